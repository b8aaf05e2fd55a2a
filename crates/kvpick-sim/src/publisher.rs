//! The KV-event publisher of one simulated pod: a ZMQ PUB socket plus a ROUTER replay socket,
//! speaking exactly what vLLM's `ZmqEventPublisher` speaks.
//!
//! Wire (DESIGN §3): every PUB message is 3 frames `[topic, seq (u64 BE, from 0), payload]`.
//! The replay ROUTER takes `[b"", start_seq]` from a DEALER and answers one message
//! `[b"", topic, seq, payload]` per buffered batch with `seq >= start_seq`, then the end marker
//! `[b"", b"", 0xFF×8, b""]`. The buffer keeps the last `buffer_steps` batches, in memory only.
//!
//! Concurrency: one task owns both sockets and the buffer; the engine hands batches over a
//! bounded channel (`try_send`: when full the batch is dropped and counted, so a stalled
//! publisher never stalls the engine). Replay requests are served between batches, as vLLM
//! serves them between queue polls. Fault injection (dropping a fraction of PUB sends, a
//! restart that resets seq and the buffer) goes through the same channel, so it is ordered with
//! the batches around it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::events::{EventBatch, EventLayout};

/// The replay end marker's seq frame.
pub const END_MARKER_SEQ: [u8; 8] = [0xFF; 8];

/// Publisher settings.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB bind endpoint, e.g. `tcp://127.0.0.1:5557` (port 0 picks a free port).
    pub endpoint: String,
    /// ROUTER bind endpoint for replay, if any.
    pub replay_endpoint: Option<String>,
    /// Topic frame, e.g. `kv@<ip:port>@<model>` (llm-d) or `""` (vLLM's default).
    pub topic: String,
    /// Batches kept for replay (vLLM `buffer_steps`, default 10000).
    pub buffer_steps: usize,
    /// Event encoding.
    pub layout: EventLayout,
    /// Capacity of the engine → publisher channel.
    pub queue_capacity: usize,
    /// Seed for the drop-fraction fault's random choices.
    pub seed: u64,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:5557".to_owned(),
            replay_endpoint: Some("tcp://127.0.0.1:6557".to_owned()),
            topic: "kv@127.0.0.1:8000@sim-model".to_owned(),
            buffer_steps: 10_000,
            layout: EventLayout::Map,
            queue_capacity: 10_000,
            seed: 0,
        }
    }
}

/// Errors starting a publisher.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// A socket could not bind.
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        source: zeromq::ZmqError,
    },
}

enum Command {
    Batch(EventBatch),
    Restart,
    DropFraction(f64),
    NextSeq(tokio::sync::oneshot::Sender<u64>),
}

/// Handle to a running publisher; cheap to clone.
#[derive(Clone)]
pub struct PublisherHandle {
    tx: mpsc::Sender<Command>,
    dropped: Arc<AtomicU64>,
    published: Arc<AtomicU64>,
    /// The PUB endpoint actually bound (port resolved).
    pub endpoint: String,
    /// The ROUTER endpoint actually bound, if any.
    pub replay_endpoint: Option<String>,
}

impl std::fmt::Debug for PublisherHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherHandle")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish()
    }
}

impl PublisherHandle {
    /// Queues a batch; returns false (and counts a drop) if the queue is full or closed.
    pub fn publish(&self, batch: EventBatch) -> bool {
        let ok = self.tx.try_send(Command::Batch(batch)).is_ok();
        if !ok {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Simulates a publisher restart: seq restarts at 0 and the replay buffer is emptied.
    pub async fn restart(&self) {
        let _ = self.tx.send(Command::Restart).await;
    }

    /// Fault injection: skip this fraction of PUB sends (they still get a seq and stay
    /// replayable, so subscribers see gaps).
    pub async fn set_drop_fraction(&self, fraction: f64) {
        let _ = self
            .tx
            .send(Command::DropFraction(fraction.clamp(0.0, 1.0)))
            .await;
    }

    /// The seq the next batch will get, once every batch queued before this call is sent.
    pub async fn next_seq(&self) -> Option<u64> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Command::NextSeq(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Batches dropped because the queue was full.
    pub fn queue_drops(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Batches assigned a seq so far (across restarts).
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }
}

/// Binds the sockets and spawns the publisher task. The task ends when every handle is dropped.
pub async fn spawn_publisher(
    cfg: PublisherConfig,
) -> Result<(PublisherHandle, JoinHandle<()>), PublisherError> {
    let mut pub_socket = PubSocket::new();
    let endpoint = pub_socket
        .bind(&cfg.endpoint)
        .await
        .map_err(|source| PublisherError::Bind {
            endpoint: cfg.endpoint.clone(),
            source,
        })?
        .to_string();
    let (router, replay_endpoint) = match &cfg.replay_endpoint {
        Some(ep) => {
            let mut router = RouterSocket::new();
            let bound = router
                .bind(ep)
                .await
                .map_err(|source| PublisherError::Bind {
                    endpoint: ep.clone(),
                    source,
                })?;
            (Some(router), Some(bound.to_string()))
        }
        None => (None, None),
    };
    let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
    let handle = PublisherHandle {
        tx,
        dropped: Arc::new(AtomicU64::new(0)),
        published: Arc::new(AtomicU64::new(0)),
        endpoint,
        replay_endpoint,
    };
    let task = PublisherTask {
        topic: Bytes::from(cfg.topic.clone().into_bytes()),
        layout: cfg.layout,
        buffer_steps: cfg.buffer_steps.max(1),
        buffer: VecDeque::new(),
        next_seq: 0,
        drop_fraction: 0.0,
        rng: fastrand::Rng::with_seed(cfg.seed),
        published: handle.published.clone(),
    };
    let join = tokio::spawn(task.run(rx, pub_socket, router));
    Ok((handle, join))
}

struct PublisherTask {
    topic: Bytes,
    layout: EventLayout,
    buffer_steps: usize,
    buffer: VecDeque<(u64, Bytes)>,
    next_seq: u64,
    drop_fraction: f64,
    rng: fastrand::Rng,
    published: Arc<AtomicU64>,
}

async fn recv_replay(router: &mut Option<RouterSocket>) -> Option<ZmqMessage> {
    match router {
        Some(r) => r.recv().await.ok(),
        None => std::future::pending().await,
    }
}

impl PublisherTask {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Command>,
        mut pub_socket: PubSocket,
        mut router: Option<RouterSocket>,
    ) {
        loop {
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    None => break,
                    Some(Command::Batch(batch)) => self.send(&mut pub_socket, &batch).await,
                    Some(Command::Restart) => {
                        self.next_seq = 0;
                        self.buffer.clear();
                    }
                    Some(Command::DropFraction(f)) => self.drop_fraction = f,
                    Some(Command::NextSeq(reply)) => {
                        let _ = reply.send(self.next_seq);
                    }
                },
                request = recv_replay(&mut router) => {
                    if let (Some(request), Some(router)) = (request, router.as_mut()) {
                        self.replay(router, request).await;
                    }
                }
            }
        }
    }

    async fn send(&mut self, socket: &mut PubSocket, batch: &EventBatch) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.published.fetch_add(1, Ordering::Relaxed);
        let payload = Bytes::from(batch.encode(self.layout));
        self.buffer.push_back((seq, payload.clone()));
        while self.buffer.len() > self.buffer_steps {
            self.buffer.pop_front();
        }
        if self.drop_fraction > 0.0 && self.rng.f64() < self.drop_fraction {
            return;
        }
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(message) = ZmqMessage::try_from(frames) {
            // NOTE: PUB has no backpressure; a send error (no peers) is what vLLM ignores too.
            let _ = socket.send(message).await;
        }
    }

    async fn replay(&self, router: &mut RouterSocket, request: ZmqMessage) {
        // [identity, b"", start_seq(8)] from a DEALER; tolerate a missing delimiter.
        let frames = request.into_vec();
        let Some(identity) = frames.first().cloned() else {
            return;
        };
        let Some(start) = frames
            .last()
            .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
        else {
            return;
        };
        let start = u64::from_be_bytes(start);
        for (seq, payload) in self.buffer.iter().filter(|(seq, _)| *seq >= start) {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            if let Ok(message) = ZmqMessage::try_from(reply)
                && router.send(message).await.is_err()
            {
                return;
            }
        }
        let end = vec![
            identity,
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&END_MARKER_SEQ),
            Bytes::new(),
        ];
        if let Ok(message) = ZmqMessage::try_from(end) {
            let _ = router.send(message).await;
        }
    }
}
