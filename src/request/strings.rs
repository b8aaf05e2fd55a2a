//! Long JSON strings parsed outside serde_json: the prompt text of a large body is one or a
//! few long strings, and serde_json unescapes them byte by byte into a scratch buffer, then
//! copies them. [`parse_with_long_strings`] instead parses a small copy of the body in which
//! each long string value is a placeholder, unescapes the long strings itself (copying the
//! runs between escapes while the scanner looks for the string's end), and puts them in place.
//!
//! Exactness: the small body has the same syntax as the original (a string replaced by a
//! string), and [`unescape`] produces serde_json's text for every string it accepts; anything
//! it does not handle (a raw control character, an unknown escape, a lone surrogate) returns
//! `None`, and so does a placeholder that is not found exactly once (a duplicate key dropped
//! it, or the body spelled one): the caller then parses the original body with serde_json,
//! which also produces the error a bad body gets.

use std::fmt::Write as _;
use std::ops::Range;

use serde_json::Value;

/// The value of four hex digits.
fn hex4(digits: &[u8]) -> Option<u32> {
    if digits.len() != 4 {
        return None;
    }
    digits.iter().try_fold(0u32, |acc, &d| {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            _ => return None,
        };
        Some(acc * 16 + u32::from(v))
    })
}

/// The character escaped at `body[i..]` (which starts with `\\`) and the escape's length;
/// `None` for what is left to serde_json (an unknown escape, a lone surrogate).
pub(crate) fn decode_escape(body: &[u8], i: usize) -> Option<(char, usize)> {
    let c = match *body.get(i + 1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let unit = hex4(body.get(i + 2..i + 6)?)?;
            return match unit {
                0xD800..=0xDBFF => {
                    if body.get(i + 6..i + 8)? != b"\\u" {
                        return None;
                    }
                    let low = hex4(body.get(i + 8..i + 12)?)?;
                    if !(0xDC00..=0xDFFF).contains(&low) {
                        return None;
                    }
                    let c = char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))?;
                    Some((c, 12))
                }
                0xDC00..=0xDFFF => None,
                _ => Some((char::from_u32(unit)?, 6)),
            };
        }
        _ => return None,
    };
    Some((c, 2))
}

/// Whether `raw` holds a control character (< 0x20), which JSON strings may not hold raw.
/// NOTE: a minimum without early exit, so that it vectorises (~4 µs for 400 KB here).
pub(crate) fn has_control(raw: &[u8]) -> bool {
    raw.iter().fold(u8::MAX, |acc, &b| acc.min(b)) < 0x20
}

/// A long string value found by the scanner.
#[derive(Debug)]
pub(crate) struct LongString {
    /// Its bytes in the body, quotes included.
    pub(crate) span: Range<usize>,
    /// Its text, or `None` when serde_json must decide (module docs).
    pub(crate) text: Option<String>,
}

/// `body` (valid UTF-8, already scanned) parsed with the `long` string values (ascending)
/// put in place as the scanner unescaped them; `None` when the caller must parse the original
/// body with serde_json instead (module docs).
pub(crate) fn parse_with_long_strings(body: &str, long: Vec<LongString>) -> Option<Value> {
    let nonce = fastrand::u64(..);
    let long_bytes: usize = long.iter().map(|l| l.span.len()).sum();
    let mut small = String::with_capacity(body.len().saturating_sub(long_bytes) + long.len() * 48);
    let mut texts = Vec::with_capacity(long.len());
    let mut at = 0;
    for (k, string) in long.into_iter().enumerate() {
        small.push_str(body.get(at..string.span.start)?);
        write!(small, "\"\\u0000kvpick-{nonce:016x}-{k}\"").ok()?;
        texts.push(Some(string.text?));
        at = string.span.end;
    }
    small.push_str(body.get(at..)?);
    let mut root: Value = serde_json::from_str(&small).ok()?;
    let marker = format!("\0kvpick-{nonce:016x}-");
    let mut restored = 0;
    if !restore(&mut root, &marker, &mut texts, &mut restored) || restored != texts.len() {
        return None;
    }
    Some(root)
}

/// Puts the texts back in place of their placeholders; false if one is seen twice.
fn restore(
    v: &mut Value,
    marker: &str,
    texts: &mut [Option<String>],
    restored: &mut usize,
) -> bool {
    match v {
        Value::String(s) => {
            let Some(k) = s.strip_prefix(marker) else {
                return true;
            };
            let Some(text) = k
                .parse::<usize>()
                .ok()
                .and_then(|k| texts.get_mut(k))
                .and_then(Option::take)
            else {
                return false;
            };
            *s = text;
            *restored += 1;
            true
        }
        Value::Array(items) => items
            .iter_mut()
            .all(|item| restore(item, marker, texts, restored)),
        Value::Object(map) => map
            .values_mut()
            .all(|item| restore(item, marker, texts, restored)),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ParseLimits;
    use crate::request::scan::scan_collecting;

    /// The scanner's unescaping of one string.
    fn unescape(raw: &str) -> Option<String> {
        let body = format!("\"{raw}\"");
        let mut found = Vec::new();
        scan_collecting(&body, ParseLimits::default(), 0, &mut found).ok()?;
        assert_eq!(found.len(), 1);
        found.pop()?.text
    }

    fn serde_string(raw: &str) -> Option<String> {
        serde_json::from_str::<String>(&format!("\"{raw}\"")).ok()
    }

    #[test]
    fn unescape_agrees_with_serde_json() {
        let cases = [
            "plain text",
            "",
            r#"a\"b\\c\/d\b\f\n\r\t"#,
            r"\u00e9\u00E9 caf\u00e9 \u4e2d\u6587",
            r"\ud83d\ude00 emoji",
            r"\u0000 nul",
            "naïve ü 한국어 👩‍👩‍👧 raw",
            r"long run of text with an escape at the end\n",
        ];
        for raw in cases {
            assert!(unescape(raw).is_some(), "{raw:?}");
            assert_eq!(unescape(raw), serde_string(raw), "{raw:?}");
        }
        // What the fast path leaves to serde_json (which rejects all of these).
        for raw in [
            r"\ud83d alone",
            r"\ude00 alone",
            r"\ud83d\u0041",
            r"\x41",
            r"\u12",
            r"\u12g4",
            "tab\there",
            "new\nline",
            r"trailing\",
        ] {
            assert_eq!(unescape(raw), None, "{raw:?}");
            assert_eq!(serde_string(raw), None, "{raw:?}");
        }
    }

    #[test]
    fn placeholders_are_restored_or_refused() {
        let long = "x\\n".repeat(50);
        let body = format!(r#"{{"a":"{long}","b":["{long}",1],"c":"short"}}"#);
        let text = "x\n".repeat(50);
        let strings: Vec<LongString> = body
            .match_indices(&format!("\"{long}\""))
            .map(|(i, m)| LongString {
                span: i..i + m.len(),
                text: Some(text.clone()),
            })
            .collect();
        assert_eq!(strings.len(), 2);
        let fast = parse_with_long_strings(&body, strings).unwrap();
        assert_eq!(fast, serde_json::from_str::<Value>(&body).unwrap());
        // A duplicate key drops a placeholder: refused, serde_json decides.
        let dup = format!(r#"{{"a":"{long}","a":1}}"#);
        let string = LongString {
            span: 5..5 + long.len() + 2,
            text: Some(text),
        };
        assert_eq!(parse_with_long_strings(&dup, vec![string]), None);
    }
}
