//! vLLM's preprocessing endpoints, the ones routers call to tokenize a request exactly as the
//! engine will before they route it: `POST /v1/completions/render`,
//! `POST /v1/chat/completions/render` and `POST /detokenize` (`/tokenize` is in [`super::http`]).
//!
//! Why: `vllm-router`'s `kv_aware` policy (0.1.17) calls render, then `/tokenize`, on every
//! request; llm-d's precise prefix scorer moved from a tokenizer sidecar to render as well. A
//! simulator answering 404 there makes those peers look broken when real vLLM is not.
//!
//! Shapes, from vllm-project/vllm `tests/entrypoints/scale_out/render/test_render.py` and the
//! `GenerateRequest` it checks (token-in/token-out protocol):
//! - completions render answers a JSON **list**, one `GenerateRequest` per prompt, each
//!   `{request_id: "cmpl-…", token_ids, sampling_params, model, stream, stream_options,
//!   cache_salt, priority, kv_transfer_params, token_offsets: null}`;
//! - chat render answers **one** `GenerateRequest` (`request_id` `chatcmpl-…`);
//! - an unknown model is 404 with an `error` object; stream fields are echoed, the answer is
//!   still plain JSON; sampling fields the client set (`temperature`, `top_p`, …) come back in
//!   `sampling_params`, `max_tokens` resolved to the engine's default.
//! - `/detokenize` takes `{model, tokens: [ids]}` and answers `{prompt: text}`
//!   (vLLM's `DetokenizeRequest` / `DetokenizeResponse`).
//!
//! Render never reaches the engine: no KV blocks, no events, no metrics, as in vLLM.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::http::{ApiError, Common, PodApi, VOCAB, parse_body, read_chat, read_completion};

/// Sampling fields echoed into `sampling_params` when the request sets them.
const ECHOED_SAMPLING: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "min_tokens",
];

fn generate_request(
    prefix: &str,
    c: &Common,
    body: &Map<String, Value>,
    token_ids: Vec<u32>,
    max_tokens: usize,
) -> Value {
    let mut sampling = Map::new();
    sampling.insert("max_tokens".into(), json!(max_tokens));
    for key in ECHOED_SAMPLING {
        if let Some(v) = body.get(*key).filter(|v| !v.is_null()) {
            sampling.insert((*key).into(), v.clone());
        }
    }
    json!({
        "request_id": format!("{prefix}-{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..)),
        "token_ids": token_ids,
        "features": null,
        "sampling_params": sampling,
        "model": c.model,
        "stream": c.stream,
        "stream_options": body.get("stream_options").cloned().unwrap_or(Value::Null),
        "cache_salt": c.salt,
        "priority": body.get("priority").and_then(Value::as_i64).unwrap_or(0),
        "kv_transfer_params": body.get("kv_transfer_params").cloned().unwrap_or(Value::Null),
        "token_offsets": null,
    })
}

/// `POST /v1/completions/render`: one `GenerateRequest` per prompt.
pub async fn render_completion(
    State(api): State<Arc<PodApi>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let read = read_completion(&api, &body)?;
    let out: Vec<Value> = read
        .prompts
        .into_iter()
        .map(|ids| generate_request("cmpl", &read.common, &read.body, ids, read.max_tokens))
        .collect();
    Ok(axum::Json(Value::Array(out)).into_response())
}

/// `POST /v1/chat/completions/render`: the templated conversation as one `GenerateRequest`.
pub async fn render_chat(
    State(api): State<Arc<PodApi>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut read = read_chat(&api, &body)?;
    let ids = read.prompts.pop().unwrap_or_default();
    let request = generate_request("chatcmpl", &read.common, &read.body, ids, read.max_tokens);
    Ok(axum::Json(request).into_response())
}

/// `POST /detokenize`: `{tokens}` → `{prompt}`.
pub async fn detokenize(State(api): State<Arc<PodApi>>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let tokens = body
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            ApiError::bad("body.tokens: Input should be a valid list").param("tokens")
        })?;
    let mut ids = Vec::with_capacity(tokens.len());
    for t in tokens {
        let id = t
            .as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| ApiError::bad("body.tokens: Input should be a valid integer"))?;
        if id >= VOCAB {
            return Err(ApiError::bad(format!("Token id {id} is out of vocabulary")));
        }
        ids.push(id);
    }
    Ok(axum::Json(json!({"prompt": api.tokenizer.decode(&ids)})).into_response())
}
