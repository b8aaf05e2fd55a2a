//! Prefix matching: per candidate pod, the longest run of a request's leading blocks it holds.
//!
//! Why one pass over the blocks rather than one per pod: each block key is looked up once and
//! its holder list credits every candidate still on its run, so the cost is O(matched blocks
//! × holders per block), independent of how many candidates already dropped out, and the walk
//! stops at the first block that no candidate holds (confirmed or speculatively).

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::index::PrefixIndex;
use super::key::{BlockKey, BlockKeys, KeyContext};
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
        let started = std::time::Instant::now();
        let found = self.match_grouped(context, tokens, candidates);
        if let Some(metrics) = &self.metrics {
            metrics
                .lookup_seconds
                .observe(started.elapsed().as_secs_f64());
            if let Some(total) = found.iter().map(|m| m.total_blocks).max() {
                metrics.lookup_blocks.inc_by(total as u64);
            }
            let best = found.iter().map(|m| m.matched_blocks).max().unwrap_or(0);
            metrics.hit_blocks.inc_by(best as u64);
        }
        found
    }

    fn match_grouped(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> Vec<PrefixMatch> {
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
        let mut sizes = per_candidate.clone();
        sizes.sort_unstable();
        sizes.dedup();
        if let [size] = sizes[..] {
            // The common case: one block size for every candidate.
            let keys = BlockKeys::new(context, tokens, size);
            let total = keys.len();
            return self.match_iter(keys, total, size, candidates);
        }
        let mut out: Vec<Option<PrefixMatch>> = vec![None; candidates.len()];
        for size in sizes {
            let group: Vec<(usize, PodId)> = candidates
                .iter()
                .enumerate()
                .filter(|(i, _)| per_candidate.get(*i) == Some(&size))
                .map(|(i, pod)| (i, *pod))
                .collect();
            // Keys are computed lazily: only as far as some candidate still matches.
            let keys = BlockKeys::new(context, tokens, size);
            let total = keys.len();
            let pods: Vec<PodId> = group.iter().map(|(_, pod)| *pod).collect();
            for ((i, _), found) in group.iter().zip(self.match_iter(keys, total, size, &pods)) {
                if let Some(cell) = out.get_mut(*i) {
                    *cell = Some(found);
                }
            }
        }
        out.into_iter().flatten().collect()
    }

    pub(super) fn block_size_for(&self, pod: PodId) -> u32 {
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
        self.match_iter(keys.iter().copied(), keys.len(), block_size, candidates)
    }

    fn match_iter(
        &self,
        keys: impl Iterator<Item = BlockKey>,
        total_blocks: usize,
        block_size: u32,
        candidates: &[PodId],
    ) -> Vec<PrefixMatch> {
        let weights = self.config().tier_weights.0;
        let mut run = vec![0usize; candidates.len()];
        let mut weighted = vec![0f64; candidates.len()];
        let mut last_weight = vec![0f64; candidates.len()];
        // slot → candidate position, built once per call (slots are small dense integers).
        let mut position_of_slot: Vec<u32> = Vec::new();
        let mut alive = 0usize;
        {
            let table = self.table_read();
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
        let speculation = (!self.speculative.is_empty()).then(Instant::now);
        let gpu_weight = weights.first().copied().unwrap_or(1.0);
        for (i, key) in keys.enumerate() {
            if alive == 0 {
                break;
            }
            let key = &key;
            let mut extended = 0;
            let mut visit = |slot: u32, tier_weight: f64| {
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
                } else if *r == i + 1 && tier_weight > *last {
                    *w += tier_weight - *last;
                    *last = tier_weight;
                }
            };
            let mut found = false;
            if let Some(holders) = self.blocks.get(key) {
                found = true;
                for holder in holders.iter() {
                    let tier_weight = weights.get(holder.tier as usize).copied().unwrap_or(0.0);
                    visit(holder.slot, tier_weight);
                }
            }
            // The block map's guard is released before the speculative map is read.
            if let Some(now) = speculation {
                found |= self
                    .speculative
                    .visit(key, now, |slot| visit(slot, gpu_weight));
            }
            if !found {
                break;
            }
            alive = extended;
        }
        candidates
            .iter()
            .enumerate()
            .map(|(p, pod)| PrefixMatch {
                pod: *pod,
                block_size,
                total_blocks,
                matched_blocks: run.get(p).copied().unwrap_or(0),
                weighted_blocks: weighted.get(p).copied().unwrap_or(0.0),
            })
            .collect()
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
