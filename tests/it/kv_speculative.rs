//! Speculative entries (paused tokio time) and the approximate mode for pods without events.

use crate::support::paths;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvpick::endpoints::PodId;
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex, PromptKeys};
use kvpick::kvevents::{EventBatch, decode_payload};
use serde_json::Value as Json;

fn capture() -> PathBuf {
    paths::fixtures().join("vllm-0.32-kv-events")
}

fn batch(seq: usize) -> EventBatch {
    decode_payload(&std::fs::read(capture().join(format!("{seq:04}.msgpack"))).unwrap()).unwrap()
}

fn prompt(request: usize) -> Vec<u32> {
    let line = std::fs::read_to_string(capture().join("requests.jsonl"))
        .unwrap()
        .lines()
        .nth(request)
        .unwrap()
        .to_string();
    let json: Json = serde_json::from_str(&line).unwrap();
    json["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn pod(port: u16) -> PodId {
    PodId(SocketAddr::from(([127, 0, 0, 1], port)))
}

fn empty_batch() -> EventBatch {
    EventBatch {
        ts: 0.0,
        events: Vec::new(),
        dp_rank: Some(0),
    }
}

fn matched(index: &PrefixIndex, tokens: &[u32], pods: &[PodId]) -> Vec<usize> {
    index
        .match_prefix(&KeyContext::model("tiny"), tokens, pods)
        .iter()
        .map(|m| m.matched_blocks)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn speculation_lasts_its_ttl_and_yields_to_confirmed_events() {
    let index = PrefixIndex::new(IndexConfig {
        speculative_ttl: Duration::from_secs(2),
        ..IndexConfig::default()
    });
    let (a, b) = (pod(8101), pod(8102));
    // Both pods publish events (block size 32 learned from a real batch).
    index.apply_batch(a, "tiny", &batch(0));
    index.apply_batch(b, "tiny", &batch(0));
    let billing = prompt(2); // chat-billing: 14 full blocks, held by nobody yet
    assert_eq!(matched(&index, &billing, &[a, b]), vec![0, 0]);

    index.record_routed_tokens(b, &KeyContext::model("tiny"), &billing);
    assert_eq!(index.speculative_entries(), 14);
    assert_eq!(matched(&index, &billing, &[a, b]), vec![0, 14]);
    // Another salt is another prefix: no speculative hit.
    let salted = KeyContext {
        cache_salt: Some("x".into()),
        ..KeyContext::model("tiny")
    };
    assert_eq!(
        index.match_prefix(&salted, &billing, &[b])[0].matched_blocks,
        0
    );
    tokio::time::advance(Duration::from_millis(1900)).await;
    assert_eq!(matched(&index, &billing, &[a, b]), vec![0, 14]);
    tokio::time::advance(Duration::from_millis(200)).await;
    assert_eq!(matched(&index, &billing, &[a, b]), vec![0, 0]);
    index.purge_expired_speculation();
    assert_eq!(index.speculative_entries(), 0);

    // Routed again, then the engine confirms (chat-billing's events, seq 2): the confirmed
    // blocks replace the speculation and outlive the TTL.
    index.record_routed_tokens(b, &KeyContext::model("tiny"), &billing);
    index.apply_batch(b, "tiny", &batch(2));
    assert_eq!(index.speculative_entries(), 0);
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(matched(&index, &billing, &[a, b]), vec![0, 14]);
    // Already-held blocks are not speculated again.
    index.record_routed_tokens(b, &KeyContext::model("tiny"), &billing);
    assert_eq!(index.speculative_entries(), 0);
}

#[tokio::test(start_paused = true)]
async fn approximate_mode_learns_from_routing_with_lru_capacity() {
    let index = PrefixIndex::new(IndexConfig {
        approx_capacity_blocks: 20,
        ..IndexConfig::default()
    });
    let c = pod(8103);
    index.set_pod_block_size(c, 4);
    let first: Vec<u32> = (0..40).collect(); // 10 blocks
    let second: Vec<u32> = (1000..1060).collect(); // 15 blocks
    index.record_routed_tokens(c, &KeyContext::model("tiny"), &first);
    assert_eq!(matched(&index, &first, &[c]), vec![10]);
    assert_eq!(index.pod_entries(c), 10);
    // 25 blocks over a capacity of 20: the least recent go, tail first.
    index.record_routed_tokens(c, &KeyContext::model("tiny"), &second);
    assert_eq!(index.pod_entries(c), 20);
    assert_eq!(matched(&index, &second, &[c]), vec![15]);
    assert_eq!(matched(&index, &first, &[c]), vec![5]);
    // Touching the first prefix again makes it recent; the second loses its tail.
    index.record_routed_tokens(c, &KeyContext::model("tiny"), &first);
    assert_eq!(matched(&index, &first, &[c]), vec![10]);
    assert_eq!(matched(&index, &second, &[c]), vec![10]);
    // Speculation is not involved, and time does not expire approximate entries.
    assert_eq!(index.speculative_entries(), 0);
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(matched(&index, &first, &[c]), vec![10]);

    // The pod starts publishing events: routing guesses give way to facts.
    index.apply_batch(c, "tiny", &empty_batch());
    assert_eq!(matched(&index, &first, &[c]), vec![0]);
    assert_eq!(index.pod_entries(c), 0);
    assert_eq!(index.distinct_blocks(), 0);
}

#[tokio::test(start_paused = true)]
async fn record_after_lookup_reuses_keys_and_refreshes_only_speculation() {
    let index = PrefixIndex::new(IndexConfig {
        speculative_ttl: Duration::from_secs(2),
        ..IndexConfig::default()
    });
    let (a, b) = (pod(8104), pod(8105));
    index.apply_batch(a, "tiny", &batch(0));
    index.apply_batch(b, "tiny", &batch(0));
    let context = KeyContext::model("tiny");
    let billing = prompt(2); // 14 full blocks
    // b is routed the first 6 blocks' worth of the prompt, then (1.5 s later) the whole prompt
    // after a lookup: the lookup's keys are reused and b's speculative head is refreshed, so
    // the whole run outlives the first record's TTL.
    let head = &billing[..6 * 32];
    index.record_routed_tokens(b, &context, head);
    assert_eq!(index.speculative_entries(), 6);
    tokio::time::advance(Duration::from_millis(1500)).await;
    let keys_lookup = PromptKeys::exact(context.clone(), billing.to_vec());
    let lookup = index.lookup(&keys_lookup, &[a, b]);
    let runs: Vec<usize> = lookup.matches.iter().map(|m| m.matched_blocks).collect();
    assert_eq!(runs, vec![0, 6]);
    assert_eq!(lookup.confirmed_run(b, 32), 0, "b's run is speculative");
    index.record_routed(b, &keys_lookup, Some(&lookup));
    assert_eq!(index.speculative_entries(), 14);
    tokio::time::advance(Duration::from_millis(600)).await;
    assert_eq!(matched(&index, &billing, &[a, b]), vec![0, 14]);
    // Blocks b holds confirmed are neither refreshed nor duplicated: after chat-billing's
    // events (seq 2) b's run is confirmed and a record adds nothing.
    index.apply_batch(b, "tiny", &batch(2));
    assert_eq!(index.speculative_entries(), 0);
    let keys_lookup = PromptKeys::exact(context.clone(), billing.to_vec());
    let lookup = index.lookup(&keys_lookup, &[a, b]);
    assert_eq!(lookup.confirmed_run(b, 32), 14);
    index.record_routed(b, &keys_lookup, Some(&lookup));
    assert_eq!(index.speculative_entries(), 0);
    // The keys the lookup reused are the keys a fresh record computes: recording the whole
    // prompt on a from scratch lands on the same blocks.
    index.record_routed_tokens(a, &context, &billing);
    assert_eq!(matched(&index, &billing, &[a, b]), vec![14, 14]);
    assert_eq!(index.speculative_entries(), 14);
    // A lookup whose chain was taken by another pod's record still records correctly.
    let keys_lookup = PromptKeys::exact(context.clone(), billing[..10 * 32].to_vec());
    let lookup = index.lookup(&keys_lookup, &[a]);
    let c = pod(8106);
    index.apply_batch(c, "tiny", &batch(0));
    index.record_routed(c, &keys_lookup, Some(&lookup));
    assert_eq!(matched(&index, &billing, &[c]), vec![10]);
}
