//! The placement model's predictions against what happened: time from pick to a streamed
//! response's first byte, predicted at the pick and observed on the response path.
//!
//! Why three series: the two histograms show the distributions side by side (a dashboard can
//! plot their quantiles together), and the ratio histogram shows the model's error per
//! request (1.0 is exact; 2.0 means the first byte took twice as long as predicted).

use prometheus::{Histogram, HistogramOpts, Registry};

use crate::endpoints::TtftObservation;

/// Predicted and observed times to first token.
#[derive(Debug, Clone)]
pub struct TtftMetrics {
    /// Observed pick → first byte, streamed responses.
    pub observed: Histogram,
    /// Predicted at the pick, for the same responses (when a placement scorer predicted).
    pub predicted: Histogram,
    /// Observed / predicted.
    pub error_ratio: Histogram,
}

impl TtftMetrics {
    /// Creates the histograms and registers them in `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let seconds = || prometheus::exponential_buckets(1e-3, 2.0, 18);
        let metrics = Self {
            observed: Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_ttft_observed_seconds",
                    "Time from kvpick's pick to the first byte of a streamed response.",
                )
                .buckets(seconds()?),
            )?,
            predicted: Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_ttft_predicted_seconds",
                    "Time to first token the placement scorer predicted at the pick, for the responses in kvpick_ttft_observed_seconds.",
                )
                .buckets(seconds()?),
            )?,
            error_ratio: Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_ttft_prediction_ratio",
                    "Observed over predicted time to first token (1 is exact).",
                )
                .buckets(prometheus::exponential_buckets(1.0 / 16.0, 2.0_f64.sqrt(), 17)?),
            )?,
        };
        registry.register(Box::new(metrics.observed.clone()))?;
        registry.register(Box::new(metrics.predicted.clone()))?;
        registry.register(Box::new(metrics.error_ratio.clone()))?;
        Ok(metrics)
    }

    /// Counts one first byte.
    pub fn observe(&self, seen: &TtftObservation) {
        self.observed.observe(seen.observed_ms / 1e3);
        if let Some(predicted) = seen.predicted_ms.filter(|p| p.is_finite() && *p > 0.0) {
            self.predicted.observe(predicted / 1e3);
            self.error_ratio.observe(seen.observed_ms / predicted);
        }
    }
}
