//! kvpick's own count of requests in flight per endpoint.
//!
//! The count is exact between metric scrapes because kvpick sees every request it routes:
//! it rises when an endpoint is picked and falls when the response ends or the ext-proc stream
//! breaks. The fall is tied to a guard's `Drop`, so no code path (client abort, gRPC error,
//! panic in a handler) can leak a count.
//!
//! With active-active replicas, the other replicas' counts arrive over the replica exchange
//! (`crate::replica`) as a *foreign* term: [`InFlight::get`] (what scheduling reads) is the
//! sum, [`InFlight::local`] this replica's own (what it tells its peers).
//!
//! A *reservation* ([`InFlight::reserve`]) is a pick whose observing stream has not arrived
//! yet (split filters: `crate::endpoints::pending`). It counts in what this replica's
//! scheduling sees but not in what it tells its peers: the observing stream may be another
//! replica's, which counts the request itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// In-flight requests of one endpoint.
#[derive(Debug, Default)]
pub struct InFlight {
    count: AtomicU64,
    /// The other replicas' in-flight requests to the endpoint, as last exchanged.
    foreign: AtomicU64,
    /// This replica's picks whose observing stream has not taken them over yet.
    reserved: AtomicU64,
}

impl InFlight {
    /// Requests in flight to the endpoint: this replica's (its reservations included) plus
    /// the other replicas' last exchanged counts (the load scheduling sees).
    pub fn get(&self) -> u64 {
        self.local()
            .saturating_add(self.reserved.load(Ordering::Relaxed))
            .saturating_add(self.foreign())
    }

    /// Requests this replica routed to the endpoint whose response has not ended.
    pub fn local(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The other replicas' in-flight requests, as last exchanged.
    pub fn foreign(&self) -> u64 {
        self.foreign.load(Ordering::Relaxed)
    }

    /// Replaces the other replicas' count (the replica exchange).
    pub fn set_foreign(&self, count: u64) {
        self.foreign.store(count, Ordering::Relaxed);
    }

    /// Counts one more request; the returned guard counts it back out when dropped.
    pub fn start(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::Relaxed);
        InFlightGuard {
            load: Arc::clone(self),
        }
    }

    /// Reserves one request's place until its observing stream confirms it
    /// ([`InFlightReservation::confirm`]) or the reservation is dropped.
    pub fn reserve(self: &Arc<Self>) -> InFlightReservation {
        self.reserved.fetch_add(1, Ordering::Relaxed);
        InFlightReservation {
            load: Arc::clone(self),
        }
    }
}

/// Holds one reserved unit of an endpoint's in-flight count until confirmed or dropped.
#[derive(Debug)]
pub struct InFlightReservation {
    load: Arc<InFlight>,
}

impl InFlightReservation {
    /// The request is this replica's: it becomes an ordinary in-flight count.
    pub fn confirm(self) -> InFlightGuard {
        // Counted before the reservation is released, so the sum never dips.
        self.load.start()
    }
}

impl Drop for InFlightReservation {
    fn drop(&mut self) {
        self.load.reserved.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Holds one unit of an endpoint's in-flight count until dropped.
#[derive(Debug)]
pub struct InFlightGuard {
    load: Arc<InFlight>,
}

impl InFlightGuard {
    /// The endpoint's in-flight count now (this request included).
    pub fn current(&self) -> u64 {
        self.load.get()
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.load.count.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_counts_in_and_out() {
        let load = Arc::new(InFlight::default());
        let a = load.start();
        let b = load.start();
        assert_eq!(load.get(), 2);
        drop(a);
        assert_eq!(load.get(), 1);
        drop(b);
        assert_eq!(load.get(), 0);
    }

    #[test]
    fn foreign_counts_add_to_the_load_but_not_to_the_local_count() {
        let load = Arc::new(InFlight::default());
        let _a = load.start();
        load.set_foreign(3);
        assert_eq!((load.get(), load.local(), load.foreign()), (4, 1, 3));
        load.set_foreign(u64::MAX);
        assert_eq!(load.get(), u64::MAX, "saturates");
    }

    #[test]
    fn a_reservation_counts_for_scheduling_but_not_for_the_peers_until_confirmed() {
        let load = Arc::new(InFlight::default());
        let reserved = load.reserve();
        assert_eq!((load.get(), load.local()), (1, 0), "not told to the peers");
        let guard = reserved.confirm();
        assert_eq!(
            (load.get(), load.local()),
            (1, 1),
            "one request, now this replica's"
        );
        drop(guard);
        assert_eq!(load.get(), 0);
        drop(load.reserve());
        assert_eq!(load.get(), 0, "a lapsed reservation counts nowhere");
    }
}
