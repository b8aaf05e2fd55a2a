//! Prefix matching: per candidate pod, the longest run of a request's leading blocks it holds.
//!
//! Why one pass over the blocks rather than one per pod: each block key is looked up once and
//! its holder list credits every candidate still on its run, so the cost is O(matched blocks
//! × holders per block), independent of how many candidates already dropped out, and the walk
//! stops at the first block that no candidate holds (confirmed or speculatively).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::blockmap::{BlockMapReader, HeldBy, TIERS};
use super::index::{PodEntry, PrefixIndex};
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
    chains: Vec<LookupChain>,
    /// Per candidate, the first block of its run it held only speculatively (`usize::MAX`
    /// when none): a record must refresh speculation from there.
    speculative_from: Vec<usize>,
    /// Blocks the walk proved held without visiting them (gallops).
    galloped: usize,
}

/// A lookup's key chain: computed by the lookup, or the request's own (shared, copied only
/// if a routing record takes it).
#[derive(Clone, Debug)]
enum LookupChain {
    Owned(KeyChain),
    Shared(Arc<KeyChain>),
}

impl LookupChain {
    fn block_size(&self) -> u32 {
        match self {
            LookupChain::Owned(chain) => chain.block_size(),
            LookupChain::Shared(chain) => chain.block_size(),
        }
    }
}

impl PrefixLookup {
    /// Blocks the lookup proved held without visiting them one by one (galloping over spans
    /// and speculative runs).
    pub fn galloped_blocks(&self) -> usize {
        self.galloped
    }

    /// Takes the key chain computed at `block_size` (if a candidate had that size).
    pub fn take_chain(&mut self, block_size: u32) -> Option<KeyChain> {
        let position = self
            .chains
            .iter()
            .position(|c| c.block_size() == block_size)?;
        Some(match self.chains.swap_remove(position) {
            LookupChain::Owned(chain) => chain,
            LookupChain::Shared(chain) => Arc::unwrap_or_clone(chain),
        })
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

/// Keys probed ahead of the walk at a time (see [`Walk::run`]).
const PROBE_GROUP: usize = 8;

/// The smallest jump a gallop tries ([`Walk::gallop`]).
const MIN_JUMP: usize = 16;

/// Blocks stepped one by one after a gallop that could not jump at all, before the next try
/// (bounds the cost of trying where spans do not help: ~4 probes per 32 blocks).
const GALLOP_BACKOFF: usize = 32;

/// Where a walk's block keys come from.
enum Keys<'a> {
    /// Computed on demand from the prompt's tokens.
    Chain {
        chain: &'a mut KeyChain,
        tokens: &'a [u32],
    },
    /// Computed already.
    Fixed(&'a [BlockKey]),
}

impl Keys<'_> {
    /// The keys of blocks `0..blocks` (fewer when the prompt has fewer).
    fn upto(&mut self, blocks: usize) -> &[BlockKey] {
        match self {
            Keys::Chain { chain, tokens } => chain.extend_to(tokens, blocks),
            Keys::Fixed(keys) => keys.get(..blocks.min(keys.len())).unwrap_or_default(),
        }
    }

    fn at(&mut self, block: usize) -> Option<BlockKey> {
        self.upto(block + 1).get(block).copied()
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
        self.lookup_keyed(context, tokens, None, candidates)
    }

    /// [`Self::lookup`] with the request's block keys computed already (`keys`, in
    /// `context`): used where their seed and block size fit, else the lookup keys itself.
    pub fn lookup_keyed(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        keys: Option<&Arc<KeyChain>>,
        candidates: &[PodId],
    ) -> PrefixLookup {
        let started = std::time::Instant::now();
        let found = self.lookup_grouped(context, tokens, keys, candidates);
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

    fn lookup_grouped(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        keys: Option<&Arc<KeyChain>>,
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
        // The request's own keys, where they are this chain's (same seed and size, every
        // full block keyed).
        let precomputed = |size: u32| {
            keys.filter(|k| {
                k.seed() == seed
                    && k.block_size() == size
                    && k.keys().len() == tokens.len() / size.max(1) as usize
            })
        };
        let mut sizes = per_candidate.clone();
        sizes.sort_unstable();
        sizes.dedup();
        if let [size] = sizes[..] {
            // The common case: one block size for every candidate.
            let (walked, chain) =
                self.match_size(seed, size, precomputed(size), tokens, candidates);
            return PrefixLookup {
                matches: walked.matches,
                chains: vec![chain],
                speculative_from: walked.speculative_from,
                galloped: walked.galloped,
            };
        }
        let mut out: Vec<Option<PrefixMatch>> = vec![None; candidates.len()];
        let mut speculative_from = vec![usize::MAX; candidates.len()];
        let mut chains = Vec::with_capacity(sizes.len());
        let mut galloped = 0;
        for size in sizes {
            let group: Vec<(usize, PodId)> = candidates
                .iter()
                .enumerate()
                .filter(|(i, _)| per_candidate.get(*i) == Some(&size))
                .map(|(i, pod)| (i, *pod))
                .collect();
            let pods: Vec<PodId> = group.iter().map(|(_, pod)| *pod).collect();
            let (walked, chain) = self.match_size(seed, size, precomputed(size), tokens, &pods);
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
            chains.push(chain);
        }
        PrefixLookup {
            matches: out.into_iter().flatten().collect(),
            chains,
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
        self.walk_keys(keys, block_size, candidates).matches
    }

    /// Walks keys already computed at `block_size`.
    fn walk_keys(&self, keys: &[BlockKey], block_size: u32, candidates: &[PodId]) -> Walked {
        let mut walk = Walk::new(self, candidates);
        let blocks = self.blocks.reader(keys.len());
        walk.run(
            self,
            &blocks,
            &mut Keys::Fixed(keys),
            keys.len(),
            candidates,
        );
        walk.finish(candidates, keys.len(), block_size)
    }

    /// Matches at one block size: over `precomputed` keys when given, else keying lazily;
    /// also returns per candidate the first block of its run held only speculatively, and
    /// the chain for a later routing record.
    fn match_size(
        &self,
        seed: u64,
        size: u32,
        precomputed: Option<&Arc<KeyChain>>,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> (Walked, LookupChain) {
        match precomputed {
            Some(chain) => {
                let walked = self.walk_keys(chain.keys(), size, candidates);
                (walked, LookupChain::Shared(Arc::clone(chain)))
            }
            None => {
                let mut chain = KeyChain::new(seed, size);
                let walked = self.match_chain(&mut chain, tokens, candidates);
                (walked, LookupChain::Owned(chain))
            }
        }
    }

    /// Walks `tokens`' blocks, keying them lazily through `chain`.
    fn match_chain(&self, chain: &mut KeyChain, tokens: &[u32], candidates: &[PodId]) -> Walked {
        let total = chain.total_blocks(tokens);
        let block_size = chain.block_size();
        let mut walk = Walk::new(self, candidates);
        let blocks = self.blocks.reader(total);
        walk.run(
            self,
            &blocks,
            &mut Keys::Chain { chain, tokens },
            total,
            candidates,
        );
        walk.finish(candidates, total, block_size)
    }
}

/// What a walk found: per candidate its match and the first block of its run held only
/// speculatively, and how many blocks it galloped over.
struct Walked {
    matches: Vec<PrefixMatch>,
    speculative_from: Vec<usize>,
    galloped: usize,
}

/// The state of one walk over a request's blocks, in pod-slot space: a bitset of the
/// candidates still on their run, intersected block by block with the block's holders.
///
/// Why bitsets: a prefix every pod holds (a shared system prompt) has as many holders per
/// block as pods; intersecting a few words per block costs the same for 1 or 256 holders.
/// Per-candidate work happens only when a candidate leaves its run (once), changes the tier
/// it holds the run in (tier weights are charged per stretch of blocks, not per block), or
/// first holds a block only speculatively. A block with a single holder (the common case
/// for a prefix only one pod has) takes a path without bitsets at all. Where every candidate
/// still on its run holds the prefix in GPU as part of a span (see [`super::span`]), the walk
/// gallops: one probe verifies a jump over many blocks.
struct Walk {
    /// Weight lost per block against GPU, per tier class (gpu 0, cpu, slower).
    penalty: [f64; TIERS],
    gpu_weight: f64,
    /// slot → candidate position (`u32::MAX`: not a candidate).
    position_of_slot: Vec<u32>,
    /// Candidate slots still on their run, and how many.
    alive: Vec<u64>,
    alive_count: usize,
    /// Per tier class (cpu, slower), the alive slots whose best tier for the current stretch
    /// is that class (GPU is the rest).
    class: [Vec<u64>; 2],
    /// Per candidate position: where its current tier stretch began.
    stretch_from: Vec<usize>,
    /// Per candidate position: where its run ended (`usize::MAX`: still running).
    run_end: Vec<usize>,
    /// Per candidate position: Σ (gpu weight − best tier weight) over its run.
    weight_loss: Vec<f64>,
    /// Per candidate position: first block of its run held only speculatively.
    speculative_from: Vec<usize>,
    /// Slots already given a `speculative_from`.
    speculative_seen: Vec<u64>,
    /// Scratch per block: holders per tier (see `blockmap::More::bits`), speculative holders.
    held: Vec<u64>,
    speculative: Vec<u64>,
    /// The previous block's holder bits, when it took the bitset path without speculation:
    /// a block with the same holders changes nothing (the usual case inside a shared prefix).
    previous_held: Vec<u64>,
    previous_valid: bool,
    /// Blocks the surviving candidates have run through.
    walked: usize,
    speculation: Option<Instant>,
    /// Per candidate position: its pod's entry (for span intact lengths), if indexed; filled
    /// by the first gallop (a walk that never gallops does not pay for it).
    pods: Vec<Option<Arc<PodEntry>>>,
    /// The first block after which a gallop may be tried.
    next_gallop: usize,
    /// Scratch of [`Self::verify`]: candidates proven so far.
    proven: Vec<u64>,
    /// Blocks jumped over.
    galloped: usize,
}

/// Calls `f` with each slot whose bit is set in `word` (bit `b` of word `w` = slot `64w + b`).
#[inline]
fn for_each_slot(w: usize, mut word: u64, mut f: impl FnMut(usize)) {
    while word != 0 {
        let bit = word.trailing_zeros() as usize;
        f(w * 64 + bit);
        word &= word - 1;
    }
}

impl Walk {
    fn new(index: &PrefixIndex, candidates: &[PodId]) -> Self {
        let mut position_of_slot: Vec<u32> = Vec::new();
        let words;
        let mut alive;
        let mut alive_count = 0;
        {
            let table = index.table_read();
            position_of_slot.resize(table.slots.len(), u32::MAX);
            words = table.slots.len().div_ceil(64);
            alive = vec![0u64; words];
            for (position, pod) in candidates.iter().enumerate() {
                if let Some(entry) = table.by_id.get(pod)
                    && let Some(cell) = position_of_slot.get_mut(entry.slot as usize)
                    && let Some(w) = alive.get_mut(entry.slot as usize / 64)
                {
                    *cell = position as u32;
                    *w |= 1u64 << (entry.slot % 64);
                    alive_count += 1;
                }
            }
        }
        let weights = index.config().tier_weights.0;
        let gpu_weight = weights.first().copied().unwrap_or(1.0);
        let weight = |t: usize| weights.get(t).copied().unwrap_or(0.0);
        Self {
            penalty: [0.0, gpu_weight - weight(1), gpu_weight - weight(2)],
            gpu_weight,
            position_of_slot,
            alive,
            alive_count,
            class: [vec![0; words], vec![0; words]],
            stretch_from: vec![0; candidates.len()],
            run_end: vec![usize::MAX; candidates.len()],
            weight_loss: vec![0.0; candidates.len()],
            speculative_from: vec![usize::MAX; candidates.len()],
            speculative_seen: vec![0; words],
            held: vec![0; words * TIERS],
            speculative: vec![0; words],
            previous_held: vec![0; words * TIERS],
            previous_valid: false,
            walked: 0,
            speculation: (!index.speculative.is_empty()).then(Instant::now),
            pods: Vec::new(),
            next_gallop: if index.config().gallop { 0 } else { usize::MAX },
            proven: vec![0; words],
            galloped: 0,
        }
    }

    /// Walks blocks `0..total`, stepping block by block and galloping where it can.
    fn run(
        &mut self,
        index: &PrefixIndex,
        blocks: &BlockMapReader<'_>,
        keys: &mut Keys<'_>,
        total: usize,
        candidates: &[PodId],
    ) {
        let mut i = 0;
        while i < total {
            // Key a batch ahead, then step a group of it.
            let batch = keys.upto(i + KEY_BATCH);
            let mut group = [BlockKey(0); PROBE_GROUP];
            let n = batch.len().saturating_sub(i).min(PROBE_GROUP);
            if n == 0 {
                return;
            }
            for (slot, key) in group
                .iter_mut()
                .zip(batch.get(i..i + n).unwrap_or_default())
            {
                *slot = *key;
            }
            let group = group.get(..n).unwrap_or_default();
            // NOTE: probing a group of keys ahead, results unused, lets the CPU overlap their
            // cache misses (the walk's own probes depend on branches it cannot run ahead of);
            // the walk then finds them in cache. At most a group is probed past the end.
            std::hint::black_box(blocks.probe(group));
            let mut next = i + n;
            for (j, key) in (i..).zip(group) {
                if !self.step(index, blocks, j, key) {
                    return;
                }
                if j >= self.next_gallop && self.may_gallop() {
                    self.load_pods(index, candidates);
                    let reached = self.gallop(index, blocks, keys, j, total);
                    self.next_gallop = if reached > j {
                        reached + 1 + MIN_JUMP / 4
                    } else {
                        j + GALLOP_BACKOFF
                    };
                    if reached > j {
                        next = reached + 1;
                        break;
                    }
                }
            }
            i = next;
        }
    }

    /// Fills [`Self::pods`] (once).
    fn load_pods(&mut self, index: &PrefixIndex, candidates: &[PodId]) {
        if !self.pods.is_empty() {
            return;
        }
        let table = index.table_read();
        // NOTE: a pod purged and re-added since the walk began has another slot; its entry
        // must not vouch for the old slot's holders.
        let position_of_slot = &self.position_of_slot;
        self.pods = candidates
            .iter()
            .enumerate()
            .map(|(position, pod)| {
                table.by_id.get(pod).filter(|entry| {
                    position_of_slot.get(entry.slot as usize).copied() == Some(position as u32)
                })
            })
            .map(|entry| entry.cloned())
            .collect();
    }

    /// Whether a gallop can apply: candidates are on their run, all in the GPU class.
    fn may_gallop(&self) -> bool {
        self.alive_count > 0 && self.class.iter().all(|c| c.iter().all(|w| *w == 0))
    }

    /// After block `i` (every alive candidate on its run, GPU class): jumps ahead as far as
    /// one probe can prove that every alive candidate holds each block in between in GPU;
    /// returns the last block the run now covers (`i` when no jump was proven).
    ///
    /// Proof of a jump to `t`: each alive candidate holds key `t` in GPU at offset `o` of a
    /// span intact beyond `o`, with `o ≥ t − i − 1`; so it holds the `o` blocks before `t` in
    /// that span too, and they are this request's blocks `t − o .. t` (chained keys). Nothing
    /// else can change in between: no tier change (GPU is the best), no speculation-only block,
    /// no run end.
    fn gallop(
        &mut self,
        index: &PrefixIndex,
        blocks: &BlockMapReader<'_>,
        keys: &mut Keys<'_>,
        mut i: usize,
        total: usize,
    ) -> usize {
        let last = total.saturating_sub(1);
        // The first jump: as far as every alive candidate's span at `i` is known intact.
        let mut jump = match keys.at(i) {
            Some(key) => self.verify(index, blocks, key, 0).unwrap_or(0),
            None => return i,
        }
        .max(MIN_JUMP);
        while jump >= MIN_JUMP / 4 {
            let t = (i + jump).min(last);
            if t <= i {
                break;
            }
            let Some(key) = keys.at(t) else {
                break;
            };
            match self.verify(index, blocks, key, t - i - 1) {
                Some(ahead) => {
                    // Blocks i+1 .. t-1 were not visited (t itself was probed).
                    self.galloped += t - i - 1;
                    i = t;
                    self.walked = t + 1;
                    self.previous_valid = false;
                    jump = ahead.max(MIN_JUMP);
                }
                None => jump /= 2,
            }
        }
        i
    }

    /// Whether every alive candidate holds `key` and the `back` blocks before it in GPU (at an
    /// offset ≥ `back` of a span intact beyond it) or, for a candidate whose run already went
    /// speculative, speculatively (an entry whose run is intact back as far); if so, the fewest
    /// blocks any of them is known to hold after `key` in its span.
    fn verify(
        &mut self,
        index: &PrefixIndex,
        blocks: &BlockMapReader<'_>,
        key: BlockKey,
        back: usize,
    ) -> Option<usize> {
        let mut proven = 0usize;
        let mut ahead = usize::MAX;
        self.proven.fill(0);
        let (alive, pods, position_of_slot, proven_bits) = (
            &self.alive,
            &self.pods,
            &self.position_of_slot,
            &mut self.proven,
        );
        blocks.gpu_spans(key, |slot, span| {
            let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
            if alive.get(w).is_none_or(|word| word & bit == 0) || usize::from(span.offset) < back {
                return;
            }
            let Some(pod) = position_of_slot
                .get(slot as usize)
                .and_then(|p| pods.get(*p as usize))
                .and_then(|p| p.as_ref())
            else {
                return;
            };
            // One load: a concurrent removal may lower it, never between two reads of ours.
            let intact = pod.spans.intact(span.id) as usize;
            let offset = usize::from(span.offset);
            if span.is_some()
                && intact > offset
                && let Some(cell) = proven_bits.get_mut(w)
                && *cell & bit == 0
            {
                *cell |= bit;
                proven += 1;
                ahead = ahead.min(intact - 1 - offset);
            }
        });
        if proven < self.alive_count
            && let Some(now) = self.speculation
        {
            let seen = &self.speculative_seen;
            index.speculative.visit(&key, now, |holder| {
                let (w, bit) = (holder.slot as usize / 64, 1u64 << (holder.slot % 64));
                let on_run = alive.get(w).is_some_and(|word| word & bit != 0);
                // Only a candidate already marked speculative: the first block it holds only
                // speculatively must be found by a step.
                let went_speculative = seen.get(w).is_some_and(|word| word & bit != 0);
                if on_run
                    && went_speculative
                    && holder.run_back as usize > back
                    && let Some(cell) = proven_bits.get_mut(w)
                    && *cell & bit == 0
                {
                    *cell |= bit;
                    proven += 1;
                    ahead = ahead.min(holder.run_ahead as usize);
                }
            });
        }
        (proven == self.alive_count).then_some(ahead)
    }

    /// Position of a candidate slot.
    fn position(&self, slot: usize) -> Option<usize> {
        self.position_of_slot
            .get(slot)
            .filter(|p| **p != u32::MAX)
            .map(|p| *p as usize)
    }

    /// The tier class `slot` is in (0 gpu, 1 cpu, 2 slower).
    fn class_of(&self, slot: usize) -> usize {
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        let in_class = |c: &Vec<u64>| c.get(w).is_some_and(|word| word & bit != 0);
        match &self.class {
            [cpu, _] if in_class(cpu) => 1,
            [_, slower] if in_class(slower) => 2,
            _ => 0,
        }
    }

    /// Charges `slot`'s current tier stretch up to block `i` (exclusive) and starts a new one.
    fn close_stretch(&mut self, slot: usize, i: usize) {
        let penalty = self
            .penalty
            .get(self.class_of(slot))
            .copied()
            .unwrap_or(0.0);
        if let Some(p) = self.position(slot)
            && let (Some(from), Some(loss)) =
                (self.stretch_from.get_mut(p), self.weight_loss.get_mut(p))
        {
            if penalty != 0.0 {
                *loss += (i.saturating_sub(*from)) as f64 * penalty;
            }
            *from = i;
        }
    }

    /// Ends the run of `slot` at block `i`.
    fn end_run(&mut self, slot: usize, i: usize) {
        self.close_stretch(slot, i);
        if let Some(p) = self.position(slot)
            && let Some(end) = self.run_end.get_mut(p)
        {
            *end = i;
        }
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        let [cpu, slower] = &mut self.class;
        for word in [self.alive.get_mut(w), cpu.get_mut(w), slower.get_mut(w)]
            .into_iter()
            .flatten()
        {
            *word &= !bit;
        }
        self.alive_count = self.alive_count.saturating_sub(1);
    }

    /// Moves `slot` into tier class `class` from block `i` on (no-op when already there).
    fn set_class(&mut self, slot: usize, class: usize, i: usize) {
        if self.class_of(slot) == class {
            return;
        }
        self.close_stretch(slot, i);
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        for (c, words) in self.class.iter_mut().enumerate() {
            if let Some(word) = words.get_mut(w) {
                *word = if c + 1 == class {
                    *word | bit
                } else {
                    *word & !bit
                };
            }
        }
    }

    /// Intersects the run with block `i` (key `key`); false when no candidate is left on it.
    fn step(
        &mut self,
        index: &PrefixIndex,
        blocks: &BlockMapReader<'_>,
        i: usize,
        key: &BlockKey,
    ) -> bool {
        let mut held_by = blocks.held_by(*key, &mut self.held);
        let mut any_speculative = false;
        if let Some(now) = self.speculation {
            self.speculative.fill(0);
            let speculative = &mut self.speculative;
            any_speculative = index.speculative.visit(key, now, |holder| {
                if let Some(word) = speculative.get_mut(holder.slot as usize / 64) {
                    *word |= 1u64 << (holder.slot % 64);
                }
            });
        }
        if any_speculative {
            // Mixed with speculation: the general path needs the confirmed holders as bits.
            match held_by {
                HeldBy::Nobody => self.held.fill(0),
                HeldBy::One { slot, tier } => {
                    self.held.fill(0);
                    let word = slot as usize / 64 * TIERS + tier as usize;
                    if let Some(w) = self.held.get_mut(word) {
                        *w |= 1u64 << (slot % 64);
                    }
                }
                HeldBy::Many => {}
            }
            held_by = HeldBy::Many;
        }
        let on_run = match held_by {
            HeldBy::Nobody => {
                self.end_all(i);
                false
            }
            HeldBy::One { slot, tier } => self.step_one(slot as usize, tier as usize, i),
            HeldBy::Many
                if !any_speculative && self.previous_valid && self.held == self.previous_held =>
            {
                // Same holders as the previous block, which left every alive slot holding it
                // in the same tier class: nothing changes.
                true
            }
            HeldBy::Many => {
                let on_run = self.step_many(i, any_speculative);
                if !any_speculative {
                    self.previous_held.copy_from_slice(&self.held);
                }
                on_run
            }
        };
        self.previous_valid = matches!(held_by, HeldBy::Many) && !any_speculative;
        if on_run {
            self.walked = i + 1;
        }
        on_run
    }

    /// Ends every run at block `i`.
    fn end_all(&mut self, i: usize) {
        for w in 0..self.alive.len() {
            let alive = self.alive.get(w).copied().unwrap_or(0);
            for_each_slot(w, alive, |slot| self.end_run(slot, i));
        }
    }

    /// Block `i` held by one (slot, tier) only.
    fn step_one(&mut self, slot: usize, tier: usize, i: usize) -> bool {
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        let slot_alive = self.alive.get(w).is_some_and(|word| word & bit != 0);
        if !slot_alive {
            self.end_all(i);
            return false;
        }
        if self.alive_count > 1 {
            for v in 0..self.alive.len() {
                let others =
                    self.alive.get(v).copied().unwrap_or(0) & if v == w { !bit } else { !0 };
                for_each_slot(v, others, |other| self.end_run(other, i));
            }
        }
        self.set_class(slot, tier.min(TIERS - 1), i);
        true
    }

    /// Block `i` held by several slots (per-tier bits in `held`) and/or speculatively.
    fn step_many(&mut self, i: usize, any_speculative: bool) -> bool {
        let mut on_run = false;
        for w in 0..self.alive.len() {
            let tier_word = |t: usize| self.held.get(w * TIERS + t).copied().unwrap_or(0);
            let (gpu, cpu, slower) = (tier_word(0), tier_word(1), tier_word(2));
            let speculative = if any_speculative {
                self.speculative.get(w).copied().unwrap_or(0)
            } else {
                0
            };
            let confirmed = gpu | cpu | slower;
            let alive = self.alive.get(w).copied().unwrap_or(0);
            for_each_slot(w, alive & !(confirmed | speculative), |slot| {
                self.end_run(slot, i)
            });
            let alive = self.alive.get(w).copied().unwrap_or(0);
            on_run |= alive != 0;
            // The best tier of each surviving slot (speculation counts as GPU).
            let best_gpu = gpu | speculative;
            let cpu_class = alive & !best_gpu & cpu;
            let slower_class = alive & !best_gpu & !cpu;
            let changed = (cpu_class ^ self.class[0].get(w).copied().unwrap_or(0))
                | (slower_class ^ self.class[1].get(w).copied().unwrap_or(0));
            for_each_slot(w, changed, |slot| {
                let bit = 1u64 << (slot % 64);
                let class = if cpu_class & bit != 0 {
                    1
                } else if slower_class & bit != 0 {
                    2
                } else {
                    0
                };
                self.set_class(slot, class, i);
            });
            // Held only speculatively, for the first time on this run.
            let seen = self.speculative_seen.get(w).copied().unwrap_or(0);
            let first_speculative = alive & speculative & !confirmed & !seen;
            if first_speculative != 0 {
                for_each_slot(w, first_speculative, |slot| {
                    if let Some(p) = self.position(slot)
                        && let Some(from) = self.speculative_from.get_mut(p)
                    {
                        *from = i;
                    }
                });
                if let Some(cell) = self.speculative_seen.get_mut(w) {
                    *cell |= first_speculative;
                }
            }
        }
        on_run
    }

    fn finish(mut self, candidates: &[PodId], total_blocks: usize, block_size: u32) -> Walked {
        // Runs still going end where the walk stopped.
        let walked = self.walked;
        self.end_all(walked);
        let mut in_index = vec![false; candidates.len()];
        for p in self.position_of_slot.iter().filter(|p| **p != u32::MAX) {
            if let Some(cell) = in_index.get_mut(*p as usize) {
                *cell = true;
            }
        }
        let matches = candidates
            .iter()
            .enumerate()
            .map(|(p, pod)| {
                let matched = match self.run_end.get(p).copied() {
                    Some(end) if end != usize::MAX && in_index.get(p).copied() == Some(true) => end,
                    _ => 0,
                };
                let loss = self.weight_loss.get(p).copied().unwrap_or(0.0);
                PrefixMatch {
                    pod: *pod,
                    block_size,
                    total_blocks,
                    matched_blocks: matched,
                    weighted_blocks: (matched as f64 * self.gpu_weight - loss).max(0.0),
                }
            })
            .collect();
        Walked {
            matches,
            speculative_from: self.speculative_from,
            galloped: self.galloped,
        }
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
