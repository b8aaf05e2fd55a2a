//! The configured scheduler end to end on hand-built pod states: a real prefix index fed by
//! KV-event batches, metrics through the `MetricsSource` seam, real in-flight counters.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::config::picker_config::load;
use kvpick::endpoints::{Datastore, Endpoint, EndpointState, PodId};
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex, PromptKeys};
use kvpick::kvevents::{
    BlockExtra, BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Tier,
};
use kvpick::scheduling::{
    ConfiguredScheduler, FilterKind, FilterSpec, ScheduleError, Scheduler, SchedulerConfig,
    SchedulerDeps, SchedulingRequest,
};
use kvpick::tokenize::{ApproximatePrompt, ApproximateReason, PromptTokens};

use crate::support;

use support::metrics::FakeMetrics;

const BLOCK: usize = 16;

struct Fixture {
    pods: Vec<Arc<EndpointState>>,
    index: Arc<PrefixIndex>,
    metrics: Arc<FakeMetrics>,
}

impl Fixture {
    fn new(n: usize) -> Self {
        Self::with_labels(n, |_| Vec::new())
    }

    fn with_labels(n: usize, labels: impl Fn(usize) -> Vec<(&'static str, &'static str)>) -> Self {
        let store = Datastore::new();
        store.set_endpoints(
            (0..n)
                .map(|i| {
                    let mut e =
                        Endpoint::new(format!("10.1.0.{}:8000", i + 1).parse().expect("addr"));
                    for (k, v) in labels(i) {
                        e.labels.insert(k.to_owned(), v.to_owned());
                    }
                    e
                })
                .collect(),
        );
        let metrics = Arc::new(FakeMetrics::default());
        let pods = store.snapshot().endpoints.clone();
        for p in &pods {
            metrics.set(p.id(), 0.0, 0.0, 0.1);
        }
        Self {
            pods,
            index: Arc::new(PrefixIndex::new(IndexConfig::default())),
            metrics,
        }
    }

    fn scheduler(&self, config: SchedulerConfig, max_fallbacks: usize) -> ConfiguredScheduler {
        let deps = SchedulerDeps {
            index: Arc::clone(&self.index),
            metrics: self.metrics.clone(),
        };
        ConfiguredScheduler::new(config, deps, max_fallbacks)
    }

    fn id(&self, i: usize) -> PodId {
        self.pods[i].id()
    }

    /// Pod `i` reports (via a KV event) that it holds the full blocks of `tokens`.
    fn holds(&self, i: usize, tokens: &[u32]) {
        self.holds_in(i, tokens, Tier::Gpu);
    }

    fn holds_in(&self, i: usize, tokens: &[u32], tier: Tier) {
        let blocks = tokens.len() / BLOCK;
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: (0..blocks)
                    .map(|b| EngineHash(0xabc0_0000 + b as u64))
                    .collect(),
                parent_block_hash: None,
                token_ids: tokens[..blocks * BLOCK].to_vec(),
                block_size: Some(BLOCK as u32),
                tier,
                extra: vec![BlockExtra::default(); blocks],
                ..BlockStored::default()
            })],
            dp_rank: Some(0),
        };
        self.index.apply_batch(self.id(i), "m", &batch);
    }
}

impl Fixture {
    /// Pod `i` reports (via a KV event) that it evicted the blocks [`Fixture::holds`] stored
    /// for `tokens`.
    fn evicts(&self, i: usize, tokens: &[u32]) {
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: (0..tokens.len() / BLOCK)
                    .map(|b| EngineHash(0xabc0_0000 + b as u64))
                    .collect(),
                tier: Tier::Gpu,
                group_idx: None,
            })],
            dp_rank: Some(0),
        };
        self.index.apply_batch(self.id(i), "m", &batch);
    }
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|t| seed.wrapping_mul(100_003) ^ t)
        .collect()
}

fn exact(tokens: Vec<u32>) -> SchedulingRequest {
    SchedulingRequest {
        model: Some("m".into()),
        target_model: Some("m".into()),
        prompt: Arc::new(PromptKeys::exact(KeyContext::model("m"), tokens)),
        ..SchedulingRequest::default()
    }
}

#[test]
fn shared_prefix_lands_on_the_pod_that_holds_it() {
    let f = Fixture::new(4);
    let system = tokens(7, 2000);
    f.holds(2, &system);
    let scheduler = f.scheduler(SchedulerConfig::gie_default(), 0);
    for q in 0..20 {
        let mut prompt = system.clone();
        prompt.extend(tokens(1000 + q, 120));
        let pick = scheduler.pick(&exact(prompt), &f.pods).expect("pick");
        assert_eq!(pick.primary, f.id(2), "request {q}");
        assert!(pick.fallbacks.is_empty());
    }
    // A different prefix is not attracted to pod 2.
    let cold: HashSet<PodId> = (0..40)
        .map(|q| {
            scheduler
                .pick(&exact(tokens(5000 + q, 300)), &f.pods)
                .expect("pick")
                .primary
        })
        .collect();
    assert!(
        cold.len() > 1,
        "cold prefixes spread over equal pods: {cold:?}"
    );
}

/// The recommended profile remembers where it routed a prefix: once every pod has evicted it,
/// its next request goes back there rather than wherever is a little less busy at that
/// instant (a new prefix under the same load goes to the idler pod), so a prefix that keeps
/// being evicted does not spread its misses over the whole fleet.
#[test]
fn a_prefix_evicted_everywhere_returns_to_the_pod_it_was_routed_to() {
    let f = Fixture::new(2);
    let scheduler = f.scheduler(SchedulerConfig::kvpick_recommended(), 0);
    let group = |question: u32| {
        let mut prompt = tokens(11, 1_600);
        prompt.extend(tokens(question, 64));
        prompt
    };
    let first = scheduler.pick(&exact(group(1)), &f.pods).expect("pick");
    let home = f
        .pods
        .iter()
        .position(|p| p.id() == first.primary)
        .expect("a pod");
    let other = 1 - home;
    // The engine stores the prompt, then evicts all of it: nobody holds any of it.
    f.holds(home, &group(1));
    f.evicts(home, &group(1));
    let held = scheduler.explain(&exact(group(2)), &f.pods);
    assert!(
        held.candidates.iter().all(|c| c.cached_tokens == 0.0),
        "{held:?}"
    );
    // Home is the busier pod now.
    let _busy = f.pods[home].in_flight.start();
    let new = scheduler.explain(&exact(tokens(12, 1_664)), &f.pods);
    assert_eq!(
        new.pick.as_ref().and_then(|p| p.first()),
        Some(&f.id(other).to_string()),
        "a new prefix goes to the idler pod: {new:?}"
    );
    let back = scheduler.pick(&exact(group(2)), &f.pods).expect("pick");
    assert_eq!(back.primary, f.id(home), "the evicted prefix goes home");
}

fn cost_only() -> SchedulerConfig {
    load(Some(
        "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: saturation-filter
  parameters: {queueDepthThreshold: 100}
- type: ttft-cost-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: ttft-cost-scorer
  - pluginRef: max-score-picker
",
    ))
    .expect("config")
    .scheduler
}

#[test]
fn cost_scorer_leaves_the_cache_owner_when_its_queue_costs_more_than_the_cache_saves() {
    let f = Fixture::new(2);
    let shared = tokens(3, 9_000);
    f.holds(0, &shared);
    let scheduler = f.scheduler(cost_only(), 0);
    // Each request has its own 1k-token question (a repeated one would be cached too).
    let mut question = 0;
    let mut request = || {
        question += 1;
        let mut prompt = shared.clone();
        prompt.extend(tokens(77 + question, 1_000));
        exact(prompt)
    };
    // 1k uncached tokens (100 ms) + 8 queued (800 ms) < 10k cold tokens (1000 ms).
    f.metrics.set(f.id(0), 8.0, 4.0, 0.3);
    assert_eq!(
        scheduler.pick(&request(), &f.pods).expect("pick").primary,
        f.id(0)
    );
    // 10 queued: 1100 ms > 1000 ms.
    f.metrics.set(f.id(0), 10.0, 4.0, 0.3);
    assert_eq!(
        scheduler.pick(&request(), &f.pods).expect("pick").primary,
        f.id(1)
    );
    // Between scrapes: the scrape says 8 waiting + 4 running, but kvpick has 15 in flight
    // there, so 3 more are queued than the scrape shows.
    f.metrics.set(f.id(0), 8.0, 4.0, 0.3);
    let guards: Vec<_> = (0..15).map(|_| f.pods[0].in_flight.start()).collect();
    assert_eq!(
        scheduler.pick(&request(), &f.pods).expect("pick").primary,
        f.id(1)
    );
    drop(guards);
    // Pod 1 (no KV events) has learned the shared prefix from the requests routed to it, so
    // it is now both cached and idle: it keeps winning over the queued pod 0.
    let explanation = scheduler.explain(&request(), &f.pods);
    assert!(
        explanation.candidates[1].cached_tokens >= 8_992.0,
        "{explanation:?}"
    );
    assert_eq!(
        scheduler.pick(&request(), &f.pods).expect("pick").primary,
        f.id(1)
    );
}

/// The recommended profile's scorer behind a `saturation-filter` instead of its own
/// fresh-metrics filter.
fn recommended_behind_saturation_filter() -> SchedulerConfig {
    let mut config = SchedulerConfig::kvpick_recommended();
    config.filters = vec![FilterSpec {
        name: "saturation-filter".to_owned(),
        plugin_type: "saturation-filter",
        filter: FilterKind::Saturation {
            queue_threshold: None,
            kv_threshold: None,
        },
    }];
    config
}

#[test]
fn stale_failing_and_saturated_pods_get_no_traffic_while_others_can() {
    let f = Fixture::new(4);
    let scheduler = f.scheduler(recommended_behind_saturation_filter(), 0);
    f.metrics.set(f.id(0), 6.0, 1.0, 0.2); // over the queue threshold
    f.metrics.set_at(
        f.id(1),
        0.0,
        0.0,
        0.0,
        Instant::now() - Duration::from_secs(2),
    ); // stale
    f.metrics.set(f.id(2), 0.0, 1.0, 0.95); // KV nearly full
    for q in 0..30 {
        let pick = scheduler
            .pick(&exact(tokens(q, 64)), &f.pods)
            .expect("pick");
        assert_eq!(pick.primary, f.id(3));
    }
    let explanation = scheduler.explain(&exact(tokens(1, 64)), &f.pods);
    assert_eq!(explanation.filters.len(), 1);
    let mut removed = explanation.filters[0].removed.clone();
    removed.sort();
    assert_eq!(
        removed,
        vec![
            f.id(0).to_string(),
            f.id(1).to_string(),
            f.id(2).to_string()
        ]
    );
    assert_eq!(explanation.pick, Some(vec![f.id(3).to_string()]));
    assert_eq!(explanation.candidates.len(), 1);
    assert!(explanation.candidates[0].saturation < 1.0);
    // When every pod is saturated the filter steps aside: requests still get a pod.
    f.metrics.set(f.id(3), 9.0, 1.0, 0.2);
    assert!(scheduler.pick(&exact(tokens(9, 64)), &f.pods).is_ok());
    assert!(scheduler.explain(&exact(tokens(9, 64)), &f.pods).filters[0].kept_all);
    // And the saturation detector sees a saturated pool.
    assert!(scheduler.saturation_detector().pool(&f.pods).saturated());
}

#[test]
fn approximate_prompts_follow_routing_history() {
    let f = Fixture::new(4);
    let scheduler = f.scheduler(SchedulerConfig::gie_default(), 0);
    let system = "You are a helpful assistant. ".repeat(40);
    let request = |question: &str| SchedulingRequest {
        prompt: Arc::new(PromptKeys::new(
            PromptTokens::Approximate(ApproximatePrompt {
                text: format!("{system}{question}"),
                reason: ApproximateReason::NoTokenizer,
            }),
            Some(KeyContext::model("m")),
        )),
        ..SchedulingRequest::default()
    };
    let first = scheduler
        .pick(&request("what is rust?"), &f.pods)
        .expect("pick")
        .primary;
    for q in 0..10 {
        let pick = scheduler
            .pick(&request(&format!("question {q}")), &f.pods)
            .expect("pick");
        assert_eq!(pick.primary, first, "same system prompt, same pod");
    }
    let explanation = scheduler.explain(&request("x"), &f.pods);
    let holder = explanation
        .candidates
        .iter()
        .find(|c| c.address == first.to_string())
        .expect("candidate");
    assert!(holder.scores["prefix-cache-scorer"] > 0.9, "{holder:?}");
    assert!(holder.cached_tokens > 200.0, "{holder:?}");
}

#[test]
fn fallbacks_are_ordered_and_bounded() {
    let f = Fixture::new(5);
    for (i, waiting) in [4.0, 0.0, 3.0, 1.0, 2.0].into_iter().enumerate() {
        f.metrics.set(f.id(i), waiting, 0.0, 0.1);
    }
    let pick = f
        .scheduler(SchedulerConfig::gie_default(), 3)
        .pick(&exact(tokens(1, 32)), &f.pods)
        .expect("pick");
    assert_eq!(pick.primary, f.id(1));
    assert_eq!(pick.fallbacks, vec![f.id(3), f.id(4), f.id(2)]);
    let mut capped = SchedulerConfig::gie_default();
    capped.picker = kvpick::scheduling::PickerSpec::MaxScore {
        max_endpoints: Some(2),
    };
    let pick = f
        .scheduler(capped, 3)
        .pick(&exact(tokens(1, 32)), &f.pods)
        .expect("pick");
    assert_eq!(
        pick.fallbacks,
        vec![f.id(3)],
        "maxNumOfEndpoints 2 = primary + 1"
    );
    assert_eq!(
        f.scheduler(SchedulerConfig::gie_default(), 3)
            .pick(&exact(tokens(1, 32)), &[]),
        Err(ScheduleError::NoCandidates)
    );
}

#[test]
fn role_selector_and_session_affinity() {
    let f = Fixture::with_labels(4, |i| {
        if i % 2 == 0 {
            vec![("role", "decode")]
        } else {
            vec![("role", "prefill")]
        }
    });
    let config = load(Some(
        "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: by-label-selector
  parameters: {matchLabels: {role: decode}}
- type: session-affinity-scorer
- type: in-flight-requests-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: by-label-selector
  - pluginRef: session-affinity-scorer
    weight: 5
  - pluginRef: in-flight-requests-scorer
  - pluginRef: max-score-picker
",
    ))
    .expect("config")
    .scheduler;
    let scheduler = f.scheduler(config, 0);
    let with_session = |s: &str| SchedulingRequest {
        session_id: Some(s.to_owned()),
        ..exact(tokens(1, 32))
    };
    let mut guards = Vec::new();
    let first = scheduler
        .pick(&with_session("alice"), &f.pods)
        .expect("pick")
        .primary;
    assert!(first == f.id(0) || first == f.id(2), "decode pods only");
    // Load the session's pod: affinity (5) still beats in-flight (1).
    let index = if first == f.id(0) { 0 } else { 2 };
    guards.extend((0..3).map(|_| f.pods[index].in_flight.start()));
    for _ in 0..5 {
        assert_eq!(
            scheduler
                .pick(&with_session("alice"), &f.pods)
                .expect("pick")
                .primary,
            first
        );
    }
    // A new session goes to the idle decode pod.
    let other = scheduler
        .pick(&with_session("bob"), &f.pods)
        .expect("pick")
        .primary;
    assert_ne!(other, first);
    // Only prefill pods: the selector leaves nothing.
    assert_eq!(
        scheduler.pick(
            &with_session("carol"),
            &[Arc::clone(&f.pods[1]), Arc::clone(&f.pods[3])]
        ),
        Err(ScheduleError::NoCandidates)
    );
    drop(guards);
}

#[test]
fn explain_does_not_record() {
    let f = Fixture::new(3);
    let mut config = SchedulerConfig::gie_default();
    config.scorers.push(kvpick::scheduling::WeightedScorer {
        name: "session".into(),
        plugin_type: "session-affinity-scorer",
        scorer: kvpick::scheduling::ScorerSpec::SessionAffinity { max_sessions: 16 },
        weight: 1.0,
    });
    let scheduler = f.scheduler(config, 0);
    let request = SchedulingRequest {
        session_id: Some("s".into()),
        ..exact(tokens(4, 64))
    };
    let before = scheduler.explain(&request, &f.pods);
    assert!(before.candidates.iter().all(|c| c.scores["session"] == 0.0));
    assert_eq!(before.candidates.len(), 3);
    assert_eq!(
        scheduler
            .explain(&request, &f.pods)
            .candidates
            .iter()
            .map(|c| c.scores["session"])
            .sum::<f64>(),
        0.0
    );
    let picked = scheduler.pick(&request, &f.pods).expect("pick").primary;
    let after = scheduler.explain(&request, &f.pods);
    let scored: Vec<_> = after
        .candidates
        .iter()
        .filter(|c| c.scores["session"] == 1.0)
        .map(|c| c.address.clone())
        .collect();
    assert_eq!(scored, vec![picked.to_string()]);
    let json = serde_json::to_value(&after).expect("json");
    assert!(json["candidates"][0]["scores"]["queue-scorer"].is_number());
}

#[test]
fn offloaded_blocks_save_less_than_gpu_blocks() {
    let f = Fixture::new(2);
    let shared = tokens(11, 1_600);
    f.holds_in(0, &shared, Tier::Gpu);
    f.holds_in(1, &shared, Tier::Cpu);
    let scheduler = f.scheduler(SchedulerConfig::kvpick_recommended(), 0);
    let explanation = scheduler.explain(&exact(shared.clone()), &f.pods);
    let cached: Vec<f64> = explanation
        .candidates
        .iter()
        .map(|c| c.cached_tokens)
        .collect();
    assert_eq!(cached[0], 1_600.0);
    assert!(
        (cached[1] - 1_280.0).abs() < 1e-6,
        "cpu tier weight 0.8: {cached:?}"
    );
    let ttft: Vec<f64> = explanation
        .candidates
        .iter()
        .map(|c| c.estimated_ttft_ms.expect("cost scorer configured"))
        .collect();
    assert!(ttft[0] < ttft[1], "{ttft:?}");
    assert_eq!(
        scheduler
            .pick(&exact(shared), &f.pods)
            .expect("pick")
            .primary,
        f.id(0)
    );
}

#[test]
fn a_deferred_record_lands_when_applied_or_dropped() {
    let f = Fixture::new(3);
    let scheduler = f.scheduler(SchedulerConfig::gie_default(), 0);
    let cached_on = |prompt: &[u32], pod: PodId| {
        scheduler
            .explain(&exact(prompt.to_vec()), &f.pods)
            .candidates
            .iter()
            .find(|c| c.address == pod.to_string())
            .map_or(0.0, |c| c.cached_tokens)
    };
    let prompt = tokens(21, 640);
    let (pick, record) = scheduler
        .pick_deferred(&exact(prompt.clone()), &f.pods)
        .expect("pick");
    assert!(!record.is_empty());
    // Not recorded until applied: the decision itself does not write the index.
    assert_eq!(cached_on(&prompt, pick.primary), 0.0);
    record.apply();
    assert_eq!(cached_on(&prompt, pick.primary), 640.0);
    assert_eq!(
        scheduler
            .pick(&exact(prompt), &f.pods)
            .expect("pick")
            .primary,
        pick.primary
    );
    // A record nobody applies is applied when dropped.
    let other = tokens(22, 320);
    let (pick, record) = scheduler
        .pick_deferred(&exact(other.clone()), &f.pods)
        .expect("pick");
    assert_eq!(cached_on(&other, pick.primary), 0.0);
    drop(record);
    assert_eq!(cached_on(&other, pick.primary), 320.0);
}

#[test]
fn the_lookup_and_the_record_share_one_set_of_keys() {
    let f = Fixture::new(3);
    let scheduler = f.scheduler(SchedulerConfig::gie_default(), 0);
    // Pod 1 holds the first 10 of the prompt's 100 blocks; nobody holds block 10.
    let prompt = tokens(31, 100 * BLOCK);
    f.holds(1, &prompt[..10 * BLOCK]);
    let request = exact(prompt.clone());
    let (pick, record) = scheduler.pick_deferred(&request, &f.pods).expect("pick");
    assert_eq!(pick.primary, f.id(1));
    // The lookup keyed the prompt only as far as some pod held it (and the probe batch
    // after it), not all 100 blocks.
    let keyed = request.prompt.keyed_blocks(BLOCK as u32);
    assert!((11..100).contains(&keyed), "keyed {keyed}");
    // The record keys the rest into the request's own keys (shared, not a copy).
    record.apply();
    assert_eq!(request.prompt.keyed_blocks(BLOCK as u32), 100);
    // Keys computed ahead (as the ext-proc path does on the preparing thread) are used as
    // they are: the same pick, nothing keyed again at another size.
    let warmed = exact(prompt);
    scheduler.warm_keys(&warmed.prompt);
    assert_eq!(warmed.prompt.keyed_blocks(BLOCK as u32), 100);
    let (again, record) = scheduler.pick_deferred(&warmed, &f.pods).expect("pick");
    drop(record);
    assert_eq!(again.primary, f.id(1));
}

/// llm-d's P/D config with `threshold` uncached tokens.
fn pd_config(threshold: u64) -> SchedulerConfig {
    load(Some(&format!(
        "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
- type: pd-profile-handler
  parameters: {{threshold: {threshold}}}
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: queue-scorer
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
"
    )))
    .expect("P/D config")
    .scheduler
}

/// Pods 0, 1 decode; 2, 3 prefill; 4 both; 5 unlabelled (decode-filter admits it).
fn pd_fixture() -> Fixture {
    Fixture::with_labels(6, |i| match i {
        0 | 1 => vec![("llm-d.ai/role", "decode")],
        2 | 3 => vec![("llm-d.ai/role", "prefill")],
        4 => vec![("llm-d.ai/role", "both")],
        _ => Vec::new(),
    })
}

#[test]
fn pd_handler_adds_a_prefill_pod_only_when_the_uncached_part_reaches_the_threshold() {
    let f = pd_fixture();
    let decode_side: HashSet<PodId> = [0, 1, 4, 5].map(|i| f.id(i)).into();
    let prefill_side: HashSet<PodId> = [2, 3, 4].map(|i| f.id(i)).into();
    let scheduler = f.scheduler(pd_config(100), 0);

    // Cold 400-token prompts: 400 uncached ≥ 100 → prefill elsewhere.
    for q in 0..20 {
        let pick = scheduler
            .pick(&exact(tokens(100 + q, 400)), &f.pods)
            .expect("pick");
        assert!(decode_side.contains(&pick.primary), "{pick:?}");
        let prefill = pick.prefill.expect("a prefill pod");
        assert!(prefill_side.contains(&prefill), "{pick:?}");
    }
    // Routed once, the prompt is expected cached on its decode pod (routing record): the
    // repeat prefills there.
    let repeat = tokens(11, 400);
    let first = scheduler
        .pick(&exact(repeat.clone()), &f.pods)
        .expect("pick");
    assert!(first.prefill.is_some());
    let again = scheduler.pick(&exact(repeat), &f.pods).expect("pick");
    assert_eq!(again.primary, first.primary);
    assert_eq!(again.prefill, None);

    // Decode pod 1 holds 384 of a 400-token prompt (24 full blocks): 16 uncached < 100 → it
    // serves, and prefills by itself.
    let warm = tokens(12, 400);
    f.holds(1, &warm[..384]);
    let pick = scheduler.pick(&exact(warm.clone()), &f.pods).expect("pick");
    assert_eq!(pick.primary, f.id(1));
    assert_eq!(pick.prefill, None, "below the threshold: no prefill header");

    // The same state with a lower threshold (10): 16 ≥ 10 → prefill runs; threshold 0:
    // always, even for a fully cached prompt. (Fresh fixtures: the pick above recorded
    // `warm` as routed to pod 1.)
    for (threshold, prompt) in [(10, &warm[..]), (0, &warm[..384])] {
        let g = pd_fixture();
        g.holds(1, &warm[..384]);
        let pick = g
            .scheduler(pd_config(threshold), 0)
            .pick(&exact(prompt.to_vec()), &g.pods)
            .expect("pick");
        assert_eq!(pick.primary, g.id(1), "threshold {threshold}");
        let prefill = pick.prefill.expect("prefill");
        assert!(prefill_side.contains(&prefill), "threshold {threshold}");
    }

    // The prefill profile prefers the idle prefill pod (queue-scorer).
    f.metrics.set(f.id(2), 9.0, 0.0, 0.1);
    f.metrics.set(f.id(4), 9.0, 0.0, 0.1);
    for q in 0..10 {
        let pick = scheduler
            .pick(&exact(tokens(300 + q, 400)), &f.pods)
            .expect("pick");
        assert_eq!(pick.prefill, Some(f.id(3)));
    }
}

#[test]
fn pd_without_prefill_pods_decodes_alone_and_explain_shows_both_profiles() {
    // Only decode-role pods: the prefill profile finds no candidate; decode serves alone.
    let decode_only = Fixture::with_labels(2, |_| vec![("llm-d.ai/role", "decode")]);
    let pick = decode_only
        .scheduler(pd_config(0), 0)
        .pick(&exact(tokens(21, 200)), &decode_only.pods)
        .expect("decode still picks");
    assert_eq!(pick.prefill, None);

    let f = pd_fixture();
    let registry = prometheus::Registry::new();
    let scheduler = f
        .scheduler(pd_config(100), 0)
        .with_plugin_metrics(&registry)
        .expect("metrics");
    let explained = scheduler.explain(&exact(tokens(22, 400)), &f.pods);
    assert_eq!(explained.profile, "decode");
    assert_eq!(explained.filters[0].filter, "decode-filter");
    assert_eq!(
        explained.filters[0].removed,
        [f.id(2).to_string(), f.id(3).to_string()]
    );
    let pd = explained.disaggregation.as_ref().expect("P/D decision");
    assert_eq!(pd.handler, "pd-profile-handler");
    assert_eq!((pd.threshold_tokens, pd.uncached_tokens), (100, 400.0));
    assert!(pd.prefill_ran);
    let prefill = pd.prefill.as_ref().expect("prefill explanation");
    assert_eq!(prefill.profile, "prefill");
    let mut prefill_candidates: Vec<_> = prefill
        .candidates
        .iter()
        .map(|c| c.address.clone())
        .collect();
    prefill_candidates.sort();
    assert_eq!(
        prefill_candidates,
        [f.id(2), f.id(3), f.id(4)].map(|p| p.to_string())
    );
    let json = serde_json::to_value(&explained).expect("json");
    assert_eq!(json["disaggregation"]["prefill"]["profile"], "prefill");

    // Below the threshold the explanation says so and runs no prefill profile.
    let short = scheduler.explain(&exact(tokens(23, 50)), &f.pods);
    let pd = short.disaggregation.expect("P/D decision");
    assert!(!pd.prefill_ran && pd.prefill.is_none());
    // Decisions are counted under llm-d's metric (explain counts nothing).
    let decisions = |decision: &str| {
        registry
            .gather()
            .iter()
            .filter(|family| family.name() == "llm_d_inference_scheduler_pd_decision_total")
            .flat_map(|family| family.get_metric().to_vec())
            .filter(|m| m.get_label().iter().any(|l| l.value() == decision))
            .map(|m| m.get_counter().get_value())
            .sum::<f64>()
    };
    assert_eq!(decisions("prefill-decode") + decisions("decode-only"), 0.0);
    for q in 0..3 {
        let pick = scheduler
            .pick(&exact(tokens(400 + q, 400)), &f.pods)
            .expect("pick");
        assert!(pick.prefill.is_some());
    }
    let pick = scheduler
        .pick(&exact(tokens(410, 50)), &f.pods)
        .expect("pick");
    assert!(pick.prefill.is_none());
    assert_eq!(
        (decisions("prefill-decode"), decisions("decode-only")),
        (3.0, 1.0)
    );
    // A single-profile config explains no disaggregation.
    let single = f.scheduler(SchedulerConfig::gie_default(), 0);
    let json = serde_json::to_value(single.explain(&exact(tokens(24, 50)), &f.pods)).expect("json");
    assert!(json.get("disaggregation").is_none());
}
