//! Tokenization and chat-template rendering as vLLM 0.32 does it, for the simulator's HTTP API.
//!
//! Why: `usage.prompt_tokens`, the prefix cache and every KV event depend on the exact token
//! ids, so the simulator must tokenize what vLLM would: completion prompts with special tokens,
//! chat prompts rendered through the model's own template (minijinja + pycompat) and encoded
//! without them. vLLM's content-format rules (DESIGN §3.1) are applied for string and text-part
//! messages: a template that loops over `content` ("openai" format) gets a string content as
//! `[{"type": "text", "text": …}]` and `null` as `[]`; a "string" template gets text parts
//! joined with `\n`.
//!
//! Immutable after load; shared across pods behind an `Arc`.

use std::path::Path;
use std::sync::Arc;

use minijinja::value::{Enumerator, Object};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JinjaValue};
use serde_json::{Map, Value};

/// Errors loading a tokenizer directory.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` missing or invalid.
    #[error("cannot load {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// The chat template does not compile.
    #[error("invalid chat template: {0}")]
    Template(String),
}

/// Errors turning a request into token ids (all are 400s).
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The model has no chat template.
    #[error("this model has no chat template")]
    NoTemplate,
    /// The template raised or failed.
    #[error("{0}")]
    Render(String),
    /// The tokenizer failed.
    #[error("tokenization failed: {0}")]
    Encode(String),
    /// A malformed message.
    #[error("{0}")]
    BadMessage(String),
}

/// A loaded tokenizer directory (`tokenizer.json`, `tokenizer_config.json`,
/// `chat_template.jinja`).
pub struct SimTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: Option<Environment<'static>>,
    openai_content: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for SimTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTokenizer")
            .field("has_template", &self.env.is_some())
            .field("openai_content", &self.openai_content)
            .finish()
    }
}

fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Whether the template loops over a message's content (vLLM's "openai" content format).
// NOTE: vLLM walks the Jinja AST; a textual scan for `for … in …content` covers the templates
// in use (including content passed through a macro argument named `content`).
fn loops_over_content(template: &str) -> bool {
    template.split("{%").skip(1).any(|tag| {
        let tag = tag.trim_start_matches('-').trim_start();
        tag.starts_with("for ")
            && tag
                .split("%}")
                .next()
                .and_then(|head| head.split(" in ").nth(1))
                .is_some_and(|iter| iter.contains("content"))
    })
}

/// Python's `json.dumps(x, ensure_ascii=False)`: `", "` and `": "` separators, no escaping
/// of `<>&'`, insertion order kept.
pub fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_python_json(value, &mut out);
    out
}

fn write_python_json(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(v, out);
            }
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(0.0);
            if f.fract() == 0.0 && f.abs() < 1e16 {
                out.push_str(&format!("{f:.1}"));
            } else {
                out.push_str(&n.to_string());
            }
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A JSON object handed to the template with its key order kept (minijinja's own maps sort
/// keys unless its `preserve_order` feature is on), so `tojson` prints keys as Python would.
#[derive(Debug)]
struct OrderedMap(Vec<(String, JinjaValue)>);

impl Object for OrderedMap {
    fn get_value(self: &Arc<Self>, key: &JinjaValue) -> Option<JinjaValue> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(
            self.0
                .iter()
                .map(|(k, _)| JinjaValue::from(k.as_str()))
                .collect(),
        )
    }
}

/// Converts JSON into template values, objects as [`OrderedMap`]s.
fn to_jinja(value: &Value) -> JinjaValue {
    match value {
        Value::Object(map) => JinjaValue::from_object(OrderedMap(
            map.iter().map(|(k, v)| (k.clone(), to_jinja(v))).collect(),
        )),
        Value::Array(items) => JinjaValue::from(items.iter().map(to_jinja).collect::<Vec<_>>()),
        other => JinjaValue::from_serialize(other),
    }
}

/// vLLM's tool normalisation: `{type, function: {name, description, parameters}}`, missing
/// fields as null, unknown keys dropped.
fn normalize_tools(tools: &Value) -> Value {
    let Value::Array(tools) = tools else {
        return tools.clone();
    };
    let field =
        |v: Option<&Value>, k: &str| v.and_then(|v| v.get(k)).cloned().unwrap_or(Value::Null);
    Value::Array(
        tools
            .iter()
            .map(|t| {
                let f = t.get("function");
                serde_json::json!({
                    "type": field(Some(t), "type"),
                    "function": {
                        "name": field(f, "name"),
                        "description": field(f, "description"),
                        "parameters": field(f, "parameters"),
                    },
                })
            })
            .collect(),
    )
}

fn tojson_filter(value: JinjaValue) -> Result<JinjaValue, JinjaError> {
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(JinjaValue::from_safe_string(python_json(&json)))
}

fn raise_exception(message: String) -> Result<JinjaValue, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

impl SimTokenizer {
    /// Loads `dir`.
    pub fn load(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let tokenizer =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        let config: Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        let template = std::fs::read_to_string(dir.join("chat_template.jinja"))
            .ok()
            .or_else(|| {
                config
                    .get("chat_template")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            });
        let (env, openai_content) = match template {
            Some(source) => {
                let openai = loops_over_content(&source);
                let mut env = Environment::new();
                minijinja_contrib::add_to_environment(&mut env);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_filter("tojson", tojson_filter);
                env.add_function("raise_exception", raise_exception);
                env.add_template_owned("chat", source)
                    .map_err(|e| TokenizerError::Template(e.to_string()))?;
                (Some(env), openai)
            }
            None => (None, false),
        };
        Ok(Self {
            tokenizer,
            env,
            openai_content,
            bos_token: special_token(&config, "bos_token"),
            eos_token: special_token(&config, "eos_token"),
        })
    }

    /// Encodes a completion prompt (special tokens added, as vLLM does).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        self.encode(text, true)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, PromptError> {
        self.tokenizer
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| PromptError::Encode(e.to_string()))
    }

    /// Decodes generated ids to text.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// Applies vLLM's content-format normalisation to one message.
    fn normalize_message(&self, message: &Value) -> Result<Value, PromptError> {
        let Value::Object(fields) = message else {
            return Err(PromptError::BadMessage(
                "each message must be an object".into(),
            ));
        };
        let role = fields
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if role.is_empty() {
            return Err(PromptError::BadMessage("message without a role".into()));
        }
        let mut out = Map::new();
        for (k, v) in fields {
            out.insert(k.clone(), v.clone());
        }
        let content = fields.get("content").cloned().unwrap_or(Value::Null);
        let texts: Option<Vec<String>> = match &content {
            Value::String(s) => Some(vec![s.clone()]),
            Value::Null => Some(Vec::new()),
            Value::Array(parts) => parts
                .iter()
                .map(|p| {
                    (p.get("type").and_then(Value::as_str) == Some("text"))
                        .then(|| p.get("text").and_then(Value::as_str).map(str::to_owned))
                        .flatten()
                })
                .collect(),
            _ => None,
        };
        let Some(texts) = texts else {
            return Err(PromptError::BadMessage(
                "only string and text-part message content is supported".into(),
            ));
        };
        let normalized = if self.openai_content && role != "tool" {
            Value::Array(
                texts
                    .into_iter()
                    .map(|t| serde_json::json!({"type": "text", "text": t}))
                    .collect(),
            )
        } else if content.is_null() && !self.openai_content {
            Value::Null
        } else {
            Value::String(texts.join("\n"))
        };
        out.insert("content".into(), normalized);
        if let Some(Value::Array(calls)) = fields.get("tool_calls") {
            let mut parsed = Vec::with_capacity(calls.len());
            for call in calls {
                let mut call = call.clone();
                if let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) {
                    match function.get("arguments") {
                        Some(Value::String(s)) => {
                            let args = serde_json::from_str(s).map_err(|_| {
                                PromptError::BadMessage("tool call arguments are not JSON".into())
                            })?;
                            function.insert("arguments".into(), args);
                        }
                        Some(Value::Null) | None => {}
                        Some(_) => {
                            return Err(PromptError::BadMessage(
                                "tool call arguments must be a JSON string".into(),
                            ));
                        }
                    }
                }
                parsed.push(call);
            }
            out.insert("tool_calls".into(), Value::Array(parsed));
        }
        Ok(Value::Object(out))
    }

    /// Renders a chat request's messages with the template (no tokenization).
    pub fn render_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
    ) -> Result<String, PromptError> {
        let env = self.env.as_ref().ok_or(PromptError::NoTemplate)?;
        let template = env
            .get_template("chat")
            .map_err(|e| PromptError::Render(e.to_string()))?;
        let messages = messages
            .iter()
            .map(|m| self.normalize_message(m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ctx = Map::new();
        if let Some(kwargs) = kwargs {
            for (k, v) in kwargs {
                ctx.insert(k.clone(), v.clone());
            }
        }
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt && !continue_final_message),
        );
        ctx.insert(
            "tools".into(),
            tools.map(normalize_tools).unwrap_or(Value::Null),
        );
        ctx.insert(
            "bos_token".into(),
            self.bos_token.clone().map_or(Value::Null, Value::String),
        );
        ctx.insert(
            "eos_token".into(),
            self.eos_token.clone().map_or(Value::Null, Value::String),
        );
        let rendered = template
            .render(to_jinja(&Value::Object(ctx)))
            .map_err(|e| {
                let mut msg = e
                    .detail()
                    .map(str::to_owned)
                    .unwrap_or_else(|| e.to_string());
                if msg.is_empty() {
                    msg = e.to_string();
                }
                PromptError::Render(msg)
            })?;
        Ok(rendered)
    }

    /// Token ids of a chat request (rendered, encoded without special tokens).
    pub fn encode_chat(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Option<&Value>,
        kwargs: Option<&Map<String, Value>>,
    ) -> Result<Vec<u32>, PromptError> {
        let text = self.render_chat(
            messages,
            add_generation_prompt,
            continue_final_message,
            tools,
            kwargs,
        )?;
        self.encode(&text, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_matches_json_dumps() {
        let v: Value = serde_json::from_str(r#"{"b":1,"a":[1.0,"<é>",null,true]}"#).expect("json");
        assert_eq!(
            python_json(&v),
            r#"{"b": 1, "a": [1.0, "<é>", null, true]}"#
        );
    }

    #[test]
    fn content_loops_are_detected() {
        assert!(loops_over_content(
            "{%- for part in content -%}{%- endfor -%}"
        ));
        assert!(loops_over_content(
            "{% for p in message.content %}{% endfor %}"
        ));
        assert!(!loops_over_content(
            "{% for m in messages %}{{ m.content }}{% endfor %}"
        ));
    }
}
