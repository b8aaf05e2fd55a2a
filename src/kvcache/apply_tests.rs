//! A store's new blocks added as runs leave the index exactly as block by block: random event
//! streams (long chains, continuations, duplicate and repeated hashes, hashes reused for other
//! tokens, re-announcements, offload copies without tokens, removals tail first, clears,
//! small limits) applied to two indexes, one with runs from 1 block and one block by block.
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;

use super::*;
use crate::kvcache::index::IndexConfig;
use crate::kvcache::key::{KeyContext, block_keys};
use crate::kvcache::record::RUN_FROM;
use crate::kvcache::test_rng::TestRng as Rng;
use kvpick_kvevents_wire::BlockExtra;

const BLOCK: usize = 4;
const DOCS: usize = 5;
const DOC_BLOCKS: usize = 400;

fn pod(i: usize) -> PodId {
    PodId(SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16)))
}

/// Documents that share prefixes: doc `d` follows doc 0 for its first `40·d` blocks.
fn doc_tokens(d: usize) -> Vec<u32> {
    (0..DOC_BLOCKS * BLOCK)
        .map(|t| {
            let b = t / BLOCK;
            let family = if b < 40 * d { 0 } else { d };
            (family * 1_000_000 + t) as u32
        })
        .collect()
}

/// The engine hash vLLM would give block `b` of doc `d` (docs sharing a prefix share its
/// hashes), in engine generation `g` (a restarted engine hashes anew).
fn engine_hash(d: usize, b: usize, g: u64) -> EngineHash {
    let family = if b < 40 * d { 0 } else { d };
    EngineHash(((family as u64) << 32 | b as u64 | g << 48).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn store(
    hashes: Vec<EngineHash>,
    parent: Option<EngineHash>,
    tokens: Vec<u32>,
    tier: Tier,
) -> KvEvent {
    let blocks = hashes.len();
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: Some(BLOCK as u32),
        tier,
        extra: vec![BlockExtra::default(); blocks],
        ..BlockStored::default()
    })
}

fn removed(hash: EngineHash, tier: Tier) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![hash],
        tier,
        group_idx: None,
    })
}

/// One random batch of events for a pod; `held` tracks (hash, tier) stored so far, so
/// removals mostly name real blocks.
fn random_batch(
    rng: &mut Rng,
    docs: &[Vec<u32>],
    held: &mut Vec<(EngineHash, Tier)>,
) -> EventBatch {
    let mut events = Vec::new();
    for _ in 0..1 + rng.below(4) {
        let d = rng.below(DOCS);
        let tier = if rng.below(5) == 0 {
            Tier::Cpu
        } else {
            Tier::Gpu
        };
        let g = (rng.below(8) == 0) as u64;
        match rng.below(10) {
            // A chain from block 0 or continuing at a parent (maybe one the pod lacks).
            0..=4 => {
                let start = if rng.below(2) == 0 {
                    0
                } else {
                    rng.below(DOC_BLOCKS - 1)
                };
                let longest = if rng.below(3) == 0 { 300 } else { 90 };
                let len = 1 + rng.below(longest);
                let end = (start + len).min(DOC_BLOCKS);
                let mut hashes: Vec<EngineHash> =
                    (start..end).map(|b| engine_hash(d, b, g)).collect();
                let mut tokens = docs[d][start * BLOCK..end * BLOCK].to_vec();
                match rng.below(8) {
                    // A hash repeated inside the chain.
                    0 if hashes.len() > 2 => {
                        let (a, b) = (rng.below(hashes.len()), rng.below(hashes.len()));
                        hashes[b] = hashes[a];
                    }
                    // A hash reused for other tokens (another doc's block).
                    1 if hashes.len() > 2 => {
                        let at = rng.below(hashes.len());
                        hashes[at] = engine_hash((d + 1) % DOCS, rng.below(DOC_BLOCKS), g);
                    }
                    // The same tokens twice within the chain (not a repeated key: keys chain
                    // on their predecessor; `record`'s tests repeat keys in a run).
                    2 if hashes.len() > 8 => {
                        let at = 4 + rng.below(hashes.len() - 4);
                        let (head, tail) = tokens.split_at_mut(at * BLOCK);
                        tail[..BLOCK].copy_from_slice(&head[..BLOCK]);
                    }
                    _ => {}
                }
                let parent = (start > 0).then(|| engine_hash(d, start - 1, g));
                held.extend(hashes.iter().map(|h| (*h, tier)));
                events.push(store(hashes, parent, tokens, tier));
            }
            // An offload copy announced without tokens.
            5 => {
                let count = 1 + rng.below(80);
                let picked: Vec<EngineHash> = (0..count)
                    .filter_map(|_| {
                        let at = rng.below(held.len());
                        held.get(at).map(|(h, _)| *h)
                    })
                    .collect();
                held.extend(picked.iter().map(|h| (*h, Tier::Cpu)));
                events.push(store(picked, None, Vec::new(), Tier::Cpu));
            }
            // Evictions, newest first (as vLLM evicts a chain's leaves first), one event per
            // block.
            // Sometimes several blocks of one tier in one event, and now and then a hash the
            // pod never stored.
            6..=7 => {
                let count = rng.below(200);
                let per_event = 1 + rng.below(3);
                for _ in 0..count {
                    let Some((hash, tier)) = held.pop() else {
                        break;
                    };
                    let same_tier = |held: &Vec<(EngineHash, Tier)>| {
                        held.last().filter(|(_, t)| *t == tier).map(|(h, _)| *h)
                    };
                    let mut hashes = vec![hash];
                    while hashes.len() < per_event
                        && let Some(next) = same_tier(held)
                    {
                        held.pop();
                        hashes.push(next);
                    }
                    if rng.below(16) == 0 {
                        hashes.push(EngineHash(0xdead_0000 + rng.below(1 << 16) as u64));
                    }
                    events.push(KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: hashes,
                        tier,
                        group_idx: None,
                    }));
                }
            }
            // Evictions in any order, so a chain stored again may meet blocks still held
            // after its evicted head.
            8 => {
                let count = rng.below(100);
                for _ in 0..count.min(held.len()) {
                    let (hash, tier) = held.swap_remove(rng.below(held.len()));
                    events.push(removed(hash, tier));
                }
            }
            _ => {
                let tier = [None, Some(Tier::Gpu), Some(Tier::Cpu)][rng.below(3)];
                if tier.is_none() {
                    held.clear();
                } else {
                    held.retain(|(_, t)| Some(*t) != tier);
                }
                events.push(KvEvent::AllBlocksCleared { tier });
            }
        }
    }
    EventBatch {
        ts: 0.0,
        events,
        dp_rank: None,
    }
}

/// What one pod's state looks like from outside: per tier of each of `keys` the references,
/// the span and its intact length (what walks read); the pod's counters; and its hash map,
/// whole (what later events are keyed by, and what its limit counts).
type PodView = (
    Vec<(u16, Option<(SpanRef, u32)>)>,
    usize,
    Option<ApplyStats>,
    Vec<(EngineHash, BlockKey)>,
);

fn pod_view(index: &PrefixIndex, pod: PodId, keys: &BTreeSet<BlockKey>) -> PodView {
    let entry: Arc<PodEntry> = index.pod_or_insert(pod);
    let holding = keys
        .iter()
        .flat_map(|key| Tier::ALL.into_iter().map(move |tier| (*key, tier)))
        .map(|(key, tier)| {
            let refs = index.blocks.tier_refs(key, entry.slot, tier);
            let span = index
                .blocks
                .span_of(key, entry.slot, tier)
                .map(|span| (span, entry.spans.intact(span.id)));
            (refs, span)
        })
        .collect();
    let mut hashes: Vec<(EngineHash, BlockKey)> =
        entry.lock().by_hash.iter().map(|(h, k)| (*h, *k)).collect();
    hashes.sort();
    (
        holding,
        index.pod_entries(pod),
        index.pod_stats(pod),
        hashes,
    )
}

/// Two indexes fed the same batches, one adding stores' new blocks as runs from 1 block, one
/// block by block; `keys` are the keys compared (every key either index has keyed joins).
struct Pair {
    runs: PrefixIndex,
    steps: PrefixIndex,
    pods: usize,
    keys: BTreeSet<BlockKey>,
    /// The runs' index adds runs from this many blocks.
    run_from: usize,
}

impl Pair {
    fn new(pods: usize, capacity: Option<usize>, keys: BTreeSet<BlockKey>) -> Self {
        let config = IndexConfig {
            max_blocks_per_pod: 1 << 16,
            ..IndexConfig::default()
        };
        let pair = Pair {
            runs: PrefixIndex::new(config.clone()),
            steps: PrefixIndex::new(config),
            pods,
            keys,
            run_from: 1,
        };
        if let Some(capacity) = capacity {
            for p in 0..pods {
                pair.runs.set_pod_capacity(pod(p), capacity);
                pair.steps.set_pod_capacity(pod(p), capacity);
            }
        }
        pair
    }

    /// Applies `batch` from pod `p` to both and checks they agree; the batch's counters.
    fn apply(&mut self, p: usize, batch: &EventBatch, what: &str) -> ApplyStats {
        let a = self
            .runs
            .apply_batch_runs_from(pod(p), "m", batch, self.run_from);
        let b = self
            .steps
            .apply_batch_runs_from(pod(p), "m", batch, usize::MAX);
        assert_eq!(a, b, "{what}: the batch's counters");
        assert_eq!(
            self.runs.distinct_blocks(),
            self.steps.distinct_blocks(),
            "{what}: blocks in the index"
        );
        for index in [&self.runs, &self.steps] {
            for q in 0..self.pods {
                let entry = index.pod_or_insert(pod(q));
                self.keys.extend(entry.lock().by_hash.values().copied());
            }
        }
        for q in 0..self.pods {
            assert_eq!(
                pod_view(&self.runs, pod(q), &self.keys),
                pod_view(&self.steps, pod(q), &self.keys),
                "{what}, pod {q}"
            );
        }
        a
    }
}

fn check_runs_equal_block_by_block(seed: u64, capacity: Option<usize>, run_from: usize) {
    const PODS: usize = 2;
    let docs: Vec<Vec<u32>> = (0..DOCS).map(doc_tokens).collect();
    let keys = docs
        .iter()
        .flat_map(|tokens| block_keys(&KeyContext::model("m"), tokens, BLOCK as u32))
        .collect();
    let mut pair = Pair::new(PODS, capacity, keys);
    pair.run_from = run_from;
    let mut rng = Rng(seed | 1);
    let mut held: Vec<Vec<(EngineHash, Tier)>> = vec![Vec::new(); PODS];
    let mut added = 0;
    for step in 0..40 {
        let p = rng.below(PODS);
        let batch = random_batch(&mut rng, &docs, &mut held[p]);
        added += pair
            .apply(p, &batch, &format!("seed {seed}, step {step}"))
            .blocks_added;
    }
    assert!(added > 0, "seed {seed}: the stream stored nothing");
}

#[test]
fn stores_added_as_runs_are_held_as_block_by_block() {
    for seed in 1..=5 {
        check_runs_equal_block_by_block(seed * 0x9e37_79b9, None, 1);
        check_runs_equal_block_by_block(seed * 0xc2b2_ae35, None, RUN_FROM);
    }
}

#[test]
fn stores_added_as_runs_near_the_pods_limit_are_held_as_block_by_block() {
    // Capacity 300: limit 300 × 2 + 64 = 664 entries, so long chains meet the limit.
    for seed in 1..=5 {
        check_runs_equal_block_by_block(seed * 0x85eb_ca6b, Some(300), 1);
    }
}

#[test]
fn a_new_chain_added_as_runs_is_one_span() {
    // A new 300-block chain (block 0 alone block by block: it may be a re-announcement, then
    // runs) leaves one span of 300 consecutive offsets, intact.
    let index = PrefixIndex::new(IndexConfig::default());
    let tokens = doc_tokens(1);
    let hashes: Vec<EngineHash> = (0..300).map(|b| engine_hash(1, b, 0)).collect();
    let batch = EventBatch {
        ts: 0.0,
        events: vec![store(
            hashes,
            None,
            tokens[..300 * BLOCK].to_vec(),
            Tier::Gpu,
        )],
        dp_rank: None,
    };
    let stats = index.apply_batch_runs_from(pod(0), "m", &batch, 1);
    assert_eq!(stats.blocks_added, 300);
    let entry = index.pod_or_insert(pod(0));
    let keys = block_keys(
        &KeyContext::model("m"),
        &tokens[..300 * BLOCK],
        BLOCK as u32,
    );
    let spans: Vec<SpanRef> = keys
        .iter()
        .filter_map(|key| index.blocks.span_of(*key, entry.slot, Tier::Gpu))
        .collect();
    assert_eq!(spans.len(), 300);
    assert!(
        spans
            .iter()
            .enumerate()
            .all(|(k, s)| *s == spans[0].advanced(k))
    );
    assert_eq!(entry.spans.intact(spans[0].id), 300);
}

#[test]
fn a_run_stops_at_the_limit_of_the_pods_hash_map() {
    // One block re-announced under 200 hashes: the pod's map holds 200 hashes for 1 entry.
    // Its limit (capacity 100: 100 × 2 + 64 = 264) counts the hashes too, so a new chain of
    // 150 blocks has room for 64 more, not 263.
    let tokens = doc_tokens(2);
    let mut pair = Pair::new(1, Some(100), BTreeSet::new());
    let repeats = EventBatch {
        ts: 0.0,
        events: (0..200)
            .map(|g| {
                let block0 = tokens[..BLOCK].to_vec();
                store(vec![engine_hash(2, 0, g)], None, block0, Tier::Gpu)
            })
            .collect(),
        dp_rank: None,
    };
    let stats = pair.apply(0, &repeats, "re-announcements");
    assert_eq!((stats.blocks_added, stats.reannounced), (1, 199));
    let chain = EventBatch {
        ts: 0.0,
        events: vec![store(
            (1..151).map(|b| engine_hash(2, b, 0)).collect(),
            Some(engine_hash(2, 0, 0)),
            tokens[BLOCK..151 * BLOCK].to_vec(),
            Tier::Gpu,
        )],
        dp_rank: None,
    };
    let stats = pair.apply(0, &chain, "a chain at the limit");
    assert_eq!((stats.blocks_added, stats.capacity_drops), (64, 86));
}

#[test]
fn a_chain_stored_again_under_new_hashes_is_duplicates_as_block_by_block() {
    // An engine that hashes anew stores blocks the pod holds under other hashes: each is one
    // more reference. The run path declines at once (its first block is held) and backs off.
    let tokens = doc_tokens(3);
    let mut pair = Pair::new(1, None, BTreeSet::new());
    pair.run_from = RUN_FROM;
    for g in 0..3 {
        // Generation 0 from block 0; later ones continue its block 0 (a chain from block 0
        // whose blocks are held would be a re-announcement instead).
        let from = if g == 0 { 0 } else { 1 };
        let batch = EventBatch {
            ts: 0.0,
            events: vec![store(
                (from..300).map(|b| engine_hash(3, b, g)).collect(),
                (g > 0).then(|| engine_hash(3, 0, 0)),
                tokens[from * BLOCK..300 * BLOCK].to_vec(),
                Tier::Gpu,
            )],
            dp_rank: None,
        };
        let stats = pair.apply(0, &batch, &format!("generation {g}"));
        let expected = if g == 0 { (300, 0) } else { (0, 299) };
        assert_eq!((stats.blocks_added, stats.duplicate_stores), expected);
    }
}

#[test]
fn a_large_pods_removals_and_repeats_are_read_ahead_and_apply_exactly() {
    // 17,000 blocks: past READ_AHEAD_FROM_HASHES, so removals and block-by-block stores read
    // ahead. What they apply must be exact.
    let index = PrefixIndex::new(IndexConfig::default());
    let chains: Vec<(Vec<EngineHash>, Vec<u32>)> = (0..34u32)
        .map(|c| {
            let hashes = (0..500)
                .map(|b| EngineHash(u64::from(c) << 32 | b))
                .collect();
            let tokens = (0..500 * BLOCK as u32)
                .map(|t| c * 10_000_000 + t)
                .collect();
            (hashes, tokens)
        })
        .collect();
    for (hashes, tokens) in &chains {
        let batch = EventBatch {
            ts: 0.0,
            events: vec![store(hashes.clone(), None, tokens.clone(), Tier::Gpu)],
            dp_rank: None,
        };
        index.apply_batch(pod(0), "m", &batch);
    }
    assert_eq!(index.pod_entries(pod(0)), 17_000);
    const { assert!(17_000 >= READ_AHEAD_FROM_HASHES) };
    // Chain 0 announced again in full: block by block, each block a re-announcement.
    let again = EventBatch {
        ts: 0.0,
        events: vec![store(
            chains[0].0.clone(),
            None,
            chains[0].1.clone(),
            Tier::Gpu,
        )],
        dp_rank: None,
    };
    let stats = index.apply_batch(pod(0), "m", &again);
    assert_eq!((stats.reannounced, stats.blocks_added), (500, 0));
    // Chain 1 evicted tail first with 100 unknown hashes among its 500 (several read-ahead
    // stretches of 256), then chain 2's first 10 blocks twice.
    let mut events: Vec<KvEvent> = Vec::new();
    for (k, hash) in chains[1].0.iter().rev().enumerate() {
        events.push(removed(*hash, Tier::Gpu));
        if k % 5 == 0 {
            events.push(removed(EngineHash(u64::MAX - k as u64), Tier::Gpu));
        }
    }
    for hash in chains[2]
        .0
        .iter()
        .take(10)
        .chain(chains[2].0.iter().take(10))
    {
        events.push(removed(*hash, Tier::Gpu));
    }
    let stats = index.apply_batch(
        pod(0),
        "m",
        &EventBatch {
            ts: 0.0,
            events,
            dp_rank: None,
        },
    );
    assert_eq!((stats.blocks_removed, stats.unknown_removals), (510, 110));
    assert_eq!(index.pod_entries(pod(0)), 16_490);
    assert_eq!(index.distinct_blocks(), 16_490);
}
