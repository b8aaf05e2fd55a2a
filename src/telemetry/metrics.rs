//! kvpick's own Prometheus metrics for the EPP path.
//!
//! Names follow GIE's EPP where GIE has one (`inference_objective_request_total`,
//! `inference_extension_scheduler_e2e_duration_seconds`, `inference_pool_ready_pods`, …) so
//! existing dashboards keep working; kvpick-only series are prefixed `kvpick_`.

use std::sync::Arc;

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

use super::labels::{BoundedVec, LabelLimiter};

/// A counter vector whose model labels are bounded ([`super::labels`]).
pub type ModelCounterVec = BoundedVec<IntCounterVec>;
/// A histogram vector whose model labels are bounded ([`super::labels`]).
pub type ModelHistogramVec = BoundedVec<HistogramVec>;

/// The labels of the per-request series, llm-d's set. GIE's names show them without
/// `fairness_id` (and, but for the request counter, without `priority`): [`super::llmd`].
pub const REQUEST_LABELS: [&str; 4] =
    ["model_name", "target_model_name", "fairness_id", "priority"];
/// [`REQUEST_LABELS`] and the error code.
pub const REQUEST_ERROR_LABELS: [&str; 5] = [
    "model_name",
    "target_model_name",
    "fairness_id",
    "priority",
    "error_code",
];
/// The labels of the flow-control queue gauge (GIE's and llm-d's).
pub const FLOW_QUEUE_LABELS: [&str; 5] = [
    "fairness_id",
    "priority",
    "inference_pool",
    "model_name",
    "target_model_name",
];
/// The labels of the flow-control queue-time histogram (GIE's and llm-d's).
pub const FLOW_OUTCOME_LABELS: [&str; 6] = [
    "fairness_id",
    "priority",
    "outcome",
    "inference_pool",
    "model_name",
    "target_model_name",
];

/// The fairness id of a request without `x-gateway-inference-fairness-id` (llm-d's).
pub const DEFAULT_FAIRNESS_ID: &str = "default-flow";

/// The values of a request's [`REQUEST_LABELS`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestLabels {
    /// The model the client asked for.
    pub model: String,
    /// The model the pods serve it as (after any rewrite).
    pub target_model: String,
    /// The flow-control tenant ([`DEFAULT_FAIRNESS_ID`] when none was sent).
    pub fairness_id: String,
    /// The objective's priority.
    pub priority: String,
}

impl RequestLabels {
    /// Labels for a request; an absent target model is the model, an absent tenant
    /// [`DEFAULT_FAIRNESS_ID`].
    pub fn new(
        model: Option<&str>,
        target_model: Option<&str>,
        fairness_id: Option<&str>,
        priority: i32,
    ) -> Self {
        let model = model.unwrap_or("");
        Self {
            model: model.to_owned(),
            target_model: target_model.unwrap_or(model).to_owned(),
            fairness_id: fairness_id
                .filter(|id| !id.is_empty())
                .unwrap_or(DEFAULT_FAIRNESS_ID)
                .to_owned(),
            priority: priority.to_string(),
        }
    }

    /// The values in [`REQUEST_LABELS`] order.
    pub fn values(&self) -> [&str; 4] {
        [
            &self.model,
            &self.target_model,
            &self.fairness_id,
            &self.priority,
        ]
    }

    /// The values in [`FLOW_QUEUE_LABELS`] order, in `pool`.
    pub fn in_queue<'a>(&'a self, pool: &'a str) -> [&'a str; 5] {
        [
            &self.fairness_id,
            &self.priority,
            pool,
            &self.model,
            &self.target_model,
        ]
    }

    /// The values in [`FLOW_OUTCOME_LABELS`] order, in `pool`.
    pub fn queue_outcome<'a>(&'a self, pool: &'a str, outcome: &'a str) -> [&'a str; 6] {
        [
            &self.fairness_id,
            &self.priority,
            outcome,
            pool,
            &self.model,
            &self.target_model,
        ]
    }

    /// The values in [`REQUEST_ERROR_LABELS`] order.
    pub fn with_code<'a>(&'a self, code: &'a str) -> [&'a str; 5] {
        let [m, t, f, p] = self.values();
        [m, t, f, p, code]
    }
}

/// Metrics of the ext-proc path and the pool.
#[derive(Debug, Clone)]
pub struct EppMetrics {
    /// Requests scheduled, by model (GIE: `inference_objective_request_total`).
    pub requests: ModelCounterVec,
    /// Requests answered with an error, by model and code
    /// (GIE: `inference_objective_request_error_total`).
    pub request_errors: ModelCounterVec,
    /// Request body sizes, by model (GIE: `inference_objective_request_sizes`).
    pub request_sizes: ModelHistogramVec,
    /// Time from the end of the request body to the pick
    /// (GIE: `inference_extension_scheduler_e2e_duration_seconds`).
    pub scheduler_e2e: Histogram,
    /// Endpoints with fresh metrics, by pool (GIE: `inference_pool_ready_pods`).
    pub ready_pods: IntGaugeVec,
    /// Mean KV-cache usage over the pool's fresh endpoints
    /// (GIE: `inference_pool_average_kv_cache_utilization`).
    pub pool_average_kv: GaugeVec,
    /// Mean waiting queue over the pool's fresh endpoints
    /// (GIE: `inference_pool_average_queue_size`).
    pub pool_average_queue: GaugeVec,
    /// In-flight requests per endpoint, kvpick's own count.
    pub in_flight: IntGaugeVec,
    /// Ext-proc streams currently open.
    pub open_streams: IntGauge,
    /// 1 while this replica may take traffic as the leader: it holds the Lease, or leader
    /// election is off (every replica serves); 0 while another replica holds the Lease.
    pub leader: IntGauge,
    /// Ext-proc streams that broke before the request was answered, by phase.
    pub aborted_streams: IntCounterVec,
    /// Observing streams (a gateway's `observability_mode` filter), by what they carried.
    pub observed_streams: IntCounterVec,
    /// Picks reserved until their observing stream (split filters), by how they ended.
    pub pick_reservations: IntCounterVec,
    /// Bytes of request bodies buffered right now.
    pub buffered_bytes: IntGauge,
    /// Prompt tokens the servers reported (GIE: `inference_objective_input_tokens`).
    pub input_tokens: ModelHistogramVec,
    /// Generated tokens the servers reported (GIE: `inference_objective_output_tokens`).
    pub output_tokens: ModelHistogramVec,
    /// Prompt tokens reported, by endpoint.
    pub prompt_tokens: IntCounterVec,
    /// Prompt tokens the servers served from their prefix cache, by endpoint: with
    /// `kvpick_prompt_tokens_total` this is the real cache hit rate of kvpick's routing.
    pub cached_prompt_tokens: IntCounterVec,
    /// Requests waiting in flow control, by [`FLOW_QUEUE_LABELS`]
    /// (GIE: `inference_extension_flow_control_queue_size`).
    pub flow_queue_size: BoundedVec<IntGaugeVec>,
    /// Time requests spent in flow control, by [`FLOW_OUTCOME_LABELS`]
    /// (GIE: `inference_extension_flow_control_request_queue_duration_seconds`).
    pub flow_queue_seconds: ModelHistogramVec,
    /// 1 while an endpoint is down (scrape refused and event stream gone), by endpoint.
    pub endpoint_down: IntGaugeVec,
    /// Times an endpoint went down, by endpoint.
    pub endpoint_down_total: IntCounterVec,
    /// Pool reloads applied.
    pub pool_reloads: IntCounter,
    /// Pool reloads rejected (unreadable or invalid file).
    pub pool_reload_errors: IntCounter,
    /// Ext-proc streams refused because `--max-extproc-streams` were open.
    pub refused_streams: IntCounter,
    /// Background subsystems that died (panicked or returned), by subsystem.
    pub subsystem_failures: IntCounterVec,
    /// `/metrics` and `/debug/*` requests refused for a missing or wrong bearer token.
    pub admin_unauthorized: IntCounter,
    /// The placement model's predicted and observed times to first token.
    pub ttft: super::TtftMetrics,
    /// Time per stage of the request path (`kvpick_request_stage_seconds`).
    pub stages: super::StageMetrics,
}

impl EppMetrics {
    /// Counts `n` pick reservations that ended as `result` (`taken`, `lapsed`).
    pub fn count_reservations(&self, result: &str, n: usize) {
        if n > 0 {
            self.pick_reservations
                .with_label_values(&[result])
                .inc_by(n as u64);
        }
    }

    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        Self::with_fairness_id_limit(registry, super::labels::MAX_LABEL_VALUES)
    }

    /// [`Self::new`], with at most `fairness_ids` distinct fairness ids getting series of
    /// their own (llm-d's `--fairness-id-metric-label-limit`; 0 counts them all as `other`).
    pub fn with_fairness_id_limit(
        registry: &Registry,
        fairness_ids: usize,
    ) -> prometheus::Result<Self> {
        // One limiter for every model label: the same client-chosen names feed them all.
        let models = Arc::new(LabelLimiter::new(registry)?);
        // Tenants come from a client header: their own bound, like llm-d's.
        let tenants = Arc::new(models.for_kind("fairness ids", fairness_ids));
        let metrics = Self {
            requests: BoundedVec::new(
                Arc::clone(&models),
                2,
                IntCounterVec::new(
                    Opts::new(
                        "inference_objective_request_total",
                        "Requests scheduled, by model.",
                    ),
                    &REQUEST_LABELS,
                )?,
            )
            .bounding(2, Arc::clone(&tenants)),
            request_errors: BoundedVec::new(
                Arc::clone(&models),
                2,
                IntCounterVec::new(
                    Opts::new(
                        "inference_objective_request_error_total",
                        "Requests answered with an error by kvpick, by model and error code.",
                    ),
                    &REQUEST_ERROR_LABELS,
                )?,
            )
            .bounding(2, Arc::clone(&tenants)),
            request_sizes: BoundedVec::new(
                Arc::clone(&models),
                2,
                HistogramVec::new(
                    HistogramOpts::new(
                        "inference_objective_request_sizes",
                        "Request body sizes in bytes.",
                    )
                    .buckets(prometheus::exponential_buckets(64.0, 4.0, 12)?),
                    &REQUEST_LABELS,
                )?,
            )
            .bounding(2, Arc::clone(&tenants)),
            scheduler_e2e: Histogram::with_opts(
                HistogramOpts::new(
                    "inference_extension_scheduler_e2e_duration_seconds",
                    "Time from the full request body to the pick.",
                )
                .buckets(prometheus::exponential_buckets(1e-6, 2.0, 20)?),
            )?,
            ready_pods: IntGaugeVec::new(
                Opts::new(
                    "inference_pool_ready_pods",
                    "Endpoints of the pool whose metrics are fresh.",
                ),
                &["name"],
            )?,
            pool_average_kv: GaugeVec::new(
                Opts::new(
                    "inference_pool_average_kv_cache_utilization",
                    "Mean KV-cache usage of the pool's endpoints with fresh metrics.",
                ),
                &["name"],
            )?,
            pool_average_queue: GaugeVec::new(
                Opts::new(
                    "inference_pool_average_queue_size",
                    "Mean waiting requests of the pool's endpoints with fresh metrics.",
                ),
                &["name"],
            )?,
            in_flight: IntGaugeVec::new(
                Opts::new(
                    "kvpick_endpoint_in_flight_requests",
                    "Requests routed to an endpoint whose response has not ended (this replica's, plus the other replicas' from the replica exchange).",
                ),
                &["endpoint"],
            )?,
            open_streams: IntGauge::new("kvpick_extproc_open_streams", "Open ext-proc streams.")?,
            leader: {
                let leader = IntGauge::new(
                    "kvpick_leader",
                    "1 while this replica holds the leader Lease or leader election is off; 0 while another replica leads.",
                )?;
                leader.set(1);
                leader
            },
            aborted_streams: IntCounterVec::new(
                Opts::new(
                    "kvpick_extproc_aborted_streams_total",
                    "Ext-proc streams that ended early, by the phase they were in.",
                ),
                &["phase"],
            )?,
            observed_streams: IntCounterVec::new(
                Opts::new(
                    "kvpick_extproc_observed_streams_total",
                    "Observing ext-proc streams (observability_mode), by result: `observed` \
                     (a pick's response followed), `not_routed` (no hand-off: the request \
                     failed open or kvpick answered it), `bad_handoff`, `unknown_endpoint` \
                     (the pod left the pool).",
                ),
                &["result"],
            )?,
            pick_reservations: IntCounterVec::new(
                Opts::new(
                    "kvpick_extproc_pick_reservations_total",
                    "Picks counted on their pod from the decision until their observing \
                     stream took them over (split filters), by result: `taken` (the observing \
                     stream was this replica's), `lapsed` (none came within 250 ms: another \
                     replica observed the request, or no observing filter is configured).",
                ),
                &["result"],
            )?,
            buffered_bytes: IntGauge::new(
                "kvpick_extproc_buffered_body_bytes",
                "Request body bytes buffered across all streams.",
            )?,
            input_tokens: BoundedVec::new(
                Arc::clone(&models),
                2,
                HistogramVec::new(
                    HistogramOpts::new(
                        "inference_objective_input_tokens",
                        "Prompt tokens per request, as the model server reported.",
                    )
                    .buckets(prometheus::exponential_buckets(16.0, 2.0, 16)?),
                    &REQUEST_LABELS,
                )?,
            )
            .bounding(2, Arc::clone(&tenants)),
            output_tokens: BoundedVec::new(
                Arc::clone(&models),
                2,
                HistogramVec::new(
                    HistogramOpts::new(
                        "inference_objective_output_tokens",
                        "Generated tokens per request, as the model server reported.",
                    )
                    .buckets(prometheus::exponential_buckets(1.0, 2.0, 16)?),
                    &REQUEST_LABELS,
                )?,
            )
            .bounding(2, Arc::clone(&tenants)),
            prompt_tokens: IntCounterVec::new(
                Opts::new(
                    "kvpick_prompt_tokens_total",
                    "Prompt tokens reported by model servers, by endpoint.",
                ),
                &["endpoint"],
            )?,
            cached_prompt_tokens: IntCounterVec::new(
                Opts::new(
                    "kvpick_cached_prompt_tokens_total",
                    "Prompt tokens served from the model servers' prefix caches, by endpoint.",
                ),
                &["endpoint"],
            )?,
            flow_queue_size: BoundedVec::new(
                Arc::clone(&tenants),
                1,
                IntGaugeVec::new(
                    Opts::new(
                        "inference_extension_flow_control_queue_size",
                        "Requests waiting in flow control.",
                    ),
                    &FLOW_QUEUE_LABELS,
                )?,
            )
            .bounding(3, Arc::clone(&models))
            .bounding(4, Arc::clone(&models)),
            flow_queue_seconds: BoundedVec::new(
                Arc::clone(&tenants),
                1,
                HistogramVec::new(
                    HistogramOpts::new(
                        "inference_extension_flow_control_request_queue_duration_seconds",
                        "Time a request waited in flow control, by outcome.",
                    )
                    .buckets(prometheus::exponential_buckets(1e-4, 2.0, 20)?),
                    &FLOW_OUTCOME_LABELS,
                )?,
            )
            .bounding(4, Arc::clone(&models))
            .bounding(5, Arc::clone(&models)),
            endpoint_down: IntGaugeVec::new(
                Opts::new(
                    "kvpick_endpoint_down",
                    "1 while the endpoint is down (its scrape is refused and its KV-event stream is disconnected) and left out of the candidates.",
                ),
                &["endpoint"],
            )?,
            endpoint_down_total: IntCounterVec::new(
                Opts::new(
                    "kvpick_endpoint_down_total",
                    "Times the endpoint went down.",
                ),
                &["endpoint"],
            )?,
            pool_reloads: IntCounter::new("kvpick_pool_reloads_total", "Pool updates applied.")?,
            pool_reload_errors: IntCounter::new(
                "kvpick_pool_reload_errors_total",
                "Pool updates rejected (unreadable or invalid).",
            )?,
            refused_streams: IntCounter::new(
                "kvpick_extproc_refused_streams_total",
                "Ext-proc streams refused because the open-stream bound was reached.",
            )?,
            subsystem_failures: IntCounterVec::new(
                Opts::new(
                    "kvpick_subsystem_failures_total",
                    "Background subsystems that died (panicked or ended), by subsystem.",
                ),
                &["subsystem"],
            )?,
            admin_unauthorized: IntCounter::new(
                "kvpick_admin_unauthorized_requests_total",
                "Requests to /metrics or /debug/* refused for a missing or wrong bearer token.",
            )?,
            ttft: super::TtftMetrics::new(registry)?,
            stages: super::StageMetrics::new(registry)?,
        };
        registry.register(Box::new(metrics.requests.inner().clone()))?;
        registry.register(Box::new(metrics.request_errors.inner().clone()))?;
        registry.register(Box::new(metrics.request_sizes.inner().clone()))?;
        registry.register(Box::new(metrics.scheduler_e2e.clone()))?;
        registry.register(Box::new(metrics.ready_pods.clone()))?;
        registry.register(Box::new(metrics.pool_average_kv.clone()))?;
        registry.register(Box::new(metrics.pool_average_queue.clone()))?;
        registry.register(Box::new(metrics.in_flight.clone()))?;
        registry.register(Box::new(metrics.open_streams.clone()))?;
        registry.register(Box::new(metrics.leader.clone()))?;
        registry.register(Box::new(metrics.aborted_streams.clone()))?;
        registry.register(Box::new(metrics.observed_streams.clone()))?;
        registry.register(Box::new(metrics.pick_reservations.clone()))?;
        registry.register(Box::new(metrics.buffered_bytes.clone()))?;
        registry.register(Box::new(metrics.input_tokens.inner().clone()))?;
        registry.register(Box::new(metrics.output_tokens.inner().clone()))?;
        registry.register(Box::new(metrics.prompt_tokens.clone()))?;
        registry.register(Box::new(metrics.cached_prompt_tokens.clone()))?;
        registry.register(Box::new(metrics.flow_queue_size.inner().clone()))?;
        registry.register(Box::new(metrics.flow_queue_seconds.inner().clone()))?;
        registry.register(Box::new(metrics.endpoint_down.clone()))?;
        registry.register(Box::new(metrics.endpoint_down_total.clone()))?;
        registry.register(Box::new(metrics.pool_reloads.clone()))?;
        registry.register(Box::new(metrics.pool_reload_errors.clone()))?;
        registry.register(Box::new(metrics.refused_streams.clone()))?;
        registry.register(Box::new(metrics.subsystem_failures.clone()))?;
        registry.register(Box::new(metrics.admin_unauthorized.clone()))?;
        Ok(metrics)
    }
}
