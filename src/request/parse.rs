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
        merge_inline_system: false,
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
                // vLLM's chat stage renders a `thinking` part as a text part (`TEXT_PART_TYPES`).
                "thinking" => o
                    .get("thinking")
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

/// The optional fields of a normalised tool that vLLM renders only when set.
#[derive(Default)]
struct ToolFlags<'a> {
    /// `function.strict`.
    strict: Option<&'a Value>,
    /// `function.defer_loading`.
    defer_loading: Option<&'a Value>,
    /// The chat tool's top-level `defer_loading` (also copied into the function when that has
    /// none: `ChatCompletionToolsParam._propagate_defer_loading`).
    top_defer_loading: Option<&'a Value>,
}

/// vLLM's normalised tool (`ChatCompletionToolsParam.model_dump()`):
/// `{"type":"function","function":{name,description,parameters[,strict][,defer_loading]}
/// [,"defer_loading"]}`; unset optional fields are left out.
fn normalised_tool(
    name: &str,
    description: Option<&Value>,
    parameters: Option<&Value>,
    flags: ToolFlags<'_>,
) -> Value {
    let set = |v: Option<&Value>| v.filter(|v| !v.is_null()).cloned();
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
    if let Some(s) = set(flags.strict) {
        f.insert("strict".into(), s);
    }
    let top_defer = set(flags.top_defer_loading);
    if let Some(d) = set(flags.defer_loading).or_else(|| top_defer.clone()) {
        f.insert("defer_loading".into(), d);
    }
    let mut t = Map::new();
    t.insert("type".into(), Value::String("function".into()));
    t.insert("function".into(), Value::Object(f));
    if let Some(d) = top_defer {
        t.insert("defer_loading".into(), d);
    }
    Value::Object(t)
}

/// A chat tool (`{"type":"function","function":{…}}`) or a flat `/v1/responses` function tool.
fn openai_tool(t: &Value, i: usize) -> Result<Value, RequestError> {
    let nested = t.get("function");
    let f = nested.unwrap_or(t);
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
        ToolFlags {
            strict: f.get("strict"),
            defer_loading: f.get("defer_loading"),
            top_defer_loading: nested.and_then(|_| t.get("defer_loading")),
        },
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

/// OpenAI `/v1/responses`, converted as vLLM 0.32's `construct_input_messages` and
/// `_construct_message_from_response_item` (`entrypoints/openai/responses/utils.py`) do.
fn responses_prompt(obj: &Map<String, Value>) -> Result<ChatPrompt, RequestError> {
    let mut messages = Vec::new();
    // `if request_instructions:`: an empty string adds no system message (the template's
    // default system prompt then appears).
    if let Some(instr) = obj
        .get("instructions")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
    {
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
                responses_item(o, &field, &mut messages)?;
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(invalid("input", "expected a string or an array")),
    }
    let continue_final = should_continue_final_message(obj.get("input"));
    let tools = match obj.get("tools") {
        Some(Value::Array(tools)) => Some(responses_tools(tools)?),
        _ => None,
    };
    Ok(ChatPrompt {
        messages,
        tools,
        add_generation_prompt: !continue_final,
        continue_final_message: continue_final,
        chat_template_kwargs: Map::new(),
        merge_inline_system: false,
    })
}

/// The function tools a `/v1/responses` request shows the model, in order (vLLM's
/// `get_function_tools`): function tools; a namespace's function tools named
/// `<namespace>__<name>`; custom tools as a one-string-argument function shim. Other tool types
/// (web search, MCP, custom tools inside a namespace…) are not rendered.
fn responses_tools(tools: &[Value]) -> Result<Vec<Value>, RequestError> {
    let mut out = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        match t.get("type").and_then(Value::as_str).unwrap_or("function") {
            "function" => out.push(openai_tool(t, i)?),
            "namespace" => {
                let ns = t.get("name").and_then(Value::as_str).unwrap_or_default();
                let Some(Value::Array(inner)) = t.get("tools") else {
                    continue;
                };
                for f in inner
                    .iter()
                    .filter(|f| f.get("type").and_then(Value::as_str) == Some("function"))
                {
                    let Some(name) = f.get("name").and_then(Value::as_str) else {
                        return Err(invalid(
                            format!("tools[{i}].tools"),
                            "name must be a string",
                        ));
                    };
                    out.push(normalised_tool(
                        &format!("{ns}__{name}"),
                        f.get("description"),
                        f.get("parameters"),
                        ToolFlags {
                            strict: f.get("strict"),
                            defer_loading: f.get("defer_loading"),
                            top_defer_loading: None,
                        },
                    ));
                }
            }
            "custom" => {
                let Some(name) = t.get("name").and_then(Value::as_str) else {
                    return Err(invalid(format!("tools[{i}].name"), "expected a string"));
                };
                out.push(normalised_tool(
                    name,
                    t.get("description"),
                    Some(&custom_tool_parameters()),
                    ToolFlags::default(),
                ));
            }
            _ => {}
        }
    }
    Ok(out)
}

/// vLLM's `custom_tool_parameters`: the schema of the function shim a custom tool is shown as.
fn custom_tool_parameters() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "input": {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": ["input"],
        "additionalProperties": false,
    })
}

/// vLLM's `should_continue_final_message`: a last input item that is a message or reasoning
/// item with `status` `in_progress`/`incomplete` is continued (no generation prompt).
fn should_continue_final_message(input: Option<&Value>) -> bool {
    let Some(Value::Array(items)) = input else {
        return false;
    };
    let Some(Value::Object(last)) = items.last() else {
        return false;
    };
    let kind = last
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    let status = last.get("status").and_then(Value::as_str);
    matches!(kind, "message" | "reasoning") && matches!(status, Some("in_progress" | "incomplete"))
}

/// The assistant message a responses item may be merged into: the last message, if it is an
/// assistant one (vLLM's `prev_assistant_msg`).
fn last_assistant(messages: &mut [ChatMessage]) -> Option<&mut ChatMessage> {
    messages.last_mut().filter(|m| m.role == "assistant")
}

/// The text of the first element of a list field (`content[0].text`), if any.
fn first_text<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    match o.get(key) {
        Some(Value::Array(parts)) => parts.first()?.get("text")?.as_str(),
        _ => None,
    }
}

/// One `/v1/responses` input item: appended as a new message, or merged into the previous
/// assistant message the way vLLM merges it (a `function_call` joins the previous assistant
/// message's `tool_calls`; `reasoning` and assistant text fill its empty slots).
fn responses_item(
    o: &Map<String, Value>,
    field: &str,
    messages: &mut Vec<ChatMessage>,
) -> Result<(), RequestError> {
    match o.get("type").and_then(Value::as_str) {
        Some(kind @ ("function_call" | "custom_tool_call")) => {
            let name = o.get("name").and_then(Value::as_str).unwrap_or_default();
            let call = if kind == "custom_tool_call" {
                // `encode_custom_tool_input`: the free-form input as `{"input": …}`.
                let input = o.get("input").and_then(Value::as_str).unwrap_or_default();
                let mut args = Map::new();
                args.insert("input".into(), Value::String(input.to_owned()));
                ToolCall {
                    id: opt_string(o, "call_id"),
                    name: name.to_owned(),
                    arguments: Value::Object(args),
                }
            } else {
                // `flat_namespace_tool_name`: `<namespace>__<name>`.
                let name = match o.get("namespace").and_then(Value::as_str) {
                    Some(ns) if !ns.is_empty() => format!("{ns}__{name}"),
                    _ => name.to_owned(),
                };
                ToolCall {
                    id: opt_string(o, "call_id"),
                    name,
                    arguments: parse_arguments(o.get("arguments")),
                }
            };
            match last_assistant(messages) {
                Some(prev) => prev.tool_calls.get_or_insert_with(Vec::new).push(call),
                None => {
                    let mut m = message("assistant", MessageContent::Null);
                    m.tool_calls = Some(vec![call]);
                    messages.push(m);
                }
            }
        }
        Some("reasoning") => {
            let text = first_text(o, "content")
                .or_else(|| first_text(o, "summary"))
                .unwrap_or_default()
                .to_owned();
            match last_assistant(messages).filter(|m| m.reasoning_content.is_none()) {
                Some(prev) => prev.reasoning_content = Some(text),
                None => {
                    let mut m = message("assistant", MessageContent::Null);
                    m.reasoning_content = Some(text);
                    messages.push(m);
                }
            }
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            let out = match o.get("output") {
                Some(Value::String(s)) => MessageContent::Text(s.clone()),
                other => content(other, field)?,
            };
            let mut m = message("tool", out);
            m.tool_call_id = opt_string(o, "call_id");
            messages.push(m);
        }
        // Messages (`type: "message"` or no type). Other item types are answered with 400 by
        // vLLM; they add nothing here.
        None | Some("message") => {
            let Some(role) = o.get("role").and_then(Value::as_str) else {
                return Ok(());
            };
            // An assistant message keeps only its first part's text (`content[0].text`).
            let assistant_text = match o.get("content") {
                Some(Value::String(s)) if role == "assistant" => Some(s.as_str()),
                _ if role == "assistant" => first_text(o, "content"),
                _ => None,
            };
            if let Some(text) = assistant_text {
                let text = MessageContent::Text(text.to_owned());
                match last_assistant(messages).filter(|m| m.content == MessageContent::Null) {
                    Some(prev) => prev.content = text,
                    None => messages.push(message("assistant", text)),
                }
            } else {
                messages.push(message(role, content(o.get("content"), field)?));
            }
        }
        Some(_) => {}
    }
    Ok(())
}

/// Claude Code's attribution header: its per-request hash would defeat prefix caching, so vLLM
/// drops system blocks starting with it (`_CLAUDE_CODE_BILLING_HEADER`).
pub const BILLING_HEADER: &str = "x-anthropic-billing-header";

fn block_type(b: &Value) -> Option<&str> {
    b.get("type").and_then(Value::as_str)
}

/// The non-empty text blocks of a system block list that are not billing headers, joined with
/// `""` (vLLM joins system parts with no separator).
fn system_blocks_text(blocks: &[Value]) -> String {
    blocks
        .iter()
        .filter(|b| block_type(b) == Some("text"))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
        .collect()
}

/// Anthropic `/v1/messages`, converted as vLLM 0.32's
/// `AnthropicServingMessages.to_chat_completion_request` (`entrypoints/anthropic/serving.py`)
/// converts it. Inline `system` messages stay in place here; [`ChatPrompt::merge_inline_system`]
/// lets the renderer merge them when the template requires it, as vLLM decides per template.
fn anthropic_prompt(obj: &Map<String, Value>) -> Result<ChatPrompt, RequestError> {
    let mut messages = Vec::new();
    // `_convert_system_message`: a string is kept whole (the chat stage strips a leading billing
    // header line); blocks are filtered and joined with "". Empty → no system message.
    let system = match obj.get("system") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => system_blocks_text(blocks),
        _ => String::new(),
    };
    if !system.is_empty() {
        messages.push(message("system", MessageContent::Text(system)));
    }
    let Some(Value::Array(raw)) = obj.get("messages") else {
        return Err(invalid("messages", "expected an array"));
    };
    for (i, m) in raw.iter().enumerate() {
        anthropic_message(m, &format!("messages[{i}]"), &mut messages)?;
    }
    let tools = match obj.get("tools") {
        Some(Value::Array(tools)) => Some(
            tools
                .iter()
                .enumerate()
                .map(|(i, t)| anthropic_tool(t, i))
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
        merge_inline_system: true,
    })
}

/// One Anthropic message (`_convert_messages`): a system message's text, or the message with
/// its blocks converted; `tool_result` blocks of a user message become `tool` messages placed
/// before it.
fn anthropic_message(
    m: &Value,
    field: &str,
    messages: &mut Vec<ChatMessage>,
) -> Result<(), RequestError> {
    let Some(role) = m.get("role").and_then(Value::as_str) else {
        return Err(invalid(field, "role must be a string"));
    };
    if role == "system" {
        // `_extract_system_text`: billing headers dropped, blocks joined with "", empty → none.
        let text = match m.get("content") {
            Some(Value::String(s)) if !s.starts_with(BILLING_HEADER) => s.clone(),
            Some(Value::Array(blocks)) => system_blocks_text(blocks),
            _ => String::new(),
        };
        if !text.is_empty() {
            messages.push(message("system", MessageContent::Text(text)));
        }
        return Ok(());
    }
    let blocks = match m.get("content") {
        Some(Value::Array(blocks)) => blocks,
        other => {
            messages.push(message(role, content(other, field)?));
            return Ok(());
        }
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning: Option<String> = None;
    for b in blocks {
        match block_type(b) {
            Some("text") => {
                if let Some(t) = b
                    .get("text")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    parts.push(ContentPart::Text(t.to_owned()));
                }
            }
            Some("image") if b.get("source").is_some_and(truthy) => {
                parts.push(ContentPart::Media("image"));
            }
            Some("thinking") => {
                if let Some(t) = b.get("thinking").and_then(Value::as_str) {
                    reasoning.get_or_insert_with(String::new).push_str(t);
                }
            }
            Some("tool_use") => calls.push(ToolCall {
                id: opt_string_of(b, "id"),
                name: opt_string_of(b, "name").unwrap_or_default(),
                // `json.dumps(block.input or {})`, parsed back by the chat stage.
                arguments: b
                    .get("input")
                    .filter(|v| v.is_object())
                    .cloned()
                    .unwrap_or_else(|| Value::Object(Map::new())),
            }),
            Some("tool_result") if role == "user" => user_tool_result(b, messages),
            Some("tool_result") => {
                // vLLM formats it with Python's `str()`.
                let text = match b.get("content") {
                    Some(c) if truthy(c) => super::pyrepr::py_str(c),
                    _ => String::new(),
                };
                parts.push(ContentPart::Text(format!("Tool result: {text}")));
            }
            _ => {}
        }
    }
    // A user message left without content is dropped; an assistant one is kept (its tool
    // calls or reasoning, or an empty turn).
    if role == "user" && parts.is_empty() {
        return Ok(());
    }
    let content = if parts.is_empty() {
        MessageContent::Null
    } else {
        MessageContent::Parts(parts)
    };
    let mut msg = message(role, content);
    msg.reasoning_content = reasoning;
    if !calls.is_empty() {
        msg.tool_calls = Some(calls);
    }
    messages.push(msg);
    Ok(())
}

/// Python truthiness of a JSON value (`if x:`).
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

fn opt_string_of(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// `_convert_user_tool_result`: a `tool` message with the result's text (text items joined
/// with `\n`), then a user message with the result's images, if any.
/// NOTE: `tool_reference` items (a third, structured `tool` message in vLLM) are not rendered.
fn user_tool_result(b: &Value, messages: &mut Vec<ChatMessage>) {
    let mut images = 0usize;
    let text = match b.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items.iter().filter(|i| i.is_object()) {
                match block_type(item) {
                    Some("text") => {
                        texts.push(item.get("text").and_then(Value::as_str).unwrap_or_default());
                    }
                    Some("image") => {
                        let source = item.get("source");
                        let is_url = source.and_then(|s| s.get("type")).and_then(Value::as_str)
                            == Some("url");
                        let url = source.and_then(|s| s.get("url")).and_then(Value::as_str);
                        // A base64 (or untyped) source always yields a data URL.
                        if !is_url || url.is_some_and(|u| !u.is_empty()) {
                            images += 1;
                        }
                    }
                    _ => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    let mut tool = message("tool", MessageContent::Text(text));
    tool.tool_call_id = Some(opt_string_of(b, "tool_use_id").unwrap_or_default());
    messages.push(tool);
    if images > 0 {
        messages.push(message(
            "user",
            MessageContent::Parts(vec![ContentPart::Media("image"); images]),
        ));
    }
}

/// `_convert_tools`: an OpenAI function tool; `input_schema` gains `"type": "object"` (at its
/// end) when it has no `type`; `strict` and `defer_loading` are kept when set.
fn anthropic_tool(t: &Value, i: usize) -> Result<Value, RequestError> {
    let Some(name) = t.get("name").and_then(Value::as_str) else {
        return Err(invalid(format!("tools[{i}].name"), "expected a string"));
    };
    let schema = match t.get("input_schema") {
        Some(Value::Object(schema)) if !schema.contains_key("type") => {
            let mut schema = schema.clone();
            schema.insert("type".into(), Value::String("object".into()));
            Some(Value::Object(schema))
        }
        other => other.cloned(),
    };
    Ok(normalised_tool(
        name,
        t.get("description"),
        schema.as_ref(),
        ToolFlags {
            strict: t.get("strict"),
            defer_loading: t.get("defer_loading"),
            top_defer_loading: None,
        },
    ))
}
