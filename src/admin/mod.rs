//! The admin HTTP servers: Prometheus `/metrics` on the metrics port, and the JSON
//! `/debug/*` views (handlers in [`super::debug`]) on the debug port.
//!
//! NOTE: the debug views are on their own listener, bound to loopback by default
//! (`--debug-bind-address`), because `POST /debug/prefix` tells its caller whether any
//! prompt (another tenant's too) is cached: on the metrics port, which Prometheus must reach
//! over the network, it was a cross-tenant oracle. Both routers take the optional bearer
//! token (`--metrics-bearer-token-file`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus::{Encoder, Registry, TextEncoder};
use std::time::Duration;

pub mod auth;
pub mod debug;

use crate::endpoints::Datastore;
use crate::kvcache::PrefixIndex;
use crate::kvevents::KvEventsManager;
use crate::scrape::MetricsStore;
use crate::telemetry::EppMetrics;
use crate::tokenize::Tokenizers;
use auth::{AuthState, require};

/// What the admin server reads.
#[derive(Clone)]
pub struct AdminState {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// The pool.
    pub datastore: Arc<Datastore>,
    /// EPP metrics refreshed from the pool at scrape time.
    pub metrics: Arc<EppMetrics>,
    /// KV-event streams and index sizes per pod.
    pub kv_events: Arc<KvEventsManager>,
    /// The prefix index.
    pub index: Arc<PrefixIndex>,
    /// Tokenizers (for `/debug/prefix` on request bodies).
    pub tokenizers: Arc<Tokenizers>,
    /// Scraped pod metrics.
    pub scrapes: Arc<MetricsStore>,
    /// Metrics older than this are stale.
    pub staleness: Duration,
    /// The pool's name (the `name` label of pool metrics).
    pub pool_name: String,
    /// Model rewrite rules (so `/debug/prefix` keys a request as routing does).
    pub model_rewrites: crate::live::Live<crate::request::ModelRewriteRules>,
    /// The scheduler (for `/debug/explain`).
    pub scheduler: Arc<crate::scheduling::ConfiguredScheduler>,
    /// Shedding and flow control (queue gauges).
    pub admission: Arc<crate::extproc::admission::Admission>,
}

/// The metrics port's router: `/metrics` only.
pub fn metrics_router(state: AdminState, auth: AuthState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(auth, require))
}

/// The debug port's router: the `/debug/*` views.
pub fn debug_router(state: AdminState, auth: AuthState) -> Router {
    Router::new()
        .route("/debug/pods", get(debug::pods))
        .route("/debug/prefix", post(debug::prefix))
        .route("/debug/explain", post(debug::explain))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(auth, require))
}

async fn metrics(State(state): State<AdminState>) -> Response {
    // Gauges that mirror the pool are set here rather than on every request: a scrape is
    // rare, requests are not.
    let pool = state.datastore.snapshot();
    let now = std::time::Instant::now();
    let fresh: Vec<_> = pool
        .endpoints
        .iter()
        .filter_map(|e| {
            let status = state.scrapes.status(e.id());
            if status.is_fresh(now, state.staleness) {
                status.metrics.clone()
            } else {
                None
            }
        })
        .collect();
    let name = [state.pool_name.as_str()];
    state
        .metrics
        .ready_pods
        .with_label_values(&name)
        .set(fresh.len() as i64);
    if !fresh.is_empty() {
        let n = fresh.len() as f64;
        let kv = fresh.iter().map(|m| m.kv_usage).sum::<f64>() / n;
        let queue = fresh.iter().map(|m| m.waiting).sum::<f64>() / n;
        state
            .metrics
            .pool_average_kv
            .with_label_values(&name)
            .set(kv);
        state
            .metrics
            .pool_average_queue
            .with_label_values(&name)
            .set(queue);
    }
    // Picks whose observing stream went to another replica stop counting here once they
    // lapse, whether or not a pick came since.
    let lapsed = state.datastore.pending().sweep(std::time::Instant::now());
    state.metrics.count_reservations("lapsed", lapsed);
    state.metrics.in_flight.reset();
    for endpoint in &pool.endpoints {
        state
            .metrics
            .in_flight
            .with_label_values(&[&endpoint.id().to_string()])
            .set(endpoint.in_flight.get() as i64);
    }
    let mut text = Vec::new();
    let families = crate::telemetry::llmd::with_llmd_names(state.registry.gather());
    match TextEncoder::new().encode(&families, &mut text) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {error}"),
        )
            .into_response(),
    }
}
