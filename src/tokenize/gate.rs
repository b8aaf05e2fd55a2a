//! A byte-weighted limit on how much request text is parsed and tokenized at once.
//!
//! Preparing a body (parse, render, tokenize, key its blocks) holds several times the body's
//! size (the prompt string, ids, word starts, the prefix-cache entry): three 16 MB prompts of
//! words at once peaked at 543 MB RSS. The body budget (`--max-buffered-bytes`, 1 GiB) would
//! admit 64 such bodies, and 2 cores gain nothing from tokenizing more than a few at once, so
//! large preparations enter this gate first: at most `--max-preparing-bytes` of bodies are
//! prepared at a time, the rest wait (in FIFO order, holding only their buffered body).

use std::sync::Arc;

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
}

/// Leave to prepare a body; the bytes return to the gate when it is dropped.
#[derive(Debug)]
pub struct PreparePermit {
    _permit: Option<OwnedSemaphorePermit>,
    bytes: i64,
    preparing: IntGauge,
}

impl Drop for PreparePermit {
    fn drop(&mut self) {
        self.preparing.sub(self.bytes);
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

        let open = PrepareGate::new(0, &Registry::new()).expect("gate");
        let _x = open.enter(usize::MAX).await;
        let _y = open.enter(usize::MAX).await;
    }
}
