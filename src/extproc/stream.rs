//! The per-request ext-proc state machine (DESIGN §2: FULL_DUPLEX_STREAMED; BUFFERED request
//! bodies too, [`super::request_body`]).
//!
//! One [`RequestStream`] lives for one gRPC stream, i.e. one HTTP request. Message handling
//! ([`RequestStream::on_message`]) is synchronous and owns no I/O, so every ordering rule of
//! the protocol is testable without a network. The one slow step, reading and tokenizing
//! the body and picking ([`RequestStream::decide`]), is async: the body work runs on the
//! blocking pool so a 400 KB prompt never stalls other streams.
//!
//! Phases: request headers → body buffered until end of stream → decide → (headers response
//! with metadata, body chunks; or, when Envoy holds the body, one answer to it carrying the
//! same headers and metadata: `stream/reply.rs`) → response headers/body/trailers passed
//! through → done. When the gateway splits the work over two filters ([`super::handoff`]), a
//! routing stream is done at its decision and an observing stream ([`observe`]) goes from
//! request headers (the hand-off) straight to the response, answering nothing.
//! The request's in-flight unit ([`InFlightGuard`]) and its share of the body budget
//! ([`Held`]) are fields: dropping the stream, for any reason, returns both.
//!
//! Reads are bounded in time while the request is still arriving ([`Self::read_deadline`]):
//! the request headers must come within `--request-headers-timeout` of the stream opening,
//! and the whole body within `--request-body-timeout` of the headers. The deadline is for
//! the whole body, not a gap between chunks, so a client trickling a byte at a time cannot
//! hold its share of the budget longer than a stalled one. The response side has no such
//! bound: LLM responses stream for minutes and the gateway owns their timeouts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod observe;
mod reply;
mod response_path;

use super::admission::Admission;
use super::budget::{BodyBudget, Held};
use super::conformance::{EndpointSelection, SERVED_ECHO_HEADER, served_echo};
use super::dynamic_metadata;
use super::error::{ProtocolError, Rejection};
use super::meta::RequestMeta;
use super::mutations;
use super::prepare::{Prepared, prepare};
use super::request_body::RequestBodyMode;
use super::response::{ResponseBody, ResponseBodyMode};
use super::subset::{SubsetHint, subset_hint};
use super::usage::UsageTail;
use crate::endpoints::{Datastore, InFlightGuard, PodId, PrefillGuard, live_candidates};
use crate::kvcache::PromptKeys;
use crate::live::Live;
use crate::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use crate::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request::Request,
};
use crate::request::ModelRewriteRules;
use crate::scheduling::{PendingRecord, Pick, ScheduleError, Scheduler, SchedulingRequest};
use crate::telemetry::{EppMetrics, RequestLabels, Stage};
use crate::tokenize::{Tokenizers, TrimLater};
use observe::Observed;

/// Bodies up to this size are prepared on the stream's own task.
const INLINE_PREPARE_BYTES: usize = 16 * 1024;

/// What every stream shares.
pub struct StreamContext {
    /// The pool.
    pub datastore: Arc<Datastore>,
    /// The decision maker.
    pub scheduler: Arc<dyn Scheduler>,
    /// Tokenizers per model.
    pub tokenizers: Arc<Tokenizers>,
    /// Weighted model rewrite rules.
    pub model_rewrites: Live<ModelRewriteRules>,
    /// Objective name → priority (unknown or absent objective: 0).
    pub objectives: Live<HashMap<String, i32>>,
    /// Shedding and flow control.
    pub admission: Arc<Admission>,
    /// EPP metrics.
    pub metrics: Arc<EppMetrics>,
    /// Bytes of request bodies that may be buffered across all streams.
    pub body_budget: Arc<BodyBudget>,
    /// Per-request body limit (also bounds a held response body).
    pub max_body_bytes: usize,
    /// How long the request may take to arrive.
    pub timeouts: StreamTimeouts,
    /// Whether GIE's conformance hooks are on (`--enable-conformance-hooks`:
    /// [`super::conformance`]).
    pub conformance_hooks: bool,
    /// Whether the gateway's subset hint restricts the pick (off with llm-d's
    /// `--disable-endpoint-subset-filter`).
    pub endpoint_subset_filter: bool,
}

/// How long each part of the request may take to arrive (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamTimeouts {
    /// From the stream opening to its request headers (`--request-headers-timeout`).
    pub headers: std::time::Duration,
    /// From the request headers to the end of the body (`--request-body-timeout`).
    pub body: std::time::Duration,
}

impl Default for StreamTimeouts {
    /// The flags' defaults.
    fn default() -> Self {
        Self {
            headers: std::time::Duration::from_secs(10),
            body: std::time::Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitRequestHeaders,
    BufferBody,
    Deciding,
    AwaitResponse,
    Response,
    Done,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Self::AwaitRequestHeaders => "awaiting request headers",
            Self::BufferBody => "buffering the request body",
            Self::Deciding => "deciding",
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
            Self::Deciding => "deciding",
            Self::AwaitResponse => "await_response",
            Self::Response => "response",
            Self::Done => "done",
        }
    }
}

/// What the driver does after a message.
#[derive(Debug)]
pub enum Step {
    /// Send these replies (possibly none) and read on.
    Reply(Vec<ProcessingResponse>),
    /// The request is complete: call [`RequestStream::decide`].
    Decide,
}

/// How the request ended on the request side: body end or trailers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestEnd {
    /// Headers carried end of stream: no body.
    Bodyless,
    /// The last body chunk carried end of stream.
    Body,
    /// Trailers ended the request.
    Trailers,
}

/// The state of one ext-proc stream.
pub struct RequestStream {
    ctx: Arc<StreamContext>,
    phase: Phase,
    meta: RequestMeta,
    subset: Option<SubsetHint>,
    /// A conformance test's endpoint restriction (only with the hooks on).
    selection: Option<EndpointSelection>,
    body: Vec<u8>,
    budget: Held,
    end: RequestEnd,
    /// When the stream opened, then (once they came) when the request headers came.
    phase_started: tokio::time::Instant,
    in_flight: Option<InFlightGuard>,
    /// The request's share of its pod's prefill backlog: released at the first byte of a
    /// streamed response (which also times it), or at the end of any other.
    prefill: Option<PrefillGuard>,
    /// Whether the client asked for a streamed response (its first byte is its first token).
    streamed: bool,
    response: ResponseBody,
    /// How the gateway sends the response body (from the first message).
    response_mode: ResponseBodyMode,
    /// Where the request went and under which model labels, for the usage metrics.
    routed: Option<Routed>,
    /// The request's priority once its objective is looked up (0 before: a rejection
    /// before that is counted at 0, as llm-d does).
    priority: i32,
    usage: UsageTail,
    /// The pick's routing record, applied once the decision's replies are sent
    /// ([`Self::take_record`]).
    record: Option<PendingRecord>,
    /// Time spent appending body chunks so far.
    buffering: Duration,
    /// Whether the body was large enough to be prepared off this task.
    large: bool,
    /// For a very large request: marks a memory trim due once what it holds is freed
    /// (moved into its routing record's application, [`Self::take_trim_later`]).
    trim_later: Option<TrimLater>,
    /// A routing stream whose gateway sends no response on it (`response_body_mode: NONE`):
    /// the response half is an observing stream's ([`super::handoff`]).
    split: bool,
    /// A split pick's reservation token, for the hand-off (`crate::endpoints::PendingPicks`).
    reservation: Option<u64>,
    /// An observing stream (`observability_mode`): follows a pick's response, answers nothing.
    observing: bool,
    /// How the gateway sends the request body (from the first message).
    request_mode: RequestBodyMode,
    /// A held body (`BUFFERED`) came without end of stream: the pick answered it, and the
    /// request's trailers are still to come (and to be answered).
    trailers_owed: bool,
}

struct Routed {
    pod: PodId,
    labels: RequestLabels,
}

impl RequestStream {
    /// A stream waiting for request headers.
    pub fn new(ctx: Arc<StreamContext>) -> Self {
        ctx.metrics.open_streams.inc();
        Self {
            ctx,
            phase: Phase::AwaitRequestHeaders,
            meta: RequestMeta::default(),
            subset: None,
            selection: None,
            body: Vec::new(),
            budget: Held::default(),
            end: RequestEnd::Bodyless,
            phase_started: tokio::time::Instant::now(),
            in_flight: None,
            prefill: None,
            streamed: false,
            response: ResponseBody::PassThrough,
            response_mode: ResponseBodyMode::FullDuplex,
            routed: None,
            priority: 0,
            usage: UsageTail::default(),
            record: None,
            buffering: Duration::ZERO,
            large: false,
            trim_later: None,
            split: false,
            reservation: None,
            observing: false,
            request_mode: RequestBodyMode::FullDuplex,
            trailers_owed: false,
        }
    }

    /// The routing record of the pick, for the driver to apply after sending the replies
    /// [`Self::decide`] returned (see `crate::scheduling::PendingRecord`).
    pub fn take_record(&mut self) -> Option<PendingRecord> {
        self.record.take()
    }

    /// Whether the request's body was large (prepared on the blocking pool): its routing
    /// record is then long too.
    pub fn is_large(&self) -> bool {
        self.large
    }

    /// The trim handle of a very large request, to drop once its routing record (and with
    /// it the prompt's tokens and keys) is freed.
    pub fn take_trim_later(&mut self) -> Option<TrimLater> {
        self.trim_later.take()
    }

    /// The metrics, for work that outlives this stream's task.
    pub fn metrics(&self) -> Arc<EppMetrics> {
        Arc::clone(&self.ctx.metrics)
    }

    /// Whether the request was answered or passed through to its end.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done && !self.trailers_owed
    }

    /// Until when the next inbound message may take: `None` once the request is in.
    pub fn read_deadline(&self) -> Option<tokio::time::Instant> {
        let limit = match self.phase {
            Phase::AwaitRequestHeaders => self.ctx.timeouts.headers,
            Phase::BufferBody => self.ctx.timeouts.body,
            _ => return None,
        };
        Some(self.phase_started + limit)
    }

    /// The read deadline passed: a body still arriving is answered 408 (the replies to
    /// send); a stream that never sent its headers is a protocol error (closed with
    /// DEADLINE_EXCEEDED, and counted as aborted when dropped).
    pub fn expire(&mut self) -> Result<Vec<ProcessingResponse>, ProtocolError> {
        match self.phase {
            Phase::BufferBody => {
                let limit = self.ctx.timeouts.body;
                tracing::info!(
                    ?limit,
                    received = self.body.len(),
                    "request body too slow; answering 408"
                );
                Ok(self.reject(Rejection::BodyTimeout { limit }, None))
            }
            _ => {
                let limit = self.ctx.timeouts.headers;
                tracing::info!(
                    ?limit,
                    "ext-proc stream sent no request headers; closing it"
                );
                Err(ProtocolError::NoHeaders { limit })
            }
        }
    }

    /// Handles one inbound message.
    pub fn on_message(&mut self, message: ProcessingRequest) -> Result<Step, ProtocolError> {
        // What kvpick reads of the forwarded metadata comes with the request headers (the
        // subset hint, set by a filter before this one; an observing stream's hand-off), so
        // it is decoded there once; later messages' copies are not read.
        let headers_metadata = match message.request {
            Some(Request::RequestHeaders(_)) => {
                dynamic_metadata::decode(&message.metadata_context)?
            }
            _ => None,
        };
        if self.subset.is_none() && self.ctx.endpoint_subset_filter {
            self.subset = subset_hint(headers_metadata.as_ref());
        }
        if let Some(config) = &message.protocol_config {
            let mode = config.response_body_mode();
            self.response_mode = if mode == BodySendMode::Streamed {
                ResponseBodyMode::Streamed
            } else {
                ResponseBodyMode::FullDuplex
            };
            self.split = mode == BodySendMode::None;
            self.request_mode = RequestBodyMode::from_config(config)?;
        }
        if message.observability_mode && self.phase == Phase::AwaitRequestHeaders {
            self.observing = true;
        }
        let served = if self.ctx.conformance_hooks
            && !self.observing
            && matches!(message.request, Some(Request::ResponseHeaders(_)))
        {
            Some(served_echo(
                dynamic_metadata::decode(&message.metadata_context)?.as_ref(),
            ))
        } else {
            None
        };
        let request = message.request.ok_or(ProtocolError::Empty)?;
        if self.trailers_owed && matches!(request, Request::RequestTrailers(_)) {
            self.trailers_owed = false;
            return Ok(Step::Reply(vec![mutations::request_trailers_continue()]));
        }
        if self.observing {
            match (&request, self.phase) {
                (Request::RequestHeaders(_), Phase::AwaitRequestHeaders) => {
                    self.observe_pick(headers_metadata.as_ref());
                    return Ok(Step::Reply(Vec::new()));
                }
                // The request half is the routing stream's.
                (Request::RequestHeaders(_) | Request::RequestBody(_), _)
                | (Request::RequestTrailers(_), _) => return Ok(Step::Reply(Vec::new())),
                // A response with no request before it: kvpick (or the gateway) answered
                // the request itself, so there is no pick to follow.
                (_, Phase::AwaitRequestHeaders) => {
                    self.count_observed(Observed::NotRouted);
                    self.phase = Phase::Done;
                    return Ok(Step::Reply(Vec::new()));
                }
                // An observing filter that skips response headers (nothing in them is read)
                // starts the response with its body or trailers. NOTE: the shipped one sends
                // them: skipping them saved no measurable CPU (docs/benchmarks.md, session 25),
                // and a response without a body would then end only at the stream's close.
                (Request::ResponseBody(_) | Request::ResponseTrailers(_), Phase::AwaitResponse) => {
                    self.phase = Phase::Response;
                }
                _ => {}
            }
        }
        let replies = match (self.phase, request) {
            (Phase::AwaitRequestHeaders, Request::RequestHeaders(headers)) => {
                return Ok(self.on_request_headers(headers));
            }
            (Phase::BufferBody, Request::RequestBody(body)) => {
                return Ok(self.on_request_body(body));
            }
            (Phase::BufferBody, Request::RequestTrailers(_)) => {
                self.end = RequestEnd::Trailers;
                self.phase = Phase::Deciding;
                return Ok(Step::Decide);
            }
            (Phase::AwaitResponse, Request::ResponseHeaders(headers)) => {
                self.phase = if headers.end_of_stream {
                    self.end_response();
                    Phase::Done
                } else {
                    Phase::Response
                };
                let mut reply =
                    mutations::response_headers_continue(self.response.changes_length());
                if let Some(served) = served {
                    mutations::set_response_header(&mut reply, SERVED_ECHO_HEADER, &served);
                }
                vec![reply]
            }
            (Phase::Response, Request::ResponseBody(body)) => {
                if !body.body.is_empty() {
                    self.response_chunk();
                }
                self.usage.push(&body.body);
                if body.end_of_stream {
                    self.end_response();
                }
                if self.observing {
                    return Ok(Step::Reply(Vec::new()));
                }
                self.response
                    .on_chunk(body.body, body.end_of_stream, self.response_mode)
            }
            (Phase::Response, Request::ResponseTrailers(_)) => {
                self.end_response();
                vec![mutations::response_trailers_continue()]
            }
            (phase, request) => {
                return Err(ProtocolError::Unexpected {
                    message: message_name(&request),
                    phase: phase.name(),
                });
            }
        };
        if self.observing {
            // NOTE: in observability mode the gateway ignores answers; none are sent.
            return Ok(Step::Reply(Vec::new()));
        }
        Ok(Step::Reply(replies))
    }

    fn on_request_headers(&mut self, headers: HttpHeaders) -> Step {
        self.meta = RequestMeta::from_headers(headers.headers.as_ref());
        if self.ctx.conformance_hooks {
            self.selection = self
                .meta
                .endpoint_selection
                .as_deref()
                .map(EndpointSelection::parse);
        }
        if headers.end_of_stream {
            self.end = RequestEnd::Bodyless;
            self.phase = Phase::Deciding;
            return Step::Decide;
        }
        self.phase = Phase::BufferBody;
        self.phase_started = tokio::time::Instant::now();
        match self.request_mode {
            // Envoy holds the headers until the body's answer, which carries the pick.
            RequestBodyMode::Buffered => Step::Reply(vec![mutations::request_headers_continue()]),
            RequestBodyMode::FullDuplex => Step::Reply(Vec::new()),
        }
    }

    fn on_request_body(&mut self, body: HttpBody) -> Step {
        let started = Instant::now();
        let buffered = self.buffer(&body.body);
        self.buffering += started.elapsed();
        if let Err(rejection) = buffered {
            return Step::Reply(self.reject(rejection, None));
        }
        if body.end_of_stream {
            self.end = RequestEnd::Body;
            self.phase = Phase::Deciding;
            Step::Decide
        } else if self.request_mode == RequestBodyMode::Buffered {
            // NOTE: a held body is always whole: without end of stream, trailers follow, and
            // they are sent only once this message is answered (the pick goes with it).
            self.end = RequestEnd::Body;
            self.trailers_owed = true;
            self.phase = Phase::Deciding;
            Step::Decide
        } else {
            Step::Reply(Vec::new())
        }
    }

    fn buffer(&mut self, chunk: &[u8]) -> Result<(), Rejection> {
        if chunk.is_empty() {
            return Ok(());
        }
        let limit = self.ctx.max_body_bytes;
        if self.body.len().saturating_add(chunk.len()) > limit {
            return Err(Rejection::BodyTooLarge { limit });
        }
        self.ctx
            .body_budget
            .take(&mut self.budget, chunk.len())
            .map_err(|_| Rejection::BufferBudgetExhausted)?;
        self.ctx.metrics.buffered_bytes.add(chunk.len() as i64);
        self.body.extend_from_slice(chunk);
        Ok(())
    }

    fn release_body(&mut self) {
        let held = std::mem::take(&mut self.budget);
        self.ctx.metrics.buffered_bytes.sub(held.bytes() as i64);
        self.body = Vec::new();
    }

    /// The whole request is in: read it, admit it (shed or queue), pick, and return the
    /// headers response (with the destination metadata) and the body chunks.
    pub async fn decide(&mut self) -> Vec<ProcessingResponse> {
        let started = Instant::now();
        self.stage(Stage::Buffer, self.buffering);
        let prepared = match self.prepare_body().await {
            Ok(prepared) => prepared,
            Err(rejection) => return self.reject(rejection, None),
        };
        if let Some(times) = prepared.as_ref().map(|p| p.times) {
            self.stage(Stage::Parse, times.parse);
            if let Some(rewrite) = times.rewrite {
                self.stage(Stage::Rewrite, rewrite);
            }
            self.stage(Stage::Render, times.render);
            self.stage(Stage::Tokenize, times.tokenize);
        }
        let scheduling = Instant::now();
        let model = prepared.as_ref().map(|p| p.client_model.clone());
        let priority = self
            .meta
            .objective
            .as_ref()
            .and_then(|name| self.ctx.objectives.load().get(name).copied())
            .unwrap_or(0);
        self.priority = priority;
        let candidates = self.candidates();
        let labels = RequestLabels::new(
            model.as_deref(),
            prepared.as_ref().map(|p| p.target_model.as_str()),
            self.meta.fairness_id.as_deref(),
            priority,
        );
        let admitted = self
            .ctx
            .admission
            .admit(
                priority,
                self.meta.fairness_id.as_deref(),
                self.body.len(),
                &candidates,
                &labels,
                &self.ctx.metrics,
            )
            .await;
        // The permit counts the request as pending until the pick has counted it in flight.
        let _permit = match admitted {
            Ok(permit) => permit,
            Err(rejection) => return self.reject(rejection, model.as_deref()),
        };
        match self.pick(prepared, priority, labels, started, scheduling) {
            Ok(replies) => replies,
            Err((rejection, model)) => self.reject(rejection, model.as_deref()),
        }
    }

    fn stage(&self, stage: Stage, took: Duration) {
        self.ctx.metrics.stages.observe(stage, took.as_secs_f64());
    }

    /// Parses, rewrites and tokenizes the body (`None`: no body): inline when small, on the
    /// blocking pool when large.
    async fn prepare_body(&mut self) -> Result<Option<Prepared>, Rejection> {
        if self.end == RequestEnd::Bodyless || self.body.is_empty() {
            return Ok(None);
        }
        // NOTE: a small body tokenizes in well under a millisecond (tens of microseconds when
        // its prefix is cached), less than the two thread hand-offs of the blocking pool
        // cost in latency and CPU; only large bodies are worth moving off the async worker.
        // The prompt's block keys are computed here too, with the tokens (as far as the
        // scheduler asks, `warm_keys`): off the async worker for a large body, and out of the
        // decision.
        if self.body.len() <= INLINE_PREPARE_BYTES {
            let prepared = prepare(
                &self.ctx.tokenizers,
                &self.ctx.model_rewrites.load(),
                &self.meta,
                &self.body,
                self.ctx.scheduler.needs_prompt(),
            )?;
            let keying = Instant::now();
            self.ctx.scheduler.warm_keys(&prepared.prompt);
            self.stage(Stage::Keys, keying.elapsed());
            return Ok(Some(prepared));
        }
        self.large = true;
        self.trim_later = self.ctx.tokenizers.gate().trim_later(self.body.len());
        // Bounded: at most --max-preparing-bytes of bodies are prepared at once.
        let permit = self.ctx.tokenizers.gate().enter(self.body.len()).await;
        let body = std::mem::take(&mut self.body);
        let tokenizers = Arc::clone(&self.ctx.tokenizers);
        let rules = self.ctx.model_rewrites.load();
        let scheduler = Arc::clone(&self.ctx.scheduler);
        let meta = self.meta.clone();
        let sent = Instant::now();
        let work = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let started = Instant::now();
            let tokenize = scheduler.needs_prompt();
            let prepared = prepare(&tokenizers, &rules, &meta, &body, tokenize);
            let keying = Instant::now();
            if let Ok(prepared) = &prepared {
                scheduler.warm_keys(&prepared.prompt);
            }
            (prepared, body, started.elapsed(), keying.elapsed())
        });
        let (result, body, work, keys) = work
            .await
            .map_err(|_| Rejection::Internal("request preparation failed"))?;
        self.stage(Stage::PoolHop, sent.elapsed().saturating_sub(work));
        self.stage(Stage::Keys, keys);
        self.body = body;
        Ok(Some(result?))
    }

    /// The pool's endpoints the gateway's subset hint allows, from the current pool, less
    /// those that are down (unless all of them are).
    fn candidates(&self) -> Vec<Arc<crate::endpoints::EndpointState>> {
        let pool = self.ctx.datastore.snapshot();
        live_candidates(pool.endpoints.iter().filter(|e| {
            let addr = e.id().addr();
            self.subset.as_ref().is_none_or(|hint| hint.allows(addr))
                && self.selection.as_ref().is_none_or(|s| s.allows(addr))
        }))
    }

    /// The decision for the prepared request, then the replies that carry it.
    fn pick(
        &mut self,
        mut prepared: Option<Prepared>,
        priority: i32,
        labels: RequestLabels,
        started: Instant,
        scheduling: Instant,
    ) -> Result<Vec<ProcessingResponse>, (Rejection, Option<String>)> {
        let model = prepared.as_ref().map(|p| p.client_model.clone());
        let pick = self
            .schedule(prepared.as_mut(), model.clone(), priority)
            .map_err(|rejection| (rejection, model.clone()))?;
        self.count_routed(&pick, labels, started);
        let replying = Instant::now();
        self.stage(Stage::Schedule, replying.duration_since(scheduling));
        let replies = self.reply(&pick, prepared.as_ref());
        // The prepared request (a long prompt's tokens and keys) is freed here too.
        drop(prepared);
        self.stage(Stage::Reply, replying.elapsed());
        Ok(replies)
    }

    /// Asks the scheduler for a pod among the live candidates; keeps the pick's routing
    /// record (applied after the reply) and counts the request in flight on the primary.
    fn schedule(
        &mut self,
        prepared: Option<&mut Prepared>,
        model: Option<String>,
        priority: i32,
    ) -> Result<Pick, Rejection> {
        // A fresh look at the pool: flow control may have held the request a while.
        let candidates = self.candidates();
        if candidates.is_empty() {
            let pool_empty = self.ctx.datastore.snapshot().endpoints.is_empty();
            return Err(if self.selection.is_some() && !pool_empty {
                Rejection::NoSelectedEndpoint
            } else if self.subset.is_some() && !pool_empty {
                Rejection::EmptySubset
            } else {
                Rejection::Schedule(ScheduleError::NoCandidates)
            });
        }
        self.streamed = prepared.as_ref().is_some_and(|p| p.stream);
        let (target_model, prompt) = match prepared {
            // The prompt moves into the Arc the scheduler and the routing record share (no
            // copy of a long prompt or its keys); what the reply still needs of `prepared` is
            // the body, model names and `stream`.
            Some(p) => (
                Some(p.target_model.clone()),
                Arc::new(std::mem::take(&mut p.prompt)),
            ),
            None => (None, Arc::new(PromptKeys::default())),
        };
        let request = SchedulingRequest {
            model,
            target_model,
            prompt,
            body_bytes: self.body.len(),
            priority,
            fairness_id: self.meta.fairness_id.clone(),
            session_id: self.meta.session_id.clone(),
            slo: self.meta.slo,
        };
        if self.split {
            self.sweep_reservations();
        }
        let (pick, record) = self.ctx.scheduler.pick_deferred(&request, &candidates)?;
        self.record = (!record.is_empty()).then_some(record);
        let primary = candidates.iter().find(|e| e.id() == pick.primary);
        // Split: the request is counted as reserved until its observing stream takes it over.
        if self.split {
            if let Some(primary) = primary {
                self.reserve_pick(primary, &pick);
            }
            return Ok(pick);
        }
        if let Some(primary) = primary {
            self.count_on(
                primary,
                pick.expected.uncached_tokens.unwrap_or(0.0),
                pick.expected.cached_tokens,
                pick.expected.ttft_ms,
            );
        }
        Ok(pick)
    }

    /// Counts the request in flight on `endpoint` and its `uncached_tokens` in the endpoint's
    /// prefill backlog until its first byte (both returned when the stream ends, however).
    fn count_on(
        &mut self,
        endpoint: &crate::endpoints::EndpointState,
        uncached_tokens: f64,
        cached_tokens: f64,
        predicted_ms: Option<f64>,
    ) {
        self.in_flight = Some(endpoint.in_flight.start());
        self.prefill = Some(endpoint.prefill.start(
            uncached_tokens,
            cached_tokens,
            predicted_ms,
            Instant::now(),
        ));
    }

    /// The decision's metrics, and what the response phase needs to know of it.
    fn count_routed(&mut self, pick: &Pick, labels: RequestLabels, started: Instant) {
        let metrics = &self.ctx.metrics;
        metrics
            .scheduler_e2e
            .observe(started.elapsed().as_secs_f64());
        metrics.requests.with_label_values(&labels.values()).inc();
        metrics
            .request_sizes
            .with_label_values(&labels.values())
            .observe(self.body.len() as f64);
        self.routed = Some(Routed {
            pod: pick.primary,
            labels,
        });
    }

    fn reject(&mut self, rejection: Rejection, model: Option<&str>) -> Vec<ProcessingResponse> {
        let status = rejection.http_status();
        tracing::debug!(status, %rejection, "request rejected");
        let labels = RequestLabels::new(
            model,
            model,
            self.meta.fairness_id.as_deref(),
            self.priority,
        );
        self.ctx
            .metrics
            .request_errors
            .with_label_values(&labels.with_code(rejection.error_code()))
            .inc();
        self.release_body();
        self.phase = Phase::Done;
        // The gateway sends nothing more after an immediate response, trailers included.
        self.trailers_owed = false;
        vec![mutations::immediate_error(status, &rejection.to_string())]
    }
}

impl Drop for RequestStream {
    /// The gRPC stream is gone, however it ended: count an early end and return the body
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
