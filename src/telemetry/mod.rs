//! kvpick's own observability: Prometheus metrics (with bounded request-derived labels) and
//! gRPC health. The HTTP servers that expose them (and the debug views) are in
//! [`crate::admin`], above every layer they report on.

pub mod health;
pub mod labels;
mod metrics;
mod ttft;

pub use metrics::EppMetrics;
pub use ttft::TtftMetrics;
