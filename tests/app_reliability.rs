//! Reliability of the kvpick process through its real interfaces: SIGTERM under traffic
//! behind a real Envoy, slow uploaders against the body budget, idle ext-proc streams.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::backend::Backend;
use support::envoy::{Envoy, EnvoyOptions};
use support::http::send;
use support::kvpick::Kvpick;

fn pool_yaml(backends: &[&Backend]) -> String {
    let mut yaml = String::from("endpoints:\n");
    for b in backends {
        yaml.push_str(&format!("  - address: {}\n", b.addr));
    }
    yaml
}

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

/// Outcome of one request of the steady traffic: its status (0: transport error).
async fn post(url: &str) -> u16 {
    match send(
        "POST",
        url,
        &[("content-type", "application/json")],
        BODY.to_vec(),
    )
    .await
    {
        Ok(reply) => reply.status,
        Err(error) => {
            eprintln!("request failed: {error}");
            0
        }
    }
}

#[tokio::test]
async fn sigterm_under_steady_traffic_loses_no_request() {
    let a = Backend::start("127.0.0.1").await;
    let grace = Duration::from_secs(3);
    let mut kvpick = Kvpick::start(
        &pool_yaml(&[&a]),
        &["--shutdown-grace-period", "3s", "--drain-timeout", "5s"],
    )
    .await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            fallback: vec![a.addr],
            ..Default::default()
        },
    )
    .await;
    let url = envoy.url("/v1/completions");
    // Until Envoy's health check has seen kvpick SERVING, requests fall open: wait for a
    // routed one so the traffic below really goes through kvpick when SIGTERM comes.
    support::wait_until("routing through kvpick", Duration::from_secs(10), || {
        let (url, a) = (url.clone(), a.clone());
        async move {
            post(&url).await == 200
                && a.seen()
                    .last()
                    .is_some_and(|r| r.headers.contains_key("x-gateway-destination-endpoint"))
        }
    })
    .await;
    let before = a.seen().len();

    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (url, stop) = (url.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    statuses.push(post(&url).await);
                }
                statuses
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let terminated = Instant::now();
    kvpick.terminate();
    let code = kvpick.wait_exit(Duration::from_secs(20)).await;
    let ran = terminated.elapsed();
    // Traffic goes on a little past the exit: the gateway must have let go of kvpick.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut statuses = Vec::new();
    for client in clients {
        statuses.extend(client.await.expect("client task"));
    }

    let mut lost = std::collections::BTreeMap::<u16, usize>::new();
    for status in statuses.iter().filter(|s| !(200..300).contains(*s)) {
        *lost.entry(*status).or_default() += 1;
    }
    let lost_total: usize = lost.values().sum();
    let seen = &a.seen()[before..];
    let routed = seen
        .iter()
        .filter(|r| r.headers.contains_key("x-gateway-destination-endpoint"))
        .count();
    eprintln!(
        "SIGTERM under traffic: {} requests sent, {lost_total} lost (by status: {lost:?}), {routed} routed by kvpick, {} fell open; kvpick exited {code:?} after {ran:?}",
        statuses.len(),
        seen.len() - routed,
    );
    assert!(statuses.len() >= 20, "steady traffic: {}", statuses.len());
    assert_eq!(lost_total, 0, "requests lost during shutdown, by status: {lost:?}");
    assert_eq!(seen.len(), statuses.len(), "every request reached the backend");
    assert!(routed > 0, "kvpick routed traffic before the shutdown");
    assert_eq!(code, Some(0));
    assert!(ran >= grace, "kvpick kept accepting for the grace period ({ran:?})");
}
