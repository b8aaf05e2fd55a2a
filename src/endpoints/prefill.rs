//! Each endpoint's prefill backlog, and its time to first token learned online.
//!
//! The backlog: uncached prompt tokens of the requests kvpick routed to the endpoint that have
//! not produced their first response byte yet — the prefill work queued ahead of the next
//! request, exact between scrapes for traffic kvpick routes (an engine's waiting count says
//! how many requests wait, not how long they are).
//!
//! The fit: when a streamed response's first byte arrives, the request's time from pick to
//! first byte is regressed on the prefill work it had to wait for (the backlog at its pick
//! plus its own uncached tokens): `ttft ≈ base_ms + slope_ms × work`, a least-squares line
//! over exponentially decayed sums (recent observations weigh most, so the fit follows a pod
//! whose speed changes). No sidecar and no offline training: the observations are the ones
//! kvpick sees on the response path anyway.
//!
//! The decode fit: the gaps between a streamed response's chunks, regressed on the decode
//! batch (kvpick's in-flight count on the pod when the chunk came): `gap ≈ step_ms +
//! ms_per_decode × in_flight` — what one more request in the batch costs every other one, per
//! token. With the mean chunks per response it prices a placement's decode load.
//!
//! NOTE: the gaps include the steps in which other requests prefilled, and a pod with more
//! requests in flight gets more of those, so the slope is a load-interference cost rather
//! than the engine's per-sequence step cost: ~10 ms per request on the simulator whose step
//! costs 1.2 ms per decoding sequence (session 12, no-sharing control). Learning only the
//! gaps no prefill of kvpick's overlapped recovers 1.2 ms, and was tried: with full caches at
//! 18 req/s kvpick's mean TTFT went 439 → 597 ms (smg 604 → 365 in the same two runs), as
//! `coldDecodeWeight` stopped spreading new prefixes, and the no-sharing control did not
//! improve; so the prefill stalls stay in the fit (docs/benchmarks.md, session 12).
//!
//! A fit is only as recent as its last observation. A pod whose first bytes were slow for a
//! while (a burst of cold prefills, a noisy neighbour) is predicted slow, so it is picked
//! only when every other pod looks worse, and nothing re-measures it: measured, a 48 req/s
//! cold start left one pod of 8 with a line of 1,355 ms + 0.05 ms/token against the others'
//! ~190 + 0.16, and it got no request for the rest of the run, 64 req/s included
//! (docs/benchmarks.md, session 38). So a TTFT fit with no first byte for [`FIT_MAX_AGE`]
//! is *in question*: while nothing of kvpick's awaits its first byte there, the pod is
//! predicted with the fleet's line (it is tried, one request at a time), and that request's
//! first byte settles it. At least [`REFIT_SPEEDUP`]× faster than the fit said: the fit is
//! dropped and learned afresh from the new first bytes (the fleet's line until there are
//! [`MIN_OBSERVATIONS`]). Otherwise the fit stands, fresh again. A decode fit with no gap for
//! as long is dropped: gaps come many per response, so it is learned again at once.
//! NOTE: a pod that is still slow costs one request per [`FIT_MAX_AGE`] at its slow speed.
//! Dropping every stale fit at once was tried first: an 8× slow pod then got 6 requests
//! within 2.3 s (each predicted with the fleet's line until its backlog outweighed it).
//! Decaying the fit with time (not tried) would keep the slow spell in the sums beside the
//! new first bytes, so a recovered pod would be predicted slow from the mix.
//!
//! Concurrency: the backlog is two atomics; the fit is a small mutex taken once per pick (to
//! read), once per response chunk and once per response end (to update), never across an
//! `.await`.
//! The backlog's fall is tied to the guard (first byte, or `Drop` for a response that ended,
//! failed or was abandoned), so no path can leak backlog.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Weight each older observation keeps per new one (an effective window of ~50).
const DECAY: f64 = 0.98;

/// Half-life of an endpoint's cache heat, seconds.
const HEAT_HALF_LIFE_S: f64 = 30.0;

/// Time constant of an endpoint's sustained load (its in-flight count averaged over time),
/// seconds: long against one request (a few seconds here) so that a pod's share of a
/// Poisson stream averages out, short against a shift in which prefixes are hot.
const LOAD_TIME_CONSTANT_S: f64 = 10.0;

/// Observations before a pod's own fit is used.
pub const MIN_OBSERVATIONS: u64 = 8;

/// Time after its last observation at which a fit is in question (as old as a pod's
/// sustained load remembers, [`LOAD_TIME_CONSTANT_S`]).
pub const FIT_MAX_AGE: Duration = Duration::from_secs(10);

/// How much faster than a fit in question a pod must answer for the fit to be learned afresh
/// (twice: far outside one first byte's usual spread around the line).
pub const REFIT_SPEEDUP: f64 = 2.0;

/// A line's slope bounds, ms per token (a fit outside is noise, not a pod).
const MIN_MS_PER_TOKEN: f64 = 1e-4;
const MAX_MS_PER_TOKEN: f64 = 100.0;

/// A fitted line `y_ms = base_ms + slope_ms × x`: time to first token against prefill work
/// (tokens), or time between response chunks against the decode batch (requests in flight).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct FittedLine {
    /// The time with `x = 0` (a step's fixed cost, the HTTP round trip).
    pub base_ms: f64,
    /// The time per unit of `x`: ms per token of prefill work, or ms per request decoding.
    pub slope_ms: f64,
}

impl FittedLine {
    /// The predicted time for `x`.
    pub fn predict_ms(&self, x: f64) -> f64 {
        self.base_ms + self.slope_ms * x.max(0.0)
    }
}

/// Exponentially decayed least-squares sums of one `(x, y)` relation.
#[derive(Debug, Default, Clone)]
struct DecayedLine {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    observations: u64,
    /// When the last observation was made (the latest, if they came out of order).
    last: Option<Instant>,
}

/// What a line does when its `x` barely varied (the slope is not identifiable).
#[derive(Debug, Clone, Copy)]
enum NoSpread {
    /// All of `y` is slope (TTFT: all of the time is prefill) — errs towards valuing cache
    /// hits, the safe side for placement.
    ThroughOrigin,
    /// `y` is flat (ITL: the batch size did not change, so its effect is unknown; assume
    /// none rather than invent one).
    Flat,
}

impl DecayedLine {
    /// Whether the last observation is older than [`FIT_MAX_AGE`] at `now`.
    fn is_stale(&self, now: Instant) -> bool {
        self.last
            .is_some_and(|last| now.saturating_duration_since(last) > FIT_MAX_AGE)
    }

    /// Adds an observation made at `now`.
    fn observe(&mut self, x: f64, y: f64, now: Instant) {
        self.last = Some(self.last.map_or(now, |last| last.max(now)));
        self.w = self.w * DECAY + 1.0;
        self.sx = self.sx * DECAY + x;
        self.sy = self.sy * DECAY + y;
        self.sxx = self.sxx * DECAY + x * x;
        self.sxy = self.sxy * DECAY + x * y;
        self.observations += 1;
    }

    /// The fitted line, however old: none before [`MIN_OBSERVATIONS`].
    fn line(&self, no_spread: NoSpread, max_slope: f64) -> Option<FittedLine> {
        if self.observations < MIN_OBSERVATIONS || self.w <= 0.0 {
            return None;
        }
        let mean_x = self.sx / self.w;
        let mean_y = self.sy / self.w;
        let var_x = self.sxx / self.w - mean_x * mean_x;
        let cov = self.sxy / self.w - mean_x * mean_y;
        let spread = var_x > (0.05 * mean_x).powi(2) && var_x > 0.25;
        let (base, slope) = if spread && cov > 0.0 {
            let slope = cov / var_x;
            (mean_y - slope * mean_x, slope)
        } else {
            match no_spread {
                NoSpread::ThroughOrigin if mean_x > 0.0 => (0.0, mean_y / mean_x),
                NoSpread::ThroughOrigin => return None,
                NoSpread::Flat => (mean_y, 0.0),
            }
        };
        let slope = match no_spread {
            NoSpread::ThroughOrigin => slope.clamp(MIN_MS_PER_TOKEN, max_slope),
            NoSpread::Flat => slope.clamp(0.0, max_slope),
        };
        let base = if base.is_finite() { base.max(0.0) } else { 0.0 };
        (slope.is_finite() && base.is_finite()).then_some(FittedLine {
            base_ms: base,
            slope_ms: slope,
        })
    }
}

/// Most ms one more decoding request can add to a step (a fit above is noise).
const MAX_MS_PER_DECODE: f64 = 1_000.0;

/// The decayed mean after its `n`-th value `x` (the first value is the mean).
fn decayed_mean(mean: f64, x: f64, n: u64) -> f64 {
    if n <= 1 {
        x
    } else {
        mean * DECAY + x * (1.0 - DECAY)
    }
}

/// An endpoint's learned timing.
#[derive(Debug, Default, Clone)]
struct Fit {
    /// Time to first byte against the prefill work it waited for.
    ttft: DecayedLine,
    /// Time between a streamed response's chunks against kvpick's in-flight count there.
    itl: DecayedLine,
    /// Decayed mean of uncached tokens per request (sizes the requests kvpick did not route).
    mean_uncached: f64,
    /// Decayed mean of chunks per streamed response (0 before one ended).
    mean_chunks: f64,
    responses: u64,
    /// Cached tokens routed there, decayed with [`HEAT_HALF_LIFE_S`] (as of `heat_at`).
    heat: f64,
    heat_at: Option<Instant>,
    /// Requests in flight there, averaged over time with [`LOAD_TIME_CONSTANT_S`] (as of
    /// `load_at`), from the counts the scheduler saw.
    load: f64,
    load_at: Option<Instant>,
}

impl Fit {
    fn observe_first_byte(&mut self, work: f64, ttft_ms: f64, uncached: f64, now: Instant) {
        if self.ttft.is_stale(now) {
            // The first byte that settles a fit in question.
            let stands = self
                .ttft
                .line(NoSpread::ThroughOrigin, MAX_MS_PER_TOKEN)
                .is_some_and(|line| ttft_ms * REFIT_SPEEDUP > line.predict_ms(work));
            if !stands {
                self.ttft = DecayedLine::default();
            }
        }
        self.ttft.observe(work, ttft_ms, now);
        self.mean_uncached = decayed_mean(self.mean_uncached, uncached, self.ttft.observations);
    }

    fn observe_gap(&mut self, in_flight: f64, gap_ms: f64, now: Instant) {
        if self.itl.is_stale(now) {
            self.itl = DecayedLine::default();
        }
        self.itl.observe(in_flight, gap_ms, now);
    }

    fn observe_response(&mut self, chunks: f64) {
        self.responses += 1;
        self.mean_chunks = decayed_mean(self.mean_chunks, chunks, self.responses);
    }

    fn heat_at(&self, now: Instant) -> f64 {
        match self.heat_at {
            Some(at) => {
                let age = now.saturating_duration_since(at).as_secs_f64();
                self.heat * (-age * std::f64::consts::LN_2 / HEAT_HALF_LIFE_S).exp()
            }
            None => 0.0,
        }
    }

    fn add_heat(&mut self, cached: f64, now: Instant) {
        self.heat = self.heat_at(now) + cached;
        self.heat_at = Some(now);
    }

    /// Averages `in_flight`, seen at `now`, into the sustained load: the count is taken to
    /// have held since the last one seen (samples come with every scheduling pass).
    fn observe_load(&mut self, in_flight: f64, now: Instant) {
        self.load = match self.load_at {
            Some(at) if now > at => {
                let age = now.saturating_duration_since(at).as_secs_f64();
                let keep = (-age / LOAD_TIME_CONSTANT_S).exp();
                self.load * keep + in_flight * (1.0 - keep)
            }
            Some(_) => self.load,
            // NOTE: the first sample starts the average at 0, not at itself: a pod that
            // joins busy is not called overloaded before it has been seen for a while.
            None => 0.0,
        };
        self.load_at = Some(now);
    }
}

/// One endpoint's prefill backlog and fitted time to first token.
#[derive(Debug, Default)]
pub struct PrefillLoad {
    backlog_tokens: AtomicU64,
    awaiting: AtomicU64,
    fit: Mutex<Fit>,
}

/// A snapshot of an endpoint's prefill state, read once per scheduling cycle.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct PrefillView {
    /// Uncached tokens of kvpick's requests awaiting their first byte.
    pub backlog_tokens: f64,
    /// Those requests.
    pub awaiting: f64,
    /// Its fitted time to first token against prefill work, once it has
    /// [`MIN_OBSERVATIONS`] first bytes; none while the fit is in question and nothing
    /// awaits there (see the module doc).
    pub line: Option<FittedLine>,
    /// Its fitted time between response chunks against its decode batch (kvpick's
    /// in-flight count), once it has [`MIN_OBSERVATIONS`] gaps, the last within
    /// [`FIT_MAX_AGE`].
    pub itl: Option<FittedLine>,
    /// The decayed mean of uncached tokens per request (0 before any observation).
    pub mean_uncached_tokens: f64,
    /// The decayed mean of chunks per streamed response (0 before one ended).
    pub mean_output_chunks: f64,
    /// How valuable its cache is: prompt tokens routed there that it held (cache hits),
    /// decayed with a 30 s half-life. A pod serving many hot prefixes is expensive to evict.
    pub heat_tokens: f64,
    /// Its sustained load: requests in flight there averaged over the last ~10 s (0 before
    /// the scheduler has seen it; [`PrefillLoad::view_loaded`]).
    pub mean_in_flight: f64,
}

/// What one first byte taught: the prediction made at the pick and what happened.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftObservation {
    /// Predicted at the pick, ms (when the scheduler predicted one).
    pub predicted_ms: Option<f64>,
    /// Observed, ms.
    pub observed_ms: f64,
}

impl PrefillLoad {
    fn lock(&self) -> MutexGuard<'_, Fit> {
        // NOTE: plain sums; a panic mid-update loses at most one observation.
        self.fit.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// kvpick's requests there awaiting their first byte, now.
    pub fn awaiting(&self) -> u64 {
        self.awaiting.load(Ordering::Relaxed)
    }

    /// The endpoint's state at `now`.
    pub fn view(&self, now: Instant) -> PrefillView {
        self.view_with(&self.lock(), now)
    }

    /// The endpoint's state at `now`, with `in_flight` (what the scheduler sees there now)
    /// averaged into its sustained load first.
    pub fn view_loaded(&self, now: Instant, in_flight: u64) -> PrefillView {
        let mut fit = self.lock();
        fit.observe_load(in_flight as f64, now);
        self.view_with(&fit, now)
    }

    fn view_with(&self, fit: &Fit, now: Instant) -> PrefillView {
        let awaiting = self.awaiting.load(Ordering::Relaxed);
        // A fit in question, with nothing awaiting there: the pod is tried on the fleet's
        // line. With a request awaiting, the fit holds until that request settles it.
        let line = fit.ttft.line(NoSpread::ThroughOrigin, MAX_MS_PER_TOKEN);
        let line = line.filter(|_| awaiting > 0 || !fit.ttft.is_stale(now));
        let itl = fit.itl.line(NoSpread::Flat, MAX_MS_PER_DECODE);
        PrefillView {
            backlog_tokens: self.backlog_tokens.load(Ordering::Relaxed) as f64,
            awaiting: awaiting as f64,
            line,
            itl: itl.filter(|_| !fit.itl.is_stale(now)),
            mean_uncached_tokens: fit.mean_uncached,
            mean_output_chunks: fit.mean_chunks,
            heat_tokens: fit.heat_at(now),
            mean_in_flight: fit.load,
        }
    }

    /// Counts a routed request's `uncached_tokens` in the backlog until its first byte and
    /// its `cached_tokens` in the heat; `predicted_ms` is kept to report the model's error.
    pub fn start(
        self: &Arc<Self>,
        uncached_tokens: f64,
        cached_tokens: f64,
        predicted_ms: Option<f64>,
        now: Instant,
    ) -> PrefillGuard {
        if cached_tokens.is_finite() && cached_tokens > 0.0 {
            self.lock().add_heat(cached_tokens, now);
        }
        let tokens = if uncached_tokens.is_finite() {
            uncached_tokens.max(0.0).round() as u64
        } else {
            0
        };
        let ahead = self.backlog_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.awaiting.fetch_add(1, Ordering::Relaxed);
        PrefillGuard {
            load: Arc::clone(self),
            tokens,
            work: ahead.saturating_add(tokens),
            predicted_ms,
            started: now,
            open: true,
            last_chunk: None,
            chunks: 0,
        }
    }

    fn release(&self, tokens: u64) {
        // Saturating: the guard is the only writer of its own tokens, so this never goes
        // below zero in practice; the update loop makes that hold even if it did.
        let _ = self
            .backlog_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(b.saturating_sub(tokens))
            });
        let _ = self
            .awaiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(1))
            });
    }
}

/// Holds one request's tokens in an endpoint's backlog until its first byte (or drop).
#[derive(Debug)]
pub struct PrefillGuard {
    load: Arc<PrefillLoad>,
    tokens: u64,
    /// The backlog ahead of it at the pick plus its own tokens.
    work: u64,
    predicted_ms: Option<f64>,
    started: Instant,
    open: bool,
    /// When the last response chunk came (after the first byte).
    last_chunk: Option<Instant>,
    /// Response chunks so far.
    chunks: u64,
}

impl PrefillGuard {
    /// A later response chunk arrived at `now` with `in_flight` requests of kvpick's on the
    /// pod: the gap since the previous chunk teaches the decode fit.
    pub fn chunk(&mut self, now: Instant, in_flight: u64) {
        let Some(last) = self.last_chunk else {
            return;
        };
        let gap_ms = now.saturating_duration_since(last).as_secs_f64() * 1e3;
        self.last_chunk = Some(now);
        self.chunks += 1;
        self.load.lock().observe_gap(in_flight as f64, gap_ms, now);
    }

    /// The first response byte arrived at `now`: leaves the backlog and teaches the fit
    /// (once; later calls return `None`).
    pub fn first_byte(&mut self, now: Instant) -> Option<TtftObservation> {
        if !self.open {
            return None;
        }
        self.open = false;
        self.load.release(self.tokens);
        let observed_ms = now.saturating_duration_since(self.started).as_secs_f64() * 1e3;
        self.load
            .lock()
            .observe_first_byte(self.work as f64, observed_ms, self.tokens as f64, now);
        self.last_chunk = Some(now);
        self.chunks = 1;
        Some(TtftObservation {
            predicted_ms: self.predicted_ms,
            observed_ms,
        })
    }
}

impl Drop for PrefillGuard {
    fn drop(&mut self) {
        if self.open {
            self.load.release(self.tokens);
        } else if self.chunks > 0 {
            // A streamed response that ended (or broke): its length sizes the next ones.
            self.load.lock().observe_response(self.chunks as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A pod with known costs: 20 ms base, 0.4 ms per token of work, FCFS.
    fn simulate(load: &Arc<PrefillLoad>, requests: &[f64]) {
        let t0 = Instant::now();
        let mut guards: Vec<PrefillGuard> = requests
            .iter()
            .map(|tokens| load.start(*tokens, 0.0, None, t0))
            .collect();
        for guard in &mut guards {
            let ttft = 20.0 + 0.4 * guard.work as f64;
            guard.first_byte(t0 + Duration::from_secs_f64(ttft / 1e3));
        }
    }

    #[test]
    fn the_fit_converges_on_a_pod_with_known_costs() {
        let load = Arc::new(PrefillLoad::default());
        assert_eq!(load.view(Instant::now()).line, None, "no observations yet");
        for round in 0..40 {
            let sizes: Vec<f64> = (0..4)
                .map(|i| 100.0 + 300.0 * ((round + i) % 5) as f64)
                .collect();
            simulate(&load, &sizes);
        }
        let line = load.view(Instant::now()).line.expect("fitted");
        assert!((line.slope_ms - 0.4).abs() < 0.01, "{line:?}");
        assert!((line.base_ms - 20.0).abs() < 2.0, "{line:?}");
        let view = load.view(Instant::now());
        assert_eq!(view.backlog_tokens, 0.0, "every guard left the backlog");
        assert_eq!(view.awaiting, 0.0);
    }

    /// `n` first bytes at `at`, of requests of `tokens` each started then, on a pod taking
    /// `base_ms + ms_per_token × tokens` (alone: each waited for nothing else).
    fn observe_alone(
        load: &Arc<PrefillLoad>,
        at: Instant,
        n: usize,
        base_ms: f64,
        ms_per_token: f64,
    ) {
        for i in 0..n {
            let tokens = 200.0 + 100.0 * (i % 4) as f64;
            let mut guard = load.start(tokens, 0.0, None, at);
            let ttft = base_ms + ms_per_token * tokens;
            guard.first_byte(at + Duration::from_secs_f64(ttft / 1e3));
        }
    }

    #[test]
    fn a_fit_nobody_refreshed_is_tried_one_request_at_a_time_and_kept_or_learned_afresh() {
        let load = Arc::new(PrefillLoad::default());
        let t0 = Instant::now();
        // A slow spell: 50 first bytes of a pod at 1,000 ms + 2 ms per token.
        observe_alone(&load, t0, 50, 1_000.0, 2.0);
        let slow = load.view(t0 + Duration::from_secs(1)).line.expect("fitted");
        assert!((slow.slope_ms - 2.0).abs() < 0.01, "{slow:?}");
        // The last first byte: 1,000 + 2 × 500 ms after the start. The fit is the pod's up
        // to the age limit, in question after it: no line while nothing awaits there (the
        // placement then predicts the pod with the fleet's line).
        let last = t0 + Duration::from_secs(2);
        assert_eq!(load.view(last + FIT_MAX_AGE).line, Some(slow));
        let later = last + FIT_MAX_AGE + Duration::from_millis(1);
        assert_eq!(load.view(later).line, None, "a fit in question");
        // One request tried there: until it answers, the old fit holds (no second one is
        // sent on the fleet's line).
        let mut probe = load.start(300.0, 0.0, None, later);
        assert_eq!(load.view(later).line, Some(slow));
        // It answers as slowly as the fit said: the fit stands, fresh again.
        let answered = later + Duration::from_millis(1_500);
        assert!(probe.first_byte(answered).is_some());
        drop(probe);
        let kept = load.view(answered).line.expect("the fit stands");
        assert!((kept.slope_ms - 2.0).abs() < 0.1, "{kept:?}");
        // In question again later; this time the pod answers 5× faster than the fit says:
        // the slow spell is dropped, and the pod is learned afresh from the new first bytes
        // alone (the fleet's line until there are enough of them).
        let again = answered + FIT_MAX_AGE + Duration::from_millis(1);
        assert_eq!(load.view(again).line, None);
        let mut probe = load.start(300.0, 0.0, None, again);
        probe.first_byte(again + Duration::from_millis(140));
        drop(probe);
        let fresh_from = again + Duration::from_secs(1);
        assert_eq!(load.view(fresh_from).line, None, "one first byte is no fit");
        observe_alone(
            &load,
            fresh_from,
            (MIN_OBSERVATIONS - 2) as usize,
            20.0,
            0.4,
        );
        assert_eq!(load.view(fresh_from + Duration::from_secs(1)).line, None);
        observe_alone(&load, fresh_from, 12, 20.0, 0.4);
        let fresh = load
            .view(fresh_from + Duration::from_secs(1))
            .line
            .expect("refitted");
        assert!((fresh.slope_ms - 0.4).abs() < 0.05, "{fresh:?}");
        assert!(fresh.base_ms < 40.0, "{fresh:?}");
    }

    #[test]
    fn a_decode_fit_nobody_refreshed_is_dropped_too() {
        let load = Arc::new(PrefillLoad::default());
        let t0 = Instant::now();
        let mut guard = load.start(100.0, 0.0, None, t0);
        guard.first_byte(t0);
        for i in 1..=20u64 {
            guard.chunk(t0 + Duration::from_millis(50 * i), i % 5);
        }
        let at = t0 + Duration::from_secs(1);
        assert!(load.view(at).itl.is_some(), "fitted");
        assert!(
            load.view(at + FIT_MAX_AGE).itl.is_some(),
            "the last gap came at 1 s"
        );
        assert_eq!(
            load.view(at + FIT_MAX_AGE + Duration::from_millis(1)).itl,
            None
        );
    }

    #[test]
    fn the_fit_follows_a_pod_that_slows_down() {
        let load = Arc::new(PrefillLoad::default());
        for _ in 0..30 {
            simulate(&load, &[500.0, 1000.0]);
        }
        // Now twice as slow.
        let t0 = Instant::now();
        for _ in 0..150 {
            let mut a = load.start(500.0, 0.0, None, t0);
            a.first_byte(t0 + Duration::from_secs_f64((40.0 + 0.8 * 500.0) / 1e3));
            let mut b = load.start(1500.0, 0.0, None, t0);
            b.first_byte(t0 + Duration::from_secs_f64((40.0 + 0.8 * 1500.0) / 1e3));
        }
        let line = load.view(Instant::now()).line.expect("fitted");
        assert!((line.slope_ms - 0.8).abs() < 0.05, "{line:?}");
    }

    #[test]
    fn one_work_size_falls_back_to_a_line_through_the_origin() {
        let load = Arc::new(PrefillLoad::default());
        let t0 = Instant::now();
        for _ in 0..10 {
            let mut g = load.start(1000.0, 0.0, Some(90.0), t0);
            let seen = g
                .first_byte(t0 + Duration::from_millis(100))
                .expect("first");
            assert_eq!(seen.predicted_ms, Some(90.0));
            assert!((seen.observed_ms - 100.0).abs() < 1e-6);
            assert_eq!(g.first_byte(t0 + Duration::from_millis(200)), None, "once");
        }
        let line = load.view(Instant::now()).line.expect("fitted");
        assert_eq!(line.base_ms, 0.0);
        assert!((line.slope_ms - 0.1).abs() < 1e-9, "{line:?}");
    }

    #[test]
    fn the_backlog_counts_requests_until_first_byte_or_drop() {
        let load = Arc::new(PrefillLoad::default());
        let t0 = Instant::now();
        let mut a = load.start(300.0, 0.0, None, t0);
        let b = load.start(200.0, 0.0, None, t0);
        let _c = load.start(f64::NAN, f64::NAN, None, t0);
        let view = load.view(Instant::now());
        assert_eq!((view.backlog_tokens, view.awaiting), (500.0, 3.0));
        a.first_byte(t0);
        assert_eq!(load.view(Instant::now()).backlog_tokens, 200.0);
        drop(b);
        drop(a);
        let view = load.view(Instant::now());
        assert_eq!((view.backlog_tokens, view.awaiting), (0.0, 1.0));
        assert_eq!(view.heat_tokens, 0.0, "nothing cached was routed");
    }

    #[test]
    fn the_decode_fit_learns_what_one_more_request_in_flight_costs() {
        // Steps of 25 ms plus 1.2 ms per request decoding; responses of 10 chunks.
        let load = Arc::new(PrefillLoad::default());
        let t0 = Instant::now();
        for round in 0..30u64 {
            let batch = 1 + round % 12;
            let mut g = load.start(100.0, 0.0, None, t0);
            let mut at = t0 + Duration::from_millis(50);
            g.first_byte(at);
            for _ in 1..10 {
                at += Duration::from_secs_f64((25.0 + 1.2 * batch as f64) / 1e3);
                g.chunk(at, batch);
            }
        }
        let view = load.view(Instant::now());
        let itl = view.itl.expect("fitted");
        assert!((itl.slope_ms - 1.2).abs() < 0.01, "{itl:?}");
        assert!((itl.base_ms - 25.0).abs() < 0.2, "{itl:?}");
        assert!((view.mean_output_chunks - 10.0).abs() < 1e-6);
        // One batch size only: no slope is invented.
        let flat = Arc::new(PrefillLoad::default());
        let mut g = flat.start(100.0, 0.0, None, t0);
        g.first_byte(t0);
        for i in 1..20u64 {
            g.chunk(t0 + Duration::from_millis(30 * i), 4);
        }
        let itl = flat.view(Instant::now()).itl.expect("fitted");
        assert_eq!(itl.slope_ms, 0.0);
        assert!((itl.base_ms - 30.0).abs() < 1e-6, "{itl:?}");
    }

    #[test]
    fn the_sustained_load_averages_in_flight_counts_over_time() {
        let load = PrefillLoad::default();
        let t0 = Instant::now();
        assert_eq!(load.view_loaded(t0, 30).mean_in_flight, 0.0, "starts at 0");
        // 30 in flight for one time constant: 1 − 1/e of the way there.
        let after = load.view_loaded(t0 + Duration::from_secs(10), 30);
        assert!((after.mean_in_flight - 30.0 * (1.0 - (-1.0f64).exp())).abs() < 1e-9);
        // Many samples close together move it no more than one sample over the same time.
        let busy = PrefillLoad::default();
        busy.view_loaded(t0, 0);
        for ms in (100..=10_000).step_by(100) {
            busy.view_loaded(t0 + Duration::from_millis(ms), 30);
        }
        let sampled = busy.view(t0 + Duration::from_secs(10)).mean_in_flight;
        assert!((sampled - after.mean_in_flight).abs() < 1e-9, "{sampled}");
        // A burst of a second's length barely moves it.
        let calm = PrefillLoad::default();
        calm.view_loaded(t0, 2);
        calm.view_loaded(t0 + Duration::from_secs(30), 2);
        calm.view_loaded(t0 + Duration::from_secs(31), 40);
        let burst = calm.view(t0).mean_in_flight;
        assert!(burst < 6.0, "{burst}");
    }

    #[test]
    fn heat_counts_cached_tokens_routed_and_halves_every_thirty_seconds() {
        let load = Arc::new(PrefillLoad::default());
        let t0 = Instant::now();
        drop(load.start(100.0, 2000.0, None, t0));
        drop(load.start(100.0, 1000.0, None, t0 + Duration::from_secs(30)));
        let heat = load.view(t0 + Duration::from_secs(30)).heat_tokens;
        assert!((heat - 2000.0).abs() < 1e-6, "{heat}");
        let later = load.view(t0 + Duration::from_secs(60)).heat_tokens;
        assert!((later - 1000.0).abs() < 1e-6, "{later}");
    }
}
