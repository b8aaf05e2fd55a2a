//! The tonic `ExternalProcessor` service: one task per gRPC stream drives a [`RequestStream`].

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::stream::{RequestStream, StreamContext};

/// Messages queued per stream before the task waits for the gateway to read. Bounded so a
/// slow gateway applies back-pressure instead of kvpick buffering without limit.
const OUTBOUND_QUEUE: usize = 16;

/// The ext-proc service.
pub struct ExtProcService {
    ctx: Arc<StreamContext>,
}

impl ExtProcService {
    /// A service over `ctx`.
    pub fn new(ctx: Arc<StreamContext>) -> Self {
        Self { ctx }
    }

    /// The tonic server wrapper, with message limits that fit a full 62 KB chunk and more.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(8 * 1024 * 1024)
            .max_encoding_message_size(8 * 1024 * 1024)
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let ctx = Arc::clone(&self.ctx);
        tokio::spawn(async move {
            ctx.metrics.open_streams.inc();
            let mut stream = RequestStream::new(Arc::clone(&ctx));
            'messages: loop {
                let message = tokio::select! {
                    message = inbound.message() => message,
                    // The gateway dropped our side: nothing more can be delivered.
                    _ = tx.closed() => break,
                };
                match message {
                    Ok(Some(message)) => match stream.on_message(message) {
                        Ok(replies) => {
                            for reply in replies {
                                if tx.send(Ok(reply)).await.is_err() {
                                    break 'messages;
                                }
                            }
                            // Answered (immediate response) or passed through to the end:
                            // close our side so neither end holds the stream open.
                            if stream.is_done() {
                                break;
                            }
                        }
                        Err(error) => {
                            tracing::warn!(%error, "ext-proc protocol error; closing the stream");
                            let _ = tx.send(Err(error.into())).await;
                            break;
                        }
                    },
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "ext-proc stream broke");
                        break;
                    }
                }
            }
            stream.close();
            ctx.metrics.open_streams.dec();
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
