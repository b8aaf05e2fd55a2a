//! Tokenization exactly as the model server does it, fast.
//!
//! - [`Tokenizers`]: per-model registry of tokenizer directories (HF layout), LoRA adapters
//!   resolving to their base model, a default directory, approximate fallback;
//!   [`Tokenizers::prompt_tokens`] is the single call the request path makes.
//! - [`ChatTemplate`]: HF/vLLM-compatible Jinja rendering, including vLLM's pre-template
//!   rewrites of the request (DESIGN §3.1).
//! - [`PrefixTokenCache`]: reuses the tokens of a previously seen prefix, provably identical
//!   to full tokenization, bounded by an LRU by bytes.
//!
//! Special tokens follow vLLM: chat prompts are encoded without adding special tokens,
//! completion prompts with them (the request's `add_special_tokens` decides).

mod bounds;
mod error;
mod fast_bpe;
mod gate;
mod merge_table;
mod model;
mod prefix_cache;
mod pyjson;
mod registry;
mod template;
mod template_concat;
pub mod unicode_pretoken;
mod word_cache;

pub use bounds::MAX_PRETOKEN_BYTES;
pub use error::TokenizeError;
pub use fast_bpe::{FastEncoder, QWEN2_PATTERN, WordEncoding};
pub use gate::{
    DEFAULT_MAX_PREPARING_BYTES, PrepareGate, PreparePermit, TrimLater, release_free_memory,
};
pub use merge_table::{
    LAZY_AFTER_MISSES, LazyMerges, MAX_MERGE_BYTES, MergeTable, MergeTableError,
};
pub use model::ModelTokenizer;
pub use prefix_cache::{ANCHOR_BYTES, CachedTokens, PrefixTokenCache, WordEncoder};
pub use pyjson::{dumps as python_json_dumps, python_float_repr};
pub use registry::{
    ApproximatePrompt, ApproximateReason, DEFAULT_PREFIX_CACHE_BYTES, PromptTokens,
    TokenizeMetrics, Tokenizers, TokenizersConfig,
};
pub use template::{ChatTemplate, ContentFormat, detect_content_format, vllm_messages};
