//! The prefix token cache never changes a token: property tests over random texts built from
//! tokenizer-hostile pieces (contractions, whitespace runs, CR/LF, digits, combining marks,
//! Hangul, emoji ZWJ sequences, special tokens and their halves, multi-byte characters that
//! share leading bytes) and random cut points, checked against full tokenization.

use std::path::PathBuf;
use std::sync::LazyLock;

use kvpick::tokenize::{ANCHOR_BYTES, ModelTokenizer, PrefixTokenCache, WordEncoder};
use proptest::prelude::*;
use tokenizers::Tokenizer;

static MODEL: LazyLock<ModelTokenizer> = LazyLock::new(|| {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer");
    ModelTokenizer::load(&dir, 8 << 20, None).expect("load assets/tokenizer")
});

fn full(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).unwrap().get_ids().to_vec()
}

const PIECES: &[&str] = &[
    "a",
    "Hello",
    " world",
    "'s",
    "'LL",
    "'",
    " ",
    "  ",
    "    ",
    "\n",
    "\r\n",
    "\n\n",
    "\t",
    "1",
    "2024",
    ".",
    "...",
    "!!",
    " ?",
    "(",
    ")",
    "{\"k\": 1}",
    "é",
    "ê",
    "e\u{301}",
    "\u{301}",
    "한국어",
    " 텍스트",
    "\u{3000}",
    "👩\u{200d}👩\u{200d}👧",
    "🇰🇷",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_",
    "_start|>",
    "\u{1c}",
    "\u{85}",
    "\u{a0}",
    "x",
    "_",
    "-",
    "ﬁ",
    "Å",
    "A\u{30a}",
];

fn text_strategy(min: usize, max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(PIECES), min..max).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Tokenize `A[..k] + B`, then `A[..k] + C` (and `A` itself): every result equals a
    /// full tokenization, whatever the cache held before.
    #[test]
    fn cached_equals_full(
        base in text_strategy(400, 900),
        b in text_strategy(0, 60),
        c in text_strategy(0, 60),
        cut in 0.0f64..1.0,
    ) {
        let tok = MODEL.tokenizer();
        // Both encoders behind the cache: the tokenizers crate, and the fast path.
        let slow = WordEncoder::new(tok, None);
        let fast = MODEL.word_encoder();
        let cache = PrefixTokenCache::new(1 << 20, 64);
        let fast_cache = PrefixTokenCache::new(1 << 20, 64);
        let mut k = (base.len() as f64 * cut) as usize;
        while !base.is_char_boundary(k) { k -= 1; }
        let first = format!("{}{}", &base[..k], b);
        let second = format!("{}{}", &base[..k], c);
        for (i, text) in [&base, &first, &second, &base].into_iter().enumerate() {
            let want = full(tok, text);
            for (enc, cache) in [(&slow, &cache), (&fast, &fast_cache)] {
                // Borrowed and owned (the cache keeps the text) inputs alternate.
                let got = if i % 2 == 0 {
                    cache.encode(enc, text).unwrap()
                } else {
                    cache.encode_owned(enc, text.to_string()).map_err(|(e, _)| e).unwrap()
                };
                prop_assert_eq!(&got.ids, &want);
                if i > 0 && k >= 1500 {
                    prop_assert!(got.reused_tokens > 0, "no reuse at k={}", k);
                }
            }
        }
    }

    /// Through the model's own cache (shared across cases): extending a text and cutting
    /// it back, including cuts inside multi-byte characters of the common prefix.
    #[test]
    fn model_cache_equals_full_across_cases(
        base in text_strategy(300, 700),
        tail in text_strategy(1, 40),
        drop in 1usize..50,
    ) {
        let tok = MODEL.tokenizer();
        let longer = format!("{base}{tail}");
        let mut shorter_end = longer.len().saturating_sub(drop);
        while !longer.is_char_boundary(shorter_end) { shorter_end -= 1; }
        for text in [&longer[..], &longer[..shorter_end], &longer[..]] {
            prop_assert_eq!(MODEL.encode(text, false).unwrap().ids, full(tok, text));
        }
    }
}

#[test]
fn long_shared_prefix_is_reused_and_memory_is_bounded() {
    let tok = MODEL.tokenizer();
    let enc = MODEL.word_encoder();
    let prefix: String = (0..400)
        .map(|i| format!("Line {i}: 한국어 텍스트 and café, naïve 'quotes' ... \n"))
        .collect();
    let cache = PrefixTokenCache::new(4 << 20, 64);
    let a = format!("{prefix}first question?");
    let b = format!("{prefix}second question, longer than the first one!");
    assert_eq!(cache.encode(&enc, &a).unwrap().reused_tokens, 0);
    let warm = cache.encode(&enc, &b).unwrap();
    assert_eq!(warm.ids, full(tok, &b));
    assert!(
        warm.reused_tokens + 40 > full(tok, &prefix).len(),
        "reused {}",
        warm.reused_tokens
    );

    // A tiny budget holds at most one such entry and never exceeds it.
    let small = PrefixTokenCache::new(prefix.len() * 3, 64);
    for i in 0..5 {
        let t = format!("{i}{prefix}");
        assert_eq!(small.encode(&enc, &t).unwrap().ids, full(tok, &t));
        assert!(small.bytes() <= prefix.len() * 3, "bytes {}", small.bytes());
    }
}

#[test]
fn entries_sharing_pieces_stay_within_the_budget() {
    let tok = MODEL.tokenizer();
    let enc = MODEL.word_encoder();
    let prefix: String = (0..300)
        .map(|i| format!("Row {i}: alpha beta, gamma; delta.\n"))
        .collect();
    let budget = prefix.len() * 4;
    let cache = PrefixTokenCache::new(budget, 64);
    for i in 0..12 {
        // Every text reuses the first one's pieces (and extends or branches off the last).
        let text = format!("{prefix}question {i} {}", "and more ".repeat(i));
        let got = cache.encode(&enc, &text).unwrap();
        assert_eq!(got.ids, full(tok, &text), "text {i}");
        if i > 0 {
            assert!(got.reused_tokens > 0, "text {i} reused nothing");
        }
        assert!(
            cache.bytes() <= budget,
            "bytes {} > {budget}",
            cache.bytes()
        );
    }
    assert!(
        cache.len() < 12,
        "nothing was evicted ({} entries)",
        cache.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    /// A growing conversation (the real prefix-cache workload): every turn's rendered prompt,
    /// tokenized through the model's cache and fast path, equals the crate's full encode.
    #[test]
    fn growing_conversation_equals_full(turns in prop::collection::vec(text_strategy(20, 200), 2..8)) {
        use kvpick::request::Prompt;
        let tok = MODEL.tokenizer();
        let mut messages = vec![serde_json::json!({"role": "system", "content": "You are terse. ".repeat(80)})];
        for (i, content) in turns.iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(serde_json::json!({"role": role, "content": content}));
            let body = serde_json::json!({"model": "tiny", "messages": messages}).to_string();
            let req = kvpick::request::parse("/v1/chat/completions", body.as_bytes()).unwrap();
            let Prompt::Chat(chat) = &req.prompt else { panic!("chat") };
            let text = MODEL.render(chat).unwrap();
            let want = full(tok, &text);
            // The owned path the registry takes for rendered chat prompts.
            let got = MODEL.encode_owned(text, false).map_err(|(e, _)| e).unwrap();
            prop_assert_eq!(got.ids, want);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]

    /// A text extended many times (more turns than an entry keeps pieces before flattening),
    /// with an occasional branch off an earlier turn: every result equals a full
    /// tokenization, and a text extending a cached one replaces it.
    #[test]
    fn long_growing_text_and_branches_equal_full(
        base in text_strategy(450, 600),
        turns in prop::collection::vec(text_strategy(1, 30), 20..30),
        branch in text_strategy(1, 30),
        at in 0usize..20,
    ) {
        let tok = MODEL.tokenizer();
        let fast = MODEL.word_encoder();
        let slow = WordEncoder::new(tok, None);
        for enc in [&fast, &slow] {
            let cache = PrefixTokenCache::new(8 << 20, 64);
            let mut text = base.clone();
            let mut history = Vec::new();
            for (i, turn) in turns.iter().enumerate() {
                text.push_str(turn);
                history.push(text.clone());
                let got = cache.encode_owned(enc, text.clone()).map_err(|(e, _)| e).unwrap();
                prop_assert_eq!(&got.ids, &full(tok, &text));
                if i > 0 && text.len() >= ANCHOR_BYTES + 500 {
                    prop_assert!(got.reused_tokens > 0, "no reuse at {} bytes", text.len());
                }
            }
            // Each turn extended the previous one, which it replaced.
            prop_assert!(cache.len() <= 1, "{} entries", cache.len());
            let forked = format!("{}{}", history[at.min(history.len() - 1)], branch);
            prop_assert_eq!(cache.encode(enc, &forked).unwrap().ids, full(tok, &forked));
            // An exact repeat of the last turn is served whole.
            let again = cache.encode(enc, &text).unwrap();
            prop_assert_eq!(&again.ids, &full(tok, &text));
        }
    }
}
