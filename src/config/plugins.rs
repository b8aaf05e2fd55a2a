//! One plugin declaration (`plugins[i]`: `type` + `parameters`) → a typed plugin.
//!
//! Why its own module: each plugin type has its own closed parameter struct (a misspelt
//! parameter is an error naming `plugins[i].parameters`, never a silently ignored setting),
//! and the type strings are resolved here once, so nothing downstream dispatches on a name.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_yaml::Value;

use super::handler::{HandlerPlugin, PdParams};
use super::picker_doc::{PLUGIN_TYPES, PickerConfigError, PluginSpec};
use crate::scheduling::{
    CostModel, FilterKind, PickerSpec, PlacementParams, PrefixCacheParams, PrefixMode, ScorerSpec,
};

/// The `'static` spelling of a known plugin type (metric label values stay allocation-free).
pub(super) fn static_type(plugin_type: &str) -> &'static str {
    PLUGIN_TYPES
        .iter()
        .copied()
        .find(|known| *known == plugin_type)
        .unwrap_or("unknown")
}

/// One parsed plugin declaration.
pub(super) enum Plugin {
    /// A filter.
    Filter(FilterKind),
    /// A scorer.
    Scorer(ScorerSpec),
    /// A picker.
    Picker(PickerSpec),
    /// A profile handler (decides which profiles run; not a profile step).
    Handler(HandlerPlugin),
    /// llm-d's `prefill-header-handler`: kvpick sets `x-prefiller-host-port` itself, so it
    /// only names the prefill profile (validated).
    PrefillHeader {
        /// The profile whose pick is the prefill endpoint.
        prefill_profile: String,
    },
    /// llm-d's `prefix-based-pd-decider`: the P/D threshold in uncached tokens.
    PdDecider {
        /// `nonCachedTokens`.
        non_cached_tokens: u64,
    },
}

fn params<T: DeserializeOwned + Default>(
    spec: &PluginSpec,
    index: usize,
) -> Result<T, PickerConfigError> {
    match &spec.parameters {
        None | Some(Value::Null) => Ok(T::default()),
        // The path serde was at names the parameter (`plugins[2].parameters.blockSize`);
        // an unknown parameter is reported at the object holding it, and names itself.
        Some(value) => serde_path_to_error::deserialize(value.clone()).map_err(|e| {
            let path = e.path().to_string();
            let field = match path.as_str() {
                "" | "." => format!("plugins[{index}].parameters"),
                path => format!("plugins[{index}].parameters.{path}"),
            };
            PickerConfigError::BadParameter {
                field,
                message: format!(
                    "{} ({}): {}",
                    spec.instance_name(),
                    spec.plugin_type,
                    e.into_inner()
                ),
            }
        }),
    }
}

fn no_params(spec: &PluginSpec, index: usize) -> Result<(), PickerConfigError> {
    params::<NoParams>(spec, index).map(|_| ())
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NoParams {}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PrefixParams {
    block_size: Option<usize>,
    max_prefix_blocks_to_match: Option<usize>,
    lru_capacity_per_server: Option<usize>,
    mode: Option<String>,
    auto_tune: Option<Value>,
    block_size_tokens: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PrecisePrefixParams {}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PickerParams {
    max_num_of_endpoints: Option<usize>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SessionParams {
    max_sessions: Option<usize>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NoHitParams {
    lru_size: Option<usize>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CostParams {
    prefill_ms_per_token: Option<f64>,
    queued_request_ms: Option<f64>,
    decode_slowdown_per_running: Option<f64>,
    chars_per_token: Option<f64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PlacementConfigParams {
    hold_bias: Option<f64>,
    displacement_weight: Option<f64>,
    prior_prefill_ms_per_token: Option<f64>,
    default_block_size: Option<u32>,
    decode_weight: Option<f64>,
    cold_decode_weight: Option<f64>,
    home_bias: Option<f64>,
    holdup_weight: Option<f64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SaturationFilterParams {
    queue_depth_threshold: Option<f64>,
    kv_cache_util_threshold: Option<f64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SelectorParams {
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ByLabelParams {
    label: String,
    valid_values: Vec<String>,
    allows_no_label: bool,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PrefillHeaderParams {
    prefill_profile: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DeciderParams {
    non_cached_tokens: Option<i64>,
}

/// llm-d's role label (`decode-filter`, `prefill-filter`).
pub const ROLE_LABEL: &str = "llm-d.ai/role";
/// Roles `decode-filter` keeps (endpoints without the label pass too).
const DECODE_ROLES: &[&str] = &["decode", "prefill-decode", "both", "encode-prefill-decode"];
/// Roles `prefill-filter` keeps (endpoints without the label do not pass).
const PREFILL_ROLES: &[&str] = &[
    "prefill",
    "encode-prefill",
    "prefill-decode",
    "both",
    "encode-prefill-decode",
];

fn role_filter(roles: &[&str], allows_no_label: bool) -> FilterKind {
    FilterKind::ByLabel {
        label: ROLE_LABEL.to_owned(),
        valid_values: roles.iter().map(|r| (*r).to_owned()).collect(),
        allows_no_label,
    }
}

fn bad(index: usize, message: String) -> PickerConfigError {
    PickerConfigError::BadParameter {
        field: format!("plugins[{index}].parameters"),
        message,
    }
}

fn non_negative(
    index: usize,
    name: &str,
    value: Option<f64>,
    default: f64,
) -> Result<f64, PickerConfigError> {
    match value {
        None => Ok(default),
        Some(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Some(v) => Err(bad(
            index,
            format!("{name} must be a finite number ≥ 0 (got {v})"),
        )),
    }
}

fn at_least_one(
    index: usize,
    name: &str,
    value: Option<usize>,
    default: usize,
) -> Result<usize, PickerConfigError> {
    match value {
        None => Ok(default),
        Some(0) => Err(bad(index, format!("{name} must be at least 1"))),
        Some(v) => Ok(v),
    }
}

/// Parses `plugins[i]` into its typed plugin (warnings for accepted-but-unused settings).
pub(super) fn parse_plugin(
    spec: &PluginSpec,
    i: usize,
    warnings: &mut Vec<String>,
) -> Result<Plugin, PickerConfigError> {
    let picker_limit = |spec: &PluginSpec| -> Result<Option<usize>, PickerConfigError> {
        let p: PickerParams = params(spec, i)?;
        p.max_num_of_endpoints
            .map(|n| at_least_one(i, "maxNumOfEndpoints", Some(n), 1))
            .transpose()
    };
    Ok(match spec.plugin_type.as_str() {
        "queue-scorer" => {
            no_params(spec, i)?;
            Plugin::Scorer(ScorerSpec::Queue)
        }
        "kv-cache-utilization-scorer" => {
            no_params(spec, i)?;
            Plugin::Scorer(ScorerSpec::KvCacheUtilization)
        }
        "lora-affinity-scorer" => {
            no_params(spec, i)?;
            Plugin::Scorer(ScorerSpec::LoraAffinity)
        }
        "in-flight-requests-scorer" | "active-request-scorer" => {
            if spec.plugin_type == "active-request-scorer" && spec.parameters.is_some() {
                warnings.push(format!("plugins[{i}].parameters: active-request-scorer parameters are not used (kvpick counts requests exactly)"));
            } else {
                no_params(spec, i)?;
            }
            Plugin::Scorer(ScorerSpec::InFlight)
        }
        "prefix-cache-scorer" => {
            let p: PrefixParams = params(spec, i)?;
            let defaults = PrefixCacheParams::default();
            if p.auto_tune.is_some() || p.block_size_tokens.is_some() {
                warnings.push(format!("plugins[{i}].parameters: autoTune/blockSizeTokens are not used (kvpick learns block sizes from KV events)"));
            }
            let mode = match p.mode.as_deref() {
                None | Some("auto") => PrefixMode::Auto,
                Some("precise") => PrefixMode::Precise,
                Some(other) => {
                    return Err(bad(
                        i,
                        format!("mode must be `auto` or `precise` (got `{other}`)"),
                    ));
                }
            };
            Plugin::Scorer(ScorerSpec::PrefixCache(PrefixCacheParams {
                mode,
                approx_chunk_chars: at_least_one(
                    i,
                    "blockSize",
                    p.block_size,
                    defaults.approx_chunk_chars,
                )?,
                approx_max_chunks: at_least_one(
                    i,
                    "maxPrefixBlocksToMatch",
                    p.max_prefix_blocks_to_match,
                    defaults.approx_max_chunks,
                )?,
                approx_capacity_per_endpoint: at_least_one(
                    i,
                    "lruCapacityPerServer",
                    p.lru_capacity_per_server,
                    defaults.approx_capacity_per_endpoint,
                )?,
            }))
        }
        "precise-prefix-cache-scorer" => {
            let _: PrecisePrefixParams = params(spec, i)?;
            if spec.parameters.is_some() {
                warnings.push(format!("plugins[{i}].parameters: precise-prefix-cache-scorer parameters are not used (kvpick's index is configured by its own flags)"));
            }
            Plugin::Scorer(ScorerSpec::PrefixCache(PrefixCacheParams {
                mode: PrefixMode::Precise,
                ..PrefixCacheParams::default()
            }))
        }
        "session-affinity-scorer" => {
            let p: SessionParams = params(spec, i)?;
            Plugin::Scorer(ScorerSpec::SessionAffinity {
                max_sessions: at_least_one(i, "maxSessions", p.max_sessions, 100_000)?,
            })
        }
        "no-hit-lru-scorer" => {
            let p: NoHitParams = params(spec, i)?;
            Plugin::Scorer(ScorerSpec::NoHitLru {
                max_endpoints: at_least_one(i, "lruSize", p.lru_size, 4096)?,
            })
        }
        "ttft-cost-scorer" => {
            let p: CostParams = params(spec, i)?;
            let d = CostModel::default();
            Plugin::Scorer(ScorerSpec::Cost(CostModel {
                prefill_ms_per_token: non_negative(
                    i,
                    "prefillMsPerToken",
                    p.prefill_ms_per_token,
                    d.prefill_ms_per_token,
                )?,
                queued_request_ms: non_negative(
                    i,
                    "queuedRequestMs",
                    p.queued_request_ms,
                    d.queued_request_ms,
                )?,
                decode_slowdown_per_running: non_negative(
                    i,
                    "decodeSlowdownPerRunning",
                    p.decode_slowdown_per_running,
                    d.decode_slowdown_per_running,
                )?,
                chars_per_token: match p.chars_per_token {
                    None => d.chars_per_token,
                    Some(v) if v.is_finite() && v > 0.0 => v,
                    Some(v) => return Err(bad(i, format!("charsPerToken must be > 0 (got {v})"))),
                },
            }))
        }
        "kv-placement-scorer" => {
            let p: PlacementConfigParams = params(spec, i)?;
            let d = PlacementParams::default();
            let hold_bias = non_negative(i, "holdBias", p.hold_bias, d.hold_bias)?;
            if hold_bias < 1.0 {
                return Err(bad(i, format!("holdBias must be ≥ 1 (got {hold_bias})")));
            }
            let home_bias = non_negative(i, "homeBias", p.home_bias, d.home_bias)?;
            if home_bias < 1.0 {
                return Err(bad(i, format!("homeBias must be ≥ 1 (got {home_bias})")));
            }
            Plugin::Scorer(ScorerSpec::Placement(PlacementParams {
                hold_bias,
                displacement_weight: non_negative(
                    i,
                    "displacementWeight",
                    p.displacement_weight,
                    d.displacement_weight,
                )?,
                prior_ms_per_token: non_negative(
                    i,
                    "priorPrefillMsPerToken",
                    p.prior_prefill_ms_per_token,
                    d.prior_ms_per_token,
                )?,
                default_block_size: match p.default_block_size {
                    None => d.default_block_size,
                    Some(0) => return Err(bad(i, "defaultBlockSize must be at least 1".into())),
                    Some(v) => v,
                },
                decode_weight: non_negative(i, "decodeWeight", p.decode_weight, d.decode_weight)?,
                cold_decode_weight: non_negative(
                    i,
                    "coldDecodeWeight",
                    p.cold_decode_weight,
                    d.cold_decode_weight,
                )?,
                home_bias,
                holdup_weight: non_negative(i, "holdupWeight", p.holdup_weight, d.holdup_weight)?,
            }))
        }
        "saturation-filter" => {
            let p: SaturationFilterParams = params(spec, i)?;
            for (name, v) in [
                ("queueDepthThreshold", p.queue_depth_threshold),
                ("kvCacheUtilThreshold", p.kv_cache_util_threshold),
            ] {
                if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                    return Err(bad(i, format!("{name} must be a number > 0")));
                }
            }
            Plugin::Filter(FilterKind::Saturation {
                queue_threshold: p.queue_depth_threshold,
                kv_threshold: p.kv_cache_util_threshold,
            })
        }
        "fresh-metrics-filter" => {
            no_params(spec, i)?;
            Plugin::Filter(FilterKind::FreshMetrics)
        }
        "lora-capacity-filter" => {
            no_params(spec, i)?;
            Plugin::Filter(FilterKind::LoraCapacity)
        }
        "by-label-selector" => {
            let p: SelectorParams = params(spec, i)?;
            if p.match_labels.is_empty() {
                return Err(bad(
                    i,
                    "matchLabels must name at least one label".to_owned(),
                ));
            }
            Plugin::Filter(FilterKind::LabelSelector {
                match_labels: p.match_labels,
            })
        }
        "by-label" => {
            let p: ByLabelParams = params(spec, i)?;
            if p.label.is_empty() {
                return Err(bad(i, "label is required".to_owned()));
            }
            Plugin::Filter(FilterKind::ByLabel {
                label: p.label,
                valid_values: p.valid_values,
                allows_no_label: p.allows_no_label,
            })
        }
        "max-score-picker" => Plugin::Picker(PickerSpec::MaxScore {
            max_endpoints: picker_limit(spec)?,
        }),
        "random-picker" => Plugin::Picker(PickerSpec::Random {
            max_endpoints: picker_limit(spec)?,
        }),
        "weighted-random-picker" => Plugin::Picker(PickerSpec::WeightedRandom {
            max_endpoints: picker_limit(spec)?,
        }),
        "single-profile-handler" => {
            no_params(spec, i)?;
            Plugin::Handler(HandlerPlugin::Single)
        }
        "pd-profile-handler" => {
            let p: PdParams = params(spec, i)?;
            p.check(i, warnings)?;
            Plugin::Handler(HandlerPlugin::PrefillDecode(p))
        }
        "prefill-header-handler" => {
            let p: PrefillHeaderParams = params(spec, i)?;
            Plugin::PrefillHeader {
                prefill_profile: p.prefill_profile.unwrap_or_else(|| "prefill".to_owned()),
            }
        }
        "prefix-based-pd-decider" => {
            let p: DeciderParams = params(spec, i)?;
            let tokens = p.non_cached_tokens.unwrap_or(0);
            if tokens < 0 {
                return Err(bad(
                    i,
                    format!("nonCachedTokens must be ≥ 0 (got {tokens})"),
                ));
            }
            Plugin::PdDecider {
                non_cached_tokens: tokens.unsigned_abs(),
            }
        }
        "decode-filter" => {
            no_params(spec, i)?;
            Plugin::Filter(role_filter(DECODE_ROLES, true))
        }
        "prefill-filter" => {
            no_params(spec, i)?;
            Plugin::Filter(role_filter(PREFILL_ROLES, false))
        }
        other => {
            return Err(PickerConfigError::UnknownPluginType {
                field: format!("plugins[{i}].type"),
                plugin_type: other.to_owned(),
            });
        }
    })
}
