//! The decision: which endpoint serves a request, and which ones to fall back to.
//!
//! The ext-proc path hands a [`Scheduler`] the request's [`SchedulingRequest`] and the
//! candidate endpoints (the pool, narrowed by the gateway's subset hint) and gets back a
//! [`Pick`]: the primary first, then ordered fallbacks. What the pick leaves for the next
//! requests (the prefix index's routing record) can be applied after the reply
//! ([`Scheduler::pick_deferred`], [`PendingRecord`]).
//!
//! The configurable scheduler ([`ConfiguredScheduler`]) runs one GIE-style profile (two
//! under llm-d's prefill/decode `pd-profile-handler`: decode picks the destination, prefill
//! the pod named in [`Pick::prefill`]): filters
//! ([`filters`]) → weighted scorers ([`scorers`], [`affinity`]) → picker ([`pickers`]), built
//! once from a typed [`SchedulerConfig`] ([`spec`]; parsed from EndpointPickerConfig YAML by
//! `crate::config::picker_config`). [`saturation`] says when the pool is full (shedding, flow
//! control), and [`flow_control`] holds requests while it is. [`LeastInFlight`] is the minimal fallback scheduler.

pub mod affinity;
pub mod approx_prefix;
pub mod configured;
pub mod cycle;
pub mod filters;
pub mod flow_control;
mod least_in_flight;
pub mod pickers;
pub mod placement;
mod record;
pub mod saturation;
pub mod scorers;
pub mod spec;

use std::sync::Arc;

use crate::endpoints::{EndpointState, PodId};
use crate::kvcache::{KeyContext, PromptKeys};

pub use configured::{
    CandidateExplain, ConfiguredScheduler, DisaggregationExplain, Explanation, SchedulerDeps,
};
pub use cycle::MetricsSource;
pub use flow_control::{FlowControlConfig, FlowController, FlowError, FlowRequest, Permit};
pub use least_in_flight::LeastInFlight;
pub use record::PendingRecord;
pub use saturation::{PoolSaturation, SaturationDetector};
pub use spec::{
    CostModel, FilterKind, FilterSpec, PickerSpec, PlacementParams, PrefillDecodeSpec,
    PrefixCacheParams, PrefixMode, ProfileHandlerSpec, SaturationConfig, SchedulerConfig,
    ScorerSpec, WeightedScorer,
};

/// What the scheduler knows of a request.
#[derive(Debug, Clone)]
pub struct SchedulingRequest {
    /// The model the client named, when there is a body.
    pub model: Option<String>,
    /// The model the pods serve for this request (after any rewrite); a LoRA adapter's name
    /// when the request runs on one.
    pub target_model: Option<String>,
    /// The prompt as the model server will tokenize it (or approximate text), how the prefix
    /// index keys it (base model as in the pods' KV-event topics, LoRA adapter, cache salt;
    /// no context without a model), and its block keys as far as computed. Shared with the
    /// routing record that follows the pick.
    pub prompt: Arc<PromptKeys>,
    /// The request body size in bytes.
    pub body_bytes: usize,
    /// Priority from the request's objective: higher is more important, negative is
    /// sheddable. 0 when no objective is named.
    pub priority: i32,
    /// The flow-control tenant (`x-gateway-inference-fairness-id`).
    pub fairness_id: Option<String>,
    /// A client session id for session affinity (`x-session-id` header), when sent.
    pub session_id: Option<String>,
    /// The latency objectives the client asked for (llm-d's SLO headers), if any.
    pub slo: LatencySlo,
}

/// A request's latency objectives (llm-d's `x-llm-d-slo-ttft-ms`, `x-llm-d-slo-tpot-ms`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencySlo {
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Time per output token, ms.
    pub tpot_ms: Option<f64>,
}

impl LatencySlo {
    /// Whether any objective is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some()
    }

    /// Whether predictions `ttft_ms` and `tpot_ms` meet the objectives; a prediction that
    /// does not exist yet (no decode measured) does not count against its objective.
    pub fn met_by(&self, ttft_ms: f64, tpot_ms: Option<f64>) -> bool {
        self.ttft_ms.is_none_or(|slo| ttft_ms <= slo)
            && match (self.tpot_ms, tpot_ms) {
                (Some(slo), Some(predicted)) => predicted <= slo,
                _ => true,
            }
    }
}

impl Default for SchedulingRequest {
    fn default() -> Self {
        Self {
            model: None,
            target_model: None,
            prompt: Arc::new(PromptKeys::default()),
            body_bytes: 0,
            priority: 0,
            fairness_id: None,
            session_id: None,
            slo: LatencySlo::default(),
        }
    }
}

impl SchedulingRequest {
    /// How the prefix index keys this request (`None` without a model).
    pub fn key_context(&self) -> Option<&KeyContext> {
        self.prompt.context()
    }
}

/// The scheduler's answer: the primary endpoint, then ordered fallbacks.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// The primary.
    pub primary: PodId,
    /// Fallbacks, best first.
    pub fallbacks: Vec<PodId>,
    /// Prefill/decode disaggregation: the endpoint that runs the prefill
    /// (`x-prefiller-host-port`), when the profile handler ran the prefill profile.
    pub prefill: Option<PodId>,
    /// The scores behind the pick, when the scheduler was asked to emit them
    /// (`--emit-endpoint-scores`); `None` otherwise (nothing is computed for it).
    pub trace: Option<Box<ScoreTrace>>,
    /// What the scheduler expects of the primary (the response path measures it).
    pub expected: Expected,
}

/// What a pick expects of its primary.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Expected {
    /// Prompt tokens the primary does not hold (its prefill work); `None` without a prompt.
    pub uncached_tokens: Option<f64>,
    /// Prompt tokens the primary holds (0 without a prompt or a prefix lookup).
    pub cached_tokens: f64,
    /// Predicted time to first token, ms (under `kv-placement-scorer` or `ttft-cost-scorer`).
    pub ttft_ms: Option<f64>,
}

/// The scores behind one pick: the same per-candidate view `POST /debug/explain` reports,
/// taken from the pick's own scoring pass.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreTrace {
    /// The profile that picked the destination.
    pub profile: String,
    /// Candidates that reached scoring: the picked one first, then best total first.
    pub candidates: Vec<CandidateExplain>,
}

impl Pick {
    /// A pick of `primary` then `fallbacks`, without prefill or trace.
    pub fn new(primary: PodId, fallbacks: Vec<PodId>) -> Self {
        Self {
            primary,
            fallbacks,
            prefill: None,
            trace: None,
            expected: Expected::default(),
        }
    }

    /// The destination header value: `primary[,fallback…]`.
    pub fn header_value(&self) -> String {
        let mut value = self.primary.to_string();
        for fallback in &self.fallbacks {
            value.push(',');
            value.push_str(&fallback.to_string());
        }
        value
    }
}

/// Why no endpoint could be picked.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    /// No endpoint was eligible.
    #[error("no candidate endpoints")]
    NoCandidates,
    /// A sheddable request's latency objective can be met by no endpoint (none is predicted
    /// to, none is idle, none has a cold cache).
    #[error("request is sheddable and no endpoint is predicted to meet its latency SLO")]
    SloUnattainable,
}

/// Picks endpoints for requests.
pub trait Scheduler: Send + Sync + 'static {
    /// Picks among `candidates` (never empty when called by the ext-proc path).
    fn pick(
        &self,
        request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Result<Pick, ScheduleError>;

    /// [`Self::pick`], leaving the routing record of the pick (state kept for the next
    /// requests) to the caller, to apply once the reply is on its way. The default records
    /// inside `pick`.
    fn pick_deferred(
        &self,
        request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Result<(Pick, PendingRecord), ScheduleError> {
        self.pick(request, candidates)
            .map(|pick| (pick, PendingRecord::default()))
    }

    /// Computes ahead what this scheduler will need of a request's block keys, on the thread
    /// that tokenized the prompt (so the decision finds them ready). The default needs none.
    fn warm_keys(&self, _keys: &PromptKeys) {}

    /// Whether any decision reads the prompt (tokens, text or prefix matches); when not, the
    /// request path skips rendering and tokenizing it. The default: it does.
    fn needs_prompt(&self) -> bool {
        true
    }
}
