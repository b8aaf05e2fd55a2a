//! kvpick's own count of requests in flight per endpoint.
//!
//! The count is exact between metric scrapes because kvpick sees every request it routes:
//! it rises when an endpoint is picked and falls when the response ends or the ext-proc stream
//! breaks. The fall is tied to a guard's `Drop`, so no code path (client abort, gRPC error,
//! panic in a handler) can leak a count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// In-flight requests of one endpoint.
#[derive(Debug, Default)]
pub struct InFlight {
    count: AtomicU64,
}

impl InFlight {
    /// Requests routed to the endpoint whose response has not ended.
    pub fn get(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Counts one more request; the returned guard counts it back out when dropped.
    pub fn start(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::Relaxed);
        InFlightGuard {
            load: Arc::clone(self),
        }
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
}
