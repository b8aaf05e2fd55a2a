//! Scheduler decision time (p50/p99) for 8, 64 and 256 pods with a 32k-token prompt,
//! excluding tokenization: the prefix index is pre-populated from KV-event batches, the
//! prompts are token ids already. One decision = `Scheduler::pick_deferred` as the ext-proc
//! path calls it: reading metrics and in-flight counts, the prefix match (keying the prompt's
//! blocks included), every scorer and the picker. The routing record it returns (the
//! speculative entries written after the reply is sent) is applied outside the timed part and
//! timed on its own ("record after reply"); `pick` (decision and record back to back) is
//! timed too. The index's own `match_prefix` is timed alone, to separate index cost from
//! scheduler overhead.
//!
//! Run: `cargo bench --bench scheduler` (prints a table; goal p99 ≤ 50 µs at 64 pods);
//! `KVPICK_BENCH_PODS=64` limits it to one pool size.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use kvpick::endpoints::{Datastore, Endpoint, EndpointState, PodId};
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex, PromptKeys};
use kvpick::kvevents::{BlockExtra, BlockStored, EngineHash, EventBatch, KvEvent, Tier};
use kvpick::scheduling::{
    ConfiguredScheduler, MetricsSource, Scheduler, SchedulerConfig, SchedulerDeps,
    SchedulingRequest,
};
use kvpick::scrape::{PodMetrics, ScrapeStatus};

const BLOCK: usize = 16;
const PROMPT_TOKENS: usize = 32 * 1024;
/// The shared part of every prompt (a long system prompt / document); the rest is a
/// per-request question.
const SHARED_TOKENS: usize = 30 * 1024;
const DISTINCT_PROMPTS: usize = 64;
const ITERATIONS: usize = 5_000;

/// Metrics that never go stale during the run (the bench measures scheduling, not scraping):
/// published snapshots read under one lock, as `MetricsStore` does, stamped an hour ahead so
/// their age stays 0.
struct Frozen(RwLock<HashMap<PodId, Arc<ScrapeStatus>>>);

impl MetricsSource for Frozen {
    fn status(&self, pod: PodId) -> Arc<ScrapeStatus> {
        self.statuses(&[pod]).pop().unwrap_or_default()
    }

    fn statuses(&self, pods: &[PodId]) -> Vec<Arc<ScrapeStatus>> {
        let map = self.0.read().expect("lock");
        pods.iter()
            .map(|pod| map.get(pod).cloned().unwrap_or_default())
            .collect()
    }
}

/// A fresh copy of `template` as a new request would arrive: its own [`PromptKeys`], keyed
/// ahead by `warm` as the ext-proc path does on the preparing thread (`Scheduler::warm_keys`),
/// or not keyed at all. Built outside the timed regions.
fn fresh(template: &SchedulingRequest, warm: Option<&dyn Scheduler>) -> SchedulingRequest {
    let tokens = template
        .prompt
        .keyable_tokens()
        .unwrap_or_default()
        .to_vec();
    let context = template
        .prompt
        .context()
        .cloned()
        .unwrap_or_else(|| KeyContext::model("m"));
    let keys = PromptKeys::exact(context, tokens);
    if let Some(scheduler) = warm {
        scheduler.warm_keys(&keys);
    }
    SchedulingRequest {
        prompt: Arc::new(keys),
        ..template.clone()
    }
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|t| seed.wrapping_mul(100_003) ^ t)
        .collect()
}

fn stored(tokens: &[u32], hash_base: u64) -> EventBatch {
    let blocks = tokens.len() / BLOCK;
    EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks)
                .map(|b| EngineHash(hash_base + b as u64))
                .collect(),
            parent_block_hash: None,
            token_ids: tokens[..blocks * BLOCK].to_vec(),
            block_size: Some(BLOCK as u32),
            tier: Tier::Gpu,
            extra: vec![BlockExtra::default(); blocks],
            ..BlockStored::default()
        })],
        dp_rank: Some(0),
    }
}

struct Setup {
    pods: Vec<Arc<EndpointState>>,
    index: Arc<PrefixIndex>,
    metrics: Arc<Frozen>,
    requests: Vec<SchedulingRequest>,
}

fn setup(n: usize, config: IndexConfig) -> Setup {
    let store = Datastore::new();
    store.set_endpoints(
        (0..n)
            .map(|i| {
                Endpoint::new(
                    format!("10.{}.{}.1:8000", i / 250, i % 250)
                        .parse()
                        .expect("addr"),
                )
            })
            .collect(),
    );
    let pods = store.snapshot().endpoints.clone();
    let index = Arc::new(PrefixIndex::new(config));
    let shared = tokens(1, SHARED_TOKENS);
    let mut statuses = HashMap::new();
    for (i, pod) in pods.iter().enumerate() {
        // A quarter of the pods hold the whole shared prefix, others 3/4, 1/2, 1/4 of it.
        let held = SHARED_TOKENS * (4 - i % 4) / 4;
        index.apply_batch(pod.id(), "m", &stored(&shared[..held], (i as u64) << 32));
        // Plus unrelated blocks, as a busy pod would have.
        index.apply_batch(
            pod.id(),
            "m",
            &stored(
                &tokens(1000 + i as u32, 8 * 1024),
                ((i as u64) << 32) + (1 << 24),
            ),
        );
        statuses.insert(
            pod.id(),
            Arc::new(ScrapeStatus {
                metrics: Some(Arc::new(PodMetrics {
                    waiting: (i % 5) as f64,
                    running: (i % 7) as f64 * 4.0,
                    kv_usage: (i % 10) as f64 / 12.0,
                    ..PodMetrics::default()
                })),
                fetched_at: Some(Instant::now() + Duration::from_secs(3600)),
                ..ScrapeStatus::default()
            }),
        );
    }
    let requests = (0..DISTINCT_PROMPTS)
        .map(|q| {
            let mut prompt = shared.clone();
            prompt.extend(tokens(50_000 + q as u32, PROMPT_TOKENS - SHARED_TOKENS));
            SchedulingRequest {
                model: Some("m".into()),
                target_model: Some("m".into()),
                body_bytes: PROMPT_TOKENS * 4,
                prompt: Arc::new(PromptKeys::exact(KeyContext::model("m"), prompt)),
                ..SchedulingRequest::default()
            }
        })
        .collect();
    Setup {
        pods,
        index,
        metrics: Arc::new(Frozen(RwLock::new(statuses))),
        requests,
    }
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| {
        samples
            .get(((samples.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or_default()
    };
    (at(0.50), at(0.99))
}

/// Times `run` over what `make` built for it (untimed), after a warm-up.
fn measure<T>(
    mut make: impl FnMut(usize) -> T,
    mut run: impl FnMut(usize, T),
) -> (Duration, Duration) {
    for i in 0..ITERATIONS / 10 {
        run(i, make(i));
    }
    let samples = (0..ITERATIONS)
        .map(|i| {
            let input = make(i);
            let started = Instant::now();
            run(i, input);
            started.elapsed()
        })
        .collect();
    percentiles(samples)
}

/// One scrape's parse and extract of a real vLLM engine's `/metrics` (55 KB, 485 samples):
/// every line, against only the lines scheduling reads (what the scraper does).
fn scrape_parse() {
    use kvpick::scrape::EngineKind;
    use kvpick::scrape::prom_text::{parse, parse_wanted};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/vllm-0.32-kv-events/metrics-load.txt");
    let Ok(text) = std::fs::read_to_string(&path) else {
        println!("scrape parse: {} not found, skipped", path.display());
        return;
    };
    println!(
        "scrape parse + extract, real vLLM /metrics ({} bytes)",
        text.len()
    );
    let (a50, a99) = measure(
        |_| (),
        |_, ()| {
            black_box(EngineKind::Vllm.extract(&parse(&text).samples).ok());
        },
    );
    println!("       {:<26} {a50:>10.1?} {a99:>10.1?}", "every line");
    let (w50, w99) = measure(
        |_| (),
        |_, ()| {
            let read = parse_wanted(&text, EngineKind::Vllm.read_names());
            black_box(EngineKind::Vllm.extract(&read.samples).ok());
        },
    );
    println!(
        "       {:<26} {w50:>10.1?} {w99:>10.1?}",
        "the lines it reads"
    );
}

fn main() {
    scrape_parse();
    println!(
        "scheduler decision time, {PROMPT_TOKENS}-token prompt ({SHARED_TOKENS} shared), {ITERATIONS} picks"
    );
    println!("{:>5}  {:<26} {:>10} {:>10}", "pods", "what", "p50", "p99");
    // `KVPICK_BENCH_PODS=64` runs one pool size (e.g. under `perf record`).
    let only: Option<usize> = std::env::var("KVPICK_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok());
    for n in [8, 64, 256]
        .into_iter()
        .filter(|n| only.is_none_or(|o| o == *n))
    {
        let s = setup(n, IndexConfig::default());
        let ids: Vec<PodId> = s.pods.iter().map(|p| p.id()).collect();
        let (p50, p99) = measure(
            |i| fresh(&s.requests[i % s.requests.len()], None),
            |_, r| {
                black_box(s.index.lookup(&r.prompt, &ids));
            },
        );
        println!(
            "{n:>5}  {:<26} {:>10.1?} {:>10.1?}",
            "index lookup (keying)", p50, p99
        );
        let mut load_only = SchedulerConfig::gie_default();
        load_only.scorers.retain(|w| !w.scorer.needs_prefix());
        // Warmed: the keys computed ahead, as the ext-proc path does with the tokens; else
        // the decision keys the prompt itself.
        for (name, config, warmed) in [
            ("queue+kv pick (no prefix)", load_only, true),
            ("gie-default decision", SchedulerConfig::gie_default(), true),
            (
                "  same, keying inside",
                SchedulerConfig::gie_default(),
                false,
            ),
            (
                "recommended decision",
                SchedulerConfig::kvpick_recommended(),
                true,
            ),
            (
                "  same, keying inside",
                SchedulerConfig::kvpick_recommended(),
                false,
            ),
        ] {
            let deps = SchedulerDeps {
                index: Arc::clone(&s.index),
                metrics: s.metrics.clone(),
            };
            let scheduler = ConfiguredScheduler::new(config, deps, 0);
            // The decision as the ext-proc path times it, then its record, timed apart.
            let mut decisions = Vec::with_capacity(ITERATIONS);
            let mut records = Vec::with_capacity(ITERATIONS);
            let warm = warmed.then_some(&scheduler as &dyn Scheduler);
            for i in 0..ITERATIONS + ITERATIONS / 10 {
                let r = fresh(&s.requests[i % s.requests.len()], warm);
                let started = Instant::now();
                let decided = scheduler.pick_deferred(&r, &s.pods).ok();
                let decided_at = Instant::now();
                if let Some((pick, record)) = decided {
                    black_box(pick);
                    record.apply();
                }
                if i >= ITERATIONS / 10 {
                    decisions.push(decided_at - started);
                    records.push(decided_at.elapsed());
                }
            }
            let (d50, d99) = percentiles(decisions);
            let (r50, r99) = percentiles(records);
            println!("{n:>5}  {name:<26} {d50:>10.1?} {d99:>10.1?}");
            println!(
                "{n:>5}  {:<26} {r50:>10.1?} {r99:>10.1?}",
                "  then record after reply"
            );
            let (p50, p99) = measure(
                |i| fresh(&s.requests[i % s.requests.len()], warm),
                |_, r| {
                    black_box(scheduler.pick(&r, &s.pods).ok());
                },
            );
            println!(
                "{n:>5}  {:<26} {p50:>10.1?} {p99:>10.1?}",
                "  pick (both back to back)"
            );
        }
        {
            // The same decision with walks stepping block by block (no gallop), for the ratio.
            let s = setup(
                n,
                IndexConfig {
                    gallop: false,
                    ..IndexConfig::default()
                },
            );
            let scheduler = ConfiguredScheduler::new(
                SchedulerConfig::gie_default(),
                SchedulerDeps {
                    index: Arc::clone(&s.index),
                    metrics: s.metrics.clone(),
                },
                0,
            );
            let mut decisions = Vec::with_capacity(ITERATIONS);
            for i in 0..ITERATIONS + ITERATIONS / 10 {
                let r = fresh(&s.requests[i % s.requests.len()], Some(&scheduler));
                let started = Instant::now();
                let decided = scheduler.pick_deferred(&r, &s.pods).ok();
                let took = started.elapsed();
                if let Some((pick, record)) = decided {
                    black_box(pick);
                    record.apply();
                }
                if i >= ITERATIONS / 10 {
                    decisions.push(took);
                }
            }
            let (d50, d99) = percentiles(decisions);
            println!(
                "{n:>5}  {:<26} {d50:>10.1?} {d99:>10.1?}",
                "gie-default, no gallop"
            );
        }
        // Last: recording to every pod adds speculative holders that slow later matches.
        let (p50, p99) = measure(
            |i| fresh(&s.requests[i % s.requests.len()], None),
            |i, r| s.index.record_routed(ids[i % ids.len()], &r.prompt, None),
        );
        println!(
            "{n:>5}  {:<26} {:>10.1?} {:>10.1?}",
            "index record_routed", p50, p99
        );
    }
}
