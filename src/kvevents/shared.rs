//! What the manager, its subscribers, their streams and the index writer share: the
//! pipeline's configuration, the shared state, the per-pod signals from the scrape path and
//! the index writer's input. Below all of them, so none reaches back up.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::Notify;

use super::decode::EventBatch;
use super::metrics::KvEventsMetrics;
use super::status::PodEventCounters;
use super::transport::TransportConfig;
use crate::endpoints::PodId;
use crate::kvcache::PrefixIndex;

/// Tuning of the event pipeline.
#[derive(Clone, Debug)]
pub struct KvEventsConfig {
    /// Capacity (in batches) of the channel from the streams to the index writer.
    pub channel_capacity: usize,
    /// Upper bound of one replay exchange.
    pub replay_timeout: Duration,
    /// Bounds and timeouts of every connection (message size before allocation, connect,
    /// handshake, mid-message stalls).
    pub transport: TransportConfig,
    /// First reconnect delay.
    pub backoff_initial: Duration,
    /// Largest reconnect delay (a restarted engine is resubscribed at most this late).
    pub backoff_max: Duration,
    /// Most pods connected at once to the central bind socket.
    pub central_max_peers: usize,
    /// Bytes the central bind socket's connections may buffer together.
    pub central_budget_bytes: usize,
    /// Model name used to key blocks when a topic does not name one (vLLM's default topic is
    /// empty; configure `kv@<ip:port>@<model>` as DESIGN §3 says).
    pub fallback_model: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            channel_capacity: 4096,
            replay_timeout: Duration::from_secs(3),
            transport: TransportConfig::default(),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
            central_max_peers: 1024,
            central_budget_bytes: 256 * 1024 * 1024,
            fallback_model: String::new(),
        }
    }
}

/// State shared by the manager, its streams and its writer.
pub(crate) struct Shared {
    pub(crate) index: Arc<PrefixIndex>,
    pub(crate) config: KvEventsConfig,
    pub(crate) metrics: KvEventsMetrics,
    pub(crate) counters: DashMap<PodId, Arc<PodEventCounters>>,
    /// Pods in the pool → their replay endpoint (central mode accepts only these).
    pub(crate) known: RwLock<HashMap<PodId, Option<String>>>,
    /// Per pod signals from the scrape path (restart seen, reachable again).
    pub(crate) signals: DashMap<PodId, Arc<PodSignals>>,
    /// Wakes the central task to look at `signals`.
    pub(crate) central_nudge: Notify,
}

impl Shared {
    pub(crate) fn counters_for(&self, pod: PodId) -> Arc<PodEventCounters> {
        self.counters.entry(pod).or_default().clone()
    }

    /// `Some(replay endpoint)` when the pod is in the pool.
    pub(crate) fn known_replay(&self, pod: PodId) -> Option<Option<String>> {
        self.known
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&pod)
            .cloned()
    }
}

/// Signals from outside the event stream about one pod (its scrape saw it come back, or saw
/// its engine restart).
#[derive(Debug, Default)]
pub(crate) struct PodSignals {
    /// Wakes the subscriber (reconnect now, or act on `restarted`).
    pub(crate) nudge: Notify,
    /// The engine process restarted (its `process_start_time_seconds` changed).
    pub(crate) restarted: AtomicBool,
}

/// A change to the index, in stream order.
#[derive(Debug)]
pub(crate) enum IndexUpdate {
    Apply {
        pod: PodId,
        model: Arc<str>,
        batch: EventBatch,
    },
    Clear {
        pod: PodId,
    },
    Purge {
        pod: PodId,
    },
}
