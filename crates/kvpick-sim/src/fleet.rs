//! Many simulated pods in one process: pod `i` serves HTTP on `base_port + i`, publishes KV
//! events on `events_base_port + i` and replays on `replay_base_port + i`, with topic
//! `kv@127.0.0.1:<base_port + i>@<model>` (DESIGN §2.1) unless a topic template says otherwise
//! ([`start_fleet_with_topic`]). Per-pod overrides make heterogeneous fleets (capacity, speed,
//! faults at start).
//!
//! Each pod is independent (own engine task, publisher task, registry, HTTP server); the
//! tokenizer is shared read-only.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::engine::EngineConfig;
use super::events::EventLayout;
use super::http::{PodApi, router};
use super::pod::{Faults, MetricsFault, Pod, PodConfig, PodError};
use super::publisher::PublisherConfig;
use super::request_log::RequestLog;
use super::tokenizer::SimTokenizer;

/// Per-pod deviations from the fleet defaults.
#[derive(Debug, Clone, Default)]
pub struct PodOverride {
    /// KV blocks for this pod.
    pub num_gpu_blocks: Option<usize>,
    /// Step-time multiplier for this pod (a slower GPU).
    pub slowdown: Option<f64>,
    /// Max running requests.
    pub max_num_seqs: Option<usize>,
    /// Fraction of event messages dropped from the start.
    pub drop_fraction: Option<f64>,
    /// Refuse requests from the start.
    pub refuse: bool,
    /// `/metrics` fault from the start.
    pub metrics: Option<MetricsFault>,
}

/// A fleet's settings.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Number of pods.
    pub pods: usize,
    /// Loopback address to bind.
    pub host: std::net::IpAddr,
    /// HTTP port of pod 0 (0 = any free port per pod, for tests).
    pub base_port: u16,
    /// KV-event PUB port of pod 0 (0 = any); `None` disables events.
    pub events_base_port: Option<u16>,
    /// Replay ROUTER port of pod 0 (0 = any); `None` disables replay.
    pub replay_base_port: Option<u16>,
    /// Served model name.
    pub model: String,
    /// Engine defaults for every pod.
    pub engine: EngineConfig,
    /// Step-time multiplier.
    pub time_scale: f64,
    /// Replay buffer length.
    pub buffer_steps: usize,
    /// Event layout.
    pub layout: EventLayout,
    /// Overrides by pod index.
    pub overrides: Vec<(usize, PodOverride)>,
    /// Where every pod writes a line per request (`--request-log`); `None`: nowhere.
    pub request_log: Option<Arc<RequestLog>>,
}

/// Errors starting a fleet.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// A pod failed to start.
    #[error("pod {index}: {source}")]
    Pod {
        /// Pod index.
        index: usize,
        /// Cause.
        source: PodError,
    },
    /// The HTTP port could not be bound.
    #[error("pod {index}: cannot bind {addr}: {source}")]
    Bind {
        /// Pod index.
        index: usize,
        /// Address.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
    /// A port would overflow u16.
    #[error("port range overflows for pod {0}")]
    PortOverflow(usize),
}

/// One running pod of the fleet.
#[derive(Debug)]
pub struct FleetPod {
    /// The pod handle.
    pub pod: Pod,
    /// Its HTTP address.
    pub http: SocketAddr,
    /// Its tasks (engine, HTTP server).
    pub tasks: Vec<JoinHandle<()>>,
}

fn port(base: u16, i: usize) -> Option<u16> {
    if base == 0 {
        return Some(0);
    }
    u16::try_from(usize::from(base) + i).ok()
}

/// The default KV-event topic template: llm-d's `kv@<ip:port>@<model>` convention (DESIGN §2.1).
pub const DEFAULT_TOPIC_TEMPLATE: &str = "kv@{addr}@{model}";

/// A pod's KV-event topic from `template`: `{addr}` becomes its HTTP `ip:port`, `{model}` the
/// served model name; anything else is literal.
///
/// Why a template: vLLM's topic is deployment config (`--kv-events-config '{"topic": …}'`) whose
/// own default is the empty string; llm-d sets `kv@<ip:port>@<model>`, and consumers differ in
/// what they accept (vllm-router 0.1.17's static `--kv-event-source` only takes the empty topic).
pub fn render_topic(template: &str, http: SocketAddr, model: &str) -> String {
    template
        .replace("{addr}", &http.to_string())
        .replace("{model}", model)
}

/// Starts every pod with the default topic ([`DEFAULT_TOPIC_TEMPLATE`]); returns when all
/// are listening.
pub async fn start_fleet(
    cfg: FleetConfig,
    tokenizer: Arc<SimTokenizer>,
) -> Result<Vec<FleetPod>, FleetError> {
    start_fleet_with_topic(cfg, tokenizer, DEFAULT_TOPIC_TEMPLATE).await
}

/// Starts every pod, each publishing on [`render_topic`]`(topic_template, …)`; returns when all
/// are listening.
// NOTE: a parameter rather than a `FleetConfig` field so the struct literals in other crates'
// tests keep compiling.
pub async fn start_fleet_with_topic(
    cfg: FleetConfig,
    tokenizer: Arc<SimTokenizer>,
    topic_template: &str,
) -> Result<Vec<FleetPod>, FleetError> {
    let mut out = Vec::with_capacity(cfg.pods);
    for index in 0..cfg.pods {
        let over = cfg
            .overrides
            .iter()
            .filter(|(i, _)| *i == index)
            .map(|(_, o)| o.clone())
            .next_back()
            .unwrap_or_default();
        let http_port = port(cfg.base_port, index).ok_or(FleetError::PortOverflow(index))?;
        let addr = SocketAddr::new(cfg.host, http_port);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| FleetError::Bind {
                index,
                addr,
                source,
            })?;
        let http = listener.local_addr().map_err(|source| FleetError::Bind {
            index,
            addr,
            source,
        })?;
        let mut engine = cfg.engine.clone();
        if let Some(n) = over.num_gpu_blocks {
            engine.num_gpu_blocks = n;
        }
        if let Some(n) = over.max_num_seqs {
            engine.max_num_seqs = n;
        }
        let publisher = match cfg.events_base_port {
            Some(base) => {
                let p = port(base, index).ok_or(FleetError::PortOverflow(index))?;
                let replay = match cfg.replay_base_port {
                    Some(rb) => Some(port(rb, index).ok_or(FleetError::PortOverflow(index))?),
                    None => None,
                };
                Some(PublisherConfig {
                    endpoint: format!("tcp://{}:{p}", cfg.host),
                    replay_endpoint: replay.map(|r| format!("tcp://{}:{r}", cfg.host)),
                    topic: render_topic(topic_template, http, &cfg.model),
                    buffer_steps: cfg.buffer_steps,
                    layout: cfg.layout,
                    queue_capacity: 10_000,
                    seed: index as u64,
                })
            }
            None => None,
        };
        let faults = Arc::new(Faults::default());
        if let Some(s) = over.slowdown {
            faults.set_slowdown(s);
        }
        faults.set_refuse(over.refuse);
        if let Some(m) = over.metrics {
            faults.set_metrics(m);
        }
        let (pod, engine_task) = Pod::start(
            PodConfig {
                model: cfg.model.clone(),
                engine,
                time_scale: cfg.time_scale,
                publisher,
            },
            faults,
        )
        .await
        .map_err(|source| FleetError::Pod { index, source })?;
        if let (Some(f), Some(p)) = (over.drop_fraction, &pod.publisher) {
            p.set_drop_fraction(f).await;
        }
        let app = router(Arc::new(PodApi {
            pod: pod.clone(),
            tokenizer: tokenizer.clone(),
            index,
            request_log: cfg.request_log.clone(),
        }));
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "simulated pod HTTP server stopped");
            }
        });
        out.push(FleetPod {
            pod,
            http,
            tasks: vec![engine_task, server],
        });
    }
    Ok(out)
}

/// Errors parsing `--pod-override`.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    /// Not `INDEX:key=value[,key=value…]`.
    #[error("pod override {0:?}: expected INDEX:key=value[,key=value...]")]
    Syntax(String),
    /// Unknown key or bad value.
    #[error("pod override {spec:?}: bad {key}")]
    Value {
        /// The whole spec.
        spec: String,
        /// The offending key.
        key: String,
    },
}

/// Parses `INDEX:blocks=N,slowdown=F,max-num-seqs=N,drop=F,refuse=true,metrics=stall|error`.
pub fn parse_override(spec: &str) -> Result<(usize, PodOverride), OverrideError> {
    let syntax = || OverrideError::Syntax(spec.to_owned());
    let (index, rest) = spec.split_once(':').ok_or_else(syntax)?;
    let index: usize = index.trim().parse().map_err(|_| syntax())?;
    let mut over = PodOverride::default();
    for pair in rest.split(',').filter(|p| !p.trim().is_empty()) {
        let (key, value) = pair.split_once('=').ok_or_else(syntax)?;
        let (key, value) = (key.trim(), value.trim());
        let bad = || OverrideError::Value {
            spec: spec.to_owned(),
            key: key.to_owned(),
        };
        match key {
            "blocks" => over.num_gpu_blocks = Some(value.parse().map_err(|_| bad())?),
            "max-num-seqs" => over.max_num_seqs = Some(value.parse().map_err(|_| bad())?),
            "slowdown" => over.slowdown = Some(value.parse().map_err(|_| bad())?),
            "drop" => over.drop_fraction = Some(value.parse().map_err(|_| bad())?),
            "refuse" => over.refuse = value.parse().map_err(|_| bad())?,
            "metrics" => {
                over.metrics = Some(match value {
                    "ok" => MetricsFault::Ok,
                    "stall" => MetricsFault::Stall,
                    "error" => MetricsFault::Error,
                    _ => return Err(bad()),
                })
            }
            _ => return Err(bad()),
        }
    }
    Ok((index, over))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_template_renders_llm_d_default_and_vllm_empty_topic() {
        let http: SocketAddr = "127.0.0.1:8105".parse().expect("addr");
        assert_eq!(
            render_topic(DEFAULT_TOPIC_TEMPLATE, http, "sim-model"),
            "kv@127.0.0.1:8105@sim-model"
        );
        // vLLM's KVEventsConfig default: the empty topic.
        assert_eq!(render_topic("", http, "sim-model"), "");
        assert_eq!(render_topic("pods/{model}", http, "m"), "pods/m");
    }

    #[test]
    fn overrides_parse_and_reject_garbage() {
        let (i, o) =
            parse_override("3:blocks=128,slowdown=2.5,metrics=stall,refuse=true").expect("parses");
        assert_eq!(i, 3);
        assert_eq!(o.num_gpu_blocks, Some(128));
        assert_eq!(o.slowdown, Some(2.5));
        assert_eq!(o.metrics, Some(MetricsFault::Stall));
        assert!(o.refuse);
        for bad in ["x:blocks=1", "1", "1:blocks", "1:color=red", "1:blocks=-4"] {
            assert!(parse_override(bad).is_err(), "{bad}");
        }
    }
}
