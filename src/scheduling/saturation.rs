//! The saturation detector (DESIGN §5): how full each endpoint and the pool are.
//!
//! Per endpoint `saturation = max(queued / queue_depth_threshold, kv_usage / kv_threshold)`,
//! where `queued` also counts kvpick's in-flight requests the last scrape has not seen
//! ([`super::cycle::PodView::queued`]), so the signal reacts between scrapes. An endpoint whose
//! metrics are stale, failing or absent counts as exactly saturated (1.0). The pool's
//! saturation is the mean over its endpoints of each endpoint's saturation capped at 1.0, so
//! one overloaded endpoint counts as one full endpoint and a pool with idle endpoints is not
//! saturated; an empty pool is saturated (no capacity).
//! `≥ 1.0` means saturated. The ext-proc path sheds sheddable requests (priority < 0 → 429)
//! and flow control holds requests while [`PoolSaturation::saturated`] is true.

use std::sync::Arc;
use std::time::Instant;

use crate::endpoints::EndpointState;

use super::cycle::{MetricsSource, PodView};
use super::spec::SaturationConfig;

/// The saturation of one endpoint from its cycle view.
pub fn endpoint_saturation(config: &SaturationConfig, pod: &PodView) -> f64 {
    endpoint_saturation_with(
        config.queue_depth_threshold,
        config.kv_cache_util_threshold,
        pod,
    )
}

pub(crate) fn endpoint_saturation_with(
    queue_threshold: f64,
    kv_threshold: f64,
    pod: &PodView,
) -> f64 {
    let Some(metrics) = pod.metrics.as_ref().filter(|_| pod.fresh) else {
        return 1.0;
    };
    let ratio = |value: f64, threshold: f64| {
        if threshold > 0.0 {
            value.max(0.0) / threshold
        } else if value > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
    };
    let kv = if metrics.kv_usage.is_finite() {
        metrics.kv_usage
    } else {
        1.0
    };
    ratio(pod.queued(), queue_threshold).max(ratio(kv, kv_threshold))
}

/// The pool's saturation.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSaturation {
    /// Mean endpoint saturation, each endpoint capped at 1.0 (1.0 for an empty pool).
    pub mean: f64,
    /// Endpoints counted.
    pub endpoints: usize,
    /// Endpoints at or over 1.0 (stale ones included).
    pub saturated_endpoints: usize,
}

impl PoolSaturation {
    /// Whether the pool has no spare capacity (mean ≥ 1.0): shed sheddable requests, queue
    /// the rest when flow control is on.
    pub fn saturated(&self) -> bool {
        self.mean >= 1.0
    }
}

/// Computes endpoint and pool saturation from live state.
#[derive(Clone)]
pub struct SaturationDetector {
    config: SaturationConfig,
    metrics: Arc<dyn MetricsSource>,
}

impl std::fmt::Debug for SaturationDetector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaturationDetector")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl SaturationDetector {
    /// A detector reading `metrics` with `config`'s thresholds.
    pub fn new(config: SaturationConfig, metrics: Arc<dyn MetricsSource>) -> Self {
        Self { config, metrics }
    }

    /// The thresholds.
    pub fn config(&self) -> &SaturationConfig {
        &self.config
    }

    /// Whether `endpoints` can take one more request when `pending` admitted requests are not
    /// yet counted in their load: each pending request adds `1 / queue_depth_threshold` of
    /// one endpoint's saturation to the pool's sum. False for an empty pool. This is the
    /// capacity check to hand to [`super::FlowController::new`].
    pub fn has_capacity(&self, endpoints: &[Arc<EndpointState>], pending: usize) -> bool {
        if endpoints.is_empty() {
            return false;
        }
        let pool = self.pool(endpoints);
        let threshold = self.config.queue_depth_threshold.max(f64::MIN_POSITIVE);
        let extra = pending as f64 / threshold / endpoints.len() as f64;
        pool.mean + extra < 1.0
    }

    /// The saturation of `endpoints` (the pool, or a request's candidates) now.
    pub fn pool(&self, endpoints: &[Arc<EndpointState>]) -> PoolSaturation {
        let now = Instant::now();
        let mut total = 0.0;
        let mut saturated = 0;
        for endpoint in endpoints {
            let view = PodView::read(
                endpoint,
                self.metrics.as_ref(),
                now,
                self.config.metrics_staleness,
            );
            let s = endpoint_saturation(&self.config, &view);
            // NOTE: capped at one full endpoint. Uncapped, one pod reporting 100 waiting
            // requests (20× the threshold) beside idle pods pushed the mean past 1.0 and shed
            // or queued every request although the idle pods had room; an endpoint's excess
            // load is the scorers' and the saturation filter's business, not the pool's.
            total += s.min(1.0);
            if s >= 1.0 {
                saturated += 1;
            }
        }
        PoolSaturation {
            mean: if endpoints.is_empty() {
                1.0
            } else {
                total / endpoints.len() as f64
            },
            endpoints: endpoints.len(),
            saturated_endpoints: saturated,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::cycle::test_support::*;
    use super::*;
    use crate::scrape::ScrapeStatus;
    use std::time::Duration;

    #[test]
    fn endpoint_and_pool_saturation() {
        let config = SaturationConfig::default();
        let fake = Arc::new(FakeMetrics::default());
        let pods: Vec<_> = (0..4).map(endpoint).collect();
        fake.set(pods[0].id(), metrics(0.0, 1.0, 0.0));
        fake.set(pods[1].id(), metrics(2.5, 1.0, 0.2));
        fake.set(pods[2].id(), metrics(1.0, 1.0, 0.8));
        // pods[3] never scraped: stale.
        let detector = SaturationDetector::new(config, fake.clone());
        let pool = detector.pool(&pods);
        assert!(
            (pool.mean - (0.0 + 0.5 + 1.0 + 1.0) / 4.0).abs() < 1e-9,
            "{pool:?}"
        );
        assert_eq!(pool.saturated_endpoints, 2);
        assert!(!pool.saturated());
        assert!(detector.has_capacity(&pods, 0));
        // 2 pending requests add 2 / 5 / 4 = 0.1 to the mean 0.625.
        assert!(detector.has_capacity(&pods, 2));
        assert!(!detector.has_capacity(&pods, 8), "0.625 + 0.4 ≥ 1");
        assert!(!detector.has_capacity(&[], 0), "no endpoints, no capacity");

        // In-flight requests the scrape has not seen count as queued.
        let guards: Vec<_> = (0..6).map(|_| pods[0].in_flight.start()).collect();
        let v = PodView::read(
            &pods[0],
            fake.as_ref(),
            Instant::now(),
            config.metrics_staleness,
        );
        assert!(
            (endpoint_saturation(&config, &v) - 1.0).abs() < 1e-9,
            "5 unseen / 5"
        );
        drop(guards);

        // A failing scrape makes the endpoint saturated even with good old metrics.
        fake.set_status(
            pods[0].id(),
            ScrapeStatus {
                metrics: Some(Arc::new(metrics(0.0, 0.0, 0.0))),
                fetched_at: Some(Instant::now()),
                last_error: Some(crate::scrape::scraper::ScrapeError::Timeout),
                consecutive_failures: 1,
                ..ScrapeStatus::default()
            },
        );
        fake.set(pods[1].id(), metrics(10.0, 0.0, 0.0));
        assert!(detector.pool(&pods).saturated());
        assert!(detector.pool(&[]).saturated(), "no endpoints, no capacity");
    }

    #[test]
    fn one_overloaded_endpoint_does_not_saturate_a_pool_with_idle_ones() {
        let config = SaturationConfig::default();
        let fake = Arc::new(FakeMetrics::default());
        let pods: Vec<_> = (0..3).map(endpoint).collect();
        fake.set(pods[0].id(), metrics(100.0, 1.0, 0.0));
        fake.set(pods[1].id(), metrics(0.0, 0.0, 0.0));
        fake.set(pods[2].id(), metrics(0.0, 0.0, 0.0));
        let detector = SaturationDetector::new(config, fake.clone());
        let pool = detector.pool(&pods);
        assert!((pool.mean - 1.0 / 3.0).abs() < 1e-9, "{pool:?}");
        assert_eq!(pool.saturated_endpoints, 1);
        assert!(!pool.saturated(), "two idle endpoints: {pool:?}");
        assert!(detector.has_capacity(&pods, 0));
        // Each idle endpoint takes 5 more before the pool is full: 1/3 + 9/5/3 < 1 ≤ 1/3 + 10/5/3.
        assert!(detector.has_capacity(&pods, 9));
        assert!(!detector.has_capacity(&pods, 10));

        // Every endpoint overloaded: saturated.
        fake.set(pods[1].id(), metrics(100.0, 0.0, 0.0));
        fake.set(pods[2].id(), metrics(0.0, 0.0, 1.0));
        assert!(detector.pool(&pods).saturated());
    }

    #[test]
    fn stale_metrics_are_saturated() {
        let config = SaturationConfig {
            metrics_staleness: Duration::from_millis(200),
            ..SaturationConfig::default()
        };
        let fake = FakeMetrics::default();
        let pod = endpoint(0);
        let old = Instant::now();
        fake.set_status(
            pod.id(),
            ScrapeStatus {
                metrics: Some(Arc::new(metrics(0.0, 0.0, 0.0))),
                fetched_at: Some(old),
                ..ScrapeStatus::default()
            },
        );
        let fresh = PodView::read(
            &pod,
            &fake,
            old + Duration::from_millis(100),
            config.metrics_staleness,
        );
        assert_eq!(endpoint_saturation(&config, &fresh), 0.0);
        let stale = PodView::read(
            &pod,
            &fake,
            old + Duration::from_millis(300),
            config.metrics_staleness,
        );
        assert_eq!(endpoint_saturation(&config, &stale), 1.0);
    }
}
