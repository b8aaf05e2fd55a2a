//! The JSON debug views on the admin port (DESIGN §2.1): `GET /debug/pods`,
//! `POST /debug/prefix` and `POST /debug/explain`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::AdminState;
use crate::endpoints::{PodId, live_candidates};
use crate::extproc::meta::RequestMeta;
use crate::extproc::prepare::{Prepared, prepare};
use crate::kvcache::{DebugPrefixPod, KeyContext};
use crate::kvevents::KvEventsStatus;
use crate::scheduling::SchedulingRequest;
use crate::tokenize::PromptTokens;

/// A pod's last scraped load, as `/debug/pods` shows it.
#[derive(Debug, Serialize)]
pub struct PodLoadView {
    /// Requests waiting in the engine.
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV-cache usage 0..1.
    pub kv_usage: f64,
    /// Age of the last good scrape, milliseconds.
    pub age_ms: Option<u64>,
    /// The last scrape's error, if it failed.
    pub error: Option<String>,
    /// Which page is scraped: `by_name` (only the metrics kvpick reads) or `whole`.
    pub page: &'static str,
}

/// One pod in `GET /debug/pods`.
#[derive(Debug, Serialize)]
pub struct PodView {
    /// `ip:port`.
    pub address: String,
    /// Whether the pod's metrics are fresh (a stale or failing pod counts as saturated) and
    /// it is not down.
    pub ready: bool,
    /// Whether the pod is down: its scrape is refused and its KV-event stream is gone, so it
    /// is left out of the candidates until it answers.
    pub down: bool,
    /// Why it is down.
    pub down_reason: Option<String>,
    /// (block, tier) entries the prefix index holds for the pod.
    pub index_blocks: usize,
    /// Its KV-event stream, when it has one.
    pub kv_events: Option<KvEventsStatus>,
    /// Its last scraped load (`null` before the first scrape).
    pub metrics: Option<PodLoadView>,
    /// kvpick's in-flight count for it.
    pub in_flight: u64,
    /// Its prefill backlog and the timing kvpick has learned of it (what the placement
    /// scorer predicts with).
    pub timing: crate::endpoints::PrefillView,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
}

/// The body of `GET /debug/pods`.
#[derive(Debug, Serialize)]
pub struct PodsView {
    /// Every pod of the pool.
    pub pods: Vec<PodView>,
}

/// `GET /debug/pods`.
pub async fn pods(State(state): State<AdminState>) -> axum::Json<PodsView> {
    let pool = state.datastore.snapshot();
    let now = Instant::now();
    let pods = pool
        .endpoints
        .iter()
        .map(|endpoint| {
            let id = endpoint.id();
            let index = state.kv_events.pod_status(id);
            let scrape = state.scrapes.status(id);
            let metrics = scrape.metrics.as_ref().map(|m| PodLoadView {
                waiting: m.waiting,
                running: m.running,
                kv_usage: m.kv_usage,
                age_ms: scrape
                    .age(now)
                    .map(|a| u64::try_from(a.as_millis()).unwrap_or(u64::MAX)),
                error: scrape.last_error.as_ref().map(|e| e.to_string()),
                page: if scrape.by_name { "by_name" } else { "whole" },
            });
            let down = endpoint.liveness.is_down();
            PodView {
                address: id.to_string(),
                ready: scrape.is_fresh(now, state.staleness) && !down,
                down,
                down_reason: endpoint.liveness.reason(),
                index_blocks: index.index_blocks,
                kv_events: index.kv_events,
                metrics,
                in_flight: endpoint.in_flight.get(),
                timing: endpoint.prefill.view(std::time::Instant::now()),
                labels: endpoint.endpoint.labels.clone(),
            }
        })
        .collect();
    axum::Json(PodsView { pods })
}

/// Parses and tokenizes a request body exactly as the ext-proc path does.
async fn prepare_request(
    state: &AdminState,
    path: Option<String>,
    body: Bytes,
) -> Result<Prepared, Response> {
    let tokenizers = Arc::clone(&state.tokenizers);
    let rules = state.model_rewrites.load();
    let meta = RequestMeta {
        path: path.unwrap_or_default(),
        ..RequestMeta::default()
    };
    let permit = state.tokenizers.gate().enter(body.len()).await;
    let work = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        // The debug views show the tokens whatever the profile reads.
        prepare(&tokenizers, &rules, &meta, &body, true)
    });
    match work.await {
        Ok(Ok(prepared)) => Ok(prepared),
        Ok(Err(error)) => {
            Err((StatusCode::BAD_REQUEST, format!("inference error: {error}")).into_response())
        }
        Err(_) => Err((StatusCode::INTERNAL_SERVER_ERROR, "tokenization failed").into_response()),
    }
}

/// Query of `POST /debug/explain`.
#[derive(Debug, Deserialize)]
pub struct ExplainQuery {
    /// The API path the body is for (default: guessed from the body's shape).
    #[serde(default)]
    path: Option<String>,
    /// Priority to explain the request at (default 0).
    #[serde(default)]
    priority: Option<i32>,
}

/// `POST /debug/explain` with a request body: every candidate's per-scorer scores, the
/// filters that removed pods, and the pick. Records nothing.
pub async fn explain(
    State(state): State<AdminState>,
    Query(query): Query<ExplainQuery>,
    body: Bytes,
) -> Response {
    let body_bytes = body.len();
    let prepared = match prepare_request(&state, query.path, body).await {
        Ok(prepared) => prepared,
        Err(response) => return response,
    };
    let request = SchedulingRequest {
        model: Some(prepared.client_model),
        target_model: Some(prepared.target_model),
        prompt: Arc::new(prepared.prompt),
        body_bytes,
        priority: query.priority.unwrap_or(0),
        ..SchedulingRequest::default()
    };
    // The same candidates as the ext-proc path: down pods are left out.
    let candidates = live_candidates(&state.datastore.snapshot().endpoints);
    axum::Json(state.scheduler.explain(&request, &candidates)).into_response()
}

/// Query of `POST /debug/prefix`.
#[derive(Debug, Deserialize)]
pub struct PrefixQuery {
    /// `1` adds the computed token ids to the answer.
    #[serde(default)]
    tokens: Option<u8>,
    /// The API path the body is for (default: guessed from the body's shape).
    #[serde(default)]
    path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenIdsBody {
    model: String,
    token_ids: Vec<u32>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// The body of `POST /debug/prefix`.
#[derive(Debug, Serialize)]
pub struct PrefixView {
    /// Tokens in the request (0 when only approximate text is known).
    pub token_count: usize,
    /// Whether the prompt could not be tokenized exactly (no tokenizer for the model).
    pub approximate: bool,
    /// Per pod: block size, matched blocks and tokens.
    pub pods: Vec<DebugPrefixPod>,
    /// The ids kvpick computed (with `?tokens=1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// `POST /debug/prefix` with an OpenAI/Anthropic body or `{"model", "token_ids"}`.
pub async fn prefix(
    State(state): State<AdminState>,
    Query(query): Query<PrefixQuery>,
    body: Bytes,
) -> Response {
    let direct: Option<TokenIdsBody> = serde_json::from_slice(&body).ok();
    let (context, prompt) = match direct {
        Some(direct) => (
            KeyContext {
                model: direct.model,
                lora_name: direct.lora_name,
                cache_salt: direct.cache_salt,
            },
            PromptTokens::Exact(direct.token_ids),
        ),
        None => match prepare_request(&state, query.path, body).await {
            Ok(prepared) => {
                // `prepare` keys every prompt in its target model's context.
                let (prompt, context) = prepared.prompt.into_parts();
                let context = context.unwrap_or_else(|| KeyContext::model(&prepared.target_model));
                (context, prompt)
            }
            Err(response) => return response,
        },
    };
    let candidates: Vec<PodId> = state
        .datastore
        .snapshot()
        .endpoints
        .iter()
        .map(|e| e.id())
        .collect();
    let view = match prompt {
        PromptTokens::Exact(ids) => {
            let found = state.index.debug_prefix(&context, &ids, &candidates);
            PrefixView {
                token_count: found.token_count,
                approximate: false,
                pods: found.pods,
                token_ids: (query.tokens == Some(1)).then_some(ids),
            }
        }
        PromptTokens::Approximate(_) | PromptTokens::Empty => PrefixView {
            token_count: 0,
            approximate: true,
            pods: Vec::new(),
            token_ids: None,
        },
    };
    axum::Json(view).into_response()
}
