//! One peer's side of the exchange: a bounded queue of batches ([`Fanout`] fills it, drops
//! counted when full) and a client task ([`run_peer`]) that streams it to the peer,
//! reconnecting with backoff.
//!
//! NOTE: batches queued while a peer is down are delivered when it comes back; the queue's
//! bound (a fraction of a second of batches) keeps them younger than the speculative TTL.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::metrics::ReplicaMetrics;
use super::proto::Batch;
use super::proto::replica_exchange_client::ReplicaExchangeClient;

/// Reconnect delays: doubling from the first to the last.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Delays from `first`, doubling up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            first,
            max,
            next: first,
        }
    }

    /// The next delay (and doubles the one after).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Back to the first delay (after a connection that worked).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

/// The per-peer queues the exchange loop sends each batch into.
#[derive(Default)]
pub struct Fanout {
    queues: HashMap<String, mpsc::Sender<Arc<Batch>>>,
}

impl Fanout {
    /// Adds a peer's queue.
    pub fn insert(&mut self, peer: String, queue: mpsc::Sender<Arc<Batch>>) {
        self.queues.insert(peer, queue);
    }

    /// Removes a peer's queue.
    pub fn remove(&mut self, peer: &str) {
        self.queues.remove(peer);
    }

    /// Whether there is no peer to send to.
    pub fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// Queues `batch` for every peer; a full queue drops it for that peer (counted). With no
    /// peer at all, its records are counted as dropped (`no_peer`): a replica alone tells
    /// nobody, and a peer that joins later never gets what was made before it.
    pub fn send(&self, batch: Batch, metrics: &ReplicaMetrics) {
        let records = batch.records.len() as u64;
        if self.queues.is_empty() {
            metrics
                .dropped_records
                .with_label_values(&["no_peer"])
                .inc_by(records);
            return;
        }
        let batch = Arc::new(batch);
        for (peer, queue) in &self.queues {
            if queue.try_send(Arc::clone(&batch)).is_err() {
                tracing::debug!(%peer, "replica peer queue full: batch dropped");
                metrics
                    .dropped_batches
                    .with_label_values(&["queue_full"])
                    .inc();
                metrics
                    .dropped_records
                    .with_label_values(&["queue_full"])
                    .inc_by(records);
            }
        }
    }
}

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 pings on an idle stream, so a peer that vanished is noticed.
const KEEPALIVE: Duration = Duration::from_secs(5);

/// Streams `queue` to `peer` (`host:port`) until `cancel`, reconnecting with backoff.
pub async fn run_peer(
    peer: String,
    mut queue: mpsc::Receiver<Arc<Batch>>,
    metrics: ReplicaMetrics,
    cancel: CancellationToken,
    tls: Option<Arc<rustls::ClientConfig>>,
) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let endpoint = match tonic::transport::Endpoint::from_shared(format!("http://{peer}")) {
        Ok(endpoint) => endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true),
        Err(error) => {
            tracing::error!(%peer, %error, "replica peer address is not usable; ignored");
            return;
        }
    };
    loop {
        let connected = tokio::select! {
            () = cancel.cancelled() => return,
            connected = async {
                match &tls {
                    Some(config) => {
                        let connector = super::tls::TlsConnect(Arc::clone(config));
                        endpoint.connect_with_connector(connector).await
                    }
                    None => endpoint.connect().await,
                }
            } => connected,
        };
        match connected {
            Err(error) => {
                metrics.connect_errors.inc();
                tracing::debug!(%peer, %error, "replica peer unreachable; retrying");
            }
            Ok(channel) => {
                metrics.peers_connected.inc();
                tracing::info!(%peer, "replica exchange connected");
                let delivered = stream(channel, &mut queue, &metrics, &cancel).await;
                metrics.peers_connected.dec();
                if cancel.is_cancelled() {
                    return;
                }
                tracing::info!(%peer, delivered, "replica exchange stream ended; reconnecting");
                if delivered > 0 {
                    backoff.reset();
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// One stream's life: forwards batches until the stream breaks or `cancel`; returns the
/// batches delivered into it.
async fn stream(
    channel: tonic::transport::Channel,
    queue: &mut mpsc::Receiver<Arc<Batch>>,
    metrics: &ReplicaMetrics,
    cancel: &CancellationToken,
) -> u64 {
    let mut client = ReplicaExchangeClient::new(channel);
    // A small hand-off: when the peer reads slowly, batches back up in the peer's queue,
    // which drops (counted) rather than this buffer growing.
    let (tx, rx) = mpsc::channel::<Batch>(4);
    let call = client.exchange(tokio_stream::wrappers::ReceiverStream::new(rx));
    tokio::pin!(call);
    let mut delivered = 0;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return delivered,
            ended = &mut call => {
                if let Err(status) = ended {
                    tracing::debug!(code = ?status.code(), message = status.message(), "replica exchange stream failed");
                }
                return delivered;
            }
            batch = queue.recv() => {
                let Some(batch) = batch else { return delivered };
                let records = batch.records.len() as u64;
                let bytes = prost::Message::encoded_len(&*batch) as u64;
                if tx.send(Batch::clone(&batch)).await.is_err() {
                    return delivered;
                }
                delivered += 1;
                metrics.batches.with_label_values(&["sent"]).inc();
                metrics.records.with_label_values(&["sent"]).inc_by(records);
                metrics.bytes.with_label_values(&["sent"]).inc_by(bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<u128> = (0..5).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
    }

    #[test]
    fn a_full_peer_queue_drops_for_that_peer_only() {
        let metrics = ReplicaMetrics::unregistered();
        let (slow, mut slow_rx) = mpsc::channel(2);
        let (fast, mut fast_rx) = mpsc::channel(8);
        let mut fanout = Fanout::default();
        fanout.insert("slow:1".into(), slow);
        fanout.insert("fast:1".into(), fast);
        let batch = Batch {
            replica: "a".into(),
            records: vec![Default::default(); 3],
            in_flight: vec![],
        };
        for _ in 0..5 {
            fanout.send(batch.clone(), &metrics);
        }
        let dropped = |reason: &str| {
            (
                metrics.dropped_batches.with_label_values(&[reason]).get(),
                metrics.dropped_records.with_label_values(&[reason]).get(),
            )
        };
        assert_eq!(dropped("queue_full"), (3, 9));
        let mut got = (0, 0);
        while slow_rx.try_recv().is_ok() {
            got.0 += 1;
        }
        while fast_rx.try_recv().is_ok() {
            got.1 += 1;
        }
        assert_eq!(got, (2, 5));
        fanout.remove("slow:1");
        fanout.remove("fast:1");
        assert!(fanout.is_empty());
    }
}
