//! The ext-proc stream state machine, driven through its real gRPC interface by a plain
//! client (no Envoy): ordering, truncation, aborts, limits, subset hints.

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use support::extproc::{headers, streamed_body};

use kvpick::endpoints::EndpointState;
use kvpick::endpoints::{Datastore, Endpoint};
use kvpick::extproc::admission::Admission;
use kvpick::extproc::{BodyBudget, StreamContext, StreamTimeouts};
use kvpick::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use kvpick::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use kvpick::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kvpick::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, processing_request::Request, processing_response::Response,
};
use kvpick::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use kvpick::request::ModelRewriteRules;
use kvpick::scheduling::{LeastInFlight, Pick, ScheduleError, Scheduler, SchedulingRequest};
use kvpick::scheduling::{MetricsSource, SaturationConfig, SaturationDetector};
use kvpick::scrape::MetricsStore;
use kvpick::telemetry::EppMetrics;
use kvpick::tokenize::PromptTokens;
use kvpick::tokenize::{Tokenizers, TokenizersConfig};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

pub(crate) struct Harness {
    client: ExternalProcessorClient<Channel>,
    pub(crate) datastore: Arc<Datastore>,
    pub(crate) metrics: Arc<EppMetrics>,
    pub(crate) budget: Arc<BodyBudget>,
}

pub(crate) struct Options {
    pub(crate) endpoints: Vec<&'static str>,
    pub(crate) max_body: usize,
    pub(crate) budget: usize,
    pub(crate) fallbacks: usize,
    pub(crate) rewrites: ModelRewriteRules,
    pub(crate) objectives: HashMap<String, i32>,
    pub(crate) recorder: Option<Arc<Recorder>>,
    /// What the saturation detector reads (empty: every pod unscraped, i.e. saturated).
    pub(crate) scrapes: Arc<MetricsStore>,
    pub(crate) timeouts: StreamTimeouts,
}

/// A scheduler that records what it was asked and picks least-in-flight.
#[derive(Default)]
pub(crate) struct Recorder {
    seen: std::sync::Mutex<Vec<SchedulingRequest>>,
}

impl Scheduler for Recorder {
    fn pick(
        &self,
        request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Result<Pick, ScheduleError> {
        self.seen.lock().expect("lock").push(request.clone());
        LeastInFlight::new(0).pick(request, candidates)
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            endpoints: vec!["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"],
            max_body: 1 << 20,
            budget: 4 << 20,
            fallbacks: 0,
            rewrites: ModelRewriteRules::default(),
            objectives: HashMap::new(),
            recorder: None,
            scrapes: Arc::new(MetricsStore::default()),
            timeouts: StreamTimeouts::default(),
        }
    }
}

pub(crate) async fn start(options: Options) -> Harness {
    let datastore = Arc::new(Datastore::new());
    datastore.set_endpoints(
        options
            .endpoints
            .iter()
            .map(|a| Endpoint::new(a.parse().expect("addr")))
            .collect(),
    );
    let metrics = Arc::new(EppMetrics::new(&prometheus::Registry::new()).expect("metrics"));
    let budget = Arc::new(BodyBudget::new(options.budget, options.max_body));
    let registry = prometheus::Registry::new();
    let tokenizers = Arc::new(
        Tokenizers::new(TokenizersConfig::default(), &registry).expect("no tokenizers to load"),
    );
    let ctx = Arc::new(StreamContext {
        datastore: Arc::clone(&datastore),
        scheduler: match &options.recorder {
            Some(recorder) => Arc::clone(recorder) as Arc<dyn Scheduler>,
            None => Arc::new(LeastInFlight::new(options.fallbacks)),
        },
        tokenizers,
        model_rewrites: kvpick::live::Live::new(options.rewrites.clone()),
        objectives: kvpick::live::Live::new(options.objectives.clone()),
        admission: Arc::new(Admission {
            detector: SaturationDetector::new(
                SaturationConfig::default(),
                Arc::clone(&options.scrapes) as Arc<dyn MetricsSource>,
            ),
            flow: None,
            pool_name: "default".into(),
        }),
        metrics: Arc::clone(&metrics),
        body_budget: Arc::clone(&budget),
        max_body_bytes: options.max_body,
        timeouts: options.timeouts,
        conformance_hooks: false,
        endpoint_subset_filter: true,
    });
    let client = support::extproc::serve(ctx).await;
    Harness {
        client,
        datastore,
        metrics,
        budget,
    }
}

pub(crate) struct Stream {
    pub(crate) tx: mpsc::Sender<ProcessingRequest>,
    pub(crate) rx: Streaming<ProcessingResponse>,
}

impl Harness {
    pub(crate) async fn open(&mut self) -> Stream {
        let (tx, rx) = mpsc::channel(64);
        let response = self
            .client
            .process(ReceiverStream::new(rx))
            .await
            .expect("open stream");
        Stream {
            tx,
            rx: response.into_inner(),
        }
    }

    /// A stream whose first message, `request_headers`, carries the `protocol_config` Envoy
    /// sends: request bodies FULL_DUPLEX_STREAMED, response bodies in `response_body_mode`.
    pub(crate) async fn open_in_mode(
        &mut self,
        request_headers: Request,
        response_body_mode: BodySendMode,
    ) -> Stream {
        self.open_with_modes(
            request_headers,
            BodySendMode::FullDuplexStreamed,
            response_body_mode,
        )
        .await
    }

    /// A stream whose first message, `request_headers`, announces these body modes.
    pub(crate) async fn open_with_modes(
        &mut self,
        request_headers: Request,
        request_body_mode: BodySendMode,
        response_body_mode: BodySendMode,
    ) -> Stream {
        let s = self.open().await;
        s.tx.send(ProcessingRequest {
            request: Some(request_headers),
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: request_body_mode as i32,
                response_body_mode: response_body_mode as i32,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("send");
        s
    }

    pub(crate) fn in_flight_total(&self) -> u64 {
        self.datastore
            .snapshot()
            .endpoints
            .iter()
            .map(|e| e.in_flight.get())
            .sum()
    }

    /// Waits (bounded) until the server has noticed a closed stream.
    pub(crate) async fn settle(&self) {
        for _ in 0..200 {
            if self.metrics.open_streams.get() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("stream never closed on the server");
    }
}

impl Stream {
    pub(crate) async fn send(&self, request: Request) {
        self.send_with(request, None).await;
    }

    async fn send_with(&self, request: Request, metadata: Option<Metadata>) {
        self.tx
            .send(ProcessingRequest {
                request: Some(request),
                metadata_context: metadata
                    .as_ref()
                    .map(kvpick::extproc::dynamic_metadata::encode)
                    .unwrap_or_default(),
                ..Default::default()
            })
            .await
            .expect("send");
    }

    pub(crate) async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("reply in time")
            .expect("no grpc error")
            .expect("stream open")
    }

    pub(crate) async fn recv_status(&mut self) -> tonic::Status {
        match tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("reply in time")
        {
            Err(status) => status,
            Ok(other) => panic!("expected a gRPC error, got {other:?}"),
        }
    }
}

pub(crate) fn post_headers() -> Request {
    headers(&[(":method", "POST"), (":path", "/v1/completions")], false)
}

pub(crate) fn body(bytes: &[u8], end_of_stream: bool) -> Request {
    Request::RequestBody(HttpBody {
        body: bytes.to_vec().into(),
        end_of_stream,
        ..Default::default()
    })
}

pub(crate) fn response_body(bytes: &[u8], end_of_stream: bool) -> Request {
    Request::ResponseBody(HttpBody {
        body: bytes.to_vec().into(),
        end_of_stream,
        ..Default::default()
    })
}

/// The destination header, the removed headers and the `envoy.lb` metadata of a pick's
/// answer.
pub(crate) struct Decision {
    pub(crate) destination: String,
    pub(crate) content_length: Option<String>,
    pub(crate) removed: Vec<String>,
    pub(crate) metadata_destination: String,
    pub(crate) clear_route_cache: bool,
}

/// The pick in a request-headers reply (panics on any other reply).
pub(crate) fn decision(reply: &ProcessingResponse) -> Decision {
    let Some(Response::RequestHeaders(h)) = &reply.response else {
        panic!("expected a request headers reply, got {reply:?}");
    };
    decision_in(reply, h.response.as_ref().expect("common response"))
}

/// The pick in the answer to a held request body (`BUFFERED`; panics on any other reply).
pub(crate) fn body_decision(reply: &ProcessingResponse) -> Decision {
    let Some(Response::RequestBody(b)) = &reply.response else {
        panic!("expected a request body answer, got {reply:?}");
    };
    decision_in(reply, b.response.as_ref().expect("common response"))
}

fn decision_in(reply: &ProcessingResponse, common: &CommonResponse) -> Decision {
    let mutation = common.header_mutation.as_ref().expect("mutation");
    let header = |name: &str| support::extproc::set_header_in(common, name);
    let lb = match reply
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get("envoy.lb"))
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StructValue(s)) => s.clone(),
        other => panic!("no envoy.lb metadata: {other:?}"),
    };
    let metadata_destination = match lb
        .fields
        .get("x-gateway-destination-endpoint")
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StringValue(s)) => s.clone(),
        other => panic!("no destination in metadata: {other:?}"),
    };
    Decision {
        destination: header("x-gateway-destination-endpoint").expect("destination header"),
        content_length: header("content-length"),
        removed: mutation.remove_headers.clone(),
        metadata_destination,
        clear_route_cache: common.clear_route_cache,
    }
}

fn immediate(reply: &ProcessingResponse) -> (i32, String) {
    match &reply.response {
        Some(Response::ImmediateResponse(i)) => (
            i.status.as_ref().map(|s| s.code).unwrap_or_default(),
            String::from_utf8(i.body.to_vec()).expect("utf8"),
        ),
        other => panic!("expected an immediate response, got {other:?}"),
    }
}

fn subset(entries: &[&str]) -> Metadata {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: entries
                .iter()
                .map(|e| Value {
                    kind: Some(Kind::StringValue((*e).to_owned())),
                })
                .collect(),
        })),
    };
    let mut fields = std::collections::BTreeMap::new();
    fields.insert("x-gateway-destination-endpoint-subset".to_owned(), list);
    let mut filter_metadata = HashMap::new();
    filter_metadata.insert("envoy.lb.subset_hint".to_owned(), Struct { fields });
    Metadata {
        filter_metadata,
        ..Default::default()
    }
}

pub(crate) const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

#[tokio::test]
async fn full_request_and_response_round_trip() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(headers(
        &[
            (":method", "POST"),
            ("x-gateway-inference-objective", "critical"),
            ("X-Gateway-Inference-Fairness-Id", "tenant-a"),
        ],
        false,
    ))
    .await;
    // A 200 KB body in uneven chunks, as a gateway would stream it.
    let filler = "x".repeat(200_000);
    let big = format!(r#"{{"model":"m","prompt":"{filler}"}}"#).into_bytes();
    for (i, chunk) in big.chunks(30_001).enumerate() {
        let last = (i + 1) * 30_001 >= big.len();
        s.send(body(chunk, last)).await;
    }
    let d = decision(&s.recv().await);
    assert!(d.clear_route_cache);
    assert_eq!(d.destination, d.metadata_destination);
    assert!(
        h.datastore
            .snapshot()
            .get(d.destination.parse().expect("id"))
            .is_some()
    );
    assert_eq!(
        d.content_length.as_deref(),
        Some(big.len().to_string().as_str())
    );
    let mut removed = d.removed.clone();
    removed.sort();
    assert_eq!(
        removed,
        [
            "x-gateway-inference-fairness-id",
            "x-gateway-inference-objective"
        ]
    );

    let mut forwarded = Vec::new();
    loop {
        let (chunk, eos) = streamed_body(&s.recv().await);
        assert!(chunk.len() <= 62_000, "chunk of {} bytes", chunk.len());
        forwarded.extend_from_slice(&chunk);
        if eos {
            break;
        }
    }
    assert_eq!(forwarded, big, "body forwarded byte for byte");
    assert_eq!(h.in_flight_total(), 1, "counted from the pick");
    assert_eq!(h.metrics.buffered_bytes.get(), 0, "body budget returned");
    assert_eq!(h.budget.available(), 4 << 20);

    s.send(Request::ResponseHeaders(HttpHeaders::default()))
        .await;
    assert!(matches!(
        s.recv().await.response,
        Some(Response::ResponseHeaders(_))
    ));
    s.send(response_body(b"data: one\n\n", false)).await;
    assert_eq!(
        streamed_body(&s.recv().await),
        (b"data: one\n\n".to_vec(), false)
    );
    assert_eq!(h.in_flight_total(), 1, "still streaming");
    s.send(response_body(b"data: [DONE]\n\n", true)).await;
    assert_eq!(
        streamed_body(&s.recv().await),
        (b"data: [DONE]\n\n".to_vec(), true)
    );
    assert_eq!(h.in_flight_total(), 0, "response end releases the endpoint");
    drop(s);
    h.settle().await;
    assert_eq!(
        h.metrics
            .aborted_streams
            .with_label_values(&["response"])
            .get(),
        0
    );
}

#[tokio::test]
async fn fallbacks_follow_the_primary_in_header_and_metadata() {
    let mut h = start(Options {
        fallbacks: 2,
        ..Options::default()
    })
    .await;
    let s = h.open().await;
    let mut s = s;
    s.send(post_headers()).await;
    s.send(body(BODY, true)).await;
    let d = decision(&s.recv().await);
    let listed: Vec<&str> = d.destination.split(',').collect();
    assert_eq!(
        listed.len(),
        3,
        "primary and two fallbacks: {}",
        d.destination
    );
    let unique: std::collections::HashSet<_> = listed.iter().collect();
    assert_eq!(unique.len(), 3);
    assert_eq!(d.destination, d.metadata_destination);
}

#[tokio::test]
async fn bodyless_request_is_routed_without_a_body_reply() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(headers(
        &[(":method", "GET"), (":path", "/v1/models")],
        true,
    ))
    .await;
    let d = decision(&s.recv().await);
    assert!(d.content_length.is_none());
    s.send(Request::ResponseHeaders(HttpHeaders {
        end_of_stream: true,
        ..Default::default()
    }))
    .await;
    assert!(matches!(
        s.recv().await.response,
        Some(Response::ResponseHeaders(_))
    ));
    assert_eq!(h.in_flight_total(), 0);
}

#[tokio::test]
async fn request_trailers_end_the_body() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(post_headers()).await;
    s.send(body(BODY, false)).await;
    s.send(Request::RequestTrailers(HttpTrailers::default()))
        .await;
    decision(&s.recv().await);
    assert_eq!(streamed_body(&s.recv().await), (BODY.to_vec(), false));
    assert!(matches!(
        s.recv().await.response,
        Some(Response::RequestTrailers(_))
    ));
}

#[tokio::test]
async fn bad_bodies_get_400_with_the_reason() {
    let mut h = start(Options::default()).await;
    for (bytes, reason) in [
        (&b"{not json"[..], "JSON"),
        (&br#"{"prompt":"no model"}"#[..], "no `model` field"),
        (&br#"[1, 2]"#[..], "not a JSON object"),
        (&b"{\"model\": \"\xff\"}"[..], "UTF-8"),
    ] {
        let mut s = h.open().await;
        s.send(post_headers()).await;
        s.send(body(bytes, true)).await;
        let (status, text) = immediate(&s.recv().await);
        assert_eq!(status, 400);
        assert!(text.starts_with("inference error: "), "{text}");
        assert!(text.contains(reason), "{text}");
    }
    assert_eq!(h.in_flight_total(), 0);
    assert_eq!(h.metrics.buffered_bytes.get(), 0);
}

#[tokio::test]
async fn oversize_body_gets_413_before_it_is_all_buffered() {
    let mut h = start(Options {
        max_body: 64 * 1024,
        ..Options::default()
    })
    .await;
    let mut s = h.open().await;
    s.send(post_headers()).await;
    s.send(body(&[b' '; 40_000], false)).await;
    s.send(body(&[b' '; 40_000], false)).await;
    let (status, text) = immediate(&s.recv().await);
    assert_eq!(status, 413);
    assert!(text.contains("65536"), "{text}");
    assert_eq!(h.metrics.buffered_bytes.get(), 0, "nothing kept after 413");
    assert_eq!(h.budget.available(), 4 << 20);
}

#[tokio::test]
async fn exhausted_buffer_budget_gets_503_and_is_returned() {
    let mut h = start(Options {
        max_body: 64 * 1024,
        budget: 100 * 1024,
        ..Options::default()
    })
    .await;
    let first = h.open().await;
    first.send(post_headers()).await;
    first.send(body(&[b' '; 60_000], false)).await;
    let mut second = h.open().await;
    second.send(post_headers()).await;
    second.send(body(&[b' '; 60_000], false)).await;
    let (status, text) = immediate(&second.recv().await);
    assert_eq!(status, 503);
    assert!(text.contains("budget"), "{text}");
    // The first client goes away mid-body: its share comes back.
    drop(first);
    h.settle().await;
    assert_eq!(h.budget.available(), 100 * 1024);
    assert_eq!(h.metrics.buffered_bytes.get(), 0);
    assert_eq!(
        h.metrics
            .aborted_streams
            .with_label_values(&["request_body"])
            .get(),
        1
    );
}

#[tokio::test]
async fn zero_endpoints_get_503() {
    let mut h = start(Options {
        endpoints: vec![],
        ..Options::default()
    })
    .await;
    let mut s = h.open().await;
    s.send(post_headers()).await;
    s.send(body(BODY, true)).await;
    let (status, text) = immediate(&s.recv().await);
    assert_eq!(status, 503);
    assert!(text.contains("no candidate endpoints"), "{text}");
}

#[tokio::test]
async fn subset_hint_restricts_the_pick_and_an_empty_subset_gets_503() {
    let mut h = start(Options::default()).await;
    for _ in 0..20 {
        let mut s = h.open().await;
        s.send_with(post_headers(), Some(subset(&["10.0.0.2:8000"])))
            .await;
        s.send(body(BODY, true)).await;
        assert_eq!(decision(&s.recv().await).destination, "10.0.0.2:8000");
    }
    let mut s = h.open().await;
    s.send_with(post_headers(), Some(subset(&[]))).await;
    s.send(body(BODY, true)).await;
    let (status, _) = immediate(&s.recv().await);
    assert_eq!(status, 503);
    let mut s = h.open().await;
    s.send_with(post_headers(), Some(subset(&["10.9.9.9:8000"])))
        .await;
    s.send(body(BODY, true)).await;
    assert_eq!(immediate(&s.recv().await).0, 503);
}

#[tokio::test]
async fn without_conformance_hooks_the_selection_header_is_ignored_and_nothing_is_echoed() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(headers(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("test-epp-endpoint-selection", "10.9.9.9:8000"),
        ],
        false,
    ))
    .await;
    s.send(body(BODY, true)).await;
    let picked = decision(&s.recv().await).destination;
    assert!(
        picked.starts_with("10.0.0."),
        "routed normally, to {picked}"
    );
    let _body = s.recv().await;
    s.send(response_headers()).await;
    let reply = s.recv().await;
    let Some(Response::ResponseHeaders(h)) = &reply.response else {
        panic!("expected a response headers reply, got {reply:?}");
    };
    let set: Vec<_> = h
        .response
        .iter()
        .flat_map(|c| c.header_mutation.iter())
        .flat_map(|m| m.set_headers.iter())
        .filter_map(|o| o.header.as_ref().map(|h| h.key.clone()))
        .collect();
    assert!(set.is_empty(), "headers set on the response: {set:?}");
}

#[tokio::test]
async fn out_of_order_messages_close_the_stream_with_an_error() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(body(BODY, true)).await;
    let status = s.recv_status().await;
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status.message().contains("request body"),
        "{}",
        status.message()
    );

    let mut s = h.open().await;
    s.send(post_headers()).await;
    s.send(Request::ResponseHeaders(HttpHeaders::default()))
        .await;
    assert_eq!(
        s.recv_status().await.code(),
        tonic::Code::FailedPrecondition
    );

    let mut s = h.open().await;
    s.tx.send(ProcessingRequest::default()).await.expect("send");
    assert_eq!(
        s.recv_status().await.code(),
        tonic::Code::FailedPrecondition
    );
    h.settle().await;
    assert_eq!(h.metrics.buffered_bytes.get(), 0);
}

#[tokio::test]
async fn a_stream_that_breaks_after_the_pick_releases_its_endpoint() {
    let mut h = start(Options::default()).await;
    let mut s = h.open().await;
    s.send(post_headers()).await;
    s.send(body(BODY, true)).await;
    decision(&s.recv().await);
    streamed_body(&s.recv().await);
    assert_eq!(h.in_flight_total(), 1);
    drop(s);
    h.settle().await;
    assert_eq!(h.in_flight_total(), 0);
    assert_eq!(
        h.metrics
            .aborted_streams
            .with_label_values(&["await_response"])
            .get(),
        1
    );
}

#[tokio::test]
async fn a_truncated_request_leaks_nothing() {
    let mut h = start(Options::default()).await;
    let s = h.open().await;
    s.send(post_headers()).await;
    s.send(body(&BODY[..10], false)).await;
    drop(s);
    h.settle().await;
    assert_eq!(h.metrics.buffered_bytes.get(), 0);
    assert_eq!(h.budget.available(), 4 << 20);
    assert_eq!(h.in_flight_total(), 0);
}

#[tokio::test]
async fn least_in_flight_spreads_concurrent_requests() {
    let mut h = start(Options::default()).await;
    let mut open = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..3 {
        let mut s = h.open().await;
        s.send(post_headers()).await;
        s.send(body(BODY, true)).await;
        seen.insert(decision(&s.recv().await).destination);
        streamed_body(&s.recv().await);
        open.push(s);
    }
    assert_eq!(
        seen.len(),
        3,
        "each in-flight request went to an idle endpoint"
    );
}

pub(crate) fn response_headers() -> Request {
    Request::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: "content-length".into(),
                raw_value: bytes::Bytes::from_static(b"100"),
                ..Default::default()
            }],
        }),
        ..Default::default()
    })
}

#[tokio::test]
async fn the_scheduler_sees_model_priority_fairness_session_and_prompt() {
    let recorder = Arc::new(Recorder::default());
    let mut h = start(Options {
        objectives: HashMap::from([("critical".to_owned(), 10), ("batch".to_owned(), -1)]),
        recorder: Some(Arc::clone(&recorder)),
        ..Options::default()
    })
    .await;
    let mut s = h.open().await;
    s.send(headers(
        &[
            (":path", "/v1/chat/completions"),
            ("x-gateway-inference-objective", "critical"),
            ("x-gateway-inference-fairness-id", "tenant-a"),
            ("x-session-id", "s1"),
        ],
        false,
    ))
    .await;
    s.send(body(
        br#"{"model":"m","cache_salt":"salt-1","messages":[{"role":"user","content":"hi"}]}"#,
        true,
    ))
    .await;
    decision(&s.recv().await);
    let mut s = h.open().await;
    s.send(headers(
        &[
            (":path", "/v1/completions"),
            ("x-gateway-inference-objective", "unknown"),
        ],
        false,
    ))
    .await;
    s.send(body(br#"{"model":"m","prompt":[1,2,3]}"#, true))
        .await;
    decision(&s.recv().await);

    let seen = recorder.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].model.as_deref(), Some("m"));
    assert_eq!(seen[0].priority, 10);
    assert_eq!(seen[0].fairness_id.as_deref(), Some("tenant-a"));
    assert_eq!(seen[0].session_id.as_deref(), Some("s1"));
    let context = seen[0].key_context().expect("key context");
    assert_eq!(
        (context.model.as_str(), context.cache_salt.as_deref()),
        ("m", Some("salt-1"))
    );
    assert!(
        matches!(seen[0].prompt.prompt(), PromptTokens::Approximate(_)),
        "no tokenizer configured: approximate text"
    );
    assert_eq!(seen[1].priority, 0, "unknown objective: default priority");
    assert_eq!(seen[1].prompt.prompt(), &PromptTokens::Exact(vec![1, 2, 3]));
}

#[tokio::test]
async fn sheddable_requests_get_429_when_the_pool_is_saturated() {
    // No pod has been scraped: stale metrics count as saturated.
    let mut h = start(Options {
        objectives: HashMap::from([("batch".to_owned(), -1), ("critical".to_owned(), 5)]),
        ..Options::default()
    })
    .await;
    let mut s = h.open().await;
    s.send(headers(
        &[
            (":path", "/v1/completions"),
            ("x-gateway-inference-objective", "batch"),
        ],
        false,
    ))
    .await;
    s.send(body(BODY, true)).await;
    let (status, text) = immediate(&s.recv().await);
    assert_eq!(status, 429);
    assert!(text.contains("sheddable"), "{text}");

    let mut s = h.open().await;
    s.send(headers(
        &[
            (":path", "/v1/completions"),
            ("x-gateway-inference-objective", "critical"),
        ],
        false,
    ))
    .await;
    s.send(body(BODY, true)).await;
    decision(&s.recv().await);
    assert_eq!(h.in_flight_total(), 1, "critical requests are not shed");
}

// NOTE: the timeout tests run in real time with short timeouts rather than tokio's paused
// clock: the streams go over real loopback sockets, and a paused clock auto-advances past
// the client's own deadline while the server's reply is still in the socket.
const SHORT: StreamTimeouts = StreamTimeouts {
    headers: Duration::from_millis(300),
    body: Duration::from_millis(300),
};

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_gets_408_and_returns_its_budget() {
    let mut h = start(Options {
        timeouts: SHORT,
        ..Options::default()
    })
    .await;
    let mut s = h.open().await;
    let opened = std::time::Instant::now();
    s.send(post_headers()).await;
    s.send(body(&[b' '; 100_000], false)).await;
    // A byte every 100 ms keeps the stream busy, but the deadline is for the whole body.
    let trickle = {
        let tx = s.tx.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let chunk = ProcessingRequest {
                    request: Some(body(b" ", false)),
                    ..Default::default()
                };
                if tx.send(chunk).await.is_err() {
                    return;
                }
            }
        })
    };
    let (status, text) = immediate(&s.recv().await);
    let waited = opened.elapsed();
    assert_eq!(status, 408);
    assert_eq!(
        text,
        "inference error: request body not received within 300ms"
    );
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    trickle.abort();
    h.settle().await;
    assert_eq!(h.budget.available(), 4 << 20, "budget returned");
    assert_eq!(h.metrics.buffered_bytes.get(), 0);
    assert_eq!(
        h.metrics
            .request_errors
            .with_label_values(&["", "", "default-flow", "0", "RequestTimeout"])
            .get(),
        1
    );
}

#[tokio::test]
async fn a_stream_that_never_sends_headers_is_closed_with_deadline_exceeded() {
    let mut h = start(Options {
        timeouts: SHORT,
        ..Options::default()
    })
    .await;
    let opened = std::time::Instant::now();
    let mut s = h.open().await;
    let status = s.recv_status().await;
    let waited = opened.elapsed();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
    assert!(
        status.message().contains("no request headers within 300ms"),
        "{status:?}"
    );
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    h.settle().await;
    assert_eq!(
        h.metrics
            .aborted_streams
            .with_label_values(&["request_headers"])
            .get(),
        1
    );
}

#[tokio::test]
async fn a_fast_request_is_not_cut_by_the_timeouts() {
    let mut h = start(Options {
        timeouts: SHORT,
        ..Options::default()
    })
    .await;
    let mut s = h.open().await;
    s.send(post_headers()).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    s.send(body(br#"{"model":"m","prompt":"hi"}"#, true)).await;
    assert!(!decision(&s.recv().await).destination.is_empty());
    assert!(streamed_body(&s.recv().await).1, "the whole body forwarded");
    // The response side has no deadline: a response that takes long is not cut.
    tokio::time::sleep(Duration::from_millis(500)).await;
    s.send(Request::ResponseHeaders(HttpHeaders::default()))
        .await;
    assert!(matches!(
        s.recv().await.response,
        Some(Response::ResponseHeaders(_))
    ));
}
