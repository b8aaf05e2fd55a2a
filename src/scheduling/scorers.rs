//! Scorers: each writes a score in [0, 1] per candidate (higher is better).
//!
//! - queue (`queue-scorer`, GIE): min-max normalized waiting, `(max − w) / (max − min)`, all 1.0
//!   when equal. Waiting counts kvpick's in-flight requests the last scrape has not seen yet
//!   ([`PodView::queued`]). An endpoint without metrics scores 0.
//! - kv-cache-utilization (`kv-cache-utilization-scorer`, GIE): `1 − usage`; 0 without metrics.
//! - prefix (`prefix-cache-scorer`): the cycle's prefix hit (weighted matched blocks / total).
//! - in-flight (`in-flight-requests-scorer`): `(max − n) / max` over kvpick's own counts, all
//!   1.0 when nothing is in flight (exact between scrapes, unlike `running`).
//! - LoRA affinity (`lora-affinity-scorer`, DESIGN §5): 1.0 the adapter is running, 0.6 it is
//!   waiting, 0.8 there is room to load it, else 0; all 1.0 for base-model requests.
//! - session affinity and no-hit-LRU: see [`super::affinity`].
//! - placement (`kv-placement-scorer`): see [`super::placement`].
//! - cost (`ttft-cost-scorer`): a prediction of each endpoint's time to first token. Once
//!   kvpick has timed first response bytes (`crate::endpoints::prefill`: a line per pod,
//!   fitted online from the time from pick to first byte against the prefill work ahead of
//!   and in the request), the pod's own line, or the fleet's median line for a pod without
//!   one, predicts it as the placement scorer does:
//!
//!   ```text
//!   ttft = base_ms + slope_ms × (queued_work_tokens + uncached_tokens)
//!   queued_work_tokens = kvpick's own prefill backlog on the pod
//!                      + other senders' waiting requests × the pod's mean uncached size
//!   ```
//!
//!   Before any line is fitted (a fresh start, no response observed), the coefficients:
//!
//!   ```text
//!   ttft = queued × queued_request_ms
//!        + uncached_tokens × prefill_ms_per_token × (1 + decode_slowdown_per_running × running)
//!   uncached_tokens = prompt_tokens − cached_tokens(prefix hit)
//!   ```
//!
//!   and either way `score = min_ttft / ttft` (1.0 for the fastest; 2× slower → 0.5).
//!   Defaults ([`CostModel`]): prefill 0.1 ms/token (~10k tokens/s), a queued request costs
//!   100 ms (a ~1k-token prefill), each running request slows prefill by 2% (chunked prefill
//!   shares the batch with decodes), 4 characters per token for approximate prompts. Why a
//!   ratio rather than min-max: min-max would blow up a 1 ms difference into the full [0, 1]
//!   range; the ratio keeps "twice as slow" meaning half the score. This is the scorer that
//!   trades cache against load in one unit (milliseconds): a cache hit is worth exactly the
//!   prefill it saves, and a queue costs what it delays. Its predictions against what kvpick
//!   then observes are the `kvpick_ttft_prediction_ratio` metric.

use crate::endpoints::PodId;
use crate::endpoints::prefill::FittedLine;

use super::affinity::{NoHitLru, SessionAffinity};
use super::cycle::{Cycle, PodView};
use super::spec::{CostModel, PlacementParams, ScorerSpec};

/// A scorer ready to run (stateful ones carry their state).
#[derive(Debug)]
pub enum Scorer {
    /// See the module docs.
    Queue,
    /// See the module docs.
    KvCacheUtilization,
    /// See the module docs.
    PrefixCache,
    /// See the module docs.
    InFlight,
    /// See the module docs.
    LoraAffinity,
    /// See the module docs.
    SessionAffinity(SessionAffinity),
    /// See the module docs.
    NoHitLru(NoHitLru),
    /// See the module docs.
    Cost(CostModel),
    /// See [`super::placement`].
    Placement(PlacementParams),
}

impl Scorer {
    /// Builds the scorer a spec describes.
    pub fn from_spec(spec: &ScorerSpec) -> Self {
        match spec {
            ScorerSpec::Queue => Self::Queue,
            ScorerSpec::KvCacheUtilization => Self::KvCacheUtilization,
            ScorerSpec::PrefixCache(_) => Self::PrefixCache,
            ScorerSpec::InFlight => Self::InFlight,
            ScorerSpec::LoraAffinity => Self::LoraAffinity,
            ScorerSpec::SessionAffinity { max_sessions } => {
                Self::SessionAffinity(SessionAffinity::new(*max_sessions))
            }
            ScorerSpec::NoHitLru { max_endpoints } => Self::NoHitLru(NoHitLru::new(*max_endpoints)),
            ScorerSpec::Cost(model) => Self::Cost(*model),
            ScorerSpec::Placement(params) => Self::Placement(*params),
        }
    }

    /// Scores every candidate of `cycle` into `out` (same length as `cycle.pods`).
    pub fn score(&self, cycle: &Cycle<'_>, out: &mut [f64]) {
        let pods = &cycle.pods;
        match self {
            Self::Queue => queue_scores(pods, out),
            Self::KvCacheUtilization => {
                for (slot, pod) in out.iter_mut().zip(pods) {
                    *slot = pod.metrics.as_ref().map_or(0.0, |m| unit(1.0 - m.kv_usage));
                }
            }
            Self::PrefixCache => {
                for (i, slot) in out.iter_mut().enumerate() {
                    *slot = unit(cycle.prefix_hit(i).score);
                }
            }
            Self::InFlight => {
                let max = pods.iter().map(|p| p.in_flight).max().unwrap_or(0);
                for (slot, pod) in out.iter_mut().zip(pods) {
                    *slot = if max == 0 {
                        1.0
                    } else {
                        (max - pod.in_flight.min(max)) as f64 / max as f64
                    };
                }
            }
            Self::LoraAffinity => {
                let adapter = cycle
                    .request
                    .key_context()
                    .and_then(|c| c.lora_name.as_deref());
                for (slot, pod) in out.iter_mut().zip(pods) {
                    *slot = lora_affinity(adapter, pod);
                }
            }
            Self::SessionAffinity(state) => {
                let ids = ids(pods);
                state.score(cycle.request.session_id.as_deref(), &ids, out);
            }
            Self::NoHitLru(state) => state.score(cycle.any_prefix_hit(), &ids(pods), out),
            Self::Cost(model) => {
                let fleet = super::placement::fleet_line(pods);
                let ttft: Vec<f64> = (0..pods.len())
                    .zip(pods)
                    .map(|(i, pod)| {
                        estimate_ttft_ms(
                            model,
                            pod,
                            fleet,
                            cycle.prompt_tokens,
                            cycle.prefix_hit(i).cached_tokens,
                        )
                    })
                    .collect();
                let best = ttft.iter().copied().fold(f64::INFINITY, f64::min);
                for (slot, t) in out.iter_mut().zip(&ttft) {
                    *slot = if *t <= MIN_TTFT_MS || !best.is_finite() {
                        1.0
                    } else {
                        unit(best.max(MIN_TTFT_MS) / t)
                    };
                }
            }
            Self::Placement(params) => super::placement::score(cycle, params, out),
        }
    }

    /// Updates the scorer's memory once `primary` is picked.
    pub fn after_pick(&self, cycle: &Cycle<'_>, primary: PodId) {
        match self {
            Self::SessionAffinity(state) => {
                state.record(cycle.request.session_id.as_deref(), primary)
            }
            Self::NoHitLru(state) => state.record(cycle.any_prefix_hit(), primary),
            _ => {}
        }
    }
}

/// TTFTs below this count as equal (avoids dividing by ~0 for empty prompts on idle pods).
const MIN_TTFT_MS: f64 = 1.0;

fn ids(pods: &[PodView]) -> Vec<PodId> {
    pods.iter().map(|p| p.id).collect()
}

fn unit(x: f64) -> f64 {
    if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) }
}

fn queue_scores(pods: &[PodView], out: &mut [f64]) {
    let queued: Vec<Option<f64>> = pods
        .iter()
        .map(|p| p.metrics.as_ref().map(|_| p.queued()))
        .collect();
    let known = queued.iter().flatten();
    let min = known.clone().copied().fold(f64::INFINITY, f64::min);
    let max = known.copied().fold(f64::NEG_INFINITY, f64::max);
    for (slot, q) in out.iter_mut().zip(&queued) {
        *slot = match q {
            None => 0.0,
            Some(_) if max <= min => 1.0,
            Some(q) => unit((max - q) / (max - min)),
        };
    }
}

fn lora_affinity(adapter: Option<&str>, pod: &PodView) -> f64 {
    let Some(adapter) = adapter else {
        return 1.0;
    };
    let Some(lora) = pod.metrics.as_ref().and_then(|m| m.lora.as_ref()) else {
        return 0.0;
    };
    if lora.running.iter().any(|a| a == adapter) {
        1.0
    } else if lora.waiting.iter().any(|a| a == adapter) {
        0.6
    } else if lora_has_room(lora) {
        0.8
    } else {
        0.0
    }
}

/// Whether an endpoint can load one more adapter.
pub(crate) fn lora_has_room(lora: &crate::scrape::LoraState) -> bool {
    let mut loaded: Vec<&String> = lora.running.iter().chain(&lora.waiting).collect();
    loaded.sort_unstable();
    loaded.dedup();
    (loaded.len() as u64) < u64::from(lora.max_loras)
}

/// The cost model's TTFT prediction for one endpoint, in ms: from the pod's fitted line (or
/// `fleet`, the candidates' median line) once there is one, else from the coefficients.
pub fn estimate_ttft_ms(
    model: &CostModel,
    pod: &PodView,
    fleet: Option<FittedLine>,
    prompt_tokens: f64,
    cached_tokens: f64,
) -> f64 {
    let uncached = (prompt_tokens - cached_tokens).max(0.0);
    if let Some(line) = pod.prefill.line.or(fleet) {
        return super::placement::predict_on_line(line, pod, prompt_tokens, uncached);
    }
    let slowdown = 1.0 + model.decode_slowdown_per_running.max(0.0) * pod.running().max(0.0);
    let ttft = pod.queued().max(0.0) * model.queued_request_ms.max(0.0)
        + uncached * model.prefill_ms_per_token.max(0.0) * slowdown;
    if ttft.is_finite() { ttft } else { f64::MAX }
}

#[cfg(test)]
mod tests {
    use super::super::SchedulingRequest;
    use super::super::cycle::PrefixHit;
    use super::super::cycle::test_support::*;
    use super::*;
    use crate::kvcache::{KeyContext, PromptKeys};
    use crate::tokenize::PromptTokens;
    use std::sync::Arc;

    fn run(
        scorer: &Scorer,
        request: &SchedulingRequest,
        pods: Vec<PodView>,
        prefix: Vec<PrefixHit>,
        prompt: f64,
    ) -> Vec<f64> {
        let cycle = Cycle {
            request,
            pods,
            prompt_tokens: prompt,
            prefix,
            lookup: None,
            home: None,
        };
        let mut out = vec![f64::NAN; cycle.pods.len()];
        scorer.score(&cycle, &mut out);
        assert!(
            out.iter().all(|s| (0.0..=1.0).contains(s)),
            "{out:?} in [0,1]"
        );
        out
    }

    fn hit(score: f64, cached: f64) -> PrefixHit {
        PrefixHit {
            score,
            cached_tokens: cached,
        }
    }

    #[test]
    fn queue_is_min_max_normalized_and_counts_unseen_in_flight() {
        let req = SchedulingRequest::default();
        let pods = vec![
            view(0, Some(metrics(0.0, 2.0, 0.1)), 0),
            view(1, Some(metrics(4.0, 2.0, 0.1)), 0),
            view(2, Some(metrics(2.0, 2.0, 0.1)), 0),
            view(3, None, 0),
        ];
        assert_eq!(
            run(&Scorer::Queue, &req, pods, vec![], 0.0),
            vec![1.0, 0.0, 0.5, 0.0]
        );
        // Pod 0 has 6 requests in flight the scrape saw as 2 running: 4 count as queued.
        let pods = vec![
            view(0, Some(metrics(0.0, 2.0, 0.1)), 6),
            view(1, Some(metrics(2.0, 2.0, 0.1)), 0),
        ];
        assert_eq!(run(&Scorer::Queue, &req, pods, vec![], 0.0), vec![0.0, 1.0]);
        let equal = vec![
            view(0, Some(metrics(3.0, 0.0, 0.0)), 0),
            view(1, Some(metrics(3.0, 0.0, 0.0)), 0),
        ];
        assert_eq!(
            run(&Scorer::Queue, &req, equal, vec![], 0.0),
            vec![1.0, 1.0]
        );
    }

    #[test]
    fn kv_utilization_and_in_flight() {
        let req = SchedulingRequest::default();
        let pods = vec![
            view(0, Some(metrics(0.0, 0.0, 0.25)), 0),
            view(1, Some(metrics(0.0, 0.0, 1.5)), 4),
            view(2, None, 2),
        ];
        assert_eq!(
            run(&Scorer::KvCacheUtilization, &req, pods.clone(), vec![], 0.0),
            vec![0.75, 0.0, 0.0]
        );
        assert_eq!(
            run(&Scorer::InFlight, &req, pods, vec![], 0.0),
            vec![1.0, 0.0, 0.5]
        );
        let idle = vec![view(0, None, 0), view(1, None, 0)];
        assert_eq!(
            run(&Scorer::InFlight, &req, idle, vec![], 0.0),
            vec![1.0, 1.0]
        );
    }

    #[test]
    fn prefix_reads_the_cycle_hits() {
        let req = SchedulingRequest::default();
        let pods = vec![view(0, None, 0), view(1, None, 0)];
        let out = run(
            &Scorer::PrefixCache,
            &req,
            pods,
            vec![hit(0.75, 12.0), hit(0.0, 0.0)],
            16.0,
        );
        assert_eq!(out, vec![0.75, 0.0]);
    }

    #[test]
    fn lora_affinity_values() {
        let mut req = SchedulingRequest::default();
        let with = |l| {
            Some(crate::scrape::PodMetrics {
                lora: Some(l),
                ..metrics(0.0, 0.0, 0.0)
            })
        };
        let pods = || {
            vec![
                view(0, with(lora(&["a"], &[], 2)), 0),
                view(1, with(lora(&["b"], &["a"], 2)), 0),
                view(2, with(lora(&["b"], &[], 2)), 0),
                view(3, with(lora(&["b", "c"], &[], 2)), 0),
                view(4, Some(metrics(0.0, 0.0, 0.0)), 0),
            ]
        };
        assert_eq!(
            run(&Scorer::LoraAffinity, &req, pods(), vec![], 0.0),
            vec![1.0; 5],
            "base model"
        );
        req.prompt = Arc::new(PromptKeys::new(
            PromptTokens::Empty,
            Some(KeyContext {
                lora_name: Some("a".into()),
                ..KeyContext::model("m")
            }),
        ));
        assert_eq!(
            run(&Scorer::LoraAffinity, &req, pods(), vec![], 0.0),
            vec![1.0, 0.6, 0.8, 0.0, 0.0]
        );
    }

    #[test]
    fn cost_trades_cache_against_queue() {
        let model = CostModel::default();
        let req = SchedulingRequest::default();
        // 10k-token prompt: pod 0 holds 9k of it but has 5 queued; pod 1 is idle and cold.
        let pods = vec![
            view(0, Some(metrics(5.0, 0.0, 0.0)), 0),
            view(1, Some(metrics(0.0, 0.0, 0.0)), 0),
        ];
        let t0 = estimate_ttft_ms(&model, &pods[0], None, 10_000.0, 9_000.0);
        let t1 = estimate_ttft_ms(&model, &pods[1], None, 10_000.0, 0.0);
        assert!((t0 - (500.0 + 100.0)).abs() < 1e-9, "{t0}");
        assert!((t1 - 1000.0).abs() < 1e-9, "{t1}");
        let scorer = Scorer::Cost(model);
        let out = run(
            &scorer,
            &req,
            pods,
            vec![hit(0.9, 9000.0), hit(0.0, 0.0)],
            10_000.0,
        );
        assert_eq!(out[0], 1.0);
        assert!((out[1] - 0.6).abs() < 1e-9, "{out:?}");
        // A deeper queue makes the cache not worth it: the cold pod wins.
        let pods = vec![
            view(0, Some(metrics(12.0, 0.0, 0.0)), 0),
            view(1, Some(metrics(0.0, 0.0, 0.0)), 0),
        ];
        let out = run(
            &scorer,
            &req,
            pods,
            vec![hit(0.9, 9000.0), hit(0.0, 0.0)],
            10_000.0,
        );
        assert!(out[1] > out[0], "{out:?}");
        // Decode load slows prefill.
        let busy = view(0, Some(metrics(0.0, 50.0, 0.0)), 50);
        assert!((estimate_ttft_ms(&model, &busy, None, 1000.0, 0.0) - 200.0).abs() < 1e-9);
        // Empty prompts on idle pods are all equal.
        let pods = vec![
            view(0, Some(metrics(0.0, 0.0, 0.0)), 0),
            view(1, Some(metrics(0.0, 0.0, 0.0)), 0),
        ];
        assert_eq!(run(&scorer, &req, pods, vec![], 0.0), vec![1.0, 1.0]);
    }

    #[test]
    fn cost_predicts_from_each_pods_fitted_line_once_it_has_one() {
        let model = CostModel::default();
        let req = SchedulingRequest::default();
        let line = |base_ms, slope_ms| FittedLine { base_ms, slope_ms };
        let with = |i, line: Option<FittedLine>, backlog_tokens| {
            let mut pod = view(i, Some(metrics(0.0, 0.0, 0.0)), 0);
            pod.prefill.line = line;
            pod.prefill.backlog_tokens = backlog_tokens;
            pod
        };
        // Pod 0 was measured 4× slower per token than the prior says, pod 1 at the prior with
        // a 20 ms base; pod 1 has 1,000 tokens of kvpick's own prefill queued.
        let (slow, fast) = (line(10.0, 0.4), line(20.0, 0.1));
        let pods = vec![with(0, Some(slow), 0.0), with(1, Some(fast), 1_000.0)];
        let t0 = estimate_ttft_ms(&model, &pods[0], None, 1_000.0, 0.0);
        let t1 = estimate_ttft_ms(&model, &pods[1], None, 1_000.0, 0.0);
        assert!((t0 - (10.0 + 0.4 * 1_000.0)).abs() < 1e-9, "{t0}");
        assert!((t1 - (20.0 + 0.1 * 2_000.0)).abs() < 1e-9, "{t1}");
        // The coefficients alone would call them equal (idle, cold, same prompt): the lines
        // send the request to the pod that is faster with its queue.
        let scorer = Scorer::Cost(model);
        let cold_1k = |pods| run(&scorer, &req, pods, vec![hit(0.0, 0.0); 2], 1_000.0);
        let out = cold_1k(pods);
        assert_eq!(out[1], 1.0);
        assert!((out[0] - 220.0 / 410.0).abs() < 1e-9, "{out:?}");
        // A pod without a line of its own is predicted by the candidates' median line, so a
        // newcomer is compared in the same units as the pods measured.
        let out = cold_1k(vec![with(0, Some(slow), 0.0), with(1, None, 0.0)]);
        assert_eq!(out, vec![1.0, 1.0]);
        // With no line anywhere: the coefficients (1,000 tokens × 0.1 ms).
        let cold = with(0, None, 0.0);
        assert!((estimate_ttft_ms(&model, &cold, None, 1_000.0, 0.0) - 100.0).abs() < 1e-9);
    }

    #[test]
    fn stateful_scorers_learn_from_picks() {
        let mut req = SchedulingRequest {
            session_id: Some("s1".into()),
            ..SchedulingRequest::default()
        };
        let scorer = Scorer::from_spec(&ScorerSpec::SessionAffinity { max_sessions: 8 });
        let pods = vec![view(0, None, 0), view(1, None, 0)];
        let cycle = Cycle {
            request: &req,
            pods: pods.clone(),
            prompt_tokens: 0.0,
            prefix: vec![],
            lookup: None,
            home: None,
        };
        scorer.after_pick(&cycle, pods[1].id);
        assert_eq!(
            run(&scorer, &req, pods.clone(), vec![], 0.0),
            vec![0.0, 1.0]
        );
        req.session_id = Some("s2".into());
        assert_eq!(run(&scorer, &req, pods, vec![], 0.0), vec![0.0, 0.0]);
    }
}
