//! Picks whose observing stream has not arrived yet (split filters:
//! `crate::extproc::handoff`).
//!
//! With the routing and observing filters split, the request is counted on its pod by the
//! observing stream, which starts after the gateway has applied the pick. One connection's
//! messages are read in order, so when a burst of requests arrives together all of their
//! picks are made before any of their observing streams is read: the picks did not see each
//! other, and the whole burst went to whichever pod looked best at its start (measured on the
//! multi-turn benchmark: 5 cold requests onto one pod within 10 ms, 1–2 s to their first
//! token where the fleet's mean was 0.2 s; docs/benchmarks.md, session 35).
//!
//! So the pick reserves its place itself: it counts in flight (as a reservation, which this
//! replica's scheduling sees and its peers are not told of) and in the pod's prefill backlog,
//! here, under a token the hand-off carries. The observing stream on this replica takes the
//! reservation over ([`PendingPicks::take`]): no count is doubled, and the request's time to
//! first token runs from the pick. An observing stream on another replica finds nothing and
//! counts the request itself; this replica's reservation then lapses after
//! [`RESERVATION_TTL`].
//!
//! Concurrency: one mutex for the table, taken once per pick, once per observing stream and
//! once per scheduling pass (the sweep), never across an `.await`; the entries are few (picks
//! of the last milliseconds) and bounded by [`MAX_PENDING`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::load::{InFlightGuard, InFlightReservation};
use super::pod::PodId;
use super::prefill::PrefillGuard;

/// How long a pick stays reserved while its observing stream has not arrived.
// NOTE: the gateway starts the observing stream right after it applies the pick, so on this
// replica the wait is the time the connection takes to read it (milliseconds, a burst's
// picks at most). Longer only matters with several replicas, where about half of the
// observing streams are another replica's: their reservations are phantoms here until they
// lapse, so the bound is kept short.
pub const RESERVATION_TTL: Duration = Duration::from_millis(250);

/// Most picks reserved at once; the oldest lapses first beyond it.
pub const MAX_PENDING: usize = 4096;

/// The picks awaiting their observing stream.
#[derive(Debug)]
pub struct PendingPicks {
    next_token: AtomicU64,
    entries: Mutex<VecDeque<PendingPick>>,
}

/// One reserved pick.
#[derive(Debug)]
struct PendingPick {
    token: u64,
    pod: PodId,
    made: Instant,
    in_flight: InFlightReservation,
    prefill: PrefillGuard,
}

/// A pick its observing stream took over.
#[derive(Debug)]
pub struct TakenPick {
    /// The request's in-flight count, now this replica's own.
    pub in_flight: InFlightGuard,
    /// Its share of the pod's prefill backlog, timed from the pick.
    pub prefill: PrefillGuard,
    /// How long it waited for its observing stream.
    pub waited: Duration,
}

impl Default for PendingPicks {
    fn default() -> Self {
        Self {
            // Random per replica: a token handed to another replica's observing stream finds
            // nothing there (its own tokens start elsewhere in the 64-bit space).
            next_token: AtomicU64::new(fastrand::u64(..)),
            entries: Mutex::default(),
        }
    }
}

impl PendingPicks {
    fn lock(&self) -> MutexGuard<'_, VecDeque<PendingPick>> {
        // NOTE: a panic mid-update leaves at worst a reservation that lapses later.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps a pick of `pod` made at `now` counted (`in_flight` reserved there, `prefill`
    /// its share of the pod's backlog) until its observing stream takes it over. Returns the
    /// hand-off's token and how many older reservations lapsed.
    pub fn reserve(
        &self,
        pod: PodId,
        in_flight: InFlightReservation,
        prefill: PrefillGuard,
        now: Instant,
    ) -> (u64, usize) {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let pick = PendingPick {
            token,
            pod,
            made: now,
            in_flight,
            prefill,
        };
        let mut entries = self.lock();
        let mut lapsed = Self::sweep_locked(&mut entries, now);
        if entries.len() >= MAX_PENDING {
            entries.pop_front();
            lapsed += 1;
        }
        entries.push_back(pick);
        (token, lapsed)
    }

    /// The pick reserved under `token` for `pod`, taken over at `now` (`None`: another
    /// replica's pick, an older version's hand-off, or one that lapsed), and how many
    /// reservations lapsed.
    pub fn take(&self, token: u64, pod: PodId, now: Instant) -> (Option<TakenPick>, usize) {
        let mut entries = self.lock();
        let lapsed = Self::sweep_locked(&mut entries, now);
        let found = entries
            .iter()
            .position(|p| p.token == token && p.pod == pod)
            .and_then(|i| entries.remove(i));
        drop(entries);
        let taken = found.map(|pick| TakenPick {
            waited: now.saturating_duration_since(pick.made),
            in_flight: pick.in_flight.confirm(),
            prefill: pick.prefill,
        });
        (taken, lapsed)
    }

    /// Lets the reservations older than [`RESERVATION_TTL`] at `now` lapse; how many did.
    pub fn sweep(&self, now: Instant) -> usize {
        Self::sweep_locked(&mut self.lock(), now)
    }

    /// Picks reserved now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no pick is reserved.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn sweep_locked(entries: &mut VecDeque<PendingPick>, now: Instant) -> usize {
        let mut lapsed = 0;
        while entries
            .front()
            .is_some_and(|p| now.saturating_duration_since(p.made) > RESERVATION_TTL)
        {
            entries.pop_front();
            lapsed += 1;
        }
        lapsed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{InFlight, PrefillLoad};
    use std::sync::Arc;

    /// One endpoint's live counts (as `EndpointState` holds them).
    struct Pod {
        id: PodId,
        in_flight: Arc<InFlight>,
        prefill: Arc<PrefillLoad>,
    }

    impl Pod {
        fn id(&self) -> PodId {
            self.id
        }
    }

    fn endpoint(port: u16) -> Pod {
        Pod {
            id: format!("10.0.0.1:{port}").parse().expect("addr"),
            in_flight: Arc::default(),
            prefill: Arc::default(),
        }
    }

    /// Reserves a pick of `pod` as the routing stream does.
    fn reserve(
        pending: &PendingPicks,
        pod: &Pod,
        uncached: f64,
        predicted_ms: Option<f64>,
        now: Instant,
    ) -> (u64, usize) {
        let prefill = pod.prefill.start(uncached, 0.0, predicted_ms, now);
        pending.reserve(pod.id(), pod.in_flight.reserve(), prefill, now)
    }

    #[test]
    fn a_reserved_pick_counts_until_its_observing_stream_takes_it_over() {
        let pending = PendingPicks::default();
        let pod = endpoint(8000);
        let t0 = Instant::now();
        let (token, lapsed) = reserve(&pending, &pod, 1200.0, Some(90.0), t0);
        assert_eq!(lapsed, 0);
        let view = pod.prefill.view(t0);
        assert_eq!((view.backlog_tokens, view.awaiting), (1200.0, 1.0));
        assert_eq!((pod.in_flight.get(), pod.in_flight.local()), (1, 0));

        let other = endpoint(8001);
        let (wrong_pod, _) = pending.take(token, other.id(), t0);
        assert!(wrong_pod.is_none(), "a token is only its pod's");
        let (wrong_token, _) = pending.take(token.wrapping_add(1), pod.id(), t0);
        assert!(wrong_token.is_none());

        let later = t0 + Duration::from_millis(3);
        let (taken, _) = pending.take(token, pod.id(), later);
        let mut taken = taken.expect("taken over");
        assert_eq!(taken.waited, Duration::from_millis(3));
        assert_eq!((pod.in_flight.get(), pod.in_flight.local()), (1, 1));
        assert_eq!(
            pod.prefill.view(later).backlog_tokens,
            1200.0,
            "not doubled"
        );
        assert!(pending.is_empty());
        let (again, _) = pending.take(token, pod.id(), later);
        assert!(again.is_none(), "taken once");

        // The first byte is timed from the pick, not from the observing stream.
        let observed = taken
            .prefill
            .first_byte(t0 + Duration::from_millis(50))
            .expect("first byte");
        assert_eq!(observed.observed_ms, 50.0);
        assert_eq!(observed.predicted_ms, Some(90.0));
        assert_eq!(pod.prefill.view(later).backlog_tokens, 0.0);
        drop(taken);
        assert_eq!(pod.in_flight.get(), 0);
    }

    #[test]
    fn a_pick_observed_elsewhere_lapses_and_counts_nowhere() {
        let pending = PendingPicks::default();
        let pod = endpoint(8000);
        let t0 = Instant::now();
        let (token, _) = reserve(&pending, &pod, 500.0, None, t0);
        let (_, _) = reserve(&pending, &pod, 700.0, None, t0 + RESERVATION_TTL);
        assert_eq!(pod.in_flight.get(), 2);
        assert_eq!(pending.sweep(t0 + RESERVATION_TTL), 0, "not yet");
        let late = t0 + RESERVATION_TTL + Duration::from_millis(1);
        assert_eq!(pending.sweep(late), 1, "the first lapsed");
        assert_eq!(pod.in_flight.get(), 1);
        assert_eq!(pod.prefill.view(late).backlog_tokens, 700.0);
        let (taken, _) = pending.take(token, pod.id(), late);
        assert!(
            taken.is_none(),
            "a lapsed pick is counted afresh by its observer"
        );
        assert_eq!(pending.len(), 1);
    }

    #[test]
    fn the_table_is_bounded_and_the_oldest_lapses_first() {
        let pending = PendingPicks::default();
        let pod = endpoint(8000);
        let t0 = Instant::now();
        let (first, _) = reserve(&pending, &pod, 1.0, None, t0);
        let mut lapsed = 0;
        for _ in 1..MAX_PENDING + 10 {
            lapsed += reserve(&pending, &pod, 1.0, None, t0).1;
        }
        assert_eq!(lapsed, 10);
        assert_eq!(pending.len(), MAX_PENDING);
        assert_eq!(pod.in_flight.get(), MAX_PENDING as u64);
        assert!(
            pending.take(first, pod.id(), t0).0.is_none(),
            "the oldest went"
        );
    }
}
