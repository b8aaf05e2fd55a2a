//! The exchange loop: gathers this replica's routing records into batches, adds its
//! in-flight counts, and fans each batch out to the current peers; starts and stops a client
//! task per peer as the peer set changes.
//!
//! A batch leaves every batch interval when there is something new (records, or in-flight
//! counts that changed), at once when it is full, and at least every [`HEARTBEAT`] so peers
//! keep this replica's counts (they forget them after `inbox::FOREIGN_LOAD_TTL`).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::inbox::ForeignLoads;
use super::metrics::ReplicaMetrics;
use super::outbox::{Batcher, OutRecord};
use super::peer::{Fanout, run_peer};
use super::proto::EndpointLoad;
use crate::endpoints::Datastore;

/// The longest a peer waits for a batch from a live replica.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// What the loop works with (shared across restarts of the supervised task).
pub struct ExchangeParts {
    /// This replica's id, sent in every batch.
    pub own_id: String,
    /// The index sink's records.
    pub outbox: Mutex<mpsc::Receiver<OutRecord>>,
    /// The current peers (`host:port`).
    pub peers: watch::Receiver<BTreeSet<String>>,
    /// The pool, for this replica's in-flight counts.
    pub datastore: Arc<Datastore>,
    /// The other replicas' counts (expired here).
    pub foreign: Arc<ForeignLoads>,
    /// How often a batch may leave.
    pub batch_interval: Duration,
    /// Batches queued per peer at most.
    pub queue_batches: usize,
    /// Counters.
    pub metrics: ReplicaMetrics,
    /// The peer clients' TLS (`--replica-exchange-tls`), when on.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// Runs the exchange until `cancel`.
pub async fn run(parts: Arc<ExchangeParts>, cancel: CancellationToken) {
    let mut outbox = parts.outbox.lock().await;
    let mut peers_rx = parts.peers.clone();
    let mut fanout = Fanout::default();
    let mut running: HashMap<String, CancellationToken> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut batcher = Batcher::default();
    let mut tick = tokio::time::interval(parts.batch_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_loads: Vec<EndpointLoad> = Vec::new();
    let mut last_sent = Instant::now();
    let mut peers_open = true;
    let peers_now = peers_rx.borrow_and_update().clone();
    reconcile(
        &parts,
        &peers_now,
        &mut fanout,
        &mut running,
        &mut tasks,
        &cancel,
    );
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            record = outbox.recv() => {
                let Some(record) = record else { break };
                if batcher.push(record) {
                    let loads = loads(&parts.datastore);
                    fanout.send(batcher.take(&parts.own_id, loads.clone()), &parts.metrics);
                    (last_loads, last_sent) = (loads, Instant::now());
                }
            }
            _ = tick.tick() => {
                let now = Instant::now();
                if parts.foreign.expire(now) {
                    parts.foreign.publish(&parts.datastore.snapshot());
                }
                let loads = loads(&parts.datastore);
                let due = !batcher.is_empty()
                    || loads != last_loads
                    || now.saturating_duration_since(last_sent) >= HEARTBEAT;
                if fanout.is_empty() {
                    // Alone: nothing to tell anyone (the records are counted as dropped).
                    fanout.send(batcher.take(&parts.own_id, Vec::new()), &parts.metrics);
                } else if due {
                    fanout.send(batcher.take(&parts.own_id, loads.clone()), &parts.metrics);
                    (last_loads, last_sent) = (loads, now);
                }
            }
            changed = peers_rx.changed(), if peers_open => {
                if changed.is_err() {
                    // The peer source stopped: keep the peers we have.
                    peers_open = false;
                    continue;
                }
                let peers_now = peers_rx.borrow_and_update().clone();
                reconcile(&parts, &peers_now, &mut fanout, &mut running, &mut tasks, &cancel);
            }
            Some(_) = tasks.join_next() => {}
        }
    }
    for token in running.values() {
        token.cancel();
    }
    while tasks.join_next().await.is_some() {}
}

/// Starts a client for each new peer and stops the ones no longer listed.
fn reconcile(
    parts: &ExchangeParts,
    peers: &BTreeSet<String>,
    fanout: &mut Fanout,
    running: &mut HashMap<String, CancellationToken>,
    tasks: &mut JoinSet<()>,
    cancel: &CancellationToken,
) {
    running.retain(|peer, token| {
        let keep = peers.contains(peer);
        if !keep {
            tracing::info!(%peer, "replica peer left");
            token.cancel();
            fanout.remove(peer);
        }
        keep
    });
    for peer in peers {
        if running.contains_key(peer) {
            continue;
        }
        tracing::info!(%peer, "replica peer added");
        let (tx, rx) = mpsc::channel(parts.queue_batches.max(1));
        let token = cancel.child_token();
        fanout.insert(peer.clone(), tx);
        tasks.spawn(run_peer(
            peer.clone(),
            rx,
            parts.metrics.clone(),
            token.clone(),
            parts.tls.clone(),
        ));
        running.insert(peer.clone(), token);
    }
    parts.metrics.peers.set(running.len() as i64);
}

/// This replica's own in-flight counts, for the endpoints that have any.
fn loads(datastore: &Datastore) -> Vec<EndpointLoad> {
    datastore
        .snapshot()
        .endpoints
        .iter()
        .filter_map(|e| {
            let count = e.in_flight.local();
            (count > 0).then(|| EndpointLoad {
                endpoint: e.id().to_string(),
                in_flight: count,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop whose one peer never answers (nothing listens on port 1), so every batch stays
    /// in its queue of 2: the drops count what the loop sent.
    fn parts(outbox: mpsc::Receiver<OutRecord>, metrics: &ReplicaMetrics) -> Arc<ExchangeParts> {
        Arc::new(ExchangeParts {
            own_id: "a:1".into(),
            outbox: Mutex::new(outbox),
            peers: watch::channel(BTreeSet::from(["127.0.0.1:1".to_owned()])).1,
            datastore: Arc::new(Datastore::new()),
            foreign: Arc::default(),
            batch_interval: Duration::from_millis(10),
            queue_batches: 2,
            metrics: metrics.clone(),
            tls: None,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn idle_replicas_send_heartbeats_and_records_leave_within_one_interval() {
        let metrics = ReplicaMetrics::unregistered();
        let (tx, rx) = mpsc::channel(16);
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(parts(rx, &metrics), cancel.clone()));
        let dropped = |what: &str| match what {
            "batches" => metrics
                .dropped_batches
                .with_label_values(&["queue_full"])
                .get(),
            _ => metrics
                .dropped_records
                .with_label_values(&["queue_full"])
                .get(),
        };
        // Idle for 5.5 s: one heartbeat a second (not one batch per 10 ms tick); two fit
        // the queue, three are dropped.
        tokio::time::sleep(Duration::from_millis(5500)).await;
        assert_eq!(metrics.peers.get(), 1);
        assert_eq!(dropped("batches"), 3);
        // Three records queued at once leave within one interval.
        for i in 0..3 {
            tx.try_send(OutRecord {
                endpoint: "10.0.0.1:8000".into(),
                block_size: 16,
                keys: vec![i],
            })
            .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
        assert_eq!(dropped("records"), 3, "all three left within one interval");
        // NOTE: one batch, or two when the exchange took the first record before the others
        // were queued (seen once under a loaded CI run); never one per record.
        assert!(
            (4..=5).contains(&dropped("batches")),
            "{} batches",
            dropped("batches")
        );
        cancel.cancel();
        task.await.unwrap();
    }
}
