//! `kvpick-sim`: a fleet of simulated vLLM pods in one process (docs/simulator.md).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kvpick_sim::engine::{EngineConfig, StepCost};
use kvpick_sim::events::EventLayout;
use kvpick_sim::fleet::{
    DEFAULT_TOPIC_TEMPLATE, FleetConfig, parse_override, start_fleet_with_topic,
};
use kvpick_sim::floor::FloorModel;
use kvpick_sim::hashing::HashAlgo;
use kvpick_sim::pod::{slowdown_factor, time_scale_factor};
use kvpick_sim::request_log::RequestLog;
use kvpick_sim::tokenizer::SimTokenizer;

#[derive(Debug, Parser)]
#[command(
    name = "kvpick-sim",
    about = "A vLLM-compatible model-server simulator"
)]
struct Args {
    /// Number of pods.
    #[arg(long, default_value_t = 1)]
    pods: usize,
    /// HTTP port of pod 0 (pod i listens on base-port + i).
    #[arg(long, default_value_t = 8100)]
    base_port: u16,
    /// KV-event PUB port of pod 0.
    #[arg(long, default_value_t = 5557)]
    events_base_port: u16,
    /// Replay ROUTER port of pod 0.
    #[arg(long, default_value_t = 6557)]
    replay_base_port: u16,
    /// Disable KV events.
    #[arg(long)]
    no_kv_events: bool,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per pod (including vLLM's null block).
    #[arg(long, default_value_t = 4096)]
    num_gpu_blocks: usize,
    /// Max running requests per pod.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Token budget per engine step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Max prompt + output tokens.
    #[arg(long, default_value_t = 32768)]
    max_model_len: usize,
    /// sha256 (pickle) or sha256_cbor.
    #[arg(long, default_value = "sha256")]
    prefix_caching_hash_algo: String,
    /// Publish 32-byte digests instead of 64-bit ints.
    #[arg(long)]
    bytes_block_hashes: bool,
    /// KV-event topic: `{addr}` = the pod's HTTP ip:port, `{model}` = --model; "" is vLLM's
    /// own default (what vllm-router's static --kv-event-source expects).
    #[arg(long, default_value = DEFAULT_TOPIC_TEMPLATE)]
    kv_events_topic: String,
    /// Write one JSON line per request reaching its first token to this file (pod, arrival,
    /// first-token time, prompt and cached tokens, prompt-head digests, the least first-token
    /// time any placement could have given it), for benchmarks.
    #[arg(long)]
    request_log: Option<std::path::PathBuf>,
    /// Encode events as pre-0.24 tagged arrays.
    #[arg(long)]
    legacy_array_events: bool,
    /// Replay buffer length (batches).
    #[arg(long, default_value_t = 10_000)]
    buffer_steps: usize,
    /// Resident LoRA adapters (0 disables LoRA).
    #[arg(long, default_value_t = 0)]
    max_loras: usize,
    /// Tokenizer directory.
    #[arg(long, default_value = "assets/tokenizer")]
    tokenizer: PathBuf,
    /// Multiplier on simulated step times (0.1 = 10x faster than real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Fixed cost per engine step, microseconds.
    #[arg(long, default_value_t = 6_200)]
    step_overhead_us: u64,
    /// Cost per computed prompt token, microseconds.
    #[arg(long, default_value_t = 50)]
    prefill_token_us: u64,
    /// Cost per decoding sequence per step, microseconds.
    #[arg(long, default_value_t = 300)]
    decode_seq_us: u64,
    /// Cost of loading a LoRA adapter, milliseconds.
    #[arg(long, default_value_t = 25)]
    lora_load_ms: u64,
    /// Per-pod override, repeatable: INDEX:blocks=N,slowdown=F,max-num-seqs=N,drop=F,refuse=true,metrics=stall|error
    #[arg(long = "pod-override")]
    pod_overrides: Vec<String>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Colours only on a terminal: a test or script reading the ready line gets plain text.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let args = Args::parse();
    let overrides = args
        .pod_overrides
        .iter()
        .map(|s| parse_override(s))
        .collect::<Result<Vec<_>, _>>()?;
    let tokenizer = Arc::new(SimTokenizer::load(&args.tokenizer)?);
    let events = (!args.no_kv_events).then_some(args.events_base_port);
    let engine = EngineConfig {
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        hash_algo: args.prefix_caching_hash_algo.parse::<HashAlgo>()?,
        bytes_hashes: args.bytes_block_hashes,
        max_loras: args.max_loras,
        cost: StepCost {
            overhead: Duration::from_micros(args.step_overhead_us),
            per_prefill_token: Duration::from_micros(args.prefill_token_us),
            per_decode_seq: Duration::from_micros(args.decode_seq_us),
            lora_load: Duration::from_millis(args.lora_load_ms),
        },
    };
    // The floors assume the fleet's fastest pod: the time scale, times an override's
    // slow-down where one is below 1, each read as the pods read them.
    let fastest = overrides
        .iter()
        .filter_map(|(_, o)| o.slowdown)
        .map(slowdown_factor)
        .fold(1.0_f64, f64::min);
    let floor = FloorModel::for_engine(&engine, time_scale_factor(args.time_scale) * fastest);
    let cfg = FleetConfig {
        pods: args.pods,
        host: [127, 0, 0, 1].into(),
        base_port: args.base_port,
        events_base_port: events,
        replay_base_port: events.map(|_| args.replay_base_port),
        model: args.model,
        engine,
        time_scale: args.time_scale,
        buffer_steps: args.buffer_steps,
        layout: if args.legacy_array_events {
            EventLayout::Array
        } else {
            EventLayout::Map
        },
        overrides,
        request_log: match &args.request_log {
            Some(path) => {
                Some(Arc::new(RequestLog::create(path, floor).map_err(|e| {
                    format!("--request-log {}: {e}", path.display())
                })?))
            }
            None => None,
        },
    };
    let pods = start_fleet_with_topic(cfg, tokenizer, &args.kv_events_topic).await?;
    for (i, p) in pods.iter().enumerate() {
        let events = p.pod.publisher.as_ref();
        tracing::info!(
            pod = i,
            http = %p.http,
            events = %events.map(|e| e.endpoint.as_str()).unwrap_or("-"),
            replay = %events.and_then(|e| e.replay_endpoint.as_deref()).unwrap_or("-"),
            "simulated vLLM pod ready"
        );
    }
    tokio::signal::ctrl_c().await?;
    Ok(())
}
