//! The datastore: the pool's endpoints and what kvpick knows about each one.

mod candidates;
mod datastore;
pub mod liveness;
mod load;
mod pending;
mod pod;
pub mod prefill;

pub use candidates::live_candidates;
pub use datastore::{Datastore, EndpointState, PoolSnapshot};
pub use liveness::Liveness;
pub use load::{InFlight, InFlightGuard, InFlightReservation};
pub use pending::{MAX_PENDING, PendingPicks, RESERVATION_TTL, TakenPick};
pub use pod::{ENGINE_TYPE_LABEL, Endpoint, PodId};
pub use prefill::{FittedLine, PrefillGuard, PrefillLoad, PrefillView, TtftObservation};
