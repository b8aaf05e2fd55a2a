//! What an ext-proc connection has carried, as its streams report it: nothing yet, only
//! observing streams, or a routing stream.
//!
//! The server reads a connection that only carries observing streams at a slower pace
//! (`crate::app::paced_socket`): their messages are never answered and none is urgent. A
//! routing stream's messages are waited for by the gateway, so the first routing stream a
//! connection carries ends that for the connection's whole life.
//!
//! Concurrency: one atomic per connection, written by its streams (on the connection's
//! task tree) and read by the connection's socket on its next read. `Relaxed` suffices:
//! nothing else is published through it, and a read that sees the change one read late
//! only paces that one read.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// What a connection has carried so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carried {
    /// No stream has sent its first message yet.
    Nothing,
    /// Only observing streams (`observability_mode`).
    Observing,
    /// At least one routing stream.
    Routing,
}

impl Carried {
    /// The label of `kvpick_extproc_connections`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Nothing => "new",
            Self::Observing => "observing",
            Self::Routing => "routing",
        }
    }
}

/// One connection's record of what it carried, shared by its streams (a request extension)
/// and its socket.
#[derive(Debug, Clone, Default)]
pub struct ConnectionUse(Arc<AtomicU8>);

const NOTHING: u8 = 0;
const OBSERVING: u8 = 1;
const ROUTING: u8 = 2;

impl ConnectionUse {
    /// A stream's first message said what it is (`observing`: `observability_mode`).
    pub fn report(&self, observing: bool) {
        if observing {
            // Only a connection that carried nothing becomes an observing one: a routing
            // stream seen before stays decisive.
            let _ =
                self.0
                    .compare_exchange(NOTHING, OBSERVING, Ordering::Relaxed, Ordering::Relaxed);
        } else {
            self.0.store(ROUTING, Ordering::Relaxed);
        }
    }

    /// What the connection has carried so far.
    pub fn carried(&self) -> Carried {
        match self.0.load(Ordering::Relaxed) {
            NOTHING => Carried::Nothing,
            OBSERVING => Carried::Observing,
            _ => Carried::Routing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routing_stream_decides_for_good_and_observing_ones_only_a_new_connection() {
        let connection = ConnectionUse::default();
        assert_eq!(connection.carried(), Carried::Nothing);
        connection.report(true);
        assert_eq!(connection.carried(), Carried::Observing);
        connection.report(false);
        assert_eq!(connection.carried(), Carried::Routing);
        connection.report(true);
        assert_eq!(connection.carried(), Carried::Routing);
    }
}
