//! The metrics/admin HTTP server: Prometheus `/metrics` and the JSON `/debug/*` views.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::{Encoder, Registry, TextEncoder};
use serde::Serialize;

use crate::endpoints::Datastore;
use crate::telemetry::EppMetrics;

/// What the admin server reads.
#[derive(Clone)]
pub struct AdminState {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// The pool.
    pub datastore: Arc<Datastore>,
    /// EPP metrics refreshed from the pool at scrape time.
    pub metrics: Arc<EppMetrics>,
}

/// The admin router.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/debug/pods", get(debug_pods))
        .with_state(state)
}

async fn metrics(State(state): State<AdminState>) -> Response {
    // Gauges that mirror the pool are set here rather than on every request: a scrape is
    // rare, requests are not.
    let pool = state.datastore.snapshot();
    state.metrics.ready_pods.set(pool.endpoints.len() as i64);
    state.metrics.in_flight.reset();
    for endpoint in &pool.endpoints {
        state
            .metrics
            .in_flight
            .with_label_values(&[&endpoint.id().to_string()])
            .set(endpoint.in_flight.get() as i64);
    }
    let mut text = Vec::new();
    match TextEncoder::new().encode(&state.registry.gather(), &mut text) {
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

/// One pod in `GET /debug/pods` (DESIGN §2.1; fields grow as subsystems land).
#[derive(Debug, Serialize)]
pub struct PodView {
    /// `ip:port`.
    pub address: String,
    /// Whether the pod is eligible for traffic.
    pub ready: bool,
    /// kvpick's in-flight count for it.
    pub in_flight: u64,
    /// Its labels.
    pub labels: std::collections::BTreeMap<String, String>,
}

/// The body of `GET /debug/pods`.
#[derive(Debug, Serialize)]
pub struct PodsView {
    /// Every pod of the pool.
    pub pods: Vec<PodView>,
}

async fn debug_pods(State(state): State<AdminState>) -> axum::Json<PodsView> {
    let pool = state.datastore.snapshot();
    let pods = pool
        .endpoints
        .iter()
        .map(|endpoint| PodView {
            address: endpoint.id().to_string(),
            ready: true,
            in_flight: endpoint.in_flight.get(),
            labels: endpoint.endpoint.labels.clone(),
        })
        .collect();
    axum::Json(PodsView { pods })
}
