//! An `InferencePool`'s spec, read from the API object and validated (DESIGN §6, §9).
//!
//! Both API generations are read: `inference.networking.k8s.io/v1` (`selector.matchLabels`,
//! `targetPorts[].number`) and `inference.networking.x-k8s.io/v1alpha2` (`selector` as a flat
//! label map, one `targetPortNumber`). The object comes from the API server, so it is hostile:
//! every rule the CRD's schema states is checked again here, because a CRD installed without
//! its validation (or an older one) lets anything through.

use std::collections::BTreeMap;

use serde_json::Value;

/// Most target ports a pool may have (the v1 CRD's `maxItems`).
pub const MAX_TARGET_PORTS: usize = 8;
/// Most selector labels a pool may have (the v1 CRD's `maxProperties`).
pub const MAX_SELECTOR_LABELS: usize = 64;

/// The two InferencePool API groups kvpick reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolGroup {
    /// `inference.networking.k8s.io/v1` (GIE's GA API).
    V1,
    /// `inference.networking.x-k8s.io/v1alpha2` (the pre-GA API).
    V1Alpha2,
}

impl PoolGroup {
    /// The group given to `--pool-group`, if kvpick knows it.
    pub fn from_group(group: &str) -> Option<Self> {
        match group {
            "inference.networking.k8s.io" => Some(Self::V1),
            "inference.networking.x-k8s.io" => Some(Self::V1Alpha2),
            _ => None,
        }
    }

    /// The API group.
    pub fn group(self) -> &'static str {
        match self {
            Self::V1 => "inference.networking.k8s.io",
            Self::V1Alpha2 => "inference.networking.x-k8s.io",
        }
    }

    /// The served version kvpick reads in that group.
    pub fn version(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V1Alpha2 => "v1alpha2",
        }
    }
}

/// What kvpick uses of a pool: which pods, and which ports of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Pods this selects are the pool's (a pool's `matchLabels`, or `--endpoint-selector`).
    pub selector: super::LabelSelector,
    /// Each ready pod × each port is one endpoint (several ports: data-parallel ranks).
    pub target_ports: Vec<u16>,
}

impl PoolSpec {
    /// The selector in the API's `labelSelector` syntax (`k=v,k2=v2`).
    pub fn label_selector(&self) -> String {
        self.selector.query()
    }
}

/// Why a pool's spec was rejected; `field` names the path in the object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SpecError {
    /// The JSON path of the offending field (`spec.targetPorts`, …).
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

fn fail(field: &'static str, reason: impl Into<String>) -> SpecError {
    SpecError {
        field,
        reason: reason.into(),
    }
}

/// Reads and validates the `spec` of an InferencePool of `group`.
pub fn parse_spec(group: PoolGroup, object: &Value) -> Result<PoolSpec, SpecError> {
    let spec = object
        .get("spec")
        .and_then(Value::as_object)
        .ok_or_else(|| fail("spec", "missing or not an object"))?;
    let (selector_field, labels) = match group {
        PoolGroup::V1 => (
            "spec.selector.matchLabels",
            spec.get("selector").and_then(|s| s.get("matchLabels")),
        ),
        PoolGroup::V1Alpha2 => ("spec.selector", spec.get("selector")),
    };
    let selector = parse_labels(selector_field, labels)?;
    let target_ports = match group {
        PoolGroup::V1 => parse_target_ports(spec.get("targetPorts"))?,
        PoolGroup::V1Alpha2 => vec![parse_port(
            "spec.targetPortNumber",
            spec.get("targetPortNumber"),
        )?],
    };
    Ok(PoolSpec {
        selector: super::LabelSelector::from_labels(&selector),
        target_ports,
    })
}

fn parse_labels(
    field: &'static str,
    value: Option<&Value>,
) -> Result<BTreeMap<String, String>, SpecError> {
    let map = value
        .and_then(Value::as_object)
        .ok_or_else(|| fail(field, "missing or not a map of labels"))?;
    if map.is_empty() {
        // An empty selector would select every pod of the namespace: never what a pool means.
        return Err(fail(field, "is empty"));
    }
    if map.len() > MAX_SELECTOR_LABELS {
        return Err(fail(
            field,
            format!("has {} labels (at most {MAX_SELECTOR_LABELS})", map.len()),
        ));
    }
    let mut labels = BTreeMap::new();
    for (key, value) in map {
        let value = value
            .as_str()
            .ok_or_else(|| fail(field, format!("label `{key}` is not a string")))?;
        check_label(key, value).map_err(|reason| fail(field, reason))?;
        labels.insert(key.clone(), value.to_owned());
    }
    Ok(labels)
}

/// Checks one selector label the way the API server validates labels (a key is an optional
/// DNS-subdomain prefix and `/`, then a name of at most 63 characters; a value is empty or at
/// most 63 characters; names and values begin and end alphanumeric, with `-`, `_`, `.`
/// inside); returns why not.
pub fn check_label(key: &str, value: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let prefix_fine = prefix.is_none_or(|p| {
        p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            })
    });
    if name.is_empty() || !label_name_fine(name) || !prefix_fine {
        return Err(format!("label key `{key}` is not a valid label key"));
    }
    if !value.is_empty() && !label_name_fine(value) {
        return Err(format!(
            "label `{key}` has value `{value}`, not a valid label value"
        ));
    }
    Ok(())
}

/// A label name or non-empty value: at most 63 characters, alphanumeric at both ends, `-`,
/// `_`, `.` and alphanumerics inside.
fn label_name_fine(text: &str) -> bool {
    let bytes = text.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn parse_target_ports(value: Option<&Value>) -> Result<Vec<u16>, SpecError> {
    const FIELD: &str = "spec.targetPorts";
    let list = value
        .and_then(Value::as_array)
        .ok_or_else(|| fail(FIELD, "missing or not a list"))?;
    if list.is_empty() || list.len() > MAX_TARGET_PORTS {
        return Err(fail(
            FIELD,
            format!("has {} ports (1 to {MAX_TARGET_PORTS})", list.len()),
        ));
    }
    let mut ports = Vec::with_capacity(list.len());
    for entry in list {
        let port = parse_port("spec.targetPorts[].number", entry.get("number"))?;
        if ports.contains(&port) {
            return Err(fail(FIELD, format!("port {port} is listed twice")));
        }
        ports.push(port);
    }
    Ok(ports)
}

fn parse_port(field: &'static str, value: Option<&Value>) -> Result<u16, SpecError> {
    let number = value
        .and_then(Value::as_u64)
        .ok_or_else(|| fail(field, "missing or not a port number"))?;
    match u16::try_from(number) {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(fail(field, format!("{number} is not a port (1-65535)"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_both_generations() {
        let v1 = json!({"spec": {"selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}]}});
        let spec = parse_spec(PoolGroup::V1, &v1).expect("valid");
        assert_eq!(spec.target_ports, [8000, 8001]);
        assert_eq!(spec.label_selector(), "app=vllm");
        let alpha =
            json!({"spec": {"selector": {"app": "vllm", "tier": "a"}, "targetPortNumber": 8000}});
        let spec = parse_spec(PoolGroup::V1Alpha2, &alpha).expect("valid");
        assert_eq!(spec.target_ports, [8000]);
        assert_eq!(spec.label_selector(), "app=vllm,tier=a");
    }

    #[test]
    fn hostile_specs_name_their_field() {
        let ports = |n: usize| {
            let list: Vec<Value> = (0..n).map(|i| json!({"number": 8000 + i})).collect();
            json!({"spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": list}})
        };
        for n in [0, 9] {
            let error = parse_spec(PoolGroup::V1, &ports(n)).expect_err("out of range");
            assert_eq!(error.field, "spec.targetPorts", "{error}");
        }
        let cases = [
            (json!({}), "spec"),
            (
                json!({"spec": {"targetPorts": [{"number": 1}]}}),
                "spec.selector.matchLabels",
            ),
            (
                json!({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}}),
                "spec.selector.matchLabels",
            ),
            (
                json!({"spec": {"selector": {"matchLabels": {"a": 1}}, "targetPorts": [{"number": 1}]}}),
                "spec.selector.matchLabels",
            ),
            (
                json!({"spec": {"selector": {"matchLabels": {"a": "b,c=d"}}, "targetPorts": [{"number": 1}]}}),
                "spec.selector.matchLabels",
            ),
            (
                json!({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}}),
                "spec.targetPorts[].number",
            ),
            (
                json!({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}, {"number": 1}]}}),
                "spec.targetPorts",
            ),
        ];
        for (object, field) in cases {
            let error = parse_spec(PoolGroup::V1, &object).expect_err("invalid");
            assert_eq!(error.field, field, "{object}: {error}");
        }
    }
}
