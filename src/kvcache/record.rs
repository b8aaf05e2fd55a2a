//! Routing records: what kvpick itself routed, kept so the next requests of a prefix find it
//! before the engine's events arrive ([`PrefixIndex::record_routed`]).
//!
//! A pod that publishes events gets short-lived speculative runs (confirmed or dropped by
//! its events, `speculative`); a pod without events gets the blocks in its approximate LRU
//! set (`approx`). A record after a lookup starts where the lookup found the pod's confirmed
//! run ending, and keys the rest through the request's [`PromptKeys`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::homes::PrefixHome;
use super::index::{PodEntry, PrefixIndex};
use super::key::{BlockKey, KeyContext};
use super::matching::PrefixLookup;
use super::prompt_keys::PromptKeys;
use super::span::{SpanBook, SpanRef};
use crate::endpoints::PodId;
use kvpick_kvevents_wire::Tier;

impl PrefixIndex {
    /// Records that kvpick routed a request with these tokens to `pod` (a one-off record, e.g.
    /// in tests; the request path uses [`Self::record_routed`] with the request's keys).
    pub fn record_routed_tokens(&self, pod: PodId, context: &KeyContext, tokens: &[u32]) {
        let keys = PromptKeys::exact(context.clone(), tokens.to_vec());
        self.record_routed(pod, &keys, None);
    }

    /// Records that kvpick routed the prompt of `keys` to `pod`. For a pod that publishes
    /// events, its blocks count as held for the speculative TTL (until confirmed); for a pod
    /// without events, they enter its approximate LRU set. After a [`Self::lookup`] that had
    /// `pod` among its candidates (`after`), the leading blocks the lookup found `pod` holding
    /// confirmed are skipped (speculative ones are refreshed), and the keys it computed are
    /// reused.
    pub fn record_routed(&self, pod: PodId, keys: &PromptKeys, after: Option<&PrefixLookup>) {
        let held = after.map_or(0, |lookup| self.confirmed_run(pod, lookup));
        self.record_routed_from(pod, keys, held);
    }

    /// Where the prompt of `keys` (keyed at `block_size`) was last routed, as far as a routing
    /// record of this replica or a peer's shows: the deepest remembered prefix (`homes`),
    /// whether or not its pod still holds it. Keys the prompt up to 4,096 blocks.
    pub fn prefix_home(&self, keys: &PromptKeys, block_size: u32) -> Option<PrefixHome> {
        keys.with_keys(block_size, |lazy| {
            let total = lazy.total_blocks();
            self.homes
                .find(total, |block| lazy.upto(block + 1).get(block).copied())
        })
        .flatten()
    }

    /// Leading blocks `lookup` found `pod` holding confirmed, at the pod's block size: where
    /// a routing record of `pod` starts ([`Self::record_routed_from`]).
    pub fn confirmed_run(&self, pod: PodId, lookup: &PrefixLookup) -> usize {
        lookup.confirmed_run(pod, self.block_size_for(pod))
    }

    /// Records `pod` as holding the prompt's blocks from block `held` on (the ones before are
    /// known to be held confirmed).
    pub fn record_routed_from(&self, pod: PodId, keys: &PromptKeys, held: usize) {
        if self.recently_purged(pod) {
            return;
        }
        let entry = self.pod_or_insert(pod);
        // NOTE: keyed at the pod's block size now; should it have changed since the lookup,
        // the record keys the new layout (another chain of the same prompt).
        let size = self.block_size_for(pod);
        let _ = keys.with_keys(size, |lazy| {
            let keys = lazy.upto(usize::MAX);
            if !keys.is_empty() {
                self.record_keys(&entry, keys, held);
                self.homes.record(pod, keys);
                // All the keys: a peer may not know the pod holds the first `held`.
                self.export_route(pod, size, keys);
            }
        });
    }

    /// [`Self::record_routed_from`] over the prompt's keys at the pod's block size.
    pub(super) fn record_keys(&self, entry: &Arc<PodEntry>, keys: &[BlockKey], held: usize) {
        self.record_keys_runs_from(entry, keys, held, RUN_FROM);
    }

    /// [`Self::record_keys`], adding an approximate pod's new stretches of `run_from` blocks
    /// or more as runs ([`Self::add_new_run`]) and evicting as many or more shard by shard
    /// (tests compare it with block by block).
    fn record_keys_runs_from(
        &self,
        entry: &Arc<PodEntry>,
        keys: &[BlockKey],
        held: usize,
        run_from: usize,
    ) {
        let mut state = entry.lock();
        if state.retired {
            return;
        }
        if state.precise {
            drop(state);
            // NOTE: the blocks after the pod's confirmed run are recorded as one run of
            // consecutive blocks, which a walk can verify with one probe; a pod that holds a
            // later block confirmed (its prefix evicted out of order) gets a redundant entry
            // for the TTL, a few bytes. The confirmed run is extended first where the caller
            // did not know it (no lookup: `held` = 0), one block at a time. A leading stretch
            // the pod already holds speculatively in a live run is refreshed in place, not
            // rewritten (`speculative`), so a warm record costs its new tail.
            let tail = keys.get(held..).unwrap_or_default();
            let confirmed = {
                let blocks = self.blocks.reader(0);
                tail.iter()
                    .take_while(|key| blocks.holds(**key, entry.slot))
                    .count()
            };
            let tail = tail.get(confirmed..).unwrap_or_default();
            self.speculative.record(entry.slot, tail, Instant::now());
            return;
        }
        // Approximate mode: every block is touched, so the LRU order follows recency (whole
        // segments at a time: a warm record costs its new tail, `approx`).
        let capacity = state.approx_capacity;
        let (added, evicted) = state.approx.touch_stretches(keys, capacity);
        let mut entries = state.entries;
        for stretch in added {
            // Approximate holders are placed in spans as a stored chain is (`span`): a new
            // stretch continues the span of the block before it when that block is its tail,
            // so walks gallop over a pod's approximate prefix as over an event-fed one. The
            // LRU evicts a touch's blocks tail first, as vLLM does, which keeps spans intact.
            let mut previous = stretch
                .start
                .checked_sub(1)
                .and_then(|before| keys.get(before))
                .and_then(|key| self.blocks.span_of(*key, entry.slot, Tier::Gpu));
            let mut stretch = keys.get(stretch).unwrap_or_default();
            if stretch.len() >= run_from {
                let (handled, new, last) =
                    self.add_new_run(entry, &mut state.spans, stretch, previous, Tier::Gpu);
                entries += new;
                stretch = stretch.get(handled..).unwrap_or_default();
                previous = last;
            }
            for key in stretch {
                let next = state.spans.next_after(previous, &entry.spans);
                let (refs, span) = self.add_holder(*key, entry.slot, Tier::Gpu, next);
                if refs == 1 {
                    state.spans.commit(span, &entry.spans);
                    entries += 1;
                }
                previous = Some(span);
            }
        }
        if evicted.len() >= run_from {
            let spans = &mut state.spans;
            let gone = self
                .blocks
                .remove_run(&evicted, entry.slot, Tier::Gpu, |span| {
                    spans.left(span, &entry.spans)
                });
            entries = entries.saturating_sub(gone);
        } else {
            for key in &evicted {
                if self.remove_holder(entry, &mut state.spans, *key, Tier::Gpu) == Some(0) {
                    entries = entries.saturating_sub(1);
                }
            }
        }
        state.entries = entries;
        entry.entries.store(state.entries as u64, Ordering::Relaxed);
        if state.events_expected {
            // NOTE: a pod whose events are subscribed to but that has not published yet (a
            // fresh engine, nothing prefilled) turns precise at its first batch, which drops
            // the approximate entries; speculative ones carry the record over until its
            // blocks are confirmed. Without them, the requests routed to a fresh pod before
            // its first event were forgotten a moment later, and under a cold start's load
            // their groups' next requests, finding no holder, were placed as new: 7 extra
            // copies of a 2,200-token prefix in the first second at 48 req/s (session 39).
            // All the keys (not from `held`): what a lookup found held here was approximate.
            // After the approximate holders, whose adding drops a speculative entry of the
            // same block and pod as a confirmed store does.
            self.speculative.record(entry.slot, keys, Instant::now());
        }
    }

    /// Adds a stretch of blocks new to the pod (in `tier`) as one chain, shard by shard
    /// ([`super::blockmap::BlockMap::add_run`]); returns how many blocks it handled (the
    /// ones after are left to the caller's block-by-block loop), how many of them are new
    /// holders, and the span of the last one (the caller's `previous`).
    ///
    /// Block by block, each new block would continue the span of the one before it: the
    /// blocks take consecutive offsets of one span, which this assigns up front. It is exact
    /// as long as every block is new to the pod; a block it already held (a key repeated in
    /// the prompt, or one the pod held outside its LRU set) would have kept its own span and
    /// broken the chain. So the first such block ends the run: the blocks after it are taken
    /// back (they were not held before: nothing else changes this pod's holders while its
    /// mutex is held) and the caller goes on from it block by block.
    pub(super) fn add_new_run(
        &self,
        entry: &PodEntry,
        spans: &mut SpanBook,
        stretch: &[BlockKey],
        previous: Option<SpanRef>,
        tier: Tier,
    ) -> (usize, usize, Option<SpanRef>) {
        let first = spans.next_after(previous, &entry.spans);
        // Block by block, a span ends at u16::MAX blocks and a new one starts; and with no
        // span id left, blocks get none. Both go block by block.
        if !first.is_some() || usize::from(first.offset) + stretch.len() >= usize::from(u16::MAX) {
            return (0, 0, previous);
        }
        let added = self.blocks.add_run(stretch, entry.slot, tier, first);
        let run = added
            .iter()
            .position(|(refs, _)| *refs != 1)
            .unwrap_or(added.len());
        // Taken back in reverse, so a key added twice after the run loses its second
        // reference before its first.
        for (key, (refs, _)) in stretch.iter().zip(&added).skip(run + 1).rev() {
            if *refs > 0 {
                // NOTE: their spans were never committed: nothing to tell the span book.
                let _ = self.blocks.remove(*key, entry.slot, tier, |_| {});
            }
        }
        for k in 0..run {
            spans.commit(first.advanced(k), &entry.spans);
        }
        let last = match added.get(run) {
            // The block that broke the run keeps what adding it did (one more reference, as
            // block by block), and is where the caller goes on from.
            Some((_, span)) => Some(*span),
            None => run.checked_sub(1).map(|k| first.advanced(k)),
        };
        let handled = (run + 1).min(stretch.len());
        // Every block added (the run's, and the one that broke it) is held now, as after
        // `add_holder`.
        self.speculative
            .confirm_keys(stretch.get(..handled).unwrap_or_default(), entry.slot);
        (handled, run, last)
    }
}

/// Blocks a stretch (or an eviction) must have for a record to add (or remove) them shard by
/// shard ([`PrefixIndex::add_new_run`]); fewer go block by block. A stored chain's new blocks
/// too (`apply`).
pub(super) const RUN_FROM: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvcache::IndexConfig;

    /// An index whose one pod has no events (approximate) and room for `capacity` blocks.
    fn approximate(capacity: usize) -> (PrefixIndex, Arc<PodEntry>) {
        let pod = PodId(std::net::SocketAddr::from(([127, 0, 0, 1], 8000)));
        let index = PrefixIndex::new(IndexConfig::default());
        index.set_pod_capacity(pod, capacity);
        let entry = index.pod_or_insert(pod);
        (index, entry)
    }

    /// What a walk reads of the pod's holding of each key: references, span, and the span's
    /// intact length.
    fn holding(
        index: &PrefixIndex,
        entry: &PodEntry,
        keys: &[BlockKey],
    ) -> Vec<(u16, Option<(SpanRef, u32)>)> {
        keys.iter()
            .map(|key| {
                let refs = index.blocks.tier_refs(*key, entry.slot, Tier::Gpu);
                let span = index
                    .blocks
                    .span_of(*key, entry.slot, Tier::Gpu)
                    .map(|span| (span, entry.spans.intact(span.id)));
                (refs, span)
            })
            .collect()
    }

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range
            .map(|k| BlockKey(k.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1))
            .collect()
    }

    /// Records `prompts` in turn into two indexes, one adding long stretches as runs and one
    /// block by block, and checks every key of every prompt is held alike.
    fn check_runs_equal_block_by_block(capacity: usize, prompts: &[Vec<BlockKey>]) {
        let (runs, runs_entry) = approximate(capacity);
        let (steps, steps_entry) = approximate(capacity);
        for (n, prompt) in prompts.iter().enumerate() {
            runs.record_keys_runs_from(&runs_entry, prompt, 0, RUN_FROM);
            steps.record_keys_runs_from(&steps_entry, prompt, 0, usize::MAX);
            for seen in &prompts[..=n] {
                assert_eq!(
                    holding(&runs, &runs_entry, seen),
                    holding(&steps, &steps_entry, seen),
                    "after prompt {n}"
                );
            }
            assert_eq!(
                runs_entry.entries.load(Ordering::Relaxed),
                steps_entry.entries.load(Ordering::Relaxed)
            );
        }
    }

    #[test]
    fn a_new_stretch_added_as_a_run_is_held_as_block_by_block() {
        let base = keys(0..300);
        let mut longer = base.clone();
        longer.extend(keys(1_000..1_200));
        check_runs_equal_block_by_block(10_000, &[base[..80].to_vec(), base.clone(), longer]);
    }

    #[test]
    fn a_run_that_meets_a_key_already_held_goes_on_block_by_block_from_it() {
        // A prompt whose keys repeat (what a 64-bit collision would look like): the run ends
        // at the repeated key, which keeps its first span, and the rest continue from it.
        let mut repeated = keys(0..200);
        repeated[120] = repeated[40];
        repeated[150] = repeated[140];
        // And a prompt repeating a key of an earlier record far into its new stretch.
        let mut again = keys(5_000..5_200);
        again[100] = repeated[10];
        check_runs_equal_block_by_block(10_000, &[repeated.clone(), again, repeated]);
    }

    #[test]
    fn runs_that_evict_are_held_as_block_by_block() {
        // Capacity for two prompts: each new one evicts the oldest, tail first.
        let prompts: Vec<Vec<BlockKey>> =
            (0..6).map(|p| keys(p * 10_000..p * 10_000 + 250)).collect();
        check_runs_equal_block_by_block(520, &prompts);
    }

    #[test]
    fn a_tail_evicted_by_a_run_and_routed_again_is_held_as_block_by_block() {
        // Room for 300 blocks: each prompt evicts most of the other's tail (tail first), and
        // routed again, the tail comes back after the head still held.
        let a = keys(0..250);
        let b = keys(50_000..50_200);
        let mut a_longer = a.clone();
        a_longer.extend(keys(90_000..90_080));
        check_runs_equal_block_by_block(300, &[a.clone(), b.clone(), a.clone(), b, a_longer, a]);
    }
}
