//! The simplest useful scheduler: least in-flight requests, random tie-break.

use std::sync::Arc;

use super::{Pick, ScheduleError, Scheduler, SchedulingRequest};
use crate::endpoints::EndpointState;

/// Picks the endpoint with the fewest in-flight requests; ties are broken at random so equal
/// endpoints share load instead of the first one taking every burst.
#[derive(Debug, Clone)]
pub struct LeastInFlight {
    max_fallbacks: usize,
}

impl LeastInFlight {
    /// A scheduler that lists at most `max_fallbacks` fallbacks after the primary.
    pub fn new(max_fallbacks: usize) -> Self {
        Self { max_fallbacks }
    }
}

impl Scheduler for LeastInFlight {
    fn pick(
        &self,
        _request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Result<Pick, ScheduleError> {
        let mut ranked: Vec<(u64, u64, &Arc<EndpointState>)> = candidates
            .iter()
            .map(|endpoint| (endpoint.in_flight.get(), fastrand::u64(..), endpoint))
            .collect();
        ranked.sort_unstable_by_key(|(load, tie, _)| (*load, *tie));
        let mut ids = ranked.into_iter().map(|(_, _, endpoint)| endpoint.id());
        let primary = ids.next().ok_or(ScheduleError::NoCandidates)?;
        Ok(Pick::new(primary, ids.take(self.max_fallbacks).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{Datastore, Endpoint};
    use std::collections::HashSet;

    fn pool(addrs: &[&str]) -> Datastore {
        let store = Datastore::new();
        store.set_endpoints(
            addrs
                .iter()
                .map(|a| Endpoint::new(a.parse().expect("addr")))
                .collect(),
        );
        store
    }

    #[test]
    fn picks_least_loaded_and_orders_fallbacks() {
        let store = pool(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        let snap = store.snapshot();
        let _a = [
            snap.endpoints[0].in_flight.start(),
            snap.endpoints[0].in_flight.start(),
        ];
        let _b = snap.endpoints[2].in_flight.start();
        let pick = LeastInFlight::new(5)
            .pick(&SchedulingRequest::default(), &snap.endpoints)
            .expect("pick");
        assert_eq!(pick.primary.to_string(), "10.0.0.2:80");
        assert_eq!(pick.header_value(), "10.0.0.2:80,10.0.0.3:80,10.0.0.1:80");
        let capped = LeastInFlight::new(1)
            .pick(&SchedulingRequest::default(), &snap.endpoints)
            .expect("pick");
        assert_eq!(capped.fallbacks.len(), 1);
    }

    #[test]
    fn ties_are_spread_and_empty_is_an_error() {
        let store = pool(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        let snap = store.snapshot();
        let primaries: HashSet<_> = (0..200)
            .map(|_| {
                LeastInFlight::new(0)
                    .pick(&SchedulingRequest::default(), &snap.endpoints)
                    .expect("pick")
                    .primary
            })
            .collect();
        assert_eq!(
            primaries.len(),
            3,
            "random tie-break reaches every endpoint"
        );
        assert_eq!(
            LeastInFlight::new(0).pick(&SchedulingRequest::default(), &[]),
            Err(ScheduleError::NoCandidates)
        );
    }
}
