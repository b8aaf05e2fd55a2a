//! Where the pool's endpoints come from: a static file today, Kubernetes later.

mod static_file;

pub use static_file::{PoolFileError, load_pool, parse_pool, watch_pool_file};
