//! Kubernetes label selectors: an InferencePool's `matchLabels`, and `--endpoint-selector` /
//! `--peer-selector` in the API's full `labelSelector` syntax, as llm-d's `--endpoint-selector`
//! takes it (`labels.Parse`): equality (`app=vllm`, `app==vllm`, `tier!=canary`), sets
//! (`env in (prod,staging)`, `env notin (dev)`) and existence (`gpu`, `!deprecated`). Not the
//! numeric `>`/`<` requirements, nor `in ()` (refused at start-up rather than read as "").
//!
//! The selector is sent to the API server (`labelSelector`), which does the filtering, and
//! checked again on every pod kvpick keeps (a stale watch can deliver pods of an old one).
//! The flags are parsed once at start-up; anything the API would reject is refused there with
//! the reason.

use std::collections::{BTreeMap, BTreeSet};

use super::pool_spec::{MAX_SELECTOR_LABELS, check_label};

/// How one requirement compares a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Operator {
    /// `key=value`: the label is present with that value.
    Equals,
    /// `key!=value`: the label is absent or has another value.
    NotEquals,
    /// `key in (a,b)`: the label is present with one of the values.
    In,
    /// `key notin (a,b)`: the label is absent or has none of the values.
    NotIn,
    /// `key`: the label is present.
    Exists,
    /// `!key`: the label is absent.
    DoesNotExist,
}

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Requirement {
    /// The label key.
    pub key: String,
    /// The comparison.
    pub operator: Operator,
    /// The values compared against (one for `=`/`!=`, none for existence).
    pub values: BTreeSet<String>,
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::Equals | Operator::In => value.is_some_and(|v| self.values.contains(v)),
            Operator::NotEquals | Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }

    fn query(&self) -> String {
        let values = self.values.iter().cloned().collect::<Vec<_>>().join(",");
        match self.operator {
            Operator::Equals => format!("{}={values}", self.key),
            Operator::NotEquals => format!("{}!={values}", self.key),
            Operator::In => format!("{} in ({values})", self.key),
            Operator::NotIn => format!("{} notin ({values})", self.key),
            Operator::Exists => self.key.clone(),
            Operator::DoesNotExist => format!("!{}", self.key),
        }
    }
}

/// A label selector: every requirement must hold (sorted, so equal selectors compare equal).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

impl LabelSelector {
    /// The selector `matchLabels` means: each label present with its value.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Self {
        Self {
            requirements: labels
                .iter()
                .map(|(key, value)| Requirement {
                    key: key.clone(),
                    operator: Operator::Equals,
                    values: BTreeSet::from([value.clone()]),
                })
                .collect(),
        }
    }

    /// Parses the API's `labelSelector` syntax; an empty selector (every pod of the
    /// namespace) is refused.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Err("is empty (it would select every pod of the namespace)".to_owned());
        }
        let mut requirements = Vec::new();
        for part in split_top_level(text)? {
            let part = part.trim();
            if part.is_empty() {
                return Err(format!("`{text}` has an empty requirement (a stray comma)"));
            }
            requirements.push(requirement(part)?);
        }
        if requirements.len() > MAX_SELECTOR_LABELS {
            return Err(format!("has more than {MAX_SELECTOR_LABELS} requirements"));
        }
        requirements.sort();
        requirements.dedup();
        Ok(Self { requirements })
    }

    /// Whether a pod with these labels is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// The selector in the API's `labelSelector` syntax.
    pub fn query(&self) -> String {
        self.requirements
            .iter()
            .map(Requirement::query)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Splits at the commas outside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' if depth == 0 => depth = 1,
            '(' => return Err(format!("`{text}` nests parentheses")),
            ')' if depth == 1 => depth = 0,
            ')' => return Err(format!("`{text}` closes a parenthesis it did not open")),
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("`{text}` leaves a parenthesis open"));
    }
    parts.push(&text[start..]);
    Ok(parts)
}

/// One requirement: `!key`, `key`, `key=v`, `key==v`, `key!=v`, `key in (…)`, `key notin (…)`.
fn requirement(part: &str) -> Result<Requirement, String> {
    let single = |key: &str, operator, value: &str| {
        let (key, value) = (key.trim(), value.trim());
        check_label(key, value)?;
        Ok(Requirement {
            key: key.to_owned(),
            operator,
            values: BTreeSet::from([value.to_owned()]),
        })
    };
    if let Some((key, value)) = part.split_once("!=") {
        return single(key, Operator::NotEquals, value);
    }
    if let Some((key, value)) = part.split_once("==") {
        return single(key, Operator::Equals, value);
    }
    if let Some((key, value)) = part.split_once('=') {
        return single(key, Operator::Equals, value);
    }
    if let Some(open) = part.find('(') {
        let head = part[..open].trim();
        let (key, operator) = if let Some(key) = head.strip_suffix(" notin") {
            (key, Operator::NotIn)
        } else if let Some(key) = head.strip_suffix(" in") {
            (key, Operator::In)
        } else {
            return Err(format!("`{part}` is not `KEY in (…)` or `KEY notin (…)`"));
        };
        let inner = part[open + 1..]
            .strip_suffix(')')
            .ok_or_else(|| format!("`{part}` has text after its closing parenthesis"))?;
        let key = key.trim();
        let mut values = BTreeSet::new();
        for value in inner.split(',').map(str::trim) {
            check_label(key, value)?;
            values.insert(value.to_owned());
        }
        if values.iter().all(String::is_empty) {
            return Err(format!("`{part}` lists no value"));
        }
        return Ok(Requirement {
            key: key.to_owned(),
            operator,
            values,
        });
    }
    let (key, operator) = match part.strip_prefix('!') {
        Some(key) => (key.trim(), Operator::DoesNotExist),
        None => (part, Operator::Exists),
    };
    if key.contains(char::is_whitespace) {
        return Err(format!("`{part}` is not a requirement"));
    }
    check_label(key, "")?;
    Ok(Requirement {
        key: key.to_owned(),
        operator,
        values: BTreeSet::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn every_form_of_requirement_parses_and_matches() {
        let selector = LabelSelector::parse(
            "app==vllm, env in (prod, staging),tier!=canary,gpu,!deprecated,zone notin (a,b)",
        )
        .expect("valid");
        assert_eq!(
            selector.query(),
            "app=vllm,!deprecated,env in (prod,staging),gpu,tier!=canary,zone notin (a,b)"
        );
        let pod = |extra: &[(&str, &str)]| {
            let mut l = labels(&[("app", "vllm"), ("env", "prod"), ("gpu", "a100")]);
            l.extend(labels(extra));
            l
        };
        assert!(selector.matches(&pod(&[])));
        assert!(selector.matches(&pod(&[("tier", "stable"), ("zone", "c")])));
        assert!(!selector.matches(&pod(&[("tier", "canary")])));
        assert!(!selector.matches(&pod(&[("deprecated", "")])));
        assert!(!selector.matches(&pod(&[("zone", "a")])));
        assert!(!selector.matches(&pod(&[("env", "dev")])));
        let mut no_gpu = pod(&[]);
        no_gpu.remove("gpu");
        assert!(!selector.matches(&no_gpu));
        // The canonical query parses to the same selector.
        assert_eq!(LabelSelector::parse(&selector.query()), Ok(selector));
    }

    #[test]
    fn keys_and_values_follow_the_apis_label_rules() {
        let name63 = "a".repeat(63);
        for good in [
            "app.kubernetes.io/name=vllm",
            "llm-d.ai/role in (decode,both)",
            "a_b.c-d=E_f.G-9",
            "app=",
        ] {
            assert!(LabelSelector::parse(good).is_ok(), "{good}");
        }
        assert!(LabelSelector::parse(&format!("{name63}=x")).is_ok());
        assert!(LabelSelector::parse(&format!("{name63}a=x")).is_err());
        assert!(LabelSelector::parse(&format!("k={name63}a")).is_err());
    }

    #[test]
    fn match_labels_are_equality_requirements() {
        let selector = LabelSelector::from_labels(&labels(&[("app", "vllm"), ("tier", "a")]));
        assert_eq!(selector.query(), "app=vllm,tier=a");
        assert_eq!(LabelSelector::parse("tier=a,app=vllm"), Ok(selector));
    }

    #[test]
    fn what_the_api_would_reject_is_refused() {
        for bad in [
            "",
            " , ",
            "app=vllm,",
            ",app=vllm",
            "app=-x",
            "app=x.",
            "-app=x",
            "Example.COM/app=x",
            "a/b/c=x",
            "app=x y",
            "a b",
            "env in prod",
            "env in (prod",
            "env in (prod))",
            "env in ((prod))",
            "env within (prod)",
            "env in ()",
            "env in (a b)",
            "bad key=x",
            "app=a/b",
            "!",
            "env in (prod) x",
        ] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad:?}");
        }
    }
}
