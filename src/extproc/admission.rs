//! Admission before scheduling: shedding of sheddable requests when the pool is saturated,
//! and flow control (queueing until capacity frees) when its feature gate is on.

use std::time::Instant;

use crate::endpoints::EndpointState;
use crate::scheduling::{FlowController, FlowError, FlowRequest, Permit, SaturationDetector};
use crate::telemetry::{EppMetrics, RequestLabels};

use super::error::Rejection;
use std::sync::Arc;

/// What decides whether a request may be scheduled now.
pub struct Admission {
    /// The saturation detector (GIE semantics).
    pub detector: SaturationDetector,
    /// Flow control, when the `flowControl` feature gate is on.
    pub flow: Option<FlowController>,
    /// The pool's name, for the flow-control metrics' `inference_pool` label.
    pub pool_name: String,
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
        labels: &RequestLabels,
        metrics: &EppMetrics,
    ) -> Result<Option<Permit>, Rejection> {
        if priority < 0 && !candidates.is_empty() && self.detector.pool(candidates).saturated() {
            return Err(Rejection::Shed);
        }
        let Some(flow) = &self.flow else {
            return Ok(None);
        };
        let mut queued = Queued::enter(metrics, labels, &self.pool_name);
        let admitted = flow
            .admit(FlowRequest {
                priority,
                fairness_id: fairness_id.unwrap_or_default().to_owned(),
                bytes,
                ttl: None,
            })
            .await;
        queued.outcome = match &admitted {
            Ok(_) => "Dispatched",
            Err(FlowError::QueueFull) => "RejectedCapacity",
            Err(FlowError::TimedOut) => "EvictedTTL",
        };
        admitted.map(Some).map_err(Rejection::Queue)
    }
}

/// A request's stay in flow control, as the metrics see it: counted in the queue gauge
/// from entry to drop, and timed by outcome when it leaves.
struct Queued<'a> {
    /// This stay's queue-gauge series (looked up once: entry and exit are the same series).
    gauge: prometheus::IntGauge,
    metrics: &'a EppMetrics,
    labels: &'a RequestLabels,
    pool: &'a str,
    entered: Instant,
    /// llm-d's outcome name; a stay dropped before one is set was cancelled (the client or
    /// gateway went away while it waited).
    outcome: &'static str,
}

impl<'a> Queued<'a> {
    fn enter(metrics: &'a EppMetrics, labels: &'a RequestLabels, pool: &'a str) -> Self {
        let gauge = metrics
            .flow_queue_size
            .with_label_values(&labels.in_queue(pool));
        gauge.inc();
        Self {
            gauge,
            metrics,
            labels,
            pool,
            entered: Instant::now(),
            outcome: "EvictedContextCancelled",
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.gauge.dec();
        self.metrics
            .flow_queue_seconds
            .with_label_values(&self.labels.queue_outcome(self.pool, self.outcome))
            .observe(self.entered.elapsed().as_secs_f64());
    }
}
