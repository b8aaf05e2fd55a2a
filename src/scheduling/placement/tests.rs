//! Unit tests of `kv-placement-scorer`: one per decision rule, on hand-built pod views (the
//! same rules over time, on a clock the test advances: `timeline_tests.rs`).

use super::super::SchedulingRequest;
use super::super::cycle::test_support::*;
use super::super::cycle::{HomeHit, PrefixHit};
use super::*;
use crate::endpoints::PrefillView;
use crate::scrape::PodMetrics;
use std::sync::Arc;

/// A pod with `waiting` engine-side waiting requests, `capacity` blocks of 16 tokens of
/// which `held` are occupied, and kvpick's own `backlog` tokens awaiting first bytes
/// (`awaiting` requests), measured at 0.4 ms per token.
fn pod(i: usize, capacity: u64, held: u64, backlog: f64, awaiting: f64) -> PodView {
    let mut v = view(
        i,
        Some(PodMetrics {
            waiting: 0.0,
            block_size: Some(16),
            num_blocks: Some(capacity),
            ..metrics(0.0, 0.0, 0.5)
        }),
        awaiting as u64,
    );
    v.held_blocks = held;
    v.prefill = PrefillView {
        backlog_tokens: backlog,
        awaiting,
        line: Some(FittedLine {
            base_ms: 10.0,
            slope_ms: 0.4,
        }),
        mean_uncached_tokens: 500.0,
        heat_tokens: 0.0,
        itl: None,
        mean_output_chunks: 0.0,
        mean_in_flight: 0.0,
    };
    v
}

/// [`pod`] with `batch` requests decoding at steps of 25 ms + 1.2 ms per request, and
/// 64-token answers.
fn decoding_pod(i: usize, capacity: u64, held: u64, batch: u64) -> PodView {
    let mut p = pod(i, capacity, held, 0.0, 0.0);
    p.in_flight = batch;
    p.prefill.itl = Some(FittedLine {
        base_ms: 25.0,
        slope_ms: 1.2,
    });
    p.prefill.mean_output_chunks = 64.0;
    p
}

fn winner(pods: Vec<PodView>, cached: &[f64], prompt: f64) -> (usize, Vec<f64>) {
    winner_with(&PlacementParams::default(), pods, cached, prompt)
}

fn winner_with(
    params: &PlacementParams,
    pods: Vec<PodView>,
    cached: &[f64],
    prompt: f64,
) -> (usize, Vec<f64>) {
    winner_for(&SchedulingRequest::default(), params, pods, cached, prompt).0
}

/// The winner, the scores, and whether the request's objectives are attainable.
fn winner_for(
    request: &SchedulingRequest,
    params: &PlacementParams,
    pods: Vec<PodView>,
    cached: &[f64],
    prompt: f64,
) -> ((usize, Vec<f64>), bool) {
    winner_at_home(request, params, pods, cached, prompt, None)
}

/// [`winner_for`] for a prompt whose prefix was last routed to `home`.
fn winner_at_home(
    request: &SchedulingRequest,
    params: &PlacementParams,
    pods: Vec<PodView>,
    cached: &[f64],
    prompt: f64,
    home: Option<HomeHit>,
) -> ((usize, Vec<f64>), bool) {
    let cycle = Cycle {
        request,
        prefix: cached
            .iter()
            .map(|c| PrefixHit {
                score: c / prompt,
                cached_tokens: *c,
            })
            .collect(),
        pods,
        prompt_tokens: prompt,
        lookup: None,
        home,
    };
    let mut out = vec![0.0; cycle.pods.len()];
    score(&cycle, params, &mut out);
    assert!(out.iter().all(|s| (0.0..=1.0).contains(s)), "{out:?}");
    let best = (0..out.len())
        .max_by(|a, b| out[*a].total_cmp(&out[*b]))
        .expect("candidates");
    let attainable = slo_attainable(&cycle, params);
    ((best, out), attainable)
}

fn with_slo(ttft_ms: Option<f64>, tpot_ms: Option<f64>) -> SchedulingRequest {
    SchedulingRequest {
        slo: super::super::LatencySlo { ttft_ms, tpot_ms },
        ..SchedulingRequest::default()
    }
}

/// The holder of 2,000 of a 2,200-token prompt with 2,100 tokens queued by 3 requests
/// (predicted TTFT 930 ms, and 83 ms of evictions, but the hold bias makes it the
/// best-placed) and an empty pod that would prefill it all (890 ms); `busy` puts two
/// requests running on the empty one's engine.
fn holder_and_empty(busy: bool) -> Vec<PodView> {
    let mut empty = pod(1, 1000, 0, 0.0, 0.0);
    if busy && let Some(m) = empty.metrics.as_mut() {
        Arc::make_mut(m).running = 2.0;
    }
    vec![pod(0, 1000, 1000, 2100.0, 3.0), empty]
}

#[test]
fn a_ttft_objective_sends_the_request_to_a_pod_predicted_in_time() {
    let params = PlacementParams::default();
    let run = |request: &SchedulingRequest, busy: bool| {
        winner_for(
            request,
            &params,
            holder_and_empty(busy),
            &[2000.0, 0.0],
            2200.0,
        )
    };
    let ((best, _), _) = run(&SchedulingRequest::default(), false);
    assert_eq!(
        best, 0,
        "without an objective the holder is the better placement"
    );
    let ((best, scores), attainable) = run(&with_slo(Some(910.0), None), false);
    assert_eq!(
        best, 1,
        "only the empty pod is predicted within 910 ms: {scores:?}"
    );
    assert_eq!(scores[0], 0.0, "the late pod ranks last");
    assert!(attainable);
    // Nobody in time: the ranking is the usual one (the least late placement).
    let ((best, _), attainable) = run(&with_slo(Some(100.0), None), false);
    assert_eq!(best, 0);
    assert!(attainable, "an idle pod makes an objective attainable");
    let ((_, _), attainable) = run(&with_slo(Some(100.0), None), true);
    assert!(!attainable, "nobody in time, nobody idle, no cold cache");
}

#[test]
fn a_tpot_objective_counts_the_decode_batch_the_request_joins() {
    let params = PlacementParams::default();
    let mut pods = holder_and_empty(true);
    for p in &mut pods {
        p.prefill.itl = Some(FittedLine {
            base_ms: 20.0,
            slope_ms: 2.0,
        });
    }
    // The holder has 3 in flight: 20 + 2 × 4 = 28 ms per token; the other 22 ms.
    let ((best, _), attainable) = winner_for(
        &with_slo(None, Some(25.0)),
        &params,
        pods.clone(),
        &[2000.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 1);
    assert!(attainable);
    let ((best, _), attainable) = winner_for(
        &with_slo(None, Some(30.0)),
        &params,
        pods.clone(),
        &[2000.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 0, "both in time: the better placement");
    assert!(attainable);
    let ((_, _), attainable) = winner_for(
        &with_slo(None, Some(10.0)),
        &params,
        pods,
        &[2000.0, 0.0],
        2200.0,
    );
    assert!(!attainable);
}

#[test]
fn when_nothing_is_shared_the_least_busy_of_equal_pods_wins() {
    // No backlog anywhere (the requests there are decoding), nothing cached, free blocks:
    // equal predictions, so the pod with the fewest requests in flight.
    let mut pods: Vec<PodView> = (0..4).map(|i| pod(i, 1000, 0, 0.0, 0.0)).collect();
    for (p, in_flight) in pods.iter_mut().zip([3, 2, 4, 3]) {
        p.in_flight = in_flight;
    }
    let (best, scores) = winner(pods.clone(), &[0.0; 4], 2200.0);
    assert_eq!(best, 1, "{scores:?}");
    // A cache hit still outweighs a busier decode batch by far.
    let (best, _) = winner(pods, &[0.0, 0.0, 2000.0, 0.0], 2200.0);
    assert_eq!(best, 2);
}

#[test]
fn a_holder_keeps_its_prefix_under_moderate_load() {
    // 2,200-token prompt, 2,000 held by pod 0, which has 3 requests' worth of prefill
    // queued (1,500 tokens); pod 1 is idle and full of other prefixes.
    let (best, _) = winner(
        vec![
            pod(0, 1000, 1000, 1500.0, 3.0),
            pod(1, 1000, 1000, 0.0, 0.0),
        ],
        &[2000.0, 0.0],
        2200.0,
    );
    assert_eq!(
        best, 0,
        "the holder serves it: copying would evict as much as it saves"
    );
}

#[test]
fn a_second_copy_is_made_only_past_the_threshold() {
    // Holder cost: (10 + 0.4 (q + 200)) / 1.23; copy: 10 + 0.4·2200 + 0.4·2208 (evicts).
    // The copy wins once q ≈ 5,000 tokens are queued on the holder (≈ 10 requests).
    let holder_wins = |queued: f64| {
        let (best, _) = winner(
            vec![
                pod(0, 1000, 1000, queued, queued / 500.0),
                pod(1, 1000, 1000, 0.0, 0.0),
            ],
            &[2000.0, 0.0],
            2200.0,
        );
        best == 0
    };
    assert!(holder_wins(0.0));
    assert!(holder_wins(4000.0));
    assert!(
        !holder_wins(7000.0),
        "a holder that cannot keep up gets a second copy"
    );
    // With room on the other pod, a copy costs only its prefill: it comes sooner.
    let (best, _) = winner(
        vec![pod(0, 1000, 1000, 3000.0, 6.0), pod(1, 1000, 100, 0.0, 0.0)],
        &[2000.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 1, "a free pod takes a copy before the full one would");
}

#[test]
fn a_copy_onto_a_pod_with_a_queue_is_charged_for_every_request_it_holds_up() {
    // A cold start: pod 0 holds 2,000 of the prompt's 2,200 tokens and has two cold
    // prefills queued (4,400 tokens); pod 1 has room and five short requests queued (1,000
    // tokens). Pod 1 would give this request the earlier first token (1,290 ms against
    // 1,850), but the 2,000 tokens it would prefill again delay each of the five requests
    // queued there (and those that follow them).
    let holder = pod(0, 1000, 100, 4400.0, 2.0);
    let busy = pod(1, 1000, 100, 1000.0, 5.0);
    let cycle_costs = |params: &PlacementParams, pods: Vec<PodView>| {
        let request = SchedulingRequest::default();
        let cycle = Cycle {
            request: &request,
            prefix: [2000.0, 0.0]
                .iter()
                .map(|c| PrefixHit {
                    score: c / 2200.0,
                    cached_tokens: *c,
                })
                .collect(),
            pods,
            prompt_tokens: 2200.0,
            lookup: None,
            home: None,
        };
        costs(&cycle, params)
    };
    let on = PlacementParams::default();
    let c = cycle_costs(&on, vec![holder.clone(), busy.clone()]);
    assert_eq!(c[0].holdup_ms, 0.0, "the holder repeats nothing");
    assert!((c[1].holdup_ms - 2000.0 * 0.4 * 5.0).abs() < 1e-6, "{c:?}");
    let (best, _) = winner(vec![holder.clone(), busy.clone()], &[2000.0, 0.0], 2200.0);
    assert_eq!(best, 0, "the group waits for its holder");
    let off = PlacementParams {
        holdup_weight: 0.0,
        ..PlacementParams::default()
    };
    let (best, _) = winner_with(&off, vec![holder.clone(), busy], &[2000.0, 0.0], 2200.0);
    assert_eq!(best, 1, "without the hold-up the copy looks cheaper");
    // A pod with nothing queued is held up by nothing: it takes the copy.
    let idle = pod(1, 1000, 100, 0.0, 0.0);
    assert_eq!(
        cycle_costs(&on, vec![holder.clone(), idle.clone()])[1].holdup_ms,
        0.0
    );
    let (best, _) = winner(vec![holder, idle], &[2000.0, 0.0], 2200.0);
    assert_eq!(best, 1);
}

#[test]
fn a_cold_prefix_goes_where_it_displaces_least() {
    // Nobody holds it; equal load; pod 1 has room, pods 0 and 2 are full.
    let (best, _) = winner(
        vec![
            pod(0, 1000, 1000, 0.0, 0.0),
            pod(1, 1000, 200, 0.0, 0.0),
            pod(2, 1000, 990, 0.0, 0.0),
        ],
        &[0.0, 0.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 1);
    // Among equally full pods, the least loaded.
    let (best, _) = winner(
        vec![
            pod(0, 1000, 1000, 800.0, 2.0),
            pod(1, 1000, 1000, 200.0, 1.0),
        ],
        &[0.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 1);
}

#[test]
fn a_cold_prefix_on_full_pods_goes_to_the_coolest_cache() {
    // Every pod is full and idle; pod 1's cache served few hits lately, pods 0 and 2
    // many: evicting from pod 1 costs the fleet least.
    let hot = |i: usize, heat: f64| {
        let mut p = pod(i, 1000, 1000, 0.0, 0.0);
        p.prefill.heat_tokens = heat;
        p
    };
    let (best, _) = winner(
        vec![hot(0, 40_000.0), hot(1, 2_000.0), hot(2, 30_000.0)],
        &[0.0, 0.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 1);
    // Heat does not outweigh a long queue: a cool pod with 8,000 tokens queued loses.
    let mut busy_cool = hot(1, 2_000.0);
    busy_cool.prefill.backlog_tokens = 8_000.0;
    let (best, _) = winner(
        vec![hot(0, 40_000.0), busy_cool, hot(2, 30_000.0)],
        &[0.0, 0.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 2, "the cooler of the two idle pods");
}

#[test]
fn a_holder_whose_decode_batch_grows_gives_work_away() {
    // Steps of 25 ms + 1.2 ms per request decoding, 64-token answers. Pod 0 holds the
    // prefix; it and pod 1 have room (so a copy evicts nothing).
    let decoding = |i: usize, batch: u64| decoding_pod(i, 10_000, 0, batch);
    let params = PlacementParams {
        decode_weight: 1.0,
        ..PlacementParams::default()
    };
    let holder_wins = |batch: u64| {
        let (best, _) = winner_with(
            &params,
            vec![decoding(0, batch), decoding(1, 4)],
            &[2000.0, 0.0],
            2200.0,
        );
        best == 0
    };
    assert!(holder_wins(4), "equal batches: the cache decides");
    assert!(
        holder_wins(8),
        "a few more decoding: still worth the 800 ms prefill saved"
    );
    assert!(
        !holder_wins(20),
        "a batch 16 larger costs more than the prefill saves"
    );
    // Off by default: the cache decides.
    let (best, _) = winner(
        vec![decoding(0, 20), decoding(1, 4)],
        &[2000.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 0);
}

/// `coldDecodeWeight` (default 1): a prefix nobody holds goes where the decode batch is smaller even
/// when the busier pod has free blocks and the other must evict; a prefix one pod holds
/// stays there whatever its batch.
#[test]
fn cold_decode_weight_spreads_new_prefixes_and_leaves_warm_ones_on_their_holder() {
    // Pod 0: room for the prompt, 20 decoding. Pod 1: full (the prompt evicts), 2 decoding.
    let fleet = || vec![decoding_pod(0, 10_000, 0, 20), decoding_pod(1, 200, 200, 2)];
    let cold = PlacementParams::default();
    let off = PlacementParams {
        cold_decode_weight: 0.0,
        ..PlacementParams::default()
    };
    assert_eq!(
        winner_with(&off, fleet(), &[0.0, 0.0], 2200.0).0,
        0,
        "off: free blocks decide"
    );
    assert_eq!(
        winner_with(&cold, fleet(), &[0.0, 0.0], 2200.0).0,
        1,
        "cold: the smaller batch, eviction and all"
    );
    assert_eq!(
        winner_with(&cold, fleet(), &[100.0, 0.0], 2200.0).0,
        1,
        "a few blocks more on one pod is still cold"
    );
    assert_eq!(
        winner_with(&cold, fleet(), &[2000.0, 0.0], 2200.0).0,
        0,
        "warm: the holder keeps it"
    );
}

/// A holder whose sustained load is far above the fleet's (several hot prefixes on one pod)
/// gets a copy made where the batch is small; a holder that is only busy *now* (the same
/// count, but a normal load over time) keeps its prefix, and so does an overloaded holder
/// when another holder is not overloaded.
#[test]
fn an_overloaded_holder_gets_a_copy_where_the_batch_is_small_but_a_busy_moment_does_not() {
    // Pod 0 holds 2,000 of the 2,200 tokens and has 30 decoding; pods 1 and 2 decode 2.
    let fleet = |sustained: f64| {
        let mut pods = vec![
            decoding_pod(0, 10_000, 200, 30),
            decoding_pod(1, 10_000, 0, 2),
            decoding_pod(2, 10_000, 0, 2),
        ];
        pods[0].prefill.mean_in_flight = sustained;
        pods[1].prefill.mean_in_flight = 2.0;
        pods[2].prefill.mean_in_flight = 2.0;
        pods
    };
    let held = [2000.0, 0.0, 0.0];
    assert_ne!(
        winner(fleet(30.0), &held, 2200.0).0,
        0,
        "sustained 30 against a mean of 11: a copy"
    );
    assert_eq!(
        winner(fleet(4.0), &held, 2200.0).0,
        0,
        "30 now but 4 over time (a burst): the holder keeps it"
    );
    // Two holders, one of them not overloaded: that one, no new copy.
    let mut two = fleet(30.0);
    two[1].prefill.mean_in_flight = 12.0;
    two[1].in_flight = 12;
    assert_eq!(winner(two, &[2000.0, 2000.0, 0.0], 2200.0).0, 1);
}

/// A prefix evicted everywhere that kvpick routed before (its home) is not new: it goes
/// back home while home is about as good, instead of wherever the decode batch is a
/// little smaller at that instant, and leaves only for a clearly better pod.
#[test]
fn a_returning_prefix_goes_home_unless_another_pod_is_clearly_better() {
    let request = SchedulingRequest::default();
    let params = PlacementParams::default();
    let home = |share: f64| Some(HomeHit { index: 0, share });
    let winner = |pods: Vec<PodView>, home: Option<HomeHit>| {
        winner_at_home(&request, &params, pods, &[0.0, 0.0], 2200.0, home)
            .0
            .0
    };
    // Both full (the prompt evicts as much on either); pod 0 decodes 3, pod 1 decodes 1.
    let full = || vec![decoding_pod(0, 200, 200, 3), decoding_pod(1, 200, 200, 1)];
    assert_eq!(winner(full(), None), 1, "new: the smaller decode batch");
    assert_eq!(winner(full(), home(1.0)), 0, "returning: home");
    let off = PlacementParams {
        home_bias: 1.0,
        ..PlacementParams::default()
    };
    assert_eq!(
        winner_at_home(&request, &off, full(), &[0.0, 0.0], 2200.0, home(1.0))
            .0
            .0,
        1,
        "homeBias 1: placed as new"
    );
    assert_eq!(
        winner(full(), home(0.3)),
        1,
        "a home covering a third of the prompt (a shared preamble) says little: new"
    );
    // Home must evict, the other pod has room: eviction costs more than the bias.
    let room = vec![decoding_pod(0, 200, 200, 1), decoding_pod(1, 10_000, 0, 1)];
    assert_eq!(winner(room, home(1.0)), 1, "free blocks elsewhere win");
    // Home has 4,000 tokens of prefill queued: the idle pod is clearly better.
    let mut queued = decoding_pod(0, 200, 200, 1);
    queued.prefill.backlog_tokens = 4_000.0;
    let busy = vec![queued, decoding_pod(1, 200, 200, 1)];
    assert_eq!(winner(busy, home(1.0)), 1, "a long queue at home");
    // A pod that holds the prompt outranks the home.
    let held = winner_at_home(&request, &params, full(), &[0.0, 2000.0], 2200.0, home(1.0));
    assert_eq!(held.0.0, 1, "the holder");
}

#[test]
fn engine_side_waiting_counts_as_foreign_work() {
    // Another router's requests wait on pod 0: the engine reports 6 waiting, kvpick has
    // none there. Pod 0 holds half the prompt, pod 1 nothing; both have room.
    let mut busy = pod(0, 10_000, 0, 0.0, 0.0);
    if let Some(m) = busy.metrics.as_mut() {
        std::sync::Arc::make_mut(m).waiting = 6.0;
    }
    let (best, _) = winner(
        vec![busy, pod(1, 10_000, 0, 0.0, 0.0)],
        &[1100.0, 0.0],
        2200.0,
    );
    assert_eq!(
        best, 1,
        "3,000 tokens of foreign work outweigh 1,100 cached"
    );
}

#[test]
fn own_requests_waiting_at_the_scrape_are_not_foreign_after_their_first_byte() {
    // At the last scrape the engine had 6 waiting, all kvpick's; they have all had their
    // first byte since (kvpick's backlog there is empty). Pod 0 holds half the prompt.
    let mut scraped = pod(0, 10_000, 0, 0.0, 0.0);
    if let Some(m) = scraped.metrics.as_mut() {
        let m = std::sync::Arc::make_mut(m);
        m.waiting = 6.0;
        m.own_awaiting = 6.0;
    }
    let (best, _) = winner(
        vec![scraped, pod(1, 10_000, 0, 0.0, 0.0)],
        &[1100.0, 0.0],
        2200.0,
    );
    assert_eq!(best, 0, "no phantom foreign work: the holder wins");
}

#[test]
fn unmeasured_pods_use_the_fleet_median_then_the_prior() {
    let mut fresh = pod(1, 1000, 0, 0.0, 0.0);
    fresh.prefill.line = None;
    let pods = vec![pod(0, 1000, 0, 0.0, 0.0), fresh.clone()];
    let fleet = fleet_line(&pods);
    assert_eq!(fleet.map(|l| l.slope_ms), Some(0.4));
    let p = PlacementParams::default();
    assert!((predict_ttft_ms(&fresh, fleet, &p, 1000.0, 1000.0) - 410.0).abs() < 1e-9);
    assert!((predict_ttft_ms(&fresh, None, &p, 1000.0, 1000.0) - 100.0).abs() < 1e-9);
}
