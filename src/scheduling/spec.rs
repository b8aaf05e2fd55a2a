//! The validated, typed description of a scheduler: which filters, weighted scorers and
//! picker one profile runs, plus the saturation thresholds and feature gates.
//!
//! Why a separate typed layer: the YAML (`crate::config::picker_config`) names plugins by
//! string; those strings are resolved into these enums once at start-up, so a pick never
//! dispatches on a name and an unknown type can only be a start-up error.

use std::collections::BTreeMap;
use std::time::Duration;

pub use super::placement::PlacementParams;

/// One validated scheduler configuration (one profile).
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// The profile's name (for logs and explain).
    pub profile_name: String,
    /// Filters, in order.
    pub filters: Vec<FilterSpec>,
    /// Scorers with their weights; final score = Σ weight × score.
    pub scorers: Vec<WeightedScorer>,
    /// How the ranked endpoints become a pick.
    pub picker: PickerSpec,
    /// The picker's plugin instance name (metrics).
    pub picker_name: String,
    /// The picker's config `type` (metrics).
    pub picker_type: &'static str,
    /// Saturation thresholds (shedding, flow control, the saturation filter's defaults).
    pub saturation: SaturationConfig,
    /// Whether the `flowControl` feature gate is on.
    pub flow_control: bool,
    /// How profiles combine: one profile, or prefill/decode disaggregation (then the fields
    /// above describe the decode profile, which picks the destination).
    pub handler: ProfileHandlerSpec,
}

/// The profile handler: which profiles run for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum ProfileHandlerSpec {
    /// `single-profile-handler`: the one profile picks the destination.
    Single,
    /// `pd-profile-handler` (llm-d): prefill/decode disaggregation.
    PrefillDecode(PrefillDecodeSpec),
}

/// llm-d's `pd-profile-handler`: the decode profile picks the destination; when the prompt's
/// part not cached on that decode pod reaches the threshold, the prefill profile picks a
/// prefill pod too, named to the decode pod's sidecar in `x-prefiller-host-port`.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillDecodeSpec {
    /// The handler's plugin instance name.
    pub name: String,
    /// Uncached prompt tokens (prompt − tokens the decode pod holds) at or above which the
    /// prefill profile runs; 0: always.
    pub threshold_tokens: u64,
    /// The prefill profile (its own handler is [`ProfileHandlerSpec::Single`]).
    pub prefill: Box<SchedulerConfig>,
}

impl PrefillDecodeSpec {
    /// Whether a request with `uncached_tokens` not cached on the decode pod gets a
    /// separate prefill (llm-d: only when the uncached part is *below* the threshold does
    /// decode run alone).
    pub fn needs_prefill(&self, uncached_tokens: f64) -> bool {
        self.threshold_tokens == 0 || uncached_tokens >= self.threshold_tokens as f64
    }
}

/// A scorer and its weight in the profile.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedScorer {
    /// The plugin instance name (for explain).
    pub name: String,
    /// The config `type` it was declared with (metrics' `plugin_type`).
    pub plugin_type: &'static str,
    /// What it scores.
    pub scorer: ScorerSpec,
    /// Its weight (≥ 0).
    pub weight: f64,
}

/// A filter and its instance name.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterSpec {
    /// The plugin instance name (for explain).
    pub name: String,
    /// The config `type` it was declared with (metrics' `plugin_type`).
    pub plugin_type: &'static str,
    /// What it filters.
    pub filter: FilterKind,
}

/// The filters kvpick knows.
#[derive(Debug, Clone, PartialEq)]
pub enum FilterKind {
    /// Removes endpoints whose metrics are stale or failing, or whose queue / KV usage is at
    /// or over a threshold; keeps every endpoint when it would remove them all.
    Saturation {
        /// Waiting requests at which an endpoint is saturated (`None`: the detector's).
        queue_threshold: Option<f64>,
        /// KV usage at which an endpoint is saturated (`None`: the detector's).
        kv_threshold: Option<f64>,
    },
    /// Removes endpoints whose metrics are stale, failing or absent (a hung or dying pod);
    /// keeps every endpoint when it would remove them all. Unlike `Saturation` it says
    /// nothing about load: a busy holder of a prefix stays a candidate.
    FreshMetrics,
    /// For LoRA requests, keeps endpoints that run the adapter, queue it, or have room to
    /// load it; keeps every endpoint when none qualifies.
    LoraCapacity,
    /// Keeps endpoints whose labels contain every `key: value` (may empty the candidates).
    LabelSelector {
        /// Labels that must match exactly.
        match_labels: BTreeMap<String, String>,
    },
    /// Keeps endpoints whose `label` is one of `valid_values` (llm-d's `by-label`).
    ByLabel {
        /// The label key (e.g. a role label).
        label: String,
        /// Accepted values.
        valid_values: Vec<String>,
        /// Whether endpoints without the label pass.
        allows_no_label: bool,
    },
}

/// The scorers kvpick knows; each scores every candidate in [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub enum ScorerSpec {
    /// `queue-scorer`: min-max normalized waiting requests (fewer is better).
    Queue,
    /// `kv-cache-utilization-scorer`: 1 − KV usage.
    KvCacheUtilization,
    /// `prefix-cache-scorer`: matched prefix blocks / total blocks.
    PrefixCache(PrefixCacheParams),
    /// `in-flight-requests-scorer`: kvpick's own in-flight count, (max − n) / max.
    InFlight,
    /// `lora-affinity-scorer`: 1.0 adapter active, 0.8 room to load, 0.6 waiting, else 0.
    LoraAffinity,
    /// `session-affinity-scorer`: 1.0 for the endpoint that served the session last.
    SessionAffinity {
        /// Sessions remembered (LRU beyond).
        max_sessions: usize,
    },
    /// `no-hit-lru-scorer`: cold prefixes go to the endpoints least recently given one.
    NoHitLru {
        /// Endpoints remembered (LRU beyond).
        max_endpoints: usize,
    },
    /// `ttft-cost-scorer`: estimated time to first token, lower is better.
    Cost(CostModel),
    /// `kv-placement-scorer`: predicted time to first token from each pod's measured speed
    /// and prefill backlog, plus the eviction cost of a copy, with hysteresis for holders
    /// (see `super::placement`).
    Placement(PlacementParams),
}

impl ScorerSpec {
    /// Whether the scorer reads the request's prefix matches.
    pub fn needs_prefix(&self) -> bool {
        matches!(
            self,
            Self::PrefixCache(_) | Self::NoHitLru { .. } | Self::Cost(_) | Self::Placement(_)
        )
    }

    /// Whether the scorer reads each pod's prefill load and cache occupancy.
    pub fn needs_load(&self) -> bool {
        matches!(self, Self::Placement(_))
    }

    /// Whether the scorer reads where prefixes were last routed (the prefix index's homes).
    pub fn reads_prefix_homes(&self) -> bool {
        matches!(self, Self::Placement(p) if p.home_bias > 1.0)
    }
}

/// Where prefix matches come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixMode {
    /// Token ids against the prefix index when the prompt is exact (precise for pods with KV
    /// events, routing history for pods without); text chunks against kvpick's routing
    /// history when the prompt is approximate.
    Auto,
    /// Only the prefix index (approximate prompts score 0).
    Precise,
}

/// Parameters of the prefix-cache scorer.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixCacheParams {
    /// Where matches come from.
    pub mode: PrefixMode,
    /// Characters per chunk of an approximate prompt (GIE `blockSize`, default 64).
    pub approx_chunk_chars: usize,
    /// Leading chunks of an approximate prompt considered (GIE `maxPrefixBlocksToMatch`).
    pub approx_max_chunks: usize,
    /// Chunks remembered per endpoint (GIE `lruCapacityPerServer`).
    pub approx_capacity_per_endpoint: usize,
}

impl Default for PrefixCacheParams {
    fn default() -> Self {
        Self {
            mode: PrefixMode::Auto,
            approx_chunk_chars: 64,
            approx_max_chunks: 256,
            approx_capacity_per_endpoint: 31_250,
        }
    }
}

/// The TTFT cost model of the cost scorer (see [`super::scorers`] for the formula).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Prefill time per uncached prompt token, ms (default 0.1: ~10k tokens/s).
    pub prefill_ms_per_token: f64,
    /// Time one queued request ahead delays this one, ms (default 100: a ~1k-token prefill).
    pub queued_request_ms: f64,
    /// Relative prefill slowdown per running (decoding) request (default 0.02).
    pub decode_slowdown_per_running: f64,
    /// Characters per token when the prompt is approximate text (default 4).
    pub chars_per_token: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_ms_per_token: 0.1,
            queued_request_ms: 100.0,
            decode_slowdown_per_running: 0.02,
            chars_per_token: 4.0,
        }
    }
}

/// The pickers kvpick knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickerSpec {
    /// `max-score-picker`: highest total score, random tie-break.
    MaxScore {
        /// Endpoints returned (primary + fallbacks); `None`: as many as fallbacks allow.
        max_endpoints: Option<usize>,
    },
    /// `random-picker`: uniform, ignoring scores.
    Random {
        /// As for `MaxScore`.
        max_endpoints: Option<usize>,
    },
    /// `weighted-random-picker`: probability proportional to total score.
    WeightedRandom {
        /// As for `MaxScore`.
        max_endpoints: Option<usize>,
    },
}

/// Saturation thresholds (DESIGN §5: per endpoint max(queue/5, kv/0.8), pool = mean).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// Waiting requests at which an endpoint is saturated (GIE: 5).
    pub queue_depth_threshold: f64,
    /// KV usage at which an endpoint is saturated (GIE: 0.8).
    pub kv_cache_util_threshold: f64,
    /// Metrics older than this count the endpoint as saturated (GIE: 200 ms).
    pub metrics_staleness: Duration,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        Self {
            queue_depth_threshold: 5.0,
            kv_cache_util_threshold: 0.8,
            metrics_staleness: Duration::from_millis(200),
        }
    }
}

fn weighted(name: &'static str, scorer: ScorerSpec, weight: f64) -> WeightedScorer {
    WeightedScorer {
        name: name.to_owned(),
        plugin_type: name,
        scorer,
        weight,
    }
}

impl SchedulerConfig {
    /// Whether a scorer of this profile (or of its prefill profile) reads prefix homes: the
    /// index remembers them only then.
    pub fn reads_prefix_homes(&self) -> bool {
        self.scorers.iter().any(|s| s.scorer.reads_prefix_homes())
            || matches!(&self.handler, ProfileHandlerSpec::PrefillDecode(pd)
                if pd.prefill.reads_prefix_homes())
    }

    /// GIE's default profile: queue-scorer 2, kv-cache-utilization-scorer 2,
    /// prefix-cache-scorer 3, max-score-picker; no filters, flow control off.
    pub fn gie_default() -> Self {
        Self {
            profile_name: "default".to_owned(),
            filters: Vec::new(),
            scorers: vec![
                weighted("queue-scorer", ScorerSpec::Queue, 2.0),
                weighted(
                    "kv-cache-utilization-scorer",
                    ScorerSpec::KvCacheUtilization,
                    2.0,
                ),
                weighted(
                    "prefix-cache-scorer",
                    ScorerSpec::PrefixCache(PrefixCacheParams::default()),
                    3.0,
                ),
            ],
            picker: PickerSpec::MaxScore {
                max_endpoints: None,
            },
            picker_name: "max-score-picker".to_owned(),
            picker_type: "max-score-picker",
            saturation: SaturationConfig::default(),
            flow_control: false,
            handler: ProfileHandlerSpec::Single,
        }
    }

    /// kvpick's recommended profile: `kv-placement-scorer` alone (predicted time to first
    /// token from each pod's measured speed and prefill backlog, the eviction cost of a copy,
    /// hysteresis for holders) behind `fresh-metrics-filter` (hung or failing pods get no
    /// traffic), max-score-picker; no saturation filter (the placement cost already weighs
    /// load, and a filter that removes a prefix's busy holder forces a copy) and no
    /// flow control (the engines queue what the fleet cannot run yet; nothing fails while it
    /// makes progress). The same profile as YAML: `deploy/config/kvpick-recommended.yaml`.
    pub fn kvpick_recommended() -> Self {
        Self {
            profile_name: "default".to_owned(),
            filters: vec![FilterSpec {
                name: "fresh-metrics-filter".to_owned(),
                plugin_type: "fresh-metrics-filter",
                filter: FilterKind::FreshMetrics,
            }],
            scorers: vec![weighted(
                "kv-placement-scorer",
                ScorerSpec::Placement(PlacementParams::default()),
                1.0,
            )],
            picker: PickerSpec::MaxScore {
                max_endpoints: None,
            },
            picker_name: "max-score-picker".to_owned(),
            picker_type: "max-score-picker",
            saturation: SaturationConfig::default(),
            flow_control: false,
            handler: ProfileHandlerSpec::Single,
        }
    }
}
