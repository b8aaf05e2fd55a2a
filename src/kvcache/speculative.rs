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
//! A counting filter in front of the map (entries per bucket of key bits, updated under the
//! key's map lock, read without it) lets a walk skip the map for the blocks no pod holds
//! speculatively — most blocks of a long prompt — at the price of one relaxed atomic load.
//! A counter is never below the entries of its bucket (one that saturates stays saturated),
//! so a zero is always a true "none".

use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use dashmap::DashMap;
use smallvec::SmallVec;
use tokio::time::Instant;

use super::key::{BlockKey, PrehashedState};

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
    /// A block's holders in place, not on the heap: nearly every block has one (a record of
    /// a cold prompt writes thousands, and an allocation each was half of its cost).
    entries: DashMap<BlockKey, SmallVec<[SpecEntry; 1]>, PrehashedState>,
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
}

/// A record near the bound purges expired entries at most this often: a purge scans the
/// whole map, and it runs on a request's task.
const RECORD_PURGE_INTERVAL: Duration = Duration::from_millis(50);

/// Run state, readable without locks (see the module docs).
struct Runs {
    chunks: Box<[OnceLock<Box<[RunCell]>>]>,
    book: Mutex<RunBook>,
    /// Expiry times are stored as nanoseconds after this instant.
    epoch: Instant,
}

const RUN_CHUNK: usize = 4096;

#[derive(Default)]
struct RunCell {
    /// Expiry, in nanoseconds after [`Runs::epoch`] (0: free).
    expires: AtomicU64,
    /// Leading entries all present.
    intact: AtomicU32,
    /// Entries below this offset live until at least `head_expires` (see the module docs).
    head: AtomicU32,
    /// The head's expiry, in nanoseconds after [`Runs::epoch`].
    head_expires: AtomicU64,
    /// Entries present, plus one while the writer is still writing.
    live: AtomicU32,
}

#[derive(Default)]
struct RunBook {
    free: Vec<u32>,
    next: u32,
}

impl Runs {
    fn new(max_runs: usize, epoch: Instant) -> Self {
        Self {
            chunks: (0..max_runs.div_ceil(RUN_CHUNK).max(1))
                .map(|_| OnceLock::new())
                .collect(),
            book: Mutex::new(RunBook::default()),
            epoch,
        }
    }

    fn cell(&self, run: u32) -> Option<&RunCell> {
        let (chunk, at) = (run as usize / RUN_CHUNK, run as usize % RUN_CHUNK);
        self.chunks
            .get(chunk)?
            .get_or_init(|| (0..RUN_CHUNK).map(|_| RunCell::default()).collect())
            .get(at)
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    fn book(&self) -> std::sync::MutexGuard<'_, RunBook> {
        // NOTE: the book is a free list; a panic mid-update loses at most an id.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new run expiring at `expires`, held by its writer; `None` when every id is taken.
    fn start(&self, expires: Instant) -> Option<u32> {
        let run = {
            let mut book = self.book();
            match book.free.pop() {
                Some(run) => run,
                None if (book.next as usize) < self.chunks.len() * RUN_CHUNK => {
                    book.next += 1;
                    book.next - 1
                }
                None => return None,
            }
        };
        let cell = self.cell(run)?;
        cell.intact.store(u32::MAX, Ordering::Release);
        cell.live.store(1, Ordering::Release);
        cell.head.store(0, Ordering::Release);
        cell.head_expires.store(0, Ordering::Release);
        cell.expires.store(self.nanos(expires), Ordering::Release);
        Some(run)
    }

    /// One more entry of `run` present.
    fn joined(&self, run: u32) {
        if let Some(cell) = self.cell(run) {
            cell.live.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The entry of `run` at `offset` left (or, with `offset == u32::MAX`, the writer is done).
    fn left(&self, run: u32, offset: u32) {
        let Some(cell) = self.cell(run) else {
            return;
        };
        cell.intact.fetch_min(offset, Ordering::AcqRel);
        if cell.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            cell.expires.store(0, Ordering::Release);
            cell.head_expires.store(0, Ordering::Release);
            self.book().free.push(run);
        }
    }

    /// The writer of `run` wrote `written` leading entries and is done.
    fn finish(&self, run: u32, written: u32) {
        if let Some(cell) = self.cell(run) {
            cell.intact.fetch_min(written, Ordering::AcqRel);
        }
        self.left(run, u32::MAX);
    }

    /// Whether the entry of `run` at `offset` is alive at `now`.
    fn alive(&self, run: u32, offset: u32, now: u64) -> bool {
        self.live_len(run, now) > offset
    }

    /// How many leading offsets of `run` are alive at `now` (all, or its head, or none).
    fn live_len(&self, run: u32, now: u64) -> u32 {
        let Some(c) = self.cell(run) else {
            return 0;
        };
        if c.expires.load(Ordering::Acquire) > now {
            return u32::MAX;
        }
        // Head before its expiry: the writer stores them in the other order.
        let head = c.head.load(Ordering::Acquire);
        if c.head_expires.load(Ordering::Acquire) > now {
            head
        } else {
            0
        }
    }

    /// Keeps the first `upto` entries of `run` alive until at least `expires`; false when
    /// the run's head cannot say so (a longer head expiring sooner: see the module docs).
    fn refresh_head(&self, run: u32, upto: u32, expires: u64) -> bool {
        let Some(cell) = self.cell(run) else {
            return false;
        };
        // NOTE: serialised on the book's lock (two records of one pod may refresh one run at
        // once); it is held for a few loads and stores.
        let _book = self.book();
        if cell.live.load(Ordering::Acquire) == 0 {
            return false;
        }
        let (head, head_expires) = (
            cell.head.load(Ordering::Acquire),
            cell.head_expires.load(Ordering::Acquire),
        );
        if upto < head {
            return head_expires >= expires;
        }
        cell.head_expires
            .store(head_expires.max(expires), Ordering::Release);
        cell.head.store(upto, Ordering::Release);
        true
    }

    fn intact(&self, run: u32) -> u32 {
        self.cell(run)
            .map_or(0, |c| c.intact.load(Ordering::Acquire))
    }
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
            // Every live run has an entry (or a writer), so runs never outnumber entries
            // (+ concurrent writers, bounded by the small slack).
            runs: Runs::new(max_entries + 1024, Instant::now()),
            last_purge: AtomicU64::new(0),
            #[cfg(test)]
            written: AtomicUsize::new(0),
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
        // Entries before the first refused one are all present: the run's intact length.
        let mut contiguous: Option<u32> = None;
        let mut refused = 0;
        for (offset, key) in (0u32..).zip(keys) {
            #[cfg(test)]
            self.written.fetch_add(1, Ordering::Relaxed);
            let mut entry = self.entries.entry(*key).or_default();
            if let Some(existing) = entry.iter_mut().find(|e| e.slot == slot) {
                let old = *existing;
                *existing = SpecEntry { slot, run, offset };
                self.runs.joined(run);
                self.runs.left(old.run, old.offset);
                continue;
            }
            if self.count.load(Ordering::Relaxed) >= self.max_entries {
                contiguous.get_or_insert(offset);
                refused += 1;
                continue;
            }
            self.runs.joined(run);
            entry.push(SpecEntry { slot, run, offset });
            self.count_in(key, 1);
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        let written = contiguous.unwrap_or(u32::try_from(keys.len()).unwrap_or(u32::MAX));
        self.runs.finish(run, written);
        refused
    }

    /// The entry of `slot` for `key`, if any.
    fn entry_of(&self, key: &BlockKey, slot: u32) -> Option<SpecEntry> {
        if !self.may_hold(key) {
            return None;
        }
        self.entries
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
        let Some(entry) = self.entries.get(key) else {
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
        if let dashmap::Entry::Occupied(mut occupied) = self.entries.entry(*key) {
            let list = occupied.get_mut();
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
            if occupied.get().is_empty() {
                occupied.remove();
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

    fn holders(s: &Speculative, key: BlockKey, now: Instant) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        s.visit(&key, now, |h| out.push((h.slot, h.run_back)));
        out
    }

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
        assert!(speculative.visit(&a, now, |h| slots.push(h.slot)));
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

    #[test]
    fn runs_say_how_far_back_a_holder_holds_in_a_row() {
        let speculative = Speculative::new(Duration::from_secs(2), 100);
        let now = Instant::now();
        let keys: Vec<BlockKey> = (1..=6u64).map(|i| BlockKey(i << 24 | i)).collect();
        assert_eq!(speculative.record(7, &keys, now), 0);
        assert_eq!(holders(&speculative, keys[5], now), vec![(7, 6)]);
        // A block of the run confirmed: the entries after it no longer prove the ones before.
        speculative.confirm(&keys[2], 7);
        assert_eq!(holders(&speculative, keys[1], now), vec![(7, 2)]);
        assert_eq!(holders(&speculative, keys[5], now), vec![(7, 1)]);
        // A newer record takes the entries it covers into its own run.
        speculative.record(7, &keys[3..], now);
        assert_eq!(holders(&speculative, keys[5], now), vec![(7, 3)]);
        // Expired runs hold nothing; purged, their ids are reused and start afresh.
        let later = now + Duration::from_secs(3);
        assert!(holders(&speculative, keys[5], later).is_empty());
        speculative.purge_expired(later);
        assert_eq!(speculative.len(), 0);
        speculative.record(8, &keys[..2], later);
        assert_eq!(holders(&speculative, keys[1], later), vec![(8, 2)]);
    }

    fn keys(from: u64, n: u64) -> Vec<BlockKey> {
        (from..from + n).map(|i| BlockKey(i << 24 | i)).collect()
    }

    fn written(s: &Speculative) -> usize {
        s.written.swap(0, Ordering::Relaxed)
    }

    /// Blocks of `keys` held from the first, in a row, at `now`.
    fn held_run(s: &Speculative, slot: u32, keys: &[BlockKey], now: Instant) -> usize {
        keys.iter()
            .take_while(|k| holders(s, **k, now).iter().any(|(h, _)| *h == slot))
            .count()
    }

    #[tokio::test(start_paused = true)]
    async fn a_warm_rerecord_writes_only_its_new_tail_and_keeps_the_shared_blocks_alive() {
        let ttl = Duration::from_secs(2);
        let s = Speculative::new(ttl, 1 << 20);
        // 6,250 blocks (a 400 KB prompt), 95% shared with the next request's.
        let bundle = keys(1, 5_937);
        let first = [bundle.clone(), keys(100_000, 313)].concat();
        let second = [bundle.clone(), keys(200_000, 313)].concat();
        let start = Instant::now();
        s.record(1, &first, start);
        assert_eq!(written(&s), 6_250);
        tokio::time::advance(Duration::from_millis(1500)).await;
        s.record(1, &second, Instant::now());
        assert_eq!(written(&s), 313, "only the new tail is written");
        assert_eq!(s.len(), 6_250 + 313);
        // Past the first record's TTL: the shared blocks and the new tail live on (refreshed),
        // the first request's own tail expired with its record, as if its entries had moved.
        tokio::time::advance(Duration::from_millis(600)).await;
        let now = Instant::now();
        assert_eq!(held_run(&s, 1, &second, now), 6_250);
        assert_eq!(held_run(&s, 1, &first, now), 5_937);
        // A walk still proves the shared stretch with one probe at its end.
        assert_eq!(holders(&s, bundle[5_936], now), vec![(1, 5_937)]);
        s.purge_expired(now);
        assert_eq!(s.len(), 6_250);
        // Again, and a growing conversation: the third prompt continues the second.
        let third = [second.clone(), keys(300_000, 100)].concat();
        s.record(1, &third, now);
        assert_eq!(written(&s), 100);
        tokio::time::advance(Duration::from_millis(1900)).await;
        assert_eq!(held_run(&s, 1, &third, Instant::now()), 6_350);
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(held_run(&s, 1, &third, Instant::now()), 0, "all expired");
    }

    #[tokio::test(start_paused = true)]
    async fn expired_or_broken_runs_are_recorded_whole() {
        let ttl = Duration::from_secs(2);
        let s = Speculative::new(ttl, 1 << 20);
        let prompt = keys(1, 100);
        s.record(1, &prompt, Instant::now());
        assert_eq!(written(&s), 100);
        // Expired: recorded whole again (the entries move into the new run).
        tokio::time::advance(Duration::from_millis(2100)).await;
        s.record(1, &prompt, Instant::now());
        assert_eq!(written(&s), 100);
        assert_eq!(s.len(), 100);
        assert_eq!(held_run(&s, 1, &prompt, Instant::now()), 100);
        // A run whose first entry was confirmed is no longer intact: recorded whole.
        s.confirm(&prompt[0], 1);
        s.record(1, &prompt[1..], Instant::now());
        assert_eq!(written(&s), 99);
        // Another pod's run is not this pod's.
        s.record(2, &prompt, Instant::now());
        assert_eq!(written(&s), 100);
        // A shorter refresh than the run's head, expiring later, cannot be said by the head:
        // those entries move (whole), the rest keeps its expiry.
        s.record(2, &prompt, Instant::now());
        assert_eq!(written(&s), 0, "a whole refresh in place");
        tokio::time::advance(Duration::from_millis(1000)).await;
        s.record(2, &prompt[..40], Instant::now());
        assert_eq!(written(&s), 40);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(held_run(&s, 2, &prompt, Instant::now()), 40);
    }

    #[test]
    fn the_bound_stops_a_run() {
        let speculative = Speculative::new(Duration::from_secs(2), 3);
        let now = Instant::now();
        let keys: Vec<BlockKey> = (1..=5u64).map(|i| BlockKey(i << 24)).collect();
        assert_eq!(speculative.record(1, &keys, now), 2);
        assert_eq!(speculative.len(), 3);
        assert_eq!(holders(&speculative, keys[2], now), vec![(1, 3)]);
        assert!(holders(&speculative, keys[3], now).is_empty());
        // At the bound, a record still refreshes what it finds; behind a refused block its
        // entries prove only themselves.
        speculative.confirm(&keys[0], 1);
        assert_eq!(speculative.record(1, &keys, now), 2);
        assert_eq!(holders(&speculative, keys[0], now), vec![(1, 1)]);
        assert_eq!(holders(&speculative, keys[2], now), vec![(1, 3)]);
        let new = BlockKey(9 << 24);
        assert_eq!(speculative.record(1, &[new, keys[1], keys[2]], now), 1);
        assert!(holders(&speculative, new, now).is_empty());
        assert_eq!(holders(&speculative, keys[2], now), vec![(1, 1)]);
    }
}
