//! Decoding one observing-stream message as Envoy sends it for each streamed response chunk:
//! an SSE chunk of ~160 bytes and, as in every message of the stream, the forwarded
//! `kvpick.pick` hand-off (`src/extproc/handoff.rs`).
//!
//! - `chunk, metadata left encoded`: what kvpick does (`ProcessingRequest.metadata_context`
//!   is bytes, `build.rs`; read only on request headers);
//! - `chunk, metadata decoded`: the same message plus decoding the metadata into its
//!   `Metadata` (maps of strings), which the generated type did for every message before;
//! - `… (nine fields)`: the same with the hand-off as kvpick wrote it before it became one
//!   `pick` string (a struct of nine fields, which Envoy copies into every chunk);
//! - `hand-off read, …`: what an observing stream's request headers cost to read it (once
//!   per request), in each layout.
//!
//! Run: `cargo bench --bench extproc`.

use std::hint::black_box;
use std::time::Duration;

use criterion::Criterion;
use kvpick::extproc::dynamic_metadata;
use kvpick::extproc::handoff::{PICK_NAMESPACE, PickHandoff};
use kvpick::pb::envoy::config::core::v3::Metadata;
use kvpick::pb::envoy::service::ext_proc::v3::{HttpBody, ProcessingRequest, processing_request};
use kvpick::pb::google::protobuf::value::Kind;
use kvpick::pb::google::protobuf::{Struct, Value};
use kvpick::telemetry::RequestLabels;
use prost::Message;

const SSE_CHUNK: &[u8] = br#"data: {"id":"cmpl-5f0c9a","object":"text_completion","created":1764806400,"model":"sim-model","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null}]}

"#;

fn pick() -> PickHandoff {
    PickHandoff {
        endpoint: "10.0.3.17:8000".parse().expect("addr"),
        uncached_tokens: 212.0,
        cached_tokens: 2000.0,
        predicted_ms: Some(38.5),
        streamed: true,
        labels: RequestLabels::new(Some("sim-model"), Some("sim-model"), None, 0),
        reservation: Some(0x5eed_0000_0000_0001),
    }
}

/// The forwarded namespace as kvpick writes it now (one `pick` string).
fn compact() -> Metadata {
    let Some(Kind::StructValue(fields)) = pick().to_value().kind else {
        panic!("the hand-off is a struct");
    };
    namespace(fields)
}

/// The forwarded namespace as kvpick wrote it before (nine fields).
fn nine_fields() -> Metadata {
    let pick = pick();
    let value = |kind| Value { kind: Some(kind) };
    let text = |s: &str| value(Kind::StringValue(s.to_owned()));
    let fields = [
        ("endpoint", text(&pick.endpoint.to_string())),
        ("uncached", value(Kind::NumberValue(pick.uncached_tokens))),
        ("cached", value(Kind::NumberValue(pick.cached_tokens))),
        ("predicted_ms", value(Kind::NumberValue(38.5))),
        ("stream", value(Kind::BoolValue(true))),
        ("model", text(&pick.labels.model)),
        ("target_model", text(&pick.labels.target_model)),
        ("fairness_id", text(&pick.labels.fairness_id)),
        ("priority", text(&pick.labels.priority)),
    ];
    namespace(Struct {
        fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
    })
}

fn namespace(fields: Struct) -> Metadata {
    let mut metadata = Metadata::default();
    metadata
        .filter_metadata
        .insert(PICK_NAMESPACE.to_owned(), fields);
    metadata
}

fn observed_chunk(metadata: &Metadata) -> bytes::Bytes {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: bytes::Bytes::from_static(SSE_CHUNK),
            end_of_stream: false,
            ..Default::default()
        })),
        metadata_context: dynamic_metadata::encode(metadata),
        observability_mode: true,
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .configure_from_args();
    for (layout, metadata) in [("", compact()), (" (nine fields)", nine_fields())] {
        let wire = observed_chunk(&metadata);
        println!("chunk message{layout}: {} bytes", wire.len());
        c.bench_function(&format!("chunk, metadata left encoded{layout}"), |b| {
            b.iter(|| {
                black_box(ProcessingRequest::decode(black_box(wire.clone())).expect("decode"))
            })
        });
        c.bench_function(&format!("chunk, metadata decoded{layout}"), |b| {
            b.iter(|| {
                let message = ProcessingRequest::decode(black_box(wire.clone())).expect("decode");
                let metadata =
                    dynamic_metadata::decode(&message.metadata_context).expect("metadata");
                black_box((message, metadata))
            })
        });
        let encoded = dynamic_metadata::encode(&metadata);
        let name = if layout.is_empty() {
            ", one string"
        } else {
            layout
        };
        c.bench_function(&format!("hand-off read{name}"), |b| {
            b.iter(|| {
                let metadata = dynamic_metadata::decode(black_box(&encoded)).expect("metadata");
                black_box(PickHandoff::from_metadata(metadata.as_ref()).expect("a hand-off"))
            })
        });
    }
    c.final_summary();
}
