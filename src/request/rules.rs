//! InferenceModelRewrite-style weighted model rewrite rules (DESIGN §6): a client model name
//! maps to weighted target models; one target is drawn per request.

use serde::Deserialize;

/// One weighted target of a rule.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewriteTarget {
    /// The model name written into the forwarded body.
    #[serde(rename = "modelRewrite", alias = "model")]
    pub model: String,
    /// Relative weight (0 = never picked). Defaults to 1.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

/// One `matches` entry: a plain model name, or InferenceModelRewrite's
/// `{model: {type: Exact, value: NAME}}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ModelMatch {
    /// A model name.
    Name(String),
    /// The CRD's form.
    Crd {
        /// The model matcher.
        model: ExactModel,
    },
}

impl ModelMatch {
    fn name(&self) -> &str {
        match self {
            Self::Name(name) => name,
            Self::Crd { model } => &model.value,
        }
    }
}

/// `{type: Exact, value: NAME}` (Exact is the only match type).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExactModel {
    /// Match type; only `Exact`.
    #[serde(rename = "type", default = "exact")]
    pub match_type: MatchType,
    /// The model name.
    pub value: String,
}

/// Model match types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum MatchType {
    /// The model name equals the value.
    Exact,
}

fn exact() -> MatchType {
    MatchType::Exact
}

/// One rule: requests for any model in `matches` are sent to one of `targets`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRewriteRule {
    /// Client model names this rule applies to; empty: every model (GIE's generic rule).
    pub matches: Vec<ModelMatch>,
    /// Weighted targets.
    pub targets: Vec<RewriteTarget>,
}

/// All rewrite rules; the first rule matching a model applies.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRewriteRules {
    /// The rules, in priority order.
    pub rules: Vec<ModelRewriteRule>,
}

impl ModelRewriteRules {
    /// The target for `model` given a uniformly random `roll`; `None` when no rule matches
    /// (or every weight is 0): forward the model unchanged.
    pub fn pick(&self, model: &str, roll: u64) -> Option<&str> {
        let rule = self
            .rules
            .iter()
            .find(|r| r.matches.is_empty() || r.matches.iter().any(|m| m.name() == model))?;
        let total: u64 = rule.targets.iter().map(|t| u64::from(t.weight)).sum();
        if total == 0 {
            return None;
        }
        let mut r = roll % total;
        for t in &rule.targets {
            let w = u64::from(t.weight);
            if r < w {
                return Some(&t.model);
            }
            r -= w;
        }
        None
    }

    /// [`Self::pick`] with a random roll.
    pub fn pick_random(&self, model: &str) -> Option<&str> {
        self.pick(model, fastrand::u64(..))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_split_rolls_proportionally() {
        let rules: ModelRewriteRules = serde_yaml::from_str(
            "rules:\n- matches: [m]\n  targets:\n  - {modelRewrite: a, weight: 1}\n  - {modelRewrite: z, weight: 0}\n  - {modelRewrite: b, weight: 3}\n",
        )
        .unwrap();
        let picks: Vec<_> = (0..8).map(|r| rules.pick("m", r).unwrap()).collect();
        assert_eq!(picks, ["a", "b", "b", "b", "a", "b", "b", "b"]);
        assert_eq!(rules.pick("other", 0), None);
        let crd: ModelRewriteRules = serde_yaml::from_str(
            "rules:\n- matches: [{model: {type: Exact, value: m}}]\n  targets: [{modelRewrite: a}]\n",
        )
        .unwrap();
        assert_eq!(crd.pick("m", 7), Some("a"));
        let generic: ModelRewriteRules = serde_yaml::from_str(
            "rules:\n- matches: [m]\n  targets: [{modelRewrite: a}]\n- matches: []\n  targets: [{modelRewrite: z}]\n",
        )
        .unwrap();
        assert_eq!(generic.pick("m", 0), Some("a"));
        assert_eq!(
            generic.pick("anything", 0),
            Some("z"),
            "an empty matches list matches all"
        );
        assert!(
            serde_yaml::from_str::<ModelRewriteRules>(
                "rules:\n- matches: [m]\n  targets: [{modelRewrite: a, wieght: 2}]\n"
            )
            .is_err(),
            "typos are errors"
        );
    }
}
