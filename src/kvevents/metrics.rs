//! Prometheus metrics of the KV-event pipeline, per pod (label `pod` = `ip:port`).

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::endpoints::PodId;

/// The `reason` values of `kvpick_kv_events_skipped_total`.
const SKIP_REASONS: [&str; 3] = ["token_count", "orphan", "capacity"];

/// Counters of the event pipeline; registers itself into the registry handed to `new`.
#[derive(Clone)]
pub struct KvEventsMetrics {
    /// Batches received from the wire.
    pub received: IntCounterVec,
    /// Batches applied to the index.
    pub applied: IntCounterVec,
    /// Messages or payloads that failed to decode (skipped).
    pub malformed: IntCounterVec,
    /// Batches dropped because the channel to the index was full (then repaired as a gap).
    pub dropped: IntCounterVec,
    /// Sequence gaps detected (including a first seq ≠ 0).
    pub gaps: IntCounterVec,
    /// Replay requests made.
    pub replays: IntCounterVec,
    /// Times a pod's entries were cleared (restart, unrecoverable gap).
    pub clears: IntCounterVec,
    /// (block, tier) entries the index holds per pod.
    pub index_entries: IntGaugeVec,
    /// Messages from pods that are not in the pool, and connections dropped (central mode),
    /// by reason.
    pub rejected: IntCounterVec,
    /// Connections to a pod that failed or ended, by pod and reason (`connect`,
    /// `message_too_large`, `closed`, …).
    pub connection_errors: IntCounterVec,
    /// Parts of applied batches the index could not use, by pod and reason
    /// (`token_count`: tokens ≠ blocks × block size; `orphan`: unknown parent; `capacity`).
    pub skipped: IntCounterVec,
}

fn counter(
    registry: &Registry,
    name: &str,
    help: &str,
    label: &str,
) -> prometheus::Result<IntCounterVec> {
    let metric = IntCounterVec::new(Opts::new(name, help), &[label])?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

impl KvEventsMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let index_entries = IntGaugeVec::new(
            Opts::new(
                "kvpick_kv_index_entries",
                "(block, tier) entries the prefix index holds per pod",
            ),
            &["pod"],
        )?;
        registry.register(Box::new(index_entries.clone()))?;
        let connection_errors = IntCounterVec::new(
            Opts::new(
                "kvpick_kv_events_connection_errors_total",
                "KV-event connections that failed or were dropped, by reason",
            ),
            &["pod", "reason"],
        )?;
        registry.register(Box::new(connection_errors.clone()))?;
        let skipped = IntCounterVec::new(
            Opts::new(
                "kvpick_kv_events_skipped_total",
                "KV-event parts the index skipped (token_count: events whose token count is not blocks × block size; orphan: blocks with an unknown parent; capacity: the pod's block limit)",
            ),
            &["pod", "reason"],
        )?;
        registry.register(Box::new(skipped.clone()))?;
        Ok(Self {
            received: counter(
                registry,
                "kvpick_kv_events_received_total",
                "KV-event batches received",
                "pod",
            )?,
            applied: counter(
                registry,
                "kvpick_kv_events_applied_total",
                "KV-event batches applied to the index",
                "pod",
            )?,
            malformed: counter(
                registry,
                "kvpick_kv_events_malformed_total",
                "KV-event messages that failed to decode",
                "pod",
            )?,
            dropped: counter(
                registry,
                "kvpick_kv_events_dropped_total",
                "KV-event batches dropped on a full channel",
                "pod",
            )?,
            gaps: counter(
                registry,
                "kvpick_kv_events_gaps_total",
                "KV-event sequence gaps detected",
                "pod",
            )?,
            replays: counter(
                registry,
                "kvpick_kv_events_replays_total",
                "KV-event replay requests",
                "pod",
            )?,
            clears: counter(
                registry,
                "kvpick_kv_index_clears_total",
                "Times a pod's index entries were cleared",
                "pod",
            )?,
            index_entries,
            rejected: counter(
                registry,
                "kvpick_kv_events_rejected_total",
                "KV-event messages from unknown publishers",
                "reason",
            )?,
            connection_errors,
            skipped,
        })
    }

    /// Counts what an applied batch's stats say was skipped.
    pub fn count_skipped(&self, pod: &str, stats: &crate::kvcache::ApplyStats) {
        let counts = [
            stats.inconsistent_events,
            stats.orphan_blocks,
            stats.capacity_drops,
        ];
        for (reason, count) in SKIP_REASONS.into_iter().zip(counts) {
            if count > 0 {
                self.skipped.with_label_values(&[pod, reason]).inc_by(count);
            }
        }
    }

    /// Creates a pod's series at 0 (its events are being followed). Prometheus only sees a
    /// counter's first increase once the series exists, so an alert on gaps, drops or clears
    /// (deploy/monitoring/alerts.yaml) fires on the first one, not the second.
    pub fn start(&self, pod: PodId) {
        let label = pod.to_string();
        for vec in self.per_pod() {
            let _ = vec.with_label_values(&[&label]);
        }
    }

    fn per_pod(&self) -> [&IntCounterVec; 7] {
        [
            &self.received,
            &self.applied,
            &self.malformed,
            &self.dropped,
            &self.gaps,
            &self.replays,
            &self.clears,
        ]
    }

    /// Removes a pod's series (it left the pool).
    pub fn forget(&self, pod: PodId) {
        let label = pod.to_string();
        for vec in self.per_pod() {
            let _ = vec.remove_label_values(&[&label]);
        }
        let _ = self.index_entries.remove_label_values(&[&label]);
        for reason in super::transport::TransportError::REASONS {
            let _ = self
                .connection_errors
                .remove_label_values(&[&label, reason]);
        }
        for reason in SKIP_REASONS {
            let _ = self.skipped.remove_label_values(&[&label, reason]);
        }
    }
}
