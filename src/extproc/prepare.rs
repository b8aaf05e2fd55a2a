//! The CPU-heavy part of a request: parse the body, apply a model rewrite, tokenize (the
//! caller then lets the scheduler key what it will need of the prompt on the same thread,
//! `Scheduler::warm_keys`, so the decision does not hash a long prompt).
//!
//! Runs on the blocking pool (a cold 400 KB chat prompt costs tens of milliseconds), never on
//! the task that drives the gRPC stream.

use bytes::Bytes;

use super::meta::RequestMeta;
use crate::kvcache::{KeyContext, PromptKeys};
use crate::request::{self, ModelRewriteRules, RequestError};
use crate::tokenize::Tokenizers;

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
}

/// Parses `body` (sent to `meta.path`), rewrites its model if asked (the
/// `x-gateway-model-name-rewrite` header, else the first matching rule), and tokenizes it.
pub fn prepare(
    tokenizers: &Tokenizers,
    rules: &ModelRewriteRules,
    meta: &RequestMeta,
    body: &[u8],
) -> Result<Prepared, RequestError> {
    let path = meta.path.split('?').next().unwrap_or_default();
    let mut parsed = request::parse_cached(path, body, tokenizers.long_strings())?;
    let client_model = parsed.model.clone();
    let target = meta
        .model_rewrite
        .as_deref()
        .or_else(|| rules.pick_random(&client_model));
    let rewritten_body = match target {
        Some(target) if target != client_model => {
            let rewritten = request::rewrite_model(body, target)?;
            parsed.model = target.to_owned();
            Some(rewritten)
        }
        _ => None,
    };
    let target_model = parsed.model.clone();
    let prompt = tokenizers.prompt_tokens(&parsed);
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
    })
}
