//! The per-request ext-proc state machine (DESIGN §2, FULL_DUPLEX_STREAMED).
//!
//! One [`RequestStream`] lives for one gRPC stream, i.e. one HTTP request. It is synchronous
//! and owns no I/O: the service feeds it each inbound message and sends what it returns, so
//! every ordering rule of the protocol is testable without a network.
//!
//! Phases: request headers → body buffered until end of stream → pick → (headers response,
//! metadata, body chunks) → response headers/body/trailers passed through → done.
//! The request's in-flight unit ([`InFlightGuard`]) and its share of the body budget
//! ([`OwnedSemaphorePermit`]) are fields: dropping the stream — for any reason — returns both.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request::Request,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::body::summarize;
use super::error::{ProtocolError, RequestError};
use super::mutations;
use super::subset::{SubsetHint, subset_hint};
use crate::endpoints::{Datastore, InFlightGuard};
use crate::scheduling::{Scheduler, SchedulingRequest};
use crate::telemetry::EppMetrics;

/// What every stream shares.
pub struct StreamContext {
    /// The pool.
    pub datastore: Arc<Datastore>,
    /// The decision maker.
    pub scheduler: Arc<dyn Scheduler>,
    /// EPP metrics.
    pub metrics: Arc<EppMetrics>,
    /// Bytes of request bodies that may be buffered across all streams.
    pub body_budget: Arc<Semaphore>,
    /// Per-request body limit.
    pub max_body_bytes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitRequestHeaders,
    BufferBody,
    AwaitResponse,
    Response,
    Done,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Self::AwaitRequestHeaders => "awaiting request headers",
            Self::BufferBody => "buffering the request body",
            Self::AwaitResponse => "awaiting the response",
            Self::Response => "streaming the response",
            Self::Done => "done",
        }
    }

    /// Label for the aborted-streams metric.
    fn label(self) -> &'static str {
        match self {
            Self::AwaitRequestHeaders => "request_headers",
            Self::BufferBody => "request_body",
            Self::AwaitResponse => "await_response",
            Self::Response => "response",
            Self::Done => "done",
        }
    }
}

/// The state of one ext-proc stream.
pub struct RequestStream {
    ctx: Arc<StreamContext>,
    phase: Phase,
    control_headers: Vec<String>,
    subset: Option<SubsetHint>,
    body: Vec<u8>,
    budget: Option<OwnedSemaphorePermit>,
    in_flight: Option<InFlightGuard>,
}

impl RequestStream {
    /// A stream waiting for request headers.
    pub fn new(ctx: Arc<StreamContext>) -> Self {
        ctx.metrics.open_streams.inc();
        Self {
            ctx,
            phase: Phase::AwaitRequestHeaders,
            control_headers: Vec::new(),
            subset: None,
            body: Vec::new(),
            budget: None,
            in_flight: None,
        }
    }

    /// Whether the request was answered or passed through to its end.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Handles one inbound message and returns the messages to send back, in order.
    pub fn on_message(
        &mut self,
        message: ProcessingRequest,
    ) -> Result<Vec<ProcessingResponse>, ProtocolError> {
        if self.subset.is_none() {
            self.subset = subset_hint(message.metadata_context.as_ref());
        }
        let request = message.request.ok_or(ProtocolError::Empty)?;
        match (self.phase, request) {
            (Phase::AwaitRequestHeaders, Request::RequestHeaders(headers)) => {
                Ok(self.on_request_headers(headers))
            }
            (Phase::BufferBody, Request::RequestBody(body)) => Ok(self.on_request_body(body)),
            (Phase::BufferBody, Request::RequestTrailers(_)) => {
                let mut out = self.finish_request(false);
                if self.phase == Phase::AwaitResponse {
                    out.push(mutations::request_trailers_continue());
                }
                Ok(out)
            }
            (Phase::AwaitResponse, Request::ResponseHeaders(headers)) => {
                self.phase = if headers.end_of_stream {
                    self.end_response();
                    Phase::Done
                } else {
                    Phase::Response
                };
                Ok(vec![mutations::response_headers_continue()])
            }
            (Phase::Response, Request::ResponseBody(body)) => {
                if body.end_of_stream {
                    self.end_response();
                }
                Ok(vec![mutations::response_body_chunk(
                    body.body,
                    body.end_of_stream,
                )])
            }
            (Phase::Response, Request::ResponseTrailers(_)) => {
                self.end_response();
                Ok(vec![mutations::response_trailers_continue()])
            }
            (phase, request) => Err(ProtocolError::Unexpected {
                message: message_name(&request),
                phase: phase.name(),
            }),
        }
    }

    fn on_request_headers(&mut self, headers: HttpHeaders) -> Vec<ProcessingResponse> {
        if let Some(map) = &headers.headers {
            for header in &map.headers {
                let key = header.key.to_ascii_lowercase();
                if mutations::CONTROL_HEADERS.contains(&key.as_str()) {
                    self.control_headers.push(key);
                }
            }
        }
        if headers.end_of_stream {
            return self.finish_request(true);
        }
        self.phase = Phase::BufferBody;
        Vec::new()
    }

    fn on_request_body(&mut self, body: HttpBody) -> Vec<ProcessingResponse> {
        if let Err(error) = self.buffer(&body.body) {
            return self.reject(error);
        }
        if body.end_of_stream {
            self.finish_request(true)
        } else {
            Vec::new()
        }
    }

    fn buffer(&mut self, chunk: &[u8]) -> Result<(), RequestError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let limit = self.ctx.max_body_bytes;
        if self.body.len().saturating_add(chunk.len()) > limit {
            return Err(RequestError::BodyTooLarge { limit });
        }
        // The limit is far below u32::MAX (validated at start-up), so the cast cannot truncate.
        let permits =
            u32::try_from(chunk.len()).map_err(|_| RequestError::BodyTooLarge { limit })?;
        let permit = Arc::clone(&self.ctx.body_budget)
            .try_acquire_many_owned(permits)
            .map_err(|_| RequestError::BufferBudgetExhausted)?;
        match &mut self.budget {
            Some(held) => held.merge(permit),
            None => self.budget = Some(permit),
        }
        self.ctx.metrics.buffered_bytes.add(chunk.len() as i64);
        self.body.extend_from_slice(chunk);
        Ok(())
    }

    fn release_body(&mut self) {
        if let Some(permit) = self.budget.take() {
            self.ctx
                .metrics
                .buffered_bytes
                .sub(permit.num_permits() as i64);
        }
        self.body = Vec::new();
    }

    /// The whole request is in: read it, pick, and answer headers (+ metadata) and body.
    fn finish_request(&mut self, end_of_stream: bool) -> Vec<ProcessingResponse> {
        let started = Instant::now();
        let had_body = self.phase == Phase::BufferBody;
        let summary = if had_body && !self.body.is_empty() {
            match summarize(&self.body) {
                Ok(summary) => Some(summary),
                Err(error) => return self.reject(error),
            }
        } else {
            None
        };
        let model = summary.as_ref().map(|s| s.model.clone());
        let pool = self.ctx.datastore.snapshot();
        let candidates: Vec<_> = match &self.subset {
            Some(hint) => pool
                .endpoints
                .iter()
                .filter(|e| hint.allows(e.id().addr()))
                .cloned()
                .collect(),
            None => pool.endpoints.clone(),
        };
        if candidates.is_empty() {
            let error = if self.subset.is_some() && !pool.endpoints.is_empty() {
                RequestError::EmptySubset
            } else {
                RequestError::Schedule(crate::scheduling::ScheduleError::NoCandidates)
            };
            return self.reject_for(error, model.as_deref());
        }
        let request = SchedulingRequest {
            model: model.clone(),
            target_model: model.clone(),
            body_bytes: self.body.len(),
            ..SchedulingRequest::default()
        };
        let pick = match self.ctx.scheduler.pick(&request, &candidates) {
            Ok(pick) => pick,
            Err(error) => return self.reject_for(error.into(), model.as_deref()),
        };
        if let Some(primary) = candidates.iter().find(|e| e.id() == pick.primary) {
            self.in_flight = Some(primary.in_flight.start());
        }
        let metrics = &self.ctx.metrics;
        metrics
            .scheduler_e2e
            .observe(started.elapsed().as_secs_f64());
        let model_label = model.as_deref().unwrap_or("");
        metrics
            .requests
            .with_label_values(&[model_label, model_label])
            .inc();
        metrics
            .request_sizes
            .with_label_values(&[model_label, model_label])
            .observe(self.body.len() as f64);
        let destination = pick.header_value();
        tracing::debug!(%destination, model = model_label, bytes = self.body.len(), "picked");

        let mut out = vec![mutations::request_headers_response(
            &destination,
            had_body.then_some(self.body.len()),
            std::mem::take(&mut self.control_headers),
        )];
        if had_body {
            out.extend(mutations::request_body_chunks(&self.body, end_of_stream));
        }
        // NOTE: the budget is returned once the chunks are built; they sit in the bounded
        // per-stream send queue only until the gateway reads them.
        self.release_body();
        self.phase = Phase::AwaitResponse;
        out
    }

    fn reject(&mut self, error: RequestError) -> Vec<ProcessingResponse> {
        self.reject_for(error, None)
    }

    fn reject_for(&mut self, error: RequestError, model: Option<&str>) -> Vec<ProcessingResponse> {
        let status = error.http_status();
        tracing::debug!(status, %error, "request rejected");
        let model = model.unwrap_or("");
        self.ctx
            .metrics
            .request_errors
            .with_label_values(&[model, model, error.error_code()])
            .inc();
        self.release_body();
        self.phase = Phase::Done;
        vec![mutations::immediate_error(status, &error.to_string())]
    }

    fn end_response(&mut self) {
        self.in_flight = None;
        self.phase = Phase::Done;
    }
}

impl Drop for RequestStream {
    /// The gRPC stream is gone, however it ended: count an early end, and return the body
    /// budget (the in-flight guard returns itself).
    fn drop(&mut self) {
        if self.phase != Phase::Done {
            self.ctx
                .metrics
                .aborted_streams
                .with_label_values(&[self.phase.label()])
                .inc();
        }
        self.release_body();
        self.ctx.metrics.open_streams.dec();
    }
}

fn message_name(request: &Request) -> &'static str {
    match request {
        Request::RequestHeaders(_) => "request headers",
        Request::ResponseHeaders(_) => "response headers",
        Request::RequestBody(_) => "request body",
        Request::ResponseBody(_) => "response body",
        Request::RequestTrailers(_) => "request trailers",
        Request::ResponseTrailers(_) => "response trailers",
    }
}
