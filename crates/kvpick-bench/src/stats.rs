//! Latency statistics for load runs: exact percentiles over recorded samples.

use std::time::Duration;

/// Summary of one run's latencies.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencySummary {
    /// Samples counted.
    pub count: usize,
    /// Mean, milliseconds.
    pub mean_ms: f64,
    /// Median, milliseconds.
    pub p50_ms: f64,
    /// 90th percentile, milliseconds.
    pub p90_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// Largest, milliseconds.
    pub max_ms: f64,
}

/// The `q`-quantile (0..=1) of sorted samples, nearest-rank.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.saturating_sub(1).min(sorted.len() - 1)]
}

/// Summarizes `samples` (sorted in place).
pub fn summarize(samples: &mut [Duration]) -> LatencySummary {
    samples.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let total: Duration = samples.iter().sum();
    LatencySummary {
        count: samples.len(),
        mean_ms: if samples.is_empty() {
            0.0
        } else {
            ms(total) / samples.len() as f64
        },
        p50_ms: ms(quantile(samples, 0.50)),
        p90_ms: ms(quantile(samples, 0.90)),
        p99_ms: ms(quantile(samples, 0.99)),
        max_ms: samples.last().copied().map(ms).unwrap_or(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let s = summarize(&mut samples);
        assert_eq!(s.count, 100);
        assert_eq!(s.p50_ms, 50.0);
        assert_eq!(s.p90_ms, 90.0);
        assert_eq!(s.p99_ms, 99.0);
        assert_eq!(s.max_ms, 100.0);
        assert!((s.mean_ms - 50.5).abs() < 1e-9);
        assert_eq!(summarize(&mut []).p99_ms, 0.0);
    }
}
