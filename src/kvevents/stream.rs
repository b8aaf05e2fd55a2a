//! One pod's event stream: decode, sequence, repair gaps, and hand batches to the index
//! writer. Shared by the connect-mode subscriber (one per pod) and the central bind mode.
//!
//! # Ordering rules
//! Every change to a pod's index entries (apply, clear, purge) goes through the one bounded
//! channel to the index writer, in the order this stream decides them, so a clear can never
//! overtake a batch queued before it. Live batches use `try_send` (a full channel drops the
//! batch, counted, and leaves its seq unrecorded so the next batch shows a gap and the replay
//! path repairs it); repair traffic (replayed batches, clears) uses an awaited `send`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::decode::{EventBatch, decode_payload};
use super::replay::fetch_replay;
use super::sequence::{SeqTracker, SeqVerdict};
use super::shared::{IndexUpdate, Shared};
use super::status::{PodEventCounters, bump};
use crate::endpoints::PodId;

/// Stream state of one pod.
pub(crate) struct PodStream {
    pod: PodId,
    label: String,
    replay: Option<String>,
    tracker: SeqTracker,
    counters: Arc<PodEventCounters>,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IndexUpdate>,
    /// The newest batch dropped on a full channel and not yet repaired: if no later batch
    /// comes to reveal the gap, the subscriber repairs it when the socket goes quiet.
    pending: Option<Pending>,
    /// The subscriber reconnected: the publisher may have restarted meanwhile.
    reconnected: bool,
    /// The data-parallel rank of the last batch decoded (for batches that cannot be).
    last_rank: Option<i64>,
}

#[derive(Debug)]
struct Pending {
    model: Arc<str>,
    rank: Option<i64>,
    seq: u64,
}

impl PodStream {
    pub(crate) fn new(
        pod: PodId,
        replay: Option<String>,
        shared: Arc<Shared>,
        tx: mpsc::Sender<IndexUpdate>,
    ) -> Self {
        let counters = shared.counters_for(pod);
        shared.metrics.start(pod);
        Self {
            pod,
            label: pod.to_string(),
            replay,
            tracker: SeqTracker::default(),
            counters,
            shared,
            tx,
            pending: None,
            reconnected: false,
            last_rank: None,
        }
    }

    /// The connection was lost and re-established. A restarted engine that published past
    /// our last seq before we reconnected would look like a mere gap, and replaying its new
    /// batches on top of the old state would keep stale blocks; so after a reconnect any
    /// discontinuity is treated as a restart (clear, then rebuild from seq 0 by replay).
    pub(crate) fn mark_reconnected(&mut self) {
        self.reconnected = true;
    }

    /// The engine restarted (its scrape says so): its entries are dropped now rather than at
    /// its next batch, and sequencing starts over, so the next batch (a gap from 0 after the
    /// reconnect) is rebuilt by replay when the pod has a replay endpoint.
    pub(crate) async fn engine_restarted(&mut self) {
        warn!(pod = %self.pod, "engine restarted (process start time changed): clearing its entries");
        self.clear().await;
        self.tracker.reset();
        self.pending = None;
        self.reconnected = true;
        self.counters.last_seq.store(u64::MAX, Ordering::Relaxed);
    }

    /// What stands in for a batch that did not decode: no events, on the last rank seen (its
    /// own rank is unreadable), so only its seq is recorded.
    fn skipped_batch(&self) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events: Vec::new(),
            dp_rank: self.last_rank,
        }
    }

    /// Whether a dropped batch still waits for repair.
    pub(crate) fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Repairs the dropped batches that no later batch revealed (call when the socket is
    /// quiet).
    pub(crate) async fn repair_pending(&mut self) {
        let Some(pending) = self.pending.take() else {
            return;
        };
        let until = pending.seq.saturating_add(1);
        if let SeqVerdict::Gap { from } = self.tracker.classify(pending.rank, until) {
            self.gap(from, until);
            self.recover(&pending.model, from, until).await;
        }
    }

    pub(crate) fn counters(&self) -> &Arc<PodEventCounters> {
        &self.counters
    }

    pub(crate) fn set_replay(&mut self, replay: Option<String>) {
        self.replay = replay;
    }

    /// Counts a message that could not even be split into frames.
    pub(crate) fn malformed(&self) {
        bump(&self.counters.malformed);
        self.shared
            .metrics
            .malformed
            .with_label_values(&[&self.label])
            .inc();
    }

    /// Handles one live message.
    pub(crate) async fn on_message(&mut self, model: &str, seq: u64, payload: &[u8]) {
        bump(&self.counters.received);
        self.shared
            .metrics
            .received
            .with_label_values(&[&self.label])
            .inc();
        let batch = match decode_payload(payload) {
            Ok(batch) => batch,
            Err(error) => {
                // NOTE: a malformed batch is not a gap: its seq is recorded (as an empty batch
                // of the last rank seen, since its own rank is unreadable) so the next good batch
                // is in order, and replay is not asked for bytes it would return unchanged. Its
                // events are lost, which can leave stale entries until those blocks are evicted
                // or the engine restarts.
                warn!(pod = %self.pod, seq, %error, "malformed KV-event payload skipped; its seq is kept");
                self.malformed();
                self.skipped_batch()
            }
        };
        self.last_rank = batch.dp_rank;
        let rank = batch.dp_rank;
        let model: Arc<str> = Arc::from(model);
        let mut verdict = self.tracker.classify(rank, seq);
        if std::mem::take(&mut self.reconnected) && matches!(verdict, SeqVerdict::Gap { .. }) {
            // NOTE: conservative: costs a rebuild after a mere network blip with a gap.
            verdict = SeqVerdict::Restart;
        }
        match verdict {
            SeqVerdict::InOrder => self.deliver_live(model, rank, seq, batch),
            SeqVerdict::Gap { from } => {
                self.gap(from, seq);
                self.recover(&model, from, seq).await;
                self.deliver(model, rank, seq, batch).await;
            }
            SeqVerdict::Restart => {
                warn!(pod = %self.pod, seq, last = ?self.tracker.last_seq(), "KV-event seq went back: engine restarted, clearing its entries");
                self.clear().await;
                self.tracker.forget(rank);
                self.pending = None;
                if seq != 0 {
                    self.gap(0, seq);
                    self.recover(&model, 0, seq).await;
                }
                self.deliver(model, rank, seq, batch).await;
            }
        }
        if let Some(pending) = &self.pending
            && self
                .tracker
                .last_for(pending.rank)
                .is_some_and(|last| last >= pending.seq)
        {
            self.pending = None;
        }
    }

    fn gap(&self, from: u64, seq: u64) {
        warn!(pod = %self.pod, from, seq, "KV-event sequence gap");
        bump(&self.counters.gaps);
        self.shared
            .metrics
            .gaps
            .with_label_values(&[&self.label])
            .inc();
    }

    fn deliver_live(&mut self, model: Arc<str>, rank: Option<i64>, seq: u64, batch: EventBatch) {
        if batch.events.is_empty() {
            // Nothing to apply (a skipped malformed batch): only its seq counts.
            self.record(rank, seq);
            return;
        }
        let update = IndexUpdate::Apply {
            pod: self.pod,
            model,
            batch,
        };
        match self.tx.try_send(update) {
            Ok(()) => self.record(rank, seq),
            Err(mpsc::error::TrySendError::Full(update)) => {
                // Left unrecorded: the next batch shows a gap from this seq and is repaired;
                // if none comes, `repair_pending` does it.
                if let IndexUpdate::Apply { model, .. } = update {
                    self.pending = Some(Pending { model, rank, seq });
                }
                debug!(pod = %self.pod, seq, "index channel full, batch dropped");
                bump(&self.counters.dropped);
                self.shared
                    .metrics
                    .dropped
                    .with_label_values(&[&self.label])
                    .inc();
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    async fn deliver(&mut self, model: Arc<str>, rank: Option<i64>, seq: u64, batch: EventBatch) {
        if batch.events.is_empty() {
            self.record(rank, seq);
            return;
        }
        let update = IndexUpdate::Apply {
            pod: self.pod,
            model,
            batch,
        };
        if self.tx.send(update).await.is_ok() {
            self.record(rank, seq);
        }
    }

    /// Records `seq` as handed to the writer, for sequencing and for the status view.
    fn record(&mut self, rank: Option<i64>, seq: u64) {
        self.tracker.record(rank, seq);
        if let Some(last) = self.tracker.last_seq() {
            self.counters.last_seq.store(last, Ordering::Relaxed);
        }
    }

    async fn clear(&mut self) {
        bump(&self.counters.clears);
        self.shared
            .metrics
            .clears
            .with_label_values(&[&self.label])
            .inc();
        let _ = self.tx.send(IndexUpdate::Clear { pod: self.pod }).await;
    }

    /// Repairs `from..until`: replays it when possible, else clears the pod (and applies what
    /// replay returned, which after a clear can only under-report).
    async fn recover(&mut self, model: &Arc<str>, from: u64, until: u64) {
        let Some(endpoint) = self.replay.clone() else {
            warn!(pod = %self.pod, from, until, "no replay endpoint: clearing the pod's entries");
            self.clear().await;
            return;
        };
        bump(&self.counters.replays);
        self.shared
            .metrics
            .replays
            .with_label_values(&[&self.label])
            .inc();
        let timeout = self.shared.config.replay_timeout;
        let mut replayed = match fetch_replay(&endpoint, from, until, timeout).await {
            Ok(replayed) => replayed,
            Err(error) => {
                warn!(pod = %self.pod, from, until, %error, "replay failed: clearing the pod's entries");
                self.clear().await;
                return;
            }
        };
        replayed.sort_by_key(|b| b.seq);
        replayed.dedup_by_key(|b| b.seq);
        let covered = replayed.len() as u64 == until.saturating_sub(from)
            && replayed.first().is_some_and(|b| b.seq == from);
        if !covered {
            warn!(pod = %self.pod, from, until, got = replayed.len(), "replay cannot cover the gap: clearing the pod's entries");
            self.clear().await;
        }
        for reply in replayed {
            match decode_payload(&reply.payload) {
                Ok(batch) => {
                    let rank = batch.dp_rank;
                    self.last_rank = rank;
                    self.deliver(model.clone(), rank, reply.seq, batch).await;
                }
                Err(error) => {
                    warn!(pod = %self.pod, seq = reply.seq, %error, "malformed replayed payload; its seq is kept");
                    self.malformed();
                    let empty = self.skipped_batch();
                    self.deliver(model.clone(), empty.dp_rank, reply.seq, empty)
                        .await;
                }
            }
        }
    }
}
