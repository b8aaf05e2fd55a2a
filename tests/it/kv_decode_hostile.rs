//! Hostile payloads, deterministically: every truncation and a spread of byte mutations of
//! the real captures must decode to an error or to a batch the index applies and clears
//! without panicking or growing past its bounds (the cargo-fuzz target in fuzz/ explores
//! further).

use crate::hostile_bytes::cuts_and_mutations;
use crate::support::paths;

use std::net::SocketAddr;

use kvpick::endpoints::PodId;
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex};
use kvpick::kvevents::decode_payload;

fn payloads() -> Vec<Vec<u8>> {
    let root = paths::fixtures();
    let mut out = Vec::new();
    for dir in [
        "vllm-0.32-kv-events",
        "vllm-0.32-kv-events-bytehash",
        "vllm-0.32-kv-events-sha256cbor",
    ] {
        for index in 0..4 {
            if let Ok(bytes) = std::fs::read(root.join(dir).join(format!("{index:04}.msgpack"))) {
                out.push(bytes);
            }
        }
    }
    out
}

fn exercise(index: &PrefixIndex, pod: PodId, data: &[u8]) -> bool {
    let Ok(batch) = decode_payload(data) else {
        return false;
    };
    index.apply_batch(pod, "m", &batch);
    assert!(index.pod_entries(pod) <= 512);
    let tokens: Vec<u32> = (0..64).collect();
    let found = index.match_prefix(&KeyContext::model("m"), &tokens, &[pod]);
    assert_eq!(found.len(), 1);
    true
}

#[test]
fn truncations_and_mutations_never_panic() {
    let index = PrefixIndex::new(IndexConfig {
        max_blocks_per_pod: 512,
        ..IndexConfig::default()
    });
    let pod = PodId(SocketAddr::from(([127, 0, 0, 1], 1)));
    let (mut decoded, mut rejected) = (0, 0);
    let mut rng = fastrand::Rng::with_seed(7);
    for payload in payloads() {
        let (ok, refused) = cuts_and_mutations(&payload, 1, 300, &mut rng, |data| {
            exercise(&index, pod, data)
        });
        decoded += ok;
        rejected += refused;
    }
    assert!(
        decoded > 0 && rejected > 0,
        "{decoded} decoded, {rejected} rejected"
    );
    index.clear_pod(pod);
    assert_eq!(index.pod_entries(pod), 0);
    assert_eq!(index.distinct_blocks(), 0);
}
