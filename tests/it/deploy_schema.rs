//! Checks for the deploy tests: a Kubernetes object against its k8s-openapi type with no
//! unknown field, and a custom resource against a CRD's structural `openAPIV3Schema`.
//!
//! k8s-openapi's types ignore fields they do not know, so [`typed`] round-trips the object
//! through the type and reports every field of the input the output lost: a typo
//! (`readOnlyRootFilesytem`) or a field in the wrong place is dropped by the type and caught.
//! [`against_schema`] walks the subset of OpenAPI v3 a structural CRD schema uses: `type`,
//! `properties` (any other field is unknown unless `additionalProperties` or
//! `x-kubernetes-preserve-unknown-fields` allows it), `required`, `enum`, `items`, and the
//! numeric, length, item and property bounds.
//!
//! NOTE: `pattern` and CEL rules (`x-kubernetes-validations`) are not evaluated (that needs a
//! regex engine and CEL, new dependencies); they are checked by hand where the manifests use
//! them (tests in deploy_manifests.rs).

use serde_json::Value;

/// Every way `object` does not survive a round trip through `T` (empty: it is a valid `T`
/// with no unknown field).
pub fn typed<T>(object: &Value) -> Vec<String>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let parsed: T = match serde_json::from_value(object.clone()) {
        Ok(parsed) => parsed,
        Err(error) => return vec![format!("does not parse: {error}")],
    };
    let back = serde_json::to_value(&parsed).expect("a typed object serializes");
    let mut lost = Vec::new();
    survives(object, &back, "", &mut lost);
    lost
}

fn survives(original: &Value, back: &Value, path: &str, lost: &mut Vec<String>) {
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                match b.get(key) {
                    Some(other) => survives(value, other, &format!("{path}.{key}"), lost),
                    // An empty map or list the type leaves out says nothing either way.
                    None if is_empty(value) => {}
                    None => lost.push(format!("{path}.{key}: unknown field")),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                survives(x, y, &format!("{path}[{i}]"), lost);
            }
        }
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
        (a, b) if a == b => {}
        (a, b) => lost.push(format!("{path}: {a} came back as {b}")),
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Object(map) => map.is_empty(),
        Value::Array(list) => list.is_empty(),
        Value::Null => true,
        _ => false,
    }
}

/// Every way `value` breaks `schema` (empty: it conforms).
pub fn against_schema(value: &Value, schema: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    walk(value, schema, "", &mut errors);
    errors
}

fn walk(value: &Value, schema: &Value, path: &str, errors: &mut Vec<String>) {
    let mut fail = |what: String| errors.push(format!("{}: {what}", path_or_root(path)));
    if let Some(kind) = schema.get("type").and_then(Value::as_str) {
        let ok = match kind {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            _ => true,
        };
        if !ok {
            fail(format!("{value} is not of type {kind}"));
            return;
        }
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array)
        && !options.contains(value)
    {
        fail(format!("{value} is not one of {options:?}"));
    }
    let bound = |key: &str| schema.get(key).and_then(Value::as_f64);
    if let Some(n) = value.as_f64()
        && (bound("minimum").is_some_and(|min| n < min)
            || bound("maximum").is_some_and(|max| n > max))
    {
        fail(format!("{n} is out of bounds"));
    }
    let sized = match value {
        Value::String(s) => Some((s.chars().count(), "minLength", "maxLength")),
        Value::Array(a) => Some((a.len(), "minItems", "maxItems")),
        Value::Object(o) => Some((o.len(), "minProperties", "maxProperties")),
        _ => None,
    };
    if let Some((len, min, max)) = sized {
        let len = len as f64;
        if bound(min).is_some_and(|m| len < m) || bound(max).is_some_and(|m| len > m) {
            fail(format!("size {len} breaks {min}/{max}"));
        }
    }
    match value {
        Value::Object(map) => {
            for key in schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                if !map.contains_key(key) {
                    errors.push(format!(
                        "{}: missing required field {key}",
                        path_or_root(path)
                    ));
                }
            }
            let properties = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties");
            let preserve = schema
                .get("x-kubernetes-preserve-unknown-fields")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            for (key, child) in map {
                let child_path = format!("{path}.{key}");
                match (properties.and_then(|p| p.get(key)), additional) {
                    (Some(child_schema), _) => walk(child, child_schema, &child_path, errors),
                    (None, Some(Value::Object(child_schema))) => walk(
                        child,
                        &Value::Object(child_schema.clone()),
                        &child_path,
                        errors,
                    ),
                    (None, Some(Value::Bool(true))) => {}
                    // metadata and other open objects (`type: object` without properties).
                    (None, _) if preserve || properties.is_none() && additional.is_none() => {}
                    (None, _) => errors.push(format!("{child_path}: unknown field")),
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    walk(item, item_schema, &format!("{path}[{i}]"), errors);
                }
            }
        }
        _ => {}
    }
}

fn path_or_root(path: &str) -> &str {
    if path.is_empty() { "(root)" } else { path }
}

#[test]
fn the_checks_catch_typos_and_misplaced_fields() {
    use k8s_openapi::api::core::v1::Service;
    let good = serde_json::json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a"},
        "spec": {"ports": [{"port": 9002, "targetPort": "grpc"}]}});
    assert_eq!(typed::<Service>(&good), Vec::<String>::new());
    let typo = serde_json::json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a"},
        "spec": {"ports": [{"port": 9002, "targetPrt": "grpc"}]}});
    assert_eq!(
        typed::<Service>(&typo),
        vec![".spec.ports[0].targetPrt: unknown field"]
    );
    let schema = serde_json::json!({"type": "object", "required": ["spec"], "properties": {
        "metadata": {"type": "object"},
        "spec": {"type": "object", "properties": {
            "ports": {"type": "array", "maxItems": 1, "items": {"type": "object", "properties": {
                "number": {"type": "integer", "minimum": 1}}}},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}}});
    let fine = serde_json::json!({"metadata": {"anything": 1}, "spec": {"ports": [{"number": 1}], "labels": {"a": "b"}}});
    assert_eq!(against_schema(&fine, &schema), Vec::<String>::new());
    let bad =
        serde_json::json!({"spec": {"ports": [{"number": 0, "nmber": 1}, {}], "labels": {"a": 1}}});
    assert_eq!(
        against_schema(&bad, &schema),
        vec![
            ".spec.ports: size 2 breaks minItems/maxItems",
            ".spec.ports[0].number: 0 is out of bounds",
            ".spec.ports[0].nmber: unknown field",
            ".spec.labels.a: 1 is not of type string",
        ]
    );
    assert_eq!(
        against_schema(&serde_json::json!({}), &schema),
        vec!["(root): missing required field spec"]
    );
}
