//! Differential property test: random event streams (stores, removes, clears, duplicates,
//! re-announcements, chains starting at unknown parents, several pods and tiers) applied to
//! the index and to a naive reference model give the same match answers.

use kvpick::endpoints::PodId;
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex};
use kvpick::kvevents::{BlockExtra, BlockRemoved, BlockStored, KvEvent, Tier};
use proptest::prelude::*;

use crate::support;
use support::kv_reference::{Reference, batch, engine_hash, pod, tier};

const BLOCK: usize = 4;
const PODS: usize = 3;
const MODEL: &str = "m";

/// Documents share prefixes: block b of doc d uses tokens from a tiny alphabet.
fn documents() -> Vec<Vec<u32>> {
    let mut docs = Vec::new();
    for d in 0..6u32 {
        let mut tokens = Vec::new();
        for b in 0..6u32 {
            // Docs 0-2 share their first two blocks, 3-5 share the first one.
            let family = if b < 2 && d < 3 || b < 1 {
                d / 3
            } else {
                d * 10 + b
            };
            tokens.extend((0..BLOCK as u32).map(|t| family * 100 + b * 7 + t));
        }
        docs.push(tokens);
    }
    docs
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        pod: usize,
        doc: usize,
        start: usize,
        len: usize,
        tier: u8,
    },
    /// An offload copy announced without token ids (resolved through the hash map).
    StoreNoTokens {
        pod: usize,
        doc: usize,
        block: usize,
    },
    Remove {
        pod: usize,
        doc: usize,
        block: usize,
        tier: u8,
    },
    ClearAll {
        pod: usize,
    },
    ClearPod {
        pod: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..PODS, 0..6usize, 0..6usize, 1..4usize, 0..2u8)
            .prop_map(|(pod, doc, start, len, tier)| Op::Store { pod, doc, start, len, tier }),
        1 => (0..PODS, 0..6usize, 0..6usize)
            .prop_map(|(pod, doc, block)| Op::StoreNoTokens { pod, doc, block }),
        5 => (0..PODS, 0..6usize, 0..6usize, 0..2u8)
            .prop_map(|(pod, doc, block, tier)| Op::Remove { pod, doc, block, tier }),
        1 => (0..PODS).prop_map(|pod| Op::ClearAll { pod }),
        1 => (0..PODS).prop_map(|pod| Op::ClearPod { pod }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_reference(ops in proptest::collection::vec(op(), 1..80),
                               requests in proptest::collection::vec((0..6usize, 1..7usize), 1..6)) {
        let docs = documents();
        let index = PrefixIndex::new(IndexConfig::default());
        let mut reference = Reference::new(PODS, BLOCK);
        for op in &ops {
            match *op {
                Op::Store { pod: p, doc, start, len, tier: t } => {
                    let tokens = &docs[doc];
                    let end = (start + len).min(6);
                    let stored = BlockStored {
                        block_hashes: (start..end).map(|b| engine_hash(&tokens[..(b + 1) * BLOCK])).collect(),
                        parent_block_hash: (start > 0).then(|| engine_hash(&tokens[..start * BLOCK])),
                        token_ids: tokens[start * BLOCK..end * BLOCK].to_vec(),
                        block_size: Some(BLOCK as u32),
                        tier: tier(t),
                        extra: vec![BlockExtra::default(); end - start],
                        ..BlockStored::default()
                    };
                    index.apply_batch(pod(p), MODEL, &batch(KvEvent::BlockStored(stored)));
                    reference.store(p, tokens, start, (start + len).min(6), t as usize);
                }
                Op::StoreNoTokens { pod: p, doc, block } => {
                    let h = engine_hash(&docs[doc][..(block + 1) * BLOCK]);
                    let stored = BlockStored {
                        block_hashes: vec![h],
                        parent_block_hash: None,
                        tier: Tier::Cpu,
                        ..BlockStored::default()
                    };
                    index.apply_batch(pod(p), MODEL, &batch(KvEvent::BlockStored(stored)));
                    if reference.held_any(p, h) {
                        reference.refs[p].entry(h).or_default()[1] += 1;
                    }
                }
                Op::Remove { pod: p, doc, block, tier: t } => {
                    let h = engine_hash(&docs[doc][..(block + 1) * BLOCK]);
                    let removed = BlockRemoved { block_hashes: vec![h], tier: tier(t), group_idx: None };
                    index.apply_batch(pod(p), MODEL, &batch(KvEvent::BlockRemoved(removed)));
                    reference.remove(p, h, t as usize);
                }
                Op::ClearAll { pod: p } => {
                    index.apply_batch(pod(p), MODEL, &batch(KvEvent::AllBlocksCleared { tier: None }));
                    reference.refs[p].clear();
                }
                Op::ClearPod { pod: p } => {
                    index.clear_pod(pod(p));
                    reference.refs[p].clear();
                }
            }
            // Bookkeeping agrees after every step.
            for p in 0..PODS {
                let expected: usize = reference.refs[p].values()
                    .map(|r| r.iter().filter(|c| **c > 0).count())
                    .sum();
                prop_assert_eq!(index.pod_entries(pod(p)), expected);
            }
        }
        let candidates: Vec<PodId> = (0..PODS).map(pod).collect();
        for (doc, blocks) in requests {
            let request = &docs[doc][..blocks * BLOCK];
            let found = index.match_prefix(&KeyContext::model(MODEL), request, &candidates);
            for (p, m) in found.iter().enumerate() {
                let (blocks, weighted) = reference.matched(p, request);
                prop_assert_eq!(m.matched_blocks, blocks, "pod {} doc {}", p, doc);
                prop_assert!((m.weighted_blocks - weighted).abs() < 1e-9);
            }
        }
    }
}
