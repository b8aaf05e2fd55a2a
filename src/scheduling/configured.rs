//! [`ConfiguredScheduler`]: one profile (filters → weighted scorers → picker) built from a
//! validated [`SchedulerConfig`], implementing [`Scheduler`].
//!
//! One pick: read every candidate once ([`PodView`]), run the filters in order, compute the
//! request's prefix matches once (only when a scorer needs them), let every scorer fill its
//! column, sum `weight × score`, let the picker order the endpoints, then tell the stateful
//! parts what was picked: session/no-hit memory, the approximate text-prefix store, and the
//! prefix index's routing record (`PrefixIndex::record_routed`: speculative holders for pods
//! with KV events, the LRU model for pods without).
//!
//! Under `pd-profile-handler` this profile is the decode profile; the prefill profile is a
//! second `ConfiguredScheduler` (same index and metrics) run after the decode pick when the
//! prompt tokens not cached on the decode pod reach the threshold — before the decode pick is
//! recorded, so its speculative entries cannot attract the prefill.
//!
//! Concurrency rules: `pick` takes `&self` and is called concurrently; all shared state is
//! behind the index's own locks, the approximate store's mutex and the scorers' mutexes, each
//! held for one short step. No lock is held across the whole pick.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::endpoints::{EndpointState, PodId};
use crate::kvcache::{PrefixIndex, PrefixLookup, PromptKeys};
use crate::tokenize::PromptTokens;

use super::record::PendingRecord;

use super::approx_prefix::{ApproxPrefixStore, chunk_hashes};
use super::cycle::{Cycle, HomeHit, MetricsSource, PodView, PrefixHit};
use super::filters::{self, FilterReport};
use super::pickers;
use super::placement;
use super::saturation::{SaturationDetector, endpoint_saturation};
use super::scorers::{Scorer, estimate_ttft_ms};
use super::spec::{
    CostModel, FilterSpec, PlacementParams, PrefillDecodeSpec, PrefixCacheParams, PrefixMode,
    ProfileHandlerSpec, SchedulerConfig, ScorerSpec,
};
use super::{Expected, Pick, ScheduleError, Scheduler, SchedulingRequest, ScoreTrace};

/// What the scheduler reads besides the request.
#[derive(Clone)]
pub struct SchedulerDeps {
    /// The prefix index (precise from KV events, approximate from routing).
    pub index: Arc<PrefixIndex>,
    /// Endpoint metrics (the scrape store).
    pub metrics: Arc<dyn MetricsSource>,
}

/// One built scorer of the profile.
struct ProfileScorer {
    name: String,
    plugin_type: &'static str,
    weight: f64,
    scorer: Scorer,
}

/// Endpoints remembered by the approximate text-prefix store.
const APPROX_MAX_ENDPOINTS: usize = 4096;

/// A scheduler running one configured profile.
pub struct ConfiguredScheduler {
    config: SchedulerConfig,
    filters: Vec<FilterSpec>,
    scorers: Vec<ProfileScorer>,
    prefix: Option<PrefixCacheParams>,
    chars_per_token: f64,
    cost_model: Option<CostModel>,
    placement: Option<PlacementParams>,
    approx: ApproxPrefixStore,
    deps: SchedulerDeps,
    limit: usize,
    detector: SaturationDetector,
    plugin_seconds: Option<prometheus::HistogramVec>,
    emit_scores: bool,
    disaggregation: Option<Disaggregation>,
    pd_decisions: Option<prometheus::IntCounterVec>,
}

/// The prefill side of `pd-profile-handler`: the handler's spec and the prefill profile built
/// as its own scheduler (same index and metrics).
struct Disaggregation {
    spec: PrefillDecodeSpec,
    prefill: Box<ConfiguredScheduler>,
}

impl std::fmt::Debug for ConfiguredScheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfiguredScheduler")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// One candidate in an explanation.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CandidateExplain {
    /// `ip:port`.
    pub address: String,
    /// Each scorer's raw score in [0, 1], by plugin name.
    pub scores: BTreeMap<String, f64>,
    /// Σ weight × score.
    pub total: f64,
    /// Prompt tokens expected cached there (offloaded blocks at their tier weight).
    pub cached_tokens: f64,
    /// Its saturation (≥ 1.0: saturated; stale metrics count as 1.0).
    pub saturation: f64,
    /// The cost model's TTFT estimate, when a cost scorer is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_ttft_ms: Option<f64>,
    /// What placing the request there would evict, in ms of prefill (placement scorer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub displacement_ms: Option<f64>,
    /// What placing the request there would cost the requests queued behind it, in ms of
    /// their waiting (placement scorer's hold-up).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holdup_ms: Option<f64>,
    /// In-flight requests (kvpick's count).
    pub in_flight: u64,
    /// Whether its metrics were fresh.
    pub fresh_metrics: bool,
}

/// The answer of `POST /debug/explain`: what every stage did, without recording the pick.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Explanation {
    /// The profile run.
    pub profile: String,
    /// Each filter's removals, in order.
    pub filters: Vec<FilterReport>,
    /// The candidates that reached scoring.
    pub candidates: Vec<CandidateExplain>,
    /// Prompt length in tokens (estimated for approximate prompts).
    pub prompt_tokens: f64,
    /// The pick (`primary` first), or `None` when nothing was eligible.
    pub pick: Option<Vec<String>>,
    /// Prefill/decode disaggregation (`pd-profile-handler`): this explanation is the decode
    /// profile's; this says whether and where the prefill would run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<DisaggregationExplain>,
}

/// What `pd-profile-handler` decided for an explained request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DisaggregationExplain {
    /// The handler's plugin name.
    pub handler: String,
    /// Uncached tokens at or above which prefill runs separately (0: always).
    pub threshold_tokens: u64,
    /// Prompt tokens not cached on the decode pick.
    pub uncached_tokens: f64,
    /// Whether the prefill profile runs.
    pub prefill_ran: bool,
    /// The prefill profile's explanation, when it runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<Box<Explanation>>,
}

impl ConfiguredScheduler {
    /// Builds the profile of `config`; the destination lists at most `max_fallbacks`
    /// fallbacks after the primary (and no more than the picker's `maxNumOfEndpoints` − 1).
    pub fn new(config: SchedulerConfig, deps: SchedulerDeps, max_fallbacks: usize) -> Self {
        let scorers = config
            .scorers
            .iter()
            .map(|s| ProfileScorer {
                name: s.name.clone(),
                plugin_type: s.plugin_type,
                weight: s.weight,
                scorer: Scorer::from_spec(&s.scorer),
            })
            .collect();
        let prefix = config.scorers.iter().find_map(|s| match &s.scorer {
            ScorerSpec::PrefixCache(p) => Some(p.clone()),
            _ => None,
        });
        // P/D decides on the decode pick's cached tokens: it needs the prefix matches too.
        let needs_prefix = config.scorers.iter().any(|s| s.scorer.needs_prefix())
            || matches!(config.handler, ProfileHandlerSpec::PrefillDecode(_));
        let cost_model = config.scorers.iter().find_map(|s| match &s.scorer {
            ScorerSpec::Cost(m) => Some(*m),
            _ => None,
        });
        let placement = config.scorers.iter().find_map(|s| match &s.scorer {
            ScorerSpec::Placement(p) => Some(*p),
            _ => None,
        });
        let chars_per_token = cost_model
            .map_or(4.0, |m| m.chars_per_token)
            .max(f64::MIN_POSITIVE);
        let prefix = prefix.or_else(|| needs_prefix.then(PrefixCacheParams::default));
        let capacity = prefix
            .as_ref()
            .map_or(1, |p| p.approx_capacity_per_endpoint);
        let limit = pickers::max_endpoints(&config.picker)
            .unwrap_or(usize::MAX)
            .min(max_fallbacks.saturating_add(1))
            .max(1);
        let detector = SaturationDetector::new(config.saturation, Arc::clone(&deps.metrics));
        let disaggregation = match &config.handler {
            ProfileHandlerSpec::Single => None,
            ProfileHandlerSpec::PrefillDecode(spec) => Some(Disaggregation {
                prefill: Box::new(Self::new((*spec.prefill).clone(), deps.clone(), 0)),
                spec: spec.clone(),
            }),
        };
        Self {
            filters: config.filters.clone(),
            scorers,
            prefix,
            chars_per_token,
            cost_model,
            placement,
            approx: ApproxPrefixStore::new(capacity, APPROX_MAX_ENDPOINTS),
            deps,
            limit,
            detector,
            plugin_seconds: None,
            emit_scores: false,
            disaggregation,
            pd_decisions: None,
            config,
        }
    }

    /// Times every filter, the prefix lookup, every scorer and the picker into
    /// `inference_extension_plugin_duration_seconds{extension_point, plugin_type,
    /// plugin_name}` (GIE's metric and labels: `plugin_type` is the config `type`,
    /// `plugin_name` the instance name). Under `pd-profile-handler` it also counts the
    /// decisions in llm-d's `llm_d_inference_scheduler_pd_decision_total{decision_type}`
    /// (`prefill-decode` when a prefill pod was named, else `decode-only`), so llm-d
    /// dashboards keep working.
    pub fn with_plugin_metrics(
        mut self,
        registry: &prometheus::Registry,
    ) -> prometheus::Result<Self> {
        let histogram = prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new(
                "inference_extension_plugin_duration_seconds",
                "Time spent in each scheduling plugin.",
            )
            .buckets(prometheus::exponential_buckets(1e-7, 2.0, 24)?),
            &["extension_point", "plugin_type", "plugin_name"],
        )?;
        registry.register(Box::new(histogram.clone()))?;
        self.set_plugin_histogram(&histogram);
        if self.disaggregation.is_some() {
            let decisions = prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    "llm_d_inference_scheduler_pd_decision_total",
                    "Prefill/decode disaggregation decisions (llm-d's metric).",
                ),
                &["decision_type"],
            )?;
            registry.register(Box::new(decisions.clone()))?;
            self.pd_decisions = Some(decisions);
        }
        Ok(self)
    }

    fn set_plugin_histogram(&mut self, histogram: &prometheus::HistogramVec) {
        self.plugin_seconds = Some(histogram.clone());
        if let Some(pd) = self.disaggregation.as_mut() {
            pd.prefill.set_plugin_histogram(histogram);
        }
    }

    /// With `on`, every pick carries its [`ScoreTrace`] (`--emit-endpoint-scores`): the
    /// pick keeps its per-scorer columns and reports them as `/debug/explain` does. Off (the
    /// default), a pick keeps no columns and builds no trace.
    pub fn with_score_trace(mut self, on: bool) -> Self {
        self.emit_scores = on;
        self
    }

    fn observe(&self, point: &str, plugin_type: &str, plugin: &str, started: Instant) {
        if let Some(histogram) = &self.plugin_seconds {
            histogram
                .with_label_values(&[point, plugin_type, plugin])
                .observe(started.elapsed().as_secs_f64());
        }
    }

    /// The configuration it runs.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The saturation detector with this configuration's thresholds (for shedding and flow
    /// control).
    pub fn saturation_detector(&self) -> &SaturationDetector {
        &self.detector
    }

    /// Runs the profile without recording anything and reports every stage.
    pub fn explain(
        &self,
        request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Explanation {
        let mut reports = Vec::new();
        let run = self.run(request, candidates, Some(&mut reports), true);
        let mut explanation = Explanation {
            profile: self.config.profile_name.clone(),
            filters: reports,
            candidates: Vec::new(),
            prompt_tokens: 0.0,
            pick: None,
            disaggregation: None,
        };
        let Some((cycle, columns, totals, order)) = run else {
            return explanation;
        };
        explanation.prompt_tokens = cycle.prompt_tokens;
        explanation.candidates = self.candidate_explains(&cycle, &columns, &totals);
        explanation.pick = Some(
            order
                .iter()
                .filter_map(|i| cycle.pods.get(*i).map(|p| p.id.to_string()))
                .collect(),
        );
        if let Some(pd) = &self.disaggregation {
            let uncached = uncached_tokens(&cycle, &order);
            let prefill_ran = pd.spec.needs_prefill(uncached);
            explanation.disaggregation = Some(DisaggregationExplain {
                handler: pd.spec.name.clone(),
                threshold_tokens: pd.spec.threshold_tokens,
                uncached_tokens: uncached,
                prefill_ran,
                prefill: prefill_ran.then(|| Box::new(pd.prefill.explain(request, candidates))),
            });
        }
        explanation
    }

    /// Every scored candidate's view (what explain and the score trace report).
    fn candidate_explains(
        &self,
        cycle: &Cycle<'_>,
        columns: &[Vec<f64>],
        totals: &[f64],
    ) -> Vec<CandidateExplain> {
        let placement = self.placement.map(|p| placement::costs(cycle, &p));
        let fleet = placement::fleet_line(&cycle.pods);
        cycle
            .pods
            .iter()
            .enumerate()
            .map(|(i, pod)| {
                let placed = placement.as_ref().and_then(|c| c.get(i));
                CandidateExplain {
                    address: pod.id.to_string(),
                    scores: self
                        .scorers
                        .iter()
                        .zip(columns)
                        .map(|(s, col)| (s.name.clone(), col.get(i).copied().unwrap_or(0.0)))
                        .collect(),
                    total: totals.get(i).copied().unwrap_or(0.0),
                    cached_tokens: cycle.prefix_hit(i).cached_tokens,
                    estimated_ttft_ms: self
                        .cost_model
                        .map(|model| {
                            estimate_ttft_ms(
                                &model,
                                pod,
                                fleet,
                                cycle.prompt_tokens,
                                cycle.prefix_hit(i).cached_tokens,
                            )
                        })
                        .or_else(|| placed.map(|c| c.ttft_ms)),
                    displacement_ms: placed.map(|c| c.displacement_ms),
                    holdup_ms: placed.map(|c| c.holdup_ms),
                    saturation: endpoint_saturation(&self.config.saturation, pod),
                    in_flight: pod.in_flight,
                    fresh_metrics: pod.fresh,
                }
            })
            .collect()
    }

    /// Filters, scores and orders; `None` when no candidate survives the filters.
    #[allow(clippy::type_complexity)]
    fn run<'r>(
        &self,
        request: &'r SchedulingRequest,
        candidates: &[Arc<EndpointState>],
        mut reports: Option<&mut Vec<FilterReport>>,
        keep_columns: bool,
    ) -> Option<(Cycle<'r>, Vec<Vec<f64>>, Vec<f64>, Vec<usize>)> {
        let now = Instant::now();
        let staleness = self.config.saturation.metrics_staleness;
        let ids: Vec<PodId> = candidates.iter().map(|e| e.id()).collect();
        let statuses = self.deps.metrics.statuses(&ids);
        let mut pods: Vec<PodView> = candidates
            .iter()
            .zip(&statuses)
            .map(|(e, status)| PodView::with_status(e, status, now, staleness))
            .collect();
        for filter in &self.filters {
            let started = Instant::now();
            let (removed, kept_all) =
                filters::apply(&filter.filter, request, &self.config.saturation, &mut pods);
            self.observe("Filter", filter.plugin_type, &filter.name, started);
            if let Some(reports) = reports.as_deref_mut() {
                reports.push(FilterReport {
                    filter: filter.name.clone(),
                    removed: removed.iter().map(PodId::to_string).collect(),
                    kept_all,
                });
            }
        }
        if pods.is_empty() {
            return None;
        }
        // The placement and cost scorers predict from each pod's prefill backlog and fitted
        // time to first token; only placement reads the blocks held.
        if self.placement.is_some() || self.cost_model.is_some() {
            for pod in &mut pods {
                pod.prefill = pod.endpoint.prefill.view_loaded(now, pod.in_flight);
                if self.placement.is_some() {
                    pod.held_blocks = self.deps.index.pod_entries(pod.id) as u64;
                }
            }
        }
        let mut cycle = Cycle {
            request,
            prompt_tokens: 0.0,
            prefix: Vec::new(),
            lookup: None,
            home: None,
            pods,
        };
        let started = Instant::now();
        self.prefix_hits(&mut cycle);
        self.observe(
            "DataProducer",
            "prefix-cache-match",
            "prefix-cache-match",
            started,
        );
        let n = cycle.pods.len();
        let mut totals = vec![0.0; n];
        let mut columns = Vec::new();
        let mut column = vec![0.0; n];
        for scorer in &self.scorers {
            let started = Instant::now();
            column.iter_mut().for_each(|s| *s = 0.0);
            scorer.scorer.score(&cycle, &mut column);
            self.observe("Scorer", scorer.plugin_type, &scorer.name, started);
            for (total, score) in totals.iter_mut().zip(&column) {
                *total += scorer.weight * score;
            }
            if keep_columns {
                columns.push(column.clone());
            }
        }
        let started = Instant::now();
        let order = pickers::order(&self.config.picker, &totals, self.limit);
        self.observe(
            "Picker",
            self.config.picker_type,
            &self.config.picker_name,
            started,
        );
        Some((cycle, columns, totals, order))
    }

    fn prefix_hits(&self, cycle: &mut Cycle<'_>) {
        match cycle.request.prompt.prompt() {
            PromptTokens::Empty => {}
            PromptTokens::Exact(tokens) => {
                cycle.prompt_tokens = tokens.len() as f64;
                if self.prefix.is_none() || cycle.request.key_context().is_none() {
                    return;
                }
                let ids: Vec<PodId> = cycle.pods.iter().map(|p| p.id).collect();
                let lookup = self.deps.index.lookup(&cycle.request.prompt, &ids);
                cycle.prefix = lookup
                    .matches
                    .iter()
                    .map(|m| PrefixHit {
                        score: m.score(),
                        // Offloaded (CPU) blocks save less than GPU ones: count them at
                        // their tier weight.
                        cached_tokens: (m.weighted_blocks * f64::from(m.block_size))
                            .min(cycle.prompt_tokens),
                    })
                    .collect();
                if self.placement.is_some_and(|p| p.home_bias > 1.0) {
                    cycle.home = self.home_hit(cycle, &lookup);
                }
                cycle.lookup = Some(lookup);
            }
            PromptTokens::Approximate(prompt) => {
                cycle.prompt_tokens = prompt.text.chars().count() as f64 / self.chars_per_token;
                let Some(params) = self.prefix.as_ref().filter(|p| p.mode == PrefixMode::Auto)
                else {
                    return;
                };
                let chunks = self.chunks(cycle.request, &prompt.text, params);
                if chunks.is_empty() {
                    return;
                }
                let ids: Vec<PodId> = cycle.pods.iter().map(|p| p.id).collect();
                let runs = self.approx.match_chunks(&chunks, &ids);
                let chunk_tokens = params.approx_chunk_chars as f64 / self.chars_per_token;
                cycle.prefix = runs
                    .iter()
                    .map(|run| PrefixHit {
                        score: *run as f64 / chunks.len() as f64,
                        cached_tokens: (*run as f64 * chunk_tokens).min(cycle.prompt_tokens),
                    })
                    .collect();
            }
        }
    }

    /// The candidate the prompt's prefix was last routed to, when no candidate holds at least
    /// half of the prompt (only then does the placement scorer ask where it used to be).
    fn home_hit(&self, cycle: &Cycle<'_>, lookup: &PrefixLookup) -> Option<HomeHit> {
        let first = lookup.matches.first()?;
        let total = first.total_blocks;
        if total == 0 || lookup.matches.iter().any(|m| m.matched_blocks * 2 >= total) {
            return None;
        }
        let home = self
            .deps
            .index
            .prefix_home(&cycle.request.prompt, first.block_size)?;
        let index = cycle.pods.iter().position(|p| p.id == home.pod)?;
        Some(HomeHit {
            index,
            share: home.blocks as f64 / total as f64,
        })
    }

    fn chunks(
        &self,
        request: &SchedulingRequest,
        text: &str,
        params: &PrefixCacheParams,
    ) -> Vec<u64> {
        let seed = request.key_context().map_or(0, |c| c.seed());
        chunk_hashes(
            seed,
            text,
            params.approx_chunk_chars,
            params.approx_max_chunks,
        )
    }

    /// Tells the stateful scorers what was picked, records approximate prefixes, and returns
    /// the prefix index's routing record for the caller to apply (see [`PendingRecord`]).
    fn record(&self, cycle: &mut Cycle<'_>, primary: PodId) -> PendingRecord {
        let mut pending = PendingRecord::default();
        for scorer in &self.scorers {
            scorer.scorer.after_pick(cycle, primary);
        }
        let Some(params) = self.prefix.as_ref() else {
            return pending;
        };
        match cycle.request.prompt.prompt() {
            PromptTokens::Exact(_) => {
                if cycle.request.key_context().is_none() {
                    return pending;
                }
                let index = &self.deps.index;
                let held = cycle
                    .lookup
                    .as_ref()
                    .map_or(0, |lookup| index.confirmed_run(primary, lookup));
                pending.push(
                    Arc::clone(index),
                    primary,
                    Arc::clone(&cycle.request.prompt),
                    held,
                );
            }
            PromptTokens::Approximate(prompt) if params.mode == PrefixMode::Auto => {
                let chunks = self.chunks(cycle.request, &prompt.text, params);
                self.approx.record(primary, &chunks);
            }
            _ => {}
        }
        pending
    }
}

impl ConfiguredScheduler {
    /// What the pick (`order[0]`) is expected to cost: its uncached tokens and, under a
    /// placement or cost scorer, its predicted time to first token (the placement scorer's
    /// when both are configured).
    fn expected(&self, cycle: &Cycle<'_>, order: &[usize]) -> Expected {
        let has_prompt = !matches!(cycle.request.prompt.prompt(), PromptTokens::Empty);
        let uncached = uncached_tokens(cycle, order);
        let pick = order.first().and_then(|i| cycle.pods.get(*i));
        let fleet = || placement::fleet_line(&cycle.pods);
        let ttft_ms = match (pick, &self.placement, &self.cost_model) {
            (Some(pod), Some(params), _) => Some(placement::predict_ttft_ms(
                pod,
                fleet(),
                params,
                cycle.prompt_tokens,
                uncached,
            )),
            (Some(pod), None, Some(model)) => Some(estimate_ttft_ms(
                model,
                pod,
                fleet(),
                cycle.prompt_tokens,
                cycle.prompt_tokens - uncached,
            )),
            _ => None,
        };
        Expected {
            uncached_tokens: has_prompt.then_some(uncached),
            cached_tokens: (cycle.prompt_tokens - uncached).max(0.0),
            ttft_ms,
        }
    }
}

/// Prompt tokens not cached on the pick (`order[0]`), per the cycle's prefix matches.
fn uncached_tokens(cycle: &Cycle<'_>, order: &[usize]) -> f64 {
    let cached = order
        .first()
        .map_or(0.0, |i| cycle.prefix_hit(*i).cached_tokens);
    (cycle.prompt_tokens - cached).max(0.0)
}

impl Scheduler for ConfiguredScheduler {
    fn pick(
        &self,
        request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Result<Pick, ScheduleError> {
        let (pick, record) = self.pick_deferred(request, candidates)?;
        record.apply();
        Ok(pick)
    }

    fn warm_keys(&self, keys: &PromptKeys) {
        if self.prefix.is_some() {
            keys.warm(self.deps.index.typical_block_size());
        }
    }

    fn needs_prompt(&self) -> bool {
        // Every prompt reader (prefix, no-hit, cost, placement scorers; P/D) sets `prefix`.
        self.prefix.is_some() || self.disaggregation.is_some()
    }

    fn pick_deferred(
        &self,
        request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Result<(Pick, PendingRecord), ScheduleError> {
        let (mut cycle, columns, totals, order) = self
            .run(request, candidates, None, self.emit_scores)
            .ok_or(ScheduleError::NoCandidates)?;
        let mut ids = order
            .iter()
            .filter_map(|i| cycle.pods.get(*i).map(|p| p.id));
        let primary = ids.next().ok_or(ScheduleError::NoCandidates)?;
        // Only sheddable requests are refused for an objective nobody meets; the others go to
        // the least late pod (the scorer's ranking).
        if request.priority < 0
            && let Some(params) = &self.placement
            && !placement::slo_attainable(&cycle, params)
        {
            return Err(ScheduleError::SloUnattainable);
        }
        let mut pick = Pick::new(primary, ids.collect());
        pick.expected = self.expected(&cycle, &order);
        let mut record = PendingRecord::default();
        if let Some(pd) = &self.disaggregation {
            // Before this pick is recorded, so the decode pod's speculative entries do not
            // attract the prefill.
            if pd.spec.needs_prefill(uncached_tokens(&cycle, &order)) {
                // No prefill pod (e.g. none with the role): the decode pod prefills itself.
                if let Ok((prefill, prefill_record)) = pd.prefill.pick_deferred(request, candidates)
                {
                    pick.prefill = Some(prefill.primary);
                    record.merge(prefill_record);
                }
            }
            if let Some(decisions) = &self.pd_decisions {
                let decision = if pick.prefill.is_some() {
                    "prefill-decode"
                } else {
                    "decode-only"
                };
                decisions.with_label_values(&[decision]).inc();
            }
        }
        record.merge(self.record(&mut cycle, primary));
        if self.emit_scores {
            let mut candidates = self.candidate_explains(&cycle, &columns, &totals);
            // The pick first (a tie or a random picker may have passed over a higher
            // total), then best total first.
            let primary = primary.to_string();
            candidates.sort_by(|a, b| {
                (b.address == primary)
                    .cmp(&(a.address == primary))
                    .then(b.total.total_cmp(&a.total))
            });
            pick.trace = Some(Box::new(ScoreTrace {
                profile: self.config.profile_name.clone(),
                candidates,
            }));
        }
        Ok((pick, record))
    }
}
