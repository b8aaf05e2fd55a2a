//! Builders for the `ProcessingResponse` messages kvpick sends back to the gateway.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use crate::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use crate::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response::Response,
};
use crate::pb::envoy::r#type::v3::HttpStatus;
use crate::pb::google::protobuf::{Struct, Value, value::Kind};

/// Header (and `envoy.lb` metadata key) that names the destination endpoint(s).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Dynamic-metadata namespace of the destination.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// Largest body chunk sent back to the gateway (DESIGN §2; under Envoy's 64 KiB frames).
pub const MAX_BODY_CHUNK: usize = 62_000;
/// Request headers that steer kvpick and are not forwarded to the model server.
pub const CONTROL_HEADERS: [&str; 3] = [
    "x-gateway-inference-objective",
    "x-gateway-inference-fairness-id",
    "x-gateway-model-name-rewrite",
];

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: Bytes::copy_from_slice(value.as_bytes()),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A protobuf `Value` holding the string `s` (dynamic metadata).
pub(super) fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// The answer to the request headers once the pick is made: destination header, route cache
/// cleared, content-length matching the body sent, control headers removed, and the same
/// destination in `envoy.lb` dynamic metadata. `extra` headers (prefill endpoint, score
/// tracing) are set too and mirrored, under the same keys, into the `kvpick` namespace; a
/// header set here is overwritten rather than also removed.
pub fn request_headers_response(
    destination: &str,
    body_len: Option<usize>,
    present_control_headers: Vec<String>,
    extra: &[(&'static str, String)],
) -> ProcessingResponse {
    let (common, metadata) = decision(destination, body_len, present_control_headers, extra);
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common),
        })),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    }
}

/// The answer to a whole request body Envoy held (`BUFFERED`) once the pick is made: the
/// same header mutations and metadata as [`request_headers_response`] (Envoy still holds the
/// headers), and the body replaced only when it was `rewritten` (with `content-length` set
/// to match, which Envoy checks); otherwise Envoy forwards the body it holds.
pub fn request_body_decision(
    destination: &str,
    rewritten: Option<Bytes>,
    present_control_headers: Vec<String>,
    extra: &[(&'static str, String)],
) -> ProcessingResponse {
    let body_len = rewritten.as_ref().map(Bytes::len);
    let (mut common, metadata) = decision(destination, body_len, present_control_headers, extra);
    common.body_mutation = rewritten.map(|body| BodyMutation {
        mutation: Some(body_mutation::Mutation::Body(body)),
    });
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(common),
        })),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    }
}

/// Continues the request headers unchanged: Envoy holds them (`BUFFERED`) until the body's
/// answer carries the pick.
pub fn request_headers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse::default())),
        ..Default::default()
    }
}

/// A pick's header mutations and dynamic metadata (see [`request_headers_response`]).
fn decision(
    destination: &str,
    body_len: Option<usize>,
    mut present_control_headers: Vec<String>,
    extra: &[(&'static str, String)],
) -> (CommonResponse, Struct) {
    let mut set_headers = vec![set_header(DESTINATION_HEADER, destination)];
    if let Some(len) = body_len {
        set_headers.push(set_header("content-length", &len.to_string()));
    }
    present_control_headers.retain(|h| !extra.iter().any(|(key, _)| key == h));
    set_headers.extend(extra.iter().map(|(key, value)| set_header(key, value)));
    let mut lb = BTreeMap::new();
    lb.insert(DESTINATION_HEADER.to_owned(), string_value(destination));
    let mut namespaces = BTreeMap::new();
    namespaces.insert(
        DESTINATION_NAMESPACE.to_owned(),
        Value {
            kind: Some(Kind::StructValue(Struct { fields: lb })),
        },
    );
    if !extra.is_empty() {
        let fields = extra
            .iter()
            .map(|(key, value)| ((*key).to_owned(), string_value(value)))
            .collect();
        namespaces.insert(
            super::scores::KVPICK_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(Struct { fields })),
            },
        );
    }
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers: present_control_headers,
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    (common, Struct { fields: namespaces })
}

fn streamed_body(chunk: Bytes, end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body: chunk,
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    }
}

/// The request body as streamed chunks of at most [`MAX_BODY_CHUNK`] bytes (slices of `body`,
/// not copies); the last one carries `end_of_stream` (unless trailers follow). An empty body
/// is one empty chunk.
pub fn request_body_chunks(body: Bytes, end_of_stream: bool) -> Vec<ProcessingResponse> {
    body_chunks(body, end_of_stream, Response::RequestBody)
}

/// A (possibly rewritten) response body as streamed chunks of at most [`MAX_BODY_CHUNK`].
pub fn response_body_chunks(body: Bytes, end_of_stream: bool) -> Vec<ProcessingResponse> {
    body_chunks(body, end_of_stream, Response::ResponseBody)
}

fn body_chunks(
    body: Bytes,
    end_of_stream: bool,
    direction: fn(BodyResponse) -> Response,
) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<Bytes> = (0..body.len())
        .step_by(MAX_BODY_CHUNK)
        .map(|start| body.slice(start..body.len().min(start + MAX_BODY_CHUNK)))
        .collect();
    if chunks.is_empty() {
        chunks.push(Bytes::new());
    }
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| ProcessingResponse {
            response: Some(direction(BodyResponse {
                response: Some(streamed_body(chunk, end_of_stream && i == last)),
            })),
            ..Default::default()
        })
        .collect()
}

/// Passes a response body chunk through unchanged.
pub fn response_body_chunk(chunk: Bytes, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(streamed_body(chunk, end_of_stream)),
        })),
        ..Default::default()
    }
}

/// Answers one response body chunk Envoy sent in `STREAMED` mode: `None` lets Envoy forward
/// the chunk it holds unchanged (no bytes come back); `Some(bytes)` replaces it.
pub fn response_body_streamed_mode(replacement: Option<Bytes>) -> ProcessingResponse {
    let response = replacement.map(|body| CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::Body(body)),
        }),
        ..Default::default()
    });
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(response.unwrap_or_default()),
        })),
        ..Default::default()
    }
}

/// Continues the response headers, removing `content-length` when the body will change.
pub fn response_headers_continue(remove_content_length: bool) -> ProcessingResponse {
    let response = remove_content_length.then(|| CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: Vec::new(),
            remove_headers: vec!["content-length".to_owned()],
        }),
        ..Default::default()
    });
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse { response })),
        ..Default::default()
    }
}

/// Adds `key: value` to a headers reply built by [`response_headers_continue`].
pub fn set_response_header(reply: &mut ProcessingResponse, key: &str, value: &str) {
    if let Some(Response::ResponseHeaders(headers)) = reply.response.as_mut() {
        headers
            .response
            .get_or_insert_with(CommonResponse::default)
            .header_mutation
            .get_or_insert_with(HeaderMutation::default)
            .set_headers
            .push(set_header(key, value));
    }
}

/// Continues request trailers unchanged.
pub fn request_trailers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestTrailers(TrailersResponse::default())),
        ..Default::default()
    }
}

/// Continues response trailers unchanged.
pub fn response_trailers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseTrailers(TrailersResponse::default())),
        ..Default::default()
    }
}

/// An immediate response with `status` and the body `inference error: <reason>`.
pub fn immediate_error(status: u16, reason: &str) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![set_header("content-type", "text/plain; charset=utf-8")],
                remove_headers: Vec::new(),
            }),
            body: format!("inference error: {reason}").into(),
            details: format!("kvpick_{status}"),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(resp: &ProcessingResponse) -> (&[u8], bool) {
        match resp.response.as_ref() {
            Some(Response::RequestBody(BodyResponse {
                response:
                    Some(CommonResponse {
                        body_mutation:
                            Some(BodyMutation {
                                mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
                            }),
                        ..
                    }),
            })) => (&s.body, s.end_of_stream),
            other => panic!("not a streamed request body: {other:?}"),
        }
    }

    #[test]
    fn chunks_are_bounded_and_reassemble() {
        let body: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let chunks = request_body_chunks(Bytes::from(body.clone()), true);
        assert_eq!(chunks.len(), 4);
        let mut joined = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let (bytes, eos) = streamed(c);
            assert!(bytes.len() <= MAX_BODY_CHUNK);
            assert_eq!(eos, i == chunks.len() - 1);
            joined.extend_from_slice(bytes);
        }
        assert_eq!(joined, body);
        let empty = request_body_chunks(Bytes::new(), true);
        assert_eq!(empty.len(), 1);
        assert_eq!(streamed(&empty[0]), (&[][..], true));
        let before_trailers = request_body_chunks(Bytes::from_static(b"x"), false);
        assert!(!streamed(&before_trailers[0]).1);
    }
}
