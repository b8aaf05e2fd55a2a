//! The CPU-heavy part of a request: parse the body, apply a model rewrite, tokenize (the
//! caller then lets the scheduler key what it will need of the prompt on the same thread,
//! `Scheduler::warm_keys`, so the decision does not hash a long prompt).
//!
//! Runs on the blocking pool (a cold 400 KB chat prompt costs tens of milliseconds), never on
//! the task that drives the gRPC stream.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::meta::RequestMeta;
use crate::kvcache::{KeyContext, PromptKeys};
use crate::request::{self, ModelRewriteRules, RequestError};
use crate::tokenize::{PromptTokens, Tokenizers};

/// A request ready for scheduling.
#[derive(Debug)]
pub struct Prepared {
    /// `model` as the client sent it.
    pub client_model: String,
    /// The model the pods serve the request as (after any rewrite).
    pub target_model: String,
    /// The body to forward when it differs from what the client sent.
    pub rewritten_body: Option<Bytes>,
    /// The prompt as the model server will tokenize it, and how the prefix index keys it.
    pub prompt: PromptKeys,
    /// Whether the client asked for an SSE stream.
    pub stream: bool,
    /// How long each step took.
    pub times: PrepareTimes,
}

/// Time spent per step of [`prepare`] (for `kvpick_request_stage_seconds`).
#[derive(Debug, Default, Clone, Copy)]
pub struct PrepareTimes {
    /// Parsing the body.
    pub parse: Duration,
    /// Rewriting its model name (zero when not rewritten).
    pub rewrite: Option<Duration>,
    /// Rendering the chat template.
    pub render: Duration,
    /// Tokenizing, rendering excluded.
    pub tokenize: Duration,
}

/// Parses `body` (sent to `meta.path`), rewrites its model if asked (the
/// `x-gateway-model-name-rewrite` header, else the first matching rule), and tokenizes it
/// when `tokenize` (the scheduler reads the prompt: `Scheduler::needs_prompt`).
///
/// NOTE: without `tokenize` the body is still parsed: the model name labels the metrics,
/// drives rewrites and the LoRA filter/scorer, `stream` arms the TTFT timing, and a body
/// that is not a valid request must keep getting its 400. Only the chat-template render and
/// the tokenization (most of a long prompt's cost) are skipped; the prompt is then `Empty`,
/// which no remaining scorer or filter reads.
pub fn prepare(
    tokenizers: &Tokenizers,
    rules: &ModelRewriteRules,
    meta: &RequestMeta,
    body: &[u8],
    tokenize: bool,
) -> Result<Prepared, RequestError> {
    let mut times = PrepareTimes::default();
    let started = Instant::now();
    let path = meta.path.split('?').next().unwrap_or_default();
    let mut parsed = request::parse_cached(path, body, tokenizers.long_strings())?;
    times.parse = started.elapsed();
    let client_model = parsed.model.clone();
    let target = meta
        .model_rewrite
        .as_deref()
        .or_else(|| rules.pick_random(&client_model));
    let rewritten_body = match target {
        Some(target) if target != client_model => {
            let started = Instant::now();
            let rewritten = request::rewrite_model(body, target)?;
            parsed.model = target.to_owned();
            times.rewrite = Some(started.elapsed());
            Some(rewritten)
        }
        _ => None,
    };
    let target_model = parsed.model.clone();
    let started = Instant::now();
    let (prompt, render) = if tokenize {
        tokenizers.prompt_tokens_timed(&parsed)
    } else {
        (PromptTokens::Empty, Duration::ZERO)
    };
    times.render = render;
    times.tokenize = started.elapsed().saturating_sub(render);
    // Pods announce blocks under the base model's name (their KV-event topic) and name the
    // adapter in `lora_name`, so an adapter request is keyed as base model + adapter.
    let key_context = match tokenizers.lora_base(&target_model) {
        Some(base) => KeyContext {
            model: base,
            lora_name: Some(target_model.clone()),
            cache_salt: parsed.cache_salt.clone(),
        },
        None => KeyContext {
            model: target_model.clone(),
            lora_name: None,
            cache_salt: parsed.cache_salt.clone(),
        },
    };
    Ok(Prepared {
        client_model,
        target_model,
        rewritten_body,
        prompt: PromptKeys::new(prompt, Some(key_context)),
        stream: parsed.stream,
        times,
    })
}
