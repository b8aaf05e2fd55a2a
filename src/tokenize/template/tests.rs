use super::*;
use crate::request::{self, Prompt};

#[test]
fn detects_content_loops() {
    assert_eq!(
        detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}"),
        ContentFormat::String
    );
    assert_eq!(
        detect_content_format("{%- for part in message['content'] -%}{{ part.text }}{%- endfor %}"),
        ContentFormat::OpenAi
    );
    assert_eq!(
        detect_content_format("{% for m in messages if m.content %}{{ m.content }}{% endfor %}"),
        ContentFormat::String
    );
}

#[test]
fn generation_tags_render_their_body() {
    let t = ChatTemplate::new(
        "a{%- generation -%} b {%- endgeneration %}c".into(),
        Map::new(),
        None,
    )
    .unwrap();
    let chat = ChatPrompt {
        messages: Vec::new(),
        tools: None,
        add_generation_prompt: false,
        continue_final_message: false,
        chat_template_kwargs: Map::new(),
        merge_inline_system: false,
    };
    assert_eq!(t.render(&chat).unwrap(), "abc");
}

#[test]
fn system_first_probe_follows_vllm() {
    // The shipped Qwen2-style template raises on a non-leading system message.
    let qwen = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/assets/tokenizer/chat_template.jinja"
    ))
    .unwrap();
    assert!(requires_system_first(&qwen));
    // A template that renders any order does not.
    let loose = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    assert!(!requires_system_first(loose));
    // vLLM's probe environment has no HF globals and no `generation` tag: both count.
    assert!(requires_system_first(
        "{% for m in messages %}{{ strftime_now('%Y') }}{% endfor %}"
    ));
    assert!(requires_system_first(
        "{% for m in messages %}{% generation %}x{% endgeneration %}{% endfor %}"
    ));
    let t = ChatTemplate::new(loose.into(), Map::new(), None).unwrap();
    assert!(!t.requires_system_first());
}

fn msg(role: &str, text: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: MessageContent::Text(text.into()),
        name: None,
        tool_call_id: None,
        tool_calls: None,
        reasoning_content: None,
    }
}

#[test]
fn inline_system_merges_only_when_asked_and_required() {
    let strict = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
        {{ raise_exception('system first') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    let loose = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    let mut chat = ChatPrompt {
        messages: vec![
            msg("system", "A."),
            msg("user", "u1"),
            msg("system", "B."),
            msg("user", "u2"),
        ],
        tools: None,
        add_generation_prompt: false,
        continue_final_message: false,
        chat_template_kwargs: Map::new(),
        merge_inline_system: true,
    };
    let strict = ChatTemplate::new(strict.into(), Map::new(), Some(ContentFormat::String)).unwrap();
    let loose = ChatTemplate::new(loose.into(), Map::new(), Some(ContentFormat::String)).unwrap();
    assert_eq!(
        strict.render(&chat).unwrap(),
        "<system>A.B.<user>u1<user>u2"
    );
    assert_eq!(
        loose.render(&chat).unwrap(),
        "<system>A.<user>u1<system>B.<user>u2"
    );
    chat.merge_inline_system = false;
    assert!(strict.render(&chat).is_err());
}

#[test]
fn billing_header_line_is_stripped_from_system_messages_only() {
    let header = "x-anthropic-billing-header: cch=1;";
    let only = strip_billing_header(&MessageContent::Text(header.into()));
    assert_eq!(only, Some(MessageContent::Parts(Vec::new())));
    let with_rest =
        strip_billing_header(&MessageContent::Text(format!("{header}\nBe brief.\nOk.")));
    assert_eq!(
        with_rest,
        Some(MessageContent::Parts(vec![ContentPart::Text(
            "Be brief.\nOk.".into()
        )]))
    );
    assert_eq!(
        strip_billing_header(&MessageContent::Text("Be brief.".into())),
        None
    );
    let messages = vllm_messages(
        &[msg("system", header), msg("user", header)],
        ContentFormat::String,
    );
    assert_eq!(messages[0]["content"], "");
    assert_eq!(messages[1]["content"], header);
}

#[test]
fn strftime_subset() {
    // 2024-02-29 13:05:09 UTC, a Thursday.
    assert_eq!(
        strftime(1_709_211_909, "%d %b %Y %-d %B %A %H:%M:%S %%"),
        "29 Feb 2024 29 February Thursday 13:05:09 %"
    );
}

// The template with its + chains rewritten (`template_concat`) against it as written.

fn chat(body: serde_json::Value) -> request::ChatPrompt {
    let body = serde_json::to_vec(&body).expect("json");
    match request::parse("/v1/chat/completions", &body)
        .expect("parse")
        .prompt
    {
        Prompt::Chat(chat) => chat,
        other => panic!("not a chat: {other:?}"),
    }
}

/// Renders every conversation with `source` rewritten and as written; both must give
/// the same text or both fail. Returns how many renders the rewrite served itself.
fn renders_alike(source: &str, conversations: &[serde_json::Value]) -> usize {
    let new = || ChatTemplate::new(source.to_owned(), serde_json::Map::new(), None);
    let (lazy, plain) = (new().expect("compiles"), new().expect("compiles"));
    let plain = plain.without_lazy_concat();
    for conversation in conversations {
        let prompt = chat(json!({"model": "m", "messages": conversation}));
        let (a, b) = (lazy.render(&prompt), plain.render(&prompt));
        match (&a, &b) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{source}\n{conversation}"),
            (Err(_), Err(_)) => {}
            _ => panic!("{source}\n{conversation}\nrewritten: {a:?}\nas written: {b:?}"),
        }
    }
    assert_eq!(plain.lazy_renders(), 0);
    lazy.lazy_renders() as usize
}

fn conversations() -> Vec<serde_json::Value> {
    vec![
        json!([{"role": "user", "content": "hi"}]),
        json!([
            {"role": "system", "content": "  sys\n"},
            {"role": "user", "content": " a + b }} {{ c "},
            {"role": "assistant", "content": "ok\t"},
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
        ]),
        json!([
            {"role": "user", "content": "call"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
            ]},
            {"role": "tool", "tool_call_id": "1", "content": "42"},
            {"role": "tool", "tool_call_id": "1", "content": ""}
        ]),
        json!([{"role": "user", "content": ""}, {"role": "system", "content": "late"}]),
        json!([{"role": "wizard", "content": "?"}]),
    ]
}

#[test]
fn the_shipped_template_renders_the_same_with_and_without_the_rewrite() {
    let source = std::fs::read_to_string(
        crate::test_paths::repo_root().join("assets/tokenizer/chat_template.jinja"),
    )
    .expect("template");
    assert!(lazy_concat_source(&source).is_some(), "it has + chains");
    // Two of the five fail in both (a late system message, an unknown role).
    assert_eq!(renders_alike(&source, &conversations()), 3);
}

#[test]
fn operands_that_are_not_all_strings_fall_back_to_the_template_as_written() {
    let cases = [
        // Numbers add and lists concatenate: the rewrite declines, the original renders.
        ("{{ 1 + 2 }}{{ 'a' + messages[0].role }}", 0),
        ("{{ [1] + [2] }}|{{ messages | length + 1 }}", 0),
        // none + a string fails either way.
        ("{{ messages[0].content + none }}", 0),
        // Macros, loops, filters and whitespace control around chains.
        (
            "{% macro m(x) %}<{{ x + '!' }}>{% endmacro %}{{- m(messages[0].role) + m('b') -}}",
            5,
        ),
        (
            "{%- for m in messages -%}{{- m.role + ': ' + (m.content if m.content is string else '') | trim + '\n' -}}{%- endfor -%}",
            5,
        ),
        // JSON autoescape serialises the printed value: the same string either way.
        (
            "{% autoescape 'json' %}{{ messages[0].role + '\"x' }}{% endautoescape %}",
            5,
        ),
        // Not a chain at the top level: left as written, rendered alike.
        (
            "{{ 'a' + 'b' if messages else 'c' }}{{ ('x' + 'y') | upper }}",
            0,
        ),
    ];
    for (source, served) in cases {
        assert_eq!(renders_alike(source, &conversations()), served, "{source}");
    }
}

#[test]
fn a_template_adding_numbers_in_every_render_stops_trying_the_rewrite() {
    let t = ChatTemplate::new(
        "{{ messages | length + 1 }}{{ 'a' + 'b' }}".to_owned(),
        serde_json::Map::new(),
        None,
    )
    .expect("compiles");
    let prompt = chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}));
    for _ in 0..40 {
        assert_eq!(t.render(&prompt).expect("renders"), "2ab");
    }
    assert_eq!(t.lazy_tries(), 17, "tried until it missed 17 times");
}
