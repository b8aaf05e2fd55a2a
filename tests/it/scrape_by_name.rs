//! The by-name scrape through the real binary: kvpick asks a simulated vLLM pod (which
//! answers `/metrics/?name[]=…` as vLLM does) for only the metrics it reads, says so in
//! `/debug/pods`, and asks for the whole page when told to (`--scrape-whole-pages`) or when
//! the pod does not answer by name (a stand-in that knows only `/metrics`).

use crate::support;

use std::time::Duration;

use support::http::send;
use support::kvpick::Kvpick;
use support::sim_pod::SimPod;
use support::wait_until;

/// The scraped page `/debug/pods` shows for the first pod, once it has been scraped.
async fn scraped_page(kvpick: &Kvpick) -> Option<String> {
    let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .ok()?
        .json();
    let metrics = &pods["pods"][0]["metrics"];
    (metrics["error"].is_null() && metrics["age_ms"].is_u64())
        .then(|| metrics["page"].as_str().map(str::to_owned))
        .flatten()
}

async fn page_of(kvpick: &Kvpick) -> String {
    wait_until("the pod scraped", Duration::from_secs(20), || async {
        scraped_page(kvpick).await.is_some()
    })
    .await;
    scraped_page(kvpick).await.unwrap_or_default()
}

#[tokio::test]
async fn a_vllm_pod_is_scraped_by_name_unless_told_or_unable() {
    let sim = SimPod::start(&[]).await;
    let pool = format!("endpoints:\n{}", sim.pool_entry());
    let by_name = Kvpick::start(&pool, &[]).await;
    assert_eq!(page_of(&by_name).await, "by_name");
    let whole = Kvpick::start(&pool, &["--scrape-whole-pages"]).await;
    assert_eq!(page_of(&whole).await, "whole");

    // A pod whose `/metrics/` is not the prometheus_client app (404 there) is scraped whole,
    // with no failed scrape (`page_of` waits for a scrape without an error).
    let stand_in = support::backend::Backend::start("127.0.0.1").await;
    stand_in.refuse_metrics_by_name();
    let falls_back = Kvpick::start(&support::backend::pool_yaml(&[&stand_in]), &[]).await;
    assert_eq!(page_of(&falls_back).await, "whole");
    let errors = send("GET", &falls_back.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("/metrics")
        .text();
    assert!(
        !errors.contains("kvpick_scrape_errors_total{"),
        "falling back counted a failed scrape: {errors}"
    );
}
