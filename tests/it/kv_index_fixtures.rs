//! Golden test: apply the whole real vLLM capture to the index; it must then hold exactly the
//! blocks the engine still holds, and match every request's prompt as the engine cached it.

use crate::support::paths;

use std::collections::HashMap;
use std::path::PathBuf;

use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex};
use kvpick::kvevents::{EngineHash, KvEvent, Tier, decode_payload, parse_topic, split_frames};
use serde_json::Value as Json;

fn capture_dir() -> PathBuf {
    paths::fixtures().join("vllm-0.32-kv-events")
}

struct Message {
    seq: u64,
    topic: Vec<u8>,
    payload: Vec<u8>,
}

fn messages() -> Vec<Message> {
    let dir = capture_dir();
    let mut out = Vec::new();
    for index in 0.. {
        let base = dir.join(format!("{index:04}"));
        let Ok(payload) = std::fs::read(base.with_extension("msgpack")) else {
            break;
        };
        let topic = std::fs::read(base.with_extension("topic")).unwrap();
        let seq = std::fs::read(base.with_extension("seq")).unwrap();
        let frames: [&[u8]; 3] = [&topic, &seq, &payload];
        let seq = split_frames(&frames).unwrap().seq;
        out.push(Message {
            seq,
            topic,
            payload,
        });
    }
    out
}

/// The engine's truth per engine hash, from the README's facts: a reference count of stores
/// and removals, except that the `kv_cache_report_mode: "full"` re-announcement (seq 11)
/// stores no new physical block.
#[derive(Default)]
struct EngineTruth {
    refs: HashMap<EngineHash, i64>,
}

impl EngineTruth {
    fn apply(&mut self, seq: u64, events: &[KvEvent]) {
        for event in events {
            match event {
                KvEvent::BlockStored(s) if seq != 11 => {
                    for h in &s.block_hashes {
                        *self.refs.entry(*h).or_default() += 1;
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in &r.block_hashes {
                        *self.refs.entry(*h).or_default() -= 1;
                    }
                }
                _ => {}
            }
        }
    }

    fn held(&self, hash: EngineHash) -> bool {
        self.refs.get(&hash).is_some_and(|r| *r > 0)
    }
}

#[test]
fn index_follows_the_engine_through_the_main_capture() {
    let requests: Vec<Json> = std::fs::read_to_string(capture_dir().join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // After which batch index each request is checked: its last event, or (no events) the
    // batches seen so far.
    let mut check_after: Vec<Option<usize>> = Vec::new();
    let mut last = None;
    for request in &requests {
        if let Some(i) = request["event_indices"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Json::as_u64)
            .max()
        {
            last = Some(i as usize);
        }
        check_after.push(last);
    }

    let index = PrefixIndex::new(IndexConfig::default());
    let mut truth = EngineTruth::default();
    let mut pod = None;
    let mut checked = 0;
    let mut full_hits = 0;
    let all = messages();
    assert_eq!(all.len(), 68);
    for (position, message) in all.iter().enumerate() {
        let topic = parse_topic(&message.topic).unwrap();
        pod = Some(topic.pod);
        let batch = decode_payload(&message.payload).unwrap();
        truth.apply(message.seq, &batch.events);
        let stats = index.apply_batch(topic.pod, &topic.model, &batch);
        assert_eq!(stats.orphan_blocks, 0, "seq {}", message.seq);
        assert_eq!(stats.inconsistent_events, 0);
        assert_eq!(stats.unknown_removals, 0, "seq {}", message.seq);

        for (request, after) in requests.iter().zip(&check_after) {
            if *after != Some(position) {
                continue;
            }
            let tokens: Vec<u32> = request["prompt_token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let hashes: Vec<EngineHash> = request["prompt_block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| {
                    // Decimal strings; signed or unsigned depending on the writer.
                    let text = h.as_str().unwrap();
                    EngineHash(
                        text.parse::<u64>()
                            .unwrap_or_else(|_| text.parse::<i64>().unwrap() as u64),
                    )
                })
                .collect();
            assert_eq!(hashes.len(), tokens.len() / 32);
            let expected = hashes.iter().take_while(|h| truth.held(**h)).count();
            let context = KeyContext {
                cache_salt: request["body"]["cache_salt"].as_str().map(str::to_string),
                ..KeyContext::model("tiny")
            };
            let found = index.match_prefix(&context, &tokens, &[topic.pod]);
            assert_eq!(found.len(), 1);
            let label = request["label"].as_str().unwrap();
            assert_eq!(found[0].block_size, 32, "{label}");
            assert_eq!(found[0].total_blocks, hashes.len(), "{label}");
            assert_eq!(found[0].matched_blocks, expected, "{label}");
            assert_eq!(found[0].weighted_blocks, expected as f64, "{label}");
            if expected == hashes.len() {
                full_hits += 1;
            }
            // The same tokens under another model, or another salt, match nothing.
            let other = KeyContext::model("other");
            assert_eq!(
                index.match_prefix(&other, &tokens, &[topic.pod])[0].matched_blocks,
                0
            );
            let salted = KeyContext {
                cache_salt: Some("tenant-z".into()),
                ..KeyContext::model("tiny")
            };
            assert_eq!(
                index.match_prefix(&salted, &tokens, &[topic.pod])[0].matched_blocks,
                0
            );
            checked += 1;
        }
    }
    assert_eq!(checked, requests.len());
    // Right after its own events the engine holds a request's whole prompt, except for the
    // concurrent load requests whose window includes later evictions.
    assert!(full_hits >= 20, "full hits {full_hits}");

    // At the end: exactly the blocks the engine still holds (fixture README: `S` 48 plus the
    // 14 `SSRS` blocks of chat-billing).
    let pod = pod.unwrap();
    let mut held: Vec<(EngineHash, Tier)> = truth
        .refs
        .iter()
        .filter(|(_, r)| **r > 0)
        .map(|(h, _)| (*h, Tier::Gpu))
        .collect();
    held.sort();
    assert_eq!(held.len(), 48 + 14);
    assert_eq!(index.pod_engine_hashes(pod), held);
    assert_eq!(index.pod_entries(pod), 62);
    let stats = index.pod_stats(pod).unwrap();
    assert_eq!(stats.reannounced, 14, "seq 11 re-announces 14 blocks");
    assert!(stats.duplicate_stores >= 1, "the duplicate physical block");

    // Purging the pod leaves nothing behind.
    index.purge_pod(pod);
    assert_eq!(index.distinct_blocks(), 0);
    assert!(index.pods().is_empty());
}

#[test]
fn replayed_prefix_rebuilds_the_same_state_as_live() {
    // Replay from 0 (taken after request 8) returns the first 13 batches byte-identical:
    // applying them gives the same index as applying the live batches 0..13.
    let dir = capture_dir().join("replay");
    let live = PrefixIndex::new(IndexConfig::default());
    let replayed = PrefixIndex::new(IndexConfig::default());
    let all = messages();
    for message in all.iter().take(13) {
        let topic = parse_topic(&message.topic).unwrap();
        live.apply_batch(
            topic.pod,
            &topic.model,
            &decode_payload(&message.payload).unwrap(),
        );
    }
    let mut pod = None;
    for index in 0..13 {
        let topic = std::fs::read(dir.join(format!("{index:04}.f1"))).unwrap();
        let payload = std::fs::read(dir.join(format!("{index:04}.f3"))).unwrap();
        let topic = parse_topic(&topic).unwrap();
        pod = Some(topic.pod);
        replayed.apply_batch(topic.pod, &topic.model, &decode_payload(&payload).unwrap());
    }
    let pod = pod.unwrap();
    assert!(live.pod_entries(pod) > 0);
    assert_eq!(live.pod_engine_hashes(pod), replayed.pod_engine_hashes(pod));
}

#[test]
fn lookups_are_measured_and_debug_view_has_the_design_shape() {
    let registry = prometheus::Registry::new();
    let index = PrefixIndex::with_registry(IndexConfig::default(), &registry).unwrap();
    let first = &messages()[0];
    let topic = parse_topic(&first.topic).unwrap();
    index.apply_batch(
        topic.pod,
        &topic.model,
        &decode_payload(&first.payload).unwrap(),
    );
    let requests: Vec<Json> = std::fs::read_to_string(capture_dir().join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tokens: Vec<u32> = requests[0]["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let view = index.debug_prefix(&KeyContext::model("tiny"), &tokens, &[topic.pod]);
    let json = serde_json::to_value(&view).unwrap();
    assert_eq!(json["token_count"], 483);
    assert_eq!(json["pods"][0]["address"], "127.0.0.1:8101");
    assert_eq!(json["pods"][0]["block_size"], 32);
    assert_eq!(json["pods"][0]["matched_blocks"], 15);
    assert_eq!(json["pods"][0]["matched_tokens"], 480);
    index.match_prefix(&KeyContext::model("other"), &tokens, &[topic.pod]);
    let value = |name: &str| {
        registry
            .gather()
            .into_iter()
            .find(|f| f.name() == name)
            .map(|f| f.get_metric()[0].clone())
            .unwrap()
    };
    assert_eq!(
        value("kvpick_prefix_lookup_blocks_total")
            .get_counter()
            .get_value(),
        30.0
    );
    assert_eq!(
        value("kvpick_prefix_hit_blocks_total")
            .get_counter()
            .get_value(),
        15.0
    );
    assert_eq!(
        value("kvpick_prefix_lookup_duration_seconds")
            .get_histogram()
            .get_sample_count(),
        2
    );
}
