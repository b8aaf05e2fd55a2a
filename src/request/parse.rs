//! Body → [`InferenceRequest`] for each supported API.
//!
//! The body is first bounded by [`super::scan`] (depth, array sizes), then parsed by serde_json
//! into a tree (`preserve_order`, so tool schemas keep their key order for `tojson`). Long string
//! values (the prompt text of a large body) are unescaped by the scanner on the way and only
//! put into the tree afterwards ([`super::strings`]), exactly as serde_json would have built
//! them. Unknown fields are ignored: the lead forwards the body untouched.

use serde_json::{Map, Value};

use super::anthropic::anthropic_prompt;
use super::error::RequestError;
use super::fields::{PartKind, invalid, openai_tool, opt_string, parse_arguments, part_kind};
use super::responses::responses_prompt;
use super::scan::{ParseLimits, scan_collecting};
use super::strings::{LongStringCache, parse_with_long_strings};
use super::types::{
    ApiKind, ChatMessage, ChatPrompt, ContentPart, InferenceRequest, MessageContent, Prompt,
    ToolCall,
};

/// Parses `body` sent to `path` with the default [`ParseLimits`].
pub fn parse(path: &str, body: &[u8]) -> Result<InferenceRequest, RequestError> {
    parse_with_limits(path, body, ParseLimits::default())
}

/// [`parse`], resuming long strings from ones seen in earlier bodies (`cache`): the same
/// result, less work when a body repeats an earlier one's beginning.
pub fn parse_cached(
    path: &str,
    body: &[u8],
    cache: &LongStringCache,
) -> Result<InferenceRequest, RequestError> {
    parse_impl(path, body, ParseLimits::default(), Some(cache))
}

/// Parses `body` sent to `path` (the path decides the API; unknown paths are guessed from the
/// body's shape).
pub fn parse_with_limits(
    path: &str,
    body: &[u8],
    limits: ParseLimits,
) -> Result<InferenceRequest, RequestError> {
    parse_impl(path, body, limits, None)
}

fn parse_impl(
    path: &str,
    body: &[u8],
    limits: ParseLimits,
    cache: Option<&LongStringCache>,
) -> Result<InferenceRequest, RequestError> {
    let root = parse_json(body, limits, cache)?;
    let Value::Object(mut obj) = root else {
        return Err(RequestError::NotAnObject);
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => return Err(RequestError::MissingModel),
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(_) => return Err(RequestError::InvalidModel),
    };
    let api = api_kind_for_path(path).unwrap_or(ApiKind::Other);
    let (prompt, add_special_tokens) = match api {
        ApiKind::Completions => text_prompt(&obj, "prompt")?,
        ApiKind::Embeddings => {
            if obj.contains_key("messages") {
                (Prompt::Chat(chat_prompt(&mut obj, false)?), false)
            } else {
                text_prompt(&obj, "input")?
            }
        }
        ApiKind::ChatCompletions => (Prompt::Chat(chat_prompt(&mut obj, true)?), false),
        ApiKind::Responses => (Prompt::Chat(responses_prompt(&obj)?), false),
        ApiKind::AnthropicMessages => (Prompt::Chat(anthropic_prompt(&obj)?), false),
        ApiKind::Other => guess_prompt(&mut obj)?,
    };
    let add_special_tokens = match obj.get("add_special_tokens") {
        Some(Value::Bool(b)) => *b,
        _ => add_special_tokens,
    };
    Ok(InferenceRequest {
        api,
        model,
        prompt,
        stream: matches!(obj.get("stream"), Some(Value::Bool(true))),
        cache_salt: obj
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_owned),
        priority: obj.get("priority").and_then(Value::as_i64),
        add_special_tokens,
    })
}

/// String values at least this long are unescaped outside serde_json ([`super::strings`]).
const LONG_STRING_BYTES: usize = 1024;

/// Validates UTF-8 and bounds, then builds the JSON tree.
pub(crate) fn parse_json(
    body: &[u8],
    limits: ParseLimits,
    cache: Option<&LongStringCache>,
) -> Result<Value, RequestError> {
    let text = std::str::from_utf8(body).map_err(|e| RequestError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    let mut long_strings = Vec::new();
    scan_collecting(text, limits, LONG_STRING_BYTES, &mut long_strings, cache)?;
    if !long_strings.is_empty()
        && let Some(root) = parse_with_long_strings(text, long_strings)
    {
        return Ok(root);
    }
    serde_json::from_str::<Value>(text).map_err(|e| {
        if e.classify() == serde_json::error::Category::Eof {
            RequestError::Truncated
        } else {
            RequestError::NotJson {
                detail: e.to_string(),
            }
        }
    })
}

/// The API served at `path` (query string ignored; any prefix before `/v1/` allowed).
pub fn api_kind_for_path(path: &str) -> Option<ApiKind> {
    let path = path.split('?').next().unwrap_or("").trim_end_matches('/');
    if path.ends_with("/chat/completions") {
        Some(ApiKind::ChatCompletions)
    } else if path.ends_with("/completions") {
        Some(ApiKind::Completions)
    } else if path.ends_with("/responses") {
        Some(ApiKind::Responses)
    } else if path.ends_with("/embeddings") {
        Some(ApiKind::Embeddings)
    } else if path.ends_with("/messages") {
        Some(ApiKind::AnthropicMessages)
    } else {
        None
    }
}

fn guess_prompt(obj: &mut Map<String, Value>) -> Result<(Prompt, bool), RequestError> {
    if obj.contains_key("messages") {
        if obj.contains_key("system") {
            return Ok((Prompt::Chat(anthropic_prompt(obj)?), false));
        }
        return Ok((Prompt::Chat(chat_prompt(obj, true)?), false));
    }
    if obj.contains_key("prompt") {
        return text_prompt(obj, "prompt");
    }
    if obj.contains_key("token_ids") {
        // kvpick's own `/debug/prefix` form: `{"model": m, "token_ids": [..]}`.
        return text_prompt(obj, "token_ids");
    }
    if obj.contains_key("instructions")
        || matches!(obj.get("input"), Some(Value::Array(items)) if items.first().is_some_and(Value::is_object))
    {
        return Ok((Prompt::Chat(responses_prompt(obj)?), false));
    }
    if obj.contains_key("input") {
        return text_prompt(obj, "input");
    }
    Ok((Prompt::None, true))
}

/// A completions/embeddings prompt: string, list of strings, token ids, or lists of token ids.
fn text_prompt(obj: &Map<String, Value>, field: &str) -> Result<(Prompt, bool), RequestError> {
    let prompt = match obj.get(field) {
        None | Some(Value::Null) => Prompt::None,
        Some(Value::String(s)) => Prompt::Texts(vec![s.clone()]),
        Some(Value::Array(items)) => match items.first() {
            None => Prompt::None,
            Some(Value::String(_)) => Prompt::Texts(
                items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| invalid(field, "mixed list"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Some(Value::Number(_)) => Prompt::TokenIds(vec![token_ids(items, field)?]),
            Some(Value::Array(_)) => Prompt::TokenIds(
                items
                    .iter()
                    .map(|v| match v {
                        Value::Array(ids) => token_ids(ids, field),
                        _ => Err(invalid(field, "mixed list")),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Some(_) => return Err(invalid(field, "expected a string, strings or token ids")),
        },
        Some(_) => return Err(invalid(field, "expected a string, strings or token ids")),
    };
    Ok((prompt, true))
}

fn token_ids(items: &[Value], field: &str) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| invalid(field, "token ids must be integers in 0..2^32"))
        })
        .collect()
}

fn bool_field(obj: &Map<String, Value>, key: &str, default: bool) -> bool {
    obj.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// OpenAI chat completions (also embeddings' chat form). Takes `messages` out of `obj`, so
/// their (possibly huge) text moves into the prompt instead of being copied.
fn chat_prompt(
    obj: &mut Map<String, Value>,
    default_generation_prompt: bool,
) -> Result<ChatPrompt, RequestError> {
    let Some(Value::Array(raw)) = obj.remove("messages") else {
        return Err(invalid("messages", "expected an array"));
    };
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.into_iter().enumerate() {
        messages.push(openai_message(m, i)?);
    }
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(
            tools
                .iter()
                .enumerate()
                .map(|(i, t)| openai_tool(t, i))
                .collect::<Result<_, _>>()?,
        ),
        Some(_) => return Err(invalid("tools", "expected an array")),
    };
    Ok(ChatPrompt {
        messages,
        tools,
        add_generation_prompt: bool_field(obj, "add_generation_prompt", default_generation_prompt),
        continue_final_message: bool_field(obj, "continue_final_message", false),
        chat_template_kwargs: match obj.get("chat_template_kwargs") {
            Some(Value::Object(kw)) => kw.clone(),
            _ => Map::new(),
        },
        merge_inline_system: false,
    })
}

fn openai_message(m: Value, i: usize) -> Result<ChatMessage, RequestError> {
    let Value::Object(mut m) = m else {
        return Err(invalid(format!("messages[{i}]"), "expected an object"));
    };
    let Some(role) = m.get("role").and_then(Value::as_str).map(str::to_owned) else {
        return Err(invalid(format!("messages[{i}].role"), "expected a string"));
    };
    let content = owned_content(m.remove("content"), i)?;
    let tool_calls = match m.get("tool_calls") {
        Some(Value::Array(calls)) if !calls.is_empty() => Some(
            calls
                .iter()
                .map(|c| openai_tool_call(c, i))
                .collect::<Result<_, _>>()?,
        ),
        _ => None,
    };
    Ok(ChatMessage {
        role,
        content,
        name: opt_string(&m, "name"),
        tool_call_id: opt_string(&m, "tool_call_id"),
        tool_calls,
        reasoning_content: opt_string(&m, "reasoning_content")
            .or_else(|| opt_string(&m, "reasoning")),
    })
}

/// [`content`] for an owned value: the text moves into the result instead of being copied.
fn owned_content(v: Option<Value>, i: usize) -> Result<MessageContent, RequestError> {
    match v {
        None | Some(Value::Null) => Ok(MessageContent::Null),
        Some(Value::String(s)) => Ok(MessageContent::Text(s)),
        Some(Value::Array(parts)) => Ok(MessageContent::Parts(
            parts.into_iter().filter_map(owned_content_part).collect(),
        )),
        Some(_) => Err(invalid(
            format!("messages[{i}].content"),
            "expected a string, null or content parts",
        )),
    }
}

/// [`content_part`] for an owned value (the text is moved, not copied).
fn owned_content_part(p: Value) -> Option<ContentPart> {
    match p {
        Value::String(s) => Some(ContentPart::Text(s)),
        Value::Object(mut o) => match part_kind(&o)? {
            PartKind::Text(key) => match o.remove(key) {
                Some(Value::String(t)) => Some(ContentPart::Text(t)),
                _ => None,
            },
            PartKind::Media(kind) => Some(ContentPart::Media(kind)),
        },
        _ => None,
    }
}

fn openai_tool_call(c: &Value, i: usize) -> Result<ToolCall, RequestError> {
    let field = || format!("messages[{i}].tool_calls");
    let Value::Object(c) = c else {
        return Err(invalid(field(), "expected objects"));
    };
    let f = match c.get("function") {
        Some(Value::Object(f)) => f,
        _ => c,
    };
    let Some(name) = f.get("name").and_then(Value::as_str) else {
        return Err(invalid(field(), "function.name must be a string"));
    };
    Ok(ToolCall {
        id: opt_string(c, "id"),
        name: name.to_owned(),
        arguments: parse_arguments(f.get("arguments")),
    })
}
