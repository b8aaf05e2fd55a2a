//! kvpick's ext-proc service on a loopback port, driven by a plain gRPC client (no Envoy).

use std::sync::Arc;

use kvpick::extproc::{ExtProcService, StreamContext};
use kvpick::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use kvpick::pb::envoy::service::ext_proc::v3::HttpHeaders;
use kvpick::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kvpick::pb::envoy::service::ext_proc::v3::processing_request::Request;
use tonic::transport::Channel;

/// Serves `ctx`'s ext-proc service on a random 127.0.0.1 port (for the rest of the test) and
/// returns a client connected to it.
pub async fn serve(ctx: Arc<StreamContext>) -> ExternalProcessorClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ExtProcService::new(ctx).into_server(Default::default()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect")
}

/// A new HTTP/2 connection to the ext-proc port `port` on 127.0.0.1 (e.g. the kvpick binary's).
pub async fn connect(port: u16) -> ExternalProcessorClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    ExternalProcessorClient::new(channel)
}

/// A `RequestHeaders` message carrying `pairs`.
pub fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> Request {
    Request::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).to_owned(),
                    raw_value: bytes::Bytes::copy_from_slice(v.as_bytes()),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream,
        ..Default::default()
    })
}

/// The body and end-of-stream flag of a request- or response-body reply that streams a body
/// back (FULL_DUPLEX_STREAMED); panics on any other reply.
pub fn streamed_body(
    reply: &kvpick::pb::envoy::service::ext_proc::v3::ProcessingResponse,
) -> (Vec<u8>, bool) {
    use kvpick::pb::envoy::service::ext_proc::v3::processing_response::Response;
    use kvpick::pb::envoy::service::ext_proc::v3::{BodyResponse, body_mutation};
    let common = match &reply.response {
        Some(Response::RequestBody(BodyResponse { response: Some(c) }))
        | Some(Response::ResponseBody(BodyResponse { response: Some(c) })) => c,
        other => panic!("expected a body reply, got {other:?}"),
    };
    match common
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.to_vec(), s.end_of_stream),
        other => panic!("expected a streamed body, got {other:?}"),
    }
}

/// The value a request-headers reply sets for header `name` (None: the reply does not set
/// it); panics on any other reply or a value that is not UTF-8.
pub fn set_header(
    reply: &kvpick::pb::envoy::service::ext_proc::v3::ProcessingResponse,
    name: &str,
) -> Option<String> {
    use kvpick::pb::envoy::service::ext_proc::v3::processing_response::Response;
    let Some(Response::RequestHeaders(headers)) = &reply.response else {
        panic!("expected a request headers reply, got {reply:?}");
    };
    set_header_in(headers.response.as_ref()?, name)
}

/// The value an answer's common part sets for header `name` (None: it does not set it);
/// panics on a value that is not UTF-8.
pub fn set_header_in(
    common: &kvpick::pb::envoy::service::ext_proc::v3::CommonResponse,
    name: &str,
) -> Option<String> {
    common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8(h.raw_value.to_vec()).expect("a UTF-8 header value"))
}
