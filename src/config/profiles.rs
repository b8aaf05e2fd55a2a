//! Scheduling profiles and the profile handler: `schedulingProfiles` → the typed
//! [`SchedulerConfig`] (one profile, or llm-d's prefill/decode pair).
//!
//! Why its own module: which profiles a config may declare depends on its profile handler.
//! `single-profile-handler` (or none) runs exactly one profile. `pd-profile-handler` (llm-d,
//! prefill/decode disaggregation) runs its `decodeProfile` to pick the destination and, when
//! the prompt's part not cached on that decode pod reaches its threshold, its
//! `prefillProfile` to pick the pod that runs the prefill; exactly those two profiles.
//!
//! Rules (every error names the field):
//! - at most one profile handler plugin (`plugins[i].type`);
//! - profile names are unique (`schedulingProfiles[k].name`);
//! - single handler: exactly one profile (the existing `schedulingProfiles` count error);
//! - P/D: `decodeProfile` / `prefillProfile` (defaults `decode` / `prefill`) name declared,
//!   different profiles (`plugins[i].parameters.decodeProfile`), and no other profile is
//!   declared (`schedulingProfiles[k].name`); a `deciderPluginName` names a declared
//!   `prefix-based-pd-decider`, whose `nonCachedTokens` is then the threshold;
//! - a `prefill-header-handler`'s `prefillProfile` names a declared profile.

use std::collections::{HashMap, HashSet};

use super::handler::{HandlerPlugin, PdParams};
use super::picker_doc::{PickerConfigError, SchedulingProfile};
use super::plugins::Plugin;
use crate::scheduling::{
    FilterSpec, PickerSpec, PrefillDecodeSpec, ProfileHandlerSpec, SaturationConfig,
    SchedulerConfig, WeightedScorer,
};

/// The plugins by instance name: (declaration index, static type, parsed plugin).
pub(super) type PluginTable<'c> = HashMap<&'c str, (usize, &'static str, Plugin)>;

/// Resolves the profiles under the declared handler into one [`SchedulerConfig`].
pub(super) fn resolve(
    profiles: &[SchedulingProfile],
    plugins: &PluginTable<'_>,
    saturation: SaturationConfig,
    flow_control: bool,
    warnings: &mut Vec<String>,
) -> Result<SchedulerConfig, PickerConfigError> {
    let mut handlers: Vec<(usize, &str, &HandlerPlugin)> = plugins
        .iter()
        .filter_map(|(name, (i, _, plugin))| match plugin {
            Plugin::Handler(handler) => Some((*i, *name, handler)),
            _ => None,
        })
        .collect();
    handlers.sort_by_key(|(i, _, _)| *i);
    if let [(_, first, _), (second, _, _), ..] = handlers.as_slice() {
        return Err(PickerConfigError::SecondHandler {
            field: format!("plugins[{second}].type"),
            first: (*first).to_owned(),
        });
    }
    let mut seen = HashSet::new();
    for (k, profile) in profiles.iter().enumerate() {
        if !seen.insert(profile.name.as_str()) {
            return Err(PickerConfigError::DuplicateProfileName {
                field: format!("schedulingProfiles[{k}].name"),
                name: profile.name.clone(),
            });
        }
    }
    let build = |k: usize, warnings: &mut Vec<String>| {
        build_profile(profiles, k, plugins, saturation, flow_control, warnings)
    };
    let config = match handlers.first() {
        None | Some((_, _, HandlerPlugin::Single)) => {
            if profiles.len() != 1 {
                return Err(PickerConfigError::ProfileCount(profiles.len()));
            }
            build(0, warnings)?
        }
        Some((index, name, HandlerPlugin::PrefillDecode(params))) => {
            let find = |wanted: &str, param: &str| {
                profiles
                    .iter()
                    .position(|p| p.name == wanted)
                    .ok_or_else(|| PickerConfigError::UnknownProfile {
                        field: format!("plugins[{index}].parameters.{param}"),
                        name: wanted.to_owned(),
                    })
            };
            let decode = find(&params.decode_profile, "decodeProfile")?;
            let prefill = find(&params.prefill_profile, "prefillProfile")?;
            if decode == prefill {
                return Err(PickerConfigError::BadParameter {
                    field: format!("plugins[{index}].parameters.prefillProfile"),
                    message: "decodeProfile and prefillProfile must name different profiles"
                        .to_owned(),
                });
            }
            if let Some(k) = (0..profiles.len()).find(|k| *k != decode && *k != prefill) {
                return Err(PickerConfigError::UnusedProfile {
                    field: format!("schedulingProfiles[{k}].name"),
                    name: profiles[k].name.clone(),
                    handler: (*name).to_owned(),
                });
            }
            let threshold_tokens = threshold(params, *index, plugins)?;
            let prefill = build(prefill, warnings)?;
            let mut config = build(decode, warnings)?;
            config.handler = ProfileHandlerSpec::PrefillDecode(PrefillDecodeSpec {
                name: (*name).to_owned(),
                threshold_tokens,
                prefill: Box::new(prefill),
            });
            config
        }
    };
    for (i, _, plugin) in plugins.values() {
        if let Plugin::PrefillHeader { prefill_profile } = plugin
            && !profiles.iter().any(|p| &p.name == prefill_profile)
        {
            return Err(PickerConfigError::UnknownProfile {
                field: format!("plugins[{i}].parameters.prefillProfile"),
                name: prefill_profile.clone(),
            });
        }
    }
    Ok(config)
}

fn threshold(
    params: &PdParams,
    index: usize,
    plugins: &PluginTable<'_>,
) -> Result<u64, PickerConfigError> {
    let Some(decider) = &params.decider_plugin_name else {
        return Ok(params.threshold.map_or(0, |t| t.unsigned_abs()));
    };
    let field = format!("plugins[{index}].parameters.deciderPluginName");
    match plugins.get(decider.as_str()) {
        Some((_, _, Plugin::PdDecider { non_cached_tokens })) => Ok(*non_cached_tokens),
        Some((_, plugin_type, _)) => Err(PickerConfigError::BadParameter {
            field,
            message: format!("`{decider}` is a {plugin_type}, not a prefix-based-pd-decider"),
        }),
        None => Err(PickerConfigError::DanglingPluginRef {
            field,
            name: decider.clone(),
        }),
    }
}

/// One profile's filters, scorers and picker.
fn build_profile(
    profiles: &[SchedulingProfile],
    k: usize,
    plugins: &PluginTable<'_>,
    saturation: SaturationConfig,
    flow_control: bool,
    warnings: &mut Vec<String>,
) -> Result<SchedulerConfig, PickerConfigError> {
    let Some(profile) = profiles.get(k) else {
        return Err(PickerConfigError::ProfileCount(profiles.len()));
    };
    let mut filters = Vec::new();
    let mut scorers = Vec::new();
    let mut picker: Option<(String, &'static str, PickerSpec)> = None;
    for (j, used) in profile.plugins.iter().enumerate() {
        let field = format!("schedulingProfiles[{k}].plugins[{j}]");
        let Some((_, plugin_type, plugin)) = plugins.get(used.plugin_ref.as_str()) else {
            return Err(PickerConfigError::DanglingPluginRef {
                field: format!("{field}.pluginRef"),
                name: used.plugin_ref.clone(),
            });
        };
        let plugin_type = *plugin_type;
        let name = used.plugin_ref.clone();
        if used.weight.is_some() && !matches!(plugin, Plugin::Scorer(_)) {
            warnings.push(format!(
                "{field}.weight: `{name}` is not a scorer; weight ignored"
            ));
        }
        match plugin {
            Plugin::Filter(kind) => filters.push(FilterSpec {
                name,
                plugin_type,
                filter: kind.clone(),
            }),
            Plugin::Scorer(scorer) => {
                let weight = used.weight.unwrap_or(1.0);
                if !weight.is_finite() || weight < 0.0 {
                    return Err(PickerConfigError::BadWeight {
                        field: format!("{field}.weight"),
                        weight,
                    });
                }
                scorers.push(WeightedScorer {
                    name,
                    plugin_type,
                    scorer: scorer.clone(),
                    weight,
                });
            }
            Plugin::Picker(spec) => {
                if let Some((first, _, _)) = &picker {
                    return Err(PickerConfigError::SecondPicker {
                        field: format!("{field}.pluginRef"),
                        first: first.clone(),
                    });
                }
                picker = Some((name, plugin_type, *spec));
            }
            Plugin::Handler(_) | Plugin::PrefillHeader { .. } | Plugin::PdDecider { .. } => {
                warnings.push(format!(
                    "{field}.pluginRef: `{name}` ({plugin_type}) is not a profile step; ignored"
                ))
            }
        }
    }
    let (picker_name, picker_type, picker) = picker.unwrap_or_else(|| {
        (
            "max-score-picker".to_owned(),
            "max-score-picker",
            PickerSpec::MaxScore {
                max_endpoints: None,
            },
        )
    });
    Ok(SchedulerConfig {
        profile_name: profile.name.clone(),
        filters,
        scorers,
        picker,
        picker_name,
        picker_type,
        saturation,
        flow_control,
        handler: ProfileHandlerSpec::Single,
    })
}
