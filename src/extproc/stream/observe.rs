//! The two halves of a split request ([`super::super::handoff`]): the routing stream's pick
//! is counted on its pod as a reservation (`crate::endpoints::PendingPicks`); an observing
//! stream's request headers carry the hand-off, and from then on that stream counts the
//! request in flight and awaiting its first byte on the picked pod, taking the reservation
//! over when it is this replica's.

use std::time::Instant;

use crate::pb::envoy::config::core::v3::Metadata;

use super::{Phase, RequestStream, Routed};
use crate::endpoints::{EndpointState, PodId};
use crate::extproc::handoff::{PICK_NAMESPACE, PickHandoff};
use crate::scheduling::Pick;

/// What an observing stream found in its request headers (the metric's label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Observed {
    /// A pick's hand-off for a pod of the pool: its response is followed.
    Pick,
    /// No hand-off: the request failed open, or kvpick answered it itself.
    NotRouted,
    /// A hand-off that could not be read.
    BadHandoff,
    /// The hand-off names a pod that is no longer in the pool.
    UnknownEndpoint,
}

impl Observed {
    fn label(self) -> &'static str {
        match self {
            Self::Pick => "observed",
            Self::NotRouted => "not_routed",
            Self::BadHandoff => "bad_handoff",
            Self::UnknownEndpoint => "unknown_endpoint",
        }
    }
}

impl RequestStream {
    /// An observing stream's request headers: the routing stream's hand-off says which pod
    /// the request went to and what the pick expected; from now on this stream counts the
    /// request in flight and awaiting its first byte there.
    pub(super) fn observe_pick(&mut self, metadata: Option<&Metadata>) {
        let observed = match PickHandoff::from_metadata(metadata) {
            Ok(Some(pick)) => self.follow(pick),
            Ok(None) => Observed::NotRouted,
            Err(error) => {
                tracing::warn!(%error, namespace = PICK_NAMESPACE, "observing stream: unreadable pick hand-off");
                Observed::BadHandoff
            }
        };
        self.count_observed(observed);
        self.phase = if observed == Observed::Pick {
            Phase::AwaitResponse
        } else {
            Phase::Done
        };
    }

    fn follow(&mut self, pick: PickHandoff) -> Observed {
        let pod = PodId(pick.endpoint);
        let pool = self.ctx.datastore.snapshot();
        let Some(endpoint) = pool.get(pod) else {
            tracing::debug!(%pod, "observing stream: the picked pod left the pool");
            return Observed::UnknownEndpoint;
        };
        let reserved = pick.reservation.and_then(|token| {
            let (taken, lapsed) = self
                .ctx
                .datastore
                .pending()
                .take(token, pod, Instant::now());
            self.count_reservations("lapsed", lapsed);
            taken
        });
        match reserved {
            Some(taken) => {
                self.count_reservations("taken", 1);
                self.in_flight = Some(taken.in_flight);
                self.prefill = Some(taken.prefill);
            }
            // Another replica's pick, an older one's hand-off, or a lapsed reservation.
            None => self.count_on(
                endpoint,
                pick.uncached_tokens,
                pick.cached_tokens,
                pick.predicted_ms,
            ),
        }
        self.streamed = pick.streamed;
        self.routed = Some(Routed {
            pod,
            labels: pick.labels,
        });
        Observed::Pick
    }

    /// A split pick: counted on `endpoint` from now until its observing stream takes it
    /// over (or the reservation lapses); the hand-off carries the token.
    pub(super) fn reserve_pick(&mut self, endpoint: &EndpointState, pick: &Pick) {
        let now = Instant::now();
        let prefill = endpoint.prefill.start(
            pick.expected.uncached_tokens.unwrap_or(0.0),
            pick.expected.cached_tokens,
            pick.expected.ttft_ms,
            now,
        );
        let (token, lapsed) = self.ctx.datastore.pending().reserve(
            endpoint.id(),
            endpoint.in_flight.reserve(),
            prefill,
            now,
        );
        self.count_reservations("lapsed", lapsed);
        self.reservation = Some(token);
    }

    /// Lets reservations whose observing stream did not come lapse before a pick reads the
    /// pods' load.
    pub(super) fn sweep_reservations(&self) {
        let lapsed = self.ctx.datastore.pending().sweep(Instant::now());
        self.count_reservations("lapsed", lapsed);
    }

    fn count_reservations(&self, result: &str, n: usize) {
        self.ctx.metrics.count_reservations(result, n);
    }

    pub(super) fn count_observed(&self, observed: Observed) {
        self.ctx
            .metrics
            .observed_streams
            .with_label_values(&[observed.label()])
            .inc();
    }
}
