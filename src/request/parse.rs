//! Body → [`InferenceRequest`] for each supported API.
//!
//! The body is first bounded by [`super::scan`] (depth, array sizes), then parsed by serde_json
//! into a tree (`preserve_order`, so tool schemas keep their key order for `tojson`). Unknown
//! fields are ignored: the lead forwards the body untouched.

use serde_json::{Map, Value};

use super::error::RequestError;
use super::scan::{ParseLimits, scan};
use super::types::{
    ApiKind, ChatMessage, ChatPrompt, ContentPart, InferenceRequest, MessageContent, Prompt,
    ToolCall,
};

/// Parses `body` sent to `path` with the default [`ParseLimits`].
pub fn parse(path: &str, body: &[u8]) -> Result<InferenceRequest, RequestError> {
    parse_with_limits(path, body, ParseLimits::default())
}

/// Parses `body` sent to `path` (the path decides the API; unknown paths are guessed from the
/// body's shape).
pub fn parse_with_limits(
    path: &str,
    body: &[u8],
    limits: ParseLimits,
) -> Result<InferenceRequest, RequestError> {
    let root = parse_json(body, limits)?;
    let Value::Object(obj) = root else {
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
                (Prompt::Chat(chat_prompt(&obj, false)?), false)
            } else {
                text_prompt(&obj, "input")?
            }
        }
        ApiKind::ChatCompletions => (Prompt::Chat(chat_prompt(&obj, true)?), false),
        ApiKind::Responses => (Prompt::Chat(responses_prompt(&obj)?), false),
        ApiKind::AnthropicMessages => (Prompt::Chat(anthropic_prompt(&obj)?), false),
        ApiKind::Other => guess_prompt(&obj)?,
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

/// Validates UTF-8 and bounds, then builds the JSON tree.
pub(crate) fn parse_json(body: &[u8], limits: ParseLimits) -> Result<Value, RequestError> {
    if let Err(e) = std::str::from_utf8(body) {
        return Err(RequestError::NotUtf8 {
            offset: e.valid_up_to(),
        });
    }
    scan(body, limits)?;
    serde_json::from_slice::<Value>(body).map_err(|e| {
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

fn guess_prompt(obj: &Map<String, Value>) -> Result<(Prompt, bool), RequestError> {
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

fn invalid(field: impl Into<String>, detail: &'static str) -> RequestError {
    RequestError::InvalidField {
        field: field.into(),
        detail,
    }
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

fn opt_string(obj: &Map<String, Value>, key: &str) -> Option<String> {
    obj.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// OpenAI chat completions (also embeddings' chat form).
fn chat_prompt(
    obj: &Map<String, Value>,
    default_generation_prompt: bool,
) -> Result<ChatPrompt, RequestError> {
    let Some(Value::Array(raw)) = obj.get("messages") else {
        return Err(invalid("messages", "expected an array"));
    };
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
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
    })
}

fn openai_message(m: &Value, i: usize) -> Result<ChatMessage, RequestError> {
    let Value::Object(m) = m else {
        return Err(invalid(format!("messages[{i}]"), "expected an object"));
    };
    let Some(role) = m.get("role").and_then(Value::as_str) else {
        return Err(invalid(format!("messages[{i}].role"), "expected a string"));
    };
    let content = content(m.get("content"), &format!("messages[{i}].content"))?;
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
        role: role.to_owned(),
        content,
        name: opt_string(m, "name"),
        tool_call_id: opt_string(m, "tool_call_id"),
        tool_calls,
        reasoning_content: opt_string(m, "reasoning_content")
            .or_else(|| opt_string(m, "reasoning")),
    })
}

/// Message content: null, a string, or a list of parts (strings or typed part objects).
fn content(v: Option<&Value>, field: &str) -> Result<MessageContent, RequestError> {
    match v {
        None | Some(Value::Null) => Ok(MessageContent::Null),
        Some(Value::String(s)) => Ok(MessageContent::Text(s.clone())),
        Some(Value::Array(parts)) => Ok(MessageContent::Parts(
            parts.iter().filter_map(content_part).collect(),
        )),
        Some(_) => Err(invalid(field, "expected a string, null or content parts")),
    }
}

/// One content part; parts that render nothing (unknown types, tool_use…) are dropped.
fn content_part(p: &Value) -> Option<ContentPart> {
    match p {
        Value::String(s) => Some(ContentPart::Text(s.clone())),
        Value::Object(o) => {
            let kind = o.get("type").and_then(Value::as_str).unwrap_or("text");
            match kind {
                "text" | "input_text" | "output_text" => o
                    .get("text")
                    .and_then(Value::as_str)
                    .map(|t| ContentPart::Text(t.to_owned())),
                "refusal" => o
                    .get("refusal")
                    .and_then(Value::as_str)
                    .map(|t| ContentPart::Text(t.to_owned())),
                "image_url" | "image" | "input_image" | "image_embeds" | "image_pil" => {
                    Some(ContentPart::Media("image"))
                }
                "audio_url" | "input_audio" | "audio" => Some(ContentPart::Media("audio")),
                "video_url" | "video" => Some(ContentPart::Media("video")),
                _ => None,
            }
        }
        _ => None,
    }
}

/// vLLM parses a JSON-string `arguments` into an object; empty/invalid/non-object → `{}`.
fn parse_arguments(a: Option<&Value>) -> Value {
    match a {
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => Value::Object(Map::new()),
        },
        // NOTE: vLLM answers 400 to object arguments; we route them anyway, as an object.
        Some(v @ Value::Object(_)) => v.clone(),
        _ => Value::Object(Map::new()),
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

/// vLLM's normalised tool: `{"type":"function","function":{name,description,parameters[,strict]}}`.
fn normalised_tool(
    name: &str,
    description: Option<&Value>,
    parameters: Option<&Value>,
    strict: Option<&Value>,
) -> Value {
    let mut f = Map::new();
    f.insert("name".into(), Value::String(name.to_owned()));
    f.insert(
        "description".into(),
        description.cloned().unwrap_or(Value::Null),
    );
    f.insert(
        "parameters".into(),
        parameters.cloned().unwrap_or(Value::Null),
    );
    if let Some(s) = strict.filter(|s| !s.is_null()) {
        f.insert("strict".into(), s.clone());
    }
    let mut t = Map::new();
    t.insert("type".into(), Value::String("function".into()));
    t.insert("function".into(), Value::Object(f));
    Value::Object(t)
}

fn openai_tool(t: &Value, i: usize) -> Result<Value, RequestError> {
    let f = t.get("function").unwrap_or(t);
    let Some(name) = f.get("name").and_then(Value::as_str) else {
        return Err(invalid(
            format!("tools[{i}].function.name"),
            "expected a string",
        ));
    };
    Ok(normalised_tool(
        name,
        f.get("description"),
        f.get("parameters"),
        f.get("strict"),
    ))
}

fn message(role: &str, content: MessageContent) -> ChatMessage {
    ChatMessage {
        role: role.to_owned(),
        content,
        name: None,
        tool_call_id: None,
        tool_calls: None,
        reasoning_content: None,
    }
}

/// OpenAI `/v1/responses`: `instructions` become a system message, `input` the conversation.
fn responses_prompt(obj: &Map<String, Value>) -> Result<ChatPrompt, RequestError> {
    let mut messages = Vec::new();
    if let Some(instr) = obj.get("instructions").and_then(Value::as_str) {
        messages.push(message("system", MessageContent::Text(instr.to_owned())));
    }
    match obj.get("input") {
        Some(Value::String(s)) => messages.push(message("user", MessageContent::Text(s.clone()))),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let field = format!("input[{i}]");
                let Value::Object(o) = item else {
                    return Err(invalid(field, "expected an object"));
                };
                match o.get("type").and_then(Value::as_str).unwrap_or("message") {
                    "message" => {
                        let role = o.get("role").and_then(Value::as_str).unwrap_or("user");
                        let c = content(o.get("content"), &field)?;
                        messages.push(message(role, c));
                    }
                    "function_call" => {
                        let name = o.get("name").and_then(Value::as_str).unwrap_or_default();
                        let mut m = message("assistant", MessageContent::Null);
                        m.tool_calls = Some(vec![ToolCall {
                            id: opt_string(o, "call_id"),
                            name: name.to_owned(),
                            arguments: parse_arguments(o.get("arguments")),
                        }]);
                        messages.push(m);
                    }
                    "function_call_output" => {
                        let out = match o.get("output") {
                            Some(Value::String(s)) => MessageContent::Text(s.clone()),
                            other => content(other, &field)?,
                        };
                        let mut m = message("tool", out);
                        m.tool_call_id = opt_string(o, "call_id");
                        messages.push(m);
                    }
                    _ => {}
                }
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(invalid("input", "expected a string or an array")),
    }
    let tools = match obj.get("tools") {
        Some(Value::Array(tools)) => Some(
            tools
                .iter()
                .filter(|t| {
                    t.get("type").and_then(Value::as_str).unwrap_or("function") == "function"
                })
                .enumerate()
                .map(|(i, t)| openai_tool(t, i))
                .collect::<Result<_, _>>()?,
        ),
        _ => None,
    };
    Ok(ChatPrompt {
        messages,
        tools,
        add_generation_prompt: true,
        continue_final_message: false,
        chat_template_kwargs: Map::new(),
    })
}

/// Anthropic `/v1/messages`, converted to the OpenAI chat shape vLLM renders.
fn anthropic_prompt(obj: &Map<String, Value>) -> Result<ChatPrompt, RequestError> {
    let mut messages = Vec::new();
    match obj.get("system") {
        Some(Value::String(s)) => messages.push(message("system", MessageContent::Text(s.clone()))),
        Some(Value::Array(blocks)) => {
            let text: Vec<&str> = blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect();
            messages.push(message("system", MessageContent::Text(text.join("\n"))));
        }
        _ => {}
    }
    let Some(Value::Array(raw)) = obj.get("messages") else {
        return Err(invalid("messages", "expected an array"));
    };
    for (i, m) in raw.iter().enumerate() {
        let field = format!("messages[{i}]");
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(invalid(field, "role must be a string"));
        };
        match m.get("content") {
            Some(Value::Array(blocks)) => {
                let mut parts = Vec::new();
                let mut calls = Vec::new();
                for b in blocks {
                    match b.get("type").and_then(Value::as_str) {
                        Some("tool_use") => calls.push(ToolCall {
                            id: b.get("id").and_then(Value::as_str).map(str::to_owned),
                            name: b
                                .get("name")
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_owned(),
                            arguments: b
                                .get("input")
                                .filter(|v| v.is_object())
                                .cloned()
                                .unwrap_or_else(|| Value::Object(Map::new())),
                        }),
                        Some("tool_result") => {
                            let c = match b.get("content") {
                                Some(Value::String(s)) => MessageContent::Text(s.clone()),
                                other => content(other, &field)?,
                            };
                            let mut t = message("tool", c);
                            t.tool_call_id = b
                                .get("tool_use_id")
                                .and_then(Value::as_str)
                                .map(str::to_owned);
                            messages.push(t);
                        }
                        _ => parts.extend(content_part(b)),
                    }
                }
                if !parts.is_empty() || !calls.is_empty() {
                    let mut msg = message(role, MessageContent::Parts(parts));
                    if !calls.is_empty() {
                        msg.tool_calls = Some(calls);
                    }
                    messages.push(msg);
                }
            }
            other => messages.push(message(role, content(other, &field)?)),
        }
    }
    let tools = match obj.get("tools") {
        Some(Value::Array(tools)) => Some(
            tools
                .iter()
                .enumerate()
                .map(|(i, t)| match t.get("name").and_then(Value::as_str) {
                    Some(name) => Ok(normalised_tool(
                        name,
                        t.get("description"),
                        t.get("input_schema"),
                        None,
                    )),
                    None => Err(invalid(format!("tools[{i}].name"), "expected a string")),
                })
                .collect::<Result<_, _>>()?,
        ),
        _ => None,
    };
    Ok(ChatPrompt {
        messages,
        tools,
        add_generation_prompt: true,
        continue_final_message: false,
        chat_template_kwargs: Map::new(),
    })
}
