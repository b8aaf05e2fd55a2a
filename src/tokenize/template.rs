//! Chat templates rendered like HF transformers/vLLM render them.
//!
//! The Jinja dialect is minijinja configured as transformers configures jinja2
//! (`trim_blocks`, `lstrip_blocks`, loop controls), plus what HF adds: `raise_exception`,
//! `strftime_now`, a `tojson` that is Python's `json.dumps(ensure_ascii=False)` (see
//! [`super::pyjson`]), Python `str` methods (minijinja-contrib pycompat) and a `trim`/`strip`
//! that removes exactly Python's whitespace. Before rendering, the request is rewritten the way
//! vLLM 0.32 rewrites it (DESIGN §3.1, [`vllm_messages`]).
//!
//! Concurrency: a [`ChatTemplate`] is immutable after construction and `Sync`; render from any
//! thread.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, State};
use std::borrow::Cow;

use serde::Serialize;
use serde::ser::SerializeMap;
use serde_json::{Map, Value as Json, json};

use super::error::TokenizeError;
use super::pyjson;
use super::template_concat::{CONCAT_FUNCTION, LazyConcatRecord, lazy_concat, lazy_concat_source};
use crate::request::{BILLING_HEADER, ChatMessage, ChatPrompt, ContentPart, MessageContent};

/// How message content reaches the template (vLLM's `--chat-template-content-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Content is one string (text parts joined with `\n`).
    String,
    /// Content is a list of OpenAI parts (`[{"type":"text","text":…}]`).
    OpenAi,
}

/// A compiled chat template with the tokenizer's special-token variables.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    format: ContentFormat,
    system_first: bool,
    /// Whether the environment also holds the template with its `+` chains printed without
    /// copies ([`LAZY_TEMPLATE_NAME`], see `template_concat`), tried first.
    lazy: bool,
    /// How the rewritten template has fared.
    lazy_record: LazyConcatRecord,
    /// Renders that tried the rewritten template (tests).
    #[cfg(test)]
    lazy_tries: std::sync::atomic::AtomicU64,
    special_tokens: Map<String, Json>,
}

const TEMPLATE_NAME: &str = "chat";
const LAZY_TEMPLATE_NAME: &str = "chat-lazy-concat";

impl ChatTemplate {
    /// Compiles `source`. `special_tokens` are the variables HF passes to every template
    /// (`bos_token`, `eos_token`, …). `format` overrides content-format detection.
    pub fn new(
        source: String,
        special_tokens: Map<String, Json>,
        format: Option<ContentFormat>,
    ) -> Result<Self, TokenizeError> {
        let format = format.unwrap_or_else(|| detect_content_format(&source));
        let system_first = requires_system_first(&source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(py_methods);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", py_trim_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let source = strip_generation_tags(&source);
        let lazy_source = lazy_concat_source(&source);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        // NOTE: a rewrite that does not compile (syntax this reading of Jinja missed) only
        // costs the speed-up; the original template compiled above.
        let lazy = lazy_source.is_some_and(|lazy| {
            env.add_function(CONCAT_FUNCTION, lazy_concat);
            env.add_template_owned(LAZY_TEMPLATE_NAME, lazy).is_ok()
        });
        Ok(Self {
            env,
            format,
            system_first,
            lazy,
            lazy_record: LazyConcatRecord::default(),
            #[cfg(test)]
            lazy_tries: Default::default(),
            special_tokens,
        })
    }

    /// The same template rendered only as written (tests compare the two renders).
    #[cfg(test)]
    pub(super) fn without_lazy_concat(mut self) -> Self {
        self.lazy = false;
        self
    }

    /// How many renders the rewritten template gave (see `template_concat`).
    #[cfg(test)]
    pub(super) fn lazy_renders(&self) -> u64 {
        self.lazy_record.hits()
    }

    /// How many renders tried the rewritten template.
    #[cfg(test)]
    pub(super) fn lazy_tries(&self) -> u64 {
        self.lazy_tries.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The content format messages are passed in.
    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Whether the template rejects a non-leading system message (vLLM's
    /// `_detect_merge_inline_system`, see [`requires_system_first`]).
    pub fn requires_system_first(&self) -> bool {
        self.system_first
    }

    /// Renders `chat` to the prompt text the server will tokenize.
    pub fn render(&self, chat: &ChatPrompt) -> Result<String, TokenizeError> {
        let merged;
        let source_messages = if chat.merge_inline_system && self.system_first {
            merged = merge_system_messages(&chat.messages);
            &merged
        } else {
            &chat.messages
        };
        let messages = template_messages(source_messages, self.format);
        let mut ctx: Map<String, Json> = chat.chat_template_kwargs.clone();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), v.clone());
        }
        let final_text = if chat.continue_final_message {
            Some(final_message_text(messages.last()).ok_or_else(|| {
                TokenizeError::Template(
                    "continue_final_message: no text in the last message".into(),
                )
            })?)
        } else {
            None
        };
        ctx.remove("messages");
        ctx.insert(
            "tools".into(),
            chat.tools.clone().map(Json::Array).unwrap_or(Json::Null),
        );
        ctx.insert("documents".into(), Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(chat.add_generation_prompt),
        );
        // NOTE: the output buffer is sized for the messages' text up front: growing it by
        // doubling re-copied a 400 KB prompt about once more and faulted in fresh pages.
        let text_bytes: usize = source_messages
            .iter()
            .flat_map(|m| text_parts(&m.content))
            .map(str::len)
            .sum();
        let mut out = Vec::with_capacity(text_bytes.saturating_add(RENDER_SLACK_BYTES));
        let context = Value::from_serialize(RenderContext {
            vars: &ctx,
            messages: &messages,
        });
        // The rewritten template first; any error there (an operand of + that is not a
        // string, or the template's own) is the original template's to give or not.
        let try_lazy = self.lazy && self.lazy_record.worth_trying();
        #[cfg(test)]
        if try_lazy {
            self.lazy_tries
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let lazy_rendered = try_lazy
            && self
                .env
                .get_template(LAZY_TEMPLATE_NAME)
                .is_ok_and(|lazy| lazy.render_captured_to(context.clone(), &mut out).is_ok());
        if lazy_rendered {
            self.lazy_record.hit();
        } else {
            out.clear();
            self.env
                .get_template(TEMPLATE_NAME)
                .map_err(|e| TokenizeError::Template(e.to_string()))?
                .render_captured_to(context, &mut out)
                .map_err(|e| TokenizeError::Template(error_chain(&e)))?;
            if try_lazy {
                self.lazy_record.miss();
            }
        }
        let rendered = String::from_utf8(out)
            .map_err(|e| TokenizeError::Template(format!("rendered prompt is not UTF-8: {e}")))?;
        match final_text {
            Some(text) => cut_after_final_message(rendered, &text),
            None => Ok(rendered),
        }
    }
}

/// Room for the template's own text (role markers, tools, system prompt) in the output buffer.
const RENDER_SLACK_BYTES: usize = 16 << 10;

/// vLLM's `AnthropicServingMessages._detect_merge_inline_system`: renders a
/// `[system, user, system, user]` conversation (string contents `"t"`, no generation prompt)
/// in a bare sandboxed Jinja environment and reports whether that fails. The environment has
/// jinja2's syntax settings but none of HF's globals (`raise_exception`, `strftime_now`) nor
/// the `{% generation %}` extension, so a template using them also counts as system-first,
/// exactly as in vLLM.
pub fn requires_system_first(source: &str) -> bool {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(py_methods);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", py_trim_filter);
    let ctx = json!({
        "messages": [
            {"role": "system", "content": "t"},
            {"role": "user", "content": "t"},
            {"role": "system", "content": "t"},
            {"role": "user", "content": "t"},
        ],
        "add_generation_prompt": false,
    });
    env.render_str(source, Value::from_serialize(&ctx)).is_err()
}

/// The Anthropic merge (vLLM's `_convert_system_message` with `merge_inline_system`): the text
/// of every system message, in order and joined with `""`, becomes one leading system message;
/// the other messages keep their order.
fn merge_system_messages(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    let (system, rest): (Vec<&ChatMessage>, Vec<&ChatMessage>) =
        messages.iter().partition(|m| m.role == "system");
    let mut out = Vec::with_capacity(rest.len() + 1);
    if let Some(first) = system.first() {
        let text: String = system.iter().flat_map(|m| text_parts(&m.content)).collect();
        let mut leading = (*first).clone();
        leading.content = MessageContent::Text(text);
        out.push(leading);
    }
    out.extend(rest.into_iter().cloned());
    out
}

/// vLLM's `_strip_claude_code_billing_header`, applied to every `system` message by its chat
/// stage: a text part starting with [`crate::request::BILLING_HEADER`] loses its first line,
/// and is dropped when nothing follows it.
fn strip_billing_header(content: &MessageContent) -> Option<MessageContent> {
    let strip = |t: &str| -> Option<Option<String>> {
        if !t.starts_with(BILLING_HEADER) {
            return None;
        }
        let rest = t.split_once('\n').map_or("", |(_, rest)| rest);
        Some((!rest.is_empty()).then(|| rest.to_owned()))
    };
    match content {
        MessageContent::Null => None,
        MessageContent::Text(t) => strip(t)
            .map(|rest| MessageContent::Parts(rest.map(ContentPart::Text).into_iter().collect())),
        MessageContent::Parts(parts) => {
            let mut changed = false;
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                match p {
                    ContentPart::Text(t) => match strip(t) {
                        None => out.push(p.clone()),
                        Some(rest) => {
                            changed = true;
                            out.extend(rest.map(ContentPart::Text));
                        }
                    },
                    ContentPart::Media(_) => out.push(p.clone()),
                }
            }
            changed.then_some(MessageContent::Parts(out))
        }
    }
}

fn error_chain(e: &Error) -> String {
    match e.detail() {
        Some(d) => d.to_string(),
        None => e.to_string(),
    }
}

/// transformers' `AssistantTracker` extension adds `{% generation %}…{% endgeneration %}` (it only
/// marks assistant tokens; the body renders unchanged). minijinja does not know the tag, so it
/// becomes `{% if true %}…{% endif %}`, keeping the tags' whitespace control.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (head, tail) = rest.split_at(start);
        out.push_str(head);
        let Some(end) = tail.find("%}") else {
            rest = tail;
            break;
        };
        let (tag, after) = tail.split_at(end + 2);
        let inner = tag.get(2..tag.len() - 2).unwrap_or("");
        let word = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => out.push_str(&tag.replacen(word, r, 1)),
            None => out.push_str(tag),
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// vLLM's detection: "openai" when the template loops over a message's content (directly or
/// through a macro argument named like it). NOTE: vLLM walks the Jinja AST; this looks at the
/// `for … in <expr>` statements' iterables for a `content` identifier, which agrees on the
/// templates seen in the wild; [`ChatTemplate::new`] takes an explicit override.
pub fn detect_content_format(source: &str) -> ContentFormat {
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = rest.get(start + 2..).unwrap_or("");
        let end = after.find("%}").unwrap_or(after.len());
        let stmt = after
            .get(..end)
            .unwrap_or("")
            .trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if let Some(f) = stmt.strip_prefix("for ")
            && let Some((_, iter)) = f.split_once(" in ")
        {
            // `for x in xs if cond` / `for x in xs recursive`: only the iterable counts.
            let iter = iter.split(" if ").next().unwrap_or(iter);
            let mentions_content = iter
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .any(|w| w == "content");
            if mentions_content {
                return ContentFormat::OpenAi;
            }
        }
        rest = after.get(end..).unwrap_or("");
    }
    ContentFormat::String
}

fn text_parts(content: &MessageContent) -> Vec<&str> {
    match content {
        MessageContent::Null => Vec::new(),
        MessageContent::Text(s) => vec![s.as_str()],
        MessageContent::Parts(parts) => parts
            .iter()
            .filter_map(|p| match p {
                ContentPart::Text(t) => Some(t.as_str()),
                ContentPart::Media(_) => None,
            })
            .collect(),
    }
}

/// The messages exactly as vLLM hands them to the template (DESIGN §3.1).
pub fn vllm_messages(messages: &[ChatMessage], format: ContentFormat) -> Vec<Json> {
    template_messages(messages, format)
        .iter()
        .map(|m| serde_json::to_value(m).unwrap_or(Json::Null))
        .collect()
}

/// The template context: `vars` (kwargs, special tokens, tools…) plus `messages`.
struct RenderContext<'a> {
    vars: &'a Map<String, Json>,
    messages: &'a [TemplateMessage<'a>],
}

impl Serialize for RenderContext<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.vars.len() + 1))?;
        for (k, v) in self.vars {
            map.serialize_entry(k, v)?;
        }
        map.serialize_entry("messages", self.messages)?;
        map.end()
    }
}

/// One message as the template sees it, borrowing the request's text: serialised straight
/// into the template's values, so a huge message is copied once, not first into a JSON tree.
/// NOTE: field order is the key order vLLM's dicts have (it shows in `tojson`/`items()`).
#[derive(Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: TemplateContent<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<TemplateToolCall<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum TemplateContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<TemplatePart<'a>>),
}

#[derive(Serialize)]
#[serde(untagged)]
enum TemplatePart<'a> {
    Text {
        #[serde(rename = "type")]
        kind: &'static str,
        text: Cow<'a, str>,
    },
    Media {
        #[serde(rename = "type")]
        kind: &'static str,
    },
}

#[derive(Serialize)]
struct TemplateToolCall<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type")]
    kind: &'static str,
    function: TemplateFunction<'a>,
}

#[derive(Serialize)]
struct TemplateFunction<'a> {
    name: &'a str,
    arguments: &'a Json,
}

fn template_messages(messages: &[ChatMessage], format: ContentFormat) -> Vec<TemplateMessage<'_>> {
    messages
        .iter()
        .map(|m| {
            let stripped = if m.role == "system" {
                strip_billing_header(&m.content)
            } else {
                None
            };
            let content = match stripped {
                Some(owned) => owned_template_content(&owned, &m.role, format),
                None => template_content(&m.content, &m.role, format),
            };
            TemplateMessage {
                role: &m.role,
                content,
                tool_call_id: m.tool_call_id.as_deref(),
                tool_calls: m.tool_calls.as_ref().map(|calls| {
                    calls
                        .iter()
                        .map(|c| TemplateToolCall {
                            id: c.id.as_deref(),
                            kind: "function",
                            function: TemplateFunction {
                                name: &c.name,
                                arguments: &c.arguments,
                            },
                        })
                        .collect()
                }),
                name: m.name.as_deref(),
                reasoning_content: m.reasoning_content.as_deref(),
            }
        })
        .collect()
}

/// Content as the template sees it: one string (`string` format, and always for `tool`
/// messages: parts joined with `\n`) or OpenAI parts.
fn template_content<'a>(
    content: &'a MessageContent,
    role: &str,
    format: ContentFormat,
) -> TemplateContent<'a> {
    if role == "tool" || format == ContentFormat::String {
        let mut texts = text_parts(content);
        return TemplateContent::Text(if texts.len() == 1 {
            Cow::Borrowed(texts.pop().unwrap_or(""))
        } else {
            Cow::Owned(texts.join("\n"))
        });
    }
    TemplateContent::Parts(match content {
        MessageContent::Null => Vec::new(),
        MessageContent::Text(s) => vec![TemplatePart::Text {
            kind: "text",
            text: Cow::Borrowed(s),
        }],
        MessageContent::Parts(parts) => parts
            .iter()
            .map(|p| match p {
                ContentPart::Text(t) => TemplatePart::Text {
                    kind: "text",
                    text: Cow::Borrowed(t),
                },
                ContentPart::Media(kind) => TemplatePart::Media { kind },
            })
            .collect(),
    })
}

/// [`template_content`] for content rewritten here (owned by the caller's temporary).
fn owned_template_content(
    content: &MessageContent,
    role: &str,
    format: ContentFormat,
) -> TemplateContent<'static> {
    match template_content(content, role, format) {
        TemplateContent::Text(t) => TemplateContent::Text(Cow::Owned(t.into_owned())),
        TemplateContent::Parts(parts) => TemplateContent::Parts(
            parts
                .into_iter()
                .map(|p| match p {
                    TemplatePart::Text { kind, text } => TemplatePart::Text {
                        kind,
                        text: Cow::Owned(text.into_owned()),
                    },
                    TemplatePart::Media { kind } => TemplatePart::Media { kind },
                })
                .collect(),
        ),
    }
}

/// The text transformers continues from: a string content, or the last part with `text`.
fn final_message_text(last: Option<&TemplateMessage<'_>>) -> Option<String> {
    match &last?.content {
        TemplateContent::Text(s) => Some(s.to_string()),
        TemplateContent::Parts(parts) => parts.iter().rev().find_map(|p| match p {
            TemplatePart::Text { text, .. } => Some(text.to_string()),
            TemplatePart::Media { .. } => None,
        }),
    }
}

/// transformers' `continue_final_message` cut: end the prompt right after the final message's
/// text (its stripped form when the template trimmed it).
fn cut_after_final_message(rendered: String, final_message: &str) -> Result<String, TokenizeError> {
    let stripped = py_strip(final_message, None);
    let Some(loc) = rendered.rfind(stripped) else {
        return Err(TokenizeError::Template(
            "continue_final_message: the final message does not appear in the rendered chat".into(),
        ));
    };
    let lstripped = py_lstrip(final_message);
    let end_keep = loc + lstripped.len();
    let cut = if rendered.get(loc..end_keep) == Some(final_message) {
        end_keep
    } else {
        loc + stripped.len()
    };
    let mut rendered = rendered;
    rendered.truncate(cut.min(rendered.len()));
    Ok(rendered)
}

/// Python's `str.isspace` (Rust's `char::is_whitespace` plus U+001C..U+001F).
pub fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn py_strip<'a>(s: &'a str, chars: Option<&str>) -> &'a str {
    match chars {
        Some(set) => s.trim_matches(|c| set.contains(c)),
        None => s.trim_matches(py_is_space),
    }
}

fn py_lstrip(s: &str) -> &str {
    s.trim_start_matches(py_is_space)
}

/// `trim`/`strip` as a filter. NOTE: a string with nothing to strip is returned as the same
/// value (no copy): the message text of a huge prompt passes through it.
fn py_trim_filter(value: &Value, chars: Option<String>) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let stripped = py_strip(s, chars.as_deref());
        if stripped.len() == s.len() {
            return Ok(value.clone());
        }
        return Ok(Value::from(stripped));
    }
    let s = <String as minijinja::value::ArgType>::from_value(Some(value))?;
    Ok(Value::from(py_strip(&s, chars.as_deref())))
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(pyjson::dumps(&value, indent)))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn py_methods(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let chars = match args {
            [] => None,
            [c] if c.is_none() => None,
            [c] => c.as_str(),
            _ => {
                return minijinja_contrib::pycompat::unknown_method_callback(
                    state, value, method, args,
                );
            }
        };
        let out = match (method, chars) {
            ("strip", c) => Some(py_strip(s, c)),
            ("lstrip", None) => Some(s.trim_start_matches(py_is_space)),
            ("rstrip", None) => Some(s.trim_end_matches(py_is_space)),
            ("lstrip", Some(set)) => Some(s.trim_start_matches(|c| set.contains(c))),
            ("rstrip", Some(set)) => Some(s.trim_end_matches(|c| set.contains(c))),
            _ => None,
        };
        if let Some(out) = out {
            return Ok(Value::from(out));
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// HF's `strftime_now(format)` (UTC). Supports the directives chat templates use.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(secs, &format)
}

/// Formats UNIX time `secs` (UTC) with a strftime subset.
pub fn strftime(secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (H. Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let month_name = MONTHS.get((month - 1) as usize).copied().unwrap_or("");
    let day_name = DAYS
        .get((days.rem_euclid(7)) as usize)
        .copied()
        .unwrap_or("");
    let mut out = String::new();
    let mut it = format.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') => match it.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o);
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(month_name.get(..3).unwrap_or("")),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(day_name.get(..3).unwrap_or("")),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests;
