//! Differential property test for long prefixes, where walks gallop over spans: random
//! event streams of long chains (stored in pieces, branching, evicted leaf-first or with holes
//! in the middle, re-stored, offloaded to CPU, cleared) over several pods give the same
//! matches as a naive reference that checks every block. Pods without events (kvpick's
//! approximate LRU of what it routed) keep their blocks in spans too: the tests at the end.

use kvpick::endpoints::PodId;
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex, PromptKeys};
use kvpick::kvevents::{BlockExtra, BlockRemoved, BlockStored, EngineHash, KvEvent, Tier};
use proptest::prelude::*;

use crate::support;
use support::kv_reference::{Reference, batch, engine_hash, pod, tier};

const BLOCK: usize = 2;
/// Blocks per document: long enough for gallops (which try jumps of 16 and more).
const DOC_BLOCKS: usize = 120;
const DOCS: usize = 6;
const PODS: usize = 5;
const MODEL: &str = "m";

/// Documents form a tree: all share blocks 0..70, pairs share 70..95, then each is its own.
fn documents() -> Vec<Vec<u32>> {
    (0..DOCS as u32)
        .map(|d| {
            (0..DOC_BLOCKS as u32)
                .flat_map(|b| {
                    let family = match b {
                        0..70 => 0,
                        70..95 => 1 + d / 2,
                        _ => 10 + d,
                    };
                    (0..BLOCK as u32).map(move |t| family * 10_000 + b * 7 + t)
                })
                .collect()
        })
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// Blocks `start..start + len` of a document, as one event continuing from block
    /// `start − 1` (a prefill chunk or a decode step).
    Store {
        pod: usize,
        doc: usize,
        start: usize,
        len: usize,
        tier: u8,
    },
    /// The prefill of a whole prefix in chunks of `chunk` blocks (several events).
    Prefill {
        pod: usize,
        doc: usize,
        blocks: usize,
        chunk: usize,
    },
    /// One block removed (a hole when it has held children).
    Remove {
        pod: usize,
        doc: usize,
        block: usize,
        tier: u8,
    },
    /// vLLM-style eviction: the last `count` blocks of a prefix, leaves first.
    EvictTail {
        pod: usize,
        doc: usize,
        end: usize,
        count: usize,
    },
    ClearAll {
        pod: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..PODS, 0..DOCS, 0..DOC_BLOCKS, 1..70usize, 0..4u8).prop_map(
            |(pod, doc, start, len, t)| Op::Store { pod, doc, start, len, tier: t.min(1) }
        ),
        3 => (0..PODS, 0..DOCS, 1..=DOC_BLOCKS, 1..40usize)
            .prop_map(|(pod, doc, blocks, chunk)| Op::Prefill { pod, doc, blocks, chunk }),
        3 => (0..PODS, 0..DOCS, 0..DOC_BLOCKS, 0..4u8)
            .prop_map(|(pod, doc, block, t)| Op::Remove { pod, doc, block, tier: t.min(1) }),
        3 => (0..PODS, 0..DOCS, 1..=DOC_BLOCKS, 1..50usize)
            .prop_map(|(pod, doc, end, count)| Op::EvictTail { pod, doc, end, count }),
        1 => (0..PODS).prop_map(|pod| Op::ClearAll { pod }),
    ]
}

fn stored(tokens: &[u32], start: usize, end: usize, t: Tier) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: (start..end)
            .map(|b| engine_hash(&tokens[..(b + 1) * BLOCK]))
            .collect(),
        parent_block_hash: (start > 0).then(|| engine_hash(&tokens[..start * BLOCK])),
        token_ids: tokens[start * BLOCK..end * BLOCK].to_vec(),
        block_size: Some(BLOCK as u32),
        tier: t,
        extra: vec![BlockExtra::default(); end - start],
        ..BlockStored::default()
    })
}

fn removed(hashes: Vec<EngineHash>, t: Tier) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes,
        tier: t,
        group_idx: None,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn long_prefix_matches_equal_the_block_by_block_reference(
        ops in proptest::collection::vec(op(), 1..60),
        requests in proptest::collection::vec((0..DOCS, 1..=DOC_BLOCKS), 1..8),
    ) {
        let docs = documents();
        let index = PrefixIndex::new(IndexConfig::default());
        let mut reference = Reference::new(PODS, BLOCK);
        for op in &ops {
            match *op {
                Op::Store { pod: p, doc, start, len, tier: t } => {
                    let end = (start + len).min(DOC_BLOCKS);
                    index.apply_batch(pod(p), MODEL, &batch(stored(&docs[doc], start, end, tier(t))));
                    reference.store(p, &docs[doc], start, end, t as usize);
                }
                Op::Prefill { pod: p, doc, blocks, chunk } => {
                    let mut start = 0;
                    while start < blocks {
                        let end = (start + chunk).min(blocks);
                        index.apply_batch(pod(p), MODEL, &batch(stored(&docs[doc], start, end, Tier::Gpu)));
                        reference.store(p, &docs[doc], start, end, 0);
                        start = end;
                    }
                }
                Op::Remove { pod: p, doc, block, tier: t } => {
                    let h = engine_hash(&docs[doc][..(block + 1) * BLOCK]);
                    index.apply_batch(pod(p), MODEL, &batch(removed(vec![h], tier(t))));
                    reference.remove(p, h, t as usize);
                }
                Op::EvictTail { pod: p, doc, end, count } => {
                    let hashes: Vec<EngineHash> = (end.saturating_sub(count)..end)
                        .rev()
                        .map(|b| engine_hash(&docs[doc][..(b + 1) * BLOCK]))
                        .collect();
                    for h in &hashes {
                        reference.remove(p, *h, 0);
                    }
                    index.apply_batch(pod(p), MODEL, &batch(removed(hashes, Tier::Gpu)));
                }
                Op::ClearAll { pod: p } => {
                    index.apply_batch(pod(p), MODEL, &batch(KvEvent::AllBlocksCleared { tier: None }));
                    reference.refs[p].clear();
                }
            }
        }
        let candidates: Vec<PodId> = (0..PODS).map(pod).collect();
        for (doc, blocks) in requests {
            let request = &docs[doc][..blocks * BLOCK];
            let context = KeyContext::model(MODEL);
            let found = index.match_prefix(&context, request, &candidates);
            // Keys computed ahead (as the request path does with the tokens) give the same.
            let keys = PromptKeys::exact(context.clone(), request.to_vec());
            keys.warm(BLOCK as u32);
            let keyed = index.lookup(&keys, &candidates);
            prop_assert_eq!(&keyed.matches, &found);
            for (p, m) in found.iter().enumerate() {
                let (blocks, weighted) = reference.matched(p, request);
                prop_assert_eq!(m.matched_blocks, blocks, "pod {} doc {}", p, doc);
                prop_assert!((m.weighted_blocks - weighted).abs() < 1e-9,
                    "pod {} doc {}: weighted {} want {}", p, doc, m.weighted_blocks, weighted);
            }
        }
    }
}

/// What the differential test below does to both indexes.
#[derive(Clone, Debug)]
enum Step {
    /// An event stream operation (see [`Op`]).
    Event(Op),
    /// kvpick routed `blocks` blocks of `doc` to `pod` after a lookup over every pod (the
    /// routing record writes speculative runs after the pod's confirmed run).
    Route {
        pod: usize,
        doc: usize,
        blocks: usize,
    },
    /// An offload-style store without tokens naming blocks by hash (possibly with gaps).
    StoreNoTokens {
        pod: usize,
        doc: usize,
        blocks: Vec<usize>,
        tier: u8,
    },
    /// A hostile or confused publisher: `doc`'s tokens under `other`'s engine hashes.
    StoreRekeyed {
        pod: usize,
        doc: usize,
        other: usize,
        start: usize,
        len: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => op().prop_map(Step::Event),
        2 => (0..PODS, 0..DOCS, 1..=DOC_BLOCKS)
            .prop_map(|(pod, doc, blocks)| Step::Route { pod, doc, blocks }),
        1 => (0..PODS, 0..DOCS, proptest::collection::vec(0..DOC_BLOCKS, 1..30), 0..2u8)
            .prop_map(|(pod, doc, blocks, tier)| Step::StoreNoTokens { pod, doc, blocks, tier }),
        1 => (0..PODS, 0..DOCS, 0..DOCS, 0..DOC_BLOCKS, 1..60usize)
            .prop_map(|(pod, doc, other, start, len)| Step::StoreRekeyed { pod, doc, other, start, len }),
    ]
}

fn apply_step(index: &PrefixIndex, docs: &[Vec<u32>], step: &Step) {
    match step {
        Step::Event(op) => apply_op(index, docs, op),
        Step::Route { .. } => {}
        Step::StoreNoTokens {
            pod: p,
            doc,
            blocks,
            tier: t,
        } => {
            let stored = BlockStored {
                block_hashes: blocks
                    .iter()
                    .map(|b| engine_hash(&docs[*doc][..(b + 1) * BLOCK]))
                    .collect(),
                tier: tier(*t),
                ..BlockStored::default()
            };
            index.apply_batch(pod(*p), MODEL, &batch(KvEvent::BlockStored(stored)));
        }
        Step::StoreRekeyed {
            pod: p,
            doc,
            other,
            start,
            len,
        } => {
            let end = (start + len).min(DOC_BLOCKS);
            let KvEvent::BlockStored(mut event) = stored(&docs[*doc], *start, end, Tier::Gpu)
            else {
                return;
            };
            event.block_hashes = (*start..end)
                .map(|b| engine_hash(&docs[*other][..(b + 1) * BLOCK]))
                .collect();
            index.apply_batch(pod(*p), MODEL, &batch(KvEvent::BlockStored(event)));
        }
    }
}

fn apply_op(index: &PrefixIndex, docs: &[Vec<u32>], op: &Op) {
    match *op {
        Op::Store {
            pod: p,
            doc,
            start,
            len,
            tier: t,
        } => {
            let end = (start + len).min(DOC_BLOCKS);
            index.apply_batch(
                pod(p),
                MODEL,
                &batch(stored(&docs[doc], start, end, tier(t))),
            );
        }
        Op::Prefill {
            pod: p,
            doc,
            blocks,
            chunk,
        } => {
            let mut start = 0;
            while start < blocks {
                let end = (start + chunk).min(blocks);
                index.apply_batch(
                    pod(p),
                    MODEL,
                    &batch(stored(&docs[doc], start, end, Tier::Gpu)),
                );
                start = end;
            }
        }
        Op::Remove {
            pod: p,
            doc,
            block,
            tier: t,
        } => {
            let h = engine_hash(&docs[doc][..(block + 1) * BLOCK]);
            index.apply_batch(pod(p), MODEL, &batch(removed(vec![h], tier(t))));
        }
        Op::EvictTail {
            pod: p,
            doc,
            end,
            count,
        } => {
            let hashes: Vec<EngineHash> = (end.saturating_sub(count)..end)
                .rev()
                .map(|b| engine_hash(&docs[doc][..(b + 1) * BLOCK]))
                .collect();
            index.apply_batch(pod(p), MODEL, &batch(removed(hashes, Tier::Gpu)));
        }
        Op::ClearAll { pod: p } => {
            index.apply_batch(
                pod(p),
                MODEL,
                &batch(KvEvent::AllBlocksCleared { tier: None }),
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    /// Galloping (over spans and speculative runs) answers exactly what stepping block by
    /// block answers, speculation and tiers included — matches and where each pod's run went
    /// speculative (what the routing record starts from).
    #[test]
    fn galloping_walks_answer_like_stepping_walks(
        steps in proptest::collection::vec(step(), 1..60),
        requests in proptest::collection::vec((0..DOCS, 1..=DOC_BLOCKS, 1..(1usize << PODS)), 1..8),
    ) {
        let docs = documents();
        let galloping = PrefixIndex::new(IndexConfig::default());
        let stepping = PrefixIndex::new(IndexConfig { gallop: false, ..IndexConfig::default() });
        let context = KeyContext::model(MODEL);
        let everyone: Vec<PodId> = (0..PODS).map(pod).collect();
        for step in &steps {
            match step {
                Step::Route { pod: p, doc, blocks } => {
                    let request = &docs[*doc][..blocks * BLOCK];
                    let keys_a = PromptKeys::exact(context.clone(), request.to_vec());
                    let a = galloping.lookup(&keys_a, &everyone);
                    let keys_b = PromptKeys::exact(context.clone(), request.to_vec());
                    let b = stepping.lookup(&keys_b, &everyone);
                    prop_assert_eq!(&a.matches, &b.matches);
                    prop_assert_eq!(
                        a.confirmed_run(pod(*p), BLOCK as u32),
                        b.confirmed_run(pod(*p), BLOCK as u32)
                    );
                    galloping.record_routed(pod(*p), &keys_a, Some(&a));
                    stepping.record_routed(pod(*p), &keys_b, Some(&b));
                }
                other => {
                    apply_step(&galloping, &docs, other);
                    apply_step(&stepping, &docs, other);
                }
            }
        }
        for (doc, blocks, subset) in requests {
            let request = &docs[doc][..blocks * BLOCK];
            let candidates: Vec<PodId> =
                (0..PODS).filter(|p| subset & (1 << p) != 0).map(pod).collect();
            let keys_a = PromptKeys::exact(context.clone(), request.to_vec());
            let a = galloping.lookup(&keys_a, &candidates);
            let keys_b = PromptKeys::exact(context.clone(), request.to_vec());
            let b = stepping.lookup(&keys_b, &candidates);
            prop_assert_eq!(&a.matches, &b.matches, "doc {} blocks {}", doc, blocks);
            for candidate in &candidates {
                prop_assert_eq!(
                    a.confirmed_run(*candidate, BLOCK as u32),
                    b.confirmed_run(*candidate, BLOCK as u32)
                );
            }
        }
    }
}

#[test]
fn long_chains_are_galloped_over_not_walked() {
    let docs = documents();
    let index = PrefixIndex::new(IndexConfig::default());
    let context = KeyContext::model(MODEL);
    // Two pods prefill the whole document in chunks (continuations extend one span).
    for p in 0..2 {
        apply_op(
            &index,
            &docs,
            &Op::Prefill {
                pod: p,
                doc: 0,
                blocks: DOC_BLOCKS,
                chunk: 16,
            },
        );
    }
    let candidates: Vec<PodId> = (0..3).map(pod).collect();
    let keys_found = PromptKeys::exact(context.clone(), docs[0].to_vec());
    let found = index.lookup(&keys_found, &candidates);
    let matched: Vec<usize> = found.matches.iter().map(|m| m.matched_blocks).collect();
    assert_eq!(matched, vec![DOC_BLOCKS, DOC_BLOCKS, 0]);
    assert!(
        found.galloped_blocks() > DOC_BLOCKS / 2,
        "galloped {} of {DOC_BLOCKS}",
        found.galloped_blocks()
    );
    // A hole in pod 1's chain ends its run there; pod 0 still gallops to the end.
    let hole = engine_hash(&docs[0][..50 * BLOCK]);
    index.apply_batch(pod(1), MODEL, &batch(removed(vec![hole], Tier::Gpu)));
    let keys_found = PromptKeys::exact(context.clone(), docs[0].to_vec());
    let found = index.lookup(&keys_found, &candidates);
    let matched: Vec<usize> = found.matches.iter().map(|m| m.matched_blocks).collect();
    assert_eq!(matched, vec![DOC_BLOCKS, 49, 0]);
    assert!(found.galloped_blocks() > DOC_BLOCKS / 2);
    // Leaf-first eviction shortens the span; re-storing the tail continues it.
    let tail: Vec<EngineHash> = (100..DOC_BLOCKS)
        .rev()
        .map(|b| engine_hash(&docs[0][..(b + 1) * BLOCK]))
        .collect();
    index.apply_batch(pod(0), MODEL, &batch(removed(tail, Tier::Gpu)));
    index.apply_batch(
        pod(0),
        MODEL,
        &batch(stored(&docs[0], 100, DOC_BLOCKS, Tier::Gpu)),
    );
    let keys_found = PromptKeys::exact(context.clone(), docs[0].to_vec());
    let found = index.lookup(&keys_found, &[pod(0)]);
    assert_eq!(found.matches[0].matched_blocks, DOC_BLOCKS);
    assert!(found.galloped_blocks() >= DOC_BLOCKS - 20);
    // With galloping off, the same answers, nothing jumped.
    let stepping = PrefixIndex::new(IndexConfig {
        gallop: false,
        ..IndexConfig::default()
    });
    apply_op(
        &stepping,
        &docs,
        &Op::Prefill {
            pod: 0,
            doc: 0,
            blocks: DOC_BLOCKS,
            chunk: 16,
        },
    );
    let keys_found = PromptKeys::exact(context.clone(), docs[0].to_vec());
    let found = stepping.lookup(&keys_found, &[pod(0)]);
    assert_eq!(found.matches[0].matched_blocks, DOC_BLOCKS);
    assert_eq!(found.galloped_blocks(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    /// Pods without events (kvpick's approximate LRU of what it routed): their holders are in
    /// spans too, and with capacities small enough that routing evicts (tail first, older
    /// touches first, across documents), galloping still answers what stepping answers.
    #[test]
    fn approximate_pods_gallop_and_answer_like_stepping_walks(
        capacities in proptest::collection::vec(8..400usize, PODS),
        routes in proptest::collection::vec((0..PODS, 0..DOCS, 1..=DOC_BLOCKS), 1..40),
        requests in proptest::collection::vec((0..DOCS, 1..=DOC_BLOCKS, 1..(1usize << PODS)), 1..8),
    ) {
        let docs = documents();
        let galloping = PrefixIndex::new(IndexConfig::default());
        let stepping = PrefixIndex::new(IndexConfig { gallop: false, ..IndexConfig::default() });
        for (p, capacity) in capacities.iter().enumerate() {
            for index in [&galloping, &stepping] {
                index.set_pod_capacity(pod(p), *capacity);
                index.set_pod_block_size(pod(p), BLOCK as u32);
            }
        }
        let context = KeyContext::model(MODEL);
        let everyone: Vec<PodId> = (0..PODS).map(pod).collect();
        let check = |doc: usize, blocks: usize, candidates: &[PodId]| {
            let request = &docs[doc][..blocks * BLOCK];
            let keys_a = PromptKeys::exact(context.clone(), request.to_vec());
            let a = galloping.lookup(&keys_a, candidates);
            let keys_b = PromptKeys::exact(context.clone(), request.to_vec());
            let b = stepping.lookup(&keys_b, candidates);
            assert_eq!(b.galloped_blocks(), 0);
            (a, keys_a, b, keys_b)
        };
        for (p, doc, blocks) in routes {
            let (a, keys_a, b, keys_b) = check(doc, blocks, &everyone);
            prop_assert_eq!(&a.matches, &b.matches, "route doc {} blocks {}", doc, blocks);
            galloping.record_routed(pod(p), &keys_a, Some(&a));
            stepping.record_routed(pod(p), &keys_b, Some(&b));
        }
        for (doc, blocks, subset) in requests {
            let candidates: Vec<PodId> =
                (0..PODS).filter(|p| subset & (1 << p) != 0).map(pod).collect();
            let (a, _, b, _) = check(doc, blocks, &candidates);
            prop_assert_eq!(&a.matches, &b.matches, "doc {} blocks {}", doc, blocks);
        }
    }
}

#[test]
fn an_approximate_pods_routed_prefix_is_galloped_over() {
    let docs = documents();
    let index = PrefixIndex::new(IndexConfig::default());
    let context = KeyContext::model(MODEL);
    // Pod 0 publishes no events: what kvpick routed there is its approximate holding.
    index.set_pod_capacity(pod(0), 200);
    index.set_pod_block_size(pod(0), BLOCK as u32);
    let route = |doc: usize, blocks: usize| {
        let keys = PromptKeys::exact(context.clone(), docs[doc][..blocks * BLOCK].to_vec());
        let found = index.lookup(&keys, &[pod(0), pod(1)]);
        index.record_routed(pod(0), &keys, Some(&found));
        found
    };
    // The prefix arrives in three pieces (a growing conversation): each continues the span.
    route(0, 40);
    route(0, 80);
    route(0, DOC_BLOCKS);
    let found = route(0, DOC_BLOCKS);
    let matched: Vec<usize> = found.matches.iter().map(|m| m.matched_blocks).collect();
    assert_eq!(matched, vec![DOC_BLOCKS, 0]);
    assert!(
        found.galloped_blocks() > DOC_BLOCKS / 2,
        "galloped {} of {DOC_BLOCKS}",
        found.galloped_blocks()
    );
    // Two more documents (50 new blocks each) overflow the 200 blocks by 20: document 0's
    // tail goes first (its head is shared with them and was touched since), and the walk
    // stops where the tail went.
    route(2, DOC_BLOCKS);
    route(4, DOC_BLOCKS);
    let keys = PromptKeys::exact(context.clone(), docs[0].to_vec());
    let found = index.lookup(&keys, &[pod(0)]);
    assert_eq!(found.matches[0].matched_blocks, DOC_BLOCKS - 20);
    assert!(found.galloped_blocks() > 0);
    // Routed again, the evicted tail comes back (as the continuation of the head's span:
    // `span`'s unit tests) and the walk gallops to the end.
    route(0, DOC_BLOCKS);
    let found = route(0, DOC_BLOCKS);
    assert_eq!(found.matches[0].matched_blocks, DOC_BLOCKS);
    assert!(
        found.galloped_blocks() > DOC_BLOCKS - 20,
        "galloped {} of {DOC_BLOCKS}",
        found.galloped_blocks()
    );
}

#[test]
fn an_approximate_pods_evicted_spans_are_recycled() {
    // More routed prompts than a pod has span ids (~131k): each takes a span and is evicted
    // again (capacity 8 blocks); ids freed by evictions are reused, so a long prefix routed
    // afterwards still gets spans and is galloped over.
    let index = PrefixIndex::new(IndexConfig::default());
    let context = KeyContext::model(MODEL);
    index.set_pod_capacity(pod(0), 8);
    index.set_pod_block_size(pod(0), BLOCK as u32);
    for n in 0..140_000u32 {
        let keys = PromptKeys::exact(context.clone(), vec![1_000_000 + n, n]);
        index.record_routed(pod(0), &keys, None);
    }
    index.set_pod_capacity(pod(0), 2 * DOC_BLOCKS);
    let docs = documents();
    let keys = PromptKeys::exact(context.clone(), docs[0].to_vec());
    index.record_routed(pod(0), &keys, None);
    let keys = PromptKeys::exact(context.clone(), docs[0].to_vec());
    let found = index.lookup(&keys, &[pod(0)]);
    assert_eq!(found.matches[0].matched_blocks, DOC_BLOCKS);
    assert!(
        found.galloped_blocks() > DOC_BLOCKS / 2,
        "galloped {} of {DOC_BLOCKS}",
        found.galloped_blocks()
    );
}
