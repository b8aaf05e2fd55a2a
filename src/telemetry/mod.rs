//! kvpick's own observability: Prometheus metrics, gRPC health and the admin HTTP server.

pub mod admin;
pub mod auth;
pub mod debug;
pub mod health;
pub mod labels;
mod metrics;

pub use metrics::EppMetrics;
