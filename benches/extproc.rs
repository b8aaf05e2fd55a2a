//! Decoding one observing-stream message as Envoy sends it for each streamed response chunk:
//! an SSE chunk of ~160 bytes and, as in every message of the stream, the forwarded
//! `kvpick.pick` hand-off (`src/extproc/handoff.rs`).
//!
//! - `chunk, metadata left encoded`: what kvpick does (`ProcessingRequest.metadata_context`
//!   is bytes, `build.rs`; read only on request headers);
//! - `chunk, metadata decoded`: the same message plus decoding the metadata into its
//!   `Metadata` (maps of strings), which the generated type did for every message before.
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
use kvpick::telemetry::RequestLabels;
use prost::Message;

const SSE_CHUNK: &[u8] = br#"data: {"id":"cmpl-5f0c9a","object":"text_completion","created":1764806400,"model":"sim-model","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null}]}

"#;

fn observed_chunk() -> bytes::Bytes {
    let pick = PickHandoff {
        endpoint: "10.0.3.17:8000".parse().expect("addr"),
        uncached_tokens: 212.0,
        cached_tokens: 2000.0,
        predicted_ms: Some(38.5),
        streamed: true,
        labels: RequestLabels::new(Some("sim-model"), Some("sim-model"), None, 0),
    };
    let Some(Kind::StructValue(fields)) = pick.to_value().kind else {
        panic!("the hand-off is a struct");
    };
    let mut metadata = Metadata::default();
    metadata
        .filter_metadata
        .insert(PICK_NAMESPACE.to_owned(), fields);
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: bytes::Bytes::from_static(SSE_CHUNK),
            end_of_stream: false,
            ..Default::default()
        })),
        metadata_context: dynamic_metadata::encode(&metadata),
        observability_mode: true,
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}

fn main() {
    let wire = observed_chunk();
    let mut c = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .configure_from_args();
    c.bench_function("chunk, metadata left encoded", |b| {
        b.iter(|| black_box(ProcessingRequest::decode(black_box(wire.clone())).expect("decode")))
    });
    c.bench_function("chunk, metadata decoded", |b| {
        b.iter(|| {
            let message = ProcessingRequest::decode(black_box(wire.clone())).expect("decode");
            let metadata = dynamic_metadata::decode(&message.metadata_context).expect("metadata");
            black_box((message, metadata))
        })
    });
    c.final_summary();
}
