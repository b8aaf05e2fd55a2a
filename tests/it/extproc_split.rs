//! kvpick's work split over two ext_proc filters (`src/extproc/handoff.rs`), driven through
//! the real gRPC interface by a plain client: a routing stream whose gateway sends no
//! response ends at its decision and hands the pick over in `kvpick.pick` metadata; an
//! observing stream (`observability_mode`) follows the response from that hand-off and
//! never answers.

use crate::extproc_stream::{
    Harness, Options, Stream, body, decision, response_body, response_headers, start,
};
use crate::support::extproc::headers;

use std::time::Duration;

use kvpick::pb::envoy::config::core::v3::Metadata;
use kvpick::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use kvpick::pb::envoy::service::ext_proc::v3::{ProcessingRequest, processing_request::Request};
use kvpick::pb::google::protobuf::{Struct, value::Kind};

const STREAMED_BODY: &[u8] = br#"{"model": "m", "prompt": "once upon a time", "stream": true}"#;

fn completion_headers() -> Request {
    headers(&[(":method", "POST"), (":path", "/v1/completions")], false)
}

/// A routing stream as Envoy opens it when the response goes to another filter.
async fn routed_in_split_mode(h: &mut Harness, request: &[u8]) -> (Stream, String, Struct) {
    let mut s = h
        .open_in_mode(completion_headers(), BodySendMode::None)
        .await;
    s.send(body(request, true)).await;
    let reply = s.recv().await;
    let destination = decision(&reply).destination;
    let handoff = match reply
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get("kvpick.pick"))
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StructValue(fields)) => fields.clone(),
        other => panic!("no kvpick.pick hand-off in the decision: {other:?}"),
    };
    s.recv().await; // the body
    (s, destination, handoff)
}

/// The metadata Envoy forwards on an observing stream: the `kvpick.pick` namespace.
fn forwarded(handoff: &Struct) -> Metadata {
    let mut metadata = Metadata::default();
    metadata
        .filter_metadata
        .insert("kvpick.pick".to_owned(), handoff.clone());
    metadata
}

/// Sends an observing stream's message (as Envoy does in observability mode).
async fn observe(s: &Stream, request: Request, handoff: Option<&Struct>) {
    let metadata = handoff.map(forwarded);
    let encoded = metadata
        .as_ref()
        .map(kvpick::extproc::dynamic_metadata::encode)
        .unwrap_or_default();
    send_observed(s, request, encoded).await;
}

/// Sends an observing stream's message with `metadata_context` as raw bytes.
/// The response's last chunk as an OpenAI stream ends: usage (7 prompt tokens) and `[DONE]`.
async fn observe_last_chunk_with_usage(s: &Stream, handoff: &Struct) {
    observe(
        s,
        response_body(
            b"data: {\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n",
            true,
        ),
        Some(handoff),
    )
    .await;
}

async fn observe_raw(s: &Stream, request: Request, metadata: &'static [u8]) {
    send_observed(s, request, bytes::Bytes::from_static(metadata)).await;
}

async fn send_observed(s: &Stream, request: Request, metadata_context: bytes::Bytes) {
    s.tx.send(ProcessingRequest {
        request: Some(request),
        metadata_context,
        observability_mode: true,
        ..Default::default()
    })
    .await
    .expect("send");
}

/// The server ends the stream without having sent anything.
async fn ends_silently(s: &mut Stream) {
    let next = tokio::time::timeout(Duration::from_secs(5), s.rx.message())
        .await
        .expect("the stream ends in time");
    assert!(
        matches!(next, Ok(None)),
        "an observing stream gets no answer: {next:?}"
    );
}

async fn wait_in_flight(h: &Harness, want: u64) {
    for _ in 0..400 {
        if h.in_flight_total() == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("in flight stayed {} (want {want})", h.in_flight_total());
}

/// Waits until `want` picks' reservations were taken over by their observing streams.
async fn wait_taken(h: &Harness, want: u64) {
    for _ in 0..400 {
        if reservations(h, "taken") == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "{} reservations taken (want {want})",
        reservations(h, "taken")
    );
}

fn reservations(h: &Harness, result: &str) -> u64 {
    h.metrics
        .pick_reservations
        .with_label_values(&[result])
        .get()
}

fn observed(h: &Harness, result: &str) -> u64 {
    h.metrics
        .observed_streams
        .with_label_values(&[result])
        .get()
}

/// The observed response of a streamed request picked for `endpoint`: a first chunk and the
/// last one with usage; the stream then ends silently, its first byte timed, its usage read
/// and nothing left in flight.
async fn streams_its_response(h: &Harness, s: &mut Stream, handoff: &Struct, endpoint: &str) {
    let first_bytes = h.metrics.ttft.observed.get_sample_count();
    observe(
        s,
        response_body(b"data: {\"x\":1}\n\n", false),
        Some(handoff),
    )
    .await;
    observe_last_chunk_with_usage(s, handoff).await;
    ends_silently(s).await;
    assert_eq!(h.in_flight_total(), 0, "the response's end ends it");
    assert_eq!(
        h.metrics.ttft.observed.get_sample_count(),
        first_bytes + 1,
        "its first byte was timed"
    );
    assert_eq!(
        h.metrics.prompt_tokens.with_label_values(&[endpoint]).get(),
        7,
        "its usage was read"
    );
}

#[tokio::test]
async fn the_routing_stream_ends_at_its_decision_and_the_observing_stream_follows_the_response() {
    let mut h = start(Options::default()).await;
    let (mut routing, destination, handoff) = routed_in_split_mode(&mut h, STREAMED_BODY).await;
    let pick = kvpick::extproc::handoff::PickHandoff::from_metadata(Some(&forwarded(&handoff)))
        .expect("a readable hand-off")
        .expect("a hand-off");
    let endpoint = pick.endpoint.to_string();
    assert_eq!(
        destination.split(',').next(),
        Some(endpoint.as_str()),
        "the hand-off names the picked pod"
    );
    assert!(pick.streamed, "the client asked for a stream: {pick:?}");
    assert!(
        pick.reservation.is_some(),
        "the pick was reserved: {pick:?}"
    );
    // The gateway sends nothing more on it: kvpick closes it; the pick stays counted on its
    // pod, reserved for the observing stream.
    let next = tokio::time::timeout(Duration::from_secs(5), routing.rx.message())
        .await
        .expect("routing stream ends");
    assert!(matches!(next, Ok(None)), "routing stream ended: {next:?}");
    assert_eq!(h.in_flight_total(), 1);
    assert_eq!(h.datastore.pending().len(), 1);

    let mut s = h.open().await;
    observe(&s, completion_headers(), Some(&handoff)).await;
    wait_taken(&h, 1).await;
    assert_eq!(h.in_flight_total(), 1, "taken over, not doubled");
    assert!(h.datastore.pending().is_empty());
    assert_eq!(observed(&h, "observed"), 1);
    // Envoy forwards the namespace with every message of the stream, as here.
    observe(&s, response_headers(), Some(&handoff)).await;
    streams_its_response(&h, &mut s, &handoff, &endpoint).await;
}

/// An observing filter may skip response headers: the response then starts with its body.
#[tokio::test]
async fn an_observing_stream_without_response_headers_follows_the_response_from_its_body() {
    let mut h = start(Options::default()).await;
    let (_routing, destination, handoff) = routed_in_split_mode(&mut h, STREAMED_BODY).await;
    let endpoint = destination.split(',').next().expect("a pod").to_owned();
    let mut s = h.open().await;
    observe(&s, completion_headers(), Some(&handoff)).await;
    wait_in_flight(&h, 1).await;
    streams_its_response(&h, &mut s, &handoff, &endpoint).await;
}

#[tokio::test]
async fn a_response_that_ends_after_its_pod_left_counts_no_tokens_for_it() {
    let mut h = start(Options::default()).await;
    let (_routing, _, handoff) = routed_in_split_mode(&mut h, STREAMED_BODY).await;
    let mut s = h.open().await;
    observe(&s, completion_headers(), Some(&handoff)).await;
    wait_in_flight(&h, 1).await;
    // The pod leaves the pool (a rollout) while its response drains.
    h.datastore
        .set_endpoints(vec![kvpick::endpoints::Endpoint::new(
            "10.9.9.9:8000".parse().expect("addr"),
        )]);
    observe(&s, response_headers(), Some(&handoff)).await;
    observe_last_chunk_with_usage(&s, &handoff).await;
    ends_silently(&mut s).await;
    assert_eq!(h.in_flight_total(), 0, "the response's end still ends it");
    // Its per-endpoint series were removed with it; counting would bring them back.
    use prometheus::core::Collector;
    let series: usize = [&h.metrics.prompt_tokens, &h.metrics.cached_prompt_tokens]
        .iter()
        .flat_map(|counter| counter.collect())
        .map(|family| family.get_metric().len())
        .sum();
    assert_eq!(series, 0);
}

#[tokio::test]
async fn observing_streams_without_a_usable_hand_off_are_counted_and_closed() {
    let mut h = start(Options::default()).await;
    let (_routing, _, handoff) = routed_in_split_mode(&mut h, STREAMED_BODY).await;

    // No hand-off (the request failed open): nothing to follow.
    let mut s = h.open().await;
    observe(&s, completion_headers(), None).await;
    ends_silently(&mut s).await;
    assert_eq!(observed(&h, "not_routed"), 1);

    // A response with no request headers before it (kvpick answered the request itself).
    let mut s = h.open().await;
    observe(&s, response_headers(), None).await;
    ends_silently(&mut s).await;
    assert_eq!(observed(&h, "not_routed"), 2);

    // A hand-off that does not parse.
    let mut bad = handoff.clone();
    let Some(Kind::StringValue(pick)) = bad.fields.get_mut("pick").and_then(|v| v.kind.as_mut())
    else {
        panic!("the hand-off is one `pick` string: {handoff:?}");
    };
    *pick = pick.chars().take(pick.chars().count() / 2).collect();
    let mut s = h.open().await;
    observe(&s, completion_headers(), Some(&bad)).await;
    ends_silently(&mut s).await;
    assert_eq!(observed(&h, "bad_handoff"), 1);

    // A pod that left the pool since the pick.
    h.datastore
        .set_endpoints(vec![kvpick::endpoints::Endpoint::new(
            "10.9.9.9:8000".parse().expect("addr"),
        )]);
    let mut s = h.open().await;
    observe(&s, completion_headers(), Some(&handoff)).await;
    ends_silently(&mut s).await;
    assert_eq!(observed(&h, "unknown_endpoint"), 1);
    assert_eq!(observed(&h, "observed"), 0);
    assert_eq!(h.in_flight_total(), 0);
}

#[tokio::test]
async fn an_observing_stream_that_breaks_mid_response_returns_what_it_counted() {
    let mut h = start(Options::default()).await;
    let (_routing, _, handoff) = routed_in_split_mode(&mut h, STREAMED_BODY).await;
    let s = h.open().await;
    observe(&s, completion_headers(), Some(&handoff)).await;
    observe(&s, response_headers(), None).await;
    observe(&s, response_body(b"data: {\"x\":1}\n\n", false), None).await;
    wait_taken(&h, 1).await;
    wait_in_flight(&h, 1).await;
    drop(s);
    wait_in_flight(&h, 0).await;
}

/// Not a `Metadata`: field 1 (`filter_metadata`) claims 100 bytes and carries 2.
const TRUNCATED_METADATA: &[u8] = &[0x0a, 100, 1, 2];

#[tokio::test]
async fn forwarded_metadata_is_read_where_it_is_used_and_a_broken_one_there_ends_the_stream() {
    let mut h = start(Options::default()).await;
    let (_routing, _, handoff) = routed_in_split_mode(&mut h, STREAMED_BODY).await;

    // Request headers carry the hand-off: undecodable metadata there ends the stream with
    // INVALID_ARGUMENT, and nothing is counted.
    let mut s = h.open().await;
    observe_raw(&s, completion_headers(), TRUNCATED_METADATA).await;
    let ended = tokio::time::timeout(Duration::from_secs(5), s.rx.message())
        .await
        .expect("the stream ends");
    match ended {
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
            assert!(status.message().contains("metadata_context"), "{status:?}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    assert_eq!(
        h.in_flight_total(),
        1,
        "the pick's reservation, nothing more"
    );
    assert_eq!(reservations(&h, "taken"), 0);

    // A response chunk's copy of the metadata is not read: the response is followed to its
    // end whatever the chunks carry.
    let mut s = h.open().await;
    observe(&s, completion_headers(), Some(&handoff)).await;
    wait_in_flight(&h, 1).await;
    let first_bytes = h.metrics.ttft.observed.get_sample_count();
    observe_raw(&s, response_headers(), TRUNCATED_METADATA).await;
    observe_raw(
        &s,
        response_body(b"data: {\"x\":1}\n\ndata: [DONE]\n\n", true),
        TRUNCATED_METADATA,
    )
    .await;
    ends_silently(&mut s).await;
    assert_eq!(h.in_flight_total(), 0, "the response's end ends it");
    assert_eq!(
        h.metrics.ttft.observed.get_sample_count(),
        first_bytes + 1,
        "its first byte was timed"
    );
}

/// A burst: one connection reads its messages in order, so every pick of a burst is made
/// before any of their observing streams is read. Each pick counts on its pod from its
/// decision, so the next one sees it (least-in-flight spreads six picks two per pod; counted
/// only from the observing streams, all six saw idle pods), and the observing streams take
/// those counts over instead of doubling them.
#[tokio::test]
async fn picks_made_before_their_observing_streams_see_each_other() {
    let mut h = start(Options::default()).await;
    let mut handoffs = Vec::new();
    for _ in 0..6 {
        let (_routing, _, handoff) = routed_in_split_mode(&mut h, STREAMED_BODY).await;
        handoffs.push(handoff);
    }
    let pool = h.datastore.snapshot();
    let per_pod = |count: fn(&kvpick::endpoints::InFlight) -> u64| -> Vec<u64> {
        pool.endpoints.iter().map(|e| count(&e.in_flight)).collect()
    };
    assert_eq!(per_pod(kvpick::endpoints::InFlight::get), [2, 2, 2]);
    assert_eq!(
        per_pod(kvpick::endpoints::InFlight::local),
        [0, 0, 0],
        "reservations are not told to the other replicas"
    );

    let mut observing = Vec::new();
    for handoff in &handoffs {
        let s = h.open().await;
        observe(&s, completion_headers(), Some(handoff)).await;
        observing.push(s);
    }
    wait_taken(&h, 6).await;
    assert_eq!(per_pod(kvpick::endpoints::InFlight::get), [2, 2, 2]);
    assert_eq!(per_pod(kvpick::endpoints::InFlight::local), [2, 2, 2]);
    assert!(h.datastore.pending().is_empty());

    // Another replica's pick (a token this replica never issued) is counted afresh.
    let mut foreign =
        kvpick::extproc::handoff::PickHandoff::from_metadata(Some(&forwarded(&handoffs[0])))
            .expect("readable")
            .expect("a hand-off");
    foreign.reservation = foreign.reservation.map(|token| token.wrapping_add(1000));
    let Some(Kind::StructValue(foreign)) = foreign.to_value().kind else {
        panic!("the hand-off is a struct");
    };
    let s = h.open().await;
    observe(&s, completion_headers(), Some(&foreign)).await;
    observing.push(s);
    wait_in_flight(&h, 7).await;
    assert_eq!(reservations(&h, "taken"), 6);
    assert_eq!(reservations(&h, "lapsed"), 0);

    drop(observing);
    wait_in_flight(&h, 0).await;
}
