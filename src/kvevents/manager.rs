//! The KV-event manager: starts and stops one subscriber per pod as the pool changes, runs
//! the central bind mode, owns the single index writer, and reports status.
//!
//! # Concurrency rules
//! - One writer task applies every index change from every stream, in channel order; the
//!   channel is bounded ([`KvEventsConfig::channel_capacity`]).
//! - Per pod, changes are ordered because one stream produces them (see [`super::stream`]).
//! - A pod leaving the pool: its task is cancelled and awaited first, then a purge is queued
//!   behind anything it already sent, so no batch can re-create the pod after the purge.
//! - Signals from the scrape path ([`KvEventsManager::pod_reachable`],
//!   [`KvEventsManager::engine_restarted`]) never touch the index: they wake the pod's task,
//!   which acts on them in stream order.
//! - `sync` calls are serialized by an async mutex; status reads are lock-free atomics.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

use dashmap::DashMap;
use prometheus::Registry;
use tokio::sync::Notify;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::metrics::KvEventsMetrics;
pub use super::shared::KvEventsConfig;
use super::shared::{IndexUpdate, PodSignals, Shared};
use super::status::{KvEventsStatus, PodIndexStatus};
use super::subscriber::{CentralLimits, bind_central, run_central, run_pod_subscriber};
use super::transport::TransportError;
use crate::endpoints::{Endpoint, PodId};
use crate::kvcache::PrefixIndex;

/// Why the manager could not do something.
#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    /// Registering metrics failed (e.g. registered twice in one registry).
    #[error("metrics registration failed: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Binding the central socket failed.
    #[error("binding the central KV-event socket failed: {0}")]
    Bind(#[from] TransportError),
}

struct PodTask {
    events: String,
    replay: Option<String>,
    cancel: CancellationToken,
    handle: JoinHandle<()>,
}

/// Owns the event subscriptions of a pool and the writer that feeds the [`PrefixIndex`].
pub struct KvEventsManager {
    shared: Arc<Shared>,
    tx: mpsc::Sender<IndexUpdate>,
    tasks: Mutex<HashMap<PodId, PodTask>>,
    writer: std::sync::Mutex<Option<JoinHandle<()>>>,
    central: std::sync::Mutex<Option<(CancellationToken, JoinHandle<()>)>>,
    /// Cancels every task of this manager.
    cancel: CancellationToken,
}

impl KvEventsManager {
    /// Creates the manager and spawns its index writer (call inside a tokio runtime).
    pub fn new(
        index: Arc<PrefixIndex>,
        config: KvEventsConfig,
        registry: &Registry,
    ) -> Result<Self, KvEventsError> {
        let metrics = KvEventsMetrics::new(registry)?;
        let (tx, rx) = mpsc::channel(config.channel_capacity.max(1));
        let shared = Arc::new(Shared {
            index,
            config,
            metrics,
            counters: DashMap::new(),
            known: RwLock::new(HashMap::new()),
            signals: DashMap::new(),
            central_nudge: Notify::new(),
        });
        let writer = tokio::spawn(run_writer(shared.clone(), rx));
        Ok(Self {
            shared,
            tx,
            tasks: Mutex::new(HashMap::new()),
            writer: std::sync::Mutex::new(Some(writer)),
            central: std::sync::Mutex::new(None),
            cancel: CancellationToken::new(),
        })
    }

    /// The index this manager feeds.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.shared.index
    }

    /// Brings subscriptions in line with the pool: starts a subscriber for each endpoint with
    /// `kv_events` (restarting it if its addresses changed), stops those of endpoints that left
    /// or lost their event address, and purges the entries of pods that left the pool.
    pub async fn sync(&self, endpoints: &[Endpoint]) {
        let mut tasks = self.tasks.lock().await;
        let wanted: HashMap<PodId, &Endpoint> = endpoints.iter().map(|e| (e.id, e)).collect();
        let removed: Vec<PodId> = {
            let mut known = self.shared.known.write().unwrap_or_else(|e| e.into_inner());
            let removed = known
                .keys()
                .filter(|pod| !wanted.contains_key(pod))
                .copied()
                .collect();
            *known = endpoints
                .iter()
                .map(|e| (e.id, e.kv_replay.clone()))
                .collect();
            removed
        };
        let stale: Vec<PodId> = tasks
            .iter()
            .filter(|(pod, task)| match wanted.get(pod) {
                Some(e) => e.kv_events.as_ref() != Some(&task.events) || e.kv_replay != task.replay,
                None => true,
            })
            .map(|(pod, _)| *pod)
            .collect();
        for pod in stale {
            if let Some(task) = tasks.remove(&pod) {
                task.cancel.cancel();
                let _ = task.handle.await;
                info!(%pod, "KV-event subscriber stopped");
                if wanted.contains_key(&pod) {
                    // Another publisher (or none) now: what the old one told us is stale.
                    let _ = self.tx.send(IndexUpdate::Clear { pod }).await;
                    self.shared.counters.remove(&pod);
                }
            }
        }
        for pod in removed {
            let _ = self.tx.send(IndexUpdate::Purge { pod }).await;
            self.shared.counters.remove(&pod);
            self.shared.signals.remove(&pod);
        }
        for endpoint in endpoints {
            let Some(events) = endpoint.kv_events.clone() else {
                continue;
            };
            if tasks.contains_key(&endpoint.id) {
                continue;
            }
            self.shared.index.ensure_pod(endpoint.id);
            let cancel = self.cancel.child_token();
            let handle = tokio::spawn(run_pod_subscriber(
                endpoint.clone(),
                events.clone(),
                self.shared.clone(),
                self.tx.clone(),
                self.signals(endpoint.id),
                cancel.clone(),
            ));
            tasks.insert(
                endpoint.id,
                PodTask {
                    events,
                    replay: endpoint.kv_replay.clone(),
                    cancel,
                    handle,
                },
            );
        }
    }

    /// Binds the central socket (e.g. `tcp://0.0.0.0:5557`) that pods dial into; returns the
    /// bound endpoint. Only pods in the pool (the last `sync`) are accepted.
    pub async fn bind_central(&self, endpoint: &str) -> Result<String, KvEventsError> {
        let (listener, bound) = bind_central(endpoint).await?;
        let limits = CentralLimits {
            max_peers: self.shared.config.central_max_peers,
            budget_bytes: self.shared.config.central_budget_bytes,
        };
        let cancel = self.cancel.child_token();
        let handle = tokio::spawn(run_central(
            listener,
            self.shared.clone(),
            self.tx.clone(),
            limits,
            cancel.clone(),
        ));
        let previous = self
            .central
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace((cancel, handle));
        if let Some((cancel, _)) = previous {
            cancel.cancel();
        }
        Ok(bound)
    }

    fn signals(&self, pod: PodId) -> Arc<PodSignals> {
        Arc::clone(&self.shared.signals.entry(pod).or_default())
    }

    /// The pod answered again after failing (its scrape recovered): a subscriber waiting to
    /// reconnect tries now instead of at the end of its backoff.
    pub fn pod_reachable(&self, pod: PodId) {
        if let Some(signals) = self.shared.signals.get(&pod) {
            signals.nudge.notify_one();
        }
    }

    /// The pod's engine process restarted (e.g. its `process_start_time_seconds` changed):
    /// its cache is gone, so its entries are cleared now, in stream order, rather than when
    /// its first new batch shows the seq going back.
    pub fn engine_restarted(&self, pod: PodId) {
        if self.shared.known_replay(pod).is_none() {
            return;
        }
        let signals = self.signals(pod);
        signals.restarted.store(true, Ordering::Release);
        signals.nudge.notify_one();
        self.shared.central_nudge.notify_one();
    }

    /// The index writer's task, for a supervisor to watch (once; `None` afterwards). The
    /// writer ends only if it panics or the manager shuts down.
    pub fn take_writer(&self) -> Option<JoinHandle<()>> {
        self.writer.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The event stream state of one pod, when it has one.
    pub fn status(&self, pod: PodId) -> Option<KvEventsStatus> {
        self.shared.counters.get(&pod).map(|c| c.snapshot())
    }

    /// One pod's view for `GET /debug/pods` (`index_blocks`, `kv_events`).
    pub fn pod_status(&self, pod: PodId) -> PodIndexStatus {
        PodIndexStatus {
            address: pod.to_string(),
            index_blocks: self.shared.index.pod_entries(pod),
            kv_events: self.status(pod),
        }
    }

    /// [`Self::pod_status`] of every pod the index knows, sorted by address.
    pub fn pods_status(&self) -> Vec<PodIndexStatus> {
        self.shared
            .index
            .pods()
            .into_iter()
            .map(|pod| self.pod_status(pod))
            .collect()
    }

    /// Stops every task through its cancellation token (also done on drop); the writer ends
    /// once every sender is gone.
    pub fn shutdown(&self) {
        self.cancel.cancel();
        if let Some(writer) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            writer.abort();
        }
    }
}

impl Drop for KvEventsManager {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The single index writer.
async fn run_writer(shared: Arc<Shared>, mut rx: mpsc::Receiver<IndexUpdate>) {
    while let Some(update) = rx.recv().await {
        match update {
            IndexUpdate::Apply { pod, model, batch } => {
                let stats = shared.index.apply_batch(pod, &model, &batch);
                let label = pod.to_string();
                if let Some(counters) = shared.counters.get(&pod) {
                    counters.applied.fetch_add(1, Ordering::Relaxed);
                }
                shared.metrics.applied.with_label_values(&[&label]).inc();
                shared.metrics.count_skipped(&label, &stats);
                if stats.inconsistent_events > 0 {
                    warn!(%pod, events = stats.inconsistent_events, "KV events whose token count is not blocks × block size were skipped");
                }
                shared
                    .metrics
                    .index_entries
                    .with_label_values(&[&label])
                    .set(shared.index.pod_entries(pod) as i64);
            }
            IndexUpdate::Clear { pod } => {
                shared.index.clear_pod(pod);
                shared
                    .metrics
                    .index_entries
                    .with_label_values(&[&pod.to_string()])
                    .set(0);
            }
            IndexUpdate::Purge { pod } => {
                shared.index.purge_pod(pod);
                shared.metrics.forget(pod);
            }
        }
    }
}
