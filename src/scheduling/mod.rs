//! The decision: which endpoint serves a request, and which ones to fall back to.
//!
//! The ext-proc path hands a [`Scheduler`] the request's [`SchedulingRequest`] and the
//! candidate endpoints (the pool, narrowed by the gateway's subset hint) and gets back a
//! [`Pick`]: the primary first, then ordered fallbacks. Scorers, filters and profiles arrive
//! behind this same trait.

mod least_in_flight;

use std::sync::Arc;

use crate::endpoints::{EndpointState, PodId};

pub use least_in_flight::LeastInFlight;

/// What the scheduler knows of a request.
#[derive(Debug, Clone, Default)]
pub struct SchedulingRequest {
    /// The model named in the body, when there is a body.
    pub model: Option<String>,
    /// The request body size in bytes.
    pub body_bytes: usize,
}

/// The scheduler's answer: the primary endpoint, then ordered fallbacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// The primary.
    pub primary: PodId,
    /// Fallbacks, best first.
    pub fallbacks: Vec<PodId>,
}

impl Pick {
    /// The destination header value: `primary[,fallback…]`.
    pub fn header_value(&self) -> String {
        let mut value = self.primary.to_string();
        for fallback in &self.fallbacks {
            value.push(',');
            value.push_str(&fallback.to_string());
        }
        value
    }
}

/// Why no endpoint could be picked.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    /// No endpoint was eligible.
    #[error("no candidate endpoints")]
    NoCandidates,
}

/// Picks endpoints for requests.
pub trait Scheduler: Send + Sync + 'static {
    /// Picks among `candidates` (never empty when called by the ext-proc path).
    fn pick(
        &self,
        request: &SchedulingRequest,
        candidates: &[Arc<EndpointState>],
    ) -> Result<Pick, ScheduleError>;
}
