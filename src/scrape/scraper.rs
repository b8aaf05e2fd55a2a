//! Scraping every endpoint's `/metrics` on an interval, and the store scheduling reads.
//!
//! Concurrency rules: one task per endpoint owns that endpoint's [`ScrapeStatus`] and, after
//! every scrape, publishes an immutable copy (`Arc<ScrapeStatus>`, its metrics an
//! `Arc<PodMetrics>`) into the [`MetricsStore`], replacing the previous one under a short
//! write lock. Readers take the read lock only to clone that `Arc` (one lock for all the
//! candidates of a pick), never copy metrics, and never wait for a scrape. The
//! [`ScrapeManager`] registers an endpoint's entry and starts its task when it joins the
//! pool, and cancels the task and drops the entry when it leaves; a task publishes only into
//! the registration it was started for, so a task that finishes its last scrape after its
//! pod left (or left and came back) cannot bring back a stale entry.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use tokio_util::sync::CancellationToken;

use super::by_name::PageChoice;
use super::connection::MetricsConnection;
use super::engine::{EngineKind, PodMetrics};
pub use super::error::ScrapeError;
use super::prom_text;
use crate::endpoints::{ENGINE_TYPE_LABEL, Endpoint, EndpointState, PodId, PrefillLoad};

/// The path scraped unless `--model-server-metrics-path` says otherwise.
pub const DEFAULT_METRICS_PATH: &str = "/metrics";

/// Scrape timing and limits.
#[derive(Debug, Clone)]
pub struct ScrapeConfig {
    /// Time between scrapes of one endpoint (GIE: 50 ms).
    pub interval: Duration,
    /// Longest one scrape may take.
    pub timeout: Duration,
    /// Metrics older than this make the pod count as saturated (GIE: ~200 ms).
    pub staleness: Duration,
    /// Largest `/metrics` body read.
    pub max_body_bytes: usize,
    /// The URL path scraped (llm-d `--model-server-metrics-path`).
    pub path: String,
    /// The port scraped on the endpoint's IP, when not the endpoint's own (llm-d
    /// `--model-server-metrics-port`).
    pub port: Option<u16>,
    /// Ask vLLM pods for only the metrics kvpick reads (`super::by_name`); pods that do not
    /// answer by name are scraped whole.
    pub by_name: bool,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(50),
            timeout: Duration::from_millis(1000),
            staleness: Duration::from_millis(200),
            max_body_bytes: 8 * 1024 * 1024,
            path: DEFAULT_METRICS_PATH.to_owned(),
            port: None,
            by_name: true,
        }
    }
}

/// The scrape state of one endpoint.
#[derive(Debug, Clone, Default)]
pub struct ScrapeStatus {
    /// The last successful scrape's metrics (shared, immutable).
    pub metrics: Option<Arc<PodMetrics>>,
    /// When the last successful scrape finished.
    pub fetched_at: Option<Instant>,
    /// The last scrape's error, cleared by a success.
    pub last_error: Option<ScrapeError>,
    /// Failures since the last success.
    pub consecutive_failures: u32,
    /// Whether the pod is asked for its metrics by name (`super::by_name`), not its whole
    /// page.
    pub by_name: bool,
}

/// Failed scrapes in a row, the last a connect timeout, that make a pod unreachable.
///
/// NOTE: one is not enough: Linux retransmits a lost SYN after 1 s, the default scrape
/// timeout, so a single dropped packet times out one scrape of a healthy pod.
pub const CONNECT_TIMEOUTS_UNREACHABLE: u32 = 2;

impl ScrapeStatus {
    /// How old the last good metrics are at `now` (`None`: never scraped).
    pub fn age(&self, now: Instant) -> Option<Duration> {
        self.fetched_at.map(|at| now.saturating_duration_since(at))
    }

    /// Whether the pod is unreachable: the last scrape found nothing listening (refused,
    /// reset, unroutable), or could not connect within the timeout after
    /// [`CONNECT_TIMEOUTS_UNREACHABLE`] failed scrapes in a row (a host that died or was cut
    /// off drops packets and answers nothing; its kept-alive connection first times out
    /// asking, then a new one times out connecting).
    pub fn connection_failed(&self) -> bool {
        match self.last_error {
            Some(ScrapeError::Connect(_)) => true,
            Some(ScrapeError::ConnectTimeout) => {
                self.consecutive_failures >= CONNECT_TIMEOUTS_UNREACHABLE
            }
            _ => false,
        }
    }

    /// Whether the metrics are recent enough to trust at `now`.
    pub fn is_fresh(&self, now: Instant, staleness: Duration) -> bool {
        self.last_error.is_none() && self.age(now).is_some_and(|age| age <= staleness)
    }
}

/// The latest scrape of every endpoint, as immutable snapshots.
#[derive(Debug, Default)]
pub struct MetricsStore {
    pods: RwLock<HashMap<PodId, Published>>,
}

/// One endpoint's entry: the registration it belongs to and its last published status.
#[derive(Debug)]
struct Published {
    registration: u64,
    status: Arc<ScrapeStatus>,
}

/// Which registration of a pod a scrape task publishes into (see [`MetricsStore::publish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration(u64);

impl MetricsStore {
    /// `pod`'s last published status (the default when it is not scraped).
    pub fn status(&self, pod: PodId) -> Arc<ScrapeStatus> {
        self.read()
            .get(&pod)
            .map(|p| Arc::clone(&p.status))
            .unwrap_or_default()
    }

    /// The last published status of each of `pods`, in order, under one read lock.
    pub fn statuses(&self, pods: &[PodId]) -> Vec<Arc<ScrapeStatus>> {
        let map = self.read();
        pods.iter()
            .map(|pod| {
                map.get(pod)
                    .map(|p| Arc::clone(&p.status))
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Starts a fresh entry for `pod` (replacing any earlier one) and names it.
    fn register(&self, pod: PodId) -> Registration {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let registration = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.write().insert(
            pod,
            Published {
                registration,
                status: Arc::default(),
            },
        );
        Registration(registration)
    }

    /// Replaces `pod`'s status, if its entry is still the one `registration` names.
    fn publish(&self, pod: PodId, registration: Registration, status: ScrapeStatus) {
        let status = Arc::new(status);
        if let Some(entry) = self
            .write()
            .get_mut(&pod)
            .filter(|e| e.registration == registration.0)
        {
            entry.status = status;
        }
    }

    fn remove(&self, pod: PodId) {
        self.write().remove(&pod);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<PodId, Published>> {
        // Entries are replaced whole, so a panic elsewhere cannot leave one half-written.
        self.pods.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<PodId, Published>> {
        self.pods.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Scrape metrics.
#[derive(Debug, Clone)]
pub struct ScrapeMetrics {
    errors: IntCounterVec,
    duration: HistogramVec,
}

impl ScrapeMetrics {
    /// Creates and registers the scrape metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let metrics = Self {
            errors: IntCounterVec::new(
                Opts::new(
                    "kvpick_scrape_errors_total",
                    "Failed /metrics scrapes, by endpoint and reason.",
                ),
                &["endpoint", "reason"],
            )?,
            duration: HistogramVec::new(
                HistogramOpts::new(
                    "kvpick_scrape_duration_seconds",
                    "Time to fetch and parse one endpoint's /metrics.",
                )
                .buckets(prometheus::exponential_buckets(1e-4, 2.0, 16)?),
                &["endpoint"],
            )?,
        };
        registry.register(Box::new(metrics.errors.clone()))?;
        registry.register(Box::new(metrics.duration.clone()))?;
        Ok(metrics)
    }

    /// Removes `pod`'s series (it left the pool): with pods replaced on every rollout, series
    /// of gone pods would otherwise pile up for the life of the process.
    fn forget(&self, pod: PodId) {
        let label = pod.to_string();
        let _ = self.duration.remove_label_values(&[&label]);
        for reason in ScrapeError::REASONS {
            let _ = self.errors.remove_label_values(&[&label, reason]);
        }
    }
}

/// A connection to `pod`'s metrics endpoint (its own IP, at the configured port and path).
pub fn metrics_connection(
    pod: PodId,
    config: &ScrapeConfig,
) -> Result<MetricsConnection, ScrapeError> {
    let mut target = pod.addr();
    if let Some(port) = config.port {
        target.set_port(port);
    }
    MetricsConnection::new(target, &config.path, config.timeout, config.max_body_bytes)
}

/// Fetches and parses one endpoint's metrics over `connection`.
pub async fn scrape_once(
    connection: &mut MetricsConnection,
    engine: EngineKind,
) -> Result<PodMetrics, ScrapeError> {
    scrape_with_start_time(connection, engine)
        .await
        .map(|(metrics, _)| metrics)
}

/// [`scrape_once`], plus the process's `process_start_time_seconds` when it exports one (the
/// Prometheus client libraries of vLLM, SGLang and TensorRT-LLM all do).
async fn scrape_with_start_time(
    connection: &mut MetricsConnection,
    engine: EngineKind,
) -> Result<(PodMetrics, Option<f64>), ScrapeError> {
    let body = connection.get().await?;
    let text = std::str::from_utf8(&body).map_err(|e| ScrapeError::Body(e.to_string()))?;
    let exposition = prom_text::parse_wanted(text, engine.read_names());
    if let Some((line, error)) = exposition.first_error {
        tracing::debug!(metrics_at = %connection.target(), line, %error, bad_lines = exposition.bad_lines, "skipped malformed metric lines");
    }
    let start_time = exposition
        .samples
        .iter()
        .find(|s| s.name == super::engine::START_TIME && s.value.is_finite() && s.value > 0.0)
        .map(|s| s.value);
    Ok((engine.extract(&exposition.samples)?, start_time))
}

/// What the scrape path tells other subsystems about a pod (implemented where they are
/// wired together, so this module depends on none of them).
pub trait ScrapeObserver: Send + Sync {
    /// The pod answered its scrape again after failing.
    fn recovered(&self, pod: PodId);
    /// The pod's `process_start_time_seconds` changed: its engine restarted and its cache
    /// is gone.
    fn restarted(&self, pod: PodId);
}

/// Whether two process start times are different processes (Prometheus exports them as
/// float seconds; allow for formatting jitter).
fn restarted_between(previous: Option<f64>, now: Option<f64>) -> bool {
    matches!((previous, now), (Some(a), Some(b)) if (a - b).abs() > 0.5)
}

/// What every scrape task of a manager shares.
#[derive(Clone)]
struct ScrapeContext {
    config: ScrapeConfig,
    metrics: ScrapeMetrics,
    observer: Option<Arc<dyn ScrapeObserver>>,
    store: Arc<MetricsStore>,
    /// The instant the manager's scrape grid counts from.
    grid: tokio::time::Instant,
}

async fn scrape_loop(
    pod: PodId,
    engine: EngineKind,
    own_load: Arc<PrefillLoad>,
    context: ScrapeContext,
    registration: Registration,
    cancel: CancellationToken,
) {
    let ScrapeContext {
        config,
        metrics,
        observer,
        store,
        grid,
    } = context;
    // This task's own status; every scrape publishes a copy (cheap: the metrics are shared).
    let mut state = ScrapeStatus::default();
    let label = pod.to_string();
    // (Looked up once: the series lives as long as this task.)
    let duration = metrics.duration.with_label_values(&[&label]);
    let mut start_time: Option<f64> = None;
    let mut connection = match metrics_connection(pod, &config) {
        Ok(connection) => connection,
        Err(error) => {
            // The path was checked when the configuration was read; this cannot come from
            // a pod, so it is said once and the pod stays unscraped (saturated).
            tracing::error!(%pod, %error, "cannot scrape this pod");
            return;
        }
    };
    let mut page = PageChoice::new(config.by_name, &config.path, engine);
    if let Some(path) = page.by_name_path()
        && connection.set_path(path).is_err()
    {
        page = PageChoice::whole();
    }
    // The first scrape at once (a new pod is unscraped, so saturated, until it is); the
    // next ones on the manager's grid, together with every other pod's (see `next_on_grid`).
    // NOTE: Skip, not Delay: a late scrape is followed by one at the next grid point, so
    // a slow pod does not drift off the grid.
    let mut ticker = tokio::time::interval_at(
        next_on_grid(grid, tokio::time::Instant::now(), config.interval),
        config.interval,
    );
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = ticker.tick() => {}
            }
        }
        let started = Instant::now();
        let awaiting_before = own_load.awaiting();
        let mut result = tokio::select! {
            _ = cancel.cancelled() => return,
            result = scrape_with_start_time(&mut connection, engine) => result,
        };
        match &result {
            Ok(_) if page.by_name_path().is_some() => page.answered_by_name(),
            Err(error) if page.retry_whole(error) => {
                let by_name_error = error.clone();
                // (Both paths were accepted when the connection was made.)
                let _ = connection.set_path(&config.path);
                result = tokio::select! {
                    _ = cancel.cancelled() => return,
                    result = scrape_with_start_time(&mut connection, engine) => result,
                };
                if page.whole_page_came(&by_name_error, result.is_ok()) {
                    tracing::info!(%pod, error = %by_name_error, "the pod does not answer for its metrics by name; scraping its whole page from now on");
                } else if let Some(path) = page.by_name_path() {
                    let _ = connection.set_path(path);
                }
            }
            _ => {}
        }
        duration.observe(started.elapsed().as_secs_f64());
        match result {
            Ok((mut pod_metrics, started_at)) => {
                // The engine counted its queue somewhere inside the round trip; of kvpick's
                // requests, those that got their first byte meanwhile may still be in it, and
                // those routed meanwhile may not be yet. The larger count errs towards less
                // foreign work, which is the harmless side: kvpick's own is counted exactly.
                pod_metrics.own_awaiting = awaiting_before.max(own_load.awaiting()) as f64;
                let recovered = state.last_error.is_some();
                if recovered {
                    tracing::info!(%pod, "metrics scrape recovered");
                }
                let restarted = restarted_between(start_time, started_at);
                if restarted {
                    tracing::warn!(%pod, previous = ?start_time, now = ?started_at, "engine process restarted (process_start_time_seconds changed)");
                }
                if started_at.is_some() {
                    start_time = started_at;
                }
                if let Some(observer) = &observer {
                    // NOTE: observers only signal (no locks of their own, no awaits).
                    if restarted {
                        observer.restarted(pod);
                    }
                    if recovered {
                        observer.recovered(pod);
                    }
                }
                state.metrics = Some(Arc::new(pod_metrics));
                state.fetched_at = Some(Instant::now());
                state.last_error = None;
                state.consecutive_failures = 0;
            }
            Err(error) => {
                // NOTE: not once the pod left (the manager removed its series; this would
                // bring one back for good). What is left is the instant between this check
                // and the removal.
                if !cancel.is_cancelled() {
                    metrics
                        .errors
                        .with_label_values(&[&label, error.reason()])
                        .inc();
                }
                if state.consecutive_failures == 0 {
                    tracing::warn!(%pod, %error, "metrics scrape failed; the pod counts as saturated until it recovers");
                }
                state.consecutive_failures = state.consecutive_failures.saturating_add(1);
                state.last_error = Some(error);
            }
        }
        state.by_name = page.by_name_path().is_some();
        store.publish(pod, registration, state.clone());
    }
}

/// Keeps one scrape task per endpoint of the pool.
pub struct ScrapeManager {
    config: ScrapeConfig,
    store: Arc<MetricsStore>,
    metrics: ScrapeMetrics,
    tasks: HashMap<PodId, (EngineKind, CancellationToken)>,
    parent: CancellationToken,
    observer: Option<Arc<dyn ScrapeObserver>>,
    /// Where every pod's scrape grid starts (`next_on_grid`).
    grid: tokio::time::Instant,
}

impl ScrapeManager {
    /// A manager writing into `store`; all its tasks stop when `parent` is cancelled.
    pub fn new(
        config: ScrapeConfig,
        store: Arc<MetricsStore>,
        metrics: ScrapeMetrics,
        parent: CancellationToken,
    ) -> Self {
        Self {
            config,
            store,
            metrics,
            tasks: HashMap::new(),
            parent,
            observer: None,
            grid: tokio::time::Instant::now(),
        }
    }

    /// Tells `observer` when a pod recovers or its engine restarts.
    pub fn with_observer(mut self, observer: Arc<dyn ScrapeObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Starts tasks for new endpoints and stops those of endpoints that left.
    pub fn sync(&mut self, endpoints: &[Arc<EndpointState>]) {
        let wanted: HashMap<PodId, (EngineKind, &Arc<PrefillLoad>)> = endpoints
            .iter()
            .map(|e| (e.id(), (engine_of(&e.endpoint), &e.prefill)))
            .collect();
        self.tasks.retain(|pod, (engine, cancel)| {
            let keep = wanted.get(pod).is_some_and(|(wanted, _)| wanted == engine);
            if !keep {
                cancel.cancel();
                self.store.remove(*pod);
                self.metrics.forget(*pod);
            }
            keep
        });
        for (pod, (engine, own_load)) in wanted {
            if self.tasks.contains_key(&pod) {
                continue;
            }
            let cancel = self.parent.child_token();
            let context = ScrapeContext {
                config: self.config.clone(),
                metrics: self.metrics.clone(),
                observer: self.observer.clone(),
                store: Arc::clone(&self.store),
                grid: self.grid,
            };
            let registration = self.store.register(pod);
            tokio::spawn(scrape_loop(
                pod,
                engine,
                Arc::clone(own_load),
                context,
                registration,
                cancel.clone(),
            ));
            self.tasks.insert(pod, (engine, cancel));
        }
    }
}

fn engine_of(endpoint: &Endpoint) -> EngineKind {
    match endpoint.labels.get(ENGINE_TYPE_LABEL) {
        None => EngineKind::default(),
        Some(value) => value.parse().unwrap_or_else(|error| {
            tracing::warn!(pod = %endpoint.id, %error, "scraping as vLLM");
            EngineKind::default()
        }),
    }
}

mod grid;
use grid::next_on_grid;

#[cfg(test)]
mod by_name_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// One scrape of `pod` on a new connection.
    async fn scrape_once(
        pod: PodId,
        engine: EngineKind,
        config: &ScrapeConfig,
    ) -> Result<PodMetrics, ScrapeError> {
        let mut connection = metrics_connection(pod, config).expect("a valid path");
        super::scrape_once(&mut connection, engine).await
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_a_slow_pod_a_timeout() {
        // A port that was just free: nothing listens there.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port");
        let config = ScrapeConfig::default();
        let error = scrape_once(PodId(closed), EngineKind::default(), &config)
            .await
            .expect_err("nothing listens");
        assert!(matches!(error, ScrapeError::Connect(_)), "{error:?}");
        assert_eq!(error.reason(), "connect");

        // Accepts, never answers: slow, not gone.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = silent.local_addr().expect("addr");
        let config = ScrapeConfig {
            timeout: Duration::from_millis(100),
            ..ScrapeConfig::default()
        };
        let error = scrape_once(PodId(addr), EngineKind::default(), &config)
            .await
            .expect_err("no answer");
        assert_eq!(error, ScrapeError::Timeout);
        drop(silent);
    }

    /// A pod whose every `GET` is answered with the real vLLM metrics fixture (one request
    /// per connection).
    async fn metrics_pod() -> std::net::SocketAddr {
        metrics_pod_at(None).await
    }

    /// [`metrics_pod`], answering 404 to any path but `path` when one is given.
    async fn metrics_pod_at(path: Option<&'static str>) -> std::net::SocketAddr {
        let page = super::super::test_pod::vllm_page();
        super::super::test_pod::serve(move |target| {
            if path.is_none_or(|path| target == path) {
                ("200 OK", page.clone())
            } else {
                ("404 Not Found", Vec::new())
            }
        })
        .await
        .addr
    }

    /// A manager scraping every 10 ms (else as `config`), with what the tests read of it.
    pub(super) struct FastScrapes {
        pub(super) manager: ScrapeManager,
        pub(super) store: Arc<MetricsStore>,
        pub(super) registry: Registry,
        pub(super) cancel: CancellationToken,
    }

    pub(super) fn fast_scrapes(config: ScrapeConfig) -> FastScrapes {
        let registry = Registry::new();
        let metrics = ScrapeMetrics::new(&registry).expect("metrics");
        let store = Arc::new(MetricsStore::default());
        let cancel = CancellationToken::new();
        let config = ScrapeConfig {
            interval: Duration::from_millis(10),
            ..config
        };
        let manager = ScrapeManager::new(config, Arc::clone(&store), metrics, cancel.clone());
        FastScrapes {
            manager,
            store,
            registry,
            cancel,
        }
    }

    #[tokio::test]
    async fn the_configured_path_and_port_are_scraped() {
        // The model server's metrics on another port and path than its API
        // (llm-d's --model-server-metrics-port / -path).
        let metrics = metrics_pod_at(Some("/stats/prometheus")).await;
        let api = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port");
        let pod = PodId(api);
        let moved = ScrapeConfig {
            path: "/stats/prometheus".to_owned(),
            port: Some(metrics.port()),
            ..ScrapeConfig::default()
        };
        let scraped = scrape_once(pod, EngineKind::default(), &moved)
            .await
            .expect("scraped at the configured path and port");
        assert!(
            scraped.block_size.is_some(),
            "the fixture's cache_config_info was read"
        );
        // The default path on that port is not where the metrics are; the API port has none.
        let wrong_path = ScrapeConfig {
            port: Some(metrics.port()),
            ..ScrapeConfig::default()
        };
        assert_eq!(
            scrape_once(pod, EngineKind::default(), &wrong_path).await,
            Err(ScrapeError::Status(404))
        );
        let api_port = scrape_once(pod, EngineKind::default(), &ScrapeConfig::default())
            .await
            .expect_err("nothing listens on the API port");
        assert!(matches!(api_port, ScrapeError::Connect(_)), "{api_port:?}");
    }

    #[tokio::test]
    async fn each_scrape_records_how_many_of_kvpicks_requests_awaited_their_first_byte() {
        let addr = metrics_pod().await;
        let pod = PodId(addr);
        let state = Arc::new(EndpointState::new(Endpoint::new(pod)));
        let awaiting: Vec<_> = (0..3)
            .map(|_| state.prefill.start(100.0, 0.0, None, Instant::now()))
            .collect();
        let FastScrapes {
            mut manager,
            store,
            cancel,
            ..
        } = fast_scrapes(ScrapeConfig::default());
        manager.sync(&[state]);
        let scraped_own = |want: f64| {
            let store = Arc::clone(&store);
            async move {
                loop {
                    let own = store.status(pod).metrics.as_ref().map(|m| m.own_awaiting);
                    if own == Some(want) {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        let within = Duration::from_secs(10);
        tokio::time::timeout(within, scraped_own(3.0))
            .await
            .expect("a scrape with kvpick's 3 requests awaiting");
        // Their first bytes arrive: the next scrapes say none of the engine's queue is kvpick's.
        drop(awaiting);
        tokio::time::timeout(within, scraped_own(0.0))
            .await
            .expect("a later scrape with none awaiting");
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_pod_that_leaves_takes_its_scrape_series_along() {
        let answering = PodId(metrics_pod().await);
        let refusing = PodId(
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("port"),
        );
        let endpoint = |pod: PodId| Arc::new(EndpointState::new(Endpoint::new(pod)));
        let FastScrapes {
            mut manager,
            registry,
            cancel,
            ..
        } = fast_scrapes(ScrapeConfig::default());
        // The endpoints named by each scrape series.
        let series = || crate::telemetry::series_with_label(&registry, "endpoint");
        let (a, b) = (answering.to_string(), refusing.to_string());
        let both = [
            ("kvpick_scrape_duration_seconds".to_owned(), a.clone()),
            ("kvpick_scrape_duration_seconds".to_owned(), b.clone()),
            ("kvpick_scrape_errors_total".to_owned(), b.clone()),
        ];
        manager.sync(&[endpoint(answering), endpoint(refusing)]);
        tokio::time::timeout(Duration::from_secs(10), async {
            while !both.iter().all(|s| series().contains(s)) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("both pods scraped, one failing");
        manager.sync(&[endpoint(answering)]);
        let named = series();
        assert!(named.contains(&both[0]), "the staying pod keeps its series");
        assert!(
            !named.iter().any(|(_, endpoint)| *endpoint == b),
            "the leaving pod's series went: {named:?}"
        );
        manager.sync(&[]);
        // A few intervals: a task finishing its last scrape brings nothing back.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(series(), Default::default());
        cancel.cancel();
    }

    #[test]
    fn the_store_publishes_snapshots_only_into_the_live_registration() {
        let store = MetricsStore::default();
        let pod = PodId("10.0.0.1:8000".parse().expect("addr"));
        let scraped = |waiting: f64| ScrapeStatus {
            metrics: Some(Arc::new(PodMetrics {
                waiting,
                ..PodMetrics::default()
            })),
            fetched_at: Some(Instant::now()),
            ..ScrapeStatus::default()
        };
        let waiting = |status: &ScrapeStatus| status.metrics.as_ref().map(|m| m.waiting);
        let first = store.register(pod);
        store.publish(pod, first, scraped(1.0));
        let held = store.status(pod);
        store.publish(pod, first, scraped(2.0));
        // A reader's snapshot does not change under it; the next read sees the new one.
        assert_eq!(waiting(&held), Some(1.0));
        assert_eq!(waiting(&store.status(pod)), Some(2.0));
        assert_eq!(waiting(&store.statuses(&[pod, pod])[1]), Some(2.0));
        // The pod leaves: a last scrape of its task does not bring the entry back.
        store.remove(pod);
        store.publish(pod, first, scraped(3.0));
        assert_eq!(waiting(&store.status(pod)), None);
        // It comes back: only the new task's scrapes land.
        let second = store.register(pod);
        store.publish(pod, first, scraped(4.0));
        assert_eq!(waiting(&store.status(pod)), None);
        store.publish(pod, second, scraped(5.0));
        assert_eq!(waiting(&store.status(pod)), Some(5.0));
    }

    #[test]
    fn a_restart_is_a_changed_start_time() {
        assert!(!restarted_between(None, Some(1.7e9)));
        assert!(!restarted_between(Some(1.7e9), None));
        assert!(!restarted_between(Some(1.7e9), Some(1.7e9 + 0.1)));
        assert!(restarted_between(Some(1.7e9), Some(1.7e9 + 60.0)));
    }

    #[test]
    fn a_pod_is_unreachable_when_refused_or_when_connecting_times_out_again() {
        let failed = |error: ScrapeError, consecutive_failures| ScrapeStatus {
            last_error: Some(error),
            consecutive_failures,
            ..ScrapeStatus::default()
        };
        let refused = ScrapeError::Connect("connection refused".into());
        assert!(failed(refused, 1).connection_failed(), "nothing listens");
        // One lost SYN (retransmitted after 1 s) times out one scrape of a healthy pod.
        assert!(!failed(ScrapeError::ConnectTimeout, 1).connection_failed());
        for after in [CONNECT_TIMEOUTS_UNREACHABLE, 5] {
            assert!(
                failed(ScrapeError::ConnectTimeout, after).connection_failed(),
                "{after} failures in a row, the last not even connecting"
            );
        }
        // Slow or broken answers come from a pod that is there.
        for error in [ScrapeError::Timeout, ScrapeError::Status(503)] {
            assert!(!failed(error, 10).connection_failed());
        }
        assert!(!ScrapeStatus::default().connection_failed());
    }

    #[test]
    fn freshness_needs_a_recent_success_and_no_error() {
        let now = Instant::now();
        let staleness = Duration::from_millis(200);
        let mut status = ScrapeStatus::default();
        assert!(!status.is_fresh(now, staleness), "never scraped");
        status.fetched_at = Some(now);
        status.metrics = Some(Arc::new(PodMetrics::default()));
        assert!(status.is_fresh(now + Duration::from_millis(150), staleness));
        assert!(!status.is_fresh(now + Duration::from_millis(250), staleness));
        status.last_error = Some(ScrapeError::Timeout);
        assert!(
            !status.is_fresh(now, staleness),
            "a failing scrape is not fresh"
        );
    }
}
