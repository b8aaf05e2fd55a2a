//! Where the pool's endpoints come from: a static file, or Kubernetes (an InferencePool or a
//! label selector). Either source produces the same thing: a `Vec<Endpoint>` handed to
//! [`crate::endpoints::Datastore::set_endpoints`].

pub mod kube;
mod static_file;

pub use static_file::{PoolFileError, load_pool, parse_pool, watch_pool_file};

/// Whether `value` is a ZMQ TCP endpoint `tcp://host:port`.
pub fn is_zmq_endpoint(value: &str) -> bool {
    value
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0))
}
