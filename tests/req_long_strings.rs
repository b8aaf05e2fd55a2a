//! Long string values are unescaped outside serde_json (`request::strings`): whatever the
//! text and however it is escaped (serde_json's own escaping, or Python's `ensure_ascii`
//! escaping of every non-ASCII character, surrogate pairs included), the parsed request is the
//! one serde_json alone gives, and bad strings still get a 400 with a reason.

use kvpick::request::{self, MessageContent, Prompt, RequestError};
use proptest::prelude::*;

const PIECES: &[&str] = &[
    "a",
    "Hello",
    " world",
    "\n",
    "\r\n",
    "\t",
    "\"",
    "\\",
    "/",
    "\u{8}",
    "\u{c}",
    "\u{1}",
    "\u{1f}",
    "\u{7f}",
    "é",
    "한국어",
    "👩\u{200d}👩\u{200d}👧",
    "🇰🇷",
    "\u{2028}",
    "\u{fffd}",
    "{\"k\": [1, 2]}",
    "\\u0041",
    "kvpick-",
    "\0",
];

fn text_strategy(min: usize, max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(PIECES), min..max).prop_map(|p| p.concat())
}

/// JSON string literal as Python's `json.dumps` (default `ensure_ascii=True`) writes it.
fn python_ascii_literal(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn chat_texts(body: &[u8]) -> Result<Vec<String>, RequestError> {
    let req = request::parse("/v1/chat/completions", body)?;
    let Prompt::Chat(chat) = req.prompt else {
        panic!("chat")
    };
    Ok(chat
        .messages
        .into_iter()
        .map(|m| match m.content {
            MessageContent::Text(t) => t,
            other => panic!("{other:?}"),
        })
        .collect())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn long_strings_parse_as_serde_json_does(
        texts in prop::collection::vec(text_strategy(0, 900), 1..4),
        ascii in any::<bool>(),
    ) {
        let messages: Vec<String> = texts
            .iter()
            .map(|t| {
                let literal = if ascii {
                    python_ascii_literal(t)
                } else {
                    serde_json::to_string(t).unwrap()
                };
                format!(r#"{{"role": "user", "content": {literal}}}"#)
            })
            .collect();
        let body = format!(r#"{{"model": "m", "messages": [{}], "max_tokens": 3}}"#, messages.join(", "));
        prop_assert_eq!(chat_texts(body.as_bytes()).unwrap(), texts);
    }
}

#[test]
fn bad_long_strings_are_refused_like_short_ones() {
    let long = "x".repeat(5000);
    let cases = [
        (format!("{long}\u{1}{long}"), "control character"),
        (format!("{long}\\ud83d{long}"), "lone leading surrogate"),
        (format!("{long}\\ude00{long}"), "lone trailing surrogate"),
        (format!("{long}\\q{long}"), "invalid escape"),
        (format!("{long}\\u12x4{long}"), "invalid escape"),
    ];
    for (raw, what) in cases {
        let body =
            format!(r#"{{"model": "m", "messages": [{{"role": "user", "content": "{raw}"}}]}}"#);
        match chat_texts(body.as_bytes()) {
            Err(RequestError::NotJson { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    // Truncated inside a long string.
    let body = format!(r#"{{"model": "m", "messages": [{{"role": "user", "content": "{long}"#);
    assert_eq!(chat_texts(body.as_bytes()), Err(RequestError::Truncated));
    // A duplicate key replaces a long string: the last value wins, as in serde_json.
    let body = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "{long}", "content": "short"}}]}}"#
    );
    assert_eq!(
        chat_texts(body.as_bytes()).unwrap(),
        vec!["short".to_string()]
    );
    let body = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "short", "content": "{long}"}}]}}"#
    );
    assert_eq!(chat_texts(body.as_bytes()).unwrap(), vec![long.clone()]);
    // A body spelling the placeholder prefix is parsed as written.
    let body = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "\u0000kvpick-0-0"}}, {{"role": "user", "content": "{long}"}}]}}"#
    );
    assert_eq!(
        chat_texts(body.as_bytes()).unwrap(),
        vec!["\0kvpick-0-0".to_string(), long]
    );
}
