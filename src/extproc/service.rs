//! The tonic `ExternalProcessor` service: each gRPC stream drives one [`RequestStream`].
//!
//! Streams are bounded: at most `--max-extproc-streams` are open at once (across all
//! connections; past it a new stream is refused with RESOURCE_EXHAUSTED, which a gateway
//! with FailOpen treats like an unavailable picker), and each read while the request is
//! still arriving has a deadline ([`RequestStream::read_deadline`]).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use crate::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use crate::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Response, Status, Streaming};

use super::stream::{RequestStream, Step, StreamContext};
use crate::telemetry::Stage;

/// The ext-proc service.
pub struct ExtProcService {
    ctx: Arc<StreamContext>,
    streams: Arc<Semaphore>,
    records: Arc<Semaphore>,
}

/// Long prompts' routing records applied on the blocking pool at once, at most.
const OFF_TASK_RECORDS: usize = 2;

impl ExtProcService {
    /// A service over `ctx`, with no bound on open streams (see [`Self::with_max_streams`]).
    pub fn new(ctx: Arc<StreamContext>) -> Self {
        Self {
            ctx,
            streams: Arc::new(Semaphore::new(Semaphore::MAX_PERMITS)),
            records: Arc::new(Semaphore::new(OFF_TASK_RECORDS)),
        }
    }

    /// At most `max` streams open at once; more are refused with RESOURCE_EXHAUSTED.
    pub fn with_max_streams(mut self, max: usize) -> Self {
        self.streams = Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS)));
        self
    }

    /// The tonic server wrapper, with these message limits.
    pub fn into_server(self, limits: MessageLimits) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(limits.recv)
            .max_encoding_message_size(limits.send)
    }
}

/// Largest gRPC messages the ext-proc service accepts and sends (llm-d's
/// `--grpc-max-recv-msg-size` / `--grpc-max-send-msg-size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageLimits {
    /// Largest message accepted, bytes.
    pub recv: usize,
    /// Largest message sent, bytes.
    pub send: usize,
}

impl MessageLimits {
    /// Room for a full 62 KB body chunk and far more: a gateway's messages stay well below.
    pub const DEFAULT_BYTES: usize = 8 * 1024 * 1024;

    /// The given limits, the default where none is given.
    pub fn new(recv: Option<usize>, send: Option<usize>) -> Self {
        Self {
            recv: recv.unwrap_or(Self::DEFAULT_BYTES),
            send: send.unwrap_or(Self::DEFAULT_BYTES),
        }
    }
}

impl Default for MessageLimits {
    fn default() -> Self {
        Self::new(None, None)
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
        let Ok(slot) = Arc::clone(&self.streams).try_acquire_owned() else {
            self.ctx.metrics.refused_streams.inc();
            tracing::warn!("too many open ext-proc streams; refusing a new one");
            return Err(Status::resource_exhausted("too many open ext-proc streams"));
        };
        let state = Driver {
            _slot: slot,
            records: Arc::clone(&self.records),
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
    /// This stream's place under `--max-extproc-streams`, returned on drop.
    _slot: OwnedSemaphorePermit,
    /// Places for routing records applied off the stream's task (shared by all streams).
    records: Arc<Semaphore>,
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
                let metrics = self.stream.metrics();
                let trim_later = self.stream.take_trim_later();
                let apply = move || {
                    let started = Instant::now();
                    record.apply();
                    let took = started.elapsed().as_secs_f64();
                    metrics.stages.observe(Stage::Record, took);
                    // NOTE: the record held the last reference to a very large prompt's tokens
                    // and keys, freed just now (on a blocking-pool thread, whose arena glibc
                    // keeps): the next memory trim returns them to the OS.
                    drop(trim_later);
                };
                // NOTE: a long prompt's record takes milliseconds (every block of the prompt
                // becomes a speculative entry); applied here it would hold up this stream's
                // response messages. It goes to the blocking pool instead, at most
                // OFF_TASK_RECORDS at once: past that it is applied here (back-pressure, no
                // record dropped). A later request may miss it for that long, as it may
                // miss any record applied after the reply.
                let slot = self
                    .stream
                    .is_large()
                    .then(|| Arc::clone(&self.records).try_acquire_owned().ok())
                    .flatten();
                match slot {
                    Some(slot) => {
                        tokio::task::spawn_blocking(move || {
                            let _slot = slot;
                            apply();
                        });
                    }
                    None => apply(),
                }
            }
            // Answered (immediate response) or passed through to the end: close our side so
            // neither end holds the stream open.
            if self.finished || self.stream.is_done() {
                return None;
            }
            let inbound = match self.stream.read_deadline() {
                None => self.inbound.message().await,
                Some(deadline) => {
                    match tokio::time::timeout_at(deadline, self.inbound.message()).await {
                        Ok(inbound) => inbound,
                        Err(_) => match self.stream.expire() {
                            Ok(replies) => {
                                self.pending.extend(replies);
                                continue;
                            }
                            Err(error) => {
                                self.finished = true;
                                return Some(Err(error.into()));
                            }
                        },
                    }
                }
            };
            match inbound {
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
                // A message over `--grpc-max-recv-msg-size` (tonic checks the declared length
                // before buffering it): the gateway is told why its stream ends.
                Err(status) if status.code() == tonic::Code::OutOfRange => {
                    tracing::warn!(%status, "ext-proc message over the receive limit; closing the stream");
                    self.finished = true;
                    return Some(Err(status));
                }
                Err(status) => {
                    tracing::debug!(%status, "ext-proc stream broke");
                    return None;
                }
            }
        }
    }
}
