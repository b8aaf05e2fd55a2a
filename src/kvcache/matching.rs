//! Prefix matching: per candidate pod, the longest run of a request's leading blocks it holds.
//!
//! Why one pass over the blocks rather than one per pod: each block key is looked up once and
//! its holder list credits every candidate still on its run, so the cost is O(matched blocks
//! × holders per block), independent of how many candidates already dropped out, and the walk
//! stops at the first block that no candidate holds (confirmed or speculatively).

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::blockmap::BlockMapReader;
use super::index::PrefixIndex;
use super::key::{BlockKey, KeyChain, KeyContext};
use crate::endpoints::PodId;

/// How much of a request's prefix one candidate pod holds.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PrefixMatch {
    /// The candidate (serialized as `ip:port`).
    #[serde(serialize_with = "serialize_pod")]
    pub pod: PodId,
    /// The block size the request was keyed at for this pod.
    pub block_size: u32,
    /// Full blocks in the request.
    pub total_blocks: usize,
    /// Leading blocks the pod holds in any tier.
    pub matched_blocks: usize,
    /// The same run, each block weighted by its best tier (gpu 1.0, cpu 0.8 by default).
    pub weighted_blocks: f64,
}

/// Serializes a [`PodId`] as its `ip:port` string.
pub fn serialize_pod<S: serde::Serializer>(pod: &PodId, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(pod)
}

impl PrefixMatch {
    /// Tokens covered by the matched blocks.
    pub fn matched_tokens(&self) -> usize {
        self.matched_blocks * self.block_size as usize
    }

    /// The prefix-cache score in [0, 1]: weighted matched blocks / total blocks.
    pub fn score(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            (self.weighted_blocks / self.total_blocks as f64).clamp(0.0, 1.0)
        }
    }
}

/// The result of one lookup: the matches, plus the block keys computed on the way so that the
/// routing record of the chosen pod does not hash the prompt again.
#[derive(Clone, Debug)]
pub struct PrefixLookup {
    /// One match per candidate, in candidate order.
    pub matches: Vec<PrefixMatch>,
    /// One chain per distinct block size among the candidates.
    chains: Vec<KeyChain>,
    /// Per candidate, the first block of its run it held only speculatively (`usize::MAX`
    /// when none): a record must refresh speculation from there.
    speculative_from: Vec<usize>,
}

impl PrefixLookup {
    /// Takes the key chain computed at `block_size` (if a candidate had that size).
    pub fn take_chain(&mut self, block_size: u32) -> Option<KeyChain> {
        let position = self
            .chains
            .iter()
            .position(|c| c.block_size() == block_size)?;
        Some(self.chains.swap_remove(position))
    }

    /// Leading blocks `pod` holds confirmed (from its events): its run up to the first block
    /// it held only speculatively. A routing record starts there, so the speculation it
    /// depends on is refreshed and the confirmed head is not touched.
    pub fn confirmed_run(&self, pod: PodId, block_size: u32) -> usize {
        self.matches
            .iter()
            .zip(&self.speculative_from)
            .find(|(m, _)| m.pod == pod && m.block_size == block_size)
            .map_or(0, |(m, from)| m.matched_blocks.min(*from))
    }
}

/// Blocks keyed ahead of the walk at a time: enough to amortise the call, few enough that a
/// walk that stops early hashes little beyond its stop.
const KEY_BATCH: usize = 32;

impl PrefixIndex {
    /// For each candidate, the longest run of leading blocks of `tokens` it holds, keyed in
    /// `context` at the pod's block size. Cost O(matched blocks × holders per block) per
    /// distinct block size among the candidates; stops at the first block no candidate holds.
    pub fn match_prefix(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> Vec<PrefixMatch> {
        self.lookup(context, tokens, candidates).matches
    }

    /// [`Self::match_prefix`], keeping the block keys computed for a later
    /// [`PrefixIndex::record_routed_lookup`].
    pub fn lookup(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> PrefixLookup {
        let started = std::time::Instant::now();
        let found = self.lookup_grouped(context, tokens, candidates);
        if let Some(metrics) = &self.metrics {
            metrics
                .lookup_seconds
                .observe(started.elapsed().as_secs_f64());
            if let Some(total) = found.matches.iter().map(|m| m.total_blocks).max() {
                metrics.lookup_blocks.inc_by(total as u64);
            }
            let best = found
                .matches
                .iter()
                .map(|m| m.matched_blocks)
                .max()
                .unwrap_or(0);
            metrics.hit_blocks.inc_by(best as u64);
        }
        found
    }

    fn lookup_grouped(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> PrefixLookup {
        let default_size = self.config().default_block_size.max(1);
        let per_candidate: Vec<u32> = {
            let table = self.table_read();
            candidates
                .iter()
                .map(|pod| {
                    table
                        .by_id
                        .get(pod)
                        .map(|entry| entry.block_size.load(Ordering::Relaxed))
                        .filter(|size| *size > 0)
                        .unwrap_or(default_size)
                })
                .collect()
        };
        let seed = context.seed();
        let mut sizes = per_candidate.clone();
        sizes.sort_unstable();
        sizes.dedup();
        if let [size] = sizes[..] {
            // The common case: one block size for every candidate.
            let mut chain = KeyChain::new(seed, size);
            let (matches, speculative_from) = self.match_chain(&mut chain, tokens, candidates);
            return PrefixLookup {
                matches,
                chains: vec![chain],
                speculative_from,
            };
        }
        let mut out: Vec<Option<PrefixMatch>> = vec![None; candidates.len()];
        let mut speculative_from = vec![usize::MAX; candidates.len()];
        let mut chains = Vec::with_capacity(sizes.len());
        for size in sizes {
            let group: Vec<(usize, PodId)> = candidates
                .iter()
                .enumerate()
                .filter(|(i, _)| per_candidate.get(*i) == Some(&size))
                .map(|(i, pod)| (i, *pod))
                .collect();
            let pods: Vec<PodId> = group.iter().map(|(_, pod)| *pod).collect();
            let mut chain = KeyChain::new(seed, size);
            let (found, from) = self.match_chain(&mut chain, tokens, &pods);
            for (((i, _), found), from) in group.iter().zip(found).zip(from) {
                if let Some(cell) = out.get_mut(*i) {
                    *cell = Some(found);
                }
                if let Some(cell) = speculative_from.get_mut(*i) {
                    *cell = from;
                }
            }
            chains.push(chain);
        }
        PrefixLookup {
            matches: out.into_iter().flatten().collect(),
            chains,
            speculative_from,
        }
    }

    /// The block size `pod`'s blocks are keyed at (learned from its events, else the default).
    pub fn block_size_for(&self, pod: PodId) -> u32 {
        self.pod_block_size(pod)
            .unwrap_or(self.config().default_block_size.max(1))
    }

    /// Like [`Self::match_prefix`] for keys already computed at `block_size`.
    pub fn match_keys(
        &self,
        keys: &[BlockKey],
        block_size: u32,
        candidates: &[PodId],
    ) -> Vec<PrefixMatch> {
        let mut walk = Walk::new(self, candidates);
        let blocks = self.blocks.reader(keys.len());
        for (i, key) in keys.iter().enumerate() {
            if !walk.step(self, &blocks, i, key) {
                break;
            }
        }
        walk.finish(candidates, keys.len(), block_size).0
    }

    /// Walks `tokens`' blocks, keying them lazily through `chain`; also returns per candidate
    /// the first block of its run held only speculatively.
    fn match_chain(
        &self,
        chain: &mut KeyChain,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> (Vec<PrefixMatch>, Vec<usize>) {
        let total = chain.total_blocks(tokens);
        let mut walk = Walk::new(self, candidates);
        let blocks = self.blocks.reader(total);
        let mut i = 0;
        'walk: while i < total {
            let keys = chain.extend_to(tokens, i + KEY_BATCH);
            for key in keys.get(i..).unwrap_or_default() {
                if !walk.step(self, &blocks, i, key) {
                    break 'walk;
                }
                i += 1;
            }
        }
        walk.finish(candidates, total, chain.block_size())
    }
}

/// The state of one walk over a request's blocks: per candidate position, its run so far.
struct Walk {
    weights: [f64; 3],
    run: Vec<usize>,
    weighted: Vec<f64>,
    last_weight: Vec<f64>,
    /// First block of each candidate's run credited by speculation alone.
    speculative_from: Vec<usize>,
    /// slot → candidate position (slots are small dense integers).
    position_of_slot: Vec<u32>,
    alive: usize,
    speculation: Option<Instant>,
}

impl Walk {
    fn new(index: &PrefixIndex, candidates: &[PodId]) -> Self {
        let mut position_of_slot: Vec<u32> = Vec::new();
        let mut alive = 0usize;
        {
            let table = index.table_read();
            position_of_slot.resize(table.slots.len(), u32::MAX);
            for (position, pod) in candidates.iter().enumerate() {
                if let Some(entry) = table.by_id.get(pod)
                    && let Some(cell) = position_of_slot.get_mut(entry.slot as usize)
                {
                    *cell = position as u32;
                    alive += 1;
                }
            }
        }
        Self {
            weights: index.config().tier_weights.0,
            run: vec![0; candidates.len()],
            weighted: vec![0.0; candidates.len()],
            last_weight: vec![0.0; candidates.len()],
            speculative_from: vec![usize::MAX; candidates.len()],
            position_of_slot,
            alive,
            speculation: (!index.speculative.is_empty()).then(Instant::now),
        }
    }

    /// Credits block `i` (key `key`) to every candidate on its run; false when the walk ends
    /// (no candidate holds the block, or none is left on its run).
    fn step(
        &mut self,
        index: &PrefixIndex,
        blocks: &BlockMapReader<'_>,
        i: usize,
        key: &BlockKey,
    ) -> bool {
        if self.alive == 0 {
            return false;
        }
        let mut extended = 0;
        let Walk {
            weights,
            run,
            weighted,
            last_weight,
            speculative_from,
            position_of_slot,
            ..
        } = self;
        let mut visit = |slot: u32, tier_weight: f64, speculative: bool| {
            let Some(&position) = position_of_slot.get(slot as usize) else {
                return;
            };
            let p = position as usize;
            let (Some(r), Some(w), Some(last)) =
                (run.get_mut(p), weighted.get_mut(p), last_weight.get_mut(p))
            else {
                return;
            };
            if *r == i {
                *r = i + 1;
                *w += tier_weight;
                *last = tier_weight;
                extended += 1;
                // Confirmed holders are visited first: credit here from speculation means
                // no confirmed copy of this block on this pod.
                if speculative && let Some(from) = speculative_from.get_mut(p) {
                    *from = (*from).min(i);
                }
            } else if *r == i + 1 && tier_weight > *last {
                *w += tier_weight - *last;
                *last = tier_weight;
            }
        };
        let mut found = blocks.visit(*key, |holder| {
            let tier_weight = weights.get(holder.tier as usize).copied().unwrap_or(0.0);
            visit(holder.slot, tier_weight, false);
        });
        if let Some(now) = self.speculation {
            let gpu_weight = weights.first().copied().unwrap_or(1.0);
            found |= index
                .speculative
                .visit(key, now, |slot| visit(slot, gpu_weight, true));
        }
        self.alive = extended;
        found && extended > 0
    }

    fn finish(
        self,
        candidates: &[PodId],
        total_blocks: usize,
        block_size: u32,
    ) -> (Vec<PrefixMatch>, Vec<usize>) {
        let matches = candidates
            .iter()
            .enumerate()
            .map(|(p, pod)| PrefixMatch {
                pod: *pod,
                block_size,
                total_blocks,
                matched_blocks: self.run.get(p).copied().unwrap_or(0),
                weighted_blocks: self.weighted.get(p).copied().unwrap_or(0.0),
            })
            .collect();
        (matches, self.speculative_from)
    }
}

/// The answer of `POST /debug/prefix` (DESIGN §2.1).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DebugPrefix {
    /// Tokens in the request.
    pub token_count: usize,
    /// Per candidate pod: block size, matched blocks and tokens.
    pub pods: Vec<DebugPrefixPod>,
}

/// One pod of [`DebugPrefix`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DebugPrefixPod {
    /// `ip:port`.
    pub address: String,
    /// Block size the request was keyed at for this pod.
    pub block_size: u32,
    /// Leading blocks held.
    pub matched_blocks: usize,
    /// Tokens those blocks cover.
    pub matched_tokens: usize,
}

impl PrefixIndex {
    /// The `POST /debug/prefix` view of a token list over `candidates`.
    pub fn debug_prefix(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> DebugPrefix {
        DebugPrefix {
            token_count: tokens.len(),
            pods: self
                .match_prefix(context, tokens, candidates)
                .into_iter()
                .map(|m| DebugPrefixPod {
                    address: m.pod.to_string(),
                    block_size: m.block_size,
                    matched_blocks: m.matched_blocks,
                    matched_tokens: m.matched_tokens(),
                })
                .collect(),
        }
    }
}
