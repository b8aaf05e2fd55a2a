//! Python `json.dumps(x, ensure_ascii=False)` for template values: the `tojson` HF/vLLM
//! templates see (separators `", "` / `": "`, key order kept, no HTML escaping, Python float
//! repr), optionally with `indent`.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};

pub use crate::request::python_float_repr;

/// Serialises `value` like Python's `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub fn dumps(value: &Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_value(&mut out, value, indent, 0);
    out
}

fn newline(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
}

fn write_value(out: &mut String, value: &Value, indent: Option<usize>, level: usize) {
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String | ValueKind::Bytes => write_str(out, &value.to_string()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map(|it| it.collect()).unwrap_or_default();
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, level + 1);
                write_value(out, item, indent, level + 1);
            }
            newline(out, indent, level);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter().map(|it| it.collect()).unwrap_or_default();
            if keys.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, level + 1);
                match key.kind() {
                    ValueKind::String => write_str(out, key.as_str().unwrap_or_default()),
                    ValueKind::Bool | ValueKind::None | ValueKind::Number => {
                        let mut k = String::new();
                        write_value(&mut k, key, None, 0);
                        write_str(out, &k);
                    }
                    _ => write_str(out, &key.to_string()),
                }
                out.push_str(": ");
                let v = value.get_item(key).unwrap_or(Value::UNDEFINED);
                write_value(out, &v, indent, level + 1);
            }
            newline(out, indent, level);
            out.push('}');
        }
        _ => write_str(out, &value.to_string()),
    }
}

fn write_str(out: &mut String, s: &str) {
    // serde_json escapes exactly what Python escapes with ensure_ascii=False:
    // `"`, `\`, \n \r \t \b \f and other C0 controls as \u00XX.
    match serde_json::to_string(s) {
        Ok(q) => out.push_str(&q),
        Err(_) => out.push_str("\"\""),
    }
}

fn write_number(out: &mut String, value: &Value) {
    if !value.is_integer()
        && let Ok(f) = f64::try_from(value.clone())
    {
        out.push_str(&python_float_repr(f));
        return;
    }
    if let Ok(i) = i64::try_from(value.clone()) {
        let _ = write!(out, "{i}");
    } else if let Ok(u) = u64::try_from(value.clone()) {
        let _ = write!(out, "{u}");
    } else if let Ok(f) = f64::try_from(value.clone()) {
        out.push_str(&python_float_repr(f));
    } else {
        out.push_str(&value.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (123456789.125, "123456789.125"),
            (1e15, "1000000000000000.0"),
        ] {
            assert_eq!(python_float_repr(f), s);
        }
    }

    #[test]
    fn dumps_like_python() {
        let v = Value::from_serialize(
            serde_json::json!({"b": [1, 2.0, "é<&>'\n"], "a": null, "c": {}}),
        );
        assert_eq!(
            dumps(&v, None),
            r#"{"b": [1, 2.0, "é<&>'\n"], "a": null, "c": {}}"#
        );
        assert_eq!(
            dumps(&v, Some(2)),
            "{\n  \"b\": [\n    1,\n    2.0,\n    \"é<&>'\\n\"\n  ],\n  \"a\": null,\n  \"c\": {}\n}"
        );
    }
}
