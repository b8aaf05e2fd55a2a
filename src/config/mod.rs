//! Flags → one validated [`ServeConfig`], built once at start-up.
//!
//! Everything downstream takes the typed config; nothing re-reads flags or re-validates.

mod duration;
mod error;
mod handler;
pub mod llmd_flags;
pub mod picker_config;
mod picker_doc;
mod plugins;
mod profiles;
mod source;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

pub use duration::{DurationError, parse_duration};
pub use error::ConfigError;
pub use source::EndpointSource;

/// Flags of `kvpick serve` (GIE-compatible names and defaults where GIE has them).
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Port of the ext-proc gRPC server (HTTP/2).
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,
    /// Port of the gRPC health server (`liveness`, `readiness`, `""`, ext-proc service).
    #[arg(long, default_value_t = 9003)]
    pub grpc_health_port: u16,
    /// Port of the HTTP server with Prometheus `/metrics`.
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,
    /// Address the ext-proc, health and metrics servers bind to.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind_address: IpAddr,
    /// Port of the HTTP server with the `/debug/*` views.
    #[arg(long, default_value_t = 9091)]
    pub debug_port: u16,
    /// Address the debug server binds to. Loopback by default: `POST /debug/prefix` tells its
    /// caller whether any prompt is cached, so it must not be reachable by clients.
    #[arg(long, default_value = "127.0.0.1")]
    pub debug_bind_address: IpAddr,
    /// File holding a bearer token that `/metrics` and `/debug/*` then require
    /// (`Authorization: Bearer <token>`; 401 without it). Read once at start.
    #[arg(long, env = "KVPICK_METRICS_BEARER_TOKEN_FILE")]
    pub metrics_bearer_token_file: Option<PathBuf>,
    /// The InferencePool to watch (GIE/llm-d `--pool-name`); also the `name` label of pool
    /// metrics (`default` without it).
    #[arg(long)]
    pub pool_name: Option<String>,
    /// Namespace of the InferencePool (or the selector's pods). Default: the service
    /// account's namespace, else `default`.
    #[arg(long)]
    pub pool_namespace: Option<String>,
    /// API group of the InferencePool: `inference.networking.k8s.io` (v1) or
    /// `inference.networking.x-k8s.io` (v1alpha2).
    #[arg(long, default_value = "inference.networking.k8s.io")]
    pub pool_group: String,
    /// Without an InferencePool: the pods of the pool by label, `k=v,k2=v2` (llm-d's
    /// standalone mode); needs `--endpoint-target-ports`.
    #[arg(long)]
    pub endpoint_selector: Option<String>,
    /// With `--endpoint-selector`: the ports of each pod that are endpoints, `8000,8001`.
    #[arg(long, value_delimiter = ',')]
    pub endpoint_target_ports: Vec<u16>,
    /// KV-event PUB port on each discovered pod's IP, for pods without a
    /// `kvpick.io/kv-events` annotation.
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// KV-event replay port on each discovered pod's IP, for pods without a
    /// `kvpick.io/kv-replay` annotation.
    #[arg(long)]
    pub kv_replay_port: Option<u16>,
    /// How long the Kubernetes watches may fail before readiness turns NOT_SERVING (the last
    /// endpoints keep being used meanwhile).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub discovery_stale_after: Duration,
    /// Leader election on a Lease (llm-d's active-passive HA): only the leader reports ready.
    /// `--ha-enable-leader-election` or `=true`/`=false`, as Go's flags take it.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub ha_enable_leader_election: bool,
    /// How long the Lease holds without renewal (controller-runtime's default).
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub ha_lease_duration: Duration,
    /// How long the leader keeps trying to renew before it steps back.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub ha_renew_deadline: Duration,
    /// How often candidates try to take the Lease and the leader renews it.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub ha_retry_period: Duration,
    /// Port of the replica exchange (active-active replicas tell each other their routing
    /// records and in-flight counts); off when not given.
    #[arg(long)]
    pub replica_exchange_port: Option<u16>,
    /// Replica peers as `host:port,...` (their `--replica-exchange-port`), without Kubernetes.
    #[arg(long, value_delimiter = ',')]
    pub replica_peers: Vec<String>,
    /// Replica peers from the API: the ready pods with these labels (`k=v,...`) in the pool's
    /// namespace, this pod excluded, on the exchange port.
    #[arg(long)]
    pub peer_selector: Option<String>,
    /// Mutual TLS on the replica exchange, pinned to the `--cert-path` certificate every
    /// replica shares (needs `--secure-serving --cert-path`).
    #[arg(long)]
    pub replica_exchange_tls: bool,
    /// How often the replica exchange sends a batch (at most 1s).
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    pub replica_batch_interval: Duration,
    /// Static pool file (YAML, see DESIGN §2.1); re-read when it changes.
    #[arg(long)]
    pub endpoints_file: Option<PathBuf>,
    /// How often the endpoints file is checked for changes.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub endpoints_reload_interval: Duration,
    /// Largest request body kvpick buffers; larger bodies get 413.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Bytes of request bodies buffered across all streams at once; past it new bodies get 503.
    #[arg(long, default_value_t = 1024 * 1024 * 1024)]
    pub max_buffered_bytes: usize,
    /// How long the whole request body may take to arrive, from the request headers; a
    /// slower body is answered 408 and its share of the buffer budget returned.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub request_body_timeout: Duration,
    /// How long a new ext-proc stream may wait for its request headers before it is closed
    /// (DEADLINE_EXCEEDED). Gateways send them at once; only idle clients hit this.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub request_headers_timeout: Duration,
    /// Ext-proc streams open at once, across all connections (and per HTTP/2 connection);
    /// past it new streams are refused with RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 10_000)]
    pub max_extproc_streams: usize,
    /// Threads serving ext-proc connections, each connection on one of them for its whole
    /// life (default: one per core; 0: on the shared runtime's workers; at most 1024).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1024))]
    pub extproc_threads: Option<usize>,
    /// Worker threads of the runtime that runs everything but the ext-proc connections:
    /// metric scrapes, KV events, discovery, the health, metrics, debug and replica-exchange
    /// servers (default: half the cores, at least one; every core with `--extproc-threads 0`,
    /// which serves the connections here too; at most 1024).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub background_threads: Option<usize>,
    /// Bytes of large request bodies parsed and tokenized at once; the rest wait their turn.
    /// Preparing a body holds several times its size; this bounds that memory and CPU.
    #[arg(long, default_value_t = crate::tokenize::DEFAULT_MAX_PREPARING_BYTES)]
    pub max_preparing_bytes: usize,
    /// How many fallback endpoints follow the primary in the destination header.
    ///
    /// 1 by default: the reference Envoy config (deploy/envoy/envoy.yaml, override_host
    /// load-balancing policy) retries a failed connect on the next address of the list, so
    /// the second-best pod takes over from a pod that died since kvpick last saw it. 0 for
    /// gateways that accept a single `ip:port` (an ORIGINAL_DST cluster).
    #[arg(long, default_value_t = 1)]
    pub max_fallbacks: usize,
    /// How long in-flight streams may run after SIGTERM before kvpick exits anyway.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// How long kvpick keeps accepting new ext-proc streams after SIGTERM, with readiness
    /// already NOT_SERVING, before it stops accepting and drains.
    ///
    /// NOTE: 5s by default: longer than the gateway's health-check interval plus its timeout
    /// (1s + 1s in deploy/envoy/envoy.yaml), so the gateway has seen NOT_SERVING and stopped
    /// opening streams (falling open) before the listener closes; a shorter grace drops the
    /// requests that arrive between SIGTERM and the gateway's next health check.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub shutdown_grace_period: Duration,
    /// Tokenizer directory (HF layout: tokenizer.json + tokenizer_config.json), as
    /// `MODEL=DIR` for one model or `DIR` for every other model. Repeatable. Models without
    /// one are matched approximately (by text).
    #[arg(long = "tokenizer", value_name = "[MODEL=]DIR")]
    pub tokenizers: Vec<String>,
    /// A LoRA adapter and its base model, `ADAPTER=BASE`. Repeatable.
    #[arg(long = "lora", value_name = "ADAPTER=BASE", value_parser = parse_lora)]
    pub loras: Vec<(String, String)>,
    /// Bytes of token prefixes cached per tokenizer (0 disables the prefix token cache).
    #[arg(long, default_value_t = crate::tokenize::DEFAULT_PREFIX_CACHE_BYTES)]
    pub prefix_token_cache_bytes: usize,
    /// Bind this ZMQ endpoint (e.g. `tcp://*:5557`) for pods that dial in their KV events,
    /// in addition to subscribing to each endpoint's own `kvEvents` address.
    #[arg(long)]
    pub kv_events_bind: Option<String>,
    /// Largest KV-event message (all frames together) accepted from a pod or a peer dialing
    /// in, checked before anything is allocated; a larger one drops the connection.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub kv_events_max_message_bytes: usize,
    /// Most connections at once on the `--kv-events-bind` socket.
    #[arg(long, default_value_t = 1024)]
    pub kv_events_max_peers: usize,
    /// Bytes the `--kv-events-bind` socket's connections may buffer together; past it,
    /// reading pauses (TCP pushes back) until the index catches up.
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    pub kv_events_buffer_bytes: usize,
    /// Interval between scrapes of each endpoint's /metrics (llm-d:
    /// `--refresh-metrics-interval`).
    #[arg(long, visible_alias = "refresh-metrics-interval", default_value = "50ms", value_parser = parse_duration)]
    pub scrape_interval: Duration,
    /// Longest one /metrics scrape may take.
    #[arg(long, default_value = "1000ms", value_parser = parse_duration)]
    pub scrape_timeout: Duration,
    /// Scrape vLLM pods' whole /metrics page instead of asking for the metrics kvpick reads
    /// by name (`/metrics/?name[]=…`, ~15× less work for the pod per scrape).
    #[arg(long)]
    pub scrape_whole_pages: bool,
    /// EndpointPickerConfig YAML file (plugins, scheduling profile, saturation detector,
    /// feature gates). Without one, GIE's default profile runs.
    #[arg(long, conflicts_with = "config_text")]
    pub config_file: Option<PathBuf>,
    /// EndpointPickerConfig YAML given inline.
    #[arg(long)]
    pub config_text: Option<String>,
    /// Run kvpick's recommended profile (TTFT-cost + prefix + in-flight scorers, flow
    /// control on) instead of GIE's default when no config is given.
    #[arg(long, conflicts_with_all = ["config_file", "config_text"])]
    pub recommended_profile: bool,
    /// Put every candidate's final and per-scorer scores on each routed request
    /// (`x-kvpick-endpoint-scores`, `x-kvpick-scorer-scores` headers and the `kvpick`
    /// dynamic-metadata namespace), for tracing. Off: nothing is computed for it.
    #[arg(long)]
    pub emit_endpoint_scores: bool,
    /// GIE's conformance-suite hooks: the `test-epp-endpoint-selection` request header
    /// restricts the pick, and the served endpoint is echoed as
    /// `x-conformance-test-served-endpoint`. For conformance runs only: any client could
    /// steer its own request with the header.
    #[arg(long)]
    pub enable_conformance_hooks: bool,
    /// TLS on the ext-proc gRPC port (llm-d's flag; llm-d turns it on by default, kvpick
    /// does not: see README). `--secure-serving` or `=true`/`=false`.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub secure_serving: bool,
    /// With `--secure-serving`: the directory holding `tls.crt` and `tls.key` (without it, a
    /// self-signed certificate made at start).
    #[arg(long, value_name = "DIR")]
    pub cert_path: Option<PathBuf>,
    /// Reload `--cert-path`'s files when they change (checked every second).
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub enable_cert_reload: bool,
    /// InferenceModelRewrite-style weighted model rewrite rules (YAML `rules: [{matches,
    /// targets: [{modelRewrite, weight}]}]`). The `x-gateway-model-name-rewrite` header wins.
    #[arg(long)]
    pub model_rewrites: Option<PathBuf>,
    /// An InferenceObjective: requests naming it in `x-gateway-inference-objective` get this
    /// priority (higher is more important; negative is sheddable). `NAME=PRIORITY`, repeatable.
    #[arg(long = "objective", value_name = "NAME=PRIORITY", value_parser = parse_objective)]
    pub objectives: Vec<(String, i32)>,
    /// The llm-d EPP's flags kvpick has none of its own for ([`llmd_flags`]).
    #[command(flatten)]
    pub llmd: llmd_flags::LlmdFlags,
}

/// The cores this process may run on (1 when unknown).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

fn parse_objective(value: &str) -> Result<(String, i32), String> {
    let (name, priority) = value
        .split_once('=')
        .ok_or_else(|| format!("`{value}` is not NAME=PRIORITY"))?;
    let priority = priority
        .trim()
        .parse::<i32>()
        .map_err(|_| format!("priority of `{value}` is not an integer"))?;
    if name.trim().is_empty() {
        return Err(format!("`{value}` has no objective name"));
    }
    Ok((name.trim().to_owned(), priority))
}

fn parse_lora(value: &str) -> Result<(String, String), String> {
    match value.split_once('=') {
        Some((adapter, base)) if !adapter.trim().is_empty() && !base.trim().is_empty() => {
            Ok((adapter.trim().to_owned(), base.trim().to_owned()))
        }
        _ => Err(format!("`{value}` is not ADAPTER=BASE")),
    }
}

fn kv_events_config(
    max_message_bytes: usize,
    max_peers: usize,
    buffer_bytes: usize,
) -> crate::kvevents::KvEventsConfig {
    let defaults = crate::kvevents::KvEventsConfig::default();
    crate::kvevents::KvEventsConfig {
        transport: crate::kvevents::transport::TransportConfig {
            limits: kvpick_kvevents_wire::zmtp::Limits {
                max_message_bytes,
                ..defaults.transport.limits
            },
            ..defaults.transport
        },
        central_max_peers: max_peers.max(1),
        central_budget_bytes: buffer_bytes,
        ..defaults
    }
}

/// The validated configuration of `kvpick serve`.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Ext-proc gRPC listen address.
    pub grpc_addr: SocketAddr,
    /// gRPC health listen address.
    pub health_addr: SocketAddr,
    /// Metrics HTTP listen address.
    pub metrics_addr: SocketAddr,
    /// Debug-views HTTP listen address.
    pub debug_addr: SocketAddr,
    /// The token `/metrics` and `/debug/*` require, if any.
    pub metrics_bearer_token: Option<crate::admin::auth::BearerToken>,
    /// The pool's name (metric label).
    pub pool_name: String,
    /// Where the endpoints come from.
    pub source: EndpointSource,
    /// Per-request body limit.
    pub max_body_bytes: usize,
    /// Global body buffer budget.
    pub max_buffered_bytes: usize,
    /// Request headers and body timeouts.
    pub stream_timeouts: crate::extproc::StreamTimeouts,
    /// Open ext-proc streams bound.
    pub max_extproc_streams: usize,
    /// Threads serving ext-proc connections (0: the shared runtime).
    pub extproc_threads: usize,
    /// Worker threads of the runtime for everything else.
    pub background_threads: usize,
    /// Whether GIE's conformance hooks are on.
    pub conformance_hooks: bool,
    /// Fallbacks after the primary.
    pub max_fallbacks: usize,
    /// Drain timeout on shutdown.
    pub drain_timeout: Duration,
    /// How long new streams are still accepted after SIGTERM (readiness off).
    pub shutdown_grace_period: Duration,
    /// Where tokenizers come from.
    pub tokenizers: crate::tokenize::TokenizersConfig,
    /// Central KV-event bind endpoint.
    pub kv_events_bind: Option<String>,
    /// KV-event pipeline bounds (message size, central peers and bytes).
    pub kv_events: crate::kvevents::KvEventsConfig,
    /// Metrics scraping.
    pub scrape: crate::scrape::ScrapeConfig,
    /// Weighted model rewrite rules.
    pub model_rewrites: crate::request::ModelRewriteRules,
    /// Objective name → priority.
    pub objectives: std::collections::HashMap<String, i32>,
    /// The validated scheduling profile.
    pub picker: picker_config::ValidatedPickerConfig,
    /// Whether routed requests carry the candidates' scores (`--emit-endpoint-scores`).
    pub emit_endpoint_scores: bool,
    /// TLS on the ext-proc port (`--secure-serving`), when on.
    pub tls: Option<crate::tls::TlsConfig>,
    /// The replica exchange (`--replica-exchange-port`), when on.
    pub replica: Option<crate::replica::ReplicaConfig>,
    /// Largest ext-proc gRPC message accepted and sent (`--grpc-max-recv-msg-size`,
    /// `--grpc-max-send-msg-size`).
    pub grpc_message_limits: crate::extproc::MessageLimits,
    /// Whether the gateway's subset hint restricts the pick (`--disable-endpoint-subset-filter`
    /// turns it off).
    pub endpoint_subset_filter: bool,
    /// What start-up should warn about once logging is up (flags accepted that do nothing
    /// here).
    pub flag_warnings: Vec<String>,
    /// Distinct fairness ids with metric series of their own.
    pub fairness_id_label_limit: usize,
}

impl ServeArgs {
    /// Validates the flags into a [`ServeConfig`].
    pub fn validate(self) -> Result<ServeConfig, ConfigError> {
        let source = self.endpoint_source()?;
        let replica = crate::replica::config::validate(crate::replica::config::ReplicaFlags {
            port: self.replica_exchange_port,
            bind: self.bind_address,
            peers: &self.replica_peers,
            peer_selector: self.peer_selector.as_deref(),
            batch_interval: self.replica_batch_interval,
            namespace: self
                .pool_namespace
                .clone()
                .unwrap_or_else(crate::discovery::kube::default_namespace),
            tls: self.replica_exchange_tls,
            shared_cert: self.secure_serving && self.cert_path.is_some(),
        })?;
        let llmd = self
            .llmd
            .overrides(self.metrics_bearer_token_file.is_some())?;
        let tls = self.tls_config(llmd.tls13_only)?;
        let ports = [
            ("grpc-port", self.grpc_port),
            ("grpc-health-port", self.grpc_health_port),
            ("metrics-port", self.metrics_port),
            ("debug-port", self.debug_port),
            (
                "replica-exchange-port",
                self.replica_exchange_port.unwrap_or(0),
            ),
        ];
        for (i, (first, a)) in ports.iter().enumerate() {
            for (second, b) in &ports[i + 1..] {
                // Port 0 asks the OS for a fresh port each time, so it never clashes.
                if a == b && *a != 0 {
                    return Err(ConfigError::PortClash {
                        first,
                        second,
                        port: *a,
                    });
                }
            }
        }
        if self.max_body_bytes < 1024 {
            return Err(ConfigError::TooSmall {
                flag: "max-body-bytes",
                min: 1024,
                value: self.max_body_bytes,
            });
        }
        if self.kv_events_max_message_bytes < 1024 {
            return Err(ConfigError::TooSmall {
                flag: "kv-events-max-message-bytes",
                min: 1024,
                value: self.kv_events_max_message_bytes,
            });
        }
        if self.kv_events_buffer_bytes < self.kv_events_max_message_bytes {
            return Err(ConfigError::TooSmall {
                flag: "kv-events-buffer-bytes",
                min: self.kv_events_max_message_bytes,
                value: self.kv_events_buffer_bytes,
            });
        }
        if self.max_buffered_bytes < self.max_body_bytes {
            return Err(ConfigError::TooSmall {
                flag: "max-buffered-bytes",
                min: self.max_body_bytes,
                value: self.max_buffered_bytes,
            });
        }
        for (flag, value) in [
            ("request-body-timeout", self.request_body_timeout),
            ("request-headers-timeout", self.request_headers_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::TooSmall {
                    flag,
                    min: 1,
                    value: 0,
                });
            }
        }
        // Bounded by what an HTTP/2 SETTINGS frame can say.
        if self.max_extproc_streams == 0 || u32::try_from(self.max_extproc_streams).is_err() {
            return Err(ConfigError::TooSmall {
                flag: "max-extproc-streams",
                min: 1,
                value: self.max_extproc_streams,
            });
        }
        if self.max_preparing_bytes < 1024 {
            return Err(ConfigError::TooSmall {
                flag: "max-preparing-bytes",
                min: 1024,
                value: self.max_preparing_bytes,
            });
        }
        let mut tokenizers = crate::tokenize::TokenizersConfig {
            lora_bases: self.loras,
            prefix_cache_bytes: self.prefix_token_cache_bytes,
            max_preparing_bytes: self.max_preparing_bytes,
            ..Default::default()
        };
        for value in &self.tokenizers {
            tokenizers.add_flag(value);
        }
        if self.scrape_interval.is_zero() {
            return Err(ConfigError::TooSmall {
                flag: "scrape-interval",
                min: 1,
                value: 0,
            });
        }
        let model_rewrites = match &self.model_rewrites {
            None => crate::request::ModelRewriteRules::default(),
            Some(path) => {
                let fail = |reason: String| ConfigError::ModelRewrites {
                    path: path.clone(),
                    reason,
                };
                let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
                serde_yaml::from_str(&text).map_err(|e| fail(e.to_string()))?
            }
        };
        let picker_text = match (&self.config_file, &self.config_text) {
            (Some(path), _) => Some(std::fs::read_to_string(path).map_err(|e| {
                ConfigError::Picker(format!("cannot read {}: {e}", path.display()))
            })?),
            (None, Some(text)) => Some(text.clone()),
            (None, None) => None,
        };
        let mut picker = picker_config::load(picker_text.as_deref())
            .map_err(|e| ConfigError::Picker(e.to_string()))?;
        if self.recommended_profile {
            picker.scheduler = crate::scheduling::SchedulerConfig::kvpick_recommended();
        }
        let mut flag_warnings = Vec::new();
        // llm-d applies `--feature-gates` after the config's `featureGates`.
        // `--metrics-staleness-threshold` sets the one staleness every check reads, unless the
        // config file sets it (per profile) itself.
        for (gate, on) in &llmd.feature_gates {
            if gate == picker_doc::FLOW_CONTROL_GATE {
                picker.scheduler.flow_control = *on;
            } else {
                picker
                    .warnings
                    .push(format!("--feature-gates: unknown gate `{gate}`; ignored"));
            }
        }
        if let Some(staleness) = llmd.metrics_staleness {
            if picker.metrics_staleness_configured {
                flag_warnings.push(format!(
                    "--metrics-staleness-threshold {staleness:?}: the config's saturationDetector.metricsStalenessThreshold ({:?}) wins",
                    picker.scheduler.saturation.metrics_staleness
                ));
            } else {
                picker.scheduler.saturation.metrics_staleness = staleness;
            }
        }
        if llmd.tracing_asked {
            flag_warnings.push(
                "--tracing=true: kvpick exports no OpenTelemetry traces (its per-request stage timings are metrics)"
                    .to_owned(),
            );
        }
        let metrics_bearer_token = self
            .metrics_bearer_token_file
            .as_deref()
            .map(crate::admin::auth::BearerToken::from_file)
            .transpose()?;
        let ip = self.bind_address;
        let extproc_threads = self.extproc_threads.unwrap_or_else(cores);
        Ok(ServeConfig {
            tls,
            replica,
            grpc_addr: SocketAddr::new(ip, self.grpc_port),
            health_addr: SocketAddr::new(ip, self.grpc_health_port),
            metrics_addr: SocketAddr::new(ip, self.metrics_port),
            debug_addr: SocketAddr::new(self.debug_bind_address, self.debug_port),
            metrics_bearer_token,
            pool_name: self.pool_name.unwrap_or_else(|| "default".to_owned()),
            source,
            max_body_bytes: self.max_body_bytes,
            max_buffered_bytes: self.max_buffered_bytes,
            stream_timeouts: crate::extproc::StreamTimeouts {
                headers: self.request_headers_timeout,
                body: self.request_body_timeout,
            },
            max_extproc_streams: self.max_extproc_streams,
            extproc_threads,
            // NOTE: half the cores, not all: the ext-proc connections have a thread per core
            // of their own, and what runs here is light but wakes often (a scrape of every
            // pod each 50 ms). With a worker per core the workers hand those wake-ups to each
            // other (futex wake, park): on 2 cores one worker cost 7-19% less of kvpick's
            // CPU per request (docs/benchmarks.md, session 36).
            // With `--extproc-threads 0` the connections are served here too: every core.
            background_threads: self.background_threads.unwrap_or_else(|| {
                if extproc_threads == 0 {
                    cores()
                } else {
                    (cores() / 2).max(1)
                }
            }),
            conformance_hooks: self.enable_conformance_hooks,
            max_fallbacks: self.max_fallbacks,
            emit_endpoint_scores: self.emit_endpoint_scores,
            drain_timeout: self.drain_timeout,
            shutdown_grace_period: self.shutdown_grace_period,
            tokenizers,
            kv_events_bind: self.kv_events_bind,
            kv_events: kv_events_config(
                self.kv_events_max_message_bytes,
                self.kv_events_max_peers,
                self.kv_events_buffer_bytes,
            ),
            scrape: crate::scrape::ScrapeConfig {
                interval: self.scrape_interval,
                timeout: self.scrape_timeout,
                // One source of truth: the saturation detector's staleness threshold.
                staleness: picker.scheduler.saturation.metrics_staleness,
                path: llmd
                    .metrics_path
                    .unwrap_or_else(|| crate::scrape::DEFAULT_METRICS_PATH.to_owned()),
                port: llmd.metrics_port,
                by_name: !self.scrape_whole_pages,
                ..Default::default()
            },
            model_rewrites,
            objectives: self.objectives.into_iter().collect(),
            picker,
            grpc_message_limits: crate::extproc::MessageLimits::new(
                llmd.grpc_max_recv,
                llmd.grpc_max_send,
            ),
            endpoint_subset_filter: llmd.endpoint_subset_filter,
            flag_warnings,
            fairness_id_label_limit: llmd.fairness_id_label_limit,
        })
    }
}

impl ServeArgs {
    /// `--secure-serving` and its refinements; a refinement without it is an error (kvpick
    /// serves plaintext by default, unlike llm-d, so a lone `--cert-path` would silently
    /// not do what an llm-d user means).
    fn tls_config(&self, tls13_only: bool) -> Result<Option<crate::tls::TlsConfig>, ConfigError> {
        if !self.secure_serving {
            if tls13_only {
                return Err(ConfigError::Tls {
                    flag: "tls-min-version",
                    reason: "needs --secure-serving (kvpick serves plaintext unless it is given)",
                });
            }
            if self.cert_path.is_some() {
                return Err(ConfigError::Tls {
                    flag: "cert-path",
                    reason: "needs --secure-serving (kvpick serves plaintext unless it is given)",
                });
            }
            if self.enable_cert_reload {
                return Err(ConfigError::Tls {
                    flag: "enable-cert-reload",
                    reason: "needs --secure-serving and --cert-path",
                });
            }
            return Ok(None);
        }
        if self.enable_cert_reload && self.cert_path.is_none() {
            return Err(ConfigError::Tls {
                flag: "enable-cert-reload",
                reason: "needs --cert-path (a self-signed certificate has no files to reload)",
            });
        }
        Ok(Some(crate::tls::TlsConfig {
            cert_path: self.cert_path.clone(),
            reload: self.enable_cert_reload,
            tls13_only,
        }))
    }
}

#[cfg(test)]
mod tests;
