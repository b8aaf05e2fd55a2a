//! Long string values are unescaped outside serde_json (`request::strings`): whatever the
//! text and however it is escaped (serde_json's own escaping, or Python's `ensure_ascii`
//! escaping of every non-ASCII character, surrogate pairs included), the parsed request is the
//! one serde_json alone gives, and bad strings still get a 400 with a reason.

use kvpick::request::{self, LongStringCache, MessageContent, Prompt, RequestError};
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
    texts_of(request::parse("/v1/chat/completions", body)?)
}

fn chat_texts_cached(body: &[u8], cache: &LongStringCache) -> Result<Vec<String>, RequestError> {
    texts_of(request::parse_cached("/v1/chat/completions", body, cache)?)
}

/// The text of every message of a parsed chat request.
fn texts_of(req: request::InferenceRequest) -> Result<Vec<String>, RequestError> {
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// A long string that begins like one parsed before is resumed from it (its unescaped
    /// prefix copied, the rest unescaped): the result is serde_json's, whatever the cut.
    #[test]
    fn strings_resumed_from_earlier_bodies_parse_as_serde_json_does(
        base in text_strategy(10_000, 20_000),
        keep in 0.0f64..1.0,
        tail in text_strategy(0, 400),
        ascii in any::<bool>(),
        second in text_strategy(0, 50),
    ) {
        let literal = |t: &str| if ascii { python_ascii_literal(t) } else { serde_json::to_string(t).unwrap() };
        let body = |t: &str| format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": {}}}, {{"role": "user", "content": {}}}]}}"#,
            literal(t),
            literal(&second)
        );
        let cache = LongStringCache::new(64 << 20);
        let first = body(&base);
        prop_assert_eq!(chat_texts_cached(first.as_bytes(), &cache).unwrap(), chat_texts(first.as_bytes()).unwrap());
        let mut cut = (base.len() as f64 * keep) as usize;
        while !base.is_char_boundary(cut) {
            cut -= 1;
        }
        let grown = format!("{}{}", &base[..cut], tail);
        let next = body(&grown);
        prop_assert_eq!(chat_texts_cached(next.as_bytes(), &cache).unwrap(), vec![grown.clone(), second.clone()]);
        // The same body again resumes (almost) all of it.
        prop_assert_eq!(chat_texts_cached(next.as_bytes(), &cache).unwrap(), vec![grown, second]);
        if literal(&base[..cut]).len() > 40_000 {
            prop_assert!(cache.reused_bytes() > 0);
        }
    }
}

#[test]
fn a_grown_document_is_resumed_and_bad_bytes_after_the_cut_are_still_refused() {
    let cache = LongStringCache::new(8 << 20);
    // Raw JSON string content (escapes as a client sends them).
    let doc = r#"Line with \"quotes\" and a tab\t, then é and 👩‍👩‍👧.\n"#.repeat(2000);
    let body = |content: &str| {
        format!(r#"{{"model": "m", "messages": [{{"role": "user", "content": "{content}"}}]}}"#)
    };
    let first = body(&doc);
    assert_eq!(
        chat_texts_cached(first.as_bytes(), &cache).unwrap(),
        chat_texts(first.as_bytes()).unwrap()
    );
    assert_eq!(cache.len(), 1);
    let grown = body(&format!("{doc}And one more question?"));
    assert_eq!(
        chat_texts_cached(grown.as_bytes(), &cache).unwrap(),
        chat_texts(grown.as_bytes()).unwrap()
    );
    assert!(
        cache.reused_bytes() > doc.len() as u64 * 9 / 10,
        "{}",
        cache.reused_bytes()
    );
    // Mostly reused: the entry it came from stays the base.
    assert_eq!(cache.len(), 1);
    // A bad escape or a control character after the shared part: refused as without cache.
    for bad in ["\\q", "\u{1}", "\\ud83d alone"] {
        let body = body(&format!("{doc}{bad}"));
        let cached = chat_texts_cached(body.as_bytes(), &cache);
        assert_eq!(
            cached.is_err(),
            chat_texts(body.as_bytes()).is_err(),
            "{bad:?}"
        );
        assert!(cached.is_err(), "{bad:?}");
    }
    // Truncated after the shared part.
    let truncated = format!(r#"{{"model": "m", "messages": [{{"role": "user", "content": "{doc}"#);
    assert_eq!(
        chat_texts_cached(truncated.as_bytes(), &cache),
        Err(RequestError::Truncated)
    );
}
