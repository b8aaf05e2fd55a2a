//! The response half of a routed request: its first byte (which ends its prefill and times
//! it), later chunks (decode steps), and its end (in-flight counts returned, usage metrics).

use std::time::Instant;

use super::{Phase, RequestStream};
use crate::endpoints::InFlightGuard;

impl RequestStream {
    /// Response bytes came: a streamed response's first chunk ends its prefill (and times
    /// it), each later one times a decode step of its pod.
    pub(super) fn response_chunk(&mut self) {
        // NOTE: a non-streamed response's first byte comes with its last token, which says
        // nothing about its prefill; it holds its backlog share to the end instead.
        if !self.streamed {
            return;
        }
        let Some(guard) = self.prefill.as_mut() else {
            return;
        };
        let now = Instant::now();
        if let Some(seen) = guard.first_byte(now) {
            self.ctx.metrics.ttft.observe(&seen);
        } else {
            let batch = self.in_flight.as_ref().map_or(1, InFlightGuard::current);
            guard.chunk(now, batch);
        }
    }

    /// The response is through: the request leaves its pod's in-flight and prefill counts,
    /// a queued request may go, and its usage is counted.
    pub(super) fn end_response(&mut self) {
        self.in_flight = None;
        self.prefill = None;
        self.phase = Phase::Done;
        // Capacity freed: let a queued request go without waiting for the next tick.
        if let Some(flow) = &self.ctx.admission.flow {
            flow.completed();
        }
        if let (Some(routed), Some(usage)) = (&self.routed, self.usage.usage()) {
            let metrics = &self.ctx.metrics;
            let labels = routed.labels.values();
            metrics
                .input_tokens
                .with_label_values(&labels)
                .observe(usage.prompt_tokens as f64);
            metrics
                .output_tokens
                .with_label_values(&labels)
                .observe(usage.completion_tokens as f64);
            // NOTE: not for a pod that left the pool since the pick (responses drain during a
            // rollout): its series were removed with it (`app::liveness`), and counting would
            // bring them back for the life of the process.
            if self.ctx.datastore.snapshot().get(routed.pod).is_some() {
                let endpoint = routed.pod.to_string();
                metrics
                    .prompt_tokens
                    .with_label_values(&[&endpoint])
                    .inc_by(usage.prompt_tokens);
                if let Some(cached) = usage.cached_tokens {
                    metrics
                        .cached_prompt_tokens
                        .with_label_values(&[&endpoint])
                        .inc_by(cached);
                }
            }
        }
    }
}
