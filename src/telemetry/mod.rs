//! kvpick's own observability: Prometheus metrics (with bounded request-derived labels, and
//! llm-d's names beside GIE's: [`llmd`]) and gRPC health. The HTTP servers that expose them
//! (and the debug views) are in [`crate::admin`], above every layer they report on.

pub mod health;
pub mod labels;
pub mod llmd;
mod metrics;
mod stages;
mod ttft;

pub use metrics::{DEFAULT_FAIRNESS_ID, EppMetrics, RequestLabels};
pub use stages::{Stage, StageMetrics};
pub use ttft::TtftMetrics;
