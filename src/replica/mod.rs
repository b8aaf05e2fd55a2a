//! The replica exchange: what active-active kvpick replicas tell each other that KV events
//! do not (`proto/kvpick/replica/v1/replica.proto`).
//!
//! Every replica subscribes to every pod's events, so each holds the whole precise index on
//! its own. What it cannot see is the other replicas' *routing*: the speculative entries they
//! recorded for the requests they just sent (a burst of one new prefix split across replicas
//! would scatter across pods until the events arrive) and their in-flight counts. Each
//! replica sends its peers batches of both ([`exchange`], [`peer`]); a peer applies the
//! records as foreign speculative entries through the index's own record path and the counts
//! as a foreign in-flight term per endpoint ([`inbox`]). The exchange is optional and lossy by
//! design: a replica without peers works alone, and a dropped batch costs placement quality
//! for at most one speculative TTL, never correctness.
//!
//! Bounds: the index sink never blocks a request (a bounded outbox, drops counted), batches
//! have record and key bounds ([`outbox`]), each peer has a bounded queue of batches
//! (drops counted), received messages are capped at gRPC's 4 MiB and every field is checked.

pub mod config;
pub mod exchange;
pub mod inbox;
pub mod metrics;
pub mod outbox;
pub mod peer;
pub mod tls;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::endpoints::Datastore;
use crate::kvcache::PrefixIndex;
pub use metrics::ReplicaMetrics;

/// The exchange's generated messages, client and server.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("kvpick.replica.v1");
}

/// Records queued in the outbox at most, between the index sink and the exchange loop.
const OUTBOX_RECORDS: usize = 4096;

/// Where the peers come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerSource {
    /// A fixed list of `host:port` (`--replica-peers`).
    Static(BTreeSet<String>),
    /// The ready pods matching these labels in kvpick's namespace, on the exchange port,
    /// this pod excluded (`--peer-selector`).
    Selector(crate::discovery::kube::LabelSelector),
}

/// The validated configuration of the exchange (`--replica-exchange-port` and friends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// Where the exchange server listens.
    pub listen: SocketAddr,
    /// Where the peers come from (`None`: no peers; this replica only listens).
    pub peers: Option<PeerSource>,
    /// How often a batch may leave (`--replica-batch-interval`).
    pub batch_interval: Duration,
    /// Batches queued per peer at most (`--replica-queue-batches`).
    pub queue_batches: usize,
    /// The namespace peer pods are looked for in (`--peer-selector`).
    pub namespace: String,
    /// Mutual TLS pinned to the `--cert-path` certificate (`--replica-exchange-tls`).
    pub tls: bool,
}

/// Why the exchange could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The exchange port could not be bound.
    #[error("--replica-exchange-port: cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The metrics could not be registered.
    #[error("replica metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// `--peer-selector` needs a Kubernetes client.
    #[error("--peer-selector: {0}")]
    Kube(#[from] crate::discovery::kube::KubeError),
    /// `--replica-exchange-tls` without the ext-proc port's certificate, or rustls refused it.
    #[error("--replica-exchange-tls: {0}")]
    Tls(String),
}

/// What the exchange works on.
pub struct ReplicaParts {
    /// The index records go into and come out of.
    pub index: Arc<PrefixIndex>,
    /// The pool.
    pub datastore: Arc<Datastore>,
    /// Where the metrics go.
    pub registry: prometheus::Registry,
    /// The ext-proc port's certificate and TLS metrics (`--secure-serving`), when on: the
    /// exchange's TLS uses them.
    pub tls: Option<(Arc<crate::tls::CertResolver>, crate::tls::TlsMetrics)>,
}

/// This replica's id in batches: the pod name (or host name) and the exchange port, so two
/// replicas on one host differ.
fn own_id(port: u16) -> String {
    let host = std::env::var("POD_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "kvpick".to_owned());
    format!("{host}:{port}")
}

/// A restartable task (the supervisor's `Start`: each call makes a fresh run).
pub type Task = Box<dyn FnMut() -> futures::future::BoxFuture<'static, ()> + Send>;

/// A started exchange.
pub struct Started {
    /// Where its server listens.
    pub addr: SocketAddr,
    /// The tasks to run supervised (restarted when they die), by name.
    pub tasks: Vec<(&'static str, Task)>,
}

/// Starts the exchange: its server (a task stopped by `background`) and the index's sink;
/// returns the exchange loop (and the peer watch) for the caller to supervise.
pub async fn start(
    config: &ReplicaConfig,
    parts: ReplicaParts,
    background: &CancellationToken,
) -> Result<Started, ReplicaError> {
    let metrics = ReplicaMetrics::new(&parts.registry)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ReplicaError::Bind {
            addr: config.listen,
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| ReplicaError::Bind {
        addr: config.listen,
        source,
    })?;
    let own_id = own_id(bound.port());
    let tls = match (config.tls, &parts.tls) {
        (false, _) => None,
        (true, None) => return Err(ReplicaError::Tls("needs --secure-serving".into())),
        (true, Some((resolver, metrics))) => Some((
            tls::ExchangeTls::new(resolver).map_err(|e| ReplicaError::Tls(e.to_string()))?,
            metrics.clone(),
        )),
    };
    let foreign = Arc::new(inbox::ForeignLoads::default());
    let inbox = Arc::new(inbox::Inbox {
        own_id: own_id.clone(),
        index: Arc::clone(&parts.index),
        datastore: Arc::clone(&parts.datastore),
        foreign: Arc::clone(&foreign),
        metrics: metrics.clone(),
    });
    let service = proto::replica_exchange_server::ReplicaExchangeServer::new(inbox)
        .max_decoding_message_size(inbox::MAX_MESSAGE_BYTES);
    let server_tls = tls
        .as_ref()
        .map(|(tls, metrics)| (Arc::clone(&tls.server), metrics.clone()));
    let cancel = background.clone();
    tokio::spawn(async move {
        // Plain, or TLS with every handshake on its own task (bounded, timed out, counted
        // with the ext-proc port's handshakes).
        let incoming = crate::tls::incoming(listener, server_tls);
        let served = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "replica exchange server failed");
        }
    });

    let mut tasks: Vec<(&'static str, Task)> = Vec::new();
    let peers = match &config.peers {
        None => watch::channel(BTreeSet::new()).1,
        Some(PeerSource::Static(list)) => watch::channel(list.clone()).1,
        Some(PeerSource::Selector(selector)) => {
            let (peers, task) = crate::discovery::kube::peers::watch_peers(
                selector.query(),
                config.namespace.clone(),
                bound.port(),
                background,
            )
            .await?;
            tasks.push(("replica-peers", task));
            peers
        }
    };
    let (outbox_tx, outbox_rx) = tokio::sync::mpsc::channel(OUTBOX_RECORDS);
    if !parts
        .index
        .set_route_sink(outbox::sink(outbox_tx, metrics.clone()))
    {
        tracing::warn!("the prefix index already has a route sink; records not exchanged");
    }
    let exchange = Arc::new(exchange::ExchangeParts {
        own_id,
        outbox: tokio::sync::Mutex::new(outbox_rx),
        peers,
        datastore: parts.datastore,
        foreign,
        batch_interval: config.batch_interval,
        queue_batches: config.queue_batches,
        metrics,
        tls: tls.map(|(tls, _)| tls.client),
    });
    let cancel = background.clone();
    tasks.push((
        "replica-exchange",
        Box::new(move || Box::pin(exchange::run(Arc::clone(&exchange), cancel.clone()))),
    ));
    tracing::info!(%bound, peers = ?config.peers, "replica exchange listening");
    Ok(Started { addr: bound, tasks })
}
