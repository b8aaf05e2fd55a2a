//! `kv-placement-scorer`: place each request where it reaches its first token soonest, counting
//! what the placement costs the fleet's cache.
//!
//! Per candidate, in milliseconds:
//!
//! ```text
//! work        = backlog + foreign + uncached
//!   backlog   = uncached tokens of kvpick's requests there awaiting their first byte
//!   foreign   = requests the engine said wait beyond kvpick's own at that scrape × their
//!               mean size
//!   uncached  = prompt tokens − tokens it holds of this prompt (events, speculative records)
//! ttft        = base + ms_per_token × work               (the pod's own fitted line)
//! displacement= max(0, uncached blocks − free blocks) × block tokens × ms_per_token × w
//!               × heat / mean heat   (how hot the pod's cache is against the fleet's)
//! holdup      = (the most any candidate holds − what it holds) × ms_per_token
//!               × requests queued for prefill there × w_h
//! decode      = chunks × ms_per_decode × batch + batch × chunks / 2 × ms_per_decode
//!   ms_per_decode: the fleet's fitted slope of chunk gaps against the decode batch
//! cost        = (ttft + displacement + holdup) / (1 + (hold_bias − 1) × held share)
//!               + w_d × decode
//!               × (1 + 2% × requests in flight there)     (near ties: the least busy)
//! score       = min cost / cost
//! ```
//!
//! Why each term:
//! - `ttft` is what the request waits for, in the pod's own terms: prefill work queued ahead
//!   (exact for kvpick's traffic, `crate::endpoints::prefill`) plus its own uncached part, at
//!   the pod's measured speed. A cache hit is worth exactly the prefill it saves, a queue
//!   costs exactly the prefill it holds.
//! - `displacement` is what placing the request costs the *next* requests: blocks it must
//!   evict on a full pod are (in a working set that fills the fleet) other prefixes' blocks,
//!   which their next request has to prefill again. Free blocks cost nothing, so while caches
//!   have room a copy is cheap and placement follows load; once they are full, copying a
//!   prefix onto a second pod costs about twice its prefill, so a prefix stays on its holder
//!   until the holder's queue is worth more than that. What the evicted blocks are worth
//!   depends on the pod: one serving many hot prefixes (many recent hits, its *heat*) loses
//!   more by an eviction than one whose cache holds prefixes nobody asks for any more, so the
//!   cost scales with the pod's heat against the candidates' mean (clamped to ¼…4×).
//! - `holdup` is what a copy costs the requests that will queue behind it: a pod prefills
//!   in arrival order, so each of them also waits for the prefill this placement repeats
//!   (the tokens another candidate already holds). How many will is estimated by how many
//!   are queued there now (in a steady state, the requests that arrive during one queue's
//!   wait). It is what keeps a cold start together: while every pod has cold prefills
//!   queued, a group's next request finds its holder behind, and a copy elsewhere would give
//!   *it* an earlier first token, but the copy's whole prefill then delays every request
//!   queued behind it there. A pod with nothing queued is held up by nothing, so a holder
//!   that cannot keep up still gets its copy where there is room.
//!   NOTE: only the repeated part. Charging every candidate its whole uncached part (the
//!   request's own question too, which holds someone up wherever it goes) also charged the
//!   holder for its queue and so made copies onto idle pods *cheaper*: measured, multi-turn
//!   chat went from 1.01 to 1.31 pods per conversation and 292 to 366 ms mean TTFT at 24
//!   req/s (session 39).
//! - `decode` is what the request's decoding costs there: its own tokens at the step time of
//!   the batch it joins, and the slowdown it adds to every request already decoding (each
//!   step is longer by one sequence's share). Without it a pod holding several hot prefixes
//!   keeps them all while its batch grows and every request on it streams slower; with it the
//!   hot pod gives work away once its batch costs more than the prefill the cache saves.
//! - `hold_bias` is hysteresis on top: a holder keeps its prefix unless the alternative is
//!   clearly better (default: 25% after displacement), so two near-equal pods do not trade a
//!   group back and forth on every scrape, and a group is not split over two copies that then
//!   evict each other. It scales with the share of the prompt held.
//!
//! Copies: every pod holding the prefix is a candidate with its own queue, so a new copy is
//! made only when *every* existing holder is predicted slower than a non-holder's full
//! prefill plus what it evicts and holds up, discounted by the hold bias: with one holder of a
//! 2,200-token prompt on full pods and an idle pod beside it, that is once ~17 of its
//! 200-token requests are queued
//! (`timeline_tests.rs` checks it over time: no copy while the holder's queue holds less work
//! than the copy's own prefill, one copy when it cannot keep up, none more while the first is
//! being prefilled). A third copy needs both holders behind, and so on: the number of copies
//! grows with the load the prefix brings, not with how its requests happen to arrive.
//!
//! A holder can also fall behind without a prefill queue: warm requests cost it little
//! prefill each, and a pod that holds several hot prefixes (a popularity shift makes
//! prefixes hot where they happened to be placed while cold) runs a decode batch several
//! times the fleet's while other pods idle; every request on it streams slower, and its
//! steps delay every first token. When *every* holder's sustained load (its in-flight count
//! averaged over ~10 s, `PrefillView::mean_in_flight`) is at least [`OVERLOAD_SHARE`] × the
//! fleet's mean and [`OVERLOAD_EXCESS`] requests above the least loaded pod's, the request
//! is priced with its decode term (the cold weight), so a copy goes where the batch is
//! small; once one holder is not overloaded, requests follow the holders' queues again.
//! NOTE: the sustained load, not the count now: a pod's share of a Poisson stream puts the
//! instantaneous count at 1.5× the mean and 4 above the least in most scrapes of a
//! balanced fleet (70% of samples with full caches at 18 req/s, session 35), which would
//! turn the full-cache placement into load balancing.
//!
//! A cold prefix (no holder) goes where the work queued is least and where it evicts least:
//! free blocks first, then the coolest cache. This is what spreads a working set that just
//! fits the fleet evenly over it (smg gets there by sending a cold prefix to its smallest
//! tree; kvpick knows which caches are full and which of them are still being used).
//!
//! A returning prefix (held nowhere any more, but routed before: `crate::kvcache` remembers
//! where, its *home*) is not cold: it is placed as if its home held it (`home_bias`, by
//! default the hold bias, and no decode spreading), so it goes back home unless another pod
//! is clearly better (free blocks where home must evict, a shorter queue). With full caches
//! prefixes are evicted between their requests; placed as new each time, a group's requests
//! wandered to whichever pod was a little less busy, every pod's cache saw every group and
//! evicted more (measured: 10–25 moves and 1.6–2.0 pods per prefix where smg keeps each on
//! one pod).
//!
//! Before a pod has its own fit (a few first bytes), it is predicted with the fleet's median
//! fitted line, and before any pod has one, with the configured prior. So is a pod whose fit
//! is in question (no first byte for 10 s: `crate::endpoints::prefill`), one request at a
//! time, so that a pod learned slow in a bad spell is measured again instead of left idle.
//!
//! Latency objectives (llm-d's `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`): a pod meets
//! them when its predicted TTFT and time per output token (its fitted chunk gap at the batch
//! the request joins) are within them. When some candidate meets them, the others score 0,
//! so the pick is the best-placed pod among those predicted in time (llm-d's
//! `slo-headroom-tier-filter` keeps that tier too); when none does, the ranking is unchanged
//! (the least late). A sheddable request nobody can serve in time is refused by the scheduler
//! ([`slo_attainable`]).
//!
//! NOTE: unlike llm-d's tier filter, no 1% of requests is sent to the late tier to re-measure
//! recovering pods: kvpick's predictions follow each pod's queue from its own records and the
//! engine's scrapes, not only from the requests routed there.

use crate::endpoints::FittedLine;

use super::cycle::{Cycle, PodView};

/// Parameters of `kv-placement-scorer`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlacementParams {
    /// Cost divisor for a pod holding the whole prompt (default 1.25).
    pub hold_bias: f64,
    /// Weight of the eviction cost (default 1.0: an evicted block is worth its prefill).
    pub displacement_weight: f64,
    /// Prefill ms per token before any pod is measured (default 0.1).
    pub prior_ms_per_token: f64,
    /// Block size assumed when neither the index nor the metrics know one (default 16).
    pub default_block_size: u32,
    /// Weight of the decoding cost (default 0: off; 1.0 counts a millisecond of decoding, the
    /// request's own or the slowdown of the batch it joins, as a millisecond of waiting).
    // NOTE: off by default because measured at weight 1 it spread prefixes over too many
    // pods: on the side-by-side benchmark with full caches the engines' hit rate fell from
    // 0.78 to 0.64 and mean TTFT rose 195 → 244 ms (docs/benchmarks.md, placement). It is
    // kept as a parameter for decode-heavy fleets, where balance matters more than hits.
    pub decode_weight: f64,
    /// Weight of the decoding cost for a request no candidate holds materially more of than
    /// the others (a prefix being placed for the first time, or evicted everywhere): the
    /// larger of this and `decode_weight` applies to it (default 1.0).
    // NOTE: a group's first request decides where all its later ones go (they follow the
    // cache), so pricing the decode batch there spreads new groups without moving warm ones
    // off their holders, which is what cost `decode_weight` its hits. Without it, cold groups
    // went wherever blocks were free (displacement 0) one after another, and those pods'
    // decode batches grew: measured A/B in two rounds (docs/benchmarks.md, session 10), 1.0
    // against 0 was 0.61–0.67× the mean TTFT with full caches at 18 req/s, 0.87–0.93× with a
    // shifting popularity, level to 0.93× on heterogeneous pods, 1.09× then 0.96× roomy.
    // NOTE: where nothing is shared it trades first-token for whole-request latency: on the
    // no-sharing control TTFT 1.08–1.12× round robin's, ITL 0.94–0.97×, end-to-end p90
    // 0.91–0.95×; at 0, round robin's on all three. Scaling it down by the fleet's reuse
    // traded the other way (TTFT 1.03–1.07×, ITL and end-to-end 1.02–1.04×, one pod with
    // 24–26 of 160 requests) and was not kept (docs/benchmarks.md, session 13).
    pub cold_decode_weight: f64,
    /// Cost divisor for the pod a returning prefix was last routed to, when it covers the
    /// whole prompt (default 1.25, as `hold_bias`; 1.0: a returning prefix is placed as new).
    pub home_bias: f64,
    /// Weight of the hold-up: the prefill a placement repeats (tokens another candidate
    /// holds) counted once more for each request queued for prefill on the pod (default
    /// 1.0; 0: off).
    pub holdup_weight: f64,
}

impl Default for PlacementParams {
    fn default() -> Self {
        Self {
            hold_bias: 1.25,
            displacement_weight: 1.0,
            prior_ms_per_token: 0.1,
            default_block_size: 16,
            decode_weight: 0.0,
            cold_decode_weight: 1.0,
            home_bias: 1.25,
            holdup_weight: 1.0,
        }
    }
}

/// One candidate's predicted cost, with its parts (explain, the pick's prediction).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PlacementCost {
    /// Predicted time to first token, ms.
    pub ttft_ms: f64,
    /// Predicted eviction cost, ms of other requests' prefill.
    pub displacement_ms: f64,
    /// Predicted hold-up: the time of the prefill it repeats there (tokens another
    /// candidate holds) × the requests queued for prefill there (a proxy for those that will
    /// arrive behind it), ms of other requests' waiting.
    pub holdup_ms: f64,
    /// Predicted decoding cost: its own decode at the batch it joins plus the slowdown it
    /// adds to the requests decoding there, ms (0 before the pods' decode is measured).
    pub decode_ms: f64,
    /// `((ttft + displacement + holdup) / hold bias + decode) × (1 + 2% per request in
    /// flight)`: what the score ranks.
    pub cost_ms: f64,
    /// Predicted time per output token at the batch the request joins, ms (`None` before
    /// any pod's decode is measured).
    pub tpot_ms: Option<f64>,
    /// Whether the predictions meet the request's latency objectives (true without any).
    pub meets_slo: bool,
}

/// The line that predicts pod `pod`: its own, else the fleet's median, else the prior.
fn line_for(pod: &PodView, fleet: Option<FittedLine>, params: &PlacementParams) -> FittedLine {
    pod.prefill.line.or(fleet).unwrap_or(FittedLine {
        base_ms: 0.0,
        slope_ms: params.prior_ms_per_token.max(0.0),
    })
}

/// The median fitted TTFT line over the candidates that have one.
pub fn fleet_line(pods: &[PodView]) -> Option<FittedLine> {
    median_line(pods.iter().filter_map(|p| p.prefill.line).collect())
}

/// The median of `lines` (slope and base each).
fn median_line(mut lines: Vec<FittedLine>) -> Option<FittedLine> {
    if lines.is_empty() {
        return None;
    }
    let mid = lines.len() / 2;
    lines.sort_by(|a, b| a.slope_ms.total_cmp(&b.slope_ms));
    let slope = lines[mid].slope_ms;
    lines.sort_by(|a, b| a.base_ms.total_cmp(&b.base_ms));
    Some(FittedLine {
        base_ms: lines[mid].base_ms,
        slope_ms: slope,
    })
}

/// Requests the engine said wait beyond kvpick's own at its last scrape (other replicas',
/// other clients').
fn foreign_requests(pod: &PodView) -> f64 {
    pod.metrics
        .as_ref()
        .map_or(0.0, |m| (m.waiting - m.own_awaiting).max(0.0))
}

/// Requests queued for prefill on `pod`: kvpick's awaiting their first byte and the
/// engine's others.
fn queued_requests(pod: &PodView) -> f64 {
    pod.prefill.awaiting.max(0.0) + foreign_requests(pod)
}

/// The prefill work (tokens) queued ahead of a new request on `pod`.
pub fn queued_work_tokens(pod: &PodView, fallback_request_tokens: f64) -> f64 {
    let own = pod.prefill.backlog_tokens;
    let foreign_requests = foreign_requests(pod);
    let size = if pod.prefill.mean_uncached_tokens > 0.0 {
        pod.prefill.mean_uncached_tokens
    } else {
        fallback_request_tokens
    };
    own + foreign_requests * size.max(0.0)
}

/// The predicted time to first token on `pod` of a request with `uncached` tokens.
pub fn predict_ttft_ms(
    pod: &PodView,
    fleet: Option<FittedLine>,
    params: &PlacementParams,
    prompt_tokens: f64,
    uncached: f64,
) -> f64 {
    predict_on_line(line_for(pod, fleet, params), pod, prompt_tokens, uncached)
}

/// The time to first token `line` predicts on `pod` for a request with `uncached` tokens:
/// the prefill work queued ahead of it and its own.
pub fn predict_on_line(line: FittedLine, pod: &PodView, prompt_tokens: f64, uncached: f64) -> f64 {
    let ttft = line.predict_ms(queued_work_tokens(pod, prompt_tokens) + uncached.max(0.0));
    if ttft.is_finite() { ttft } else { f64::MAX }
}

/// What placing a request on `pod` costs in decoding beyond an idle pod, ms: its own tokens
/// are each slower by the batch it joins, and it slows every request already decoding there
/// (for about half of their remaining tokens). `None` before the fleet has a decode fit and a
/// response length.
///
/// NOTE: only the fleet's median slope is used, not each pod's own line: a pod's fitted base
/// (its step time with an empty batch) is noisy, and a 5% error in it over a whole response
/// outweighs the prefill a cache hit saves. Pods that are slower per token show it in their
/// own TTFT lines.
fn decode_ms(pod: &PodView, itl: Option<FittedLine>, chunks: f64) -> Option<f64> {
    let slope = itl?.slope_ms;
    if chunks <= 0.0 {
        return None;
    }
    let batch = pod.in_flight as f64;
    let own = chunks * slope * batch;
    let others = batch * (chunks / 2.0) * slope;
    Some(own + others).filter(|ms| ms.is_finite())
}

/// Every candidate's cost for the cycle's request.
pub fn costs(cycle: &Cycle<'_>, params: &PlacementParams) -> Vec<PlacementCost> {
    let fleet = fleet_line(&cycle.pods);
    let fleet_itl = median_line(cycle.pods.iter().filter_map(|p| p.prefill.itl).collect());
    let mut lengths: Vec<f64> = cycle
        .pods
        .iter()
        .map(|p| p.prefill.mean_output_chunks)
        .filter(|c| *c > 0.0)
        .collect();
    lengths.sort_by(f64::total_cmp);
    let fleet_chunks = lengths.get(lengths.len() / 2).copied().unwrap_or(0.0);
    let prompt = cycle.prompt_tokens.max(0.0);
    let n = cycle.pods.len().max(1) as f64;
    let cold = is_cold(cycle, prompt);
    // A returning prefix: held nowhere (evicted), but routed before, to a candidate that is
    // its home. It is placed like a held one: not spread by its decode batch, and with
    // `home_bias` on its home (the bias below).
    let home = cycle
        .home
        .filter(|home| params.home_bias > 1.0 && cold && home.share >= RETURNING_SHARE);
    let decode_weight = if (cold && home.is_none()) || (!cold && holders_overloaded(cycle, prompt))
    {
        params.decode_weight.max(params.cold_decode_weight)
    } else {
        params.decode_weight
    }
    .max(0.0);
    // A candidate's uncached tokens that the best-held one holds are a repeat of a prefill
    // done elsewhere (the hold-up term).
    let most_held = most_held(cycle, prompt);
    let mean_heat = cycle
        .pods
        .iter()
        .map(|p| p.prefill.heat_tokens.max(0.0))
        .sum::<f64>()
        / n;
    cycle
        .pods
        .iter()
        .enumerate()
        .map(|(i, pod)| {
            let cached = cycle.prefix_hit(i).cached_tokens.clamp(0.0, prompt);
            let uncached = prompt - cached;
            let line = line_for(pod, fleet, params);
            let ttft_ms = predict_ttft_ms(pod, fleet, params, prompt, uncached);
            let value = if mean_heat > 0.0 {
                (pod.prefill.heat_tokens.max(0.0) / mean_heat).clamp(0.25, 4.0)
            } else {
                1.0
            };
            let displacement_ms = displacement_tokens(pod, uncached, params)
                * line.slope_ms
                * params.displacement_weight.max(0.0)
                * value;
            let holdup_ms = (most_held - cached).max(0.0)
                * line.slope_ms
                * queued_requests(pod)
                * params.holdup_weight.max(0.0);
            let held_share = if prompt > 0.0 { cached / prompt } else { 0.0 };
            let bias = 1.0 + (params.hold_bias.max(1.0) - 1.0) * held_share;
            let bias = match home {
                Some(home) if home.index == i => {
                    bias.max(1.0 + (params.home_bias - 1.0) * home.share.min(1.0))
                }
                _ => bias,
            };
            let decode_ms =
                decode_ms(pod, fleet_itl, fleet_chunks).map_or(0.0, |ms| ms * decode_weight);
            // NOTE: the hold bias scales only what the prefix changes (its prefill, what it
            // evicts, whom it holds up); decoding costs the same whoever holds the prefix.
            let cost_ms = ((ttft_ms + displacement_ms + holdup_ms) / bias + decode_ms)
                * (1.0 + IN_FLIGHT_COST_SHARE * pod.in_flight as f64);
            let tpot_ms = pod
                .prefill
                .itl
                .or(fleet_itl)
                .map(|line| line.predict_ms(pod.in_flight as f64 + 1.0))
                .filter(|ms| ms.is_finite());
            PlacementCost {
                ttft_ms,
                tpot_ms,
                meets_slo: cycle.request.slo.met_by(ttft_ms, tpot_ms),
                decode_ms,
                displacement_ms: if displacement_ms.is_finite() {
                    displacement_ms
                } else {
                    f64::MAX
                },
                holdup_ms: if holdup_ms.is_finite() {
                    holdup_ms
                } else {
                    f64::MAX
                },
                cost_ms: if cost_ms.is_finite() {
                    cost_ms
                } else {
                    f64::MAX
                },
            }
        })
        .collect()
}

/// Whether no candidate holds materially more of the prompt than another (less than
/// [`COLD_SPREAD`] of it between the best and the worst held): where it goes is decided by
/// load and eviction alone.
fn is_cold(cycle: &Cycle<'_>, prompt: f64) -> bool {
    if prompt <= 0.0 || cycle.pods.is_empty() {
        return false;
    }
    let held = (0..cycle.pods.len()).map(|i| cycle.prefix_hit(i).cached_tokens.clamp(0.0, prompt));
    let (lo, hi) = held.fold((f64::INFINITY, 0.0_f64), |(lo, hi), c| {
        (lo.min(c), hi.max(c))
    });
    hi - lo < COLD_SPREAD * prompt
}

/// Share of the prompt one candidate must hold beyond another for a request to be warm.
const COLD_SPREAD: f64 = 0.25;

/// Whether every candidate holding the prompt (within [`COLD_SPREAD`] of the most held)
/// carries a sustained load of at least [`OVERLOAD_SHARE`] × the candidates' mean and
/// [`OVERLOAD_EXCESS`] requests above the least loaded one's.
fn holders_overloaded(cycle: &Cycle<'_>, prompt: f64) -> bool {
    if prompt <= 0.0 || cycle.pods.len() < 2 {
        return false;
    }
    let loads: Vec<f64> = cycle
        .pods
        .iter()
        .map(|p| p.prefill.mean_in_flight.max(0.0))
        .collect();
    let mean = loads.iter().sum::<f64>() / loads.len() as f64;
    let least = loads.iter().copied().fold(f64::INFINITY, f64::min);
    let held = |i: usize| cycle.prefix_hit(i).cached_tokens.clamp(0.0, prompt);
    let most = most_held(cycle, prompt);
    if most <= 0.0 {
        return false;
    }
    (0..loads.len())
        .filter(|&i| held(i) >= most - COLD_SPREAD * prompt)
        .all(|i| loads[i] >= OVERLOAD_SHARE * mean && loads[i] >= least + OVERLOAD_EXCESS)
}

/// How many times the fleet's mean sustained load a holder must carry to be overloaded.
const OVERLOAD_SHARE: f64 = 2.0;

/// How many requests above the least loaded pod's sustained load a holder must carry to be
/// overloaded (a small fleet's mean moves by one request).
const OVERLOAD_EXCESS: f64 = 4.0;

/// The most of the prompt any candidate holds, in tokens.
fn most_held(cycle: &Cycle<'_>, prompt: f64) -> f64 {
    (0..cycle.pods.len())
        .map(|i| cycle.prefix_hit(i).cached_tokens.clamp(0.0, prompt))
        .fold(0.0, f64::max)
}

/// Share of a cold prompt its remembered home must cover for the request to count as a
/// returning prefix (one routed before and since evicted) rather than a new one.
// NOTE: a home covering less (a shared preamble before a new conversation) says little about
// where the rest should go; such a request is placed as new.
const RETURNING_SHARE: f64 = 0.5;

/// Tokens of other prefixes that placing `uncached` new tokens on `pod` evicts: the new
/// blocks beyond the pod's free ones (capacity from `cache_config_info`, occupancy from the
/// index). Unknown capacity counts as full (the safe side: it does not invite copies).
fn displacement_tokens(pod: &PodView, uncached: f64, params: &PlacementParams) -> f64 {
    let block = pod
        .metrics
        .as_ref()
        .and_then(|m| m.block_size)
        .filter(|b| *b > 0)
        .unwrap_or(params.default_block_size.max(1)) as f64;
    let free_blocks = pod
        .metrics
        .as_ref()
        .and_then(|m| m.num_blocks)
        .map_or(0.0, |capacity| {
            (capacity as f64 - pod.held_blocks as f64 - pod.prefill.backlog_tokens / block).max(0.0)
        });
    let new_blocks = (uncached / block).ceil();
    (new_blocks - free_blocks).max(0.0) * block
}

/// Writes `min cost / cost` per candidate into `out`.
pub fn score(cycle: &Cycle<'_>, params: &PlacementParams, out: &mut [f64]) {
    let costs = costs(cycle, params);
    if tracing::enabled!(tracing::Level::DEBUG) {
        explain(cycle, &costs);
    }
    let best = costs
        .iter()
        .map(|c| c.cost_ms)
        .fold(f64::INFINITY, f64::min);
    // The best among those predicted in time, when some are: the late ones rank last.
    let in_time = cycle.request.slo.is_set() && costs.iter().any(|c| c.meets_slo);
    let best = if in_time {
        costs
            .iter()
            .filter(|c| c.meets_slo)
            .map(|c| c.cost_ms)
            .fold(f64::INFINITY, f64::min)
    } else {
        best
    };
    for (slot, cost) in out.iter_mut().zip(&costs) {
        *slot = if in_time && !cost.meets_slo {
            0.0
        } else if cost.cost_ms <= MIN_COST_MS || !best.is_finite() {
            1.0
        } else {
            (best.max(MIN_COST_MS) / cost.cost_ms).clamp(0.0, 1.0)
        };
    }
}

/// Logs every candidate's cost and its parts (`RUST_LOG=kvpick::scheduling::placement=debug`):
/// what a user reads to see why a request went where it went.
fn explain(cycle: &Cycle<'_>, costs: &[PlacementCost]) {
    use std::fmt::Write;
    let mut text = String::new();
    for (i, (pod, cost)) in cycle.pods.iter().zip(costs).enumerate() {
        let cached = cycle.prefix_hit(i).cached_tokens;
        let (waiting, own) = pod
            .metrics
            .as_ref()
            .map_or((0.0, 0.0), |m| (m.waiting, m.own_awaiting));
        let _ = write!(
            text,
            "{} cost={:.0} ttft={:.0} decode={:.0} evict={:.0} holdup={:.0} cached={cached:.0} backlog={:.0} awaiting={:.0} waiting={waiting:.0} (own {own:.0}) in_flight={}; ",
            pod.id,
            cost.cost_ms,
            cost.ttft_ms,
            cost.decode_ms,
            cost.displacement_ms,
            cost.holdup_ms,
            pod.prefill.backlog_tokens,
            pod.prefill.awaiting,
            pod.in_flight,
        );
    }
    tracing::debug!(prompt = cycle.prompt_tokens, candidates = %text, "placement costs");
}

/// Whether a request with latency objectives can be served in time somewhere: a candidate
/// is predicted to meet them, or one is idle (nothing in flight from kvpick, nothing running
/// or waiting on the engine: its prediction rests on no load at all), or one has a cold cache
/// (< 2% used: a fresh pod whose fits are not yet worth much). llm-d's `latency-slo-admitter`
/// admits on the same three conditions.
pub fn slo_attainable(cycle: &Cycle<'_>, params: &PlacementParams) -> bool {
    if !cycle.request.slo.is_set() {
        return true;
    }
    let idle_or_cold = cycle.pods.iter().any(|pod| {
        let engine = pod.metrics.as_ref();
        let idle =
            pod.in_flight == 0 && engine.is_none_or(|m| m.waiting <= 0.0 && m.running <= 0.0);
        let cold = engine.is_some_and(|m| m.kv_usage < 0.02);
        idle || cold
    });
    idle_or_cold || costs(cycle, params).iter().any(|c| c.meets_slo)
}

/// Costs below this count as equal.
const MIN_COST_MS: f64 = 1.0;

/// The share each request kvpick has in flight on a pod adds to its cost: a near-tie break.
// NOTE: pods whose prefill queues and cache hits are alike (nothing shared, or all idle) cost
// about the same, and the pick then followed the noise of their fitted lines: on the
// no-sharing control that spread 15–27 requests per pod where round robin sends 20 each, and
// the fuller decode batches cost 10–22% ITL (docs/benchmarks.md). 2% per request in flight
// sends such a request to the least busy pod; a cache hit (most of a prefill saved) or a
// queued prefill is worth far more, so placement by prefix is unchanged.
const IN_FLIGHT_COST_SHARE: f64 = 0.02;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod timeline_tests;
