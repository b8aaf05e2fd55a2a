//! The datastore: the pool's endpoints and what kvpick knows about each one.

mod pod;

pub use pod::{ENGINE_TYPE_LABEL, Endpoint, PodId};
