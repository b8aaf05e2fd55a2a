//! Faults between the gateway and the pool, through a real Envoy (deploy/envoy/envoy.yaml),
//! the real kvpick binary and real HTTP backends on loopback: a pod that dies, a pod whose
//! host goes silent, a failed connect, client-forged control headers, kvpick itself down. Every request sent is
//! counted; none may be lost.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::backend::{Backend, pool_yaml};
use support::envoy::{
    ATTEMPTS_ECHO_HEADER, Envoy, EnvoyOptions, METADATA_ECHO_HEADER, UPSTREAM_ECHO_HEADER,
};
use support::http::{Reply, post_json, send};
use support::kvpick::Kvpick;
use support::sim_pod::SimPod;

/// A prompt long enough for kvpick's prefix affinity (approximate, from routing history).
fn prompt_body() -> Vec<u8> {
    let prompt: String = (0..40)
        .map(|i| format!("Rule {i}: be brief about invoice {i}. "))
        .collect();
    serde_json::json!({"model": "m", "prompt": prompt})
        .to_string()
        .into_bytes()
}

/// Requests sent and what came back.
#[derive(Debug, Default)]
struct Tally {
    sent: usize,
    ok: usize,
    /// Non-200 answers, with their status and body.
    failed: Vec<(u16, String)>,
}

impl Tally {
    fn count(&mut self, reply: &Reply) {
        self.sent += 1;
        if reply.status == 200 {
            self.ok += 1;
        } else {
            self.failed.push((reply.status, reply.text()));
        }
    }

    fn assert_none_lost(&self, what: &str) {
        assert!(
            self.failed.is_empty() && self.ok == self.sent,
            "{what}: {} sent, {} ok, failed: {:?}",
            self.sent,
            self.ok,
            self.failed
        );
        eprintln!("{what}: {} sent, {} ok, 0 lost", self.sent, self.ok);
    }
}

/// The backend that served (`served` is its address) and the other one.
fn served_and_other<'a>(
    served: &str,
    a: &'a Backend,
    b: &'a Backend,
) -> (&'a Backend, &'a Backend) {
    if served == a.addr.to_string() {
        (a, b)
    } else {
        (b, a)
    }
}

fn served_by(reply: &Reply) -> String {
    reply.header(UPSTREAM_ECHO_HEADER).unwrap_or_default()
}

fn attempts(reply: &Reply) -> String {
    reply.header(ATTEMPTS_ECHO_HEADER).unwrap_or_default()
}

async fn pod_view(kvpick: &Kvpick, addr: SocketAddr) -> Value {
    let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .expect("debug pods")
        .json();
    pods["pods"]
        .as_array()
        .and_then(|pods| {
            pods.iter()
                .find(|p| p["address"] == addr.to_string())
                .cloned()
        })
        .unwrap_or_else(|| panic!("{addr} not in /debug/pods: {pods}"))
}

/// Sends 10 requests: each must be picked for `live` and served at the first attempt.
async fn assert_picks_only(live: &Backend, url: &str, body: &[u8], tally: &mut Tally) {
    for _ in 0..10 {
        let reply = post_json(url, body).await;
        tally.count(&reply);
        assert_eq!(served_by(&reply), live.addr.to_string());
        assert_eq!(
            attempts(&reply),
            "1",
            "picked the pod left out: {:?}",
            reply.headers
        );
    }
}

/// Waits (5 s at most) until kvpick counts `addr` up again.
async fn await_up(kvpick: &Kvpick, addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while pod_view(kvpick, addr).await["down"] != false {
        assert!(Instant::now() < deadline, "not back up after 5 s");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test]
async fn a_pod_whose_listener_is_gone_is_left_out_and_comes_back_when_it_answers() {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    let kvpick = Kvpick::start(&pool_yaml(&[&a, &b]), &[]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            echo_upstream: true,
            ..Default::default()
        },
    )
    .await;
    let (url, body) = (envoy.url("/v1/completions"), prompt_body());
    let mut tally = Tally::default();

    // The prefix now lives on one pod: that one dies.
    let first = post_json(&url, &body).await;
    tally.count(&first);
    let dead_addr = served_by(&first);
    let (dead, live) = served_and_other(&dead_addr, &a, &b);
    assert_eq!(dead_addr, dead.addr.to_string(), "{:?}", first.headers);
    dead.stop();
    let stopped = Instant::now();

    // Until kvpick notices, Envoy retries the failed connects on the fallback: no request is
    // lost while the pod is being left out.
    let deadline = stopped + Duration::from_secs(5);
    loop {
        let view = pod_view(&kvpick, dead.addr).await;
        if view["down"] == true {
            assert_eq!(view["ready"], false, "{view}");
            let reason = view["down_reason"].as_str().unwrap_or_default();
            assert!(
                reason.contains("connection failed")
                    && reason.contains("no KV-event endpoint configured"),
                "{view}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "not down after 5 s: {view}");
        let reply = post_json(&url, &body).await;
        tally.count(&reply);
        assert_eq!(served_by(&reply), live.addr.to_string());
    }
    let detected = stopped.elapsed();
    eprintln!("left out after {detected:?}");

    // Left out: kvpick itself picks the live pod, so Envoy needs no retry.
    assert_picks_only(live, &url, &body, &mut tally).await;
    let metrics = kvpick.metrics_text().await;
    let gauge = format!("kvpick_endpoint_down{{endpoint=\"{}\"}} 1", dead.addr);
    let transitions = format!("kvpick_endpoint_down_total{{endpoint=\"{}\"}} 1", dead.addr);
    assert!(metrics.contains(&gauge), "{metrics}");
    assert!(metrics.contains(&transitions), "{metrics}");

    // It answers again: back among the candidates.
    dead.restart().await;
    await_up(&kvpick, dead.addr).await;
    assert!(kvpick.metrics_text().await.contains(&format!(
        "kvpick_endpoint_down{{endpoint=\"{}\"}} 0",
        dead.addr
    )));
    // New prompts (no prefix anywhere) reach it again.
    let mut reached = false;
    for i in 0..40 {
        let fresh = format!(r#"{{"model":"m","prompt":"fresh prompt {i}"}}"#);
        let reply = post_json(&url, fresh.as_bytes()).await;
        tally.count(&reply);
        if served_by(&reply) == dead.addr.to_string() {
            reached = true;
            break;
        }
    }
    assert!(reached, "the pod that came back gets no requests");
    tally.assert_none_lost("pod left out and back");
}

#[tokio::test]
async fn a_pod_whose_host_went_silent_is_left_out_and_comes_back_when_it_answers() {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    let kvpick = Kvpick::start(&pool_yaml(&[&a, &b]), &[]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            echo_upstream: true,
            ..Default::default()
        },
    )
    .await;
    let (url, body) = (envoy.url("/v1/completions"), prompt_body());
    let mut tally = Tally::default();

    // The prefix now lives on one pod, whose host then goes silent: nothing is refused or
    // reset, connects just hang (a dead node, a cut network).
    let first = post_json(&url, &body).await;
    tally.count(&first);
    let silent_addr = served_by(&first);
    let (silent, live) = served_and_other(&silent_addr, &a, &b);
    silent.blackhole().await;
    let silenced = Instant::now();

    // Until kvpick notices, each pick of it costs Envoy a connect timeout and a retry on the
    // fallback; nothing is lost.
    let deadline = silenced + Duration::from_secs(15);
    loop {
        let view = pod_view(&kvpick, silent.addr).await;
        if view["down"] == true {
            let reason = view["down_reason"].as_str().unwrap_or_default();
            assert!(reason.contains("timed out connecting"), "{view}");
            break;
        }
        assert!(Instant::now() < deadline, "not down after 15 s: {view}");
        let reply = post_json(&url, &body).await;
        tally.count(&reply);
        assert_eq!(served_by(&reply), live.addr.to_string());
    }
    eprintln!("left out after {:?}", silenced.elapsed());

    // Left out: kvpick picks the live pod, so Envoy spends no connect timeout on it.
    assert_picks_only(live, &url, &body, &mut tally).await;

    // Its host answers again: back among the candidates.
    silent.unblackhole();
    await_up(&kvpick, silent.addr).await;
    tally.assert_none_lost("silent pod left out and back");
}

#[tokio::test]
async fn a_failed_connect_to_the_primary_is_retried_on_the_fallback() {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    // One scrape at start and no more: kvpick never learns that the pod died, so every pick
    // of it is Envoy's to repair (the retry on the fallback is what is tested here).
    let kvpick = Kvpick::start(&pool_yaml(&[&a, &b]), &["--scrape-interval", "3600s"]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            echo_upstream: true,
            echo_metadata: true,
            ..Default::default()
        },
    )
    .await;
    let (url, body) = (envoy.url("/v1/completions"), prompt_body());
    let mut tally = Tally::default();
    let first = post_json(&url, &body).await;
    tally.count(&first);
    let dead_addr = served_by(&first);
    let (dead, live) = served_and_other(&dead_addr, &a, &b);
    dead.stop();

    let mut retried = 0;
    for _ in 0..10 {
        let reply = post_json(&url, &body).await;
        tally.count(&reply);
        assert_eq!(
            served_by(&reply),
            live.addr.to_string(),
            "{:?}",
            reply.headers
        );
        let picked = reply.header(METADATA_ECHO_HEADER).unwrap_or_default();
        if picked.starts_with(&dead.addr.to_string()) {
            assert_eq!(picked, format!("{},{}", dead.addr, live.addr));
            assert_eq!(attempts(&reply), "2", "{:?}", reply.headers);
            retried += 1;
        }
    }
    assert!(
        retried > 0,
        "kvpick never picked the dead pod: nothing was retried"
    );
    // Many at once: each retry is concurrent with the others (Envoy's default circuit
    // breaker allows 3 concurrent retries and would answer 503 to the rest).
    let replies = futures::future::join_all((0..32).map(|_| {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { post_json(&url, &body).await })
    }))
    .await;
    for reply in replies {
        let reply = reply.expect("join");
        tally.count(&reply);
        if reply.status == 200 {
            assert_eq!(served_by(&reply), live.addr.to_string());
        }
        if attempts(&reply) == "2" {
            retried += 1;
        }
    }
    eprintln!("retried on the fallback: {retried}");
    tally.assert_none_lost("dead primary, retried on the fallback");
    assert!(
        dead.seen().len() == 1,
        "only the first request reached the dead pod"
    );
}

#[tokio::test]
async fn client_sent_control_headers_are_stripped_even_with_kvpick_down() {
    let (pool, fallback) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    let mut kvpick = Kvpick::start(&pool_yaml(&[&pool]), &[]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            fallback: vec![fallback.addr],
            echo_upstream: true,
            ..Default::default()
        },
    )
    .await;
    let url = envoy.url("/v1/completions");
    let body = br#"{"model":"m","prompt":"hello"}"#;
    let mut tally = Tally::default();

    // kvpick up: a client's model rewrite is not applied, its destination not followed.
    let forged = [
        ("content-type", "application/json"),
        ("x-gateway-model-name-rewrite", "forged-model"),
        ("x-gateway-destination-endpoint", "127.0.0.1:1"),
    ];
    for _ in 0..5 {
        let reply = send("POST", &url, &forged, body.to_vec())
            .await
            .expect("request");
        tally.count(&reply);
        assert_eq!(served_by(&reply), pool.addr.to_string());
    }
    let seen = pool.seen();
    assert_eq!(seen.len(), 5);
    for request in &seen {
        assert_eq!(
            request.body.as_ref(),
            body,
            "the client's rewrite was applied"
        );
        assert!(!request.headers.contains_key("x-gateway-model-name-rewrite"));
        assert_eq!(
            request.headers["x-gateway-destination-endpoint"],
            pool.addr.to_string()
        );
    }

    // kvpick down: FailOpen takes the fallback route whatever destination the client sent.
    kvpick.child.kill().expect("kill kvpick");
    kvpick.child.wait().expect("reap");
    support::wait_until("fail-open routing", Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            post_json(&url, br#"{"model":"m","prompt":"probe"}"#)
                .await
                .status
                == 200
        }
    })
    .await;
    let before = fallback.seen().len();
    let pool_addr = pool.addr.to_string();
    let headers = [
        ("content-type", "application/json"),
        ("x-gateway-destination-endpoint", pool_addr.as_str()),
    ];
    for _ in 0..5 {
        let reply = send("POST", &url, &headers, body.to_vec())
            .await
            .expect("request");
        tally.count(&reply);
        assert_eq!(
            served_by(&reply),
            fallback.addr.to_string(),
            "{}",
            reply.text()
        );
    }
    let seen = fallback.seen();
    assert_eq!(seen.len(), before + 5);
    assert!(
        seen[before..]
            .iter()
            .all(|r| !r.headers.contains_key("x-gateway-destination-endpoint")),
        "the client's destination header was forwarded"
    );
    tally.assert_none_lost("forged control headers");
}

#[tokio::test]
async fn a_killed_engine_with_kv_events_is_left_out_and_comes_back() {
    let mut pods = [SimPod::start(&[]).await, SimPod::start(&[]).await];
    let pool = format!(
        "endpoints:\n{}{}",
        pods[0].pool_entry(),
        pods[1].pool_entry()
    );
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_string_lossy();
    let kvpick = Kvpick::start(&pool, &["--tokenizer", &tokenizer]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            echo_upstream: true,
            ..Default::default()
        },
    )
    .await;
    let url = envoy.url("/v1/completions");
    let prompt: String = (0..40)
        .map(|i| format!("Rule {i}: be brief about invoice {i}. "))
        .collect();
    let body = serde_json::json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4})
        .to_string()
        .into_bytes();
    let mut tally = Tally::default();
    // Both event streams up before the fault.
    for pod in &pods {
        let deadline = Instant::now() + Duration::from_secs(10);
        while pod_view(&kvpick, pod.http).await["kv_events"]["connected"] != true {
            assert!(
                Instant::now() < deadline,
                "{} events never connected",
                pod.http
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    let first = post_json(&url, &body).await;
    tally.count(&first);
    let dead = if served_by(&first) == pods[0].http.to_string() {
        0
    } else {
        1
    };
    let (dead_addr, live_addr) = (pods[dead].http, pods[1 - dead].http);
    assert_eq!(served_by(&first), dead_addr.to_string(), "{}", first.text());
    // kvpick's index learns (from the engine's own KV events) that the prefix lives there.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pod_view(&kvpick, dead_addr).await["index_blocks"]
        .as_u64()
        .unwrap_or(0)
        == 0
    {
        assert!(Instant::now() < deadline, "no KV events from {dead_addr}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    pods[dead].kill();
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(10);
    loop {
        let view = pod_view(&kvpick, dead_addr).await;
        if view["down"] == true {
            let reason = view["down_reason"].as_str().unwrap_or_default();
            assert!(
                reason.contains("connection failed")
                    && reason.contains("KV-event stream disconnected"),
                "{view}"
            );
            assert_eq!(view["kv_events"]["connected"], false, "{view}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not down 10 s after the kill: {view}"
        );
        let reply = post_json(&url, &body).await;
        tally.count(&reply);
        assert_eq!(served_by(&reply), live_addr.to_string(), "{}", reply.text());
    }
    eprintln!("killed engine left out after {:?}", killed.elapsed());
    // The prefix's holder is gone: kvpick sends its requests elsewhere by itself.
    for _ in 0..5 {
        let reply = post_json(&url, &body).await;
        tally.count(&reply);
        assert_eq!(served_by(&reply), live_addr.to_string(), "{}", reply.text());
        assert_eq!(
            attempts(&reply),
            "1",
            "picked the dead pod: {:?}",
            reply.headers
        );
    }

    pods[dead].restart().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view = pod_view(&kvpick, dead_addr).await;
        if view["down"] == false && view["kv_events"]["connected"] == true {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not back 10 s after the restart: {view}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tally.assert_none_lost("engine killed and restarted");
}

/// Thresholds of `cluster`'s DEFAULT-priority circuit breaker in the shipped config.
fn thresholds(config: &serde_yaml::Value, cluster: &str) -> serde_yaml::Value {
    let clusters = config["static_resources"]["clusters"]
        .as_sequence()
        .expect("clusters");
    let cluster = clusters
        .iter()
        .find(|c| c["name"].as_str() == Some(cluster))
        .unwrap_or_else(|| panic!("no cluster {cluster}"));
    cluster["circuit_breakers"]["thresholds"]
        .as_sequence()
        .and_then(|t| t.iter().find(|t| t["priority"].as_str() == Some("DEFAULT")))
        .cloned()
        .unwrap_or_else(|| panic!("no DEFAULT circuit breaker: {cluster:?}"))
}

#[test]
fn the_shipped_config_raises_envoys_circuit_breakers() {
    let text = std::fs::read_to_string(support::repo_root().join("deploy/envoy/envoy.yaml"))
        .expect("envoy.yaml");
    let config: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
    let at_least = |t: &serde_yaml::Value, key: &str, min: u64| {
        let value = t[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} unset: {t:?}"));
        assert!(value >= min, "{key} = {value} < {min}");
    };
    // Envoy's defaults: 1,024 connections, pending and active requests, 3 retries.
    let kvpick = thresholds(&config, "kvpick");
    at_least(&kvpick, "max_requests", 100_000);
    at_least(&kvpick, "max_pending_requests", 100_000);
    for pool in ["inference-pool", "inference-pool-fallback"] {
        let t = thresholds(&config, pool);
        for key in [
            "max_connections",
            "max_pending_requests",
            "max_requests",
            "max_retries",
        ] {
            at_least(&t, key, 100_000);
        }
    }
}
