//! The configured scheduler behind the real ext-proc gRPC service, driven by a plain gRPC
//! client (no Envoy): what the headers reply carries besides the destination — the score
//! tracing of `--emit-endpoint-scores` and, under P/D disaggregation, the prefill endpoint.

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::metrics::FakeMetrics;

use kvpick::config::picker_config::load;
use kvpick::endpoints::{Datastore, Endpoint, EndpointState, PodId};
use kvpick::extproc::admission::Admission;
use kvpick::extproc::{BodyBudget, StreamContext, StreamTimeouts};
use kvpick::kvcache::{IndexConfig, PrefixIndex, PromptKeys};
use kvpick::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kvpick::pb::envoy::service::ext_proc::v3::{
    HttpBody, ProcessingRequest, ProcessingResponse, processing_request::Request,
    processing_response::Response,
};
use kvpick::pb::google::protobuf::{Struct, value::Kind};
use kvpick::scheduling::{
    ConfiguredScheduler, MetricsSource, SaturationConfig, SaturationDetector, SchedulerConfig,
    SchedulerDeps, SchedulingRequest,
};
use kvpick::telemetry::EppMetrics;
use kvpick::tokenize::{Tokenizers, TokenizersConfig};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

struct Harness {
    client: ExternalProcessorClient<tonic::transport::Channel>,
    scheduler: Arc<ConfiguredScheduler>,
    pods: Vec<Arc<EndpointState>>,
    index: Arc<PrefixIndex>,
}

/// Pods `10.2.0.{i+1}:8000` with `labels(i)`, waiting `i × 2` requests and KV usage
/// `0.1 × i` (so every scorer tells them apart), behind `config`.
async fn start(
    config: SchedulerConfig,
    n: usize,
    labels: impl Fn(usize) -> Vec<(&'static str, &'static str)>,
    emit_scores: bool,
) -> Harness {
    start_with(config, n, labels, emit_scores, TokenizersConfig::default()).await
}

/// [`start`] with tokenizers (exact prompts are keyed and recorded in the prefix index).
async fn start_with(
    config: SchedulerConfig,
    n: usize,
    labels: impl Fn(usize) -> Vec<(&'static str, &'static str)>,
    emit_scores: bool,
    tokenizers: TokenizersConfig,
) -> Harness {
    let datastore = Arc::new(Datastore::new());
    datastore.set_endpoints(
        (0..n)
            .map(|i| {
                let mut e = Endpoint::new(format!("10.2.0.{}:8000", i + 1).parse().expect("addr"));
                for (k, v) in labels(i) {
                    e.labels.insert(k.to_owned(), v.to_owned());
                }
                e
            })
            .collect(),
    );
    let pods = datastore.snapshot().endpoints.clone();
    let metrics = Arc::new(FakeMetrics::default());
    for (i, pod) in pods.iter().enumerate() {
        metrics.set_at(
            pod.id(),
            i as f64 * 2.0,
            0.0,
            0.1 * i as f64,
            Instant::now() + Duration::from_secs(3600),
        );
    }
    let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
    let scheduler = Arc::new(
        ConfiguredScheduler::new(
            config,
            SchedulerDeps {
                index: Arc::clone(&index),
                metrics: Arc::clone(&metrics) as Arc<dyn MetricsSource>,
            },
            0,
        )
        .with_score_trace(emit_scores),
    );
    let registry = prometheus::Registry::new();
    let ctx = Arc::new(StreamContext {
        datastore,
        scheduler: Arc::clone(&scheduler) as _,
        tokenizers: Arc::new(Tokenizers::new(tokenizers, &registry).expect("tokenizers")),
        model_rewrites: kvpick::live::Live::default(),
        objectives: kvpick::live::Live::default(),
        admission: Arc::new(Admission {
            detector: SaturationDetector::new(
                SaturationConfig::default(),
                metrics as Arc<dyn MetricsSource>,
            ),
            flow: None,
            pool_name: "default".into(),
        }),
        metrics: Arc::new(EppMetrics::new(&registry).expect("metrics")),
        body_budget: Arc::new(BodyBudget::new(1 << 20, 1 << 20)),
        max_body_bytes: 1 << 20,
        timeouts: StreamTimeouts::default(),
        conformance_hooks: false,
        endpoint_subset_filter: true,
    });
    let client = support::extproc::serve(ctx).await;
    Harness {
        client,
        scheduler,
        pods,
        index,
    }
}

/// Sends one request (headers `extra` + `body`) and returns the headers reply.
async fn route(h: &mut Harness, extra: &[(&str, &str)], body: &[u8]) -> ProcessingResponse {
    send(h, extra, body).await.0
}

/// Sends one request and returns the headers reply with the stream's sending side, which
/// keeps the stream open (as a gateway does until the response) while it is held.
async fn send(
    h: &mut Harness,
    extra: &[(&str, &str)],
    body: &[u8],
) -> (ProcessingResponse, mpsc::Sender<ProcessingRequest>) {
    let (tx, rx) = mpsc::channel(8);
    let mut replies = h
        .client
        .process(ReceiverStream::new(rx))
        .await
        .expect("open")
        .into_inner();
    let mut headers = vec![(":method", "POST"), (":path", "/v1/completions")];
    headers.extend_from_slice(extra);
    let messages = [
        support::extproc::headers(&headers, false),
        Request::RequestBody(HttpBody {
            body: body.to_vec().into(),
            end_of_stream: true,
            ..Default::default()
        }),
    ];
    for request in messages {
        tx.send(ProcessingRequest {
            request: Some(request),
            ..Default::default()
        })
        .await
        .expect("send");
    }
    let reply = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .expect("reply in time")
        .expect("no grpc error")
        .expect("a reply");
    (reply, tx)
}

/// What a headers reply set, removed, and put in dynamic metadata.
struct Reply {
    set: HashMap<String, String>,
    removed: Vec<String>,
    namespaces: HashMap<String, HashMap<String, String>>,
}

fn reply(response: &ProcessingResponse) -> Reply {
    let Some(Response::RequestHeaders(h)) = &response.response else {
        panic!("expected a request headers reply, got {response:?}");
    };
    let mutation = h
        .response
        .as_ref()
        .and_then(|c| c.header_mutation.as_ref())
        .expect("mutation");
    let set = mutation
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .map(|h| {
            (
                h.key.clone(),
                String::from_utf8(h.raw_value.to_vec()).expect("utf8"),
            )
        })
        .collect();
    let strings = |s: &Struct| {
        s.fields
            .iter()
            .filter_map(|(k, v)| match &v.kind {
                Some(Kind::StringValue(s)) => Some((k.clone(), s.clone())),
                _ => None,
            })
            .collect::<HashMap<_, _>>()
    };
    let namespaces = response
        .dynamic_metadata
        .as_ref()
        .map(|m| {
            m.fields
                .iter()
                .filter_map(|(k, v)| match &v.kind {
                    Some(Kind::StructValue(s)) => Some((k.clone(), strings(s))),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Reply {
        set,
        removed: mutation.remove_headers.clone(),
        namespaces,
    }
}

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

/// Client copies of kvpick's own headers: never trusted.
const FORGED: &[(&str, &str)] = &[
    ("x-kvpick-endpoint-scores", "6.6.6.6:1=99"),
    ("x-kvpick-scorer-scores", "6.6.6.6:1=queue-scorer:1"),
    ("x-prefiller-host-port", "6.6.6.6:1"),
];

/// `addr=value;…` → [(addr, value)].
fn entries(value: &str) -> Vec<(String, String)> {
    value
        .split(';')
        .map(|e| {
            let (addr, rest) = e.split_once('=').expect("addr=value");
            (addr.to_owned(), rest.to_owned())
        })
        .collect()
}

#[tokio::test]
async fn emitted_scores_match_explain_and_replace_client_copies() {
    let mut h = start(SchedulerConfig::gie_default(), 3, |_| Vec::new(), true).await;
    // What /debug/explain computes for this state (before the pick counts a request in
    // flight); the prompt is too short for any prefix score either way.
    let request = SchedulingRequest {
        model: Some("m".into()),
        prompt: Arc::new(PromptKeys::default()),
        ..SchedulingRequest::default()
    };
    let explained = h.scheduler.explain(&request, &h.pods);
    let r = reply(&route(&mut h, FORGED, BODY).await);
    let destination = &r.set["x-gateway-destination-endpoint"];

    let totals = entries(&r.set["x-kvpick-endpoint-scores"]);
    assert_eq!(totals.len(), 3, "{totals:?}");
    assert_eq!(&totals[0].0, destination, "best first, and it is the pick");
    let values: Vec<f64> = totals
        .iter()
        .map(|(_, v)| v.parse().expect("number"))
        .collect();
    assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");

    // The same numbers /debug/explain computed.
    for (addr, value) in &totals {
        let c = explained
            .candidates
            .iter()
            .find(|c| &c.address == addr)
            .expect("explained candidate");
        assert_eq!(value, &format!("{:.4}", c.total), "{addr}");
    }
    let per_scorer = entries(&r.set["x-kvpick-scorer-scores"]);
    assert_eq!(per_scorer.len(), 3);
    for (addr, detail) in &per_scorer {
        let c = explained
            .candidates
            .iter()
            .find(|c| &c.address == addr)
            .expect("explained candidate");
        let expected: Vec<String> = c
            .scores
            .iter()
            .map(|(name, score)| format!("{name}:{score:.4}"))
            .collect();
        assert_eq!(detail, &expected.join(","), "{addr}");
    }
    assert!(
        per_scorer[0].1.contains("queue-scorer:1.0000"),
        "the idle pod has the best queue: {per_scorer:?}"
    );

    // Metadata: the same strings in kvpick's namespace; envoy.lb holds only the destination.
    let kvpick = &r.namespaces["kvpick"];
    assert_eq!(
        kvpick["x-kvpick-endpoint-scores"],
        r.set["x-kvpick-endpoint-scores"]
    );
    assert_eq!(
        kvpick["x-kvpick-scorer-scores"],
        r.set["x-kvpick-scorer-scores"]
    );
    assert_eq!(
        r.namespaces["envoy.lb"].keys().collect::<Vec<_>>(),
        ["x-gateway-destination-endpoint"]
    );
    // Forged copies: the score headers are overwritten, the prefill header (no P/D here)
    // removed.
    assert_eq!(r.removed, ["x-prefiller-host-port"]);
    assert!(!r.set.contains_key("x-prefiller-host-port"));
}

#[tokio::test]
async fn without_the_flag_nothing_is_emitted_and_client_copies_are_removed() {
    let mut h = start(SchedulerConfig::gie_default(), 3, |_| Vec::new(), false).await;
    let r = reply(&route(&mut h, FORGED, BODY).await);
    assert!(r.set.contains_key("x-gateway-destination-endpoint"));
    assert!(
        r.set.keys().all(|k| !FORGED.iter().any(|(f, _)| f == k)),
        "{:?}",
        r.set
    );
    let mut removed = r.removed.clone();
    removed.sort();
    assert_eq!(
        removed,
        [
            "x-kvpick-endpoint-scores",
            "x-kvpick-scorer-scores",
            "x-prefiller-host-port"
        ]
    );
    assert!(!r.namespaces.contains_key("kvpick"));
    // A request without forged headers removes nothing.
    let clean = reply(&route(&mut h, &[], BODY).await);
    assert!(clean.removed.is_empty(), "{:?}", clean.removed);
}

const PD_CONFIG: &str = "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefill-header-handler
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: pd-profile-handler
  parameters: {threshold: 100}
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: queue-scorer
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
  - pluginRef: queue-scorer
";

#[tokio::test]
async fn pd_sends_the_prefill_pod_in_x_prefiller_host_port_above_the_threshold() {
    let config = load(Some(PD_CONFIG)).expect("P/D config").scheduler;
    // Pod 0 decodes, pod 1 prefills, pod 2 prefills too but is busier.
    let mut h = start(
        config,
        3,
        |i| match i {
            0 => vec![("llm-d.ai/role", "decode")],
            _ => vec![("llm-d.ai/role", "prefill")],
        },
        false,
    )
    .await;
    // ~300 tokens of text (no tokenizer for `m`: 4 characters a token), none cached.
    let long = format!(
        r#"{{"model":"m","prompt":"{}"}}"#,
        "a fresh question about disaggregated serving ".repeat(27)
    );
    let r = reply(
        &route(
            &mut h,
            &[("x-prefiller-host-port", "6.6.6.6:1")],
            long.as_bytes(),
        )
        .await,
    );
    assert_eq!(r.set["x-gateway-destination-endpoint"], "10.2.0.1:8000");
    assert_eq!(r.set["x-prefiller-host-port"], "10.2.0.2:8000");
    assert!(
        r.removed.is_empty(),
        "the client's copy is overwritten: {:?}",
        r.removed
    );
    assert_eq!(
        r.namespaces["kvpick"]["x-prefiller-host-port"],
        "10.2.0.2:8000"
    );
    assert_eq!(
        r.namespaces["envoy.lb"]["x-gateway-destination-endpoint"], "10.2.0.1:8000",
        "the destination contract is the decode pod's"
    );

    // A short prompt (~2 tokens < 100): decode alone, no prefill header, the forged one gone.
    let r = reply(&route(&mut h, &[("x-prefiller-host-port", "6.6.6.6:1")], BODY).await);
    assert_eq!(r.set["x-gateway-destination-endpoint"], "10.2.0.1:8000");
    assert!(!r.set.contains_key("x-prefiller-host-port"), "{:?}", r.set);
    assert_eq!(r.removed, ["x-prefiller-host-port"]);
    assert!(!r.namespaces.contains_key("kvpick"));
}

#[tokio::test]
async fn the_routing_record_lands_after_the_reply_and_the_prefix_follows() {
    let tokenizers = TokenizersConfig {
        models: vec![("tiny".into(), support::repo_root().join("assets/tokenizer"))],
        ..TokenizersConfig::default()
    };
    let mut h = start_with(
        SchedulerConfig::gie_default(),
        3,
        |_| Vec::new(),
        false,
        tokenizers,
    )
    .await;
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let body = serde_json::json!({"model": "tiny", "prompt": prompt}).to_string();
    // The first request's stream stays open (the gateway has not sent the response yet): the
    // record must land right after the reply, not when the stream ends.
    let (first, tx) = send(&mut h, &[], body.as_bytes()).await;
    let picked = reply(&first)
        .set
        .get("x-gateway-destination-endpoint")
        .cloned()
        .expect("destination");
    // Poll (bounded) until the index shows the picked pod holding the prompt (these pods
    // publish no KV events, so the record lands in the pod's approximate set).
    let index = Arc::clone(&h.index);
    let pod: PodId = picked.parse().map(PodId).expect("ip:port");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if index.pod_entries(pod) > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "routing record not applied after the reply"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The same prompt again goes where the first one went.
    for _ in 0..3 {
        let again = reply(&route(&mut h, &[], body.as_bytes()).await);
        assert_eq!(
            again.set.get("x-gateway-destination-endpoint"),
            Some(&picked)
        );
    }
    // Only now does the first request's stream close.
    drop(tx);
}
