//! The OpenAI-compatible HTTP surface of one simulated pod (axum), shaped like vLLM 0.32's:
//! `/v1/completions`, `/v1/chat/completions` (SSE or not), `/v1/models`, `/health`,
//! `/tokenize`, `/metrics` (and `/metrics/?name[]=…`), `/reset_prefix_cache`, plus
//! `/admin/faults` for fault injection; `/detokenize` and the render endpoints are in
//! [`super::render`].
//!
//! Why hand-parsed JSON: every body is hostile; parsing into `serde_json::Value` and reading
//! fields explicitly lets every malformed input become a vLLM-style 400
//! (`{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`), never a panic.
//!
//! Concurrency: handlers share an `Arc<PodApi>` (immutable) and talk to the engine through
//! [`Pod`]. A streaming response is fed by one forwarding task per prompt into a bounded
//! channel; when the client goes away the body is dropped, the forwarders stop and the
//! dropped [`super::pod::TokenStream`]s abort their requests.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::engine::{Engine, SimRequest, TokenOut};
use super::pod::{MetricsFault, Pod, SubmitError};
use super::request_log::{RequestLog, RequestRecord, unix_seconds};
use super::tokenizer::{PromptError, SimTokenizer};

/// Token ids at or above this are out of the simulated model's vocabulary (Qwen-style).
pub(crate) const VOCAB: u32 = 151_680;

/// Shared state of one pod's HTTP server.
#[derive(Debug)]
pub struct PodApi {
    /// The pod.
    pub pod: Pod,
    /// The model's tokenizer.
    pub tokenizer: Arc<SimTokenizer>,
    /// The pod's index in its fleet (for the request log).
    pub index: usize,
    /// `--request-log`, when set.
    pub request_log: Option<Arc<RequestLog>>,
}

/// What the request log needs of a request until its first token.
struct Arrival {
    at: f64,
    started: std::time::Instant,
    prompt_tokens: usize,
    heads: (u64, u64),
    floor: Option<(usize, f64)>,
}

impl Arrival {
    fn record(&self, api: &PodApi, cached_tokens: usize) {
        if let Some(log) = &api.request_log {
            log.write(&RequestRecord {
                pod: api.index,
                arrived: self.at,
                first_token_s: self.started.elapsed().as_secs_f64(),
                prompt_tokens: self.prompt_tokens,
                cached_tokens,
                head: self.heads.0,
                head_long: self.heads.1,
                floor: self.floor,
            });
        }
    }
}

/// The pod's router.
pub fn router(api: Arc<PodApi>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(super::render::detokenize))
        .route(
            "/v1/completions/render",
            post(super::render::render_completion),
        )
        .route(
            "/v1/chat/completions/render",
            post(super::render::render_chat),
        )
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/metrics", get(metrics))
        .route("/metrics/", get(metrics_by_name))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/admin/faults", post(set_faults).get(get_faults))
        .with_state(api)
}

/// A vLLM-style error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }
    pub(crate) fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<PromptError> for ApiError {
    fn from(e: PromptError) -> Self {
        ApiError::bad(e.to_string())
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Admit(e) => ApiError::bad(e.to_string()),
            SubmitError::EngineGone => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "ServiceUnavailableError",
                message: e.to_string(),
                param: None,
            },
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn parse_body(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad("The request body must be a JSON object")),
        Err(e) => Err(ApiError::bad(format!("JSON decode error: {e}"))),
    }
}

async fn models(State(api): State<Arc<PodApi>>) -> Response {
    let max_len = Engine::max_request_tokens(&api.pod.engine);
    axum::Json(json!({"object": "list", "data": [{
        "id": api.pod.model, "object": "model", "created": now_secs(), "owned_by": "vllm",
        "root": api.pod.model, "parent": null, "max_model_len": max_len, "permission": [],
    }]}))
    .into_response()
}

/// `/metrics`: the whole page (vLLM's instrumentator route, which ignores any query).
async fn metrics(State(api): State<Arc<PodApi>>) -> Response {
    metrics_page(&api, &[]).await
}

/// `/metrics/`: the prometheus_client app vLLM mounts there, which answers `?name[]=…` with
/// only the named metrics (and everything without one).
async fn metrics_by_name(
    State(api): State<Arc<PodApi>>,
    Query(params): Query<Vec<(String, String)>>,
) -> Response {
    let names: Vec<&str> = params
        .iter()
        .filter(|(key, _)| key == "name[]")
        .map(|(_, name)| name.as_str())
        .collect();
    metrics_page(&api, &names).await
}

async fn metrics_page(api: &PodApi, names: &[&str]) -> Response {
    match api.pod.faults.metrics() {
        MetricsFault::Ok => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            super::metrics::render_named(&api.pod.registry, names),
        )
            .into_response(),
        MetricsFault::Error => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        MetricsFault::Stall => std::future::pending().await,
    }
}

async fn reset_prefix_cache(State(api): State<Arc<PodApi>>) -> Response {
    if api.pod.reset_prefix_cache().await {
        StatusCode::OK.into_response()
    } else {
        ApiError::bad("Failed to reset prefix cache: requests are running").into_response()
    }
}

fn fault_state(api: &PodApi) -> Value {
    json!({
        "slowdown": api.pod.faults.slowdown(),
        "refuse": api.pod.faults.refusing(),
        "metrics": match api.pod.faults.metrics() {
            MetricsFault::Ok => "ok", MetricsFault::Stall => "stall", MetricsFault::Error => "error",
        },
        "events_published": api.pod.publisher.as_ref().map(|p| p.published()),
    })
}

async fn get_faults(State(api): State<Arc<PodApi>>) -> Response {
    axum::Json(fault_state(&api)).into_response()
}

/// `POST /admin/faults` with any of `drop_fraction`, `slowdown`, `refuse`,
/// `metrics` ("ok"|"stall"|"error"), `restart` (bool), `reset_prefix_cache` (bool).
async fn set_faults(State(api): State<Arc<PodApi>>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    if let Some(f) = body.get("drop_fraction") {
        let f = f
            .as_f64()
            .ok_or_else(|| ApiError::bad("drop_fraction must be a number"))?;
        if let Some(p) = &api.pod.publisher {
            p.set_drop_fraction(f).await;
        }
    }
    if let Some(f) = body.get("slowdown") {
        let f = f
            .as_f64()
            .ok_or_else(|| ApiError::bad("slowdown must be a number"))?;
        api.pod.faults.set_slowdown(f);
    }
    if let Some(r) = body.get("refuse") {
        api.pod.faults.set_refuse(
            r.as_bool()
                .ok_or_else(|| ApiError::bad("refuse must be a bool"))?,
        );
    }
    if let Some(m) = body.get("metrics") {
        let fault = match m.as_str() {
            Some("ok") => MetricsFault::Ok,
            Some("stall") => MetricsFault::Stall,
            Some("error") => MetricsFault::Error,
            _ => return Err(ApiError::bad("metrics must be ok, stall or error")),
        };
        api.pod.faults.set_metrics(fault);
    }
    if body.get("restart").and_then(Value::as_bool) == Some(true) {
        api.pod.restart().await;
    }
    if body.get("reset_prefix_cache").and_then(Value::as_bool) == Some(true) {
        api.pod.reset_prefix_cache().await;
    }
    Ok(axum::Json(fault_state(&api)).into_response())
}

/// The prompts of a completion request as token ids.
fn completion_prompts(api: &PodApi, body: &Map<String, Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    let prompt = body.get("prompt").ok_or_else(|| {
        ApiError::bad("Either prompt or prompt_embeds must be provided").param("prompt")
    })?;
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let prompts = match prompt {
        Value::String(s) => vec![api.tokenizer.encode_prompt(s)?],
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::bad("prompt must not be empty").param("prompt"));
        }
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|s| api.tokenizer.encode_prompt(s.as_str().unwrap_or_default()))
            .collect::<Result<_, _>>()?,
        Value::Array(items) if items.iter().all(Value::is_number) => {
            vec![
                ids(items)
                    .ok_or_else(|| ApiError::bad("invalid token id in prompt").param("prompt"))?,
            ]
        }
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|p| p.as_array().and_then(|p| ids(p)))
            .collect::<Option<_>>()
            .ok_or_else(|| ApiError::bad("invalid token id in prompt").param("prompt"))?,
        _ => {
            return Err(
                ApiError::bad("prompt must be a string, a list of strings or token ids")
                    .param("prompt"),
            );
        }
    };
    if prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad("The prompt cannot be empty").param("prompt"));
    }
    if prompts.iter().flatten().any(|&t| t >= VOCAB) {
        return Err(ApiError::bad("Token id out of vocabulary").param("prompt"));
    }
    Ok(prompts)
}

pub(crate) struct Common {
    pub(crate) model: String,
    lora: Option<String>,
    pub(crate) stream: bool,
    include_usage: bool,
    pub(crate) max_tokens: Option<usize>,
    pub(crate) salt: Option<String>,
    session_id: Option<String>,
    full_report: bool,
    /// vLLM's `return_token_ids`: the answer carries the prompt's and the output's ids.
    return_token_ids: bool,
}

fn common(api: &PodApi, body: &Map<String, Value>, chat: bool) -> Result<Common, ApiError> {
    if api.pod.faults.refusing() {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message: "The server is not accepting requests".into(),
            param: None,
        });
    }
    let model = match body.get("model") {
        None | Some(Value::Null) => api.pod.model.clone(),
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(ApiError::bad("model must be a string").param("model")),
    };
    let lora = if model == api.pod.model {
        None
    } else if api.pod.engine.max_loras > 0 {
        Some(model.clone())
    } else {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
        });
    };
    let flag = |key: &str| -> Result<bool, ApiError> {
        match body.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::bad(format!("{key} must be a boolean"))),
        }
    };
    let stream = flag("stream")?;
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => o
            .get("include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        Some(_) => return Err(ApiError::bad("stream_options must be an object")),
    };
    let keys: &[&str] = if chat {
        &["max_completion_tokens", "max_tokens"]
    } else {
        &["max_tokens"]
    };
    let mut max_tokens = None;
    for key in keys {
        match body.get(*key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = v
                    .as_u64()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| ApiError::bad(format!("{key} must be at least 1")))?;
                max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
                break;
            }
        }
    }
    if body
        .get("n")
        .and_then(Value::as_u64)
        .is_some_and(|n| n != 1)
    {
        return Err(ApiError::bad("the simulator supports n = 1 only").param("n"));
    }
    let opt_str = |key: &str| -> Result<Option<String>, ApiError> {
        match body.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::bad(format!("{key} must be a string"))),
        }
    };
    let salt = opt_str("cache_salt")?;
    if salt.as_deref() == Some("") {
        return Err(ApiError::bad(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
        ));
    }
    let full_report = body
        .get("vllm_xargs")
        .and_then(|x| x.get("kv_cache_report_mode"))
        .and_then(Value::as_str)
        == Some("full");
    Ok(Common {
        model,
        lora,
        stream,
        include_usage,
        max_tokens,
        salt,
        session_id: opt_str("session_id")?,
        full_report,
        return_token_ids: flag("return_token_ids")?,
    })
}

/// A request body as the generation endpoint and its render both read it: the parsed body,
/// its common fields, the prompts' token ids, and the output length (as asked, else vLLM's
/// default: 16 for completions, the room left in the context for chat).
pub(crate) struct ReadRequest {
    pub(crate) body: Map<String, Value>,
    pub(crate) common: Common,
    pub(crate) prompts: Vec<Vec<u32>>,
    pub(crate) max_tokens: usize,
}

/// Reads a `/v1/completions` body (one or more prompts).
pub(crate) fn read_completion(api: &PodApi, body: &Bytes) -> Result<ReadRequest, ApiError> {
    let body = parse_body(body)?;
    let common = common(api, &body, false)?;
    let prompts = completion_prompts(api, &body)?;
    let max_tokens = common.max_tokens.unwrap_or(16);
    Ok(ReadRequest {
        body,
        common,
        prompts,
        max_tokens,
    })
}

/// Reads a `/v1/chat/completions` body (one templated prompt).
pub(crate) fn read_chat(api: &PodApi, body: &Bytes) -> Result<ReadRequest, ApiError> {
    let body = parse_body(body)?;
    let common = common(api, &body, true)?;
    let ids = chat_ids(api, &body, true)?;
    let room = Engine::max_request_tokens(&api.pod.engine)
        .saturating_sub(ids.len())
        .max(1);
    let max_tokens = common.max_tokens.unwrap_or(room);
    Ok(ReadRequest {
        body,
        common,
        prompts: vec![ids],
        max_tokens,
    })
}

async fn completions(State(api): State<Arc<PodApi>>, body: Bytes) -> Result<Response, ApiError> {
    let read = read_completion(&api, &body)?;
    run(api, read.common, read.prompts, read.max_tokens, false).await
}

async fn chat_completions(
    State(api): State<Arc<PodApi>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let read = read_chat(&api, &body)?;
    run(api, read.common, read.prompts, read.max_tokens, true).await
}

/// `tool_choice_applies` is false for `/tokenize`, which has no `tool_choice` and always passes
/// the tools to the template (as vLLM's does).
fn chat_ids(
    api: &PodApi,
    body: &Map<String, Value>,
    tool_choice_applies: bool,
) -> Result<Vec<u32>, ApiError> {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::bad("messages must be a non-empty list").param("messages"))?;
    let tools = body.get("tools").filter(|t| !t.is_null());
    let has_tools = tools
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    let choice = body.get("tool_choice").filter(|c| !c.is_null());
    // vLLM without a tool parser: tools need an explicit non-"auto" tool_choice.
    if tool_choice_applies && has_tools && choice.is_none_or(|c| c.as_str() == Some("auto")) {
        return Err(ApiError::bad(
            "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
        ));
    }
    let add_generation_prompt = body
        .get("add_generation_prompt")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let continue_final = body
        .get("continue_final_message")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let kwargs = body.get("chat_template_kwargs").and_then(Value::as_object);
    Ok(api.tokenizer.encode_chat(
        messages,
        add_generation_prompt,
        continue_final,
        tools,
        kwargs,
    )?)
}

async fn tokenize(State(api): State<Arc<PodApi>>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_body(&body)?;
    let ids = if body.contains_key("messages") {
        chat_ids(&api, &body, false)?
    } else {
        match body.get("prompt") {
            Some(Value::String(s)) => api.tokenizer.encode_prompt(s)?,
            _ => {
                return Err(
                    ApiError::bad("body.prompt: Input should be a valid string").param("prompt")
                );
            }
        }
    };
    Ok(axum::Json(json!({
        "count": ids.len(), "max_model_len": Engine::max_request_tokens(&api.pod.engine),
        "tokens": ids, "token_strs": null,
    }))
    .into_response())
}

struct Usage {
    prompt: usize,
    completion: usize,
    cached: usize,
}

impl Usage {
    fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "total_tokens": self.prompt + self.completion,
            "completion_tokens": self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

async fn run(
    api: Arc<PodApi>,
    c: Common,
    prompts: Vec<Vec<u32>>,
    max_tokens: usize,
    chat: bool,
) -> Result<Response, ApiError> {
    let n = prompts.len();
    let (tx, mut rx) = mpsc::channel::<(usize, TokenOut)>(256);
    let mut prompt_lens = Vec::with_capacity(n);
    // Kept only when the answer must carry them (`return_token_ids`).
    let mut prompt_ids: Vec<Vec<u32>> = Vec::new();
    // The first choice's prompt (the simulator serves n = 1) for the request log.
    let arrival = api
        .request_log
        .as_ref()
        .zip(prompts.first())
        .map(|(log, p)| Arrival {
            at: unix_seconds(),
            started: std::time::Instant::now(),
            prompt_tokens: p.len(),
            heads: RequestRecord::heads(p),
            floor: log.arrive(p),
        });
    for (index, prompt) in prompts.into_iter().enumerate() {
        prompt_lens.push(prompt.len());
        if c.return_token_ids {
            prompt_ids.push(prompt.clone());
        }
        let mut stream = api
            .pod
            .submit(SimRequest {
                prompt,
                max_tokens,
                cache_salt: c.salt.clone(),
                lora: c.lora.clone(),
                session_id: c.session_id.clone(),
                full_report: c.full_report,
            })
            .await?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(token) = stream.next().await {
                let done = token.finish.is_some();
                if tx.send((index, token)).await.is_err() || done {
                    break;
                }
            }
        });
    }
    drop(tx);
    let id = format!(
        "{}-{:016x}{:016x}",
        if chat { "chatcmpl" } else { "cmpl" },
        fastrand::u64(..),
        fastrand::u64(..)
    );
    let created = now_secs();
    if !c.stream {
        let mut texts: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut finish: Vec<Option<&str>> = vec![None; n];
        let mut cached = 0;
        while let Some((i, t)) = rx.recv().await {
            if t.index == 0 {
                cached += t.cached_tokens;
                if let (0, Some(a)) = (i, &arrival) {
                    a.record(&api, t.cached_tokens);
                }
            }
            if let Some(ids) = texts.get_mut(i) {
                ids.push(t.token);
            }
            if t.finish.is_some()
                && let Some(f) = finish.get_mut(i)
            {
                *f = Some("length");
            }
        }
        if finish.iter().any(Option::is_none) {
            return Err(ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: "InternalServerError",
                message: "the request was aborted (engine restarted)".into(),
                param: None,
            });
        }
        let usage = Usage {
            prompt: prompt_lens.iter().sum(),
            completion: texts.iter().map(Vec::len).sum(),
            cached,
        };
        let choices: Vec<Value> = texts
            .iter()
            .enumerate()
            .map(|(i, ids)| {
                let text = api.tokenizer.decode(ids);
                // vLLM 0.32 puts a completion's prompt ids on its choice, a chat's at the top.
                let out_ids = c.return_token_ids.then(|| ids.clone());
                if chat {
                    json!({"index": i, "message": {"role": "assistant", "content": text,
                        "refusal": null, "annotations": null, "audio": null, "function_call": null,
                        "tool_calls": [], "reasoning": null}, "logprobs": null,
                        "finish_reason": "length", "stop_reason": null, "token_ids": out_ids})
                } else {
                    json!({"index": i, "text": text, "logprobs": null, "finish_reason": "length",
                        "stop_reason": null, "token_ids": out_ids, "prompt_logprobs": null,
                        "prompt_token_ids": prompt_ids.get(i)})
                }
            })
            .collect();
        let object = if chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let mut answer = json!({
            "id": id, "object": object, "created": created, "model": c.model,
            "choices": choices, "usage": usage.json(),
        });
        if chat && let Some(obj) = answer.as_object_mut() {
            obj.insert("prompt_token_ids".into(), json!(prompt_ids.first()));
        }
        return Ok(axum::Json(answer).into_response());
    }

    let (body_tx, body_rx) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    tokio::spawn(async move {
        let frame = |v: Value| Ok(Bytes::from(format!("data: {v}\n\n")));
        if chat {
            for i in 0..n {
                let chunk = json!({"id": id, "object": object, "created": created, "model": c.model,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null}]});
                if body_tx.send(frame(chunk)).await.is_err() {
                    return;
                }
            }
        }
        let mut usage = Usage {
            prompt: prompt_lens.iter().sum(),
            completion: 0,
            cached: 0,
        };
        while let Some((i, t)) = rx.recv().await {
            usage.completion += 1;
            if t.index == 0 {
                usage.cached += t.cached_tokens;
                if let (0, Some(a)) = (i, &arrival) {
                    a.record(&api, t.cached_tokens);
                }
            }
            let text = api.tokenizer.decode(&[t.token]);
            let finish = t.finish.map(|_| "length");
            let choice = if chat {
                json!({"index": i, "delta": {"content": text}, "logprobs": null,
                    "finish_reason": finish, "stop_reason": null})
            } else {
                json!({"index": i, "text": text, "logprobs": null, "finish_reason": finish,
                    "stop_reason": null})
            };
            let chunk = json!({"id": id, "object": object, "created": created,
                "model": c.model, "choices": [choice]});
            if body_tx.send(frame(chunk)).await.is_err() {
                return;
            }
        }
        if c.include_usage {
            let chunk = json!({"id": id, "object": object, "created": created,
                "model": c.model, "choices": [], "usage": usage.json()});
            if body_tx.send(frame(chunk)).await.is_err() {
                return;
            }
        }
        let _ = body_tx
            .send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
            .await;
    });
    Ok((
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        Body::from_stream(ReceiverStream::new(body_rx)),
    )
        .into_response())
}
