//! Prometheus metrics of the replica exchange (`kvpick_replica_*`). Labels come from fixed
//! sets (direction, reason), never from peer input, so a hostile peer cannot grow `/metrics`.

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

/// The exchange's metrics; registers itself into the registry handed to `new`.
#[derive(Clone)]
pub struct ReplicaMetrics {
    /// Batches sent to / received from peers (`direction` = `sent`, `received`).
    pub batches: IntCounterVec,
    /// Routing records sent / received (`direction`).
    pub records: IntCounterVec,
    /// Encoded bytes of the batches sent / received (`direction`; protobuf payload, without
    /// gRPC and HTTP/2 framing).
    pub bytes: IntCounterVec,
    /// Batches dropped, by reason: `queue_full` (a peer's queue), `oversized` (a received
    /// batch over the bound; the excess records), `self` (a batch from this replica).
    pub dropped_batches: IntCounterVec,
    /// Records dropped, by reason: `outbox_full` (the local outbox), `queue_full`,
    /// `oversized`, `bad_endpoint`, `unknown_endpoint`, `block_size`, `pod_gone`, `no_peer`
    /// (made while this replica had no peer).
    pub dropped_records: IntCounterVec,
    /// Peers with an open exchange stream from this replica.
    pub peers_connected: IntGauge,
    /// Peers this replica knows (static list or discovered).
    pub peers: IntGauge,
    /// Connection attempts to peers that failed (each retried with backoff).
    pub connect_errors: prometheus::IntCounter,
}

impl ReplicaMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let counter = |name: &str, help: &str, label: &str| -> prometheus::Result<IntCounterVec> {
            let metric = IntCounterVec::new(Opts::new(name, help), &[label])?;
            registry.register(Box::new(metric.clone()))?;
            Ok(metric)
        };
        let gauge = |name: &str, help: &str| -> prometheus::Result<IntGauge> {
            let metric = IntGauge::new(name, help)?;
            registry.register(Box::new(metric.clone()))?;
            Ok(metric)
        };
        let connect_errors = prometheus::IntCounter::new(
            "kvpick_replica_connect_errors_total",
            "Failed connection attempts to replica peers (retried with backoff)",
        )?;
        registry.register(Box::new(connect_errors.clone()))?;
        Ok(Self {
            batches: counter(
                "kvpick_replica_batches_total",
                "Replica-exchange batches, by direction (sent, received)",
                "direction",
            )?,
            records: counter(
                "kvpick_replica_records_total",
                "Routing records in replica-exchange batches, by direction (sent, received)",
                "direction",
            )?,
            bytes: counter(
                "kvpick_replica_bytes_total",
                "Encoded bytes of replica-exchange batches, by direction (sent, received)",
                "direction",
            )?,
            dropped_batches: counter(
                "kvpick_replica_dropped_batches_total",
                "Replica-exchange batches dropped, by reason",
                "reason",
            )?,
            dropped_records: counter(
                "kvpick_replica_dropped_records_total",
                "Routing records dropped by the replica exchange, by reason",
                "reason",
            )?,
            peers_connected: gauge(
                "kvpick_replica_peers_connected",
                "Replica peers with an open exchange stream from this replica",
            )?,
            peers: gauge("kvpick_replica_peers", "Replica peers this replica knows")?,
            connect_errors,
        })
    }

    /// Metrics registered nowhere (unit tests).
    #[cfg(test)]
    pub fn unregistered() -> Self {
        Self::new(&Registry::new()).unwrap_or_else(|e| panic!("metrics: {e}"))
    }
}
