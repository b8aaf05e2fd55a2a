//! Fuzz the KV-event payload decoder (and what it feeds): no input may panic, and a decoded
//! batch applied to the index must leave it consistent (matching still works, clearing
//! empties it).
//!
//! Seed corpus: the real payloads in ../shared/fixtures/vllm-0.32-kv-events*/NNNN.msgpack.
#![no_main]

use std::net::SocketAddr;

use kvpick::endpoints::PodId;
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex};
use kvpick::kvevents::{decode_payload, parse_topic, split_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_topic(data);
    let frames: Vec<&[u8]> = data.splitn(3, |b| *b == 0).collect();
    let _ = split_frames(&frames);
    let Ok(batch) = decode_payload(data) else {
        return;
    };
    let index = PrefixIndex::new(IndexConfig {
        max_blocks_per_pod: 4096,
        ..IndexConfig::default()
    });
    let pod = PodId(SocketAddr::from(([127, 0, 0, 1], 1)));
    index.apply_batch(pod, "m", &batch);
    index.apply_batch(pod, "m", &batch);
    assert!(index.pod_entries(pod) <= 4096);
    let tokens: Vec<u32> = (0..256).collect();
    let _ = index.match_prefix(&KeyContext::model("m"), &tokens, &[pod]);
    index.clear_pod(pod);
    assert_eq!(index.pod_entries(pod), 0);
    assert_eq!(index.distinct_blocks(), 0);
});
