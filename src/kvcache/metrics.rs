//! Prometheus metrics of prefix lookups.

use prometheus::{Histogram, HistogramOpts, IntCounter, Registry};

/// Lookup latency and hit ratio (hit blocks / looked-up blocks, best candidate per lookup).
#[derive(Clone)]
pub struct IndexMetrics {
    /// Time of one `match_prefix` call (keying included).
    pub lookup_seconds: Histogram,
    /// Full blocks looked up.
    pub lookup_blocks: IntCounter,
    /// Leading blocks held by the best candidate.
    pub hit_blocks: IntCounter,
    /// Blocks walks proved held without visiting them (galloping over spans and runs).
    pub galloped_blocks: IntCounter,
}

impl IndexMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let lookup_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvpick_prefix_lookup_duration_seconds",
                "Time to match one request's prefix against the index",
            )
            .buckets(vec![
                1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 2.5e-2,
            ]),
        )?;
        let lookup_blocks = IntCounter::new(
            "kvpick_prefix_lookup_blocks_total",
            "Full blocks of requests looked up in the prefix index",
        )?;
        let hit_blocks = IntCounter::new(
            "kvpick_prefix_hit_blocks_total",
            "Leading blocks held by the best candidate (hit ratio = hit / lookup)",
        )?;
        let galloped_blocks = IntCounter::new(
            "kvpick_prefix_galloped_blocks_total",
            "Blocks prefix walks proved held without visiting them (jumps over stored chains)",
        )?;
        registry.register(Box::new(galloped_blocks.clone()))?;
        registry.register(Box::new(lookup_seconds.clone()))?;
        registry.register(Box::new(lookup_blocks.clone()))?;
        registry.register(Box::new(hit_blocks.clone()))?;
        Ok(Self {
            lookup_seconds,
            lookup_blocks,
            hit_blocks,
            galloped_blocks,
        })
    }
}
