//! SUB tasks: one per pod that connects to its PUB endpoint, or one central task that
//! accepts the pods dialing in (pod identity from the topic).
//!
//! Why supervised loops: a pod restarting, a network blip or a hostile peer must never end the
//! subscription for good. Each task reconnects itself (the transport never does) with
//! exponential backoff capped at [`super::KvEventsConfig::backoff_max`] (≤ 1 s by default, so
//! a restarted engine is resubscribed within a second of listening again), and wakes early
//! when the pod's `/metrics` answers again ([`PodSignals::nudge`]). Tasks end only through
//! their cancellation token. No lock is held across an `.await`; all index changes go through
//! the stream's channel (see [`super::stream`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::decode::{decode_seq, parse_topic};
use super::shared::{IndexUpdate, PodSignals, Shared};
use super::stream::PodStream;
use super::transport::{BudgetGuard, ByteBudget, Connection, Role, SubListener, TransportError};
use crate::endpoints::{Endpoint, PodId};

/// How long the socket must be quiet before a dropped batch that no later batch revealed is
/// repaired.
const QUIET_REPAIR_DELAY: Duration = Duration::from_millis(50);

/// Receive timeout when nothing is pending (only to loop; nothing happens on expiry).
const IDLE_WAIT: Duration = Duration::from_secs(3600);

/// Messages accepted connections may queue for the central task.
const CENTRAL_QUEUE: usize = 256;

/// Capped exponential backoff.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    current: Duration,
    initial: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        Self {
            current: initial.min(max),
            initial: initial.min(max),
            max,
        }
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.current;
        self.current = (self.current * 2).min(self.max);
        delay
    }

    pub(crate) fn reset(&mut self) {
        self.current = self.initial;
    }
}

/// Splits a message into (topic, seq, payload) frames.
fn frames(message: Vec<Bytes>) -> Option<(Bytes, u64, Bytes)> {
    let [topic, seq, payload] = <[Bytes; 3]>::try_from(message).ok()?;
    let seq = decode_seq(&seq).ok()?;
    Some((topic, seq, payload))
}

fn model_of(shared: &Shared, topic: &[u8]) -> String {
    parse_topic(topic)
        .map(|t| t.model)
        .unwrap_or_else(|| shared.config.fallback_model.clone())
}

/// Handles an engine restart notice: drop the pod's entries now, and let the next batch
/// rebuild them (its seq then shows a gap from 0, repaired by replay when the pod has one).
async fn take_restart(stream: &mut PodStream, signals: &PodSignals) {
    if signals.restarted.swap(false, Ordering::AcqRel) {
        stream.engine_restarted().await;
    }
}

/// The connect-mode task of one pod: runs until `cancel` fires.
pub(crate) async fn run_pod_subscriber(
    endpoint: Endpoint,
    events: String,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IndexUpdate>,
    signals: Arc<PodSignals>,
    cancel: CancellationToken,
) {
    let pod = endpoint.id;
    let label = pod.to_string();
    let mut stream = PodStream::new(pod, endpoint.kv_replay.clone(), shared.clone(), tx);
    let mut backoff = Backoff::new(shared.config.backoff_initial, shared.config.backoff_max);
    let mut connected_before = false;
    let mut failing_since_logged = false;
    loop {
        take_restart(&mut stream, &signals).await;
        let attempt = tokio::select! {
            () = cancel.cancelled() => return,
            attempt = Connection::connect(&events, Role::Sub, shared.config.transport) => attempt,
        };
        let mut connection = match attempt {
            Ok(connection) => connection,
            Err(error) => {
                shared
                    .metrics
                    .connection_errors
                    .with_label_values(&[&label, error.reason()])
                    .inc();
                // One warning per outage; the retries of a pod that is down are debug noise.
                if std::mem::replace(&mut failing_since_logged, true) {
                    debug!(%pod, %events, %error, "KV-event connect failed; retrying");
                } else {
                    warn!(%pod, %events, %error, "KV-event connect failed; retrying (further failures logged at debug)");
                }
                if wait_retry(&mut backoff, &signals, &cancel).await {
                    return;
                }
                continue;
            }
        };
        info!(%pod, %events, "KV-event subscriber connected");
        failing_since_logged = false;
        if std::mem::replace(&mut connected_before, true) {
            stream.mark_reconnected();
        }
        stream.counters().connected.store(true, Ordering::Relaxed);
        backoff.reset();
        let error = loop {
            let quiet = if stream.has_pending() {
                QUIET_REPAIR_DELAY
            } else {
                IDLE_WAIT
            };
            // NOTE: `Connection::recv` is cancel-safe for reads (bytes stay in its buffer), so
            // the quiet timer and the signals may interrupt it between any two reads.
            let received = tokio::select! {
                () = cancel.cancelled() => return,
                () = signals.nudge.notified() => {
                    take_restart(&mut stream, &signals).await;
                    continue;
                }
                received = tokio::time::timeout(quiet, connection.recv()) => match received {
                    Ok(received) => received,
                    Err(_) => {
                        stream.repair_pending().await;
                        continue;
                    }
                },
            };
            match received {
                Ok((message, _budget)) => match frames(message) {
                    Some((topic, seq, payload)) => {
                        let model = model_of(&shared, &topic);
                        stream.on_message(&model, seq, &payload).await;
                    }
                    None => stream.malformed(),
                },
                Err(error) => break error,
            }
        };
        shared
            .metrics
            .connection_errors
            .with_label_values(&[&label, error.reason()])
            .inc();
        warn!(%pod, %error, "KV-event publisher connection lost; reconnecting");
        stream.counters().connected.store(false, Ordering::Relaxed);
        stream.mark_reconnected();
        drop(connection);
        if wait_retry(&mut backoff, &signals, &cancel).await {
            return;
        }
    }
}

/// Sleeps the next backoff delay, or less when nudged; true when cancelled.
async fn wait_retry(
    backoff: &mut Backoff,
    signals: &PodSignals,
    cancel: &CancellationToken,
) -> bool {
    tokio::select! {
        () = cancel.cancelled() => true,
        () = tokio::time::sleep(backoff.next_delay()) => false,
        () = signals.nudge.notified() => {
            backoff.reset();
            false
        }
    }
}

/// Bounds of the central (bind) mode, where anyone who reaches the port may connect.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CentralLimits {
    /// Most connections at once; further ones are closed at accept.
    pub(crate) max_peers: usize,
    /// Bytes all connections may buffer together (partial and queued messages).
    pub(crate) budget_bytes: usize,
}

/// What one accepted connection tells the central task.
enum PeerEvent {
    /// A whole message.
    Message(PeerMessage),
    /// The connection ended: the pods heard on it are disconnected until heard again.
    Closed(SocketAddr),
}

/// A message from one accepted connection.
struct PeerMessage {
    peer: SocketAddr,
    frames: Vec<Bytes>,
    _budget: BudgetGuard,
}

/// Binds the central listener; returns it with the resolved endpoint (port 0 resolved).
pub(crate) async fn bind_central(endpoint: &str) -> Result<(SubListener, String), TransportError> {
    let listener = SubListener::bind(endpoint).await?;
    let bound = listener.endpoint();
    Ok((listener, bound))
}

/// The central task: pods dial in; each message's topic names its pod, which must be in the
/// pool (others are counted and ignored). Runs until `cancel` fires.
pub(crate) async fn run_central(
    listener: SubListener,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IndexUpdate>,
    limits: CentralLimits,
    cancel: CancellationToken,
) {
    let (peer_tx, mut peer_rx) = mpsc::channel::<PeerEvent>(CENTRAL_QUEUE);
    // Which pods each connection has published for, so its end marks them disconnected.
    let mut heard_on: HashMap<SocketAddr, Vec<PodId>> = HashMap::new();
    let mut connections = JoinSet::new();
    let slots = Arc::new(Semaphore::new(limits.max_peers.max(1)));
    let budget = ByteBudget::new(limits.budget_bytes);
    let mut streams: HashMap<PodId, PodStream> = HashMap::new();
    loop {
        let pending = streams.values().any(PodStream::has_pending);
        let quiet = if pending {
            QUIET_REPAIR_DELAY
        } else {
            IDLE_WAIT
        };
        tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(io) => {
                    let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                        shared.metrics.rejected.with_label_values(&["too_many_peers"]).inc();
                        warn!(peer = ?io.peer_addr().ok(), max = limits.max_peers, "KV-event peer refused: too many connections");
                        continue;
                    };
                    let (shared, peer_tx, budget) = (shared.clone(), peer_tx.clone(), budget.clone());
                    connections.spawn(async move {
                        let connection = serve_peer(io, shared, peer_tx.clone(), budget).await;
                        // The slot is free before the peer sees its connection close, so a
                        // peer that reconnects at once is not refused for its own old slot.
                        drop(slot);
                        if let Some(peer) = connection.as_ref().map(Connection::peer) {
                            let _ = peer_tx.send(PeerEvent::Closed(peer)).await;
                        }
                        drop(connection);
                    });
                }
                Err(error) => {
                    // Out of file descriptors and the like: do not spin.
                    warn!(%error, "central KV-event accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            received = tokio::time::timeout(quiet, peer_rx.recv()) => match received {
                Ok(Some(PeerEvent::Message(message))) => {
                    let peer = message.peer;
                    if let Some(pod) = on_central_message(&shared, &tx, &mut streams, message).await {
                        let pods = heard_on.entry(peer).or_default();
                        if !pods.contains(&pod) {
                            pods.push(pod);
                        }
                    }
                }
                Ok(Some(PeerEvent::Closed(peer))) => {
                    for pod in heard_on.remove(&peer).unwrap_or_default() {
                        if let Some(stream) = streams.get_mut(&pod) {
                            debug!(%pod, %peer, "KV-event publisher dialing in disconnected");
                            stream.counters().connected.store(false, Ordering::Relaxed);
                            stream.mark_reconnected();
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    for stream in streams.values_mut() {
                        stream.repair_pending().await;
                    }
                }
            },
            () = shared.central_nudge.notified() => {
                for (pod, stream) in &mut streams {
                    if let Some(signals) = shared.signals.get(pod).map(|s| Arc::clone(&s)) {
                        take_restart(stream, &signals).await;
                    }
                }
            }
        }
    }
    connections.shutdown().await;
}

/// One accepted connection: handshake, then forward whole messages until it ends; returns
/// the connection (still open) so the caller decides when it closes.
async fn serve_peer(
    io: tokio::net::TcpStream,
    shared: Arc<Shared>,
    peer_tx: mpsc::Sender<PeerEvent>,
    budget: ByteBudget,
) -> Option<Connection> {
    let peer = io.peer_addr().ok();
    let mut connection =
        match Connection::accept(io, Role::Sub, shared.config.transport, Some(budget)).await {
            Ok(connection) => connection,
            Err(error) => {
                shared
                    .metrics
                    .rejected
                    .with_label_values(&[error.reason()])
                    .inc();
                warn!(?peer, %error, "KV-event peer dropped during the handshake");
                return None;
            }
        };
    loop {
        match connection.recv().await {
            Ok((frames, budget)) => {
                let message = PeerMessage {
                    peer: connection.peer(),
                    frames,
                    _budget: budget,
                };
                if peer_tx.send(PeerEvent::Message(message)).await.is_err() {
                    return Some(connection);
                }
            }
            Err(TransportError::Closed) => {
                debug!(?peer, "KV-event peer disconnected");
                return Some(connection);
            }
            Err(error) => {
                shared
                    .metrics
                    .rejected
                    .with_label_values(&[error.reason()])
                    .inc();
                warn!(?peer, %error, "KV-event peer dropped");
                return Some(connection);
            }
        }
    }
}

async fn on_central_message(
    shared: &Arc<Shared>,
    tx: &mpsc::Sender<IndexUpdate>,
    streams: &mut HashMap<PodId, PodStream>,
    message: PeerMessage,
) -> Option<PodId> {
    let Some((topic, seq, payload)) = frames(message.frames) else {
        shared.metrics.rejected.with_label_values(&["frames"]).inc();
        return None;
    };
    let Some(parsed) = parse_topic(&topic) else {
        shared.metrics.rejected.with_label_values(&["topic"]).inc();
        debug!(peer = %message.peer, "KV-event message without a kv@<pod>@<model> topic");
        return None;
    };
    let replay = match shared.known_replay(parsed.pod) {
        Some(replay) => replay,
        None => {
            shared
                .metrics
                .rejected
                .with_label_values(&["unknown_pod"])
                .inc();
            streams.remove(&parsed.pod);
            return None;
        }
    };
    streams.retain(|pod, _| shared.known_replay(*pod).is_some());
    let stream = streams
        .entry(parsed.pod)
        .or_insert_with(|| PodStream::new(parsed.pod, replay.clone(), shared.clone(), tx.clone()));
    stream.set_replay(replay);
    stream.counters().connected.store(true, Ordering::Relaxed);
    // NOTE: in central mode a pod is tied to the connections it published on (the TCP peer
    // is not the topic), so the pod counts as disconnected only once a connection it was heard
    // on ends. A restart is detected by its seq going back after that reconnect, or by its
    // /metrics (process start time).
    // NOTE: one task serves every pod in central mode, so a replay for one pod (bounded by
    // the replay timeout) delays the others; their messages wait in the bounded queue.
    stream.on_message(&parsed.model, seq, &payload).await;
    Some(parsed.pod)
}
