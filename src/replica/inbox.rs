//! The receiving side: the gRPC service peers stream their batches to, and what a batch does
//! here — its routing records enter the prefix index as foreign records, its in-flight counts
//! become the endpoints' foreign in-flight term ([`ForeignLoads`]).
//!
//! Peer input is hostile like any other: the message size is capped by gRPC, records beyond
//! the per-batch bound and records naming a bad or unknown endpoint are dropped and counted,
//! and only endpoints of this replica's pool get a foreign count.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Request, Response, Status, Streaming};

use super::metrics::ReplicaMetrics;
use super::outbox::{MAX_KEYS_PER_RECORD, MAX_RECORDS_PER_BATCH};
use super::proto::replica_exchange_server::ReplicaExchange;
use super::proto::{Batch, EndpointLoad, ExchangeSummary};
use crate::endpoints::{Datastore, PodId, PoolSnapshot};
use crate::kvcache::{BlockKey, ForeignRecord, PrefixIndex};

/// Largest message a peer may send (gRPC's default, said explicitly).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Longest replica id kept (a pod name is at most 253).
const MAX_REPLICA_ID: usize = 253;
/// Replicas whose in-flight counts are kept at most; a batch from one more is not counted.
pub const MAX_REPLICAS: usize = 64;
/// A replica's in-flight counts stop counting this long after its last batch (it sends one
/// at least every heartbeat; see `exchange`).
pub const FOREIGN_LOAD_TTL: Duration = Duration::from_secs(3);

/// One replica's last counts and when they came.
type ReplicaCounts = (Instant, HashMap<PodId, u64>);

/// The other replicas' in-flight counts, by replica, and their sums on the endpoints.
#[derive(Default)]
pub struct ForeignLoads {
    by_replica: Mutex<HashMap<String, ReplicaCounts>>,
}

impl ForeignLoads {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, ReplicaCounts>> {
        // NOTE: plain maps; a panic mid-update leaves at worst stale counts until the next.
        self.by_replica.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces `replica`'s counts; false when the table is full of other live replicas.
    pub fn update(&self, replica: &str, counts: HashMap<PodId, u64>, now: Instant) -> bool {
        let mut table = self.table();
        if !table.contains_key(replica) && table.len() >= MAX_REPLICAS {
            table.retain(|_, (at, _)| now.saturating_duration_since(*at) < FOREIGN_LOAD_TTL);
            if table.len() >= MAX_REPLICAS {
                return false;
            }
        }
        table.insert(replica.to_owned(), (now, counts));
        true
    }

    /// Forgets replicas silent for longer than [`FOREIGN_LOAD_TTL`]; whether any was.
    pub fn expire(&self, now: Instant) -> bool {
        let mut table = self.table();
        let before = table.len();
        table.retain(|_, (at, _)| now.saturating_duration_since(*at) < FOREIGN_LOAD_TTL);
        table.len() != before
    }

    /// Sets every endpoint's foreign in-flight term to the sum over the replicas.
    pub fn publish(&self, pool: &PoolSnapshot) {
        let table = self.table();
        for endpoint in &pool.endpoints {
            let id = endpoint.id();
            let sum = table
                .values()
                .filter_map(|(_, counts)| counts.get(&id))
                .fold(0u64, |a, b| a.saturating_add(*b));
            endpoint.in_flight.set_foreign(sum);
        }
    }
}

/// The exchange service a peer streams its batches to.
pub struct Inbox {
    /// This replica's id (a batch carrying it came back to its sender: a peer list that
    /// names this replica itself).
    pub own_id: String,
    /// Where routing records go.
    pub index: Arc<PrefixIndex>,
    /// The pool, to check endpoints against and to set foreign counts on.
    pub datastore: Arc<Datastore>,
    /// The other replicas' in-flight counts.
    pub foreign: Arc<ForeignLoads>,
    /// Counters.
    pub metrics: ReplicaMetrics,
}

impl Inbox {
    /// Applies one batch; returns the records applied.
    pub fn apply(&self, batch: Batch, now: Instant) -> u64 {
        let drop_batch = |reason: &str| {
            self.metrics
                .dropped_batches
                .with_label_values(&[reason])
                .inc()
        };
        let drop_records = |reason: &str, n: usize| {
            self.metrics
                .dropped_records
                .with_label_values(&[reason])
                .inc_by(n as u64)
        };
        self.metrics.batches.with_label_values(&["received"]).inc();
        self.metrics
            .bytes
            .with_label_values(&["received"])
            .inc_by(prost::Message::encoded_len(&batch) as u64);
        self.metrics
            .records
            .with_label_values(&["received"])
            .inc_by(batch.records.len() as u64);
        if batch.replica == self.own_id {
            drop_batch("self");
            return 0;
        }
        let pool = self.datastore.snapshot();
        let mut applied = 0;
        if batch.records.len() > MAX_RECORDS_PER_BATCH {
            drop_batch("oversized");
            drop_records("oversized", batch.records.len() - MAX_RECORDS_PER_BATCH);
        }
        for record in batch.records.into_iter().take(MAX_RECORDS_PER_BATCH) {
            let Ok(pod) = record.endpoint.parse::<PodId>() else {
                drop_records("bad_endpoint", 1);
                continue;
            };
            if pool.get(pod).is_none() {
                drop_records("unknown_endpoint", 1);
                continue;
            }
            let keys: Vec<BlockKey> = record
                .block_keys
                .iter()
                .take(MAX_KEYS_PER_RECORD)
                .map(|k| BlockKey(*k))
                .collect();
            match self.index.record_foreign(pod, record.block_size, &keys) {
                ForeignRecord::Applied => applied += 1,
                ForeignRecord::BlockSizeMismatch => drop_records("block_size", 1),
                ForeignRecord::PodGone => drop_records("pod_gone", 1),
            }
        }
        let replica: String = batch.replica.chars().take(MAX_REPLICA_ID).collect();
        let counts = in_flight_counts(&pool, &batch.in_flight);
        if self.foreign.update(&replica, counts, now) {
            self.foreign.publish(&pool);
        } else {
            drop_batch("too_many_replicas");
        }
        applied
    }
}

/// The counts of `loads` for endpoints of the pool (others ignored: at most one per
/// endpoint of the pool is kept).
fn in_flight_counts(pool: &PoolSnapshot, loads: &[EndpointLoad]) -> HashMap<PodId, u64> {
    let mut counts = HashMap::new();
    for load in loads.iter().take(pool.endpoints.len().saturating_mul(4)) {
        if let Ok(pod) = load.endpoint.parse::<PodId>()
            && pool.get(pod).is_some()
        {
            counts.insert(pod, load.in_flight);
        }
    }
    counts
}

#[tonic::async_trait]
impl ReplicaExchange for Arc<Inbox> {
    async fn exchange(
        &self,
        request: Request<Streaming<Batch>>,
    ) -> Result<Response<ExchangeSummary>, Status> {
        let peer = request.remote_addr();
        let mut stream = request.into_inner();
        let mut summary = ExchangeSummary::default();
        loop {
            match stream.message().await {
                Ok(Some(batch)) => {
                    summary.batches += 1;
                    summary.records += self.apply(batch, Instant::now());
                }
                Ok(None) => return Ok(Response::new(summary)),
                Err(status) => {
                    tracing::debug!(?peer, code = ?status.code(), message = status.message(), "replica exchange stream from a peer ended");
                    return Err(status);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::Endpoint;

    #[tokio::test(start_paused = true)]
    async fn foreign_counts_sum_over_replicas_expire_and_are_bounded() {
        let datastore = Datastore::new();
        let pods: Vec<PodId> = ["10.0.0.1:8000", "10.0.0.2:8000"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        datastore.set_endpoints(pods.iter().map(|p| Endpoint::new(*p)).collect());
        let pool = datastore.snapshot();
        let foreign = ForeignLoads::default();
        let now = Instant::now();
        assert!(foreign.update("b", HashMap::from([(pods[0], 2)]), now));
        assert!(foreign.update("c", HashMap::from([(pods[0], 3), (pods[1], 1)]), now));
        foreign.publish(&pool);
        let counts = |pool: &PoolSnapshot| -> Vec<u64> {
            pool.endpoints
                .iter()
                .map(|e| e.in_flight.foreign())
                .collect()
        };
        assert_eq!(counts(&pool), [5, 1]);
        // A replica's next batch replaces its counts.
        assert!(foreign.update("b", HashMap::new(), now + Duration::from_secs(2)));
        foreign.publish(&pool);
        assert_eq!(counts(&pool), [3, 1]);
        // "c" has been silent for the TTL: its counts stop counting.
        assert!(foreign.expire(now + FOREIGN_LOAD_TTL));
        foreign.publish(&pool);
        assert_eq!(counts(&pool), [0, 0]);
        // At most MAX_REPLICAS live replicas are kept.
        let later = now + Duration::from_secs(10);
        for i in 0..MAX_REPLICAS {
            assert!(foreign.update(&format!("r{i}"), HashMap::new(), later));
        }
        assert!(!foreign.update("one-too-many", HashMap::new(), later));
        assert!(foreign.update("one-too-many", HashMap::new(), later + FOREIGN_LOAD_TTL));
    }
}
