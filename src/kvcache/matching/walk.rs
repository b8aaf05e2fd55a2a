//! One walk over a request's blocks in pod-slot space (see [`Walk`]).

use std::sync::Arc;

use tokio::time::Instant;

use super::super::blockmap::{BlockMapReader, HeldBy, TIERS};
use super::super::index::{PodEntry, PrefixIndex};
use super::super::key::BlockKey;
use super::gallop::{GALLOP_BACKOFF, MIN_JUMP};
use super::{Keys, PrefixMatch};
use crate::endpoints::PodId;

/// Blocks keyed ahead of the walk at a time: enough to amortise the call, few enough that a
/// walk that stops early hashes little beyond its stop.
pub(super) const KEY_BATCH: usize = 32;

/// Keys probed ahead of the walk at a time (see [`Walk::run`]).
const PROBE_GROUP: usize = 8;

/// What a walk found: per candidate its match and the first block of its run held only
/// speculatively, and how many blocks it galloped over.
pub(super) struct Walked {
    pub(super) matches: Vec<PrefixMatch>,
    pub(super) speculative_from: Vec<usize>,
    pub(super) galloped: usize,
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
pub(super) struct Walk {
    /// Weight lost per block against GPU, per tier class (gpu 0, cpu, slower).
    pub(super) penalty: [f64; TIERS],
    pub(super) gpu_weight: f64,
    /// slot → candidate position (`u32::MAX`: not a candidate).
    pub(super) position_of_slot: Vec<u32>,
    /// Candidate slots still on their run, and how many.
    pub(super) alive: Vec<u64>,
    pub(super) alive_count: usize,
    /// Per tier class (cpu, slower), the alive slots whose best tier for the current stretch
    /// is that class (GPU is the rest).
    pub(super) class: [Vec<u64>; 2],
    /// Per candidate position: where its current tier stretch began.
    pub(super) stretch_from: Vec<usize>,
    /// Per candidate position: where its run ended (`usize::MAX`: still running).
    pub(super) run_end: Vec<usize>,
    /// Per candidate position: Σ (gpu weight − best tier weight) over its run.
    pub(super) weight_loss: Vec<f64>,
    /// Per candidate position: first block of its run held only speculatively.
    pub(super) speculative_from: Vec<usize>,
    /// Slots already given a `speculative_from`.
    pub(super) speculative_seen: Vec<u64>,
    /// Scratch per block: holders per tier (see `blockmap::More::bits`), speculative holders.
    pub(super) held: Vec<u64>,
    pub(super) speculative: Vec<u64>,
    /// The previous block's holder bits, when it took the bitset path without speculation:
    /// a block with the same holders changes nothing (the usual case inside a shared prefix).
    pub(super) previous_held: Vec<u64>,
    pub(super) previous_valid: bool,
    /// Blocks the surviving candidates have run through.
    pub(super) walked: usize,
    pub(super) speculation: Option<Instant>,
    /// Per candidate position: its pod's entry (for span intact lengths), if indexed; filled
    /// by the first gallop (a walk that never gallops does not pay for it).
    pub(super) pods: Vec<Option<Arc<PodEntry>>>,
    /// The first block after which a gallop may be tried.
    pub(super) next_gallop: usize,
    /// Scratch of [`Self::verify`]: candidates proven so far.
    pub(super) proven: Vec<u64>,
    /// Blocks jumped over.
    pub(super) galloped: usize,
}

/// Calls `f` with each slot whose bit is set in `word` (bit `b` of word `w` = slot `64w + b`).
#[inline]
pub(super) fn for_each_slot(w: usize, mut word: u64, mut f: impl FnMut(usize)) {
    while word != 0 {
        let bit = word.trailing_zeros() as usize;
        f(w * 64 + bit);
        word &= word - 1;
    }
}

impl Walk {
    pub(super) fn new(index: &PrefixIndex, candidates: &[PodId]) -> Self {
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
    pub(super) fn run(
        &mut self,
        index: &PrefixIndex,
        blocks: &BlockMapReader<'_>,
        keys: &mut Keys<'_, '_>,
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
    pub(super) fn load_pods(&mut self, index: &PrefixIndex, candidates: &[PodId]) {
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

    /// Position of a candidate slot.
    pub(super) fn position(&self, slot: usize) -> Option<usize> {
        self.position_of_slot
            .get(slot)
            .filter(|p| **p != u32::MAX)
            .map(|p| *p as usize)
    }

    /// The tier class `slot` is in (0 gpu, 1 cpu, 2 slower).
    pub(super) fn class_of(&self, slot: usize) -> usize {
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        let in_class = |c: &Vec<u64>| c.get(w).is_some_and(|word| word & bit != 0);
        match &self.class {
            [cpu, _] if in_class(cpu) => 1,
            [_, slower] if in_class(slower) => 2,
            _ => 0,
        }
    }

    /// Charges `slot`'s current tier stretch up to block `i` (exclusive) and starts a new one.
    pub(super) fn close_stretch(&mut self, slot: usize, i: usize) {
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
    pub(super) fn end_run(&mut self, slot: usize, i: usize) {
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
    pub(super) fn set_class(&mut self, slot: usize, class: usize, i: usize) {
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
    pub(super) fn step(
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

    /// The per-word vectors all cover the same slots (a walk sizes them once, in
    /// [`Self::new`]): the word loops below index them directly, so a broken invariant fails
    /// loudly in tests instead of scoring silently wrong.
    fn debug_assert_shapes(&self) {
        const { assert!(TIERS == 3, "the word loops read three tiers") };
        let words = self.alive.len();
        debug_assert_eq!(self.held.len(), words * TIERS);
        debug_assert_eq!(self.speculative.len(), words);
        debug_assert_eq!(self.speculative_seen.len(), words);
        debug_assert!(self.class.iter().all(|c| c.len() == words));
    }

    /// Ends every run at block `i`.
    pub(super) fn end_all(&mut self, i: usize) {
        for w in 0..self.alive.len() {
            let alive = self.alive[w];
            for_each_slot(w, alive, |slot| self.end_run(slot, i));
        }
    }

    /// Block `i` held by one (slot, tier) only.
    pub(super) fn step_one(&mut self, slot: usize, tier: usize, i: usize) -> bool {
        let (w, bit) = (slot / 64, 1u64 << (slot % 64));
        let slot_alive = self.alive.get(w).is_some_and(|word| word & bit != 0);
        if !slot_alive {
            self.end_all(i);
            return false;
        }
        if self.alive_count > 1 {
            for v in 0..self.alive.len() {
                let others = self.alive[v] & if v == w { !bit } else { !0 };
                for_each_slot(v, others, |other| self.end_run(other, i));
            }
        }
        self.set_class(slot, tier.min(TIERS - 1), i);
        true
    }

    /// Block `i` held by several slots (per-tier bits in `held`) and/or speculatively.
    pub(super) fn step_many(&mut self, i: usize, any_speculative: bool) -> bool {
        let mut on_run = false;
        self.debug_assert_shapes();
        for w in 0..self.alive.len() {
            let (gpu, cpu, slower) = (
                self.held[w * TIERS],
                self.held[w * TIERS + 1],
                self.held[w * TIERS + 2],
            );
            let speculative = if any_speculative {
                self.speculative[w]
            } else {
                0
            };
            let confirmed = gpu | cpu | slower;
            let alive = self.alive[w];
            for_each_slot(w, alive & !(confirmed | speculative), |slot| {
                self.end_run(slot, i)
            });
            let alive = self.alive[w];
            on_run |= alive != 0;
            // The best tier of each surviving slot (speculation counts as GPU).
            let best_gpu = gpu | speculative;
            let cpu_class = alive & !best_gpu & cpu;
            let slower_class = alive & !best_gpu & !cpu;
            let changed = (cpu_class ^ self.class[0][w]) | (slower_class ^ self.class[1][w]);
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
            let seen = self.speculative_seen[w];
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

    pub(super) fn finish(
        mut self,
        candidates: &[PodId],
        total_blocks: usize,
        block_size: u32,
    ) -> Walked {
        // Runs still going end where the walk stopped.
        let walked = self.walked;
        self.end_all(walked);
        // The per-candidate vectors were sized for these candidates in `new`.
        debug_assert_eq!(self.run_end.len(), candidates.len());
        debug_assert_eq!(self.weight_loss.len(), candidates.len());
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
                let end = self.run_end[p];
                let matched = if end != usize::MAX && in_index[p] {
                    end
                } else {
                    0
                };
                let loss = self.weight_loss[p];
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
