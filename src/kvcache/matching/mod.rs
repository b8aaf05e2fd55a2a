//! Prefix matching: per candidate pod, the longest run of a request's leading blocks it holds.
//!
//! Why one pass over the blocks rather than one per pod: each block key is looked up once and
//! its holder list credits every candidate still on its run, so the cost is O(matched blocks
//! × holders per block), independent of how many candidates already dropped out, and the walk
//! stops at the first block that no candidate holds (confirmed or speculatively).
//!
//! Layout: this module is the lookup (what callers ask: [`PrefixIndex::lookup`], match per
//! block size, the debug view); [`walk`] is one walk over the blocks in pod-slot space;
//! [`gallop`] is how a walk jumps over spans with one probe.

use std::sync::atomic::Ordering;

mod gallop;
mod walk;

use super::index::PrefixIndex;
use super::key::{BlockKey, KeyContext};
use super::prompt_keys::{LazyKeys, PromptKeys};
use crate::endpoints::PodId;
use walk::{Walk, Walked};

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

/// The result of one lookup. The keys it computed stay in the request's [`PromptKeys`], where
/// the routing record of the chosen pod finds them.
#[derive(Clone, Debug)]
pub struct PrefixLookup {
    /// One match per candidate, in candidate order.
    pub matches: Vec<PrefixMatch>,
    /// Per candidate, the first block of its run it held only speculatively (`usize::MAX`
    /// when none): a record must refresh speculation from there.
    speculative_from: Vec<usize>,
    /// Blocks the walk proved held without visiting them (gallops).
    galloped: usize,
}

impl PrefixLookup {
    /// Blocks the lookup proved held without visiting them one by one (galloping over spans
    /// and speculative runs).
    pub fn galloped_blocks(&self) -> usize {
        self.galloped
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

/// Where a walk's block keys come from.
enum Keys<'a, 'k> {
    /// The prompt's own keys, computed on demand.
    Lazy(&'a mut LazyKeys<'k>),
    /// Computed already.
    Fixed(&'a [BlockKey]),
}

impl Keys<'_, '_> {
    /// The keys of blocks `0..blocks` (fewer when the prompt has fewer).
    fn upto(&mut self, blocks: usize) -> &[BlockKey] {
        match self {
            Keys::Lazy(keys) => keys.upto(blocks),
            Keys::Fixed(keys) => keys.get(..blocks.min(keys.len())).unwrap_or_default(),
        }
    }

    fn at(&mut self, block: usize) -> Option<BlockKey> {
        self.upto(block + 1).get(block).copied()
    }
}

impl PrefixIndex {
    /// For each candidate, the longest run of leading blocks of `tokens` it holds, keyed in
    /// `context` at the pod's block size: a one-off question (the debug view, tests). The
    /// request path asks [`Self::lookup`] with the request's own [`PromptKeys`] instead, so
    /// the routing record reuses the keys.
    pub fn match_prefix(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> Vec<PrefixMatch> {
        let keys = PromptKeys::exact(context.clone(), tokens.to_vec());
        self.lookup(&keys, candidates).matches
    }

    /// For each candidate, the longest run of the prompt's leading blocks it holds, at the
    /// pod's block size. Cost O(matched blocks × holders per block) per distinct block size
    /// among the candidates; stops at the first block no candidate holds. The keys computed
    /// on the way stay in `keys` for [`PrefixIndex::record_routed`]. A prompt that cannot be
    /// keyed (approximate, no model) matches nothing.
    pub fn lookup(&self, keys: &PromptKeys, candidates: &[PodId]) -> PrefixLookup {
        let started = std::time::Instant::now();
        let found = self.lookup_grouped(keys, candidates);
        if let Some(metrics) = &self.metrics {
            metrics
                .lookup_seconds
                .observe(started.elapsed().as_secs_f64());
            if let Some(total) = found.matches.iter().map(|m| m.total_blocks).max() {
                metrics.lookup_blocks.inc_by(total as u64);
            }
            metrics.galloped_blocks.inc_by(found.galloped as u64);
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

    fn lookup_grouped(&self, keys: &PromptKeys, candidates: &[PodId]) -> PrefixLookup {
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
            let walked = self.match_size(keys, size, candidates);
            return PrefixLookup {
                matches: walked.matches,
                speculative_from: walked.speculative_from,
                galloped: walked.galloped,
            };
        }
        let mut out: Vec<Option<PrefixMatch>> = vec![None; candidates.len()];
        let mut speculative_from = vec![usize::MAX; candidates.len()];
        let mut galloped = 0;
        for size in sizes {
            let group: Vec<(usize, PodId)> = candidates
                .iter()
                .enumerate()
                .filter(|(i, _)| per_candidate.get(*i) == Some(&size))
                .map(|(i, pod)| (i, *pod))
                .collect();
            let pods: Vec<PodId> = group.iter().map(|(_, pod)| *pod).collect();
            let walked = self.match_size(keys, size, &pods);
            galloped += walked.galloped;
            for (((i, _), found), from) in group
                .iter()
                .zip(walked.matches)
                .zip(walked.speculative_from)
            {
                if let Some(cell) = out.get_mut(*i) {
                    *cell = Some(found);
                }
                if let Some(cell) = speculative_from.get_mut(*i) {
                    *cell = from;
                }
            }
        }
        PrefixLookup {
            matches: out.into_iter().flatten().collect(),
            speculative_from,
            galloped,
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
        self.walk(&mut Keys::Fixed(keys), keys.len(), block_size, candidates)
            .matches
    }

    /// Matches at one block size, keying the prompt lazily; also returns per candidate the
    /// first block of its run held only speculatively.
    fn match_size(&self, keys: &PromptKeys, size: u32, candidates: &[PodId]) -> Walked {
        keys.with_keys(size, |lazy| {
            let (total, block_size) = (lazy.total_blocks(), lazy.block_size());
            self.walk(&mut Keys::Lazy(lazy), total, block_size, candidates)
        })
        .unwrap_or_else(|| Walk::new(self, candidates).finish(candidates, 0, size))
    }

    /// One walk over `total` blocks whose keys come from `keys`.
    fn walk(
        &self,
        keys: &mut Keys<'_, '_>,
        total: usize,
        block_size: u32,
        candidates: &[PodId],
    ) -> Walked {
        let mut walk = Walk::new(self, candidates);
        let blocks = self.blocks.reader(total);
        walk.run(self, &blocks, keys, total, candidates);
        walk.finish(candidates, total, block_size)
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
