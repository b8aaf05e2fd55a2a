//! Request parsing through the public `kvpick::request` API.

use crate::support::paths;

use kvpick::request::{
    ApiKind, ContentPart, MessageContent, ParseLimits, Prompt, RequestError, parse,
    parse_with_limits, rewrite_model,
};
use serde_json::json;

fn chat(body: serde_json::Value) -> kvpick::request::ChatPrompt {
    let req = parse("/v1/chat/completions", body.to_string().as_bytes()).unwrap();
    assert_eq!(req.api, ApiKind::ChatCompletions);
    match req.prompt {
        Prompt::Chat(c) => c,
        other => panic!("not chat: {other:?}"),
    }
}

#[test]
fn completions_prompt_shapes() {
    let r = parse(
        "/v1/completions?x=1",
        br#"{"model":"m","prompt":"hi","stream":true,"cache_salt":"s","priority":-2,"extra":{"a":[1]}}"#,
    )
    .unwrap();
    assert_eq!(r.api, ApiKind::Completions);
    assert_eq!(r.model, "m");
    assert_eq!(r.prompt, Prompt::Texts(vec!["hi".into()]));
    assert!(r.stream && r.add_special_tokens);
    assert_eq!(r.cache_salt.as_deref(), Some("s"));
    assert_eq!(r.priority, Some(-2));
    let r = parse("/v1/completions", br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::Texts(vec!["a".into(), "b".into()]));
    let r = parse("/v1/completions", br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::TokenIds(vec![vec![1, 2, 3]]));
    let r = parse("/v1/completions", br#"{"model":"m","prompt":[[1],[2,3]]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::TokenIds(vec![vec![1], vec![2, 3]]));
    assert!(matches!(
        parse("/v1/completions", br#"{"model":"m","prompt":[1,-1]}"#),
        Err(RequestError::InvalidField { .. })
    ));
    let r = parse("/v1/embeddings", br#"{"model":"m","input":"x"}"#).unwrap();
    assert_eq!(
        (r.api, r.prompt),
        (ApiKind::Embeddings, Prompt::Texts(vec!["x".into()]))
    );
}

#[test]
fn bad_bodies_are_refused_with_a_reason() {
    let p = "/v1/completions";
    assert!(matches!(
        parse(p, b"{\"model\":\"\xff\"}"),
        Err(RequestError::NotUtf8 { offset: 10 })
    ));
    assert_eq!(
        parse(p, br#"{"model":"m","prompt":"ab"#),
        Err(RequestError::Truncated)
    );
    assert_eq!(
        parse(p, br#"{"model":"m","prompt":[1,2"#),
        Err(RequestError::Truncated)
    );
    assert!(matches!(
        parse(p, br#"{"model":"m",,}"#),
        Err(RequestError::NotJson { .. })
    ));
    assert_eq!(parse(p, br#"[1]"#), Err(RequestError::NotAnObject));
    assert_eq!(
        parse(p, br#"{"prompt":"x"}"#),
        Err(RequestError::MissingModel)
    );
    assert_eq!(parse(p, br#"{"model":7}"#), Err(RequestError::InvalidModel));
    assert_eq!(
        parse(p, br#"{"model":""}"#),
        Err(RequestError::InvalidModel)
    );
    let deep = format!(
        "{{\"model\":\"m\",\"x\":{}{}}}",
        "[".repeat(100),
        "]".repeat(100)
    );
    assert_eq!(
        parse(p, deep.as_bytes()),
        Err(RequestError::TooDeep { max_depth: 64 })
    );
    let limits = ParseLimits {
        max_depth: 64,
        max_array_len: 1000,
    };
    let ids: Vec<String> = (0..1001).map(|i| i.to_string()).collect();
    let huge = format!("{{\"model\":\"m\",\"prompt\":[{}]}}", ids.join(","));
    assert_eq!(
        parse_with_limits(p, huge.as_bytes(), limits),
        Err(RequestError::ArrayTooLong { max_len: 1000 })
    );
    assert!(!RequestError::Truncated.reason().is_empty());
}

#[test]
fn chat_messages_tools_and_flags() {
    let c = chat(json!({
        "model": "m",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "sys"}]},
            {"role": "user", "content": ["a", {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}
        ],
        "tools": [{"type": "function", "function": {"parameters": {"z": 1, "a": 2}, "name": "f", "x": 1}}],
        "add_generation_prompt": false,
        "continue_final_message": true,
        "chat_template_kwargs": {"enable_thinking": false}
    }));
    assert_eq!(c.messages.len(), 4);
    assert_eq!(c.messages[0].role, "developer");
    assert_eq!(
        c.messages[1].content,
        MessageContent::Parts(vec![
            ContentPart::Text("a".into()),
            ContentPart::Media("image"),
            ContentPart::Text("b".into())
        ])
    );
    let calls = c.messages[2].tool_calls.as_ref().unwrap();
    assert_eq!(calls[0].arguments, json!({"a": 1}));
    assert_eq!(calls[1].arguments, json!({}));
    assert_eq!(c.messages[2].content, MessageContent::Null);
    assert_eq!(c.messages[3].tool_call_id.as_deref(), Some("c1"));
    let tool = serde_json::to_string(&c.tools.unwrap()[0]).unwrap();
    assert_eq!(
        tool,
        r#"{"type":"function","function":{"name":"f","description":null,"parameters":{"z":1,"a":2}}}"#
    );
    assert!(!c.add_generation_prompt && c.continue_final_message);
    assert_eq!(
        c.chat_template_kwargs.get("enable_thinking"),
        Some(&json!(false))
    );
}

#[test]
fn responses_and_anthropic_become_chat() {
    let r = parse(
        "/v1/responses",
        json!({"model": "m", "instructions": "be brief", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call", "call_id": "1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "1", "output": "42"}
        ]})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let Prompt::Chat(c) = r.prompt else { panic!() };
    let roles: Vec<_> = c.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    assert_eq!(c.messages[3].content, MessageContent::Text("42".into()));

    let r = parse(
        "/v1/messages",
        json!({"model": "m", "system": "s", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}
        ], "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(r.api, ApiKind::AnthropicMessages);
    let Prompt::Chat(c) = r.prompt else { panic!() };
    let roles: Vec<_> = c.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    assert_eq!(
        c.messages[2].tool_calls.as_ref().unwrap()[0].arguments,
        json!({"x": 1})
    );
    assert_eq!(
        c.tools.unwrap()[0]["function"]["parameters"],
        json!({"type": "object"})
    );
}

#[test]
fn unknown_paths_guess_from_shape() {
    let r = parse(
        "/generate",
        br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
    )
    .unwrap();
    assert_eq!(r.api, ApiKind::Other);
    assert!(matches!(r.prompt, Prompt::Chat(_)));
    let r = parse("/x", br#"{"model":"m","prompt":"p"}"#).unwrap();
    assert_eq!(r.prompt, Prompt::Texts(vec!["p".into()]));
    let r = parse("/debug/prefix", br#"{"model":"m","token_ids":[7,8]}"#).unwrap();
    assert_eq!(r.prompt, Prompt::TokenIds(vec![vec![7, 8]]));
    let r = parse("/x", br#"{"model":"m"}"#).unwrap();
    assert_eq!(r.prompt, Prompt::None);
}

#[test]
fn model_rewrite_keeps_every_other_byte_on_fixture_bodies() {
    let path = paths::fixtures().join("vllm-0.32-kv-events/requests.jsonl");
    let text = std::fs::read_to_string(path).unwrap();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let body = serde_json::to_string_pretty(&v["body"]).unwrap();
        let out = rewrite_model(body.as_bytes(), "new-model").unwrap();
        let expected = body.replacen("\"model\": \"tiny\"", "\"model\": \"new-model\"", 1);
        assert_eq!(std::str::from_utf8(&out).unwrap(), expected);
        let parsed = parse("/v1/chat/completions", &out);
        if let Ok(r) = parsed {
            assert_eq!(r.model, "new-model");
        }
    }
}

#[test]
fn odd_responses_and_messages_shapes_parse_without_panicking() {
    // Shapes vLLM answers with 400 or treats specially: kvpick must neither panic nor fail the
    // request where a prompt can still be read.
    let responses = [
        json!({"model": "m", "input": [{"type": "reasoning"}, {"type": "function_call"}]}),
        json!({"model": "m", "input": [{"type": "custom_tool_call", "input": 5}, {"type": "x"}]}),
        json!({"model": "m", "input": [{"role": "assistant", "content": [7, {"text": 1}]}]}),
        json!({"model": "m", "input": [{"type": "message", "status": "incomplete"}]}),
        json!({"model": "m", "input": "x", "tools": [{"type": "namespace", "tools": 3},
            {"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f"}]},
            {"type": "custom", "name": "c"}, {"type": "web_search"}]}),
    ];
    for body in responses {
        let r = parse("/v1/responses", body.to_string().as_bytes()).unwrap();
        assert!(matches!(r.prompt, Prompt::Chat(_)), "{body}");
    }
    let messages = [
        json!({"model": "m", "system": [{"type": "image"}, {"text": 3}], "messages": []}),
        json!({"model": "m", "messages": [{"role": "system", "content": [{"type": "text"}]},
            {"role": "assistant", "content": [{"type": "tool_result", "content": {"a": [1.5]}}]},
            {"role": "user", "content": [{"type": "tool_result", "content": [3, {"type": "image"}]}]},
            {"role": "user", "content": [{"type": "thinking", "thinking": 1}]}]}),
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "t", "input_schema": 5, "strict": null, "defer_loading": false}]}),
    ];
    for body in messages {
        let r = parse("/v1/messages", body.to_string().as_bytes()).unwrap();
        assert!(matches!(r.prompt, Prompt::Chat(_)), "{body}");
    }
}

#[test]
fn anthropic_inline_system_is_left_in_place_for_the_template_to_merge() {
    let body = json!({"model": "m", "system": [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
        "messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "C."},
                     {"role": "system", "content": "x-anthropic-billing-header: 1"}]});
    let r = parse("/v1/messages", body.to_string().as_bytes()).unwrap();
    let Prompt::Chat(chat) = r.prompt else {
        panic!("not chat")
    };
    assert!(chat.merge_inline_system);
    let roles: Vec<(&str, &MessageContent)> = chat
        .messages
        .iter()
        .map(|m| (m.role.as_str(), &m.content))
        .collect();
    assert_eq!(
        roles,
        vec![
            ("system", &MessageContent::Text("A.B.".into())),
            ("user", &MessageContent::Text("u".into())),
            ("system", &MessageContent::Text("C.".into())),
        ]
    );
}
