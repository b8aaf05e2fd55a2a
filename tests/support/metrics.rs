//! A metrics source for scheduler tests: scrape statuses set by hand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvpick::endpoints::PodId;
use kvpick::scheduling::MetricsSource;
use kvpick::scrape::{PodMetrics, ScrapeStatus};

/// Scrape statuses by pod, as the scheduler reads them through [`MetricsSource`].
#[derive(Default)]
pub struct FakeMetrics(Mutex<HashMap<PodId, ScrapeStatus>>);

impl FakeMetrics {
    /// `pod` scraped now with these gauges.
    pub fn set(&self, pod: PodId, waiting: f64, running: f64, kv: f64) {
        self.set_at(pod, waiting, running, kv, Instant::now());
    }

    /// `pod` scraped at `at` with these gauges.
    pub fn set_at(&self, pod: PodId, waiting: f64, running: f64, kv: f64, at: Instant) {
        let status = ScrapeStatus {
            metrics: Some(Arc::new(PodMetrics {
                waiting,
                running,
                kv_usage: kv,
                ..PodMetrics::default()
            })),
            fetched_at: Some(at),
            ..ScrapeStatus::default()
        };
        self.0.lock().expect("lock").insert(pod, status);
    }
}

impl MetricsSource for FakeMetrics {
    fn status(&self, pod: PodId) -> Arc<ScrapeStatus> {
        Arc::new(
            self.0
                .lock()
                .expect("lock")
                .get(&pod)
                .cloned()
                .unwrap_or_default(),
        )
    }
}
