//! The `EndpointPickerConfig` document as written (serde types, closed field sets), the
//! constants it is checked against, and the errors validation reports. The bottom of the
//! picker config: the plugin parser, the profile rules and the loader all build on it.

use serde::{Deserialize, Serialize};
use serde_yaml::Value;

/// The `kind` of the document.
pub const KIND: &str = "EndpointPickerConfig";

/// The apiVersion kvpick writes (GIE's); others GIE/llm-d used are accepted.
pub const API_VERSION: &str = "inference.networking.x-k8s.io/v1alpha1";

pub(super) const KNOWN_API_VERSIONS: &[&str] = &[
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
    "kv-placement-scorer",
    "saturation-filter",
    "fresh-metrics-filter",
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
