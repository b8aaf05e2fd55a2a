//! Profile handler plugins (`single-profile-handler`, llm-d's `pd-profile-handler`) and the
//! P/D handler's parameters: parsed with the other plugins, applied by the profile rules.

use serde::Deserialize;

use super::picker_doc::PickerConfigError;

/// A declared profile handler.
#[derive(Debug, Clone)]
pub(super) enum HandlerPlugin {
    /// `single-profile-handler`.
    Single,
    /// `pd-profile-handler`.
    PrefillDecode(PdParams),
}

/// `pd-profile-handler` parameters (llm-d's names).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct PdParams {
    /// Uncached prompt tokens at or above which prefill runs separately (0: always).
    #[serde(default)]
    pub(super) threshold: Option<i64>,
    #[serde(default = "default_decode")]
    pub(super) decode_profile: String,
    #[serde(default = "default_prefill")]
    pub(super) prefill_profile: String,
    /// llm-d's char-block size for turning prefix hits into characters; kvpick reads
    /// cached tokens from the index, so it is validated and otherwise unused.
    #[serde(default)]
    hash_block_size: Option<i64>,
    #[serde(default)]
    prefix_plugin_name: Option<String>,
    #[serde(default)]
    prefix_plugin_type: Option<String>,
    /// Data-parallel rank port (not supported: an error when set to a port).
    #[serde(default)]
    primary_port: Option<i64>,
    /// A `prefix-based-pd-decider` plugin giving the threshold (newer llm-d configs).
    #[serde(default)]
    pub(super) decider_plugin_name: Option<String>,
}

fn default_decode() -> String {
    "decode".to_owned()
}

fn default_prefill() -> String {
    "prefill".to_owned()
}

impl Default for PdParams {
    fn default() -> Self {
        Self {
            threshold: None,
            decode_profile: default_decode(),
            prefill_profile: default_prefill(),
            hash_block_size: None,
            prefix_plugin_name: None,
            prefix_plugin_type: None,
            primary_port: None,
            decider_plugin_name: None,
        }
    }
}

impl PdParams {
    /// Checks the values that need no other plugin; `index` is the plugin's position.
    pub(super) fn check(
        &self,
        index: usize,
        warnings: &mut Vec<String>,
    ) -> Result<(), PickerConfigError> {
        let field = format!("plugins[{index}].parameters");
        let bad = |message: String| PickerConfigError::BadParameter {
            field: field.clone(),
            message,
        };
        if self.threshold.is_some_and(|t| t < 0) {
            return Err(bad("threshold must be ≥ 0".to_owned()));
        }
        if let Some(size) = self.hash_block_size {
            if size <= 0 {
                return Err(bad(format!("hashBlockSize must be > 0 (got {size})")));
            }
            warnings.push(format!("{field}.hashBlockSize: not used (kvpick counts cached tokens from the prefix index)"));
        }
        if self.prefix_plugin_name.is_some() || self.prefix_plugin_type.is_some() {
            warnings.push(format!("{field}.prefixPluginName/prefixPluginType: not used (kvpick matches the prefix itself)"));
        }
        if self.primary_port.is_some_and(|p| p != 0) {
            return Err(bad(
                "primaryPort (data-parallel ranks) is not supported by kvpick".to_owned(),
            ));
        }
        if self.threshold.is_some() && self.decider_plugin_name.is_some() {
            return Err(bad(
                "threshold and deciderPluginName are exclusive: give one".to_owned(),
            ));
        }
        Ok(())
    }
}
