//! Request bodies Envoy holds (`request_body_mode: BUFFERED`), driven through the real gRPC
//! interface by a plain client: the headers are continued at once, the whole body comes as
//! one message, and its answer carries the pick as header mutations and metadata with no
//! body bytes back unless the model was rewritten (`src/extproc/request_body.rs`).

use crate::extproc_stream::{
    BODY, body, body_decision, decision, post_headers, response_body, response_headers, start,
};
use crate::support::extproc::headers;

use kvpick::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use kvpick::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpTrailers, ProcessingResponse, body_mutation, processing_request::Request,
    processing_response::Response,
};

/// The common part of an answer to a request body (panics on any other answer).
fn body_answer(reply: &ProcessingResponse) -> &CommonResponse {
    match &reply.response {
        Some(Response::RequestBody(b)) => b.response.as_ref().expect("common response"),
        other => panic!("expected a request body answer, got {other:?}"),
    }
}

/// The headers are continued at once with nothing changed (Envoy holds them).
fn assert_plain_continue(reply: &ProcessingResponse) {
    match &reply.response {
        Some(Response::RequestHeaders(h)) => assert!(
            h.response
                .as_ref()
                .is_none_or(|c| c.header_mutation.is_none()),
            "headers continued unchanged: {h:?}"
        ),
        other => panic!("expected the headers continued, got {other:?}"),
    }
    assert!(reply.dynamic_metadata.is_none(), "no pick before the body");
}

#[tokio::test]
async fn a_held_body_is_answered_with_the_pick_and_no_bytes_back() {
    let mut h = start(Default::default()).await;
    let mut s = h
        .open_with_modes(
            headers(
                &[
                    (":method", "POST"),
                    (":path", "/v1/completions"),
                    ("x-gateway-inference-objective", "critical"),
                ],
                false,
            ),
            BodySendMode::Buffered,
            BodySendMode::FullDuplexStreamed,
        )
        .await;
    assert_plain_continue(&s.recv().await);
    assert_eq!(h.in_flight_total(), 0, "nothing picked at the headers");

    let filler = "y".repeat(200_000);
    let big = format!(r#"{{"model":"m","prompt":"{filler}"}}"#).into_bytes();
    s.send(body(&big, true)).await;
    let reply = s.recv().await;
    let d = body_decision(&reply);
    assert_eq!(d.destination, d.metadata_destination);
    assert!(
        h.datastore
            .snapshot()
            .get(d.destination.parse().expect("id"))
            .is_some()
    );
    assert!(d.clear_route_cache, "the route follows the header");
    assert!(
        body_answer(&reply).body_mutation.is_none(),
        "no body bytes back"
    );
    assert_eq!(d.content_length, None, "the held body's length stands");
    assert_eq!(d.removed, ["x-gateway-inference-objective"]);
    assert_eq!(h.in_flight_total(), 1, "counted from the pick");
    assert_eq!(h.metrics.buffered_bytes.get(), 0, "body budget returned");
    assert_eq!(h.budget.available(), 4 << 20);

    // The response passes as in full duplex.
    s.send(response_headers()).await;
    assert!(matches!(
        s.recv().await.response,
        Some(Response::ResponseHeaders(_))
    ));
    s.send(response_body(b"{}", true)).await;
    s.recv().await;
    assert_eq!(h.in_flight_total(), 0, "response end releases the endpoint");
}

#[tokio::test]
async fn a_rewritten_model_replaces_the_held_body_with_a_matching_length() {
    let mut h = start(Default::default()).await;
    let mut s = h
        .open_with_modes(
            headers(
                &[
                    (":path", "/v1/completions"),
                    ("x-gateway-model-name-rewrite", "served-model-v2"),
                ],
                false,
            ),
            BodySendMode::Buffered,
            BodySendMode::None,
        )
        .await;
    assert_plain_continue(&s.recv().await);
    s.send(body(
        br#"{"prompt": "keep   these", "model" : "alias"}"#,
        true,
    ))
    .await;
    let reply = s.recv().await;
    let answer = body_answer(&reply);
    let expected = br#"{"prompt": "keep   these", "model" : "served-model-v2"}"#;
    match answer
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(body_mutation::Mutation::Body(b)) => assert_eq!(&b[..], &expected[..]),
        other => panic!("expected the whole body replaced, got {other:?}"),
    }
    // Envoy refuses a replaced body whose content-length does not match.
    assert_eq!(
        body_decision(&reply).content_length,
        Some(expected.len().to_string())
    );
    // Split (the response goes to the observing filter): the pick is handed over.
    assert!(
        reply
            .dynamic_metadata
            .as_ref()
            .is_some_and(|m| m.fields.contains_key("kvpick.pick")),
        "hand-off in the body's answer"
    );
}

#[tokio::test]
async fn trailers_after_a_held_body_are_answered_after_the_pick() {
    let mut h = start(Default::default()).await;
    let mut s = h
        .open_with_modes(post_headers(), BodySendMode::Buffered, BodySendMode::None)
        .await;
    assert_plain_continue(&s.recv().await);
    // Without end of stream: trailers follow, and Envoy sends them once this is answered.
    s.send(body(BODY, false)).await;
    let reply = s.recv().await;
    let d = body_decision(&reply);
    assert_eq!(d.destination, d.metadata_destination);
    s.send(Request::RequestTrailers(HttpTrailers::default()))
        .await;
    assert!(matches!(
        s.recv().await.response,
        Some(Response::RequestTrailers(_))
    ));
    // The routing stream is then done (split): kvpick ends it.
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), s.rx.message())
        .await
        .expect("ended in time");
    assert!(matches!(end, Ok(None)), "stream ended cleanly: {end:?}");
}

#[tokio::test]
async fn a_bodyless_request_is_answered_at_its_headers() {
    let mut h = start(Default::default()).await;
    let mut s = h
        .open_with_modes(
            headers(&[(":method", "GET"), (":path", "/v1/models")], true),
            BodySendMode::Buffered,
            BodySendMode::FullDuplexStreamed,
        )
        .await;
    let d = decision(&s.recv().await);
    assert_eq!(d.destination, d.metadata_destination);
    assert_eq!(h.in_flight_total(), 1);
}

#[tokio::test]
async fn modes_that_send_the_headers_before_the_body_is_in_are_refused_with_the_reason() {
    let mut h = start(Default::default()).await;
    for mode in [BodySendMode::Streamed, BodySendMode::BufferedPartial] {
        let mut s = h
            .open_with_modes(post_headers(), mode, BodySendMode::None)
            .await;
        let status = s.recv_status().await;
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
        assert!(
            status.message().contains(mode.as_str_name()) && status.message().contains("BUFFERED"),
            "{}",
            status.message()
        );
    }
    assert_eq!(h.in_flight_total(), 0);
}

#[tokio::test]
async fn a_refused_held_body_ends_the_stream_without_waiting_for_its_trailers() {
    let mut h = start(Default::default()).await;
    let mut s = h
        .open_with_modes(post_headers(), BodySendMode::Buffered, BodySendMode::None)
        .await;
    assert_plain_continue(&s.recv().await);
    // Trailers would follow, but the body is refused: Envoy sends nothing after a local reply.
    s.send(body(b"{not json", false)).await;
    match s.recv().await.response {
        Some(Response::ImmediateResponse(reply)) => {
            assert_eq!(reply.status.map(|s| s.code), Some(400));
        }
        other => panic!("expected 400, got {other:?}"),
    }
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), s.rx.message())
        .await
        .expect("ended without trailers");
    assert!(matches!(end, Ok(None)), "stream ended cleanly: {end:?}");
    assert_eq!(h.metrics.buffered_bytes.get(), 0);
}
