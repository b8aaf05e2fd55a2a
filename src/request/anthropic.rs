//! Anthropic `/v1/messages` → the chat messages vLLM 0.32 renders
//! (`AnthropicServingMessages.to_chat_completion_request`). Pure functions.

use serde_json::{Map, Value};

use super::error::RequestError;
use super::fields::{ToolFlags, content, invalid, message, normalised_tool};
use super::types::{ChatMessage, ChatPrompt, ContentPart, MessageContent, ToolCall};

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
pub(super) fn anthropic_prompt(obj: &Map<String, Value>) -> Result<ChatPrompt, RequestError> {
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
