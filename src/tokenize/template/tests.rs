use super::*;

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
