//! The pod's `/metrics`, under vLLM's own metric names and labels (DESIGN §4), so scrapers
//! written for vLLM (GIE, kvpick's `scrape/`) read the simulator unchanged.
//!
//! Each pod owns one `prometheus::Registry` (one pod = one vLLM process). Gauges are refreshed
//! from [`EngineStats`] after every engine step; counters advance by the delta since the last
//! refresh. Metric handles are internally synchronised, so the HTTP task may render while the
//! engine task updates.

use std::sync::Mutex;

use prometheus::{Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, Opts, Registry};

use super::engine::EngineStats;

/// TTFT buckets of vLLM 0.32 (from the real capture).
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Inter-token latency buckets of vLLM 0.32 (from the real capture).
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// The simulator's metrics for one pod.
#[derive(Debug)]
pub struct SimMetrics {
    waiting: Gauge,
    running: Gauge,
    kv_usage: Gauge,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    preemptions: IntCounter,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    lora_info: Option<GaugeVec>,
    max_loras: usize,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    event_drops: IntCounter,
    start_time: Gauge,
    last: Mutex<EngineStats>,
}

fn opts(name: &str, help: &str, model: &str) -> Opts {
    Opts::new(name, help)
        .const_label("engine", "0")
        .const_label("model_name", model)
}

fn hist(name: &str, help: &str, model: &str, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::new(name, help)
        .const_label("engine", "0")
        .const_label("model_name", model)
        .buckets(buckets.to_vec())
}

impl SimMetrics {
    /// Creates the metrics and registers them into `registry`.
    pub fn new(
        registry: &Registry,
        model: &str,
        block_size: usize,
        num_gpu_blocks: usize,
        hash_algo: &str,
        max_loras: usize,
    ) -> Result<Self, prometheus::Error> {
        let waiting = Gauge::with_opts(opts(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            model,
        ))?;
        let running = Gauge::with_opts(opts(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            model,
        ))?;
        let kv_usage = Gauge::with_opts(opts(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            model,
        ))?;
        let prefix_queries = IntCounter::with_opts(opts(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            model,
        ))?;
        let prefix_hits = IntCounter::with_opts(opts(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            model,
        ))?;
        let preemptions = IntCounter::with_opts(opts(
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            model,
        ))?;
        let prompt_tokens = IntCounter::with_opts(opts(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            model,
        ))?;
        let generation_tokens = IntCounter::with_opts(opts(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            model,
        ))?;
        let cache_info = Gauge::with_opts(
            opts(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                model,
            )
            .const_label("block_size", block_size.to_string())
            .const_label("num_gpu_blocks", num_gpu_blocks.to_string())
            .const_label("enable_prefix_caching", "True")
            .const_label("prefix_caching_hash_algo", hash_algo),
        )?;
        cache_info.set(1.0);
        let lora_info = if max_loras > 0 {
            let g = GaugeVec::new(
                Opts::new("vllm:lora_requests_info", "Running stats on lora requests."),
                &["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )?;
            registry.register(Box::new(g.clone()))?;
            Some(g)
        } else {
            None
        };
        let ttft = Histogram::with_opts(hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model,
            &TTFT_BUCKETS,
        ))?;
        let itl = Histogram::with_opts(hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            model,
            &ITL_BUCKETS,
        ))?;
        let e2e = Histogram::with_opts(hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            model,
            &TTFT_BUCKETS,
        ))?;
        // prometheus_client's process collector in vLLM exports it, unlabelled; a scraper
        // (kvpick) tells a restarted engine by its change.
        let start_time = Gauge::with_opts(Opts::new(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
        ))?;
        let event_drops = IntCounter::with_opts(Opts::new(
            "kvpick_sim_kv_event_batches_dropped_total",
            "KV-event batches dropped because the publisher queue was full (simulator only).",
        ))?;
        for c in [
            &event_drops,
            &prefix_queries,
            &prefix_hits,
            &preemptions,
            &prompt_tokens,
            &generation_tokens,
        ] {
            registry.register(Box::new(c.clone()))?;
        }
        for g in [&waiting, &running, &kv_usage, &cache_info, &start_time] {
            registry.register(Box::new(g.clone()))?;
        }
        for h in [&ttft, &itl, &e2e] {
            registry.register(Box::new(h.clone()))?;
        }
        Ok(Self {
            waiting,
            running,
            kv_usage,
            prefix_queries,
            prefix_hits,
            preemptions,
            prompt_tokens,
            generation_tokens,
            lora_info,
            max_loras,
            ttft,
            itl,
            e2e,
            event_drops,
            start_time,
            last: Mutex::new(EngineStats::default()),
        })
    }

    /// The simulated process started (or restarted) at `unix_now`: a real engine's restart is
    /// a new process, so its start time changes and its counters start again from 0.
    /// NOTE: histograms keep their samples (the prometheus crate cannot reset one); kvpick
    /// and the benchmarks read none of them across a restart.
    pub fn started(&self, unix_now: f64) {
        self.start_time.set(unix_now);
        for c in [
            &self.prefix_queries,
            &self.prefix_hits,
            &self.preemptions,
            &self.prompt_tokens,
            &self.generation_tokens,
        ] {
            c.reset();
        }
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = EngineStats::default();
    }

    /// Refreshes gauges and advances counters from the engine's cumulative stats.
    pub fn update(&self, stats: &EngineStats, unix_now: f64) {
        self.waiting.set(stats.waiting as f64);
        self.running.set(stats.running as f64);
        self.kv_usage.set(stats.kv_usage);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        // After an engine restart the cumulative stats restart at 0: counters never go back.
        self.prefix_queries
            .inc_by(stats.prefix_queries.saturating_sub(last.prefix_queries));
        self.prefix_hits
            .inc_by(stats.prefix_hits.saturating_sub(last.prefix_hits));
        self.preemptions
            .inc_by(stats.preemptions.saturating_sub(last.preemptions));
        if let Some(lora) = &self.lora_info {
            if stats.running_loras != last.running_loras
                || stats.waiting_loras != last.waiting_loras
            {
                lora.reset();
            }
            lora.with_label_values(&[
                self.max_loras.to_string(),
                stats.running_loras.join(","),
                stats.waiting_loras.join(","),
            ])
            .set(unix_now);
        }
        *last = stats.clone();
    }

    /// Records computed prompt tokens and generated tokens of one step.
    pub fn add_tokens(&self, prompt: usize, generated: usize) {
        self.prompt_tokens.inc_by(prompt as u64);
        self.generation_tokens.inc_by(generated as u64);
    }

    /// Counts a KV-event batch the publisher queue could not take.
    pub fn event_batch_dropped(&self) {
        self.event_drops.inc();
    }

    /// Records a time to first token.
    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    /// Records an inter-token latency.
    pub fn observe_itl(&self, seconds: f64) {
        self.itl.observe(seconds);
    }

    /// Records an end-to-end latency.
    pub fn observe_e2e(&self, seconds: f64) {
        self.e2e.observe(seconds);
    }
}

/// Renders a registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    render_named(registry, &[])
}

/// Renders the metrics of `registry` named in `names` (all of them when `names` is empty), as
/// prometheus_client's restricted registry does for vLLM's `/metrics/?name[]=…`.
/// NOTE: matched by family name, which is the sample name for gauges and counters here (the
/// prometheus crate's counters carry `_total` in the family name); a histogram's samples
/// (`_bucket`, `_sum`, `_count`) are not matched one by one as prometheus_client does.
pub fn render_named(registry: &Registry, names: &[&str]) -> String {
    let mut families = registry.gather();
    if !names.is_empty() {
        families.retain(|family| names.contains(&family.name()));
    }
    let mut out = String::new();
    let encoder = prometheus::TextEncoder::new();
    let _ = encoder.encode_utf8(&families, &mut out);
    out
}
