//! The observing half of a split request ([`super::super::handoff`]): an observing stream's
//! request headers carry the routing stream's hand-off, and from then on the stream counts
//! the request in flight and awaiting its first byte on the picked pod.

use crate::pb::envoy::config::core::v3::Metadata;

use super::{Phase, RequestStream, Routed};
use crate::endpoints::PodId;
use crate::extproc::handoff::{PICK_NAMESPACE, PickHandoff};

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
        self.count_on(
            endpoint,
            pick.uncached_tokens,
            pick.cached_tokens,
            pick.predicted_ms,
        );
        self.streamed = pick.streamed;
        self.routed = Some(Routed {
            pod,
            labels: pick.labels,
        });
        Observed::Pick
    }

    pub(super) fn count_observed(&self, observed: Observed) {
        self.ctx
            .metrics
            .observed_streams
            .with_label_values(&[observed.label()])
            .inc();
    }
}
