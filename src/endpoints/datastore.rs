//! The current pool and per-endpoint live state, shared by every request.
//!
//! Concurrency rules:
//! - The pool is an immutable [`PoolSnapshot`] behind a `watch` channel. Discovery replaces it
//!   whole; readers clone the `Arc` (a short read lock) and then work lock-free on their copy,
//!   so a reload never blocks or changes a scheduling decision already under way.
//! - An endpoint's [`InFlight`] counter (and its [`Liveness`]) outlives reloads: an endpoint that stays in the pool
//!   keeps its counter, so requests picked before a reload are still counted after it. A
//!   removed endpoint's counter lives on only inside the guards of its last requests.
//! - Subsystems that follow the pool (event subscribers, scrapers) `subscribe()` and react to
//!   each new snapshot.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

use super::liveness::Liveness;
use super::load::InFlight;
use super::pending::PendingPicks;
use super::pod::{Endpoint, PodId};
use super::prefill::PrefillLoad;

/// One endpoint of the pool with its live state.
#[derive(Debug)]
pub struct EndpointState {
    /// Its static description.
    pub endpoint: Endpoint,
    /// Requests in flight to it (kvpick's own count).
    pub in_flight: Arc<InFlight>,
    /// Whether it is down (left out of the candidates).
    pub liveness: Arc<Liveness>,
    /// Its prefill backlog and fitted time to first token.
    pub prefill: Arc<PrefillLoad>,
}

impl EndpointState {
    /// `endpoint` with fresh live state: nothing in flight, no backlog, not down.
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            in_flight: Arc::default(),
            liveness: Arc::default(),
            prefill: Arc::default(),
        }
    }

    /// The endpoint's id.
    pub fn id(&self) -> PodId {
        self.endpoint.id
    }
}

/// An immutable view of the pool.
#[derive(Debug, Default)]
pub struct PoolSnapshot {
    /// The endpoints, in discovery order.
    pub endpoints: Vec<Arc<EndpointState>>,
}

impl PoolSnapshot {
    /// The endpoint with this id, if it is in the pool.
    pub fn get(&self, id: PodId) -> Option<&Arc<EndpointState>> {
        self.endpoints.iter().find(|e| e.id() == id)
    }
}

/// The shared datastore of the pool.
#[derive(Debug)]
pub struct Datastore {
    pool: watch::Sender<Arc<PoolSnapshot>>,
    synced: AtomicBool,
    pending: PendingPicks,
}

impl Default for Datastore {
    fn default() -> Self {
        Self::new()
    }
}

impl Datastore {
    /// An empty, not yet synced datastore.
    pub fn new() -> Self {
        Self {
            pool: watch::Sender::new(Arc::new(PoolSnapshot::default())),
            synced: AtomicBool::new(false),
            pending: PendingPicks::default(),
        }
    }

    /// The picks awaiting their observing stream (split filters).
    pub fn pending(&self) -> &PendingPicks {
        &self.pending
    }

    /// The current pool.
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        Arc::clone(&self.pool.borrow())
    }

    /// A receiver that sees every new pool.
    pub fn subscribe(&self) -> watch::Receiver<Arc<PoolSnapshot>> {
        self.pool.subscribe()
    }

    /// Whether discovery has delivered a pool at least once.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Replaces the pool with `endpoints`, keeping the live state of endpoints that stay.
    pub fn set_endpoints(&self, endpoints: Vec<Endpoint>) {
        let current = self.snapshot();
        let previous: HashMap<PodId, &Arc<EndpointState>> =
            current.endpoints.iter().map(|e| (e.id(), e)).collect();
        let endpoints = endpoints
            .into_iter()
            .map(|endpoint| {
                let kept = previous.get(&endpoint.id);
                Arc::new(EndpointState {
                    endpoint,
                    in_flight: kept
                        .map(|state| Arc::clone(&state.in_flight))
                        .unwrap_or_default(),
                    liveness: kept
                        .map(|state| Arc::clone(&state.liveness))
                        .unwrap_or_default(),
                    prefill: kept
                        .map(|state| Arc::clone(&state.prefill))
                        .unwrap_or_default(),
                })
            })
            .collect();
        self.pool.send_replace(Arc::new(PoolSnapshot { endpoints }));
        self.synced.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(addr: &str) -> Endpoint {
        Endpoint::new(addr.parse().expect("test address"))
    }

    #[test]
    fn reload_keeps_counters_of_endpoints_that_stay() {
        let store = Datastore::new();
        assert!(!store.is_synced());
        store.set_endpoints(vec![endpoint("10.0.0.1:8000"), endpoint("10.0.0.2:8000")]);
        assert!(store.is_synced());
        let first = store.snapshot();
        let guard = first.endpoints[0].in_flight.start();

        let mut relabelled = endpoint("10.0.0.1:8000");
        relabelled.labels.insert("role".into(), "decode".into());
        store.set_endpoints(vec![relabelled, endpoint("10.0.0.3:8000")]);

        let second = store.snapshot();
        let kept = second
            .get("10.0.0.1:8000".parse().expect("id"))
            .expect("kept");
        assert_eq!(kept.in_flight.get(), 1);
        assert_eq!(
            kept.endpoint.labels.get("role").map(String::as_str),
            Some("decode")
        );
        assert!(second.get("10.0.0.2:8000".parse().expect("id")).is_none());
        drop(guard);
        assert_eq!(kept.in_flight.get(), 0);
    }
}
