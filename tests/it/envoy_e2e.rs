//! End to end through a real Envoy (deploy/envoy/envoy.yaml), the real kvpick binary and
//! real HTTP backends on loopback.

use crate::support;

use std::time::Duration;

use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions, METADATA_ECHO_HEADER};
use support::http::{post_json, send};
use support::kvpick::{Kvpick, health};
use tonic_health::pb::health_check_response::ServingStatus;

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

/// Posts `body` with a client's attempt at picking its destination and a control header
/// (neither may reach the backend: the caller checks), and checks it was answered by the
/// backend kvpick's `envoy.lb` metadata named.
async fn send_routed_with_spoofed_headers(envoy: &Envoy, body: &[u8]) {
    let reply = send(
        "POST",
        &envoy.url("/v1/completions"),
        &[
            ("content-type", "application/json"),
            ("x-gateway-destination-endpoint", "127.0.0.1:1"),
            ("x-gateway-inference-objective", "critical"),
        ],
        body.to_vec(),
    )
    .await
    .expect("request");
    assert_eq!(reply.status, 200, "{}", reply.text());
    let served_by = reply.json()["backend"]
        .as_str()
        .expect("backend")
        .to_owned();
    assert_eq!(
        reply.header(METADATA_ECHO_HEADER).as_deref(),
        Some(served_by.as_str()),
        "routed by kvpick's metadata"
    );
}

#[tokio::test]
async fn requests_reach_the_picked_backend_with_header_and_metadata_agreeing() {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    // No fallbacks: the destination names exactly one endpoint, which each backend can
    // compare with itself (the fallback list is tested in faults_gateway.rs).
    let kvpick = Kvpick::start(&pool_yaml(&[&a, &b]), &["--max-fallbacks", "0"]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            echo_metadata: true,
            ..Default::default()
        },
    )
    .await;
    for _ in 0..10 {
        send_routed_with_spoofed_headers(&envoy, BODY).await;
    }
    let seen: Vec<_> = a.seen().into_iter().chain(b.seen()).collect();
    assert_eq!(seen.len(), 10);
    for request in &seen {
        assert_eq!(request.body.as_ref(), BODY);
        let destination = request
            .headers
            .get("x-gateway-destination-endpoint")
            .expect("header");
        assert_ne!(destination, "127.0.0.1:1");
        assert!(
            request
                .headers
                .get("x-gateway-inference-objective")
                .is_none()
        );
    }
    assert!(
        !a.seen().is_empty() && !b.seen().is_empty(),
        "both backends used"
    );
    // Each backend saw only requests whose destination header named it.
    for backend in [&a, &b] {
        for request in backend.seen() {
            assert_eq!(
                request.headers["x-gateway-destination-endpoint"],
                backend.addr.to_string()
            );
        }
    }
}

#[tokio::test]
async fn a_200kb_body_arrives_intact() {
    let a = Backend::start("127.0.0.1").await;
    let kvpick = Kvpick::start(&pool_yaml(&[&a]), &[]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    // Every byte value that JSON strings allow, in a pattern that shows any shift or loss.
    let prompt: String = (0..200_000u32)
        .map(|i| char::from(b'a' + (i * 7 % 26) as u8))
        .collect();
    let body = format!(r#"{{"model":"m","prompt":"{prompt}","unicode":"헬로 🦀"}}"#).into_bytes();
    let reply = post_json(&envoy.url("/v1/completions"), &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = a.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body.len(), body.len());
    assert!(
        seen[0].body.as_ref() == body.as_slice(),
        "body changed in transit"
    );
}

#[tokio::test]
async fn a_gateway_in_streamed_response_mode_gets_answers_intact_and_models_restored() {
    let a = Backend::start("127.0.0.1").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rewrites.yaml");
    std::fs::write(
        &rules,
        "rules: [{matches: [alias], targets: [{modelRewrite: served, weight: 1}]}]\n",
    )
    .expect("write rules");
    let rules = rules.display().to_string();
    let kvpick = Kvpick::start(&pool_yaml(&[&a]), &["--model-rewrites", &rules]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            response_body_streamed: true,
            echo_metadata: true,
            ..Default::default()
        },
    )
    .await;
    for i in 0..5 {
        let reply = post_json(&envoy.url("/v1/completions"), BODY).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(reply.header(METADATA_ECHO_HEADER).is_some(), "routed");
        let answer = reply.json();
        assert_eq!(answer["model"], "m", "request {i}");
        assert_eq!(answer["bytes"], BODY.len());

        let aliased = br#"{"model":"alias","prompt":"hello"}"#;
        let reply = post_json(&envoy.url("/v1/completions"), aliased).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let seen = a.seen();
        let sent: serde_json::Value =
            serde_json::from_slice(&seen.last().expect("seen").body).expect("json");
        assert_eq!(sent["model"], "served", "rewritten on the way in");
        assert_eq!(reply.json()["model"], "alias", "restored on the way out");
    }
}

#[tokio::test]
async fn a_gateway_that_holds_request_bodies_gets_them_routed_and_rewritten() {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = dir.path().join("rewrites.yaml");
    std::fs::write(
        &rules,
        "rules: [{matches: [alias], targets: [{modelRewrite: served-model-v2, weight: 1}]}]\n",
    )
    .expect("write rules");
    let rules = rules.display().to_string();
    let kvpick = Kvpick::start(
        &pool_yaml(&[&a, &b]),
        &["--max-fallbacks", "0", "--model-rewrites", &rules],
    )
    .await;
    // No fallback cluster: a request that failed open would get 503, not 200.
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            request_body_buffered: true,
            echo_metadata: true,
            ..Default::default()
        },
    )
    .await;
    let aliased = br#"{"model":"alias","prompt":"hello there"}"#;
    for i in 0..6 {
        let sent = if i % 2 == 0 { BODY } else { &aliased[..] };
        send_routed_with_spoofed_headers(&envoy, sent).await;
    }
    let seen: Vec<_> = a.seen().into_iter().chain(b.seen()).collect();
    assert_eq!(seen.len(), 6);
    let rewritten = br#"{"model":"served-model-v2","prompt":"hello there"}"#;
    for request in &seen {
        let body = request.body.as_ref();
        assert!(
            body == BODY || body == &rewritten[..],
            "body as sent, or with only its model rewritten: {}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(
            request.headers.get("content-length").map(|v| v.as_bytes()),
            Some(body.len().to_string().as_bytes()),
            "content-length matches the body forwarded"
        );
        assert_ne!(
            request.headers["x-gateway-destination-endpoint"],
            "127.0.0.1:1"
        );
        assert!(
            request
                .headers
                .get("x-gateway-inference-objective")
                .is_none()
        );
    }
    assert_eq!(
        seen.iter()
            .filter(|r| r.body.as_ref() == &rewritten[..])
            .count(),
        3
    );
}

#[tokio::test]
async fn bad_bodies_get_400_and_413_with_the_reason() {
    let a = Backend::start("127.0.0.1").await;
    let kvpick = Kvpick::start(&pool_yaml(&[&a]), &["--max-body-bytes", "65536"]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");

    let reply = post_json(&url, b"{this is not json").await;
    assert_eq!(reply.status, 400);
    assert!(
        reply
            .text()
            .starts_with("inference error: body is not valid JSON"),
        "{}",
        reply.text()
    );

    let reply = post_json(&url, br#"{"prompt":"no model"}"#).await;
    assert_eq!(reply.status, 400);
    assert!(
        reply.text().contains("no `model` field"),
        "{}",
        reply.text()
    );

    let big = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(100_000));
    let reply = post_json(&url, big.as_bytes()).await;
    assert_eq!(reply.status, 413);
    assert!(
        reply.text().contains("exceeds 65536 bytes"),
        "{}",
        reply.text()
    );

    assert!(a.seen().is_empty(), "no rejected request reached a backend");
    let metrics = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics");
    assert!(
        metrics
            .text()
            .contains("inference_objective_request_error_total")
    );
}

#[tokio::test]
async fn zero_endpoints_get_503() {
    let kvpick = Kvpick::start("endpoints: []\n", &[]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let reply = post_json(&envoy.url("/v1/completions"), BODY).await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.text(), "inference error: no candidate endpoints");
}

#[tokio::test]
async fn the_subset_hint_is_honoured() {
    // Match is on IP, so the backends sit on different loopback addresses.
    let a = Backend::start("127.0.0.2").await;
    let b = Backend::start("127.0.0.3").await;
    let kvpick = Kvpick::start(&pool_yaml(&[&a, &b]), &[]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            subset_hint: Some(vec![b.addr.to_string()]),
            ..Default::default()
        },
    )
    .await;
    for _ in 0..8 {
        let reply = post_json(&envoy.url("/v1/completions"), BODY).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.json()["backend"], b.addr.to_string());
    }
    assert!(a.seen().is_empty());
}

#[tokio::test]
async fn pool_file_edits_apply_without_a_restart() {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    let kvpick = Kvpick::start(&pool_yaml(&[&a]), &[]).await;
    // Envoy's pool cluster lists the pool's endpoints (override_host picks among them): b is
    // known to it before the edit adds it to kvpick's pool, as an EDS update would make it.
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            extra_pool: vec![b.addr],
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        post_json(&envoy.url("/x"), BODY).await.json()["backend"],
        a.addr.to_string()
    );

    // NOTE: each edit replaces the file at once: a truncate-then-write read in between is a
    // half-written (empty) file, which keeps the pool but counts as a reload error too.
    kvpick.write_pool(&pool_yaml(&[&b]));
    let url = envoy.url("/x");
    let b_addr = b.addr.to_string();
    support::wait_until("the edit to apply", Duration::from_secs(10), || {
        let (url, b_addr) = (url.clone(), b_addr.clone());
        async move { post_json(&url, BODY).await.json()["backend"] == b_addr.as_str() }
    })
    .await;

    // An invalid edit keeps the last good pool.
    kvpick.write_pool("endpoints:\n  - address: nonsense\n");
    tokio::time::sleep(Duration::from_millis(400)).await;
    for _ in 0..5 {
        assert_eq!(
            post_json(&envoy.url("/x"), BODY).await.json()["backend"],
            b_addr
        );
    }
    let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .expect("debug pods")
        .json();
    assert_eq!(pods["pods"][0]["address"], b_addr);
    let metrics = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    assert!(
        metrics.contains("kvpick_pool_reload_errors_total 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn fail_open_keeps_traffic_flowing_when_kvpick_is_down() {
    let a = Backend::start("127.0.0.1").await;
    let mut kvpick = Kvpick::start(&pool_yaml(&[&a]), &[]).await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            fallback: vec![a.addr],
            ..Default::default()
        },
    )
    .await;
    let routed = post_json(&envoy.url("/v1/completions"), BODY).await;
    assert_eq!(routed.status, 200);
    kvpick.child.kill().expect("kill kvpick");
    kvpick.child.wait().expect("reap");
    // Envoy's health check takes the dead kvpick out within its interval (1 s); from then
    // on every request flows through the fallback route.
    let url = envoy.url("/v1/completions");
    support::wait_until("fail-open routing", Duration::from_secs(10), || {
        let url = url.clone();
        async move { post_json(&url, BODY).await.status == 200 }
    })
    .await;
    let before = a.seen().len();
    for _ in 0..5 {
        let reply = post_json(&envoy.url("/v1/completions"), BODY).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let seen = a.seen();
    assert_eq!(seen.len(), before + 5);
    assert!(
        seen[0]
            .headers
            .contains_key("x-gateway-destination-endpoint")
    );
    assert!(
        seen[before..]
            .iter()
            .all(|r| !r.headers.contains_key("x-gateway-destination-endpoint")),
        "without kvpick no destination is set and the fallback route serves"
    );
}

#[tokio::test]
async fn sigterm_turns_readiness_off_and_drains_in_flight_streams() {
    let a = Backend::start("127.0.0.1").await;
    let mut kvpick = Kvpick::start(&pool_yaml(&[&a]), &["--drain-timeout", "20s"]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/hold");
    let held = tokio::spawn(async move { post_json(&url, BODY).await });
    let seen = a.clone();
    support::wait_until(
        "the held request to reach the backend",
        Duration::from_secs(10),
        || {
            let seen = seen.clone();
            async move { !seen.seen().is_empty() }
        },
    )
    .await;

    kvpick.terminate();
    let port = kvpick.health_port;
    support::wait_until(
        "readiness to go off",
        Duration::from_secs(10),
        || async move { health(port, "readiness").await != Some(ServingStatus::Serving) },
    )
    .await;
    assert!(
        kvpick.child.try_wait().expect("try_wait").is_none(),
        "kvpick waits for the in-flight stream"
    );

    a.release();
    let reply = held.await.expect("join");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.text(), "data: first\n\ndata: [DONE]\n\n");
    assert_eq!(kvpick.wait_exit(Duration::from_secs(15)).await, Some(0));
}
