//! The discovery task: watches the InferencePool and the Pods its selector matches, and
//! publishes the endpoint set into the [`Datastore`] the same way the pool file does.
//!
//! Concurrency rules: one task owns both watch streams and all state (the pool spec, the
//! pods, the last published set); nothing else touches them, so there are no locks. It is
//! a supervised subsystem (`src/app/subsystems.rs`): it stops when its cancellation token
//! fires (the streams are dropped with it, closing their HTTP requests), and a run that
//! panics is restarted, which re-lists everything. The only outputs are
//! [`Datastore::set_endpoints`] and the [`Readiness`] watch channel that `serve` reads.
//!
//! Watching uses kube-runtime's `watcher` (it re-lists on 410 Gone and resumes from the last
//! resourceVersion after a dropped connection). Beyond it there is one periodic thing: while
//! a watch is failing, a cheap list (limit 1) probes the API, because the watcher yields
//! nothing when it re-establishes a watch, so without the probe kvpick could not tell that
//! the API is back and would stay not ready.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::watch as channel;
use tokio_util::sync::CancellationToken;

use super::metrics::DiscoveryMetrics;
use super::pod_endpoints;
use super::pool_spec::{PoolGroup, PoolSpec, parse_spec};
use super::status::{PoolPhase, Readiness, Status};
use super::{DiscoveryTarget, KubeDiscoveryConfig};
use crate::endpoints::{Datastore, Endpoint, PodId};

/// Everything one run of the discovery task needs (shared by all runs).
pub struct DiscoveryParts {
    /// What to watch.
    pub config: KubeDiscoveryConfig,
    /// The API client (from the kubeconfig or the in-cluster service account).
    pub client: Client,
    /// Where endpoint sets go.
    pub datastore: Arc<Datastore>,
    /// Discovery's metrics.
    pub metrics: DiscoveryMetrics,
    /// Where readiness goes.
    pub readiness: channel::Sender<Readiness>,
}

pub(super) type WatchStream<K> = BoxStream<'static, Result<Event<K>, watcher::Error>>;

/// How often readiness (staleness) is re-checked and, while failing, the API probed.
pub(super) fn tick_interval(stale_after: Duration) -> Duration {
    (stale_after / 4).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Longest a probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The watcher's retry backoff: 500 ms doubling to 5 s, with jitter.
///
/// NOTE: shorter than kube's default (800 ms to 30 s): one kvpick runs two watches, so it is
/// gentle on the API server either way, and a pool whose watch stays in a 30 s backoff after
/// the API came back would miss pod deletions for that long. A failing initial list retries
/// at the minimum: the watcher yields `Init` (an `Ok`, which resets any backoff) before each
/// list attempt.
struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const MIN: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(5);

    fn new() -> Self {
        Self { next: Self::MIN }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (now * 2).min(Self::MAX);
        // ±25 % jitter so restarted replicas do not retry in step.
        let jitter = 0.75 + fastrand::f64() / 2.0;
        Some(now.mul_f64(jitter))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

fn pool_resource(group: PoolGroup) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(group.group(), group.version(), "InferencePool"),
        "inferencepools",
    )
}

/// A watcher with discovery's backoff.
pub(super) fn watch<K>(api: Api<K>, config: watcher::Config) -> WatchStream<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher::watcher(api, config)
        .backoff(WatchBackoff::new())
        .boxed()
}

/// The next item of an optional stream; pending forever without one.
pub(super) async fn next_of<T>(stream: &mut Option<BoxStream<'static, T>>) -> Option<T> {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

/// One run's state.
struct Run<'a> {
    parts: &'a DiscoveryParts,
    status: Status,
    /// The last valid spec (kept over an invalid edit).
    spec: Option<PoolSpec>,
    /// Pods the current pod watch holds, by name.
    pods: BTreeMap<String, Pod>,
    /// Pods of a list in progress (between Init and InitDone).
    listing: Option<BTreeMap<String, Pod>>,
    /// The selector the pod watch runs with.
    watching: Option<String>,
    /// The pool object of a list in progress (`Some(None)`: none listed yet).
    listing_pool: Option<Option<DynamicObject>>,
    /// The last published set, by id.
    published: Option<HashMap<PodId, Endpoint>>,
    /// Problems already logged (so a pod's bad annotation is logged once, not per event).
    logged: std::collections::HashSet<(String, &'static str, String)>,
    /// The pod watch was restarted for an edited selector and has not listed yet.
    new_selector: bool,
    /// An edited selector matched no ready pod: the last set is kept until one matches.
    holding_last: bool,
}

/// Runs discovery until `cancel`.
pub async fn run_discovery(parts: Arc<DiscoveryParts>, cancel: CancellationToken) {
    let config = &parts.config;
    let namespace = config.namespace.as_str();
    let mut status = Status::new(
        config.stale_after,
        parts.readiness.clone(),
        parts.metrics.clone(),
    );
    let (mut pool_stream, pool_api, spec) = match &config.target {
        DiscoveryTarget::Pool { name, group } => {
            let api: Api<DynamicObject> =
                Api::namespaced_with(parts.client.clone(), namespace, &pool_resource(*group));
            let fields = format!("metadata.name={name}");
            let stream = watch(api.clone(), watcher::Config::default().fields(&fields));
            (Some(stream), Some((api, fields, *group)), None)
        }
        DiscoveryTarget::Selector(spec) => {
            status.pool = PoolPhase::Valid;
            (None, None, Some(spec.clone()))
        }
    };
    let pod_api: Api<Pod> = Api::namespaced(parts.client.clone(), namespace);
    let mut run = Run {
        parts: &parts,
        status,
        spec,
        pods: BTreeMap::new(),
        listing: None,
        listing_pool: None,
        watching: None,
        published: None,
        logged: Default::default(),
        new_selector: false,
        holding_last: false,
    };
    let mut pod_stream: Option<WatchStream<Pod>> = None;
    run.restart_pod_watch(&pod_api, &mut pod_stream);
    // The probe runs beside the watches (never blocking their events) while they fail.
    let mut probe: Option<BoxStream<'static, bool>> = None;
    let mut tick = tokio::time::interval(tick_interval(config.stale_after));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            event = next_of(&mut pool_stream) => {
                let Some(event) = event else {
                    // The watcher never ends by itself; start a fresh one if it does.
                    pool_stream = pool_api.as_ref().map(|(api, fields, _)| {
                        watch(api.clone(), watcher::Config::default().fields(fields))
                    });
                    continue;
                };
                let group = pool_api.as_ref().map_or(PoolGroup::V1, |(_, _, g)| *g);
                if run.on_pool_event(group, event) {
                    run.restart_pod_watch(&pod_api, &mut pod_stream);
                }
            }
            event = next_of(&mut pod_stream) => match event {
                Some(event) => run.on_pod_event(event),
                None => {
                    run.watching = None;
                    run.restart_pod_watch(&pod_api, &mut pod_stream);
                }
            },
            answered = next_of(&mut probe) => {
                probe = None;
                if answered == Some(true) && run.status.failing() {
                    tracing::info!("Kubernetes API answers again");
                    run.status.api_answered();
                }
            }
            _ = tick.tick() => {
                if run.status.failing() && probe.is_none() {
                    let pool = pool_api.as_ref().map(|(api, fields, _)| (api.clone(), fields.clone()));
                    let selector = run.watching.clone().unwrap_or_default();
                    probe = Some(futures::stream::once(probe_api(pool, pod_api.clone(), selector)).boxed());
                }
            }
        }
        run.status.evaluate();
    }
}

impl Run<'_> {
    /// Handles a pool watch event; true when the selector changed (the pod watch restarts).
    fn on_pool_event(
        &mut self,
        group: PoolGroup,
        event: Result<Event<DynamicObject>, watcher::Error>,
    ) -> bool {
        let metrics = &self.parts.metrics;
        let object = match event {
            Err(error) => {
                if self.status.watch_failed() {
                    tracing::warn!(%error, "InferencePool watch failed; retrying (further failures at debug until the API answers)");
                } else {
                    tracing::debug!(%error, "InferencePool watch failed again");
                }
                metrics
                    .watch_errors
                    .with_label_values(&["inferencepool"])
                    .inc();
                return false;
            }
            Ok(Event::Init) => {
                // NOTE: not an answer from the API: the watcher yields Init before it lists.
                metrics.relists.with_label_values(&["inferencepool"]).inc();
                // Until InitDone the pool is as last seen; InitDone without an InitApply
                // means it is gone.
                self.listing_pool = Some(None);
                return false;
            }
            Ok(Event::InitApply(object)) => {
                self.status.api_answered();
                self.listing_pool = Some(Some(object));
                return false;
            }
            Ok(Event::InitDone) => {
                self.status.api_answered();
                self.listing_pool.take().flatten()
            }
            Ok(Event::Apply(object)) => {
                self.status.api_answered();
                Some(object)
            }
            Ok(Event::Delete(_)) => {
                self.status.api_answered();
                None
            }
        };
        let name = self.pool_name();
        let Some(object) = object else {
            if self.status.pool != PoolPhase::Absent {
                tracing::warn!(pool = %name, "InferencePool not found; keeping the last endpoints, readiness off");
            }
            self.status.pool = PoolPhase::Absent;
            return false;
        };
        match parse_spec(group, &object.data) {
            Ok(spec) => {
                self.status.pool = PoolPhase::Valid;
                let selector_changed = self
                    .spec
                    .as_ref()
                    .is_none_or(|old| old.selector != spec.selector);
                let changed = self.spec.as_ref() != Some(&spec);
                if changed {
                    tracing::info!(pool = %name, selector = %spec.label_selector(), ports = ?spec.target_ports, "InferencePool spec applied");
                }
                self.spec = Some(spec);
                if changed && !selector_changed {
                    // Same pods, new ports: re-evaluate every pod now.
                    self.publish();
                }
                selector_changed
            }
            Err(error) => {
                tracing::error!(pool = %name, field = error.field, reason = %error.reason, "invalid InferencePool; keeping the last good spec");
                metrics
                    .invalid
                    .with_label_values(&["InferencePool", error.field])
                    .inc();
                if self.spec.is_none() {
                    self.status.pool = PoolPhase::Invalid;
                }
                false
            }
        }
    }
}

impl Run<'_> {
    fn pool_name(&self) -> String {
        match &self.parts.config.target {
            DiscoveryTarget::Pool { name, .. } => format!("{}/{name}", self.parts.config.namespace),
            DiscoveryTarget::Selector(_) => "(--endpoint-selector)".to_owned(),
        }
    }

    /// Starts a pod watch for the current spec's selector if it is not the one running.
    fn restart_pod_watch(&mut self, api: &Api<Pod>, stream: &mut Option<WatchStream<Pod>>) {
        let Some(spec) = &self.spec else { return };
        let selector = spec.label_selector();
        if self.watching.as_deref() == Some(selector.as_str()) {
            return;
        }
        // The new watch lists every pod of the new selector (Init … InitDone) and the set is
        // published at InitDone; until then the last published set stays.
        *stream = Some(watch(
            api.clone(),
            watcher::Config::default().labels(&selector),
        ));
        // A restart after the stream ended (`watching` cleared) is not a selector edit.
        self.new_selector = self.watching.is_some();
        self.holding_last = false;
        self.watching = Some(selector);
        self.listing = None;
    }

    fn on_pod_event(&mut self, event: Result<Event<Pod>, watcher::Error>) {
        let metrics = &self.parts.metrics;
        let key = |pod: &Pod| pod.metadata.name.clone().unwrap_or_default();
        match event {
            Err(error) => {
                if self.status.watch_failed() {
                    tracing::warn!(%error, "Pod watch failed; retrying (further failures at debug until the API answers)");
                } else {
                    tracing::debug!(%error, "Pod watch failed again");
                }
                metrics.watch_errors.with_label_values(&["pod"]).inc();
                return;
            }
            Ok(Event::Init) => {
                // NOTE: not an answer from the API: the watcher yields Init before it lists.
                metrics.relists.with_label_values(&["pod"]).inc();
                self.listing = Some(BTreeMap::new());
                return;
            }
            Ok(Event::InitApply(pod)) => {
                self.status.api_answered();
                if let Some(listing) = &mut self.listing {
                    insert_bounded(listing, key(&pod), pod, metrics);
                }
                return;
            }
            Ok(Event::InitDone) => {
                self.status.api_answered();
                self.pods = self.listing.take().unwrap_or_default();
                self.status.pods_synced = true;
                self.holding_last |= std::mem::take(&mut self.new_selector);
            }
            Ok(Event::Apply(pod)) => {
                self.status.api_answered();
                insert_bounded(&mut self.pods, key(&pod), pod, metrics);
            }
            Ok(Event::Delete(pod)) => {
                self.status.api_answered();
                self.pods.remove(&key(&pod));
            }
        }
        if self.status.pods_synced {
            self.publish();
        }
    }

    /// Builds the endpoint set from the spec and the pods and publishes it if it changed.
    fn publish(&mut self) {
        let (Some(spec), true) = (&self.spec, self.status.pods_synced) else {
            return;
        };
        let metrics = &self.parts.metrics;
        let previous = self.published.take().unwrap_or_default();
        let built = pod_endpoints::build(spec, &self.pods, self.parts.config.kv_ports, &previous);
        for problem in &built.problems {
            let key = (problem.pod.clone(), problem.field, problem.reason.clone());
            if self.logged.insert(key) {
                tracing::warn!(pod = %problem.pod, field = problem.field, reason = %problem.reason, "unusable pod field");
                metrics
                    .invalid
                    .with_label_values(&["Pod", problem.field])
                    .inc();
            }
        }
        // Forget logged problems of pods that are gone, so the set stays bounded.
        let selector_key = selector_problem(spec);
        self.logged.retain(|key| {
            key == &selector_key
                || key
                    .0
                    .rsplit_once('/')
                    .is_some_and(|(_, name)| self.pods.contains_key(name))
        });
        metrics
            .pods
            .set(i64::try_from(self.pods.len()).unwrap_or(i64::MAX));
        let unchanged = previous.len() == built.endpoints.len()
            && built
                .endpoints
                .iter()
                .all(|e| previous.get(&e.id) == Some(e));
        let first = !self.parts.datastore.is_synced();
        if self.holding_last && built.endpoints.is_empty() && !previous.is_empty() {
            // NOTE: a selector edit that matches nothing is far more often a typo or a
            // rollout whose new pods are not ready yet than a wish to stop serving, so the
            // last endpoints stay (their liveness still comes from scrapes and KV events)
            // until a pod matches. Pods of an unchanged selector leaving still empty the pool.
            if !self.logged.contains(&selector_key) {
                tracing::warn!(pool = %self.pool_name(), field = "spec.selector", selector = %spec.label_selector(), kept = previous.len(), "the pool's edited selector matches no ready pod; keeping the last endpoints until one does");
                metrics
                    .invalid
                    .with_label_values(&["InferencePool", "spec.selector"])
                    .inc();
                self.logged.insert(selector_key);
            }
            self.published = Some(previous);
            return;
        }
        self.holding_last = false;
        if built.endpoints.is_empty() && (!previous.is_empty() || first) {
            tracing::warn!(pool = %self.pool_name(), field = "spec.selector", selector = %spec.label_selector(), pods = self.pods.len(), "no ready pod matches the pool's selector");
        }
        if !unchanged || first {
            tracing::info!(pool = %self.pool_name(), endpoints = built.endpoints.len(), "endpoints from Kubernetes");
            metrics
                .endpoints
                .set(i64::try_from(built.endpoints.len()).unwrap_or(i64::MAX));
            metrics.updates.inc();
            self.parts.datastore.set_endpoints(built.endpoints.clone());
        }
        self.published = Some(built.endpoints.into_iter().map(|e| (e.id, e)).collect());
    }
}

/// The `logged` key of "this selector matches no ready pod" (logged once per selector).
fn selector_problem(spec: &PoolSpec) -> (String, &'static str, String) {
    (String::new(), "spec.selector", spec.label_selector())
}

/// Most pods one pool holds; more are left out (logged, counted), so a selector that
/// matches a whole large namespace cannot grow kvpick's memory without bound.
const MAX_PODS: usize = 10_000;

fn insert_bounded(
    pods: &mut BTreeMap<String, Pod>,
    key: String,
    pod: Pod,
    metrics: &DiscoveryMetrics,
) {
    if pods.len() >= MAX_PODS && !pods.contains_key(&key) {
        tracing::warn!(pod = %key, limit = MAX_PODS, "pool has too many pods; leaving this one out");
        metrics
            .invalid
            .with_label_values(&["Pod", "pool size"])
            .inc();
        return;
    }
    pods.insert(key, pod);
}

/// One cheap list (limit 1) of what the watches watch: whether the API answers again.
async fn probe_api(
    pool: Option<(Api<DynamicObject>, String)>,
    pods: Api<Pod>,
    selector: String,
) -> bool {
    match pool {
        Some((api, fields)) => answers(&api, &ListParams::default().fields(&fields)).await,
        None => answers(&pods, &ListParams::default().labels(&selector)).await,
    }
}

/// Whether a list of `api` with `params` (limited to one object) succeeds within
/// [`PROBE_TIMEOUT`]: the probe of a failing watch (see the module docs).
pub(super) async fn answers<K>(api: &Api<K>, params: &ListParams) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    // NOTE: kube's client retries 429/503 itself; the timeout bounds the whole attempt.
    let params = params.clone().limit(1);
    tokio::time::timeout(PROBE_TIMEOUT, api.list(&params))
        .await
        .is_ok_and(|r| r.is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pod_map_is_bounded_and_updates_still_apply_at_the_bound() {
        let metrics = DiscoveryMetrics::new(&prometheus::Registry::new()).expect("metrics");
        let mut pods = BTreeMap::new();
        for i in 0..=MAX_PODS {
            insert_bounded(&mut pods, format!("pod-{i}"), Pod::default(), &metrics);
        }
        assert_eq!(pods.len(), MAX_PODS);
        assert_eq!(
            metrics
                .invalid
                .with_label_values(&["Pod", "pool size"])
                .get(),
            1
        );
        let mut updated = Pod::default();
        updated.metadata.name = Some("pod-0".to_owned());
        insert_bounded(&mut pods, "pod-0".to_owned(), updated, &metrics);
        assert_eq!(pods["pod-0"].metadata.name.as_deref(), Some("pod-0"));
        assert_eq!(
            metrics
                .invalid
                .with_label_values(&["Pod", "pool size"])
                .get(),
            1
        );
    }

    #[test]
    fn the_backoff_grows_to_its_cap_and_resets() {
        use kube::runtime::utils::Backoff;
        let mut backoff = WatchBackoff::new();
        let delays: Vec<Duration> = (&mut backoff).take(8).collect();
        assert!(delays[0] <= WatchBackoff::MIN.mul_f64(1.25));
        assert!(delays.iter().all(|d| *d <= WatchBackoff::MAX.mul_f64(1.25)));
        assert!(delays[7] >= WatchBackoff::MAX.mul_f64(0.75));
        backoff.reset();
        assert!(
            backoff
                .next()
                .is_some_and(|d| d <= WatchBackoff::MIN.mul_f64(1.25))
        );
    }
}
