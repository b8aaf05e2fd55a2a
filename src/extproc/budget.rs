//! The request-body buffer budget (`--max-buffered-bytes`), shared so that uploads that stall
//! while holding large bodies cannot lock every other request out.
//!
//! The rule: the first *head* bytes of every body (`--max-body-bytes` / 16: 1 MiB by default)
//! may use the whole budget; the rest of a body comes from a *bulk share* of three quarters
//! of the budget. Large bodies, however many and however slow, therefore hold at most the
//! bulk share, and the quarter left over serves only request heads: at least
//! `budget / 4 / head` requests of up to a head each (256 with the defaults, far more for
//! the few-KB bodies of typical prompts) always find room. The bulk share never drops below
//! one full body, so a budget of exactly `--max-body-bytes` still takes one (its reserve is
//! then just one head). `--request-body-timeout` bounds how long any upload holds its part.
//!
//! NOTE: this guarantees room for normal requests against large stalled uploads, not against
//! thousands of small stalled ones: those are bounded by `--max-extproc-streams` and the body
//! timeout instead, as kvpick cannot tell one client from another behind the gateway.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The share of `--max-body-bytes` every body may take from the whole budget.
const HEAD_DIVISOR: usize = 16;
/// The share of the budget (1/N) kept for request heads.
const RESERVE_DIVISOR: usize = 4;

/// The body budget all streams share.
#[derive(Debug)]
pub struct BodyBudget {
    total: Arc<Semaphore>,
    bulk: Arc<Semaphore>,
    capacity: usize,
    head: usize,
}

/// The budget one stream holds; dropping it returns the bytes.
#[derive(Debug, Default)]
pub struct Held {
    total: Option<OwnedSemaphorePermit>,
    bulk: Option<OwnedSemaphorePermit>,
    bytes: usize,
}

impl Held {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// The budget (or the bulk share) has no room for a chunk.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("request body buffer budget exhausted")]
pub struct Exhausted;

impl BodyBudget {
    /// A budget of `capacity` bytes for bodies of at most `max_body` bytes.
    pub fn new(capacity: usize, max_body: usize) -> Self {
        let capacity = capacity.min(Semaphore::MAX_PERMITS);
        let head = (max_body / HEAD_DIVISOR).max(1);
        let bulk = (capacity - capacity / RESERVE_DIVISOR)
            .max(max_body.saturating_sub(head))
            .min(capacity);
        Self {
            total: Arc::new(Semaphore::new(capacity)),
            bulk: Arc::new(Semaphore::new(bulk)),
            capacity,
            head,
        }
    }

    /// The whole budget in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes not held by any stream.
    pub fn available(&self) -> usize {
        self.total.available_permits()
    }

    /// Takes `len` more bytes for the stream holding `held`: all or nothing.
    pub fn take(&self, held: &mut Held, len: usize) -> Result<(), Exhausted> {
        let head_left = self.head.saturating_sub(held.bytes);
        let bulk_len = len.saturating_sub(head_left);
        let permits = |n: usize| u32::try_from(n).map_err(|_| Exhausted);
        // Bulk first: when it has no room, the whole budget is not touched.
        let bulk = if bulk_len > 0 {
            Some(
                Arc::clone(&self.bulk)
                    .try_acquire_many_owned(permits(bulk_len)?)
                    .map_err(|_| Exhausted)?,
            )
        } else {
            None
        };
        let total = Arc::clone(&self.total)
            .try_acquire_many_owned(permits(len)?)
            .map_err(|_| Exhausted)?;
        merge(&mut held.total, total);
        if let Some(bulk) = bulk {
            merge(&mut held.bulk, bulk);
        }
        held.bytes += len;
        Ok(())
    }
}

fn merge(slot: &mut Option<OwnedSemaphorePermit>, permit: OwnedSemaphorePermit) {
    match slot {
        Some(held) => held.merge(permit),
        None => *slot = Some(permit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn stalled_large_bodies_leave_the_reserve_to_request_heads() {
        // 8 MiB budget, 1 MiB bodies: heads of 64 KiB, bulk share 6 MiB.
        let budget = BodyBudget::new(8 * MIB, MIB);
        let mut uploads = Vec::new();
        loop {
            let mut held = Held::default();
            let taken = budget.take(&mut held, MIB - 1);
            if taken.is_err() {
                assert_eq!(held.bytes(), 0, "a refused chunk takes nothing");
                break;
            }
            uploads.push(held);
        }
        assert_eq!(uploads.len(), 6, "large bodies fill only the bulk share");
        // 2 MiB + the rounding left: 32 heads of 64 KiB still fit.
        let mut heads = Vec::new();
        for _ in 0..32 {
            let mut held = Held::default();
            budget.take(&mut held, 64 * 1024).expect("a head fits");
            heads.push(held);
        }
        let mut big = Held::default();
        assert_eq!(budget.take(&mut big, 200 * 1024), Err(Exhausted));
        drop(uploads);
        drop(heads);
        assert_eq!(budget.available(), 8 * MIB, "everything returned");
    }

    #[test]
    fn a_body_grows_from_its_head_into_the_bulk_share() {
        let budget = BodyBudget::new(4 * MIB, MIB);
        let mut held = Held::default();
        for _ in 0..16 {
            budget.take(&mut held, 64 * 1024).expect("room");
        }
        assert_eq!(held.bytes(), MIB);
        assert_eq!(budget.available(), 3 * MIB);
        assert_eq!(budget.bulk.available_permits(), 3 * MIB - (MIB - 64 * 1024));
        drop(held);
        assert_eq!(budget.bulk.available_permits(), 3 * MIB);
    }

    #[test]
    fn a_budget_of_one_body_still_takes_one_body() {
        let budget = BodyBudget::new(MIB, MIB);
        let mut held = Held::default();
        budget.take(&mut held, MIB).expect("one full body");
        assert_eq!(budget.available(), 0);
    }
}
