//! The typed view of a request that scheduling and tokenization need. The body itself is
//! forwarded untouched; these types hold only what kvpick reads.

use serde_json::{Map, Value};

/// Which API the request uses (decided by the path, or by the body's shape for unknown paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiKind {
    /// OpenAI `/v1/completions`.
    Completions,
    /// OpenAI `/v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `/v1/responses`.
    Responses,
    /// OpenAI `/v1/embeddings`.
    Embeddings,
    /// Anthropic `/v1/messages`.
    AnthropicMessages,
    /// Any other path (the prompt was guessed from the body's shape, if any).
    Other,
}

/// A parsed inference request.
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceRequest {
    /// The API the body was parsed as.
    pub api: ApiKind,
    /// The `model` field as the client sent it (a base model or a LoRA adapter name).
    pub model: String,
    /// The prompt, in the form the model server tokenizes.
    pub prompt: Prompt,
    /// Whether the client asked for a streamed (SSE) response.
    pub stream: bool,
    /// vLLM's `cache_salt` (changes every KV block hash of the request).
    pub cache_salt: Option<String>,
    /// vLLM's request `priority` field, when present.
    pub priority: Option<i64>,
    /// Whether the server adds special tokens (BOS…) when encoding: vLLM's `add_special_tokens`
    /// (default true for completions/embeddings prompts, false for chat).
    pub add_special_tokens: bool,
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// No prompt could be found (bodyless or unknown shape): pick without a prefix.
    None,
    /// One or more text prompts (completions/embeddings). A batch is routed by its first one.
    Texts(Vec<String>),
    /// One or more pre-tokenized prompts, used by the server as given.
    TokenIds(Vec<Vec<u32>>),
    /// Chat messages, rendered through the model's chat template.
    Chat(ChatPrompt),
}

/// A chat conversation as vLLM hands it to the chat template (after its pre-template rewrites,
/// DESIGN §3.1).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatPrompt {
    /// The messages, in order.
    pub messages: Vec<ChatMessage>,
    /// Normalised tools (`{"type":"function","function":{name,description,parameters[,strict]}}`).
    pub tools: Option<Vec<Value>>,
    /// Append the assistant turn header.
    pub add_generation_prompt: bool,
    /// Cut the rendering after the last message's text (prefill continuation).
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`).
    pub chat_template_kwargs: Map<String, Value>,
    /// Anthropic `/v1/messages` only: when the template requires system-first ordering (it
    /// raises on a non-leading system message, vLLM's `_detect_merge_inline_system`), every
    /// `system` message is merged, joined with `""`, into one leading system message, as vLLM's
    /// `AnthropicServingMessages._convert_system_message` does. The template decides, so the
    /// merge happens at render time.
    pub merge_inline_system: bool,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant`, `tool` (or anything else the client sent; the
    /// template decides what is valid).
    pub role: String,
    /// The content.
    pub content: MessageContent,
    /// Optional participant name.
    pub name: Option<String>,
    /// For `tool` messages: the call being answered.
    pub tool_call_id: Option<String>,
    /// Assistant tool calls (arguments already parsed into JSON objects, as vLLM does).
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Assistant reasoning text (`reasoning_content` / `reasoning`), passed to templates using it.
    pub reasoning_content: Option<String>,
}

/// Message content as sent: absent/null, a string, or OpenAI content parts.
#[derive(Debug, Clone, PartialEq)]
pub enum MessageContent {
    /// `null` or missing.
    Null,
    /// A plain string.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart {
    /// A text part (`text`, `input_text`, `output_text`, Anthropic `text`).
    Text(String),
    /// A non-text part, by the placeholder type vLLM passes to templates (`image`, `audio`,
    /// `video`). NOTE: the server expands these into many placeholder tokens in its
    /// multimodal processor, so prompts with media are never token-exact here.
    Media(&'static str),
}

/// An assistant tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The call id.
    pub id: Option<String>,
    /// The function name.
    pub name: String,
    /// Arguments as a JSON object (a JSON-string argument is parsed; invalid → `{}`).
    pub arguments: Value,
}

impl InferenceRequest {
    /// The text of the first text prompt, if the prompt is text.
    pub fn first_text(&self) -> Option<&str> {
        match &self.prompt {
            Prompt::Texts(texts) => texts.first().map(String::as_str),
            _ => None,
        }
    }
}
