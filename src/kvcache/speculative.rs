//! Speculative holders: "kvpick just sent this request to pod P, so P will soon hold its
//! blocks", for a short TTL.
//!
//! Why: KV events arrive after the engine has prefilled; a burst of same-prefix requests
//! would otherwise see no holder and scatter across pods. A speculative entry makes the burst
//! follow the first request; it expires after the TTL (default 2 s) and is dropped as soon as
//! a confirmed event stores the same block on the same pod.
//!
//! Concurrency: a sharded map of its own; no operation holds one of its locks while taking a
//! lock of the block map (matching reads the two one after the other).
//!
//! A counting filter in front of the map (entries per bucket of key bits, updated under the
//! key's map lock, read without it) lets a walk skip the map for the blocks no pod holds
//! speculatively — most blocks of a long prompt — at the price of one relaxed atomic load.
//! A counter is never below the entries of its bucket (one that saturates stays saturated),
//! so a zero is always a true "none".

use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

use super::key::{BlockKey, PrehashedState};

/// Buckets of the counting filter (64 Ki counters, 128 KiB).
const FILTER_BITS: u32 = 16;

/// Speculative (pod slot, expiry) entries per block key, bounded in number.
pub(crate) struct Speculative {
    entries: DashMap<BlockKey, Vec<(u32, Instant)>, PrehashedState>,
    /// Entries per bucket of key bits (see the module docs).
    filter: Box<[AtomicU16]>,
    count: AtomicUsize,
    ttl: Duration,
    max_entries: usize,
}

impl Speculative {
    pub(crate) fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            entries: DashMap::with_hasher(PrehashedState::default()),
            filter: (0..1usize << FILTER_BITS)
                .map(|_| AtomicU16::new(0))
                .collect(),
            count: AtomicUsize::new(0),
            ttl,
            max_entries,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.count.load(Ordering::Relaxed) == 0
    }

    fn counter(&self, key: &BlockKey) -> Option<&AtomicU16> {
        // Middle bits: the map's shards and tables use the ends of the (multiplied) key.
        self.filter
            .get(((key.0 >> 24) & ((1 << FILTER_BITS) - 1)) as usize)
    }

    /// Counts `added` new entries of `key` (called under the key's map lock).
    fn count_in(&self, key: &BlockKey, added: usize) {
        if let Some(counter) = self.counter(key) {
            let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_add(added.min(u16::MAX as usize) as u16))
            });
        }
    }

    /// Uncounts `removed` entries of `key` (called under the key's map lock); a saturated
    /// counter stays saturated.
    fn count_out(&self, key: &BlockKey, removed: usize) {
        if removed == 0 {
            return;
        }
        if let Some(counter) = self.counter(key) {
            let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                (c != u16::MAX).then(|| c.saturating_sub(removed.min(u16::MAX as usize) as u16))
            });
        }
    }

    /// Whether `key` may have speculative entries (false: certainly none).
    pub(crate) fn may_hold(&self, key: &BlockKey) -> bool {
        self.counter(key)
            .is_some_and(|c| c.load(Ordering::Relaxed) != 0)
    }

    /// Records `slot` as holding `keys` until now + TTL; returns how many entries were refused
    /// because the bound was reached.
    pub(crate) fn record(&self, slot: u32, keys: &[BlockKey], now: Instant) -> usize {
        if self.count.load(Ordering::Relaxed) + keys.len() > self.max_entries {
            self.purge_expired(now);
        }
        let expires = now + self.ttl;
        let mut refused = 0;
        for key in keys {
            let mut entry = self.entries.entry(*key).or_default();
            if let Some(existing) = entry.iter_mut().find(|(s, _)| *s == slot) {
                existing.1 = expires;
                continue;
            }
            if self.count.load(Ordering::Relaxed) >= self.max_entries {
                refused += 1;
                continue;
            }
            entry.push((slot, expires));
            self.count_in(key, 1);
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        refused
    }

    /// Calls `visit(slot)` for each live speculative holder of `key`; false when it has none.
    pub(crate) fn visit(&self, key: &BlockKey, now: Instant, mut visit: impl FnMut(u32)) -> bool {
        if !self.may_hold(key) {
            return false;
        }
        let Some(entry) = self.entries.get(key) else {
            return false;
        };
        let mut any = false;
        for (slot, expires) in entry.iter() {
            if *expires > now {
                visit(*slot);
                any = true;
            }
        }
        any
    }

    /// A confirmed event stored `key` on `slot`: the speculation is no longer needed.
    pub(crate) fn confirm(&self, key: &BlockKey, slot: u32) {
        if self.is_empty() || !self.may_hold(key) {
            return;
        }
        if let dashmap::Entry::Occupied(mut occupied) = self.entries.entry(*key) {
            let before = occupied.get().len();
            occupied.get_mut().retain(|(s, _)| *s != slot);
            let removed = before - occupied.get().len();
            self.count_out(key, removed);
            self.count.fetch_sub(removed, Ordering::Relaxed);
            if occupied.get().is_empty() {
                occupied.remove();
            }
        }
    }

    /// Drops expired entries.
    pub(crate) fn purge_expired(&self, now: Instant) {
        self.retain(|_, expires| expires > now);
    }

    /// Drops every entry of a slot (the pod left).
    pub(crate) fn remove_slot(&self, slot: u32) {
        self.retain(|s, _| s != slot);
    }

    fn retain(&self, keep: impl Fn(u32, Instant) -> bool) {
        let mut removed = 0;
        self.entries.retain(|key, list| {
            let before = list.len();
            list.retain(|(s, e)| keep(*s, *e));
            self.count_out(key, before - list.len());
            removed += before - list.len();
            !list.is_empty()
        });
        self.count.fetch_sub(removed, Ordering::Relaxed);
    }

    /// Live + expired entries not yet purged.
    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_says_none_only_when_there_is_none() {
        let speculative = Speculative::new(Duration::from_secs(2), 100);
        let now = Instant::now();
        // Two keys in one filter bucket (same middle bits), one in another.
        let (a, b, c) = (
            BlockKey(1 << 24),
            BlockKey((1 << 24) | 5),
            BlockKey(2 << 24),
        );
        assert!(!speculative.may_hold(&a));
        speculative.record(3, &[a, b], now);
        speculative.record(4, &[a], now);
        assert!(speculative.may_hold(&a) && speculative.may_hold(&b));
        assert!(!speculative.may_hold(&c));
        let mut slots = Vec::new();
        assert!(speculative.visit(&a, now, |s| slots.push(s)));
        assert_eq!(slots, vec![3, 4]);
        assert!(!speculative.visit(&c, now, |_| {}));
        // Confirming and purging take the counts back down to zero.
        speculative.confirm(&a, 3);
        speculative.confirm(&b, 3);
        assert!(speculative.may_hold(&a), "slot 4 still speculates on a");
        speculative.remove_slot(4);
        assert!(!speculative.may_hold(&a) && !speculative.may_hold(&b));
        assert_eq!(speculative.len(), 0);
        // Expired entries leave the filter when purged.
        speculative.record(5, &[c], now);
        speculative.purge_expired(now + Duration::from_secs(3));
        assert!(!speculative.may_hold(&c));
    }
}
