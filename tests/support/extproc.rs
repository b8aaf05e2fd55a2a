//! kvpick's ext-proc service on a loopback port, driven by a plain gRPC client (no Envoy).

use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kvpick::extproc::{ExtProcService, StreamContext};
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
            .add_service(ExtProcService::new(ctx).into_server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect")
}
