//! The correctness bar: for every captured request, the ids kvpick computes from the body equal
//! the ids the real vLLM 0.32 engine used (`prompt_token_ids`, from its `/tokenize`).

use crate::support::paths;

use std::path::PathBuf;
use std::sync::LazyLock;

use kvpick::request::{self, Prompt};
use kvpick::tokenize::{PromptTokens, Tokenizers, TokenizersConfig};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Loaded once per test binary (the 8 MB tokenizer.json is slow to load in debug builds).
static TOKENIZERS: LazyLock<Tokenizers> = LazyLock::new(|| {
    Tokenizers::new(
        TokenizersConfig {
            models: vec![("tiny".into(), repo().join("assets/tokenizer"))],
            prefix_cache_bytes: 64 << 20,
            ..Default::default()
        },
        &prometheus::Registry::new(),
    )
    .expect("load assets/tokenizer")
});

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("u32 id"))
        .collect()
}

#[test]
fn every_captured_request_tokenizes_like_vllm() {
    let mut checked = 0;
    for capture in [
        "vllm-0.32-kv-events",
        "vllm-0.32-kv-events-sha256cbor",
        "vllm-0.32-kv-events-bytehash",
    ] {
        let text = std::fs::read_to_string(paths::fixtures().join(capture).join("requests.jsonl"))
            .unwrap();
        for line in text.lines() {
            let rec: Value = serde_json::from_str(line).unwrap();
            let label = rec["label"].as_str().unwrap();
            let endpoint = rec["endpoint"].as_str().unwrap();
            let body = serde_json::to_vec(&rec["body"]).unwrap();
            let req = request::parse(endpoint, &body).unwrap();
            if let (Prompt::Chat(chat), Some(expected)) =
                (&req.prompt, rec["rendered_prompt"].as_str())
            {
                let tok = TOKENIZERS.tokenizer_for("tiny").unwrap();
                assert_eq!(
                    tok.render(chat).unwrap(),
                    expected,
                    "{capture}/{label}: rendered prompt"
                );
            }
            let expected = ids(&rec["prompt_token_ids"]);
            // Twice: the second run goes through the prefix cache.
            for pass in 0..2 {
                match TOKENIZERS.prompt_tokens(&req) {
                    PromptTokens::Exact(got) => {
                        assert_eq!(got, expected, "{capture}/{label} pass {pass}")
                    }
                    other => panic!("{capture}/{label}: not exact: {other:?}"),
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 24 + 7 + 7);
}

#[test]
fn shared_test_vectors_match() {
    let text =
        std::fs::read_to_string(paths::fixtures().join("tokenizer/test_vectors.jsonl")).unwrap();
    let tok = TOKENIZERS.tokenizer_for("tiny").unwrap();
    let mut n = 0;
    for line in text.lines() {
        let rec: Value = serde_json::from_str(line).unwrap();
        let s = rec["text"].as_str().unwrap();
        assert_eq!(tok.encode(s, false).unwrap().ids, ids(&rec["ids"]), "{s:?}");
        assert_eq!(tok.encode(s, true).unwrap().ids, ids(&rec["ids"]), "{s:?}");
        n += 1;
    }
    assert_eq!(n, 220);
}

#[test]
fn corpus_matches_whole_and_through_the_prefix_cache() {
    let corpus = std::fs::read_to_string(paths::fixtures().join("tokenizer/corpus.txt")).unwrap();
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(paths::fixtures().join("tokenizer/corpus.ids.json")).unwrap(),
    )
    .unwrap();
    let expected = match &expected {
        Value::Array(_) => ids(&expected),
        Value::Object(o) => ids(o.get("ids").expect("ids key")),
        _ => panic!("unexpected corpus.ids.json shape"),
    };
    let tok = TOKENIZERS.tokenizer_for("tiny").unwrap();
    // First 95% cold, then the whole corpus warm: the reused prefix must not change a token.
    let cut = (corpus.len() * 95 / 100..)
        .find(|&i| corpus.is_char_boundary(i))
        .unwrap();
    tok.encode(&corpus[..cut], false).unwrap();
    let warm = tok.encode(&corpus, false).unwrap();
    assert!(
        warm.reused_tokens > expected.len() * 9 / 10,
        "reused {}",
        warm.reused_tokens
    );
    assert_eq!(warm.ids, expected);
}
