//! Unit tests of the index (limits, tiers, many-pod walks).
use super::*;
use crate::kvcache::{KeyContext, PromptKeys};
use kvpick_kvevents_wire::{BlockExtra, BlockStored, EventBatch, KvEvent};
use std::net::SocketAddr;

fn pod() -> PodId {
    PodId(SocketAddr::from(([127, 0, 0, 1], 1)))
}

fn stored(blocks: usize, tier: Tier, tokens: bool) -> EventBatch {
    let token_ids: Vec<u32> = if tokens {
        (0..blocks as u32 * 4).collect()
    } else {
        Vec::new()
    };
    EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks as u64).map(EngineHash).collect(),
            token_ids,
            block_size: Some(4),
            tier,
            extra: vec![BlockExtra::default(); blocks],
            ..BlockStored::default()
        })],
        dp_rank: None,
    }
}

#[test]
fn a_pod_cannot_grow_past_its_limit() {
    let index = PrefixIndex::new(IndexConfig {
        max_blocks_per_pod: 1000,
        ..IndexConfig::default()
    });
    index.set_pod_capacity(pod(), 4); // 4 × 2 + 64 = 72
    let stats = index.apply_batch(pod(), "m", &stored(100, Tier::Gpu, true));
    assert_eq!(index.pod_entries(pod()), 72);
    assert_eq!(stats.capacity_drops, 28);
    // The hard cap wins over a huge learned capacity.
    index.set_pod_capacity(pod(), 1 << 30);
    index.clear_pod(pod());
    index.apply_batch(pod(), "m", &stored(1200, Tier::Gpu, true));
    assert_eq!(index.pod_entries(pod()), 1000);
}

#[test]
fn tiers_clear_separately_and_offload_copies_resolve_by_hash() {
    let index = PrefixIndex::new(IndexConfig::default());
    index.apply_batch(pod(), "m", &stored(3, Tier::Gpu, true));
    // CPU copies announced without tokens are keyed through the GPU entries.
    let stats = index.apply_batch(pod(), "m", &stored(3, Tier::Cpu, false));
    assert_eq!((stats.blocks_added, stats.orphan_blocks), (3, 0));
    assert_eq!(index.pod_entries(pod()), 6);
    let tokens: Vec<u32> = (0..12).collect();
    let context = KeyContext::model("m");
    let found = &index.match_prefix(&context, &tokens, &[pod()])[0];
    assert_eq!((found.matched_blocks, found.weighted_blocks), (3, 3.0));
    let clear_gpu = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::AllBlocksCleared {
            tier: Some(Tier::Gpu),
        }],
        dp_rank: None,
    };
    index.apply_batch(pod(), "m", &clear_gpu);
    assert_eq!(index.pod_entries(pod()), 3);
    let found = &index.match_prefix(&context, &tokens, &[pod()])[0];
    assert_eq!(found.matched_blocks, 3);
    assert!((found.weighted_blocks - 2.4).abs() < 1e-9, "cpu weight 0.8");
    // Copies of unknown hashes cannot be keyed.
    let stats = index.apply_batch(pod(), "m", &stored(5, Tier::Other, false));
    assert_eq!(stats.orphan_blocks, 2);
}

#[tokio::test(start_paused = true)]
async fn walks_over_many_pods_give_each_its_own_run_and_tier_weight() {
    // 130 pods (three bitset words): pod i holds the first i % 10 + 1 blocks of a 12-block
    // prompt, in GPU (even i) or CPU (odd i); the last pod holds it only speculatively.
    let index = PrefixIndex::new(IndexConfig::default());
    let pods: Vec<PodId> = (0..130u16)
        .map(|i| {
            PodId(SocketAddr::from((
                [10, 0, (i / 200) as u8, (i % 200) as u8],
                8000,
            )))
        })
        .collect();
    let tokens: Vec<u32> = (0..48).map(|t| t * 3 + 1).collect();
    for (i, pod) in pods.iter().enumerate().take(129) {
        let blocks = i % 10 + 1;
        let mut batch = stored(blocks, if i % 2 == 0 { Tier::Gpu } else { Tier::Cpu }, true);
        if let Some(KvEvent::BlockStored(stored)) = batch.events.first_mut() {
            stored.token_ids = tokens[..blocks * 4].to_vec();
        }
        index.apply_batch(*pod, "m", &batch);
    }
    let last = pods[129];
    index.set_pod_block_size(last, 4);
    index.apply_batch(
        last,
        "m",
        &EventBatch {
            ts: 0.0,
            events: vec![],
            dp_rank: None,
        },
    );
    let context = KeyContext::model("m");
    index.record_routed_tokens(last, &context, &tokens);
    let keys_lookup = PromptKeys::exact(context.clone(), tokens.to_vec());
    let lookup = index.lookup(&keys_lookup, &pods);
    for (i, found) in lookup.matches.iter().enumerate().take(129) {
        let blocks = i % 10 + 1;
        let weight = if i % 2 == 0 { 1.0 } else { 0.8 };
        assert_eq!(found.matched_blocks, blocks, "pod {i}");
        assert!(
            (found.weighted_blocks - blocks as f64 * weight).abs() < 1e-9,
            "pod {i}"
        );
        assert_eq!(lookup.confirmed_run(found.pod, 4), blocks);
    }
    assert_eq!(lookup.matches[129].matched_blocks, 12);
    assert_eq!(lookup.matches[129].weighted_blocks, 12.0);
    assert_eq!(lookup.confirmed_run(last, 4), 0, "speculative from block 0");
    // A candidate unknown to the index holds nothing.
    let stranger = PodId(SocketAddr::from(([10, 9, 9, 9], 1)));
    let found = index.match_prefix(&context, &tokens, &[stranger, pods[9]]);
    assert_eq!((found[0].matched_blocks, found[1].matched_blocks), (0, 10));
}

#[tokio::test(start_paused = true)]
async fn a_record_landing_after_a_purge_does_not_bring_the_pod_back() {
    let index = PrefixIndex::new(IndexConfig::default());
    let context = KeyContext::model("m");
    index.ensure_pod(pod());
    index.apply_batch(pod(), "m", &stored(8, Tier::Gpu, true));
    let tokens: Vec<u32> = (0..64).collect();
    let keys_lookup = PromptKeys::exact(context.clone(), tokens.to_vec());
    let lookup = index.lookup(&keys_lookup, &[pod()]);
    // The pod leaves the pool between its pick and the record (applied after the reply).
    index.purge_pod(pod());
    index.record_routed(pod(), &keys_lookup, Some(&lookup));
    assert!(index.pods().is_empty(), "{:?}", index.pods());
    assert_eq!(index.speculative_entries(), 0);
    // Back in the pool (its subscriber registers it): records land again.
    index.ensure_pod(pod());
    index.record_routed_tokens(pod(), &context, &tokens);
    assert_eq!(index.pods(), vec![pod()]);
    // A pod without events that was purged long ago is learned again.
    index.purge_pod(pod());
    tokio::time::advance(PURGE_MEMORY + std::time::Duration::from_secs(1)).await;
    index.record_routed_tokens(pod(), &context, &tokens);
    assert_eq!(index.pods(), vec![pod()]);
}

#[tokio::test(start_paused = true)]
async fn a_record_made_before_a_subscribed_pods_first_event_outlives_it() {
    // A fresh engine publishes its first event only once it has prefilled something; under
    // load the requests routed to it before then must still be found after that event turns
    // the pod precise (and drops what was learned approximately).
    let index = PrefixIndex::new(IndexConfig::default());
    let context = KeyContext::model("m");
    index.ensure_pod(pod());
    index.set_pod_block_size(pod(), 4);
    let routed: Vec<u32> = (0..40).collect();
    index.record_routed_tokens(pod(), &context, &routed);
    // The next request of the group: the same 32 leading tokens, another question.
    let mut next: Vec<u32> = (0..32).collect();
    next.extend(500..508);
    let held =
        |index: &PrefixIndex| index.match_prefix(&context, &next, &[pod()])[0].matched_blocks;
    assert_eq!(held(&index), 8, "held approximately before any event");
    // The pod's first event: another prompt's blocks (the prefill ahead of ours).
    let mut first = stored(2, Tier::Gpu, true);
    if let Some(KvEvent::BlockStored(s)) = first.events.first_mut() {
        s.token_ids = (1000..1008).collect();
        s.block_hashes = vec![EngineHash(900), EngineHash(901)];
    }
    index.apply_batch(pod(), "m", &first);
    assert_eq!(
        held(&index),
        8,
        "held speculatively after the switch to precise"
    );
    // Its own blocks' events confirm the first 3; the rest stay speculative.
    let mut own = stored(3, Tier::Gpu, true);
    if let Some(KvEvent::BlockStored(s)) = own.events.first_mut() {
        s.token_ids = routed[..12].to_vec();
    }
    index.apply_batch(pod(), "m", &own);
    assert_eq!(held(&index), 8);
    // Unconfirmed, the rest expire with the speculative TTL.
    tokio::time::advance(
        IndexConfig::default().speculative_ttl + std::time::Duration::from_millis(1),
    )
    .await;
    assert_eq!(held(&index), 3);

    // A pod nobody subscribes to stays approximate: no speculative entries for it.
    let index = PrefixIndex::new(IndexConfig::default());
    index.record_routed_tokens(pod(), &context, &routed);
    assert_eq!(index.speculative_entries(), 0);
    assert!(index.match_prefix(&context, &next, &[pod()])[0].matched_blocks > 0);
}
