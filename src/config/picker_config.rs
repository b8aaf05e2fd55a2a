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

use super::duration::parse_duration;
use super::picker_doc::KNOWN_API_VERSIONS;
pub use super::picker_doc::{
    API_VERSION, EndpointPickerConfig, FLOW_CONTROL_GATE, KIND, PLUGIN_TYPES, PickerConfigError,
    PluginSpec, ProfilePlugin, SaturationDetectorSpec, SchedulingProfile,
};
pub use super::plugins::ROLE_LABEL;
use super::plugins::{parse_plugin, static_type};
use super::profiles::{self, PluginTable};
use crate::scheduling::{SaturationConfig, SchedulerConfig};

/// A validated config and what was accepted but not used.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedPickerConfig {
    /// The scheduler to build.
    pub scheduler: SchedulerConfig,
    /// Accepted-but-ignored settings (log them at start-up).
    pub warnings: Vec<String>,
    /// The config set `saturationDetector.metricsStalenessThreshold` itself (it then wins
    /// over llm-d's `--metrics-staleness-threshold` flag).
    pub metrics_staleness_configured: bool,
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
            metrics_staleness_configured: false,
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
            metrics_staleness_configured: self
                .saturation_detector
                .as_ref()
                .is_some_and(|s| s.metrics_staleness_threshold.is_some()),
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
        assert!(
            !parsed.scheduler.flow_control,
            "the engines queue; nothing fails in kvpick"
        );
        assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    }
}
