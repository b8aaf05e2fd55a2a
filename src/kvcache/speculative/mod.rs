//! Speculative holders: "kvpick just sent this request to pod P, so P will soon hold its
//! blocks", for a short TTL.
//!
//! Why: KV events arrive after the engine has prefilled; a burst of same-prefix requests
//! would otherwise see no holder and scatter across pods. A speculative entry makes the burst
//! follow the first request; it expires after the TTL (default 2 s) and is dropped as soon as
//! a confirmed event stores the same block on the same pod.
//!
//! # Runs
//! One routing record writes one *run*: entries for consecutive blocks of one prompt, all
//! expiring together. Each entry knows its run and its offset in it, and the run knows how
//! many of its leading entries are all still present (its intact length, lowered when an
//! entry leaves: confirmed, refreshed into a newer run, purged). So a walk can prove with one
//! probe that a pod holds a long stretch speculatively — the same argument as for the block
//! map's spans (`super::span`) — instead of visiting every block.
//!
//! # Concurrency
//! A sharded map of its own; no operation holds one of its locks while taking a lock of the
//! block map (matching reads the two one after the other). Run state is atomics in chunks that
//! never move, read without locks; allocating and freeing run ids takes a mutex. A run starts
//! with one extra reference held by its writer, so it cannot be freed (and its id reused)
//! while its entries are still being written, and its intact length starts at "all" and only
//! ever decreases: a reader that finds an entry of a run at offset `o` with intact length
//! above `o` knows the entries before it were written (earlier, by the same writer) and not
//! removed since.
//!
//! # Refreshing a run in place
//! A warm request repeats the leading blocks of an earlier one's run (a shared system prompt,
//! a growing conversation). Moving each of them into a new run cost ~0.5 µs a block. Instead a
//! record first finds the stretch of its blocks that a live, intact run of the same pod already
//! holds from the run's first entry on (chained keys: one probe at the stretch's end proves
//! the stretch, as in a walk), and extends the expiry of that run's *head* (its entries below
//! a given offset) in O(1); only the blocks after it are written. A run keeps one head: a
//! refresh over fewer entries than the current head (which it could not represent) takes the
//! old path and moves the entries. Entries past the head keep the run's own expiry, exactly
//! as the entries a moving record leaves behind would.
//!
//! A long record (at least [`RUN_FROM`] new blocks, with room under the bound) writes its
//! entries shard by shard ([`map::SpecMap::write_keys`]): it reserves its entries in the
//! count and joins its run for all of them before the first is written (so neither the count
//! nor the run's live entries can drop below a concurrent `confirm`'s decrement), then locks
//! each shard once. An entry it replaces (the pod's entry from an older run) gives its
//! reservation back afterwards. The result is what writing block by block gives.
//!
//! A counting filter in front of the map (entries per bucket of key bits, updated under the
//! key's map lock, read without it) lets a walk skip the map for the blocks no pod holds
//! speculatively — most blocks of a long prompt — at the price of one relaxed atomic load.
//! A counter is never below the entries of its bucket (one that saturates stays saturated),
//! so a zero is always a true "none".

use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::key::BlockKey;
use map::SpecMap;
use runs::Runs;

mod map;
mod runs;

/// Buckets of the counting filter (64 Ki counters, 128 KiB).
const FILTER_BITS: u32 = 16;

/// One speculative holder of a block: the pod slot, its run and its offset in the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SpecEntry {
    slot: u32,
    run: u32,
    offset: u32,
}

/// A speculative holder as a walk sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SpeculativeHolder {
    pub(crate) slot: u32,
    /// Leading blocks (this one included) the holder holds speculatively in a row: the
    /// entry's offset + 1, when its run is intact through it.
    pub(crate) run_back: u32,
    /// Blocks after this one its run is known to hold (a hint: 0 when unknown).
    pub(crate) run_ahead: u32,
}

/// Speculative entries per block key, bounded in number.
pub(crate) struct Speculative {
    entries: SpecMap,
    /// Entries per bucket of key bits (see the module docs).
    filter: Box<[AtomicU16]>,
    count: AtomicUsize,
    ttl: Duration,
    max_entries: usize,
    runs: Runs,
    /// When a record last purged expired entries (nanoseconds after the runs' epoch).
    last_purge: AtomicU64,
    /// Entries written or moved by records (what a record costs; for tests).
    #[cfg(test)]
    written: AtomicUsize,
    /// Records written shard by shard (for tests).
    #[cfg(test)]
    shard_records: AtomicUsize,
    /// New blocks from which a record writes shard by shard ([`RUN_FROM`]; tests compare
    /// both ways).
    run_from: usize,
}

/// A record near the bound purges expired entries at most this often: a purge scans the
/// whole map, and it runs on a request's task.
const RECORD_PURGE_INTERVAL: Duration = Duration::from_millis(50);

/// New blocks from which a record writes shard by shard (see the module docs); shorter ones
/// go block by block, where sorting would cost more than the misses it overlaps.
const RUN_FROM: usize = 64;

impl Speculative {
    pub(crate) fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            entries: SpecMap::default(),
            filter: (0..1usize << FILTER_BITS)
                .map(|_| AtomicU16::new(0))
                .collect(),
            count: AtomicUsize::new(0),
            ttl,
            max_entries,
            // Every live run has an entry (or a writer), so runs never outnumber entries
            // (+ concurrent writers, bounded by the small slack).
            runs: Runs::new(max_entries + 1024, Instant::now()),
            last_purge: AtomicU64::new(0),
            #[cfg(test)]
            written: AtomicUsize::new(0),
            #[cfg(test)]
            shard_records: AtomicUsize::new(0),
            run_from: RUN_FROM,
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

    /// Records `slot` as holding `keys` (consecutive blocks of one prompt) until now + TTL, as
    /// one run; an entry `slot` already had for one of them moves into this run (refreshed).
    /// A leading stretch that a live intact run of `slot` holds from its first entry on is
    /// refreshed in place instead, at O(log) probes (see the module docs).
    /// Returns how many new entries were refused because the bound was reached (the run's
    /// intact length stops at the first of them).
    pub(crate) fn record(&self, slot: u32, keys: &[BlockKey], now: Instant) -> usize {
        let keys = keys
            .get(self.refresh_held(slot, keys, now)..)
            .unwrap_or_default();
        if keys.is_empty() {
            return 0;
        }
        if self.count.load(Ordering::Relaxed) + keys.len() > self.max_entries {
            let at = self.runs.nanos(now);
            let last = self.last_purge.load(Ordering::Relaxed);
            let interval = RECORD_PURGE_INTERVAL.as_nanos() as u64;
            if at.saturating_sub(last) >= interval
                && self
                    .last_purge
                    .compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                self.purge_expired(now);
            }
        }
        let Some(run) = self.runs.start(now + self.ttl) else {
            return keys.len();
        };
        if keys.len() >= self.run_from && self.reserve(keys.len()) {
            self.write_run(slot, run, keys);
            return 0;
        }
        // Entries before the first refused one are all present: the run's intact length.
        let mut contiguous: Option<u32> = None;
        let mut refused = 0;
        for (offset, key) in (0u32..).zip(keys) {
            #[cfg(test)]
            self.written.fetch_add(1, Ordering::Relaxed);
            let Some(mut table) = self.entries.write(*key) else {
                contiguous.get_or_insert(offset);
                refused += 1;
                continue;
            };
            let holders = table.entry(*key).or_default();
            if let Some(existing) = holders.iter_mut().find(|e| e.slot == slot) {
                let old = *existing;
                *existing = SpecEntry { slot, run, offset };
                self.runs.joined(run, 1);
                self.runs.left(old.run, old.offset);
                continue;
            }
            if self.count.load(Ordering::Relaxed) >= self.max_entries {
                contiguous.get_or_insert(offset);
                refused += 1;
                if holders.is_empty() {
                    table.remove(key);
                }
                continue;
            }
            self.runs.joined(run, 1);
            holders.push(SpecEntry { slot, run, offset });
            self.count_in(key, 1);
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        let written = contiguous.unwrap_or(u32::try_from(keys.len()).unwrap_or(u32::MAX));
        self.runs.finish(run, written);
        refused
    }

    /// Counts `entries` new entries in advance if they fit under the bound (see the module
    /// docs); false, counting nothing, when they might not.
    fn reserve(&self, entries: usize) -> bool {
        self.count
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |count| {
                count
                    .checked_add(entries)
                    .filter(|after| *after <= self.max_entries)
            })
            .is_ok()
    }

    /// Writes `keys` as `run` of `slot`, shard by shard, their entries reserved in the count
    /// ([`Self::reserve`]): the long record's path (see the module docs).
    fn write_run(&self, slot: u32, run: u32, keys: &[BlockKey]) {
        let n = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        #[cfg(test)]
        {
            self.written.fetch_add(keys.len(), Ordering::Relaxed);
            self.shard_records.fetch_add(1, Ordering::Relaxed);
        }
        // Joined for all up front: the writer's own reference already keeps the run alive,
        // this spares one atomic per entry.
        self.runs.joined(run, n);
        let mut replaced = 0;
        self.entries.write_keys(keys, |holders, k, key| {
            let offset = u32::try_from(k).unwrap_or(u32::MAX);
            let entry = SpecEntry { slot, run, offset };
            if let Some(existing) = holders.iter_mut().find(|e| e.slot == slot) {
                let old = *existing;
                *existing = entry;
                self.runs.left(old.run, old.offset);
                replaced += 1;
            } else {
                holders.push(entry);
                self.count_in(&key, 1);
            }
        });
        self.count.fetch_sub(replaced, Ordering::Relaxed);
        self.runs.finish(run, n);
    }

    /// The entry of `slot` for `key`, if any.
    fn entry_of(&self, key: &BlockKey, slot: u32) -> Option<SpecEntry> {
        if !self.may_hold(key) {
            return None;
        }
        self.entries
            .read(*key)?
            .get(key)?
            .iter()
            .find(|e| e.slot == slot)
            .copied()
    }

    /// Refreshes, in place, the leading stretch of `keys` that live intact runs of `slot`
    /// hold from their first entry on (see the module docs); returns its length.
    fn refresh_held(&self, slot: u32, keys: &[BlockKey], now: Instant) -> usize {
        if self.is_empty() {
            return 0;
        }
        let (at, expires) = (self.runs.nanos(now), self.runs.nanos(now + self.ttl));
        let mut done = 0;
        while let Some(first) = keys.get(done)
            && let Some(entry) = self.entry_of(first, slot)
            && entry.offset == 0
        {
            let run = entry.run;
            let rest = keys.len() - done;
            let intact = self.runs.intact(run) as usize;
            let live = self.runs.live_len(run, at) as usize;
            let limit = rest.min(intact).min(live);
            if limit == 0 {
                break;
            }
            // The largest d < limit with our block done+d at offset d of the run (true at 0;
            // once false, false after: chained keys).
            let here = |d: usize| {
                keys.get(done + d)
                    .and_then(|key| self.entry_of(key, slot))
                    .is_some_and(|e| e.run == run && e.offset as usize == d)
            };
            let held = if here(limit - 1) {
                limit
            } else {
                let (mut yes, mut no) = (0, limit - 1);
                while no - yes > 1 {
                    let mid = yes + (no - yes) / 2;
                    if here(mid) {
                        yes = mid;
                    } else {
                        no = mid;
                    }
                }
                yes + 1
            };
            if !self
                .runs
                .refresh_head(run, u32::try_from(held).unwrap_or(u32::MAX), expires)
            {
                break;
            }
            done += held;
        }
        done
    }

    /// Calls `visit` with each live speculative holder of `key`; false when it has none.
    pub(crate) fn visit(
        &self,
        key: &BlockKey,
        now: Instant,
        mut visit: impl FnMut(SpeculativeHolder),
    ) -> bool {
        if !self.may_hold(key) {
            return false;
        }
        let Some(table) = self.entries.read(*key) else {
            return false;
        };
        let Some(entry) = table.get(key) else {
            return false;
        };
        let now = self.runs.nanos(now);
        let mut any = false;
        for e in entry.iter() {
            let live = self.runs.live_len(e.run, now);
            if live > e.offset {
                let intact = self.runs.intact(e.run).min(live);
                let (run_back, run_ahead) = if intact > e.offset {
                    (e.offset + 1, (intact - 1 - e.offset).min(1 << 20))
                } else {
                    (1, 0)
                };
                visit(SpeculativeHolder {
                    slot: e.slot,
                    run_back,
                    run_ahead,
                });
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
        if let Some(mut table) = self.entries.write(*key) {
            self.confirm_in(&mut table, key, slot);
        }
    }

    /// [`Self::confirm`] of each of `keys` (a stored chain's run of new blocks), each shard of
    /// the map locked once for all its keys, so their cache misses overlap as the run's own
    /// writes do (`map::SpecMap::write_keys`). The result is confirming them one by one: each
    /// key's confirmation touches only its own entries, and the runs' counts only go down.
    pub(crate) fn confirm_keys(&self, keys: &[BlockKey], slot: u32) {
        if self.is_empty() {
            return;
        }
        // The filter first: most keys of a run nobody routed recently have no entries.
        let maybe: Vec<BlockKey> = keys.iter().filter(|k| self.may_hold(k)).copied().collect();
        match maybe.as_slice() {
            [] => {}
            [key] => self.confirm(key, slot),
            _ => self
                .entries
                .write_tables(&maybe, |table, key| self.confirm_in(table, &key, slot)),
        }
    }

    /// Drops `slot`'s entry of `key` from its shard's `table`, held locked.
    fn confirm_in(&self, table: &mut map::Table, key: &BlockKey, slot: u32) {
        if let Some(list) = table.get_mut(key) {
            let before = list.len();
            list.retain(|e| {
                let keep = e.slot != slot;
                if !keep {
                    self.runs.left(e.run, e.offset);
                }
                keep
            });
            let removed = before - list.len();
            self.count_out(key, removed);
            self.count.fetch_sub(removed, Ordering::Relaxed);
            if list.is_empty() {
                table.remove(key);
            }
        }
    }

    /// Drops expired entries.
    pub(crate) fn purge_expired(&self, now: Instant) {
        let now = self.runs.nanos(now);
        self.retain(|e| self.runs.alive(e.run, e.offset, now));
    }

    /// Drops every entry of a slot (the pod left).
    pub(crate) fn remove_slot(&self, slot: u32) {
        self.retain(|e| e.slot != slot);
    }

    fn retain(&self, keep: impl Fn(&SpecEntry) -> bool) {
        let mut removed = 0;
        self.entries.retain(|key, list| {
            let before = list.len();
            list.retain(|e| {
                let kept = keep(e);
                if !kept {
                    self.runs.left(e.run, e.offset);
                }
                kept
            });
            self.count_out(key, before - list.len());
            removed += before - list.len();
        });
        self.count.fetch_sub(removed, Ordering::Relaxed);
    }

    /// Live + expired entries not yet purged.
    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests;
