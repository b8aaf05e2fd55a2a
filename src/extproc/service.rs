//! The tonic `ExternalProcessor` service: each gRPC stream drives one [`RequestStream`].

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::stream::{RequestStream, Step, StreamContext};

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
        // NOTE: the reply stream drives the state machine itself (no task, no channel per
        // request): the h2 connection polls it, so each inbound message is handled on the
        // connection's own task without a cross-thread wake-up. When the gateway resets the
        // stream, tonic drops this stream and with it the `RequestStream`, whose `Drop`
        // returns the request's in-flight unit and body budget.
        let state = Driver {
            inbound: request.into_inner(),
            stream: RequestStream::new(Arc::clone(&self.ctx)),
            pending: VecDeque::new(),
            finished: false,
        };
        let replies = futures::stream::unfold(state, |mut state| async move {
            let item = state.next().await?;
            Some((item, state))
        });
        Ok(Response::new(Box::pin(replies)))
    }
}

struct Driver {
    inbound: Streaming<ProcessingRequest>,
    stream: RequestStream,
    pending: VecDeque<ProcessingResponse>,
    finished: bool,
}

impl Driver {
    async fn next(&mut self) -> Option<Result<ProcessingResponse, Status>> {
        loop {
            if let Some(reply) = self.pending.pop_front() {
                return Some(Ok(reply));
            }
            // The decision's replies are all handed to the connection: let it send them (one
            // yield), then write the pick's routing record on this task.
            if let Some(record) = self.stream.take_record() {
                tokio::task::yield_now().await;
                record.apply();
            }
            // Answered (immediate response) or passed through to the end: close our side so
            // neither end holds the stream open.
            if self.finished || self.stream.is_done() {
                return None;
            }
            match self.inbound.message().await {
                Ok(Some(message)) => match self.stream.on_message(message) {
                    Ok(Step::Reply(replies)) => self.pending.extend(replies),
                    Ok(Step::Decide) => {
                        let replies = self.stream.decide().await;
                        self.pending.extend(replies);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "ext-proc protocol error; closing the stream");
                        self.finished = true;
                        return Some(Err(error.into()));
                    }
                },
                Ok(None) => return None,
                Err(status) => {
                    tracing::debug!(%status, "ext-proc stream broke");
                    return None;
                }
            }
        }
    }
}
