//! OpenAI `/v1/responses` → the chat messages vLLM 0.32 renders (`construct_input_messages`,
//! `_construct_message_from_response_item`, `get_function_tools`). Pure functions.

use serde_json::{Map, Value};

use super::error::RequestError;
use super::fields::{
    ToolFlags, content, invalid, message, normalised_tool, openai_tool, opt_string, parse_arguments,
};
use super::types::{ChatMessage, ChatPrompt, MessageContent, ToolCall};

/// OpenAI `/v1/responses`, converted as vLLM 0.32's `construct_input_messages` and
/// `_construct_message_from_response_item` (`entrypoints/openai/responses/utils.py`) do.
pub(super) fn responses_prompt(obj: &Map<String, Value>) -> Result<ChatPrompt, RequestError> {
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
