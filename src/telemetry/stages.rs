//! Where a request's time goes inside kvpick, per stage (`kvpick_request_stage_seconds`).
//!
//! One histogram child per stage, resolved once: observing is two atomic adds and a bucket
//! search, no label lookup, so every request can be timed on the hot path.

use prometheus::{Histogram, HistogramOpts, HistogramVec, Registry};

/// The stages timed (the `stage` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Appending the body's chunks into the request buffer (and taking budget for them).
    Buffer,
    /// Waiting for and returning from the blocking pool (large bodies), work excluded.
    PoolHop,
    /// Parsing the JSON body.
    Parse,
    /// Rewriting the body's model name (only requests that are rewritten).
    Rewrite,
    /// Rendering the chat template.
    Render,
    /// Tokenizing the prompt (through the prefix token cache).
    Tokenize,
    /// Computing the prompt's block keys for the prefix index.
    Keys,
    /// Admission, candidate selection and the pick.
    Schedule,
    /// Building the replies: destination headers and the body's copy back in chunks.
    Reply,
    /// Applying the pick's routing record after the reply.
    Record,
}

impl Stage {
    const ALL: [Stage; 10] = [
        Stage::Buffer,
        Stage::PoolHop,
        Stage::Parse,
        Stage::Rewrite,
        Stage::Render,
        Stage::Tokenize,
        Stage::Keys,
        Stage::Schedule,
        Stage::Reply,
        Stage::Record,
    ];

    fn label(self) -> &'static str {
        match self {
            Stage::Buffer => "buffer",
            Stage::PoolHop => "pool_hop",
            Stage::Parse => "parse",
            Stage::Rewrite => "rewrite",
            Stage::Render => "render",
            Stage::Tokenize => "tokenize",
            Stage::Keys => "keys",
            Stage::Schedule => "schedule",
            Stage::Reply => "reply",
            Stage::Record => "record",
        }
    }
}

/// `kvpick_request_stage_seconds{stage}`.
#[derive(Debug, Clone)]
pub struct StageMetrics {
    by_stage: Vec<Histogram>,
}

impl StageMetrics {
    /// Creates the histogram and registers it into `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let vec = HistogramVec::new(
            HistogramOpts::new(
                "kvpick_request_stage_seconds",
                "Time one request spent in each stage of kvpick's request path",
            )
            .buckets(vec![
                1e-6, 5e-6, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.25,
            ]),
            &["stage"],
        )?;
        registry.register(Box::new(vec.clone()))?;
        let by_stage = Stage::ALL
            .iter()
            .map(|s| vec.get_metric_with_label_values(&[s.label()]))
            .collect::<Result<_, _>>()?;
        Ok(Self { by_stage })
    }

    /// Counts `seconds` spent in `stage`.
    pub fn observe(&self, stage: Stage, seconds: f64) {
        if let Some(h) = self.by_stage.get(stage as usize) {
            h.observe(seconds);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_is_exported_under_its_label() {
        let registry = Registry::new();
        let stages = StageMetrics::new(&registry).expect("metrics");
        stages.observe(Stage::Parse, 0.002);
        stages.observe(Stage::Record, 0.000_003);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encode");
        assert!(text.contains(r#"kvpick_request_stage_seconds_count{stage="parse"} 1"#));
        assert!(text.contains(r#"kvpick_request_stage_seconds_sum{stage="parse"} 0.002"#));
        assert!(text.contains(r#"kvpick_request_stage_seconds_count{stage="record"} 1"#));
        for stage in Stage::ALL {
            assert!(
                text.contains(&format!(r#"stage="{}""#, stage.label())),
                "{stage:?} exported"
            );
        }
    }
}
