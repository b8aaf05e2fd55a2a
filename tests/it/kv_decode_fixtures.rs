//! Golden test: every payload captured from a real vLLM 0.32 engine decodes to exactly what
//! the fixture's `expected.jsonl` (decoded without a schema) says.

use crate::support::paths;

use std::path::Path;

use kvpick::kvevents::{
    EngineHash, KvEvent, Tier, decode_payload, decode_seq, parse_topic, split_frames,
};
use serde_json::Value as Json;

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn expected_hash(value: &Json) -> EngineHash {
    let text = value.as_str().expect("hash as string");
    if let Some(hex) = text.strip_prefix("bytes:") {
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let tail: [u8; 8] = bytes[bytes.len() - 8..].try_into().unwrap();
        EngineHash(u64::from_be_bytes(tail))
    } else {
        EngineHash(text.parse().expect("decimal hash"))
    }
}

fn tier_of(value: Option<&Json>) -> Tier {
    Tier::from_medium(value.and_then(Json::as_str))
}

/// Compares one decoded payload with one expected.jsonl record; returns the number of events.
fn check_batch(payload: &[u8], expected: &Json, what: &str) -> usize {
    let batch = decode_payload(payload).unwrap_or_else(|e| panic!("{what}: {e}"));
    // serde_json's default float parsing is not round-trip exact in the last ulp.
    let ts = expected["ts"].as_f64().unwrap();
    assert!(
        (batch.ts - ts).abs() < 1e-6,
        "{what} ts {} vs {ts}",
        batch.ts
    );
    assert_eq!(
        batch.dp_rank,
        expected["data_parallel_rank"].as_i64(),
        "{what} dp rank"
    );
    let events = expected["events"].as_array().unwrap();
    assert_eq!(batch.events.len(), events.len(), "{what} event count");
    for (got, want) in batch.events.iter().zip(events) {
        match (got, want["type"].as_str().unwrap()) {
            (KvEvent::BlockStored(s), "BlockStored") => {
                let hashes: Vec<EngineHash> = want["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(expected_hash)
                    .collect();
                assert_eq!(s.block_hashes, hashes, "{what} hashes");
                let parent = match &want["parent_block_hash"] {
                    Json::Null => None,
                    v => Some(expected_hash(v)),
                };
                assert_eq!(s.parent_block_hash, parent, "{what} parent");
                let tokens: Vec<u32> = want["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                assert_eq!(s.token_ids, tokens, "{what} tokens");
                assert_eq!(
                    s.block_size.map(u64::from),
                    want["block_size"].as_u64(),
                    "{what} block size"
                );
                assert_eq!(s.lora_id, want["lora_id"].as_i64());
                assert_eq!(s.lora_name.as_deref(), want["lora_name"].as_str());
                assert_eq!(s.tier, tier_of(want.get("medium")));
                assert_eq!(s.group_idx, want["group_idx"].as_i64());
                let extra = want["extra_keys"].as_array().unwrap();
                // One entry per block, or none when no block has any (all nil).
                assert!(
                    s.extra.is_empty() || s.extra.len() == extra.len(),
                    "{what} extra keys"
                );
                for (i, want) in extra.iter().enumerate() {
                    let got = s.extra.get(i).cloned().unwrap_or_default();
                    let salt = if i == 0 {
                        want.as_array()
                            .and_then(|a| a.last())
                            .and_then(Json::as_str)
                    } else {
                        None
                    };
                    assert_eq!(got.cache_salt.as_deref(), salt, "{what} salt");
                    assert_eq!(got.opaque, None, "{what} opaque extra");
                }
            }
            (KvEvent::BlockRemoved(r), "BlockRemoved") => {
                let hashes: Vec<EngineHash> = want["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(expected_hash)
                    .collect();
                assert_eq!(r.block_hashes, hashes, "{what} removed hashes");
                assert_eq!(r.tier, tier_of(want.get("medium")));
                assert_eq!(r.group_idx, want["group_idx"].as_i64());
            }
            (KvEvent::AllBlocksCleared { .. }, "AllBlocksCleared") => {}
            (got, want) => panic!("{what}: decoded {got:?}, expected {want}"),
        }
    }
    events.len()
}

fn check_capture(dir: &Path) -> (usize, usize) {
    let expected = std::fs::read_to_string(dir.join("expected.jsonl")).unwrap();
    let mut batches = 0;
    let mut events = 0;
    for line in expected.lines().filter(|l| !l.trim().is_empty()) {
        let want: Json = serde_json::from_str(line).unwrap();
        let index = want["index"].as_u64().unwrap();
        let base = dir.join(format!("{index:04}"));
        let topic = read(&base.with_extension("topic"));
        let seq = read(&base.with_extension("seq"));
        let payload = read(&base.with_extension("msgpack"));
        let frames: [&[u8]; 3] = [&topic, &seq, &payload];
        let raw = split_frames(&frames).unwrap();
        assert_eq!(raw.seq, want["seq"].as_u64().unwrap());
        let parsed = parse_topic(raw.topic).unwrap();
        assert_eq!(
            format!("kv@{}@{}", parsed.pod, parsed.model),
            want["topic"].as_str().unwrap()
        );
        events += check_batch(raw.payload, &want, &format!("{} #{index}", dir.display()));
        batches += 1;
    }
    (batches, events)
}

fn check_replay(dir: &Path) -> usize {
    let expected = std::fs::read_to_string(dir.join("replay.jsonl")).unwrap();
    let mut replies = 0;
    let mut saw_end = false;
    for line in expected.lines().filter(|l| !l.trim().is_empty()) {
        let want: Json = serde_json::from_str(line).unwrap();
        let index = want["index"].as_u64().unwrap();
        let frame = |n: u32| read(&dir.join(format!("{index:04}.f{n}")));
        assert!(frame(0).is_empty(), "delimiter frame");
        let seq = decode_seq(&frame(2)).unwrap();
        if want["end_marker"].as_bool() == Some(true) {
            assert_eq!(seq, u64::MAX);
            assert!(frame(1).is_empty() && frame(3).is_empty());
            saw_end = true;
            continue;
        }
        assert_eq!(seq, want["seq"].as_u64().unwrap());
        check_batch(&frame(3), &want, &format!("{} #{index}", dir.display()));
        replies += 1;
    }
    assert!(saw_end, "{}: no end marker", dir.display());
    replies
}

#[test]
fn main_capture_decodes_exactly() {
    let dir = paths::fixtures().join("vllm-0.32-kv-events");
    let (batches, events) = check_capture(&dir);
    // Totals from the fixture README: 68 batches, 55 BlockStored + 241 BlockRemoved.
    assert_eq!((batches, events), (68, 55 + 241));
    assert_eq!(check_replay(&dir.join("replay")), 13);
    assert!(check_replay(&dir.join("replay-tail-from-33")) > 0);
    let (after, _) = check_capture(&dir.join("restart/after"));
    assert_eq!(after, 3);
    let (watched, _) = check_capture(&dir.join("restart/watcher"));
    assert_eq!(watched, 4);
}

#[test]
fn cbor_and_bytehash_captures_decode_exactly() {
    for name in [
        "vllm-0.32-kv-events-sha256cbor",
        "vllm-0.32-kv-events-bytehash",
    ] {
        let dir = paths::fixtures().join(name);
        let (batches, events) = check_capture(&dir);
        assert!(batches > 0 && events > 0, "{name}");
        assert!(check_replay(&dir.join("replay")) > 0, "{name}");
    }
}

#[test]
fn bytehash_capture_ends_in_the_int_hashes() {
    // The 32-byte hashes end in the same 8 bytes as the main capture's int hashes.
    let root = paths::fixtures();
    let first = |dir: &str| {
        let payload = read(&root.join(dir).join("0000.msgpack"));
        match &decode_payload(&payload).unwrap().events[0] {
            KvEvent::BlockStored(s) => s.block_hashes.clone(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        first("vllm-0.32-kv-events-bytehash"),
        first("vllm-0.32-kv-events")
    );
}
