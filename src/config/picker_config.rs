//! GIE's `EndpointPickerConfig` YAML → one validated [`SchedulerConfig`].
//!
//! The file format is GIE's (DESIGN §5), so a team moving from the Go EPP keeps its config:
//!
//! ```yaml
//! apiVersion: inference.networking.x-k8s.io/v1alpha1
//! kind: EndpointPickerConfig
//! plugins:
//! - type: queue-scorer
//! - name: prefix                      # optional, defaults to the type
//!   type: prefix-cache-scorer
//!   parameters: {blockSize: 64}
//! - type: max-score-picker
//! schedulingProfiles:
//! - name: default
//!   plugins:
//!   - pluginRef: queue-scorer
//!     weight: 2
//!   - pluginRef: prefix
//!     weight: 3
//!   - pluginRef: max-score-picker
//! saturationDetector: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8, metricsStalenessThreshold: 200ms}
//! featureGates: [flowControl]
//! ```
//!
//! Validation rules (every error names the field, e.g. `plugins[2].type`):
//! - the document's own fields are a closed set (unknown keys are errors); GIE sections kvpick
//!   does not implement (`data`, `dataLayer`, `flowControl`, `parser`, `requestHandler`) are
//!   accepted and reported as warnings;
//! - a plugin `type` must be one kvpick knows ([`PLUGIN_TYPES`]); plugin names are unique;
//! - `parameters` are typed per plugin type and closed too: a misspelt parameter is an error
//!   rather than a silently ignored setting (GIE parameters kvpick accepts but does not use
//!   are warnings);
//! - every `pluginRef` names a declared plugin; scorer weights are finite and ≥ 0 (default 1);
//!   a profile has at most one picker (default `max-score-picker`);
//! - exactly one scheduling profile under `single-profile-handler` (or no handler); a decode
//!   and a prefill profile under llm-d's `pd-profile-handler` (rules in `super::profiles`);
//! - unknown feature gates are warnings.
//!
//! Plugin types: GIE's names where GIE has one (`queue-scorer`, `kv-cache-utilization-scorer`,
//! `prefix-cache-scorer`, `lora-affinity-scorer`, `max-score-picker`, `random-picker`,
//! `weighted-random-picker`, `single-profile-handler`), llm-d's where llm-d has one
//! (`precise-prefix-cache-scorer`, `session-affinity-scorer`, `no-hit-lru-scorer`,
//! `active-request-scorer`, `by-label`, `by-label-selector`, `pd-profile-handler`,
//! `prefill-header-handler`, `prefix-based-pd-decider`, `decode-filter`, `prefill-filter`),
//! and kvpick's own
//! (`ttft-cost-scorer`, `in-flight-requests-scorer`, `saturation-filter`,
//! `lora-capacity-filter`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_yaml::Value;

use super::duration::parse_duration;
pub use super::plugins::ROLE_LABEL;
use super::plugins::{parse_plugin, static_type};
use super::profiles::{self, PluginTable};
use crate::scheduling::{SaturationConfig, SchedulerConfig};

/// The `kind` of the document.
pub const KIND: &str = "EndpointPickerConfig";

/// The apiVersion kvpick writes (GIE's); others GIE/llm-d used are accepted.
pub const API_VERSION: &str = "inference.networking.x-k8s.io/v1alpha1";

const KNOWN_API_VERSIONS: &[&str] = &[
    API_VERSION,
    "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1",
    "llm-d.ai/v1alpha1",
    "llm-d.ai/v1",
];

/// The flow-control feature gate.
pub const FLOW_CONTROL_GATE: &str = "flowControl";

/// Every plugin type kvpick accepts.
pub const PLUGIN_TYPES: &[&str] = &[
    "queue-scorer",
    "kv-cache-utilization-scorer",
    "prefix-cache-scorer",
    "precise-prefix-cache-scorer",
    "lora-affinity-scorer",
    "in-flight-requests-scorer",
    "active-request-scorer",
    "session-affinity-scorer",
    "no-hit-lru-scorer",
    "ttft-cost-scorer",
    "saturation-filter",
    "lora-capacity-filter",
    "by-label-selector",
    "by-label",
    "max-score-picker",
    "random-picker",
    "weighted-random-picker",
    "single-profile-handler",
    "pd-profile-handler",
    "prefill-header-handler",
    "prefix-based-pd-decider",
    "decode-filter",
    "prefill-filter",
];

/// The YAML document, as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointPickerConfig {
    /// `inference.networking.x-k8s.io/v1alpha1` (or another GIE/llm-d version).
    pub api_version: String,
    /// `EndpointPickerConfig`.
    pub kind: String,
    /// Plugin instances.
    #[serde(default)]
    pub plugins: Vec<PluginSpec>,
    /// Scheduling profiles.
    #[serde(default)]
    pub scheduling_profiles: Vec<SchedulingProfile>,
    /// Saturation thresholds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saturation_detector: Option<SaturationDetectorSpec>,
    /// Enabled feature gates (`flowControl`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub feature_gates: Vec<String>,
    /// GIE `data` section (not used by kvpick).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// GIE/llm-d `dataLayer` section (not used by kvpick).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_layer: Option<Value>,
    /// GIE `flowControl` section (kvpick's flow control is configured by its own flags).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<Value>,
    /// GIE `parser` section (not used by kvpick).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parser: Option<Value>,
    /// llm-d `requestHandler` section (not used by kvpick).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_handler: Option<Value>,
}

/// One plugin instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    /// Instance name (defaults to the type).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Plugin type.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// Type-specific parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

impl PluginSpec {
    /// The instance name.
    pub fn instance_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.plugin_type)
    }
}

/// One scheduling profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulingProfile {
    /// Profile name.
    pub name: String,
    /// Plugins it runs, in order.
    #[serde(default)]
    pub plugins: Vec<ProfilePlugin>,
}

/// A plugin used by a profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProfilePlugin {
    /// A plugin instance name.
    pub plugin_ref: String,
    /// Scorer weight (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// `saturationDetector`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SaturationDetectorSpec {
    /// Waiting requests at which an endpoint is saturated (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth_threshold: Option<f64>,
    /// KV usage at which an endpoint is saturated (default 0.8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_util_threshold: Option<f64>,
    /// Metrics older than this are stale (default `200ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_staleness_threshold: Option<String>,
}

/// Why a picker config was rejected. Every variant names the offending field.
#[derive(Debug, thiserror::Error)]
pub enum PickerConfigError {
    /// Not YAML, or a field of the wrong shape or unknown (serde names it and its line).
    #[error("invalid EndpointPickerConfig: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// `kind` is not `EndpointPickerConfig`.
    #[error("kind: expected `{KIND}`, got `{0}`")]
    Kind(String),
    /// A plugin type kvpick does not know.
    #[error("{field}: unknown plugin type `{plugin_type}` (known: {known})", known = PLUGIN_TYPES.join(", "))]
    UnknownPluginType {
        /// e.g. `plugins[2].type`.
        field: String,
        /// The type given.
        plugin_type: String,
    },
    /// Two plugins share a name.
    #[error("{field}: duplicate plugin name `{name}`")]
    DuplicatePluginName {
        /// e.g. `plugins[3].name`.
        field: String,
        /// The name.
        name: String,
    },
    /// Parameters that do not fit the plugin type.
    #[error("{field}: {message}")]
    BadParameter {
        /// e.g. `plugins[1].parameters`.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A pluginRef to no declared plugin.
    #[error("{field}: no plugin named `{name}` is declared under plugins")]
    DanglingPluginRef {
        /// e.g. `schedulingProfiles[0].plugins[1].pluginRef`.
        field: String,
        /// The name referenced.
        name: String,
    },
    /// A bad scorer weight.
    #[error("{field}: weight must be a finite number ≥ 0 (got {weight})")]
    BadWeight {
        /// e.g. `schedulingProfiles[0].plugins[0].weight`.
        field: String,
        /// The weight.
        weight: f64,
    },
    /// More than one picker in a profile.
    #[error("{field}: a profile has one picker; `{first}` is already its picker")]
    SecondPicker {
        /// The second picker's field.
        field: String,
        /// The first picker's name.
        first: String,
    },
    /// Zero or several scheduling profiles under the single-profile handler.
    #[error(
        "schedulingProfiles: kvpick runs exactly one profile (single-profile-handler); got {0}"
    )]
    ProfileCount(usize),
    /// A second profile handler.
    #[error("{field}: a config has one profile handler; `{first}` is already declared")]
    SecondHandler {
        /// The second handler's field.
        field: String,
        /// The first handler's name.
        first: String,
    },
    /// Two profiles share a name.
    #[error("{field}: duplicate profile name `{name}`")]
    DuplicateProfileName {
        /// e.g. `schedulingProfiles[1].name`.
        field: String,
        /// The name.
        name: String,
    },
    /// A handler parameter names no declared profile.
    #[error("{field}: no scheduling profile named `{name}` is declared")]
    UnknownProfile {
        /// e.g. `plugins[0].parameters.prefillProfile`.
        field: String,
        /// The profile name referenced.
        name: String,
    },
    /// A profile the handler never runs.
    #[error("{field}: profile `{name}` is never run by profile handler `{handler}`")]
    UnusedProfile {
        /// e.g. `schedulingProfiles[2].name`.
        field: String,
        /// The profile.
        name: String,
        /// The handler.
        handler: String,
    },
    /// A bad saturation detector value.
    #[error("saturationDetector.{field}: {message}")]
    BadSaturation {
        /// The field.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// A validated config and what was accepted but not used.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedPickerConfig {
    /// The scheduler to build.
    pub scheduler: SchedulerConfig,
    /// Accepted-but-ignored settings (log them at start-up).
    pub warnings: Vec<String>,
}

/// GIE's default configuration, as YAML (what runs when no config is given).
pub const GIE_DEFAULT_YAML: &str = "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
";

/// kvpick's recommended configuration (also `deploy/config/kvpick-recommended.yaml`).
pub const KVPICK_RECOMMENDED_YAML: &str =
    include_str!("../../deploy/config/kvpick-recommended.yaml");

/// Parses and validates a config text; `None` gives GIE's default profile.
pub fn load(text: Option<&str>) -> Result<ValidatedPickerConfig, PickerConfigError> {
    match text {
        None => Ok(ValidatedPickerConfig {
            scheduler: SchedulerConfig::gie_default(),
            warnings: Vec::new(),
        }),
        Some(text) => EndpointPickerConfig::from_yaml(text)?.validate(),
    }
}

impl EndpointPickerConfig {
    /// Parses the YAML (shape only; see [`Self::validate`]).
    pub fn from_yaml(text: &str) -> Result<Self, PickerConfigError> {
        Ok(serde_yaml::from_str(text)?)
    }

    /// Serializes back to YAML.
    pub fn to_yaml(&self) -> Result<String, PickerConfigError> {
        Ok(serde_yaml::to_string(self)?)
    }

    /// Resolves plugin types and references into one [`SchedulerConfig`].
    pub fn validate(&self) -> Result<ValidatedPickerConfig, PickerConfigError> {
        let mut warnings = Vec::new();
        if self.kind != KIND {
            return Err(PickerConfigError::Kind(self.kind.clone()));
        }
        if !KNOWN_API_VERSIONS.contains(&self.api_version.as_str()) {
            warnings.push(format!(
                "apiVersion: `{}` is not one kvpick knows; reading it as {API_VERSION}",
                self.api_version
            ));
        }
        for (section, value) in [
            ("data", &self.data),
            ("dataLayer", &self.data_layer),
            ("flowControl", &self.flow_control),
            ("parser", &self.parser),
            ("requestHandler", &self.request_handler),
        ] {
            if value.is_some() {
                warnings.push(format!("{section}: not used by kvpick; ignored"));
            }
        }
        let mut plugins: PluginTable<'_> = HashMap::new();
        for (i, spec) in self.plugins.iter().enumerate() {
            let name = spec.instance_name();
            let plugin = parse_plugin(spec, i, &mut warnings)?;
            if plugins
                .insert(name, (i, static_type(&spec.plugin_type), plugin))
                .is_some()
            {
                return Err(PickerConfigError::DuplicatePluginName {
                    field: format!("plugins[{i}].name"),
                    name: name.to_owned(),
                });
            }
        }
        let mut feature_flow_control = false;
        for (i, gate) in self.feature_gates.iter().enumerate() {
            if gate == FLOW_CONTROL_GATE {
                feature_flow_control = true;
            } else {
                warnings.push(format!("featureGates[{i}]: unknown gate `{gate}`; ignored"));
            }
        }
        let scheduler = profiles::resolve(
            &self.scheduling_profiles,
            &plugins,
            saturation(self.saturation_detector.as_ref())?,
            feature_flow_control,
            &mut warnings,
        )?;
        Ok(ValidatedPickerConfig {
            scheduler,
            warnings,
        })
    }
}

fn saturation(
    spec: Option<&SaturationDetectorSpec>,
) -> Result<SaturationConfig, PickerConfigError> {
    let mut config = SaturationConfig::default();
    let Some(spec) = spec else {
        return Ok(config);
    };
    let positive = |field: &'static str, value: f64| {
        if value.is_finite() && value > 0.0 {
            Ok(value)
        } else {
            Err(PickerConfigError::BadSaturation {
                field,
                message: format!("must be a number > 0 (got {value})"),
            })
        }
    };
    if let Some(q) = spec.queue_depth_threshold {
        config.queue_depth_threshold = positive("queueDepthThreshold", q)?;
    }
    if let Some(kv) = spec.kv_cache_util_threshold {
        config.kv_cache_util_threshold = positive("kvCacheUtilThreshold", kv)?;
    }
    if let Some(text) = &spec.metrics_staleness_threshold {
        config.metrics_staleness =
            parse_duration(text).map_err(|e| PickerConfigError::BadSaturation {
                field: "metricsStalenessThreshold",
                message: e.to_string(),
            })?;
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_config_is_gie_default_and_its_yaml_agrees() {
        assert_eq!(
            load(None).expect("default").scheduler,
            SchedulerConfig::gie_default()
        );
        let parsed = load(Some(GIE_DEFAULT_YAML)).expect("gie yaml");
        assert_eq!(parsed.scheduler, SchedulerConfig::gie_default());
        assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    }

    #[test]
    fn recommended_yaml_is_the_recommended_profile() {
        let parsed = load(Some(KVPICK_RECOMMENDED_YAML)).expect("recommended");
        assert_eq!(parsed.scheduler, SchedulerConfig::kvpick_recommended());
        assert!(parsed.scheduler.flow_control);
        assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    }
}
