//! The CPU-heavy part of a request: parse the body, apply a model rewrite, tokenize, and key
//! the prompt's blocks for the prefix index (so the decision does not hash a long prompt).
//!
//! Runs on the blocking pool (a cold 400 KB chat prompt costs tens of milliseconds), never on
//! the task that drives the gRPC stream.

use std::sync::Arc;

use bytes::Bytes;

use super::meta::RequestMeta;
use crate::kvcache::{KeyChain, KeyContext};
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
    /// How the prefix index keys this request.
    pub key_context: KeyContext,
    /// The prompt as the model server will tokenize it.
    pub prompt: PromptTokens,
    /// The prompt's block keys, when a block size was asked for and the prompt is exact.
    pub block_keys: Option<Arc<KeyChain>>,
    /// Whether the client asked for an SSE stream.
    pub stream: bool,
}

/// Parses `body` (sent to `meta.path`), rewrites its model if asked (the
/// `x-gateway-model-name-rewrite` header, else the first matching rule), tokenizes it, and
/// keys its blocks at `key_block_size` when given.
pub fn prepare(
    tokenizers: &Tokenizers,
    rules: &ModelRewriteRules,
    meta: &RequestMeta,
    body: &[u8],
    key_block_size: Option<u32>,
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
    let block_keys = match (&prompt, key_block_size) {
        (PromptTokens::Exact(tokens), Some(size)) => {
            let mut chain = KeyChain::new(key_context.seed(), size);
            chain.extend_to(tokens, usize::MAX);
            Some(Arc::new(chain))
        }
        _ => None,
    };
    Ok(Prepared {
        client_model,
        target_model,
        rewritten_body,
        key_context,
        prompt,
        block_keys,
        stream: parsed.stream,
    })
}
