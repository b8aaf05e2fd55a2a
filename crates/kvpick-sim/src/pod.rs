//! One simulated vLLM pod at run time: the engine task, its publisher, metrics and faults.
//!
//! Why a single task owns the [`Engine`]: vLLM's engine core is one loop too, and a single
//! owner keeps the simulation deterministic. HTTP handlers talk to it over a bounded command
//! channel and receive tokens on a per-request bounded channel sized to hold the whole output,
//! so the engine never waits for a slow client. Dropping a [`TokenStream`] aborts its request.
//!
//! Time: the engine returns each step's simulated duration; the task sleeps that long on
//! tokio's clock (× `time_scale` × the slow-down fault), so tests can run under paused time.
//! Faults live in [`Faults`] (atomics) and are read by the engine task and the HTTP layer.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus::Registry;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::engine::{
    AdmitError, Engine, EngineConfig, EngineStats, RequestId, SimRequest, TokenOut,
};
use super::events::EventBatch;
use super::metrics::SimMetrics;
use super::publisher::{PublisherConfig, PublisherError, PublisherHandle, spawn_publisher};

/// How `/metrics` misbehaves (fault injection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsFault {
    /// Normal.
    Ok = 0,
    /// Never answers (the scraper times out).
    Stall = 1,
    /// Answers 500.
    Error = 2,
}

/// The step-time multiplier a pod runs with for a configured slow-down `factor`: clamped to
/// 0.01..=1000, 1 for a value that is not finite.
pub fn slowdown_factor(factor: f64) -> f64 {
    if factor.is_finite() {
        factor.clamp(0.01, 1000.0)
    } else {
        1.0
    }
}

/// The multiplier on step costs a pod runs with for a configured `time_scale`: the value
/// itself, or 1 for one that is negative or not finite.
pub fn time_scale_factor(time_scale: f64) -> f64 {
    if time_scale.is_finite() && time_scale >= 0.0 {
        time_scale
    } else {
        1.0
    }
}

/// Per-pod faults, settable at start and at run time.
#[derive(Debug, Default)]
pub struct Faults {
    slowdown_bits: AtomicU64,
    refuse: AtomicBool,
    metrics: AtomicU8,
}

impl Faults {
    /// Step-time multiplier (1.0 = normal).
    pub fn slowdown(&self) -> f64 {
        let v = f64::from_bits(self.slowdown_bits.load(Ordering::Relaxed));
        if v > 0.0 { v } else { 1.0 }
    }
    /// Sets the step-time multiplier ([`slowdown_factor`]).
    pub fn set_slowdown(&self, factor: f64) {
        self.slowdown_bits
            .store(slowdown_factor(factor).to_bits(), Ordering::Relaxed);
    }
    /// Whether new requests are refused (503).
    pub fn refusing(&self) -> bool {
        self.refuse.load(Ordering::Relaxed)
    }
    /// Refuse (or accept again) new requests.
    pub fn set_refuse(&self, refuse: bool) {
        self.refuse.store(refuse, Ordering::Relaxed);
    }
    /// The `/metrics` fault.
    pub fn metrics(&self) -> MetricsFault {
        match self.metrics.load(Ordering::Relaxed) {
            1 => MetricsFault::Stall,
            2 => MetricsFault::Error,
            _ => MetricsFault::Ok,
        }
    }
    /// Sets the `/metrics` fault.
    pub fn set_metrics(&self, fault: MetricsFault) {
        self.metrics.store(fault as u8, Ordering::Relaxed);
    }
}

/// Everything one pod needs.
#[derive(Debug, Clone)]
pub struct PodConfig {
    /// Served model name.
    pub model: String,
    /// The engine model.
    pub engine: EngineConfig,
    /// Multiplier on simulated step times (0.1 = 10× faster than real time).
    pub time_scale: f64,
    /// KV-event publisher, if events are enabled.
    pub publisher: Option<PublisherConfig>,
}

/// Errors starting a pod.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// The publisher failed to bind.
    #[error(transparent)]
    Publisher(#[from] PublisherError),
    /// Metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// Why a submission failed.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The engine refused the request (400).
    #[error(transparent)]
    Admit(#[from] AdmitError),
    /// The engine task is gone.
    #[error("the engine is not running")]
    EngineGone,
}

enum Command {
    Submit {
        req: SimRequest,
        reply: oneshot::Sender<Result<(RequestId, mpsc::Receiver<TokenOut>), AdmitError>>,
    },
    Abort(RequestId),
    Restart(oneshot::Sender<()>),
    ResetPrefixCache(oneshot::Sender<bool>),
}

/// A handle to a running pod; cheap to clone.
#[derive(Debug, Clone)]
pub struct Pod {
    tx: mpsc::Sender<Command>,
    stats: watch::Receiver<EngineStats>,
    /// This pod's registry (its `/metrics`).
    pub registry: Registry,
    /// Faults, shared with the engine task.
    pub faults: Arc<Faults>,
    /// The publisher, if events are enabled.
    pub publisher: Option<PublisherHandle>,
    /// Served model name.
    pub model: String,
    /// Engine settings.
    pub engine: EngineConfig,
}

/// Tokens of one request; dropping it aborts the request.
#[derive(Debug)]
pub struct TokenStream {
    /// The request id inside the pod.
    pub id: RequestId,
    rx: mpsc::Receiver<TokenOut>,
    abort: mpsc::Sender<Command>,
    finished: bool,
}

impl TokenStream {
    /// The next token; `None` when the request ended (finished, or dropped by a restart).
    pub async fn next(&mut self) -> Option<TokenOut> {
        let token = self.rx.recv().await;
        if token.as_ref().is_none_or(|t| t.finish.is_some()) {
            self.finished = true;
        }
        token
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        if !self.finished {
            // NOTE: if the command queue is full the abort is lost and the request runs to
            // completion with nobody listening; bounded memory either way.
            let _ = self.abort.try_send(Command::Abort(self.id));
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Pod {
    /// Starts the pod's engine task (and publisher).
    pub async fn start(
        cfg: PodConfig,
        faults: Arc<Faults>,
    ) -> Result<(Pod, JoinHandle<()>), PodError> {
        let registry = Registry::new();
        let algo = match cfg.engine.hash_algo {
            super::hashing::HashAlgo::Sha256 => "sha256",
            super::hashing::HashAlgo::Sha256Cbor => "sha256_cbor",
        };
        let metrics = Arc::new(SimMetrics::new(
            &registry,
            &cfg.model,
            cfg.engine.block_size,
            cfg.engine.num_gpu_blocks,
            algo,
            cfg.engine.max_loras,
        )?);
        let publisher = match cfg.publisher.clone() {
            Some(p) => Some(spawn_publisher(p).await?.0),
            None => None,
        };
        let (tx, rx) = mpsc::channel(1024);
        let engine = Engine::new(cfg.engine.clone());
        let (stats_tx, stats) = watch::channel(engine.stats());
        metrics.started(unix_now());
        metrics.update(&engine.stats(), unix_now());
        let driver = Driver {
            engine,
            outputs: HashMap::new(),
            timing: HashMap::new(),
            metrics,
            publisher: publisher.clone(),
            faults: faults.clone(),
            time_scale: time_scale_factor(cfg.time_scale),
            stats: stats_tx,
            deadline: None,
        };
        let join = tokio::spawn(driver.run(rx));
        Ok((
            Pod {
                tx,
                stats,
                registry,
                faults,
                publisher,
                model: cfg.model,
                engine: cfg.engine,
            },
            join,
        ))
    }

    /// Submits a request; tokens arrive on the returned stream.
    pub async fn submit(&self, req: SimRequest) -> Result<TokenStream, SubmitError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Submit { req, reply })
            .await
            .map_err(|_| SubmitError::EngineGone)?;
        let (id, tokens) = rx.await.map_err(|_| SubmitError::EngineGone)??;
        Ok(TokenStream {
            id,
            rx: tokens,
            abort: self.tx.clone(),
            finished: false,
        })
    }

    /// Latest engine stats.
    pub fn stats(&self) -> EngineStats {
        self.stats.borrow().clone()
    }

    /// Simulates a process restart: running requests end, the cache empties, seq goes back to 0.
    pub async fn restart(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::Restart(reply)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// `reset_prefix_cache`: clears the cache when idle; `AllBlocksCleared` is published with
    /// the next step's batch, as vLLM does.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (reply, rx) = oneshot::channel();
        if self
            .tx
            .send(Command::ResetPrefixCache(reply))
            .await
            .is_err()
        {
            return false;
        }
        rx.await.unwrap_or(false)
    }
}

struct Timing {
    arrival: Instant,
    last_token: Option<Instant>,
}

struct Driver {
    engine: Engine,
    outputs: HashMap<RequestId, mpsc::Sender<TokenOut>>,
    timing: HashMap<RequestId, Timing>,
    metrics: Arc<SimMetrics>,
    publisher: Option<PublisherHandle>,
    faults: Arc<Faults>,
    time_scale: f64,
    stats: watch::Sender<EngineStats>,
    deadline: Option<Instant>,
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd).await;
            }
            if !self.engine.has_work() {
                match rx.recv().await {
                    Some(cmd) => {
                        self.handle(cmd).await;
                        continue;
                    }
                    None => return,
                }
            }
            let out = self.engine.step();
            if out.duration.is_zero() && out.tokens.is_empty() && out.events.is_empty() {
                // Nothing schedulable: wait for the world to change.
                match rx.recv().await {
                    Some(cmd) => self.handle(cmd).await,
                    None => return,
                }
                continue;
            }
            let scale = self.time_scale * self.faults.slowdown();
            let sleep = out.duration.mul_f64(scale);
            if !sleep.is_zero() {
                // Deadlines accumulate exactly, so tokio's 1 ms timer resolution rounds each
                // wake-up but never drifts the simulated clock.
                let start = self
                    .deadline
                    .filter(|d| *d > Instant::now())
                    .unwrap_or_else(Instant::now);
                let deadline = start + sleep;
                self.deadline = Some(deadline);
                tokio::time::sleep_until(deadline).await;
            } else {
                self.deadline = None;
                tokio::task::yield_now().await;
            }
            self.publish(out.events);
            let now = Instant::now();
            self.metrics
                .add_tokens(out.prefill_tokens, out.tokens.len());
            for token in out.tokens {
                self.observe(&token, now);
                let id = token.id;
                let done = token.finish.is_some();
                if let Some(tx) = self.outputs.get(&id)
                    && tx.try_send(token).is_err()
                {
                    // Receiver gone: the client left.
                    self.engine.abort(id);
                    self.forget(id);
                    continue;
                }
                if done {
                    self.forget(id);
                }
            }
            self.refresh();
        }
    }

    fn observe(&mut self, token: &TokenOut, now: Instant) {
        let Some(timing) = self.timing.get_mut(&token.id) else {
            return;
        };
        match timing.last_token {
            None => self
                .metrics
                .observe_ttft(now.duration_since(timing.arrival).as_secs_f64()),
            Some(last) => self
                .metrics
                .observe_itl(now.duration_since(last).as_secs_f64()),
        }
        timing.last_token = Some(now);
        if token.finish.is_some() {
            self.metrics
                .observe_e2e(now.duration_since(timing.arrival).as_secs_f64());
        }
    }

    fn forget(&mut self, id: RequestId) {
        self.outputs.remove(&id);
        self.timing.remove(&id);
    }

    fn publish(&self, events: Vec<super::events::KvEvent>) {
        if events.is_empty() {
            return;
        }
        if let Some(publisher) = &self.publisher
            && !publisher.publish(EventBatch {
                ts: unix_now(),
                events,
                data_parallel_rank: Some(0),
            })
        {
            self.metrics.event_batch_dropped();
        }
    }

    fn refresh(&self) {
        let stats = self.engine.stats();
        self.metrics.update(&stats, unix_now());
        let _ = self.stats.send(stats);
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { req, reply } => {
                let capacity = req.max_tokens.saturating_add(1).clamp(1, 1 << 20);
                let result = self.engine.add_request(req).map(|id| {
                    let (tx, rx) = mpsc::channel(capacity);
                    self.outputs.insert(id, tx);
                    self.timing.insert(
                        id,
                        Timing {
                            arrival: Instant::now(),
                            last_token: None,
                        },
                    );
                    (id, rx)
                });
                if let Ok((id, _)) = &result {
                    let id = *id;
                    if reply.send(result).is_err() {
                        self.engine.abort(id);
                        self.forget(id);
                    }
                } else {
                    let _ = reply.send(result);
                }
                self.refresh();
            }
            Command::Abort(id) => {
                self.engine.abort(id);
                self.forget(id);
                self.refresh();
            }
            Command::Restart(reply) => {
                self.engine.restart();
                self.outputs.clear();
                self.timing.clear();
                if let Some(publisher) = &self.publisher {
                    publisher.restart().await;
                }
                self.metrics.started(unix_now());
                self.refresh();
                let _ = reply.send(());
            }
            Command::ResetPrefixCache(reply) => {
                // Its AllBlocksCleared goes out with the next step's batch (engine.rs).
                let ok = self.engine.reset_prefix_cache();
                self.refresh();
                let _ = reply.send(ok);
            }
        }
    }
}

/// Convenience for tests and tools: waits for the stream to end and returns all its tokens.
pub async fn collect(mut stream: TokenStream) -> Vec<TokenOut> {
    let mut out = Vec::new();
    while let Some(t) = stream.next().await {
        let done = t.finish.is_some();
        out.push(t);
        if done {
            break;
        }
    }
    out
}
