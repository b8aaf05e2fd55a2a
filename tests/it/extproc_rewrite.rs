//! Model rewrites and the gateway's response modes, driven through the ext-proc stream's
//! real gRPC interface by a plain client (harness in `extproc_stream`): a rewritten model is
//! restored in JSON and streamed responses (across chunk cuts), a gateway in STREAMED
//! response mode gets chunk answers without the bytes back, and without a rewrite responses
//! pass through with their length.

use crate::extproc_stream::*;
use crate::support::extproc::{headers, streamed_body};

use kvpick::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use kvpick::pb::envoy::service::ext_proc::v3::{ProcessingResponse, processing_response::Response};
use kvpick::request::ModelRewriteRules;

fn removed_response_headers(reply: &ProcessingResponse) -> Vec<String> {
    match &reply.response {
        Some(Response::ResponseHeaders(h)) => h
            .response
            .as_ref()
            .and_then(|c| c.header_mutation.as_ref())
            .map(|m| m.remove_headers.clone())
            .unwrap_or_default(),
        other => panic!("expected response headers reply, got {other:?}"),
    }
}

#[tokio::test]
async fn model_rewrite_changes_only_the_model_and_restores_it_in_json_responses() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(headers(
        &[
            (":path", "/v1/completions"),
            ("x-gateway-model-name-rewrite", "served-model-v2"),
        ],
        false,
    ))
    .await;
    let sent = br#"{"prompt": "keep   these bytes", "model" : "alias", "n":1}"#;
    s.send(body(sent, true)).await;
    let d = decision(&s.recv().await);
    assert_eq!(d.removed, ["x-gateway-model-name-rewrite"]);
    let (forwarded, eos) = streamed_body(&s.recv().await);
    assert!(eos);
    let expected = br#"{"prompt": "keep   these bytes", "model" : "served-model-v2", "n":1}"#;
    assert_eq!(forwarded, expected.to_vec());
    assert_eq!(d.content_length, Some(expected.len().to_string()));

    s.send(response_headers()).await;
    assert_eq!(
        removed_response_headers(&s.recv().await),
        ["content-length"]
    );
    let answer = br#"{"id":"x","model":"served-model-v2","choices":[]}"#;
    s.send(response_body(&answer[..20], false)).await;
    assert_eq!(
        streamed_body(&s.recv().await),
        (Vec::new(), false),
        "held until complete"
    );
    s.send(response_body(&answer[20..], true)).await;
    let (restored, eos) = streamed_body(&s.recv().await);
    assert!(eos);
    assert_eq!(
        restored,
        br#"{"id":"x","model":"alias","choices":[]}"#.to_vec()
    );
    assert_eq!(h.in_flight_total(), 0);
}

#[tokio::test]
async fn model_rewrite_restores_the_name_in_streamed_responses_across_chunk_cuts() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(headers(
        &[
            (":path", "/v1/chat/completions"),
            ("x-gateway-model-name-rewrite", "target"),
        ],
        false,
    ))
    .await;
    s.send(body(
        br#"{"model":"alias","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        true,
    ))
    .await;
    decision(&s.recv().await);
    streamed_body(&s.recv().await);
    s.send(response_headers()).await;
    assert_eq!(
        removed_response_headers(&s.recv().await),
        ["content-length"]
    );
    let sse = b"data: {\"model\":\"target\",\"x\":1}\n\ndata: {\"model\":\"target\",\"x\":2}\n\ndata: [DONE]\n\n";
    let mut out = Vec::new();
    for (i, piece) in sse.chunks(7).enumerate() {
        let last = (i + 1) * 7 >= sse.len();
        s.send(response_body(piece, last)).await;
        let (bytes, eos) = streamed_body(&s.recv().await);
        out.extend_from_slice(&bytes);
        assert_eq!(eos, last);
    }
    assert_eq!(
        String::from_utf8(out).expect("utf8"),
        "data: {\"model\":\"alias\",\"x\":1}\n\ndata: {\"model\":\"alias\",\"x\":2}\n\ndata: [DONE]\n\n"
    );
}

/// What a reply to a response body chunk in Envoy's `STREAMED` mode does: `None` continues
/// the chunk Envoy holds, `Some(bytes)` replaces it.
fn streamed_mode_answer(reply: &ProcessingResponse) -> Option<Vec<u8>> {
    use kvpick::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
    let Some(Response::ResponseBody(body)) = &reply.response else {
        panic!("expected a response body reply, got {reply:?}");
    };
    match body
        .response
        .as_ref()
        .and_then(|c| c.body_mutation.as_ref())
    {
        None => None,
        Some(mutation) => match &mutation.mutation {
            Some(Mutation::Body(bytes)) => Some(bytes.to_vec()),
            other => panic!("STREAMED mode takes whole-chunk replacements, got {other:?}"),
        },
    }
}

/// Opens a stream whose first message declares STREAMED response bodies (as Envoy's
/// `protocol_config` does), sends a POST with `rewrite` as the model-rewrite header and
/// `request_body`, takes the pick and the forwarded body, then sends the response headers;
/// returns the stream and the headers the reply to them removed.
async fn streamed_mode_stream(
    h: &mut Harness,
    rewrite: Option<&str>,
    request_body: &[u8],
) -> (Stream, Vec<String>) {
    let mut request_headers = vec![(":method", "POST"), (":path", "/v1/completions")];
    request_headers.extend(rewrite.map(|model| ("x-gateway-model-name-rewrite", model)));
    let mut s = h
        .open_in_mode(headers(&request_headers, false), BodySendMode::Streamed)
        .await;
    s.send(body(request_body, true)).await;
    decision(&s.recv().await);
    streamed_body(&s.recv().await);
    s.send(response_headers()).await;
    let removed = removed_response_headers(&s.recv().await);
    (s, removed)
}

#[tokio::test]
async fn a_gateway_in_streamed_response_mode_gets_chunk_answers_without_the_bytes_back() {
    let mut h = start(Options::default()).await;

    // No rewrite: each chunk is continued as Envoy holds it (nothing sent back).
    let (mut s, removed) = streamed_mode_stream(&mut h, None, BODY).await;
    assert!(removed.is_empty());
    for (chunk, last) in [
        (&b"data: a\n\n"[..], false),
        (&b"data: [DONE]\n\n"[..], true),
    ] {
        s.send(response_body(chunk, last)).await;
        assert_eq!(streamed_mode_answer(&s.recv().await), None);
    }

    // A rewritten model in a JSON answer: held (empty replacements), restored at the end.
    let request = br#"{"prompt": "p", "model": "alias"}"#;
    let (mut s, removed) = streamed_mode_stream(&mut h, Some("served-model-v2"), request).await;
    assert_eq!(removed, ["content-length"]);
    let answer = br#"{"id":"x","model":"served-model-v2","choices":[]}"#;
    s.send(response_body(&answer[..20], false)).await;
    assert_eq!(
        streamed_mode_answer(&s.recv().await),
        Some(Vec::new()),
        "held"
    );
    s.send(response_body(&answer[20..], true)).await;
    assert_eq!(
        streamed_mode_answer(&s.recv().await),
        Some(br#"{"id":"x","model":"alias","choices":[]}"#.to_vec())
    );

    // SSE: each chunk answered with its rewritten complete lines.
    let request = br#"{"prompt": "p", "model": "alias", "stream": true}"#;
    let (mut s, removed) = streamed_mode_stream(&mut h, Some("target"), request).await;
    assert_eq!(removed, ["content-length"]);
    let sse = b"data: {\"model\":\"target\",\"x\":1}\n\ndata: [DONE]\n\n";
    let mut out = Vec::new();
    for (i, piece) in sse.chunks(9).enumerate() {
        let last = (i + 1) * 9 >= sse.len();
        s.send(response_body(piece, last)).await;
        let answer = streamed_mode_answer(&s.recv().await);
        out.extend_from_slice(&answer.unwrap_or_else(|| piece.to_vec()));
    }
    assert_eq!(
        String::from_utf8(out).expect("utf8"),
        "data: {\"model\":\"alias\",\"x\":1}\n\ndata: [DONE]\n\n"
    );
    assert_eq!(h.in_flight_total(), 0);
}

#[tokio::test]
async fn without_a_rewrite_responses_pass_through_with_their_length() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(post_headers()).await;
    s.send(body(BODY, true)).await;
    decision(&s.recv().await);
    streamed_body(&s.recv().await);
    s.send(response_headers()).await;
    assert!(removed_response_headers(&s.recv().await).is_empty());
}

#[tokio::test]
async fn configured_rewrite_rules_apply_and_the_header_wins() {
    let rewrites: ModelRewriteRules = serde_yaml::from_str(
        "rules:\n- matches: [alias]\n  targets: [{modelRewrite: ruled, weight: 1}]\n",
    )
    .expect("rules");
    let mut h = start(Options {
        rewrites,
        ..Options::default()
    })
    .await;
    let mut s = h.open().await;
    s.send(post_headers()).await;
    s.send(body(br#"{"model":"alias","prompt":"x"}"#, true))
        .await;
    decision(&s.recv().await);
    assert_eq!(
        streamed_body(&s.recv().await).0,
        br#"{"model":"ruled","prompt":"x"}"#.to_vec()
    );

    let mut s = h.open().await;
    s.send(headers(
        &[
            (":path", "/v1/completions"),
            ("x-gateway-model-name-rewrite", "by-header"),
        ],
        false,
    ))
    .await;
    s.send(body(br#"{"model":"alias","prompt":"x"}"#, true))
        .await;
    decision(&s.recv().await);
    assert_eq!(
        streamed_body(&s.recv().await).0,
        br#"{"model":"by-header","prompt":"x"}"#.to_vec()
    );
}
