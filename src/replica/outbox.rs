//! This replica's routing records on their way to its peers: the index's sink puts each one
//! into a bounded outbox (dropped and counted when full, never blocking a request), and the
//! exchange loop gathers them into batches ([`Batcher`]) under fixed bounds.

use tokio::sync::mpsc;

use super::metrics::ReplicaMetrics;
use super::proto::{Batch, EndpointLoad, RoutingRecord};
use crate::kvcache::{BlockKey, RouteSink};

/// Records one batch carries at most (a receiver drops what is beyond it).
pub const MAX_RECORDS_PER_BATCH: usize = 1024;
/// Block keys one record carries at most: its leading blocks (a prefix is still a valid
/// record; 16 Ki blocks are 256 Ki tokens at 16 tokens a block).
pub const MAX_KEYS_PER_RECORD: usize = 16 * 1024;
/// Block keys one batch carries at most: with 8 bytes a key, ~2 MiB, under gRPC's 4 MiB
/// message limit the receiver keeps.
pub const MAX_KEYS_PER_BATCH: usize = 256 * 1024;

/// One routing record as the sink saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutRecord {
    /// `ip:port` of the pod.
    pub endpoint: String,
    /// The block size the keys were computed at.
    pub block_size: u32,
    /// The keys, at most [`MAX_KEYS_PER_RECORD`].
    pub keys: Vec<u64>,
}

/// The index's sink: copies each record into `outbox` without waiting.
pub fn sink(outbox: mpsc::Sender<OutRecord>, metrics: ReplicaMetrics) -> RouteSink {
    let full = metrics.dropped_records.with_label_values(&["outbox_full"]);
    Box::new(move |pod, block_size, keys: &[BlockKey]| {
        let Ok(permit) = outbox.try_reserve() else {
            // Full, or the exchange stopped: a record less, never a stalled request.
            full.inc();
            return;
        };
        let keys = keys.iter().take(MAX_KEYS_PER_RECORD).map(|k| k.0).collect();
        permit.send(OutRecord {
            endpoint: pod.to_string(),
            block_size,
            keys,
        });
    })
}

/// Routing records gathered for the next batch.
#[derive(Debug, Default)]
pub struct Batcher {
    records: Vec<RoutingRecord>,
    keys: usize,
}

impl Batcher {
    /// Adds a record; returns whether the batch is now full (flush it before the next).
    pub fn push(&mut self, record: OutRecord) -> bool {
        self.keys += record.keys.len();
        self.records.push(RoutingRecord {
            endpoint: record.endpoint,
            block_size: record.block_size,
            block_keys: record.keys,
        });
        self.is_full()
    }

    /// Whether another record could overflow the batch's bounds.
    pub fn is_full(&self) -> bool {
        self.records.len() >= MAX_RECORDS_PER_BATCH
            || self.keys + MAX_KEYS_PER_RECORD > MAX_KEYS_PER_BATCH
    }

    /// Whether no record is waiting.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The batch of the records gathered so far and `in_flight`; empties the batcher.
    pub fn take(&mut self, replica: &str, in_flight: Vec<EndpointLoad>) -> Batch {
        self.keys = 0;
        Batch {
            replica: replica.to_owned(),
            records: std::mem::take(&mut self.records),
            in_flight,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::PodId;

    fn record(keys: usize) -> OutRecord {
        OutRecord {
            endpoint: "10.0.0.1:8000".into(),
            block_size: 16,
            keys: (0..keys as u64).collect(),
        }
    }

    #[test]
    fn a_batch_is_full_at_its_record_or_key_bound() {
        let mut batcher = Batcher::default();
        for _ in 0..MAX_RECORDS_PER_BATCH - 1 {
            assert!(!batcher.push(record(1)));
        }
        assert!(batcher.push(record(1)), "full at the record bound");
        let batch = batcher.take("a", vec![]);
        assert_eq!(batch.records.len(), MAX_RECORDS_PER_BATCH);
        assert!(batcher.is_empty() && !batcher.is_full());
        // Big records: full before the keys could pass the bound.
        let mut pushed = 0;
        while !batcher.push(record(MAX_KEYS_PER_RECORD)) {
            pushed += 1;
        }
        let batch = batcher.take("a", vec![]);
        let keys: usize = batch.records.iter().map(|r| r.block_keys.len()).sum();
        assert!(
            keys <= MAX_KEYS_PER_BATCH,
            "{keys} keys after {pushed} pushes"
        );
    }

    #[test]
    fn the_sink_drops_and_counts_when_the_outbox_is_full() {
        let metrics = ReplicaMetrics::unregistered();
        let (tx, mut rx) = mpsc::channel(2);
        let sink = sink(tx, metrics.clone());
        let pod: PodId = "10.0.0.1:8000".parse().unwrap();
        let long: Vec<BlockKey> = (0..MAX_KEYS_PER_RECORD as u64 + 5).map(BlockKey).collect();
        for _ in 0..5 {
            sink(pod, 16, &long);
        }
        let dropped = metrics.dropped_records.with_label_values(&["outbox_full"]);
        assert_eq!(dropped.get(), 3);
        let first = rx.try_recv().unwrap();
        assert_eq!(
            first.keys.len(),
            MAX_KEYS_PER_RECORD,
            "capped to its leading keys"
        );
        assert_eq!(first.keys[..2], [0, 1]);
        assert_eq!(first.endpoint, "10.0.0.1:8000");
    }
}
