//! ZMQ SUB tasks: one per pod that connects to its PUB endpoint, or one central task that
//! binds an address the pods dial into (pod identity from the topic).
//!
//! Why supervised loops: a pod restarting, a network blip or a hostile peer must never end the
//! subscription for good; each task reconnects with capped exponential backoff until it is
//! aborted (the manager aborts it when the pod leaves the pool). No lock is held across an
//! `.await`; all index changes go through the stream's channel (see [`super::stream`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tracing::{info, warn};
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqMessage};

use super::decode::{decode_seq, parse_topic};
use super::manager::Shared;
use super::stream::{IndexUpdate, PodStream};
use crate::endpoints::{Endpoint, PodId};

/// How long the socket must be quiet before a dropped batch that no later batch revealed is
/// repaired.
const QUIET_REPAIR_DELAY: Duration = Duration::from_millis(50);

/// Receive timeout when nothing is pending (only to loop; nothing happens on expiry).
const IDLE_WAIT: Duration = Duration::from_secs(3600);

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
            current: initial,
            initial,
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

fn sub_socket(connect_timeout: Duration) -> SubSocket {
    let mut options = SocketOptions::default();
    options.connect_timeout(connect_timeout);
    SubSocket::with_options(options)
}

/// Splits a message into (topic, seq, payload) frames.
fn frames(message: ZmqMessage) -> Option<(bytes::Bytes, u64, bytes::Bytes)> {
    let [topic, seq, payload] = <[bytes::Bytes; 3]>::try_from(message.into_vec()).ok()?;
    let seq = decode_seq(&seq).ok()?;
    Some((topic, seq, payload))
}

/// The connect-mode task of one pod: runs until aborted.
pub(crate) async fn run_pod_subscriber(
    endpoint: Endpoint,
    events: String,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IndexUpdate>,
) {
    let pod = endpoint.id;
    let mut stream = PodStream::new(pod, endpoint.kv_replay.clone(), shared.clone(), tx);
    let mut backoff = Backoff::new(shared.config.backoff_initial, shared.config.backoff_max);
    let mut connected_before = false;
    loop {
        let mut socket = sub_socket(shared.config.connect_timeout);
        // The SUB reconnects by itself after a publisher goes away; its monitor is how we learn
        // that the stream may have been interrupted (and the engine possibly restarted).
        let mut monitor = socket.monitor();
        let connected = match socket.subscribe("").await {
            Ok(()) => socket.connect(&events).await,
            Err(error) => Err(error),
        };
        if let Err(error) = connected {
            warn!(%pod, %events, %error, "KV-event subscribe failed; retrying");
            tokio::time::sleep(backoff.next_delay()).await;
            continue;
        }
        info!(%pod, %events, "KV-event subscriber connected");
        if std::mem::replace(&mut connected_before, true) {
            stream.mark_reconnected();
        }
        stream.counters().connected.store(true, Ordering::Relaxed);
        backoff.reset();
        loop {
            let quiet = if stream.has_pending() {
                QUIET_REPAIR_DELAY
            } else {
                IDLE_WAIT
            };
            let received = tokio::select! {
                received = tokio::time::timeout(quiet, socket.recv()) => match received {
                    Ok(received) => received,
                    Err(_) => {
                        stream.repair_pending().await;
                        continue;
                    }
                },
                event = monitor.next() => {
                    match event {
                        Some(SocketEvent::Disconnected(_)) => {
                            warn!(%pod, "KV-event publisher disconnected; the SUB reconnects");
                            stream.counters().connected.store(false, Ordering::Relaxed);
                            stream.mark_reconnected();
                        }
                        Some(SocketEvent::Connected(..)) => {
                            info!(%pod, "KV-event publisher reconnected");
                            stream.counters().connected.store(true, Ordering::Relaxed);
                        }
                        Some(_) => {}
                        // The monitor is gone with its socket: start over.
                        None => break,
                    }
                    continue;
                }
            };
            match received {
                Ok(message) => match frames(message) {
                    Some((topic, seq, payload)) => {
                        let model = parse_topic(&topic)
                            .map(|t| t.model)
                            .unwrap_or_else(|| shared.config.fallback_model.clone());
                        stream.on_message(&model, seq, &payload).await;
                    }
                    None => stream.malformed(),
                },
                Err(error) => {
                    warn!(%pod, %error, "KV-event subscriber lost its publisher; reconnecting");
                    break;
                }
            }
        }
        stream.counters().connected.store(false, Ordering::Relaxed);
        drop(socket);
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// Binds the central SUB socket; returns it with the resolved endpoint (port 0 resolved).
pub(crate) async fn bind_central(
    endpoint: &str,
    connect_timeout: Duration,
) -> Result<(SubSocket, String), zeromq::ZmqError> {
    let mut socket = sub_socket(connect_timeout);
    socket.subscribe("").await?;
    let bound = socket.bind(endpoint).await?;
    Ok((socket, bound.to_string()))
}

/// The central task: pods dial in; each message's topic names its pod, which must be in the
/// pool (others are counted and ignored). Runs until aborted.
pub(crate) async fn run_central(
    mut socket: SubSocket,
    shared: Arc<Shared>,
    tx: mpsc::Sender<IndexUpdate>,
) {
    let mut streams: HashMap<PodId, PodStream> = HashMap::new();
    let mut backoff = Backoff::new(shared.config.backoff_initial, shared.config.backoff_max);
    loop {
        let received = if streams.values().any(PodStream::has_pending) {
            match tokio::time::timeout(QUIET_REPAIR_DELAY, socket.recv()).await {
                Ok(received) => received,
                Err(_) => {
                    for stream in streams.values_mut() {
                        stream.repair_pending().await;
                    }
                    continue;
                }
            }
        } else {
            socket.recv().await
        };
        let message = match received {
            Ok(message) => {
                backoff.reset();
                message
            }
            Err(error) => {
                // A peer went away; the bound socket keeps accepting others.
                warn!(%error, "central KV-event socket receive error");
                tokio::time::sleep(backoff.next_delay()).await;
                continue;
            }
        };
        let Some((topic, seq, payload)) = frames(message) else {
            shared.metrics.rejected.with_label_values(&["frames"]).inc();
            continue;
        };
        let Some(parsed) = parse_topic(&topic) else {
            shared.metrics.rejected.with_label_values(&["topic"]).inc();
            continue;
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
                continue;
            }
        };
        streams.retain(|pod, _| shared.known_replay(*pod).is_some());
        let stream = streams.entry(parsed.pod).or_insert_with(|| {
            PodStream::new(parsed.pod, replay.clone(), shared.clone(), tx.clone())
        });
        stream.set_replay(replay);
        stream.counters().connected.store(true, Ordering::Relaxed);
        // NOTE: in central mode a disconnect cannot be tied to a pod (the ZMQ peer is not the
        // topic), so an engine restart is detected by its seq going back only; a restart that
        // publishes past our last seq before we hear from it again is taken for a gap.
        // NOTE: one task serves every pod in central mode, so a replay for one pod (bounded by
        // the replay timeout) delays the others; their messages wait in the socket buffer.
        stream.on_message(&parsed.model, seq, &payload).await;
    }
}
