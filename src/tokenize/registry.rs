//! The per-model tokenizer registry and the one call the ext-proc path makes:
//! [`Tokenizers::prompt_tokens`].
//!
//! Models map to tokenizer directories (`--tokenizer MODEL=DIR`), a default directory serves
//! every other model (`--tokenizer DIR`), and LoRA adapters resolve to their base model's
//! tokenizer. A model with no tokenizer is routed on approximate text chunks instead: logged
//! once per model, counted, never a failed request.
//!
//! Concurrency: `Tokenizers` is `Sync`; the LoRA map is a `DashMap` so adapters can be
//! registered while requests are served; each model's prefix cache has its own lock.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use super::error::TokenizeError;
use super::model::ModelTokenizer;
use super::prefix_cache::CachedTokens;
use super::template::ContentFormat;
use crate::request::{ChatPrompt, InferenceRequest, MessageContent, Prompt};

/// Default prefix-cache budget per tokenizer directory.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 256 << 20;
/// At most this many distinct model names are remembered for "logged once".
const MAX_LOGGED_MODELS: usize = 1024;
/// Bytes of a model name kept in logs and in the set of models already logged.
const LOGGED_MODEL_BYTES: usize = crate::telemetry::labels::MAX_LABEL_BYTES;

/// Where tokenizers come from.
#[derive(Debug, Clone, Default)]
pub struct TokenizersConfig {
    /// `(model name, directory)` pairs (`--tokenizer MODEL=DIR`).
    pub models: Vec<(String, PathBuf)>,
    /// The directory for every other model (`--tokenizer DIR`).
    pub default_dir: Option<PathBuf>,
    /// `(LoRA adapter name, base model name)` pairs known at start.
    pub lora_bases: Vec<(String, String)>,
    /// Prefix-cache budget per tokenizer directory (0 disables the cache).
    pub prefix_cache_bytes: usize,
    /// Overrides chat-template content-format detection (vLLM's `--chat-template-content-format`).
    pub content_format: Option<ContentFormat>,
    /// Bytes of large bodies prepared at once ([`super::PrepareGate`]; 0: no limit).
    pub max_preparing_bytes: usize,
}

impl TokenizersConfig {
    /// Adds one `--tokenizer` flag value: `MODEL=DIR` for one model, or `DIR` alone for the
    /// default. A value whose part before the first `=` is an existing directory is a `DIR`.
    pub fn add_flag(&mut self, value: &str) {
        match value.split_once('=') {
            Some((model, dir)) if !model.is_empty() && !std::path::Path::new(model).is_dir() => {
                self.models.push((model.to_owned(), PathBuf::from(dir)));
            }
            _ => self.default_dir = Some(PathBuf::from(value)),
        }
    }
}

/// A request's prompt as token ids, or approximately as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptTokens {
    /// The ids the model server will use (for a prompt with a pre-token over
    /// [`super::MAX_PRETOKEN_BYTES`], those before it: `kvpick_tokenize_cut_prompts_total`).
    Exact(Vec<u32>),
    /// No tokenizer (or template) for this model: the prompt text, for character-chunk
    /// prefix matching.
    Approximate(ApproximatePrompt),
    /// The request has no prompt.
    Empty,
}

/// Why a prompt is approximate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApproximateReason {
    /// No tokenizer is configured for the model (nor a default).
    NoTokenizer,
    /// A chat request for a tokenizer without a chat template.
    NoTemplate,
    /// The template raised (the server will answer 400 itself).
    TemplateError,
    /// The tokenizer failed to encode.
    EncodeError,
    /// A run without whitespace over [`super::MAX_PRETOKEN_BYTES`] for a tokenizer whose
    /// pre-token boundaries kvpick cannot find itself (no exact place to stop).
    PretokenTooLong,
}

impl ApproximateReason {
    fn label(self) -> &'static str {
        match self {
            Self::NoTokenizer => "no_tokenizer",
            Self::NoTemplate => "no_template",
            Self::TemplateError => "template_error",
            Self::EncodeError => "encode_error",
            Self::PretokenTooLong => "pretoken_too_long",
        }
    }
}

/// Prompt text used for approximate prefix matching.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApproximatePrompt {
    /// The prompt text (for chat, a plain `role\ncontent\n` rendering).
    pub text: String,
    /// Why it is approximate.
    pub reason: ApproximateReason,
}

impl ApproximatePrompt {
    /// Consecutive chunks of `chars_per_chunk` characters (the last partial chunk dropped, as
    /// partial KV blocks are never cached).
    pub fn chunks(&self, chars_per_chunk: usize) -> Vec<&str> {
        let mut out = Vec::new();
        if chars_per_chunk == 0 {
            return out;
        }
        let mut start = 0;
        for (n, (i, _)) in self.text.char_indices().enumerate() {
            if n > 0 && n % chars_per_chunk == 0 {
                out.extend(self.text.get(start..i));
                start = i;
            }
        }
        if self
            .text
            .get(start..)
            .is_some_and(|s| s.chars().count() == chars_per_chunk)
        {
            out.extend(self.text.get(start..));
        }
        out
    }
}

/// Tokenization metrics (`kvpick_tokenize_*`).
#[derive(Debug, Clone)]
pub struct TokenizeMetrics {
    exact: IntCounter,
    approximate: IntCounterVec,
    reused_tokens: IntCounter,
    cache_bytes: IntGauge,
    duration: Histogram,
    cut: IntCounter,
}

impl TokenizeMetrics {
    /// Creates the metrics and registers them into `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let exact = IntCounter::new(
            "kvpick_tokenize_exact_total",
            "Prompts tokenized exactly (as the model server will)",
        )?;
        let approximate = IntCounterVec::new(
            Opts::new(
                "kvpick_tokenize_approximate_total",
                "Prompts routed on approximate text chunks, by reason",
            ),
            &["reason"],
        )?;
        let reused_tokens = IntCounter::new(
            "kvpick_tokenize_prefix_cache_reused_tokens_total",
            "Prompt tokens taken from the prefix token cache instead of re-tokenizing",
        )?;
        let cache_bytes = IntGauge::new(
            "kvpick_tokenize_prefix_cache_bytes",
            "Bytes held by the prefix token cache of the last tokenizer used",
        )?;
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "kvpick_tokenize_duration_seconds",
                "Time to render and tokenize one prompt",
            )
            .buckets(vec![
                1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0,
            ]),
        )?;
        registry.register(Box::new(exact.clone()))?;
        registry.register(Box::new(approximate.clone()))?;
        registry.register(Box::new(reused_tokens.clone()))?;
        registry.register(Box::new(cache_bytes.clone()))?;
        let cut = IntCounter::new(
            "kvpick_tokenize_cut_prompts_total",
            "Prompts whose exact tokenization stopped at a pre-token over the bound \
             (keyed by the tokens before it)",
        )?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(cut.clone()))?;
        Ok(Self {
            exact,
            approximate,
            reused_tokens,
            cache_bytes,
            duration,
            cut,
        })
    }
}

/// All configured tokenizers.
#[derive(Debug)]
pub struct Tokenizers {
    by_model: HashMap<String, Arc<ModelTokenizer>>,
    default: Option<Arc<ModelTokenizer>>,
    lora_bases: DashMap<String, String>,
    metrics: TokenizeMetrics,
    logged: Mutex<HashSet<String>>,
    gate: super::PrepareGate,
    /// Long JSON strings of earlier bodies, to resume parsing from (see
    /// [`crate::request::LongStringCache`]); a quarter of the prefix-cache budget.
    long_strings: crate::request::LongStringCache,
}

impl Tokenizers {
    /// Loads every configured directory (each distinct directory once) and registers metrics.
    pub fn new(config: TokenizersConfig, registry: &Registry) -> Result<Self, TokenizeError> {
        let metrics =
            TokenizeMetrics::new(registry).map_err(|e| TokenizeError::Metrics(e.to_string()))?;
        let gate = super::PrepareGate::new(config.max_preparing_bytes, registry)
            .map_err(|e| TokenizeError::Metrics(e.to_string()))?;
        let mut loaded: HashMap<PathBuf, Arc<ModelTokenizer>> = HashMap::new();
        let mut load = |dir: &PathBuf| -> Result<Arc<ModelTokenizer>, TokenizeError> {
            let key = dir.canonicalize().unwrap_or_else(|_| dir.clone());
            if let Some(t) = loaded.get(&key) {
                return Ok(Arc::clone(t));
            }
            let t = Arc::new(ModelTokenizer::load(
                dir,
                config.prefix_cache_bytes,
                config.content_format,
            )?);
            loaded.insert(key, Arc::clone(&t));
            Ok(t)
        };
        let mut by_model = HashMap::new();
        for (model, dir) in &config.models {
            by_model.insert(model.clone(), load(dir)?);
        }
        let default = config.default_dir.as_ref().map(&mut load).transpose()?;
        // Parsing tokenizer.json leaves tens of MB of freed garbage resident.
        super::release_free_memory();
        Ok(Self {
            by_model,
            default,
            lora_bases: config.lora_bases.iter().cloned().collect(),
            metrics,
            logged: Mutex::new(HashSet::new()),
            gate,
            long_strings: crate::request::LongStringCache::new(config.prefix_cache_bytes / 4),
        })
    }

    /// The limit on bytes of bodies prepared at once: enter it before preparing a large body.
    pub fn gate(&self) -> &super::PrepareGate {
        &self.gate
    }

    /// The cache of long request strings bodies are parsed with (`request::parse_cached`).
    pub fn long_strings(&self) -> &crate::request::LongStringCache {
        &self.long_strings
    }

    /// Declares (or updates) a LoRA adapter's base model.
    pub fn register_lora(&self, adapter: &str, base_model: &str) {
        self.lora_bases
            .insert(adapter.to_owned(), base_model.to_owned());
    }

    /// The base model of a registered LoRA adapter.
    pub fn lora_base(&self, adapter: &str) -> Option<String> {
        self.lora_bases.get(adapter).map(|b| b.value().clone())
    }

    /// The tokenizer for `model`: its own, its LoRA base model's, or the default.
    pub fn tokenizer_for(&self, model: &str) -> Option<&Arc<ModelTokenizer>> {
        if let Some(t) = self.by_model.get(model) {
            return Some(t);
        }
        if let Some(base) = self.lora_bases.get(model)
            && let Some(t) = self.by_model.get(base.value())
        {
            return Some(t);
        }
        self.default.as_ref()
    }

    /// The prompt token ids the model server will compute for `req` (or an approximation).
    pub fn prompt_tokens(&self, req: &InferenceRequest) -> PromptTokens {
        self.prompt_tokens_timed(req).0
    }

    /// [`Self::prompt_tokens`], and how long of it rendering a chat template took.
    pub fn prompt_tokens_timed(&self, req: &InferenceRequest) -> (PromptTokens, Duration) {
        let started = Instant::now();
        let mut render = Duration::ZERO;
        let out = self.compute(req, &mut render);
        match &out {
            PromptTokens::Exact(_) => self.metrics.exact.inc(),
            PromptTokens::Approximate(a) => self
                .metrics
                .approximate
                .with_label_values(&[a.reason.label()])
                .inc(),
            PromptTokens::Empty => {}
        }
        self.metrics
            .duration
            .observe(started.elapsed().as_secs_f64());
        (out, render)
    }

    fn compute(&self, req: &InferenceRequest, render: &mut Duration) -> PromptTokens {
        let text = match &req.prompt {
            Prompt::None => return PromptTokens::Empty,
            Prompt::TokenIds(batches) => {
                return batches
                    .first()
                    .map_or(PromptTokens::Empty, |ids| PromptTokens::Exact(ids.clone()));
            }
            Prompt::Texts(texts) => match texts.first() {
                Some(t) => t,
                None => return PromptTokens::Empty,
            },
            Prompt::Chat(chat) => return self.chat_tokens(req, chat, render),
        };
        let Some(tok) = self.tokenizer_for(&req.model) else {
            return self.approximate(&req.model, text.clone(), ApproximateReason::NoTokenizer);
        };
        self.encode(tok, &req.model, text, req.add_special_tokens)
    }

    fn chat_tokens(
        &self,
        req: &InferenceRequest,
        chat: &ChatPrompt,
        render: &mut Duration,
    ) -> PromptTokens {
        let Some(tok) = self.tokenizer_for(&req.model) else {
            return self.approximate(
                &req.model,
                plain_chat_text(chat),
                ApproximateReason::NoTokenizer,
            );
        };
        let started = Instant::now();
        let rendered = tok.render(chat);
        *render = started.elapsed();
        match rendered {
            Ok(text) => self.encode_owned(tok, &req.model, text, req.add_special_tokens),
            Err(TokenizeError::NoTemplate) => self.approximate(
                &req.model,
                plain_chat_text(chat),
                ApproximateReason::NoTemplate,
            ),
            Err(e) => {
                tracing::debug!(model = %req.model, error = %e, "chat template failed");
                PromptTokens::Approximate(ApproximatePrompt {
                    text: plain_chat_text(chat),
                    reason: ApproximateReason::TemplateError,
                })
            }
        }
    }

    fn encode(
        &self,
        tok: &ModelTokenizer,
        model: &str,
        text: &str,
        add_special: bool,
    ) -> PromptTokens {
        match tok.encode(text, add_special) {
            Ok(cached) => self.exact(tok, model, cached),
            Err(e) => self.encode_failed(model, e, text.to_owned()),
        }
    }

    /// [`Self::encode`] for a rendered prompt, handed to the prefix cache without a copy.
    fn encode_owned(
        &self,
        tok: &ModelTokenizer,
        model: &str,
        text: String,
        add_special: bool,
    ) -> PromptTokens {
        match tok.encode_owned(text, add_special) {
            Ok(cached) => self.exact(tok, model, cached),
            Err((e, text)) => self.encode_failed(model, e, text),
        }
    }

    fn encode_failed(&self, model: &str, error: TokenizeError, text: String) -> PromptTokens {
        let model = crate::telemetry::labels::truncate(model, LOGGED_MODEL_BYTES);
        let reason = match error {
            TokenizeError::PretokenTooLong { .. } => ApproximateReason::PretokenTooLong,
            _ => ApproximateReason::EncodeError,
        };
        // NOTE: a client can send such prompts at will: log the 1st, 2nd, 4th, 8th… only
        // (the metric counts every one).
        let count = self
            .metrics
            .approximate
            .with_label_values(&[reason.label()])
            .get()
            + 1;
        if count.is_power_of_two() {
            tracing::warn!(model, error = %error, count, "tokenizer failed to encode a prompt; routing it approximately");
        }
        PromptTokens::Approximate(ApproximatePrompt { text, reason })
    }

    fn exact(&self, tok: &ModelTokenizer, model: &str, cached: CachedTokens) -> PromptTokens {
        if let Some(at) = cached.cut_at {
            self.metrics.cut.inc();
            let count = self.metrics.cut.get();
            if count.is_power_of_two() {
                let model = crate::telemetry::labels::truncate(model, LOGGED_MODEL_BYTES);
                tracing::warn!(
                    model,
                    at,
                    keyed_tokens = cached.ids.len(),
                    limit = super::MAX_PRETOKEN_BYTES,
                    count,
                    "prompt has a pre-token over the bound; keyed by the tokens before it"
                );
            }
        }
        self.metrics
            .reused_tokens
            .inc_by(cached.reused_tokens as u64);
        self.metrics
            .cache_bytes
            .set(i64::try_from(tok.cache_bytes()).unwrap_or(i64::MAX));
        PromptTokens::Exact(cached.ids)
    }

    fn approximate(&self, model: &str, text: String, reason: ApproximateReason) -> PromptTokens {
        // The model name is the client's: a 1 MB name must not become a 1 MB log line or
        // 1 MB held in `logged`.
        let model = crate::telemetry::labels::truncate(model, LOGGED_MODEL_BYTES);
        if let Ok(mut logged) = self.logged.lock()
            && logged.len() < MAX_LOGGED_MODELS
            && logged.insert(model.to_owned())
        {
            tracing::warn!(
                model,
                reason = reason.label(),
                "no exact tokenization for model; using approximate prefix matching"
            );
        }
        PromptTokens::Approximate(ApproximatePrompt { text, reason })
    }
}

/// A template-free rendering for approximate matching: `role\ncontent\n` per message.
fn plain_chat_text(chat: &ChatPrompt) -> String {
    let mut out = String::new();
    if let Some(tools) = &chat.tools {
        for t in tools {
            out.push_str(&t.to_string());
            out.push('\n');
        }
    }
    for m in &chat.messages {
        out.push_str(&m.role);
        out.push('\n');
        match &m.content {
            MessageContent::Null => {}
            MessageContent::Text(s) => out.push_str(s),
            MessageContent::Parts(parts) => {
                for p in parts {
                    if let crate::request::ContentPart::Text(t) = p {
                        out.push_str(t);
                        out.push('\n');
                    }
                }
            }
        }
        out.push('\n');
    }
    out
}
