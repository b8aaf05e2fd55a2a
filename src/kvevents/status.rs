//! Per pod event-stream state, readable without locks (for `GET /debug/pods`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Live counters of one pod's event stream (written by its subscriber and the index writer).
#[derive(Debug)]
pub struct PodEventCounters {
    pub(crate) connected: AtomicBool,
    /// Last seq accepted; `u64::MAX` = none yet.
    pub(crate) last_seq: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) applied: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) gaps: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) clears: AtomicU64,
}

impl Default for PodEventCounters {
    fn default() -> Self {
        Self {
            connected: AtomicBool::new(false),
            last_seq: AtomicU64::new(u64::MAX),
            received: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            clears: AtomicU64::new(0),
        }
    }
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl PodEventCounters {
    /// A consistent-enough snapshot (each field is read atomically).
    pub fn snapshot(&self) -> KvEventsStatus {
        let last = self.last_seq.load(Ordering::Relaxed);
        KvEventsStatus {
            connected: self.connected.load(Ordering::Relaxed),
            last_seq: (last != u64::MAX).then_some(last),
            gaps: self.gaps.load(Ordering::Relaxed),
            replays: self.replays.load(Ordering::Relaxed),
            clears: self.clears.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            applied: self.applied.load(Ordering::Relaxed),
            malformed: self.malformed.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
        }
    }
}

/// The `kv_events` object of `GET /debug/pods` (DESIGN §2.1), plus the per pod counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KvEventsStatus {
    /// Whether the subscriber is connected (connect mode) or has heard from the pod (central).
    pub connected: bool,
    /// Last sequence number accepted.
    pub last_seq: Option<u64>,
    /// Sequence gaps detected.
    pub gaps: u64,
    /// Replays requested.
    pub replays: u64,
    /// Times the pod's entries were cleared.
    pub clears: u64,
    /// Batches received.
    pub received: u64,
    /// Batches applied to the index.
    pub applied: u64,
    /// Messages that failed to decode.
    pub malformed: u64,
    /// Batches dropped on a full channel.
    pub dropped: u64,
}

/// One pod's index view for `GET /debug/pods`: `index_blocks` and `kv_events`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PodIndexStatus {
    /// `ip:port`.
    pub address: String,
    /// (block, tier) entries the index holds for the pod.
    pub index_blocks: usize,
    /// The event stream's state; `None` when the pod has no event source.
    pub kv_events: Option<KvEventsStatus>,
}
