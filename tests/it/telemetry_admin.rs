//! Who can reach `/metrics` and the `/debug/*` views of the real kvpick binary: the debug
//! views (a cross-tenant cache oracle) only on loopback, off the metrics port; with a bearer
//! token file, nothing without the token.

use crate::support;

use support::backend::Backend;
use support::http::send;
use support::kvpick::Kvpick;

const PROBE: &[u8] = br#"{"model":"m","prompt":"another tenant's secret prompt"}"#;

async fn pool() -> (Backend, String) {
    let backend = Backend::start("127.0.0.1").await;
    let yaml = format!("endpoints:\n  - address: {}\n", backend.addr);
    (backend, yaml)
}

async fn status(url: &str, headers: &[(&str, &str)]) -> Result<u16, String> {
    let method = if url.contains("/debug/prefix") || url.contains("/debug/explain") {
        "POST"
    } else {
        "GET"
    };
    send(method, url, headers, PROBE.to_vec())
        .await
        .map(|r| r.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_views_are_off_the_metrics_port_and_only_on_loopback() {
    let (_backend, yaml) = pool().await;
    // Every other server on all addresses, as the default `--bind-address 0.0.0.0`.
    let kvpick = Kvpick::start(&yaml, &["--bind-address", "0.0.0.0"]).await;
    let on = |ip: &str, port: u16, path: &str| format!("http://{ip}:{port}{path}");

    // /metrics answers on any address (127.0.0.2 stands in for the pod IP).
    for ip in ["127.0.0.1", "127.0.0.2"] {
        assert_eq!(
            status(&on(ip, kvpick.metrics_port, "/metrics"), &[]).await,
            Ok(200),
            "/metrics on {ip}"
        );
    }
    for path in ["/debug/pods", "/debug/prefix", "/debug/explain"] {
        for ip in ["127.0.0.1", "127.0.0.2"] {
            assert_eq!(
                status(&on(ip, kvpick.metrics_port, path), &[]).await,
                Ok(404),
                "{path} is not on the metrics port ({ip})"
            );
        }
        assert_eq!(
            status(&kvpick.debug_url(path), &[]).await,
            Ok(200),
            "{path} on the loopback debug port"
        );
        let elsewhere = status(&on("127.0.0.2", kvpick.debug_port, path), &[]).await;
        assert!(
            elsewhere.is_err(),
            "{path}: the debug port is bound to 127.0.0.1 only, got {elsewhere:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bearer_token_file_guards_metrics_and_debug_views() {
    let (_backend, yaml) = pool().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "t0ken-for-prometheus\n").expect("write token");
    let token_arg = token_file.to_string_lossy().into_owned();
    let kvpick = Kvpick::start(&yaml, &["--metrics-bearer-token-file", &token_arg]).await;

    let urls = [
        kvpick.metrics_url("/metrics"),
        kvpick.debug_url("/debug/pods"),
        kvpick.debug_url("/debug/prefix"),
        kvpick.debug_url("/debug/explain"),
    ];
    for url in &urls {
        assert_eq!(status(url, &[]).await, Ok(401), "{url} without a token");
        for wrong in ["Bearer t0ken-for-prometheu", "Basic t0ken-for-prometheus"] {
            assert_eq!(
                status(url, &[("authorization", wrong)]).await,
                Ok(401),
                "{url} with `{wrong}`"
            );
        }
        assert_eq!(
            status(url, &[("authorization", "Bearer t0ken-for-prometheus")]).await,
            Ok(200),
            "{url} with the token"
        );
    }
    let unauthorized = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics");
    assert_eq!(
        unauthorized.header("www-authenticate").as_deref(),
        Some("Bearer")
    );
    let metrics = send(
        "GET",
        &kvpick.metrics_url("/metrics"),
        &[("authorization", "Bearer t0ken-for-prometheus")],
        Vec::new(),
    )
    .await
    .expect("metrics")
    .text();
    assert!(
        metrics.contains("kvpick_admin_unauthorized_requests_total 13"),
        "refusals are counted"
    );

    // An empty token file is a start-up error, not an open endpoint.
    std::fs::write(&token_file, "\n").expect("write token");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpick"))
        .args(["serve", "--endpoints-file", "/nonexistent.yaml"])
        .args(["--metrics-bearer-token-file", &token_arg])
        .output()
        .expect("run kvpick");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("holds no token"), "{stderr}");
}
