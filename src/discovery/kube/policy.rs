//! InferenceObjective and InferenceModelRewrite objects from the API: which of them name our
//! pool, checked as hostile input, and merged with the flag/file values into what the
//! request path uses.
//!
//! Both API groups carry the same `v1alpha2` shapes: `llm-d.ai` (where llm-d moved them) and
//! the older `inference.networking.x-k8s.io`. An object names our pool when its
//! `spec.poolRef.name` is the pool's name and `spec.poolRef.group` (default
//! `inference.networking.k8s.io`) is the pool's group, as llm-d's reconcilers filter.

use std::collections::{BTreeMap, HashMap};

use kube::api::DynamicObject;
use serde_json::Value;

use crate::request::{ModelMatch, ModelRewriteRule, ModelRewriteRules, RewriteTarget};

/// The group `spec.poolRef.group` means when it is empty or absent.
pub const DEFAULT_POOL_REF_GROUP: &str = "inference.networking.k8s.io";
/// Rules one InferenceModelRewrite may hold (more: the object is rejected).
pub const MAX_RULES: usize = 256;
/// Matches or targets one rule may hold.
pub const MAX_RULE_ITEMS: usize = 64;
/// Longest model name accepted in a match or a target.
pub const MAX_MODEL_NAME: usize = 1024;
/// Largest target weight (GIE's bound).
pub const MAX_WEIGHT: i64 = 1_000_000;

/// The two kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyKind {
    /// `InferenceObjective` (`inferenceobjectives`).
    Objective,
    /// `InferenceModelRewrite` (`inferencemodelrewrites`).
    Rewrite,
}

impl PolicyKind {
    /// The Kind.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Objective => "InferenceObjective",
            Self::Rewrite => "InferenceModelRewrite",
        }
    }

    /// The resource's plural.
    pub fn plural(self) -> &'static str {
        match self {
            Self::Objective => "inferenceobjectives",
            Self::Rewrite => "inferencemodelrewrites",
        }
    }
}

/// The two API groups, in precedence order (an object of the same name in `llm-d.ai` wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyGroup {
    /// The older `inference.networking.x-k8s.io` (GIE before the move).
    Legacy,
    /// `llm-d.ai`.
    LlmD,
}

impl PolicyGroup {
    /// Both groups.
    pub const ALL: [PolicyGroup; 2] = [PolicyGroup::LlmD, PolicyGroup::Legacy];

    /// The API group.
    pub fn group(self) -> &'static str {
        match self {
            Self::LlmD => "llm-d.ai",
            Self::Legacy => "inference.networking.x-k8s.io",
        }
    }

    /// The version both groups serve.
    pub fn version(self) -> &'static str {
        "v1alpha2"
    }
}

/// Our pool, as objects must name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    /// The pool's name.
    pub name: String,
    /// The pool's API group.
    pub group: String,
}

/// Why an object was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct Invalid {
    /// The field, from a fixed set (a metric label): `spec`, `spec.poolRef`, `spec.priority`,
    /// `spec.rules`, `spec.rules.matches`, `spec.rules.targets`.
    pub field: &'static str,
    /// What is wrong, naming the rule's index where there is one (for the log line).
    pub reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Invalid {
    Invalid {
        field,
        reason: reason.into(),
    }
}

/// A checked InferenceModelRewrite that names our pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiRewrite {
    /// `metadata.creationTimestamp` (older wins ties); absent sorts first.
    pub created: Option<k8s_openapi::jiff::Timestamp>,
    /// Its rules, in list order.
    pub rules: Vec<ModelRewriteRule>,
}

fn spec(object: &DynamicObject) -> Result<&serde_json::Map<String, Value>, Invalid> {
    object
        .data
        .get("spec")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("spec", "missing or not an object"))
}

/// Whether `spec.poolRef` names `pool` (an error when it is missing or malformed).
fn names_pool(spec: &serde_json::Map<String, Value>, pool: &PoolRef) -> Result<bool, Invalid> {
    let pool_ref = spec
        .get("poolRef")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("spec.poolRef", "missing or not an object"))?;
    let name = pool_ref
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| invalid("spec.poolRef", "name is missing or not a string"))?;
    let group = match pool_ref.get("group") {
        None | Some(Value::Null) => DEFAULT_POOL_REF_GROUP,
        Some(Value::String(g)) if g.is_empty() => DEFAULT_POOL_REF_GROUP,
        Some(Value::String(g)) => g.as_str(),
        Some(_) => return Err(invalid("spec.poolRef", "group is not a string")),
    };
    if let Some(kind) = pool_ref.get("kind").filter(|k| !k.is_null())
        && kind
            .as_str()
            .is_some_and(|k| !k.is_empty() && k != "InferencePool")
    {
        return Ok(false);
    }
    Ok(name == pool.name && group == pool.group)
}

/// An InferenceObjective's priority; `Ok(None)` when it names another pool. An absent
/// priority is 0 (as llm-d treats it).
pub fn parse_objective(object: &DynamicObject, pool: &PoolRef) -> Result<Option<i32>, Invalid> {
    let spec = spec(object)?;
    if !names_pool(spec, pool)? {
        return Ok(None);
    }
    let priority = match spec.get("priority") {
        None | Some(Value::Null) => 0,
        Some(value) => value
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| invalid("spec.priority", format!("{value} is not a 32-bit integer")))?,
    };
    Ok(Some(priority))
}

/// An InferenceModelRewrite's rules; `Ok(None)` when it names another pool.
pub fn parse_rewrite(
    object: &DynamicObject,
    pool: &PoolRef,
) -> Result<Option<ApiRewrite>, Invalid> {
    let spec = spec(object)?;
    if !names_pool(spec, pool)? {
        return Ok(None);
    }
    let rules = match spec.get("rules") {
        None | Some(Value::Null) => &Vec::new(),
        Some(Value::Array(rules)) => rules,
        Some(_) => return Err(invalid("spec.rules", "not a list")),
    };
    if rules.len() > MAX_RULES {
        return Err(invalid(
            "spec.rules",
            format!("{} rules (at most {MAX_RULES})", rules.len()),
        ));
    }
    let rules = rules
        .iter()
        .enumerate()
        .map(|(i, rule)| parse_rule(i, rule))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(ApiRewrite {
        created: object
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|time| time.0),
        rules,
    }))
}

fn list<'a>(
    rule: &'a Value,
    key: &str,
    field: &'static str,
    index: usize,
) -> Result<&'a [Value], Invalid> {
    match rule.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) if items.len() <= MAX_RULE_ITEMS => Ok(items),
        Some(Value::Array(items)) => Err(invalid(
            field,
            format!(
                "rule {index}: {} items (at most {MAX_RULE_ITEMS})",
                items.len()
            ),
        )),
        Some(_) => Err(invalid(field, format!("rule {index}: not a list"))),
    }
}

fn model_name(value: Option<&Value>) -> Option<String> {
    value
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty() && n.len() <= MAX_MODEL_NAME)
        .map(str::to_owned)
}

fn parse_rule(index: usize, rule: &Value) -> Result<ModelRewriteRule, Invalid> {
    if !rule.is_object() {
        return Err(invalid(
            "spec.rules",
            format!("rule {index}: not an object"),
        ));
    }
    let field = "spec.rules.matches";
    let mut matches = Vec::new();
    for item in list(rule, "matches", field, index)? {
        let model = item
            .get("model")
            .ok_or_else(|| invalid(field, format!("rule {index}: a match without `model`")))?;
        match model
            .get("type")
            .and_then(|t| if t.is_null() { None } else { Some(t) })
        {
            None => {}
            Some(Value::String(t)) if t == "Exact" => {}
            Some(other) => {
                return Err(invalid(
                    field,
                    format!("rule {index}: match type {other} (only Exact)"),
                ));
            }
        }
        let value = model_name(model.get("value")).ok_or_else(|| {
            invalid(
                field,
                format!(
                    "rule {index}: model value empty, not a string or over {MAX_MODEL_NAME} bytes"
                ),
            )
        })?;
        matches.push(ModelMatch::Name(value));
    }
    let field = "spec.rules.targets";
    let targets = list(rule, "targets", field, index)?;
    let weighted = targets
        .iter()
        .filter(|t| t.get("weight").is_some_and(|w| !w.is_null()))
        .count();
    if weighted != 0 && weighted != targets.len() {
        return Err(invalid(
            field,
            format!("rule {index}: a weight is set on some targets but not all"),
        ));
    }
    let targets = targets
        .iter()
        .map(|target| {
            let model = model_name(target.get("modelRewrite")).ok_or_else(|| {
                invalid(
                    field,
                    format!("rule {index}: modelRewrite empty, not a string or over {MAX_MODEL_NAME} bytes"),
                )
            })?;
            let weight = match target.get("weight") {
                None | Some(Value::Null) => 1,
                Some(w) => w
                    .as_i64()
                    .filter(|w| (1..=MAX_WEIGHT).contains(w))
                    .and_then(|w| u32::try_from(w).ok())
                    .ok_or_else(|| {
                        invalid(
                            field,
                            format!("rule {index}: weight {w} is not 1 to {MAX_WEIGHT}"),
                        )
                    })?,
            };
            Ok(RewriteTarget { model, weight })
        })
        .collect::<Result<Vec<_>, Invalid>>()?;
    Ok(ModelRewriteRule { matches, targets })
}

/// Objective priorities: the flags' (`--objective`), overridden by API objects of the same
/// name; of two API objects with one name, the `llm-d.ai` one wins.
pub fn merge_objectives(
    flags: &HashMap<String, i32>,
    api: &BTreeMap<(PolicyGroup, String), i32>,
) -> HashMap<String, i32> {
    let mut merged = flags.clone();
    // BTreeMap order: Legacy before LlmD, so LlmD overwrites.
    for ((_, name), priority) in api {
        merged.insert(name.clone(), *priority);
    }
    merged
}

/// Rewrite rules with GIE's precedence: exact-match rules before generic ones (an empty
/// `matches`), and among API objects the oldest first (then by name, then `llm-d.ai`
/// before the older group), rules of one object in list order. The file's rules
/// (`--model-rewrites`) come after the API's of the same class: an API exact rule beats a
/// file exact rule, a file exact rule beats an API generic one.
pub fn merge_rewrites(
    file: &ModelRewriteRules,
    api: &BTreeMap<(PolicyGroup, String), ApiRewrite>,
) -> ModelRewriteRules {
    let mut objects: Vec<(&(PolicyGroup, String), &ApiRewrite)> = api.iter().collect();
    objects.sort_by(|(ka, a), (kb, b)| {
        a.created
            .cmp(&b.created)
            .then_with(|| ka.1.cmp(&kb.1))
            .then_with(|| kb.0.cmp(&ka.0))
    });
    let api_rules = || objects.iter().flat_map(|(_, r)| r.rules.iter());
    let generic = |rule: &&ModelRewriteRule| rule.matches.is_empty();
    let rules = api_rules()
        .filter(|r| !generic(r))
        .chain(file.rules.iter().filter(|r| !generic(r)))
        .chain(api_rules().filter(generic))
        .chain(file.rules.iter().filter(generic))
        .cloned()
        .collect();
    ModelRewriteRules { rules }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool() -> PoolRef {
        PoolRef {
            name: "pool".to_owned(),
            group: DEFAULT_POOL_REF_GROUP.to_owned(),
        }
    }

    fn object(spec: Value, created: Option<&str>) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "llm-d.ai/v1alpha2", "kind": "X",
            "metadata": {"name": "o", "creationTimestamp": created},
            "spec": spec,
        }))
        .expect("object")
    }

    #[test]
    fn objectives_name_the_pool_by_name_and_group() {
        let ours = object(json!({"poolRef": {"name": "pool"}, "priority": 10}), None);
        assert_eq!(parse_objective(&ours, &pool()), Ok(Some(10)));
        let other = object(json!({"poolRef": {"name": "other"}, "priority": 10}), None);
        assert_eq!(parse_objective(&other, &pool()), Ok(None));
        let other_group = object(
            json!({"poolRef": {"name": "pool", "group": "inference.networking.x-k8s.io"}}),
            None,
        );
        assert_eq!(parse_objective(&other_group, &pool()), Ok(None));
        let unset = object(json!({"poolRef": {"name": "pool", "group": ""}}), None);
        assert_eq!(parse_objective(&unset, &pool()), Ok(Some(0)));
    }

    #[test]
    fn hostile_objectives_name_the_field() {
        for (spec, field) in [
            (
                json!({"poolRef": {"name": "pool"}, "priority": 1_u64 << 40}),
                "spec.priority",
            ),
            (
                json!({"poolRef": {"name": "pool"}, "priority": "high"}),
                "spec.priority",
            ),
            (
                json!({"poolRef": {"name": "pool"}, "priority": 1.5}),
                "spec.priority",
            ),
            (json!({"priority": 1}), "spec.poolRef"),
            (json!({"poolRef": {"name": 7}}), "spec.poolRef"),
            (json!("nope"), "spec"),
        ] {
            let error = parse_objective(&object(spec.clone(), None), &pool()).expect_err("invalid");
            assert_eq!(error.field, field, "{spec}");
        }
    }

    #[test]
    fn rewrites_parse_the_crd_shape_and_reject_bad_rules() {
        let good = object(
            json!({"poolRef": {"name": "pool"}, "rules": [
                {"matches": [{"model": {"type": "Exact", "value": "alias"}}],
                 "targets": [{"modelRewrite": "a", "weight": 1}, {"modelRewrite": "b", "weight": 3}]},
                {"targets": [{"modelRewrite": "fallback"}]}]}),
            Some("2026-01-01T00:00:00Z"),
        );
        let parsed = parse_rewrite(&good, &pool()).expect("valid").expect("ours");
        assert_eq!(parsed.rules.len(), 2);
        assert_eq!(parsed.rules[0].targets[1].weight, 3);
        assert!(parsed.rules[1].matches.is_empty());
        assert!(parsed.created.is_some());
        let rule = |r: Value| object(json!({"poolRef": {"name": "pool"}, "rules": [r]}), None);
        for (bad, field) in [
            (
                json!({"targets": [{"modelRewrite": "a", "weight": 0}]}),
                "spec.rules.targets",
            ),
            (
                json!({"targets": [{"modelRewrite": "a", "weight": 2_000_000}]}),
                "spec.rules.targets",
            ),
            (
                json!({"targets": [{"modelRewrite": "a", "weight": 2}, {"modelRewrite": "b"}]}),
                "spec.rules.targets",
            ),
            (
                json!({"targets": [{"modelRewrite": ""}]}),
                "spec.rules.targets",
            ),
            (json!({"targets": [{"weight": 1}]}), "spec.rules.targets"),
            (
                json!({"matches": [{"model": {"type": "Prefix", "value": "a"}}]}),
                "spec.rules.matches",
            ),
            (
                json!({"matches": [{"model": {"value": ""}}]}),
                "spec.rules.matches",
            ),
            (json!({"matches": [{}]}), "spec.rules.matches"),
            (json!({"matches": "a"}), "spec.rules.matches"),
            (
                json!({"targets": vec![json!({"modelRewrite": "a"}); MAX_RULE_ITEMS + 1]}),
                "spec.rules.targets",
            ),
            (json!(3), "spec.rules"),
        ] {
            let error = parse_rewrite(&rule(bad.clone()), &pool()).expect_err("invalid");
            assert_eq!(error.field, field, "{bad}");
        }
        let many = object(
            json!({"poolRef": {"name": "pool"}, "rules": vec![json!({}); MAX_RULES + 1]}),
            None,
        );
        assert_eq!(
            parse_rewrite(&many, &pool()).expect_err("too many").field,
            "spec.rules"
        );
    }

    fn rewrite(created: &str, rules: Vec<(Vec<&str>, &str)>) -> ApiRewrite {
        ApiRewrite {
            created: Some(created.parse().expect("timestamp")),
            rules: rules
                .into_iter()
                .map(|(matches, target)| ModelRewriteRule {
                    matches: matches
                        .into_iter()
                        .map(|m| ModelMatch::Name(m.to_owned()))
                        .collect(),
                    targets: vec![RewriteTarget {
                        model: target.to_owned(),
                        weight: 1,
                    }],
                })
                .collect(),
        }
    }

    #[test]
    fn rewrite_precedence_is_exact_then_oldest_then_the_file_then_generic() {
        let mut api = BTreeMap::new();
        api.insert(
            (PolicyGroup::LlmD, "newer".to_owned()),
            rewrite(
                "2026-02-01T00:00:00Z",
                vec![(vec!["m"], "newer-m"), (vec![], "newer-any")],
            ),
        );
        api.insert(
            (PolicyGroup::Legacy, "older".to_owned()),
            rewrite(
                "2026-01-01T00:00:00Z",
                vec![(vec![], "older-any"), (vec!["m", "n"], "older-m")],
            ),
        );
        let file: ModelRewriteRules = serde_yaml::from_str(
            "rules:\n- matches: [f, m]\n  targets: [{modelRewrite: file-f}]\n- matches: []\n  targets: [{modelRewrite: file-any}]\n",
        )
        .expect("file");
        let merged = merge_rewrites(&file, &api);
        assert_eq!(merged.pick("m", 0), Some("older-m"), "oldest exact");
        assert_eq!(merged.pick("n", 0), Some("older-m"));
        assert_eq!(
            merged.pick("f", 0),
            Some("file-f"),
            "file exact beats API generic"
        );
        assert_eq!(merged.pick("x", 0), Some("older-any"), "oldest generic");
        api.clear();
        assert_eq!(merge_rewrites(&file, &api).pick("x", 0), Some("file-any"));
    }

    #[test]
    fn api_objectives_override_flags_and_llm_d_wins_a_name_clash() {
        let flags = HashMap::from([("batch".to_owned(), -1), ("keep".to_owned(), 3)]);
        let api = BTreeMap::from([
            ((PolicyGroup::LlmD, "batch".to_owned()), 5),
            ((PolicyGroup::Legacy, "batch".to_owned()), 7),
        ]);
        let merged = merge_objectives(&flags, &api);
        assert_eq!(merged.get("batch"), Some(&5));
        assert_eq!(merged.get("keep"), Some(&3));
    }
}
