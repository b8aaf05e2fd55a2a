//! Follows every endpoint's scrape and KV-event state and marks it down or up
//! ([`crate::endpoints::liveness`] has the rule).
//!
//! One task, on the scrape interval: a verdict is at most one scrape plus one tick old, so a
//! killed engine stops getting picks within ~2 scrape intervals. Each transition is logged
//! with the pod and the cause, counted in `kvpick_endpoint_down_total`, and mirrored in the
//! `kvpick_endpoint_down` gauge. An endpoint that left the pool loses its per-endpoint series
//! here (down gauge and transitions, prompt and cached tokens); the scrape series go with its
//! scrape task (`scrape::scraper`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::endpoints::Datastore;
use crate::endpoints::liveness::{Signals, judge};
use crate::kvevents::KvEventsManager;
use crate::scrape::MetricsStore;
use crate::telemetry::EppMetrics;

/// What the tracker reads and writes.
pub struct LivenessInputs {
    /// The pool (each endpoint carries its verdict).
    pub datastore: Arc<Datastore>,
    /// The scrapes.
    pub scrapes: Arc<MetricsStore>,
    /// The KV-event streams (only their `connected` flag is read).
    pub kv_events: Arc<KvEventsManager>,
    /// Where transitions are counted.
    pub metrics: Arc<EppMetrics>,
}

/// Re-judges every endpoint each `interval` until `cancel`.
pub async fn track_liveness(inputs: LivenessInputs, interval: Duration, cancel: CancellationToken) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut exported: HashSet<String> = HashSet::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        exported = judge_pool(&inputs, &exported);
    }
}

/// One pass over the pool; returns the endpoints whose gauge is exported now.
fn judge_pool(inputs: &LivenessInputs, exported: &HashSet<String>) -> HashSet<String> {
    let pool = inputs.datastore.snapshot();
    let mut now_exported = HashSet::with_capacity(pool.endpoints.len());
    for endpoint in &pool.endpoints {
        let id = endpoint.id();
        let scrape = inputs.scrapes.status(id);
        let signals = Signals {
            scrape_connection_error: scrape
                .connection_failed()
                .then(|| scrape.last_error.as_ref().map(|e| e.to_string()))
                .flatten(),
            kv_events_configured: endpoint.endpoint.kv_events.is_some(),
            kv_events_connected: inputs
                .kv_events
                .status(id)
                .is_some_and(|status| status.connected),
            was_down: endpoint.liveness.is_down(),
        };
        let verdict = judge(&signals);
        let label = id.to_string();
        let down = verdict.is_some();
        if endpoint.liveness.set(verdict.clone()) {
            match &verdict {
                Some(reason) => {
                    tracing::warn!(pod = %id, %reason, "endpoint down: left out of the candidates until it answers");
                    inputs
                        .metrics
                        .endpoint_down_total
                        .with_label_values(&[&label])
                        .inc();
                }
                None => tracing::info!(pod = %id, "endpoint up again: back among the candidates"),
            }
        }
        inputs
            .metrics
            .endpoint_down
            .with_label_values(&[&label])
            .set(i64::from(down));
        now_exported.insert(label);
    }
    // Endpoints that left the pool: their series go too (with pods replaced on every
    // rollout, they would pile up for the life of the process).
    for gone in exported.difference(&now_exported) {
        let metrics = &inputs.metrics;
        for series in [
            &metrics.endpoint_down_total,
            &metrics.prompt_tokens,
            &metrics.cached_prompt_tokens,
        ] {
            let _ = series.remove_label_values(&[gone]);
        }
        let _ = metrics.endpoint_down.remove_label_values(&[gone]);
    }
    now_exported
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;

    use super::*;
    use crate::endpoints::{Endpoint, PodId};
    use crate::kvcache::{IndexConfig, PrefixIndex};

    #[tokio::test]
    async fn an_endpoint_that_leaves_takes_its_series_along() {
        let registry = Registry::new();
        let metrics = Arc::new(EppMetrics::new(&registry).expect("metrics"));
        let index =
            Arc::new(PrefixIndex::with_registry(IndexConfig::default(), &registry).expect("index"));
        let inputs = LivenessInputs {
            datastore: Arc::new(Datastore::new()),
            scrapes: Arc::default(),
            kv_events: Arc::new(
                KvEventsManager::new(index, Default::default(), &registry).expect("manager"),
            ),
            metrics: Arc::clone(&metrics),
        };
        let (stays, leaves): (PodId, PodId) = (
            PodId("10.0.0.1:8000".parse().expect("addr")),
            PodId("10.0.0.2:8000".parse().expect("addr")),
        );
        inputs
            .datastore
            .set_endpoints(vec![Endpoint::new(stays), Endpoint::new(leaves)]);
        // What responses and a down transition leave behind for each.
        for pod in [stays, leaves] {
            let label = pod.to_string();
            metrics.prompt_tokens.with_label_values(&[&label]).inc_by(7);
            metrics
                .cached_prompt_tokens
                .with_label_values(&[&label])
                .inc_by(5);
            metrics
                .endpoint_down_total
                .with_label_values(&[&label])
                .inc();
        }
        let endpoints = || crate::telemetry::series_with_label(&registry, "endpoint");
        let exported = judge_pool(&inputs, &HashSet::new());
        assert_eq!(
            endpoints()
                .iter()
                .filter(|(_, e)| *e == leaves.to_string())
                .count(),
            4,
            "down gauge, down transitions, prompt and cached tokens: {:?}",
            endpoints()
        );
        inputs.datastore.set_endpoints(vec![Endpoint::new(stays)]);
        judge_pool(&inputs, &exported);
        let named = endpoints();
        assert!(
            !named.iter().any(|(_, e)| *e == leaves.to_string()),
            "{named:?}"
        );
        assert_eq!(
            named
                .iter()
                .filter(|(_, e)| *e == stays.to_string())
                .count(),
            4,
            "{named:?}"
        );
    }
}
