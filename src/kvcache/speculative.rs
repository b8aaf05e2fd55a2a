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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

use super::key::{BlockKey, PrehashedState};

/// Speculative (pod slot, expiry) entries per block key, bounded in number.
pub(crate) struct Speculative {
    entries: DashMap<BlockKey, Vec<(u32, Instant)>, PrehashedState>,
    count: AtomicUsize,
    ttl: Duration,
    max_entries: usize,
}

impl Speculative {
    pub(crate) fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            entries: DashMap::with_hasher(PrehashedState::default()),
            count: AtomicUsize::new(0),
            ttl,
            max_entries,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.count.load(Ordering::Relaxed) == 0
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
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        refused
    }

    /// Calls `visit(slot)` for each live speculative holder of `key`; false when it has none.
    pub(crate) fn visit(&self, key: &BlockKey, now: Instant, mut visit: impl FnMut(u32)) -> bool {
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
        if self.is_empty() {
            return;
        }
        if let dashmap::Entry::Occupied(mut occupied) = self.entries.entry(*key) {
            let before = occupied.get().len();
            occupied.get_mut().retain(|(s, _)| *s != slot);
            let removed = before - occupied.get().len();
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
        self.entries.retain(|_, list| {
            let before = list.len();
            list.retain(|(s, e)| keep(*s, *e));
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
