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
            for key in keys.get(stretch).unwrap_or_default() {
                let next = state.spans.next_after(previous, &entry.spans);
                let (refs, span) = self.add_holder(*key, entry.slot, Tier::Gpu, next);
                if refs == 1 {
                    state.spans.commit(span, &entry.spans);
                    entries += 1;
                }
                previous = Some(span);
            }
        }
        for key in &evicted {
            if self.remove_holder(entry, &mut state.spans, *key, Tier::Gpu) == Some(0) {
                entries = entries.saturating_sub(1);
            }
        }
        state.entries = entries;
        entry.entries.store(state.entries as u64, Ordering::Relaxed);
    }
}
