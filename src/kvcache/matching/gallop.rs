//! Galloping: a walk jumps over many blocks with one probe where every candidate still on
//! its run holds the prefix in GPU as part of an intact span (see [`super::super::span`]).

use super::super::blockmap::BlockMapReader;
use super::super::index::PrefixIndex;
use super::super::key::BlockKey;
use super::Keys;
use super::walk::Walk;

/// The smallest jump a gallop tries ([`Walk::gallop`]).
pub(super) const MIN_JUMP: usize = 16;

/// Blocks stepped one by one after a gallop that could not jump at all, before the next try
/// (bounds the cost of trying where spans do not help: ~4 probes per 32 blocks).
pub(super) const GALLOP_BACKOFF: usize = 32;

impl Walk {
    /// Whether a gallop can apply: candidates are on their run, all in the GPU class.
    pub(super) fn may_gallop(&self) -> bool {
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
    pub(super) fn gallop(
        &mut self,
        index: &PrefixIndex,
        blocks: &BlockMapReader<'_>,
        keys: &mut Keys<'_, '_>,
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
    pub(super) fn verify(
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
}
