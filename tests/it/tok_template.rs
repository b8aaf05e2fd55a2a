//! Chat rendering and registry behaviour beyond the captures: multi-turn, tools, unicode,
//! whitespace, continue_final_message, raise_exception, tojson, LoRA and approximate mode.

use std::path::PathBuf;
use std::sync::LazyLock;

use kvpick::request::{self, Prompt};
use kvpick::tokenize::{
    ApproximateReason, ChatTemplate, ContentFormat, PromptTokens, Tokenizers, TokenizersConfig,
};
use serde_json::{Map, Value, json};

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer")
}

static REGISTRY: LazyLock<prometheus::Registry> = LazyLock::new(prometheus::Registry::new);

/// One load per test binary: model `tiny`, LoRA `tiny-lora` on it, no default.
static TOKENIZERS: LazyLock<Tokenizers> = LazyLock::new(|| {
    Tokenizers::new(
        TokenizersConfig {
            models: vec![("tiny".into(), tokenizer_dir())],
            lora_bases: vec![("tiny-lora".into(), "tiny".into())],
            prefix_cache_bytes: 16 << 20,
            ..Default::default()
        },
        &REGISTRY,
    )
    .expect("load assets/tokenizer")
});

fn chat_body(v: Value) -> request::InferenceRequest {
    request::parse("/v1/chat/completions", v.to_string().as_bytes()).unwrap()
}

fn render(v: Value) -> String {
    let req = chat_body(v);
    let Prompt::Chat(chat) = &req.prompt else {
        panic!("not chat")
    };
    TOKENIZERS
        .tokenizer_for("tiny")
        .unwrap()
        .render(chat)
        .unwrap()
}

/// Renders, then checks the ids equal a plain encode of the expected text.
fn assert_renders(v: Value, expected: &str) {
    assert_eq!(render(v.clone()), expected);
    let req = chat_body(v);
    let want = TOKENIZERS
        .tokenizer_for("tiny")
        .unwrap()
        .tokenizer()
        .encode(expected, false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(TOKENIZERS.prompt_tokens(&req), PromptTokens::Exact(want));
}

#[test]
fn multi_turn_without_system_uses_the_default_and_trims_turns() {
    assert_renders(
        json!({"model": "tiny", "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "  How are you?  \n"}
        ]}),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n\
         <|im_start|>assistant\n",
    );
}

#[test]
fn tools_and_tool_calls_are_serialised_like_python() {
    assert_renders(
        json!({"model": "tiny", "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1,\"b\":\"é\",\"c\":[1.5,true]}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}
        ], "tools": [{"type": "function", "function": {"name": "f", "extra": 1,
            "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "<a & b>"}}}}}],
           "add_generation_prompt": false}),
        "<|im_start|>system\nS\n\n# Tools\n\nYou may call functions. Their signatures are inside <tools></tools>:\n<tools>\n\
         {\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": null, \"parameters\": \
         {\"type\": \"object\", \"properties\": {\"q\": {\"type\": \"string\", \"description\": \"<a & b>\"}}}}}\n\
         </tools>\n\nReturn each call as JSON inside <tool_call></tool_call>.<|im_end|>\n\
         <|im_start|>user\nq<|im_end|>\n\
         <|im_start|>assistant\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": \"é\", \"c\": [1.5, true]}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\nr1\nr2\n</tool_response><|im_end|>\n",
    );
}

#[test]
fn unicode_and_whitespace_runs_trim_like_python() {
    assert_renders(
        json!({"model": "tiny", "messages": [
            {"role": "system", "content": "  keep  "},
            {"role": "user", "content": "\u{1c}\u{3000}  한국어 텍스트\t\t  emoji 👩‍👩‍👧 🇰🇷 e\u{301} \u{3000} end\n\n\n   \u{1f}"}
        ]}),
        "<|im_start|>system\n  keep  <|im_end|>\n<|im_start|>user\n한국어 텍스트\t\t  emoji 👩‍👩‍👧 🇰🇷 e\u{301} \u{3000} end<|im_end|>\n\
         <|im_start|>assistant\n",
    );
}

#[test]
fn continue_final_message_cuts_after_the_trimmed_text() {
    assert_renders(
        json!({"model": "tiny", "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Say it"},
            {"role": "assistant", "content": "The answer is "}
        ], "add_generation_prompt": false, "continue_final_message": true}),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\nThe answer is",
    );
}

#[test]
fn raise_exception_makes_the_prompt_approximate_not_a_failure() {
    let req = chat_body(json!({"model": "tiny", "messages": [
        {"role": "user", "content": "a"}, {"role": "system", "content": "late"}]}));
    let Prompt::Chat(chat) = &req.prompt else {
        panic!()
    };
    let err = TOKENIZERS
        .tokenizer_for("tiny")
        .unwrap()
        .render(chat)
        .unwrap_err();
    assert!(
        err.to_string().contains("System messages are only allowed"),
        "{err}"
    );
    match TOKENIZERS.prompt_tokens(&req) {
        PromptTokens::Approximate(a) => assert_eq!(a.reason, ApproximateReason::TemplateError),
        other => panic!("{other:?}"),
    }
}

#[test]
fn lora_adapters_use_their_base_tokenizer_and_unknown_models_are_approximate() {
    let body = json!({"model": "tiny-lora", "prompt": "hello world"}).to_string();
    let req = request::parse("/v1/completions", body.as_bytes()).unwrap();
    assert_eq!(
        TOKENIZERS.prompt_tokens(&req),
        PromptTokens::Exact(vec![14990, 1879])
    );
    TOKENIZERS.register_lora("late-lora", "tiny");
    assert!(TOKENIZERS.tokenizer_for("late-lora").is_some());
    assert_eq!(TOKENIZERS.lora_base("late-lora").as_deref(), Some("tiny"));
    assert_eq!(TOKENIZERS.lora_base("tiny"), None);

    let body = json!({"model": "mystery", "prompt": "abcdefgh"}).to_string();
    let req = request::parse("/v1/completions", body.as_bytes()).unwrap();
    for _ in 0..2 {
        match TOKENIZERS.prompt_tokens(&req) {
            PromptTokens::Approximate(a) => {
                assert_eq!(a.reason, ApproximateReason::NoTokenizer);
                assert_eq!(a.chunks(3), ["abc", "def"]);
            }
            other => panic!("{other:?}"),
        }
    }
    let counted: f64 = REGISTRY
        .gather()
        .iter()
        .filter(|f| f.name() == "kvpick_tokenize_approximate_total")
        .flat_map(|f| f.get_metric().iter().map(|m| m.get_counter().get_value()))
        .sum();
    assert!(counted >= 2.0, "approximate counter {counted}");
    let ids = request::parse("/v1/completions", br#"{"model":"mystery","prompt":[5,6]}"#).unwrap();
    assert_eq!(
        TOKENIZERS.prompt_tokens(&ids),
        PromptTokens::Exact(vec![5, 6])
    );
}

#[test]
fn template_environment_is_python_compatible() {
    let mut special = Map::new();
    special.insert("bos_token".into(), json!("<s>"));
    let source = "{{ bos_token }}{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ ' a '.strip() }}|\
                  {% for m in messages %}{{ m.content }};{% endfor %}|{{ 'a\u{1c}'.rstrip() }}|{{ d.items() | list | length }}"
        .to_string();
    let t = ChatTemplate::new(source, special, None).unwrap();
    assert_eq!(t.content_format(), ContentFormat::String);
    let mut kwargs = Map::new();
    kwargs.insert("x".into(), json!({"b": 1.0, "a": "<é>"}));
    kwargs.insert("d".into(), json!({"k": 1, "j": 2}));
    let req = chat_body(json!({"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]}]}));
    let Prompt::Chat(mut chat) = req.prompt else {
        panic!()
    };
    chat.chat_template_kwargs = kwargs;
    assert_eq!(
        t.render(&chat).unwrap(),
        "<s>{\"b\": 1.0, \"a\": \"<é>\"}|{\n  \"b\": 1.0,\n  \"a\": \"<é>\"\n}|a|p1\np2;|a|2"
    );
}

fn exact(req: &request::InferenceRequest) -> Vec<u32> {
    match TOKENIZERS.prompt_tokens(req) {
        PromptTokens::Exact(ids) => ids,
        other => panic!("not exact: {other:?}"),
    }
}

#[test]
fn responses_and_anthropic_bodies_tokenize_like_the_equivalent_chat() {
    let chat = chat_body(json!({"model": "tiny", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"}
    ]}));
    let responses = request::parse(
        "/v1/responses",
        json!({"model": "tiny", "instructions": "Be brief.", "input": "What is 2+2?"})
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    let anthropic = request::parse(
        "/v1/messages",
        json!({"model": "tiny", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
               "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let want = exact(&chat);
    assert!(!want.is_empty());
    assert_eq!(exact(&responses), want);
    assert_eq!(exact(&anthropic), want);
}

#[test]
fn prompts_differing_inside_a_multibyte_character_at_an_anchor_boundary() {
    // Two prompts identical up to the middle of a 2-byte character that straddles byte 1024
    // (the prefix cache's anchor size) and again at other offsets: ids must be exact.
    for offset in [1023usize, 1024, 1025, 2047, 2100] {
        let filler = "x ".repeat(offset / 2) + &"y".repeat(offset % 2);
        let a = format!("{filler}é and more text after it");
        let b = format!("{filler}ê and more text after it");
        assert_eq!(a.as_bytes()[..offset], b.as_bytes()[..offset]);
        for text in [&a, &b, &a] {
            let body = json!({"model": "tiny", "prompt": text}).to_string();
            let req = request::parse("/v1/completions", body.as_bytes()).unwrap();
            let want = TOKENIZERS
                .tokenizer_for("tiny")
                .unwrap()
                .tokenizer()
                .encode(text.as_str(), true)
                .unwrap()
                .get_ids()
                .to_vec();
            assert_eq!(exact(&req), want, "offset {offset}");
        }
    }
}

#[test]
fn default_dir_serves_unknown_models_and_a_broken_template_only_degrades_chat() {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        tokenizer_dir().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}broken").unwrap();
    let tok = Tokenizers::new(
        TokenizersConfig {
            default_dir: Some(dir.path().to_path_buf()),
            prefix_cache_bytes: 1 << 20,
            ..Default::default()
        },
        &prometheus::Registry::new(),
    )
    .unwrap();
    let req = request::parse(
        "/v1/completions",
        br#"{"model":"anything","prompt":"hello world"}"#,
    )
    .unwrap();
    assert_eq!(
        tok.prompt_tokens(&req),
        PromptTokens::Exact(vec![14990, 1879])
    );
    let req =
        chat_body(json!({"model": "anything", "messages": [{"role": "user", "content": "hi"}]}));
    match tok.prompt_tokens(&req) {
        PromptTokens::Approximate(a) => {
            assert_eq!(a.reason, ApproximateReason::NoTemplate);
            assert!(a.text.contains("hi"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn flags_and_thread_safety() {
    let mut cfg = TokenizersConfig::default();
    cfg.add_flag("tiny=/models/tiny");
    cfg.add_flag("/models/default");
    assert_eq!(
        cfg.models,
        vec![("tiny".to_string(), PathBuf::from("/models/tiny"))]
    );
    assert_eq!(cfg.default_dir, Some(PathBuf::from("/models/default")));
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizers>();
    assert_send_sync::<kvpick::request::InferenceRequest>();
}
