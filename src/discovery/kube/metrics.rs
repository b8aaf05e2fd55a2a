//! Prometheus metrics of Kubernetes discovery (`kvpick_discovery_*`); every label value comes
//! from a fixed set, so hostile objects cannot grow `/metrics`.

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Discovery's metrics; registers itself into the registry handed to `new`.
#[derive(Clone)]
pub struct DiscoveryMetrics {
    /// 1 while discovery is ready (pool and pods synced, watches not stale).
    pub ready: IntGauge,
    /// Transitions to not ready, by reason (`pool_not_found`, `pool_invalid`, `stale`, …).
    pub not_ready: IntCounterVec,
    /// Errors yielded by the watches, by resource (`inferencepool`, `pod`).
    pub watch_errors: IntCounterVec,
    /// Full (re-)lists begun, by resource: the first and each after a 410 Gone or restart.
    pub relists: IntCounterVec,
    /// Objects or fields rejected, by kind and field (`InferencePool`/`spec.targetPorts`, …).
    pub invalid: IntCounterVec,
    /// Endpoint sets published into the datastore.
    pub updates: prometheus::IntCounter,
    /// Endpoints in the last published set.
    pub endpoints: IntGauge,
    /// Pods the watch holds (matching the selector, ready or not).
    pub pods: IntGauge,
    /// 1 while a policy resource (by resource and group) is not served: CRD not installed
    /// (404) or not granted (403).
    pub crd_missing: IntGaugeVec,
    /// Valid InferenceObjectives / InferenceModelRewrites naming the pool, by kind.
    pub policy_objects: IntGaugeVec,
}

impl DiscoveryMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let ready = IntGauge::new(
            "kvpick_discovery_ready",
            "1 while Kubernetes discovery is synced and its watches are not stale",
        )?;
        let counter =
            |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntCounterVec> {
                let metric = IntCounterVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(metric.clone()))?;
                Ok(metric)
            };
        let not_ready = counter(
            "kvpick_discovery_not_ready_total",
            "Times Kubernetes discovery turned not ready, by reason",
            &["reason"],
        )?;
        let watch_errors = counter(
            "kvpick_discovery_watch_errors_total",
            "Errors of the InferencePool and Pod watches (each retried with backoff)",
            &["resource"],
        )?;
        let relists = counter(
            "kvpick_discovery_relists_total",
            "Full lists begun by the watches (at start and after 410 Gone)",
            &["resource"],
        )?;
        let invalid = counter(
            "kvpick_discovery_invalid_total",
            "Kubernetes objects or fields rejected (the last good state is kept), by kind and field",
            &["kind", "field"],
        )?;
        let updates = prometheus::IntCounter::new(
            "kvpick_discovery_updates_total",
            "Endpoint sets published from Kubernetes discovery",
        )?;
        let endpoints = IntGauge::new(
            "kvpick_discovery_endpoints",
            "Endpoints (ready pod × target port) in the last published set",
        )?;
        let pods = IntGauge::new(
            "kvpick_discovery_pods",
            "Pods matching the selector that the watch holds, ready or not",
        )?;
        let crd_missing = IntGaugeVec::new(
            Opts::new(
                "kvpick_discovery_crd_missing",
                "1 while an InferenceObjective/InferenceModelRewrite resource is not served (CRD not installed, or RBAC)",
            ),
            &["resource", "group"],
        )?;
        let policy_objects = IntGaugeVec::new(
            Opts::new(
                "kvpick_discovery_policy_objects",
                "Valid InferenceObjectives and InferenceModelRewrites naming the pool, by kind",
            ),
            &["kind"],
        )?;
        registry.register(Box::new(crd_missing.clone()))?;
        registry.register(Box::new(policy_objects.clone()))?;
        for gauge in [&ready, &endpoints, &pods] {
            registry.register(Box::new(gauge.clone()))?;
        }
        registry.register(Box::new(updates.clone()))?;
        Ok(Self {
            ready,
            not_ready,
            watch_errors,
            relists,
            invalid,
            updates,
            endpoints,
            pods,
            crd_missing,
            policy_objects,
        })
    }
}
