//! Admission before scheduling: shedding of sheddable requests when the pool is saturated,
//! and flow control (queueing until capacity frees) when its feature gate is on.

use std::time::Instant;

use crate::endpoints::EndpointState;
use crate::scheduling::{FlowController, FlowRequest, Permit, SaturationDetector};

use super::error::Rejection;
use std::sync::Arc;

/// What decides whether a request may be scheduled now.
pub struct Admission {
    /// The saturation detector (GIE semantics).
    pub detector: SaturationDetector,
    /// Flow control, when the `flowControl` feature gate is on.
    pub flow: Option<FlowController>,
}

impl Admission {
    /// Sheds or queues the request; `Ok` carries the flow-control permit to hold until the
    /// pick has counted the request in flight.
    pub async fn admit(
        &self,
        priority: i32,
        fairness_id: Option<&str>,
        bytes: usize,
        candidates: &[Arc<EndpointState>],
        queue_seconds: &prometheus::Histogram,
    ) -> Result<Option<Permit>, Rejection> {
        if priority < 0 && !candidates.is_empty() && self.detector.pool(candidates).saturated() {
            return Err(Rejection::Shed);
        }
        let Some(flow) = &self.flow else {
            return Ok(None);
        };
        let started = Instant::now();
        let admitted = flow
            .admit(FlowRequest {
                priority,
                fairness_id: fairness_id.unwrap_or_default().to_owned(),
                bytes,
                ttl: None,
            })
            .await;
        queue_seconds.observe(started.elapsed().as_secs_f64());
        admitted.map(Some).map_err(Rejection::Queue)
    }
}
