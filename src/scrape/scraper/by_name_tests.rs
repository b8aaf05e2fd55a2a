//! The by-name scrape (`crate::scrape::by_name`) through the scrape tasks: what a pod is asked
//! for, by how it answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::tests::{FastScrapes, fast_scrapes};

use crate::endpoints::{Endpoint, EndpointState, PodId};
use crate::scrape::by_name::path_by_name;
use crate::scrape::test_pod::{self, TestPod};
use crate::scrape::{EngineKind, ScrapeConfig, ScrapeStatus};

/// How the fake pod answers a GET of `/metrics/?…` (`/metrics` always gets the
/// real vLLM page).
#[derive(Clone, Copy)]
enum ByName {
    /// The page (as vLLM's prometheus_client app does, give or take the filtering).
    Served,
    /// 404 (no app mounted there).
    NotFound,
    /// 200 and an empty page (something in front that knows no such path, or vLLM's
    /// multiprocess registry).
    Empty,
    /// 500 every time (something in front that fails there).
    Failing,
    /// The page once, then 500 (a pod that answered by name, then broke).
    ServedOnce,
}

/// A pod whose `/metrics` is the real vLLM page, and whose `/metrics/?…` answers as
/// `by_name` says.
async fn pod(by_name: ByName) -> TestPod {
    let page = test_pod::vllm_page();
    let served = AtomicUsize::new(0);
    test_pod::serve(move |target| {
        let first = target.starts_with("/metrics/") && served.fetch_add(1, Ordering::SeqCst) == 0;
        match (target.starts_with("/metrics/"), by_name) {
            (false, _) | (true, ByName::Served) => ("200 OK", page.clone()),
            (true, ByName::ServedOnce) if first => ("200 OK", page.clone()),
            (true, ByName::NotFound) => ("404 Not Found", Vec::new()),
            (true, ByName::Empty) => ("200 OK", Vec::new()),
            (true, ByName::Failing | ByName::ServedOnce) => {
                ("500 Internal Server Error", Vec::new())
            }
        }
    })
    .await
}

/// Scrapes `pod` until it has been asked `gets` times; the targets asked for, and
/// whether any scrape counted as failed.
async fn scrape(test_pod: &TestPod, by_name: bool, gets: usize) -> (Vec<String>, bool) {
    scrape_until(test_pod, by_name, gets, |status| status.metrics.is_some()).await
}

/// [`scrape`], until the pod's published status also passes `done`.
async fn scrape_until(
    test_pod: &TestPod,
    by_name: bool,
    gets: usize,
    done: impl Fn(&ScrapeStatus) -> bool,
) -> (Vec<String>, bool) {
    let pod = PodId(test_pod.addr);
    let FastScrapes {
        mut manager,
        store,
        registry,
        cancel,
    } = fast_scrapes(ScrapeConfig {
        by_name,
        ..ScrapeConfig::default()
    });
    manager.sync(&[Arc::new(EndpointState::new(Endpoint::new(pod)))]);
    tokio::time::timeout(Duration::from_secs(10), async {
        while test_pod.asked().len() < gets || !done(&store.status(pod)) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("scraped");
    cancel.cancel();
    let failed = !crate::telemetry::series_with_label(&registry, "endpoint")
        .iter()
        .all(|(name, _)| name != "kvpick_scrape_errors_total");
    let asked = test_pod.asked().into_iter().take(gets).collect();
    (asked, failed)
}

#[tokio::test]
async fn a_vllm_pod_is_asked_by_name_every_time() {
    let (targets, failed) = scrape(&pod(ByName::Served).await, true, 3).await;
    let by_name = path_by_name("/metrics", EngineKind::Vllm).expect("a path");
    assert_eq!(targets, [by_name.clone(), by_name.clone(), by_name]);
    assert!(!failed);
}

#[tokio::test]
async fn a_pod_that_does_not_answer_by_name_is_scraped_whole_from_its_first_scrape() {
    // Also a path that fails where the whole page works, before any answer by name.
    for answer in [ByName::NotFound, ByName::Empty, ByName::Failing] {
        let (targets, failed) = scrape(&pod(answer).await, true, 4).await;
        let by_name = path_by_name("/metrics", EngineKind::Vllm).expect("a path");
        assert_eq!(
            targets,
            [by_name.as_str(), "/metrics", "/metrics", "/metrics"]
        );
        assert!(!failed, "falling back is no failed scrape");
    }
}

#[tokio::test]
async fn whole_pages_when_configured() {
    let (targets, _) = scrape(&pod(ByName::Served).await, false, 2).await;
    assert_eq!(targets, ["/metrics", "/metrics"]);
}

#[tokio::test]
async fn a_pod_that_answered_by_name_and_then_fails_is_not_scraped_whole() {
    let (targets, failed) = scrape_until(&pod(ByName::ServedOnce).await, true, 3, |status| {
        status.consecutive_failures >= 2
    })
    .await;
    let by_name = path_by_name("/metrics", EngineKind::Vllm).expect("a path");
    assert_eq!(targets, [by_name.clone(), by_name.clone(), by_name]);
    assert!(failed, "its failures count as failed scrapes");
}
