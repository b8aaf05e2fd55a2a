//! Every pod's scrapes on one grid of the scrape interval.
//!
//! Why: each pod's scrapes on a timer of their own wake kvpick once per pod per interval (8
//! pods at 50 ms: 160 timer wake-ups a second, each writing one pod's request). On one grid
//! the timers of every pod fire in the same turn of the runtime: one wake-up writes every
//! pod's request, and their answers come back close together.

use std::time::Duration;

use tokio::time::Instant;

/// The first instant after `now` on the grid of `interval` that starts at `grid`.
pub(super) fn next_on_grid(grid: Instant, now: Instant, interval: Duration) -> Instant {
    // (A grid point past what an Instant holds: the interval from now, or now.)
    let unaligned = now.checked_add(interval).unwrap_or(now);
    let (Ok(step), Ok(since)) = (
        u64::try_from(interval.as_nanos()),
        u64::try_from(now.saturating_duration_since(grid).as_nanos()),
    ) else {
        return unaligned;
    };
    if step == 0 {
        return unaligned;
    }
    let offset = Duration::from_nanos((since / step).saturating_add(1).saturating_mul(step));
    grid.checked_add(offset).unwrap_or(unaligned)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::endpoints::{Endpoint, EndpointState, PodId};
    use crate::scrape::ScrapeConfig;
    use crate::scrape::scraper::tests::{FastScrapes, fast_scrapes};
    use crate::scrape::test_pod;

    const STEP: Duration = Duration::from_millis(50);

    #[test]
    fn the_next_point_is_the_first_multiple_of_the_interval_after_now() {
        let grid = Instant::now();
        let at = |ms: u64| grid + Duration::from_millis(ms);
        assert_eq!(next_on_grid(grid, at(0), STEP), at(50));
        assert_eq!(next_on_grid(grid, at(13), STEP), at(50));
        assert_eq!(next_on_grid(grid, at(49), STEP), at(50));
        assert_eq!(next_on_grid(grid, at(50), STEP), at(100));
        assert_eq!(next_on_grid(grid, at(1_013), STEP), at(1_050));
    }

    #[test]
    fn a_zero_interval_or_a_clock_before_the_grid_does_not_panic() {
        let grid = Instant::now() + Duration::from_secs(1);
        let now = Instant::now();
        // Before the grid's start: its first point after it.
        assert_eq!(next_on_grid(grid, now, STEP), grid + STEP);
        assert_eq!(next_on_grid(grid, now, Duration::ZERO), now);
    }

    /// A stand-in pod that notes the (paused) instant of every scrape it gets.
    async fn timed_pod() -> (PodId, Arc<Mutex<Vec<Instant>>>) {
        let times = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&times);
        let page = test_pod::vllm_page();
        let pod = test_pod::serve(move |_| {
            log.lock().expect("log").push(Instant::now());
            ("200 OK", page.clone())
        })
        .await;
        (PodId(pod.addr), times)
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_that_joins_later_is_scraped_at_once_then_with_the_others() {
        let (a, a_times) = timed_pod().await;
        let (b, b_times) = timed_pod().await;
        // Scrapes every 10 ms; `b` joins 13 ms after `a`, off the grid.
        let FastScrapes {
            mut manager,
            cancel,
            ..
        } = fast_scrapes(ScrapeConfig::default());
        let endpoint = |pod| Arc::new(EndpointState::new(Endpoint::new(pod)));
        let (a_state, b_state) = (endpoint(a), endpoint(b));
        manager.sync(&[Arc::clone(&a_state)]);
        tokio::time::sleep(Duration::from_millis(13)).await;
        let joined = Instant::now();
        manager.sync(&[a_state, b_state]);
        tokio::time::sleep(Duration::from_millis(100)).await;
        cancel.cancel();
        let a_times = a_times.lock().expect("log").clone();
        let b_times = b_times.lock().expect("log").clone();
        assert!(b_times.len() >= 8, "{b_times:?}");
        assert_eq!(
            b_times[0], joined,
            "the first scrape does not wait for the grid"
        );
        for at in &b_times[1..] {
            assert!(
                a_times.contains(at),
                "b scraped at +{:?}, a at {:?}",
                at.duration_since(joined),
                a_times
                    .iter()
                    .map(|t| t.saturating_duration_since(joined))
                    .collect::<Vec<_>>()
            );
        }
    }
}
