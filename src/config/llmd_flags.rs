//! The llm-d EPP's flags (`pkg/epp/server/options.go`, ../shared/DESIGN.md §8) that kvpick
//! has no flag of its own for, so a Deployment written for llm-d keeps its arguments when its
//! image becomes kvpick.
//!
//! Each flag is one of:
//! - **applied**: it does here what it does there (`--refresh-metrics-interval` is an alias of
//!   `--scrape-interval` in [`super::ServeArgs`]; `-v`, `--zap-*` set the log level and
//!   format; the gRPC message sizes, `--metrics-staleness-threshold`, `--feature-gates`,
//!   `--fairness-id-metric-label-limit`,
//!   `--disable-endpoint-subset-filter`, `--tls-min-version`, `--model-server-metrics-path`
//!   and `-port`);
//! - **accepted, nothing to do**: what it switches is always on or has no counterpart in
//!   kvpick (`--health-checking`, `--enable-pprof`, `--allow-experimental-plugins`, …); its
//!   value is still validated as llm-d would;
//! - **refused with the reason** when accepting it would silently weaken what the user asked
//!   for: TLS on the metrics port, `--metrics-endpoint-auth=true` without kvpick's bearer
//!   token, `https` scrapes, TLS cipher-suite lists, and the metric-name flags llm-d itself
//!   refuses.
//!
//! Go's flag syntax is kept: booleans as `--flag`, `--flag=true|false` (not `--flag false`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::parse_duration;

/// llm-d EPP flags without a kvpick flag of their own (see the module docs).
#[derive(Args, Debug, Clone, Default)]
pub struct LlmdFlags {
    /// llm-d's log verbosity (`-v 4`, `--v=4`): 4 logs debug lines, 5 and above trace lines,
    /// less is info. `RUST_LOG`/`--log` win when given.
    #[arg(short = 'v', long = "v", value_name = "LEVEL")]
    pub verbosity: Option<u8>,
    /// controller-runtime's zap level: `debug`, `info`, `warn`, `error`, `panic`, or a
    /// verbosity number (as `-v`). Wins over `-v`.
    #[arg(long, value_name = "LEVEL")]
    pub zap_log_level: Option<String>,
    /// Log line format: `json` (one JSON object per line) or `console` (text).
    #[arg(long, value_name = "ENCODER")]
    pub zap_encoder: Option<String>,
    /// zap's development mode: with `=false` and no `--zap-encoder`, logs are JSON (as
    /// controller-runtime's production mode).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub zap_devel: Option<bool>,
    /// Accepted (`info`, `error`, `panic`); kvpick's errors carry their cause chain instead
    /// of a stack trace.
    #[arg(long, value_name = "LEVEL")]
    pub zap_stacktrace_level: Option<String>,
    /// Accepted (`epoch`, `millis`, `nano`, `iso8601`, `rfc3339`, `rfc3339nano`); kvpick's
    /// timestamps are RFC 3339 with microseconds.
    #[arg(long, value_name = "ENCODING")]
    pub zap_time_encoding: Option<String>,
    /// llm-d: emit OpenTelemetry traces. kvpick exports none (a warning says so when `true`
    /// is given); its per-request stage timings are metrics.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub tracing: Option<bool>,
    /// Accepted: kvpick always serves gRPC health on `--grpc-health-port`.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub health_checking: Option<bool>,
    /// Accepted: Go's pprof handlers have no Rust counterpart (profile kvpick with perf).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub enable_pprof: Option<bool>,
    /// Accepted: every plugin kvpick implements may be configured.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_experimental_plugins: Option<bool>,
    /// Accepted: kvpick's ext-proc stream metrics are always on.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub enable_grpc_stream_metrics: Option<bool>,
    /// Accepted (must be positive): kvpick's gauges are current at every `/metrics` read.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub refresh_prometheus_metrics_interval: Option<Duration>,
    /// Accepted (must be positive): kvpick's per-request state ends with its stream, nothing
    /// is left to reap.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub plugin_state_staleness_threshold: Option<Duration>,
    /// Metrics older than this are stale (the fresh-metrics filter, the saturation detector),
    /// unless the EndpointPickerConfig sets `saturationDetector.metricsStalenessThreshold`.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub metrics_staleness_threshold: Option<Duration>,
    /// llm-d: TokenReview on `/metrics`. kvpick's stand-in is `--metrics-bearer-token-file`;
    /// `=true` without it is refused rather than serving `/metrics` open.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub metrics_endpoint_auth: Option<bool>,
    /// Largest ext-proc gRPC message accepted, as a Kubernetes quantity (`10MiB`, `25MB`,
    /// `1.5Mi`, `1e6`, `4194304`; 0: the default, 8 MiB).
    #[arg(long, value_name = "SIZE")]
    pub grpc_max_recv_msg_size: Option<String>,
    /// Largest ext-proc gRPC message sent (as `--grpc-max-recv-msg-size`).
    #[arg(long, value_name = "SIZE")]
    pub grpc_max_send_msg_size: Option<String>,
    /// Distinct fairness ids (`x-gateway-inference-fairness-id`) that get metric series of
    /// their own; later ones are counted as `other` (0: all of them). Default 1000.
    #[arg(long, value_name = "N")]
    pub fairness_id_metric_label_limit: Option<usize>,
    /// Feature gates over the EndpointPickerConfig's `featureGates`, kubelet style:
    /// `flowControl`, `flowControl=true`, `flowControl=false`.
    #[arg(long, value_delimiter = ',', value_name = "GATES")]
    pub feature_gates: Vec<String>,
    /// Ignore the gateway's subset hint (`x-gateway-destination-endpoint-subset`) and pick
    /// from the whole pool.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub disable_endpoint_subset_filter: bool,
    /// Lowest TLS version on the ext-proc port: `VersionTLS12` (kvpick's floor) or
    /// `VersionTLS13`. `VersionTLS10`/`11` are accepted as 1.2 (rustls speaks nothing older).
    #[arg(long, value_name = "VERSION")]
    pub tls_min_version: Option<String>,
    /// Refused: rustls's TLS 1.2 suites are fixed (all AEAD, forward secret).
    #[arg(long, value_delimiter = ',', value_name = "SUITES")]
    pub tls_cipher_suites: Vec<String>,
    /// Refused: kvpick serves `/metrics` in plaintext (put a bearer token on it with
    /// `--metrics-bearer-token-file`).
    #[arg(long, value_name = "DIR")]
    pub metrics_cert_dir: Option<PathBuf>,
    /// Refused, as `--metrics-cert-dir`.
    #[arg(long, value_name = "FILE")]
    pub metrics_client_ca_file: Option<PathBuf>,
    /// Scheme of the model servers' metrics: `http` only (`https` is refused).
    #[arg(long, value_name = "SCHEME")]
    pub model_server_metrics_scheme: Option<String>,
    /// Path scraped on each endpoint (default `/metrics`).
    #[arg(long, value_name = "PATH")]
    pub model_server_metrics_path: Option<String>,
    /// Port scraped on each endpoint's IP instead of the endpoint's own port (0: its own).
    #[arg(long, value_name = "PORT")]
    pub model_server_metrics_port: Option<u16>,
    /// Accepted with `http` (nothing to verify).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub model_server_metrics_https_insecure_skip_verify: Option<bool>,
    /// Refused, as llm-d refuses it (engine metric names come from the engine type).
    #[arg(long, hide = true)]
    pub total_queued_requests_metric: Option<String>,
    /// Refused, as llm-d refuses it.
    #[arg(long, hide = true)]
    pub total_running_requests_metric: Option<String>,
    /// Refused, as llm-d refuses it.
    #[arg(long, hide = true)]
    pub kv_cache_usage_percentage_metric: Option<String>,
    /// Refused, as llm-d refuses it.
    #[arg(long, hide = true)]
    pub lora_info_metric: Option<String>,
    /// Refused, as llm-d refuses it.
    #[arg(long, hide = true)]
    pub cache_info_metric: Option<String>,
}

/// Why an llm-d flag was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LlmdFlagError {
    /// The value is not one the flag takes.
    #[error("--{flag} {value:?}: {reason}")]
    Invalid {
        /// The flag.
        flag: &'static str,
        /// What was given.
        value: String,
        /// What it takes.
        reason: &'static str,
    },
    /// The flag asks for something kvpick does not do; accepting it would weaken it silently.
    #[error("--{flag}: {reason}")]
    Unsupported {
        /// The flag.
        flag: &'static str,
        /// Why, and what to use instead.
        reason: &'static str,
    },
}

/// How kvpick logs, from `-v` and `--zap-*`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogSettings {
    /// The log filter the flags ask for (`None`: kvpick's default, info). Levels above info
    /// apply to kvpick's own lines only (`info,kvpick=debug`): as llm-d's `-v` raises its own
    /// logger's verbosity, not that of every library (h2 alone logs every HTTP/2 frame at
    /// debug).
    pub level: Option<&'static str>,
    /// One JSON object per line instead of text.
    pub json: bool,
}

/// What the flags change in kvpick's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LlmdOverrides {
    /// `--metrics-staleness-threshold`.
    pub metrics_staleness: Option<Duration>,
    /// `--grpc-max-recv-msg-size` in bytes (`None`: the default).
    pub grpc_max_recv: Option<usize>,
    /// `--grpc-max-send-msg-size` in bytes (`None`: the default).
    pub grpc_max_send: Option<usize>,
    /// `--feature-gates`, in order: gate name and whether it is on.
    pub feature_gates: Vec<(String, bool)>,
    /// The gateway's subset hint is honoured (`--disable-endpoint-subset-filter` not given).
    pub endpoint_subset_filter: bool,
    /// `--tls-min-version VersionTLS13`.
    pub tls13_only: bool,
    /// `--model-server-metrics-path`.
    pub metrics_path: Option<String>,
    /// `--model-server-metrics-port`.
    pub metrics_port: Option<u16>,
    /// `--tracing=true` was given: worth a warning, as kvpick exports no traces.
    pub tracing_asked: bool,
    /// `--fairness-id-metric-label-limit` (default 1000).
    pub fairness_id_label_limit: usize,
}

impl LlmdFlags {
    /// The log level and format the flags ask for.
    pub fn log_settings(&self) -> Result<LogSettings, LlmdFlagError> {
        let level = match (&self.zap_log_level, self.verbosity) {
            (Some(text), _) => Some(zap_level(text)?),
            (None, Some(v)) => verbosity_level(v),
            (None, None) => None,
        };
        let json = match self.zap_encoder.as_deref() {
            Some("json") => true,
            Some("console") => false,
            Some(other) => {
                return Err(LlmdFlagError::Invalid {
                    flag: "zap-encoder",
                    value: other.to_owned(),
                    reason: "takes json or console",
                });
            }
            None => self.zap_devel == Some(false),
        };
        if let Some(text) = &self.zap_stacktrace_level
            && !matches!(text.as_str(), "info" | "error" | "panic")
        {
            return Err(LlmdFlagError::Invalid {
                flag: "zap-stacktrace-level",
                value: text.clone(),
                reason: "takes info, error or panic",
            });
        }
        if let Some(text) = &self.zap_time_encoding
            && !matches!(
                text.as_str(),
                "epoch" | "millis" | "nano" | "iso8601" | "rfc3339" | "rfc3339nano"
            )
        {
            return Err(LlmdFlagError::Invalid {
                flag: "zap-time-encoding",
                value: text.clone(),
                reason: "takes epoch, millis, nano, iso8601, rfc3339 or rfc3339nano",
            });
        }
        Ok(LogSettings { level, json })
    }

    /// Validates every flag as llm-d would and returns what they change.
    pub fn overrides(&self, has_bearer_token: bool) -> Result<LlmdOverrides, LlmdFlagError> {
        self.log_settings()?;
        self.refuse_unsupported(has_bearer_token)?;
        for (flag, value) in [
            (
                "refresh-prometheus-metrics-interval",
                self.refresh_prometheus_metrics_interval,
            ),
            (
                "plugin-state-staleness-threshold",
                self.plugin_state_staleness_threshold,
            ),
            (
                "metrics-staleness-threshold",
                self.metrics_staleness_threshold,
            ),
        ] {
            if value.is_some_and(|d| d.is_zero()) {
                return Err(LlmdFlagError::Invalid {
                    flag,
                    value: "0".to_owned(),
                    reason: "must be positive",
                });
            }
        }
        let tls13_only = match self.tls_min_version.as_deref() {
            None | Some("VersionTLS10" | "VersionTLS11" | "VersionTLS12") => false,
            Some("VersionTLS13") => true,
            Some(other) => {
                return Err(LlmdFlagError::Invalid {
                    flag: "tls-min-version",
                    value: other.to_owned(),
                    reason: "takes VersionTLS10, VersionTLS11, VersionTLS12 or VersionTLS13",
                });
            }
        };
        if let Some(path) = &self.model_server_metrics_path
            && (!path.starts_with('/') || path.parse::<hyper::Uri>().is_err())
        {
            return Err(LlmdFlagError::Invalid {
                flag: "model-server-metrics-path",
                value: path.clone(),
                reason: "takes an absolute URL path such as /metrics",
            });
        }
        Ok(LlmdOverrides {
            metrics_staleness: self.metrics_staleness_threshold,
            grpc_max_recv: message_size("grpc-max-recv-msg-size", &self.grpc_max_recv_msg_size)?,
            grpc_max_send: message_size("grpc-max-send-msg-size", &self.grpc_max_send_msg_size)?,
            feature_gates: self
                .feature_gates
                .iter()
                .filter(|gate| !gate.trim().is_empty())
                .map(|gate| feature_gate(gate))
                .collect::<Result<_, _>>()?,
            endpoint_subset_filter: !self.disable_endpoint_subset_filter,
            tls13_only,
            metrics_path: self.model_server_metrics_path.clone(),
            // llm-d: 0 (its default) means the endpoint's own port.
            metrics_port: self.model_server_metrics_port.filter(|&port| port != 0),
            tracing_asked: self.tracing == Some(true),
            fairness_id_label_limit: self
                .fairness_id_metric_label_limit
                .unwrap_or(crate::telemetry::labels::MAX_LABEL_VALUES),
        })
    }

    /// The flags that ask for what kvpick does not do.
    fn refuse_unsupported(&self, has_bearer_token: bool) -> Result<(), LlmdFlagError> {
        let refuse = |flag, reason| Err(LlmdFlagError::Unsupported { flag, reason });
        if self.metrics_endpoint_auth == Some(true) && !has_bearer_token {
            return refuse(
                "metrics-endpoint-auth",
                "kvpick does not call TokenReview; protect /metrics with --metrics-bearer-token-file, or pass --metrics-endpoint-auth=false",
            );
        }
        for (flag, given) in [
            ("metrics-cert-dir", &self.metrics_cert_dir),
            ("metrics-client-ca-file", &self.metrics_client_ca_file),
        ] {
            if given.is_some() {
                return refuse(
                    flag,
                    "kvpick serves /metrics without TLS; protect it with --metrics-bearer-token-file and a NetworkPolicy",
                );
            }
        }
        if !self.tls_cipher_suites.is_empty() {
            return refuse(
                "tls-cipher-suites",
                "kvpick's TLS 1.2 suites are fixed (rustls: AEAD with forward secrecy only); pass --tls-min-version=VersionTLS13 to allow TLS 1.3 alone",
            );
        }
        match self.model_server_metrics_scheme.as_deref() {
            None | Some("http") => {}
            Some("https") => {
                return refuse(
                    "model-server-metrics-scheme",
                    "kvpick scrapes model servers over http only",
                );
            }
            Some(other) => {
                return Err(LlmdFlagError::Invalid {
                    flag: "model-server-metrics-scheme",
                    value: other.to_owned(),
                    reason: "takes http or https",
                });
            }
        }
        for (flag, given) in [
            (
                "total-queued-requests-metric",
                &self.total_queued_requests_metric,
            ),
            (
                "total-running-requests-metric",
                &self.total_running_requests_metric,
            ),
            (
                "kv-cache-usage-percentage-metric",
                &self.kv_cache_usage_percentage_metric,
            ),
            ("lora-info-metric", &self.lora_info_metric),
            ("cache-info-metric", &self.cache_info_metric),
        ] {
            if given.is_some() {
                return refuse(
                    flag,
                    "deprecated and refused by llm-d too; the metric names follow the endpoint's engine-type label (vllm, sglang, trtllm)",
                );
            }
        }
        Ok(())
    }
}

/// controller-runtime's `--zap-log-level` as a tracing level.
fn zap_level(text: &str) -> Result<&'static str, LlmdFlagError> {
    match text.to_ascii_lowercase().as_str() {
        "debug" => Ok("info,kvpick=debug"),
        "info" => Ok("info"),
        "warn" | "warning" => Ok("warn"),
        "error" | "dpanic" | "panic" | "fatal" => Ok("error"),
        number => match number.parse::<u8>() {
            Ok(v) if v > 0 => Ok(verbosity_level(v).unwrap_or("info")),
            _ => Err(LlmdFlagError::Invalid {
                flag: "zap-log-level",
                value: text.to_owned(),
                reason: "takes debug, info, warn, error, panic or a verbosity above 0",
            }),
        },
    }
}

/// llm-d's verbosity levels (2 default, 3 verbose, 4 debug, 5 trace) as a log filter.
fn verbosity_level(v: u8) -> Option<&'static str> {
    match v {
        0..=3 => None,
        4 => Some("info,kvpick=debug"),
        _ => Some("info,kvpick=trace"),
    }
}

/// Largest gRPC message kvpick will agree to (a message is buffered whole before decoding).
const MAX_GRPC_MESSAGE_BYTES: u64 = 1 << 30;

/// A Kubernetes quantity (`resource.ParseQuantity`, with llm-d's trailing `B` dropped) in
/// bytes; 0 is `None` (the default).
fn message_size(
    flag: &'static str,
    given: &Option<String>,
) -> Result<Option<usize>, LlmdFlagError> {
    let Some(text) = given else {
        return Ok(None);
    };
    let invalid = |reason| LlmdFlagError::Invalid {
        flag,
        value: text.clone(),
        reason,
    };
    let trimmed = text.trim();
    let trimmed = trimmed
        .strip_suffix(['B', 'b'])
        .filter(|rest| !rest.is_empty())
        .unwrap_or(trimmed);
    const FORM: &str = "takes a number of bytes (`4194304`, `1.5Mi`, `1e6`) with an optional Ki, Mi, Gi, k, M or G suffix";
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(split);
    // A decimal exponent (`1e6`, `5E3`) is a quantity's other suffix.
    let (unit, exponent): (u64, u32) = match suffix {
        "" => (1, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "k" | "K" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        exp => match exp
            .strip_prefix(['e', 'E'])
            .and_then(|digits| digits.parse::<u32>().ok())
        {
            Some(e) if e <= 9 => (1, e),
            _ => return Err(invalid(FORM)),
        },
    };
    // Exact arithmetic on the decimal digits: bytes = digits × unit × 10^exponent / 10^fraction.
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') || fraction.len() > 9 {
        return Err(invalid(FORM));
    }
    let digits: u128 = format!("{whole}{fraction}")
        .parse()
        .map_err(|_| invalid(FORM))?;
    let scaled = digits
        .checked_mul(u128::from(unit))
        .and_then(|v| v.checked_mul(10u128.pow(exponent)))
        .ok_or_else(|| invalid("must be at most 1Gi"))?;
    let divisor = 10u128.pow(u32::try_from(fraction.len()).unwrap_or(9));
    if scaled % divisor != 0 {
        return Err(invalid("must be a whole number of bytes"));
    }
    let bytes = u64::try_from(scaled / divisor)
        .ok()
        .filter(|&b| b <= MAX_GRPC_MESSAGE_BYTES)
        .ok_or_else(|| invalid("must be at most 1Gi"))?;
    if bytes == 0 {
        return Ok(None);
    }
    usize::try_from(bytes)
        .map(Some)
        .map_err(|_| invalid("must be at most 1Gi"))
}

/// One kubelet-style gate: `name`, `name=true` or `name=false`.
fn feature_gate(text: &str) -> Result<(String, bool), LlmdFlagError> {
    let text = text.trim();
    let (name, on) = match text.split_once('=') {
        None => (text, true),
        Some((name, value)) => match value.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "t" => (name, true),
            "false" | "0" | "f" => (name, false),
            _ => {
                return Err(LlmdFlagError::Invalid {
                    flag: "feature-gates",
                    value: text.to_owned(),
                    reason: "takes name, name=true or name=false, comma-separated",
                });
            }
        },
    };
    let name = name.trim();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(LlmdFlagError::Invalid {
            flag: "feature-gates",
            value: text.to_owned(),
            reason: "takes name, name=true or name=false, comma-separated",
        });
    }
    Ok((name.to_owned(), on))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbosity_and_zap_levels_map_onto_tracing_levels() {
        let v = |n| LlmdFlags {
            verbosity: Some(n),
            ..Default::default()
        };
        assert_eq!(v(2).log_settings().map(|s| s.level), Ok(None));
        assert_eq!(
            v(4).log_settings().map(|s| s.level),
            Ok(Some("info,kvpick=debug"))
        );
        assert_eq!(
            v(7).log_settings().map(|s| s.level),
            Ok(Some("info,kvpick=trace"))
        );
        let zap = |text: &str| LlmdFlags {
            zap_log_level: Some(text.to_owned()),
            verbosity: Some(5),
            ..Default::default()
        };
        // --zap-log-level wins over -v.
        assert_eq!(
            zap("error").log_settings().map(|s| s.level),
            Ok(Some("error"))
        );
        assert_eq!(
            zap("DEBUG").log_settings().map(|s| s.level),
            Ok(Some("info,kvpick=debug"))
        );
        assert_eq!(
            zap("4").log_settings().map(|s| s.level),
            Ok(Some("info,kvpick=debug"))
        );
        for bad in ["0", "loud", "-1"] {
            assert!(
                matches!(
                    zap(bad).log_settings(),
                    Err(LlmdFlagError::Invalid {
                        flag: "zap-log-level",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn json_logs_by_encoder_or_by_production_mode() {
        let flags = |encoder: Option<&str>, devel: Option<bool>| LlmdFlags {
            zap_encoder: encoder.map(str::to_owned),
            zap_devel: devel,
            ..Default::default()
        };
        let json = |f: LlmdFlags| f.log_settings().map(|s| s.json);
        assert_eq!(json(flags(None, None)), Ok(false));
        assert_eq!(json(flags(Some("json"), None)), Ok(true));
        assert_eq!(json(flags(Some("console"), Some(false))), Ok(false));
        assert_eq!(json(flags(None, Some(false))), Ok(true));
        assert!(json(flags(Some("xml"), None)).is_err());
    }

    #[test]
    fn message_sizes_read_kubernetes_quantities() {
        let size = |text: &str| message_size("grpc-max-recv-msg-size", &Some(text.to_owned()));
        assert_eq!(size("10MiB"), Ok(Some(10 << 20)));
        assert_eq!(size("10Mi"), Ok(Some(10 << 20)));
        assert_eq!(size("25MB"), Ok(Some(25_000_000)));
        assert_eq!(size("4194304"), Ok(Some(4_194_304)));
        assert_eq!(size("512k"), Ok(Some(512_000)));
        assert_eq!(size("0"), Ok(None));
        assert_eq!(size("1.5Mi"), Ok(Some(1_572_864)));
        assert_eq!(size("1e6"), Ok(Some(1_000_000)));
        assert_eq!(size("2.5k"), Ok(Some(2_500)));
        for bad in [
            "",
            "B",
            "10XB",
            "-1",
            "2Gi",
            "99999999999999999999",
            "1.0000000001Ki",
            "0.5",
            ".",
            "1e99",
        ] {
            assert!(size(bad).is_err(), "{bad}");
        }
        assert_eq!(message_size("grpc-max-send-msg-size", &None), Ok(None));
    }

    #[test]
    fn feature_gates_read_kubelet_style() {
        let flags = LlmdFlags {
            feature_gates: vec![
                "flowControl".into(),
                "other=false".into(),
                " x=TRUE ".into(),
                String::new(),
            ],
            ..Default::default()
        };
        let gates = flags.overrides(false).map(|o| o.feature_gates);
        assert_eq!(
            gates,
            Ok(vec![
                ("flowControl".to_owned(), true),
                ("other".to_owned(), false),
                ("x".to_owned(), true)
            ])
        );
        for bad in ["=true", "a=maybe", "a b"] {
            assert!(feature_gate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn what_would_weaken_a_request_is_refused_with_the_reason() {
        let auth = LlmdFlags {
            metrics_endpoint_auth: Some(true),
            ..Default::default()
        };
        assert!(matches!(
            auth.overrides(false),
            Err(LlmdFlagError::Unsupported {
                flag: "metrics-endpoint-auth",
                ..
            })
        ));
        assert!(
            auth.overrides(true).is_ok(),
            "the bearer token protects /metrics"
        );
        let off = LlmdFlags {
            metrics_endpoint_auth: Some(false),
            ..Default::default()
        };
        assert!(off.overrides(false).is_ok());
        let refused = [
            LlmdFlags {
                metrics_cert_dir: Some("/certs".into()),
                ..Default::default()
            },
            LlmdFlags {
                tls_cipher_suites: vec!["TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256".into()],
                ..Default::default()
            },
            LlmdFlags {
                model_server_metrics_scheme: Some("https".into()),
                ..Default::default()
            },
            LlmdFlags {
                total_queued_requests_metric: Some("vllm:num_requests_waiting".into()),
                ..Default::default()
            },
        ];
        for flags in refused {
            assert!(
                matches!(
                    flags.overrides(false),
                    Err(LlmdFlagError::Unsupported { .. })
                ),
                "{flags:?}"
            );
        }
    }

    #[test]
    fn durations_must_be_positive_and_tls_versions_known() {
        let zero = LlmdFlags {
            plugin_state_staleness_threshold: Some(Duration::ZERO),
            ..Default::default()
        };
        assert!(zero.overrides(false).is_err());
        let tls = |v: &str| {
            LlmdFlags {
                tls_min_version: Some(v.to_owned()),
                ..Default::default()
            }
            .overrides(false)
            .map(|o| o.tls13_only)
        };
        assert_eq!(tls("VersionTLS13"), Ok(true));
        assert_eq!(tls("VersionTLS12"), Ok(false));
        assert_eq!(tls("VersionTLS10"), Ok(false));
        assert!(tls("TLS13").is_err());
        let path = |p: &str| {
            LlmdFlags {
                model_server_metrics_path: Some(p.to_owned()),
                ..Default::default()
            }
            .overrides(false)
        };
        assert!(path("/stats/prometheus").is_ok());
        assert!(path("metrics").is_err());
    }

    /// An llm-d Deployment's arguments, as the GIE chart and llm-d's docs write them, start
    /// kvpick and do what they say.
    #[test]
    fn an_llmd_deployments_arguments_validate_and_apply() {
        use clap::Parser;

        #[derive(Parser)]
        #[command(args_override_self = true)]
        struct Cli {
            #[command(flatten)]
            serve: super::super::ServeArgs,
        }
        let parse = |args: &[&str]| {
            let mut argv = vec!["kvpick", "--endpoints-file", "pool.yaml"];
            argv.extend_from_slice(args);
            Cli::try_parse_from(argv).map(|cli| cli.serve)
        };
        let args = parse(&[
            "--zap-encoder",
            "json",
            "--tracing=false",
            "-v",
            "3",
            "--refresh-metrics-interval=1.5s",
            "--metrics-staleness-threshold",
            "2s",
            "--grpc-max-recv-msg-size",
            "16MiB",
            "--feature-gates",
            "flowControl",
            "--disable-endpoint-subset-filter",
            "--health-checking",
            "--enable-pprof=false",
            "--allow-experimental-plugins",
            "--metrics-endpoint-auth=false",
            "--model-server-metrics-path=/stats/prometheus",
            "--drain-timeout=1m30s",
        ])
        .expect("llm-d's flags parse");
        assert_eq!(args.llmd.log_settings().map(|s| s.json), Ok(true));
        let config = args.validate().expect("and validate");
        assert_eq!(config.scrape.interval, Duration::from_millis(1500));
        assert_eq!(config.scrape.staleness, Duration::from_secs(2));
        assert_eq!(config.scrape.path, "/stats/prometheus");
        assert_eq!(
            config.picker.scheduler.saturation.metrics_staleness,
            Duration::from_secs(2)
        );
        assert!(config.picker.scheduler.flow_control);
        assert_eq!(config.grpc_message_limits.recv, 16 << 20);
        assert_eq!(
            config.grpc_message_limits.send,
            crate::extproc::MessageLimits::DEFAULT_BYTES
        );
        assert!(!config.endpoint_subset_filter);
        assert_eq!(config.drain_timeout, Duration::from_secs(90));
        assert!(config.flag_warnings.is_empty());

        // Without them, kvpick's own defaults.
        let plain = parse(&[]).expect("parse").validate().expect("valid");
        assert!(plain.endpoint_subset_filter);
        assert!(!plain.picker.scheduler.flow_control);
        assert_eq!(plain.scrape.path, "/metrics");
        // `--tracing` alone means true: warned about, not refused.
        let traced = parse(&["--tracing"])
            .expect("parse")
            .validate()
            .expect("valid");
        assert_eq!(traced.flag_warnings.len(), 1);
        // A config that turns flow control on is turned off by the flag (applied after it).
        let base = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/config/kvpick-recommended.yaml"
        ))
        .expect("the recommended profile");
        let gated = format!("{base}featureGates: [flowControl]\n");
        let gated = gated.as_str();
        let on = parse(&["--config-text", gated])
            .expect("parse")
            .validate()
            .expect("valid");
        assert!(on.picker.scheduler.flow_control);
        let off = parse(&["--config-text", gated, "--feature-gates=flowControl=false"])
            .expect("parse")
            .validate()
            .expect("valid");
        assert!(!off.picker.scheduler.flow_control);
        // The config's own metricsStalenessThreshold (200ms in the recommended profile's file)
        // wins over the flag, with a warning; without one, the flag sets it.
        let both = parse(&["--config-text", gated, "--metrics-staleness-threshold=2s"])
            .expect("parse")
            .validate()
            .expect("valid");
        assert_eq!(
            both.picker.scheduler.saturation.metrics_staleness,
            Duration::from_millis(200)
        );
        assert_eq!(both.flag_warnings.len(), 1, "{:?}", both.flag_warnings);
        let flag_only = parse(&["--recommended-profile", "--metrics-staleness-threshold=2s"])
            .expect("parse")
            .validate()
            .expect("valid");
        assert_eq!(flag_only.scrape.staleness, Duration::from_secs(2));
        // A flag given twice takes its last value, as in Go; repeatable ones still repeat.
        let twice = parse(&[
            "--v",
            "3",
            "--v=5",
            "--tokenizer",
            "a=/x",
            "--tokenizer",
            "b=/y",
        ])
        .expect("parse");
        assert_eq!(twice.llmd.verbosity, Some(5));
        assert_eq!(twice.tokenizers.len(), 2);
        // Go's boolean syntax: `--flag false` is not `--flag=false`.
        assert!(parse(&["--tracing", "maybe"]).is_err());
        // TLS 1.3 only needs TLS.
        assert!(matches!(
            parse(&["--tls-min-version=VersionTLS13"])
                .expect("parse")
                .validate(),
            Err(super::super::ConfigError::Tls {
                flag: "tls-min-version",
                ..
            })
        ));
        let tls13 = parse(&["--secure-serving", "--tls-min-version=VersionTLS13"])
            .expect("parse")
            .validate()
            .expect("valid");
        assert!(tls13.tls.is_some_and(|tls| tls.tls13_only));
    }
}
