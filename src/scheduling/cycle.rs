//! One scheduling cycle's view of the candidates: every endpoint's load and metrics read once,
//! and the request's prefix matches computed once for all scorers that need them.
//!
//! Why a snapshot per cycle: the metrics store and in-flight counters change under us; reading
//! each once keeps filters and scorers consistent with each other within one decision.

use std::sync::Arc;
use std::time::Instant;

use crate::endpoints::{EndpointState, PodId, PrefillView};
use crate::kvcache::PrefixLookup;
use crate::scrape::{MetricsStore, PodMetrics, ScrapeStatus};

use super::SchedulingRequest;

/// Where the scheduler reads endpoint metrics from (the [`MetricsStore`] in production, a
/// plain map in tests).
pub trait MetricsSource: Send + Sync + 'static {
    /// The scrape status of `pod` (default when never scraped): a published snapshot.
    fn status(&self, pod: PodId) -> Arc<ScrapeStatus>;

    /// The statuses of `pods`, in order (one read of the source where it can).
    fn statuses(&self, pods: &[PodId]) -> Vec<Arc<ScrapeStatus>> {
        pods.iter().map(|pod| self.status(*pod)).collect()
    }
}

impl MetricsSource for MetricsStore {
    fn status(&self, pod: PodId) -> Arc<ScrapeStatus> {
        MetricsStore::status(self, pod)
    }

    fn statuses(&self, pods: &[PodId]) -> Vec<Arc<ScrapeStatus>> {
        MetricsStore::statuses(self, pods)
    }
}

/// One candidate as the cycle sees it.
#[derive(Debug, Clone)]
pub struct PodView {
    /// The endpoint (labels, in-flight counter).
    pub endpoint: Arc<EndpointState>,
    /// Its id.
    pub id: PodId,
    /// kvpick's in-flight count, read once.
    pub in_flight: u64,
    /// The last good metrics (possibly stale), shared with the store's snapshot.
    pub metrics: Option<Arc<PodMetrics>>,
    /// Whether the metrics are fresh and the last scrape succeeded.
    pub fresh: bool,
    /// Its prefill backlog and fitted time to first token, read once (filled only when a
    /// scorer needs them: the default is empty).
    pub prefill: PrefillView,
    /// Blocks the prefix index holds for it (filled only when a scorer needs occupancy).
    pub held_blocks: u64,
}

impl PodView {
    /// Reads one endpoint's state at `now`.
    pub fn read(
        endpoint: &Arc<EndpointState>,
        source: &dyn MetricsSource,
        now: Instant,
        staleness: std::time::Duration,
    ) -> Self {
        Self::with_status(endpoint, &source.status(endpoint.id()), now, staleness)
    }

    /// One endpoint's state at `now`, given its scrape status.
    pub fn with_status(
        endpoint: &Arc<EndpointState>,
        status: &ScrapeStatus,
        now: Instant,
        staleness: std::time::Duration,
    ) -> Self {
        Self {
            endpoint: Arc::clone(endpoint),
            id: endpoint.id(),
            in_flight: endpoint.in_flight.get(),
            fresh: status.is_fresh(now, staleness),
            metrics: status.metrics.clone(),
            prefill: PrefillView::default(),
            held_blocks: 0,
        }
    }

    /// Waiting requests, counting kvpick's in-flight requests the last scrape has not seen
    /// yet as waiting: `waiting + max(0, in_flight − waiting − running)`. Exact between
    /// scrapes for traffic kvpick routes. Without metrics: the in-flight count.
    pub fn queued(&self) -> f64 {
        let in_flight = self.in_flight as f64;
        match &self.metrics {
            Some(m) => m.waiting + (in_flight - m.waiting - m.running).max(0.0),
            None => in_flight,
        }
    }

    /// Running requests per the last scrape (0 without metrics).
    pub fn running(&self) -> f64 {
        self.metrics.as_ref().map_or(0.0, |m| m.running)
    }
}

/// How much of the request's prefix one candidate holds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefixHit {
    /// The prefix-cache score in [0, 1] (weighted matched blocks / total blocks).
    pub score: f64,
    /// Prompt tokens the candidate is expected to have cached (offloaded blocks count at
    /// their tier weight).
    pub cached_tokens: f64,
}

/// The state scorers read: candidates, prompt size and prefix hits (index = candidate).
#[derive(Debug)]
pub struct Cycle<'r> {
    /// The request.
    pub request: &'r SchedulingRequest,
    /// Surviving candidates (filters shrink this).
    pub pods: Vec<PodView>,
    /// Prompt length in tokens (estimated from characters for approximate prompts).
    pub prompt_tokens: f64,
    /// Per candidate prefix hit; empty when no scorer needs it.
    pub prefix: Vec<PrefixHit>,
    /// The index lookup behind `prefix` (exact prompts), kept so the routing record reuses
    /// its block keys.
    pub lookup: Option<PrefixLookup>,
    /// The candidate kvpick last routed this prompt's prefix to, when no candidate holds
    /// most of the prompt any more (filled only for the placement scorer).
    pub home: Option<HomeHit>,
}

/// The candidate a prompt's prefix was last routed to (`crate::kvcache::PrefixHome`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HomeHit {
    /// Its index among the candidates.
    pub index: usize,
    /// The share of the prompt that the remembered prefix covers, in [0, 1].
    pub share: f64,
}

impl Cycle<'_> {
    /// The prefix hit of candidate `i` (none when not computed).
    pub fn prefix_hit(&self, i: usize) -> PrefixHit {
        self.prefix.get(i).copied().unwrap_or_default()
    }

    /// Whether any candidate holds any of the prefix.
    pub fn any_prefix_hit(&self) -> bool {
        self.prefix.iter().any(|h| h.cached_tokens > 0.0)
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Hand-built pods and metrics for unit tests.
    use super::*;
    use crate::endpoints::Endpoint;
    use crate::scrape::LoraState;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// A metrics source backed by a map.
    #[derive(Default)]
    pub struct FakeMetrics(pub Mutex<HashMap<PodId, ScrapeStatus>>);

    impl FakeMetrics {
        pub fn set(&self, pod: PodId, metrics: PodMetrics) {
            let status = ScrapeStatus {
                metrics: Some(Arc::new(metrics)),
                fetched_at: Some(Instant::now()),
                ..ScrapeStatus::default()
            };
            self.0.lock().expect("lock").insert(pod, status);
        }
        pub fn set_status(&self, pod: PodId, status: ScrapeStatus) {
            self.0.lock().expect("lock").insert(pod, status);
        }
    }

    impl MetricsSource for FakeMetrics {
        fn status(&self, pod: PodId) -> Arc<ScrapeStatus> {
            Arc::new(
                self.0
                    .lock()
                    .expect("lock")
                    .get(&pod)
                    .cloned()
                    .unwrap_or_default(),
            )
        }
    }

    pub fn endpoint(i: usize) -> Arc<EndpointState> {
        endpoint_with(i, &[])
    }

    pub fn endpoint_with(i: usize, labels: &[(&str, &str)]) -> Arc<EndpointState> {
        let mut e = Endpoint::new(format!("10.0.0.{}:8000", i + 1).parse().expect("addr"));
        for (k, v) in labels {
            e.labels.insert((*k).to_owned(), (*v).to_owned());
        }
        Arc::new(EndpointState::new(e))
    }

    pub fn metrics(waiting: f64, running: f64, kv: f64) -> PodMetrics {
        PodMetrics {
            waiting,
            running,
            kv_usage: kv,
            ..PodMetrics::default()
        }
    }

    pub fn view(i: usize, m: Option<PodMetrics>, in_flight: u64) -> PodView {
        PodView {
            endpoint: endpoint(i),
            id: endpoint(i).id(),
            in_flight,
            fresh: m.is_some(),
            metrics: m.map(Arc::new),
            prefill: PrefillView::default(),
            held_blocks: 0,
        }
    }

    pub fn lora(running: &[&str], waiting: &[&str], max: u32) -> LoraState {
        LoraState {
            running: running.iter().map(|s| (*s).to_owned()).collect(),
            waiting: waiting.iter().map(|s| (*s).to_owned()).collect(),
            max_loras: max,
        }
    }
}
