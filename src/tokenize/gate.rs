//! A byte-weighted limit on how much request text is parsed and tokenized at once.
//!
//! Preparing a body (parse, render, tokenize, key its blocks) holds several times the body's
//! size (the prompt string, ids, word starts, the prefix-cache entry): three 16 MB prompts of
//! words at once peaked at 543 MB RSS. The body budget (`--max-buffered-bytes`, 1 GiB) would
//! admit 64 such bodies, and 2 cores gain nothing from tokenizing more than a few at once, so
//! large preparations enter this gate first: at most `--max-preparing-bytes` of bodies are
//! prepared at a time, the rest wait (in FIFO order, holding only their buffered body).
//!
//! When the last large preparation in progress ends, the memory it freed is returned to the
//! OS ([`release_free_memory`]): the allocator would otherwise keep it resident.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::{IntCounter, IntGauge, Registry};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Default bytes of bodies prepared at once: two bodies of the default 16 MiB limit.
pub const DEFAULT_MAX_PREPARING_BYTES: usize = 32 * 1024 * 1024;

/// The gate (see the module docs).
#[derive(Debug)]
pub struct PrepareGate {
    /// `None`: no limit (capacity 0).
    semaphore: Option<Arc<Semaphore>>,
    capacity: u32,
    preparing: IntGauge,
    waits: IntCounter,
    /// Set when a large preparation ended: [`PrepareGate::trim_if_due`] then trims.
    trim_due: Arc<AtomicBool>,
}

/// Leave to prepare a body; the bytes return to the gate when it is dropped.
#[derive(Debug)]
pub struct PreparePermit {
    _permit: Option<OwnedSemaphorePermit>,
    bytes: i64,
    preparing: IntGauge,
    trim_due: Arc<AtomicBool>,
}

impl Drop for PreparePermit {
    fn drop(&mut self) {
        self.preparing.sub(self.bytes);
        if self.bytes >= TRIM_AFTER_BYTES {
            self.trim_due.store(true, Ordering::Relaxed);
        }
    }
}

/// Marks a trim due when dropped: for what a large request frees after its preparation (its
/// prompt's tokens and keys, released with its routing record, often on another thread).
#[derive(Debug)]
pub struct TrimLater {
    trim_due: Arc<AtomicBool>,
}

impl Drop for TrimLater {
    fn drop(&mut self) {
        self.trim_due.store(true, Ordering::Relaxed);
    }
}

/// Preparations of at least this many bytes return their freed memory to the OS.
const TRIM_AFTER_BYTES: i64 = 1 << 20;

/// Returns memory the allocator holds free to the OS.
///
/// NOTE: glibc's malloc keeps what a thread freed in that thread's arena: after six 16 MB
/// prompts were tokenized on blocking-pool threads, 240 MB stayed resident with every cache
/// off (0 MB with `MALLOC_ARENA_MAX=1`, 30–90 MB with jemalloc or mimalloc preloaded).
/// `malloc_trim(0)` releases the free pages of every arena; it walks the heaps, so it runs
/// only after large work, from [`PrepareGate::trim_if_due`] on a timer (by then the body
/// and its tokens, freed after the pick on other threads, are free too).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only returns free pages to the OS.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl PrepareGate {
    /// A gate of `capacity` bytes (0: no limit; more than `u32::MAX` is capped there), its
    /// metrics registered in `registry`.
    pub fn new(capacity: usize, registry: &Registry) -> prometheus::Result<Self> {
        let preparing = IntGauge::new(
            "kvpick_tokenize_preparing_bytes",
            "Bytes of request bodies being parsed and tokenized right now",
        )?;
        let waits = IntCounter::new(
            "kvpick_tokenize_prepare_waits_total",
            "Bodies that waited for --max-preparing-bytes before being tokenized",
        )?;
        registry.register(Box::new(preparing.clone()))?;
        registry.register(Box::new(waits.clone()))?;
        let capacity = u32::try_from(capacity).unwrap_or(u32::MAX);
        Ok(Self {
            semaphore: (capacity > 0).then(|| Arc::new(Semaphore::new(capacity as usize))),
            capacity,
            preparing,
            waits,
            trim_due: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Returns freed memory to the OS if a large preparation ended since the last call and
    /// none is in progress (else the next call will). Blocking: call it off the async workers.
    pub fn trim_if_due(&self) -> bool {
        if self.preparing.get() > 0 || !self.trim_due.swap(false, Ordering::Relaxed) {
            return false;
        }
        release_free_memory();
        true
    }

    /// For a request of `bytes`: a handle that marks a trim due when dropped, if the request
    /// is large enough to be worth one.
    pub fn trim_later(&self, bytes: usize) -> Option<TrimLater> {
        (i64::try_from(bytes).unwrap_or(i64::MAX) >= TRIM_AFTER_BYTES).then(|| TrimLater {
            trim_due: Arc::clone(&self.trim_due),
        })
    }

    /// Waits until `bytes` more can be prepared. A body larger than the whole capacity takes
    /// all of it (it runs alone rather than never).
    pub async fn enter(&self, bytes: usize) -> PreparePermit {
        let permit = match &self.semaphore {
            None => None,
            Some(semaphore) => {
                let weight = u32::try_from(bytes)
                    .unwrap_or(u32::MAX)
                    .clamp(1, self.capacity);
                match Arc::clone(semaphore).try_acquire_many_owned(weight) {
                    Ok(permit) => Some(permit),
                    Err(_) => {
                        self.waits.inc();
                        // NOTE: the semaphore is never closed, so this only fails if it
                        // were; then the body is prepared unthrottled rather than refused.
                        Arc::clone(semaphore).acquire_many_owned(weight).await.ok()
                    }
                }
            }
        };
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.preparing.add(bytes);
        PreparePermit {
            _permit: permit,
            bytes,
            preparing: self.preparing.clone(),
            trim_due: Arc::clone(&self.trim_due),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bodies_over_the_capacity_wait_in_order_and_an_oversized_one_runs_alone() {
        let gate = Arc::new(PrepareGate::new(100, &Registry::new()).expect("gate"));
        let a = gate.enter(60).await;
        let b = gate.enter(40).await;
        assert_eq!(gate.preparing.get(), 100);
        let waiting = tokio::spawn({
            let gate = Arc::clone(&gate);
            async move { gate.enter(1_000).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the capacity is taken");
        assert_eq!(gate.waits.get(), 1);
        drop(a);
        tokio::task::yield_now().await;
        assert!(
            !waiting.is_finished(),
            "1,000 bytes take the whole capacity"
        );
        drop(b);
        let big = waiting.await.expect("join");
        assert_eq!(gate.preparing.get(), 1_000);
        drop(big);
        assert_eq!(gate.preparing.get(), 0);
        assert!(!gate.trim_if_due(), "only small preparations ended");

        let large = PrepareGate::new(8 << 20, &Registry::new()).expect("gate");
        let a = large.enter(2 << 20).await;
        let b = large.enter(2 << 20).await;
        drop(a);
        assert!(!large.trim_if_due(), "a large preparation is in progress");
        drop(b);
        assert!(large.trim_if_due(), "large preparations ended");
        assert!(!large.trim_if_due(), "once");

        let open = PrepareGate::new(0, &Registry::new()).expect("gate");
        let _x = open.enter(usize::MAX).await;
        let _y = open.enter(usize::MAX).await;
    }
}
