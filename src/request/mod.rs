//! Request understanding: what an OpenAI / Anthropic body asks for, as the model server will
//! see it, plus the byte-preserving model rewrite.
//!
//! - [`parse`] turns `(path, body)` into an [`InferenceRequest`] (API kind, model, prompt as text,
//!   token ids or chat messages, stream, cache_salt, priority), or a [`RequestError`] (HTTP 400).
//! - [`rewrite_model`] changes only the `model` value of a body; [`ResponseModelRewriter`] puts
//!   the client's model name back into JSON and SSE responses.
//! - [`ModelRewriteRules`] are InferenceModelRewrite-style weighted rules.
//! - `/v1/responses` and Anthropic `/v1/messages` are converted to chat messages exactly as
//!   vLLM 0.32 converts them (`responses`, `anthropic`; checked against real captures in
//!   `tests/fixtures/vllm-api-captures/`).
//!
//! Hostile input: bodies are bounded in nesting depth and array length before any tree is
//! built ([`ParseLimits`]); nothing here panics on input-derived values.
//!
//! Concurrency: everything is a pure function over its arguments except
//! [`ResponseModelRewriter`], which holds one response stream's partial line (one per stream).

mod anthropic;
mod error;
mod fields;
mod parse;
mod pyrepr;
mod responses;
mod rewrite;
mod rules;
mod scan;
mod strings;
mod types;

pub use anthropic::BILLING_HEADER;
pub use error::RequestError;
pub use parse::{api_kind_for_path, parse, parse_cached, parse_with_limits};
pub use pyrepr::python_float_repr;
pub use rewrite::{MAX_SSE_LINE_BYTES, ResponseModelRewriter, rewrite_model};
pub use rules::{
    ExactModel, MatchType, ModelMatch, ModelRewriteRule, ModelRewriteRules, RewriteTarget,
};
pub use scan::{BodyShape, ParseLimits, scan};
pub use strings::LongStringCache;
pub use types::{
    ApiKind, ChatMessage, ChatPrompt, ContentPart, InferenceRequest, MessageContent, Prompt,
    ToolCall,
};
