//! Run state, readable without locks (the concurrency rules are in the parent module's docs).

use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::time::Instant;

/// Every run's state, in chunks that never move.
pub(super) struct Runs {
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
    pub(super) fn new(max_runs: usize, epoch: Instant) -> Self {
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

    pub(super) fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    fn book(&self) -> std::sync::MutexGuard<'_, RunBook> {
        // NOTE: the book is a free list; a panic mid-update loses at most an id.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new run expiring at `expires`, held by its writer; `None` when every id is taken.
    pub(super) fn start(&self, expires: Instant) -> Option<u32> {
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

    /// `entries` more entries of `run` present.
    pub(super) fn joined(&self, run: u32, entries: u32) {
        if let Some(cell) = self.cell(run) {
            cell.live.fetch_add(entries, Ordering::AcqRel);
        }
    }

    /// The entry of `run` at `offset` left (or, with `offset == u32::MAX`, the writer is done).
    pub(super) fn left(&self, run: u32, offset: u32) {
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
    pub(super) fn finish(&self, run: u32, written: u32) {
        if let Some(cell) = self.cell(run) {
            cell.intact.fetch_min(written, Ordering::AcqRel);
        }
        self.left(run, u32::MAX);
    }

    /// Whether the entry of `run` at `offset` is alive at `now`.
    pub(super) fn alive(&self, run: u32, offset: u32, now: u64) -> bool {
        self.live_len(run, now) > offset
    }

    /// How many leading offsets of `run` are alive at `now` (all, or its head, or none).
    pub(super) fn live_len(&self, run: u32, now: u64) -> u32 {
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
    pub(super) fn refresh_head(&self, run: u32, upto: u32, expires: u64) -> bool {
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

    pub(super) fn intact(&self, run: u32) -> u32 {
        self.cell(run)
            .map_or(0, |c| c.intact.load(Ordering::Acquire))
    }
}
