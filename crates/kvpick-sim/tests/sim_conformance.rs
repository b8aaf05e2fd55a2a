//! Conformance of the simulator's wire formats against the real vLLM 0.32 captures in
//! `../shared/fixtures/`: block hashes (sha256/pickle, sha256_cbor, byte hashes) and the
//! msgpack bytes of every captured event batch.

// The workspace's one fixture lookup (tests/support/paths.rs).
#[path = "../../../tests/support/paths.rs"]
mod paths;

use std::collections::HashSet;
use std::path::PathBuf;

use kvpick_sim::events::{EngineHash, EventBatch, EventLayout, KvEvent, event_keys};
use kvpick_sim::hashing::{HashAlgo, chain_hashes, low64};
use serde_json::Value;

use paths::fixtures;

fn jsonl(path: PathBuf) -> Vec<Value> {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture json"))
        .collect()
}

fn token_ids(request: &Value) -> Vec<u32> {
    request["prompt_token_ids"]
        .as_array()
        .expect("prompt_token_ids")
        .iter()
        .map(|v| v.as_u64().expect("token id") as u32)
        .collect()
}

fn stored_hashes(capture: &str) -> HashSet<String> {
    let mut out = HashSet::new();
    for batch in jsonl(fixtures().join(capture).join("expected.jsonl")) {
        for event in batch["events"].as_array().expect("events") {
            if event["type"] == "BlockStored" {
                for h in event["block_hashes"].as_array().expect("hashes") {
                    out.insert(h.as_str().expect("hash string").to_owned());
                }
            }
        }
    }
    out
}

/// Every prompt block of every request hashes to what vLLM computed and announced.
fn check_int_hashes(capture: &str, algo: HashAlgo) -> usize {
    let stored = stored_hashes(capture);
    let mut checked = 0;
    for request in jsonl(fixtures().join(capture).join("requests.jsonl")) {
        let ids = token_ids(&request);
        let salt = request["body"]["cache_salt"].as_str();
        let ours: Vec<String> = chain_hashes(algo, &ids, 32, salt, None)
            .iter()
            .map(|d| low64(d).to_string())
            .collect();
        let theirs: Vec<String> = request["prompt_block_hashes"]
            .as_array()
            .expect("prompt_block_hashes")
            .iter()
            .map(|v| v.as_str().expect("hash string").to_owned())
            .collect();
        assert_eq!(ours, theirs, "request {}", request["label"]);
        for h in &ours {
            assert!(stored.contains(h), "{h} was never announced");
        }
        checked += ours.len();
    }
    checked
}

#[test]
fn sha256_pickle_hashes_equal_the_real_engine() {
    assert_eq!(
        check_int_hashes("vllm-0.32-kv-events", HashAlgo::Sha256),
        435
    );
}

#[test]
fn sha256_cbor_hashes_equal_the_real_engine() {
    assert_eq!(
        check_int_hashes("vllm-0.32-kv-events-sha256cbor", HashAlgo::Sha256Cbor),
        151
    );
}

#[test]
fn full_digests_equal_the_bytehash_capture() {
    let mut checked = 0;
    for request in jsonl(fixtures().join("vllm-0.32-kv-events-bytehash/requests.jsonl")) {
        let ids = token_ids(&request);
        let salt = request["body"]["cache_salt"].as_str();
        let ours: Vec<String> = chain_hashes(HashAlgo::Sha256, &ids, 32, salt, None)
            .iter()
            .map(|d| {
                format!(
                    "bytes:{}",
                    d.iter().map(|b| format!("{b:02x}")).collect::<String>()
                )
            })
            .collect();
        let theirs: Vec<&str> = request["prompt_block_hashes_full"]
            .as_array()
            .expect("full hashes")
            .iter()
            .map(|v| v.as_str().expect("string"))
            .collect();
        assert_eq!(ours, theirs);
        checked += ours.len();
    }
    assert_eq!(checked, 151);
}

fn capture_payloads(capture: &str) -> Vec<(u64, Vec<u8>)> {
    let dir = fixtures().join(capture);
    jsonl(dir.join("expected.jsonl"))
        .iter()
        .map(|b| {
            let index = b["index"].as_u64().expect("index");
            let bytes = std::fs::read(dir.join(format!("{index:04}.msgpack"))).expect("payload");
            (index, bytes)
        })
        .collect()
}

/// Decoding a real payload and re-encoding it with the simulator's encoder gives the same bytes.
#[test]
fn encoder_reproduces_every_captured_payload_byte_for_byte() {
    let mut batches = 0;
    let mut kinds = HashSet::new();
    for capture in [
        "vllm-0.32-kv-events",
        "vllm-0.32-kv-events-sha256cbor",
        "vllm-0.32-kv-events-bytehash",
    ] {
        for (index, payload) in capture_payloads(capture) {
            let batch = EventBatch::decode(&payload).expect("decodes");
            assert_eq!(batch.data_parallel_rank, Some(0));
            for e in &batch.events {
                kinds.insert(match e {
                    KvEvent::BlockStored(s) if s.session_id.is_some() => "stored+session",
                    KvEvent::BlockStored(s) if s.parent_block_hash.is_some() => "stored+parent",
                    KvEvent::BlockStored(s)
                        if matches!(s.block_hashes.first(), Some(EngineHash::Bytes(_))) =>
                    {
                        "stored+bytes"
                    }
                    KvEvent::BlockStored(_) => "stored",
                    KvEvent::BlockRemoved { .. } => "removed",
                    KvEvent::AllBlocksCleared => "cleared",
                });
            }
            let ours = batch.encode(EventLayout::Map);
            assert_eq!(ours, payload, "{capture} batch {index}");
            assert_eq!(event_keys(&ours).ok(), event_keys(&payload).ok());
            batches += 1;
        }
    }
    assert_eq!(batches, 68 + 12 + 12);
    for kind in [
        "stored",
        "stored+parent",
        "stored+session",
        "stored+bytes",
        "removed",
    ] {
        assert!(kinds.contains(kind), "no {kind} event exercised");
    }
}

/// The replay capture's payloads (frame 3) are the live payloads, and re-encode identically.
#[test]
fn replayed_payloads_reencode_identically() {
    let dir = fixtures().join("vllm-0.32-kv-events/replay");
    let mut n = 0;
    for i in 0.. {
        let f3 = dir.join(format!("{i:04}.f3"));
        let Ok(payload) = std::fs::read(&f3) else {
            break;
        };
        let seq = std::fs::read(dir.join(format!("{i:04}.f2"))).expect("seq frame");
        if seq == [0xff; 8] {
            assert!(payload.is_empty());
            continue;
        }
        let batch = EventBatch::decode(&payload).expect("decodes");
        assert_eq!(batch.encode(EventLayout::Map), payload);
        n += 1;
    }
    assert_eq!(n, 13);
}

/// The simulator tokenizes every captured prompt (completions and chat, through the real
/// template, tools and tool calls included) to the ids vLLM's `/tokenize` returned.
#[test]
fn prompts_tokenize_to_the_real_engines_ids() {
    let dir = paths::repo_root().join("assets/tokenizer");
    let tok = kvpick_sim::tokenizer::SimTokenizer::load(&dir).expect("tokenizer");
    let mut checked = 0;
    let mut mismatched = Vec::new();
    for request in jsonl(fixtures().join("vllm-0.32-kv-events/requests.jsonl")) {
        let expected = token_ids(&request);
        let body = &request["body"];
        let ours = if let Some(prompt) = body["prompt"].as_str() {
            tok.encode_prompt(prompt).expect("encode")
        } else {
            let t = &request["tokenize_request"];
            tok.encode_chat(
                t["messages"].as_array().expect("messages"),
                t["add_generation_prompt"].as_bool().unwrap_or(true),
                t["continue_final_message"].as_bool().unwrap_or(false),
                t.get("tools"),
                t["chat_template_kwargs"].as_object(),
            )
            .expect("render")
        };
        if ours != expected {
            mismatched.push(request["label"].as_str().unwrap_or("?").to_owned());
        }
        checked += 1;
    }
    assert_eq!(checked, 24);
    assert!(mismatched.is_empty(), "mismatched: {mismatched:?}");
}
