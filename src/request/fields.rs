//! The message fields the chat APIs share (OpenAI chat, Anthropic messages, OpenAI
//! responses): content and its parts, tool definitions and calls, and the errors naming a
//! field. Below the per-API parsers, which all build on it.

use serde_json::{Map, Value};

use super::error::RequestError;
use super::types::{ChatMessage, ContentPart, MessageContent};

pub(super) fn invalid(field: impl Into<String>, detail: &'static str) -> RequestError {
    RequestError::InvalidField {
        field: field.into(),
        detail,
    }
}

pub(super) fn opt_string(obj: &Map<String, Value>, key: &str) -> Option<String> {
    obj.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// Message content: null, a string, or a list of parts (strings or typed part objects).
pub(super) fn content(v: Option<&Value>, field: &str) -> Result<MessageContent, RequestError> {
    match v {
        None | Some(Value::Null) => Ok(MessageContent::Null),
        Some(Value::String(s)) => Ok(MessageContent::Text(s.clone())),
        Some(Value::Array(parts)) => Ok(MessageContent::Parts(
            parts.iter().filter_map(content_part).collect(),
        )),
        Some(_) => Err(invalid(field, "expected a string, null or content parts")),
    }
}

/// What a typed content part renders as.
pub(super) enum PartKind {
    /// Text held under this key.
    Text(&'static str),
    /// A media placeholder.
    Media(&'static str),
}

/// The kind of a content part by its `type` (absent: `text`); `None` renders nothing.
pub(super) fn part_kind(part: &Map<String, Value>) -> Option<PartKind> {
    let kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
    match kind {
        "text" | "input_text" | "output_text" => Some(PartKind::Text("text")),
        // vLLM's chat stage renders a `thinking` part as a text part (`TEXT_PART_TYPES`).
        "thinking" => Some(PartKind::Text("thinking")),
        "refusal" => Some(PartKind::Text("refusal")),
        "image_url" | "image" | "input_image" | "image_embeds" | "image_pil" => {
            Some(PartKind::Media("image"))
        }
        "audio_url" | "input_audio" | "audio" => Some(PartKind::Media("audio")),
        "video_url" | "video" => Some(PartKind::Media("video")),
        _ => None,
    }
}

/// One content part; parts that render nothing (unknown types, tool_use…) are dropped.
fn content_part(p: &Value) -> Option<ContentPart> {
    match p {
        Value::String(s) => Some(ContentPart::Text(s.clone())),
        Value::Object(o) => match part_kind(o)? {
            PartKind::Text(key) => o
                .get(key)
                .and_then(Value::as_str)
                .map(|t| ContentPart::Text(t.to_owned())),
            PartKind::Media(kind) => Some(ContentPart::Media(kind)),
        },
        _ => None,
    }
}

/// vLLM parses a JSON-string `arguments` into an object; empty/invalid/non-object → `{}`.
pub(super) fn parse_arguments(a: Option<&Value>) -> Value {
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

/// The optional fields of a normalised tool that vLLM renders only when set.
#[derive(Default)]
pub(super) struct ToolFlags<'a> {
    /// `function.strict`.
    pub(super) strict: Option<&'a Value>,
    /// `function.defer_loading`.
    pub(super) defer_loading: Option<&'a Value>,
    /// The chat tool's top-level `defer_loading` (also copied into the function when that has
    /// none: `ChatCompletionToolsParam._propagate_defer_loading`).
    pub(super) top_defer_loading: Option<&'a Value>,
}

/// vLLM's normalised tool (`ChatCompletionToolsParam.model_dump()`):
/// `{"type":"function","function":{name,description,parameters[,strict][,defer_loading]}
/// [,"defer_loading"]}`; unset optional fields are left out.
pub(super) fn normalised_tool(
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
pub(super) fn openai_tool(t: &Value, i: usize) -> Result<Value, RequestError> {
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

pub(super) fn message(role: &str, content: MessageContent) -> ChatMessage {
    ChatMessage {
        role: role.to_owned(),
        content,
        name: None,
        tool_call_id: None,
        tool_calls: None,
        reasoning_content: None,
    }
}
