//! llm-d's EPP flags through the real binary (README "llm-d's flags",
//! `src/config/llmd_flags.rs`): a Deployment's arguments start kvpick and do what they say
//! there; what kvpick cannot honour is refused with the reason.

use crate::app_reliability::raw::{self, Outcome};
use crate::support;
use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::post_json;
use support::kvpick::{Kvpick, serve_refused};

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

/// A subset hint naming an address outside the pool: honoured, it leaves no candidate.
const OUTSIDE_THE_POOL: &str = "127.0.0.9:9";

#[tokio::test]
async fn an_llmd_deployments_arguments_start_kvpick_and_apply() {
    let a = Backend::start("127.0.0.2").await;
    let b = Backend::start("127.0.0.3").await;
    let pool = pool_yaml(&[&a, &b]);
    let hint = || EnvoyOptions {
        subset_hint: Some(vec![OUTSIDE_THE_POOL.to_owned()]),
        ..Default::default()
    };

    // What GIE's and llm-d's EPP manifests pass (`--v 4`, `--zap-encoder json`, …), with the
    // subset filter off.
    let kvpick = Kvpick::start(
        &pool,
        &[
            // Given twice (a chart's default, then the user's): the last one counts, as in Go.
            "--v",
            "2",
            "--zap-encoder",
            "json",
            "--tracing=false",
            "--v",
            "4",
            "--refresh-metrics-interval=100ms",
            "--metrics-staleness-threshold=2s",
            "--health-checking",
            "--enable-pprof=false",
            "--allow-experimental-plugins",
            "--metrics-endpoint-auth=false",
            "--grpc-max-recv-msg-size=16MiB",
            "--feature-gates=flowControl",
            "--drain-timeout=1m30s",
            "--disable-endpoint-subset-filter",
        ],
    )
    .await;
    // JSON log lines, and the gate applied.
    kvpick
        .wait_log(&[
            r#"{"timestamp":"#,
            r#""message":"scheduler ready""#,
            r#""flow_control":true"#,
        ])
        .await;
    let envoy = Envoy::start(&kvpick, hint()).await;
    for _ in 0..4 {
        let reply = post_json(&envoy.url("/v1/completions"), BODY).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert_eq!(a.seen().len() + b.seen().len(), 4);
    drop(envoy);
    drop(kvpick);

    // The control: the same hint honoured (no flag) leaves no candidate.
    let honoured = Kvpick::start(&pool, &[]).await;
    let envoy = Envoy::start(&honoured, hint()).await;
    let reply = post_json(&envoy.url("/v1/completions"), BODY).await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert_eq!(a.seen().len() + b.seen().len(), 4);
}

#[tokio::test]
async fn the_grpc_receive_limit_bounds_the_ext_proc_messages_kvpick_reads() {
    let backend = Backend::start("127.0.0.1").await;
    let pool = pool_yaml(&[&backend]);
    // One 100 KB body message (a gateway's chunks are at most 62,000 bytes; a client may
    // send more).
    let big = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(100_000)).into_bytes();
    let send_one = |kvpick: &Kvpick, body: Vec<u8>| {
        let port = kvpick.grpc_port;
        async move {
            let mut client = support::extproc::connect(port).await;
            let mut stream = raw::open(&mut client).await.expect("stream");
            stream.post_headers().await;
            stream.body(&body, true).await;
            raw::outcome(stream.rx.message().await)
        }
    };

    let limited = Kvpick::start(&pool, &["--grpc-max-recv-msg-size=64Ki"]).await;
    assert_eq!(send_one(&limited, BODY.to_vec()).await, Outcome::Routed);
    let over = send_one(&limited, big.clone()).await;
    assert_eq!(over, Outcome::Closed(tonic::Code::OutOfRange));
    drop(limited);

    let default = Kvpick::start(&pool, &[]).await;
    assert_eq!(send_one(&default, big).await, Outcome::Routed);
}

#[test]
fn flags_that_would_silently_weaken_the_deployment_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = dir.path().join("pool.yaml");
    std::fs::write(&pool, "endpoints: []\n").expect("write pool");
    let pool = pool.display().to_string();
    for (flags, reason) in [
        (&["--metrics-endpoint-auth"][..], "TokenReview"),
        (&["--metrics-cert-dir", "/certs"][..], "without TLS"),
        (
            &["--model-server-metrics-scheme=https"][..],
            "over http only",
        ),
        (
            &[
                "--total-queued-requests-metric",
                "vllm:num_requests_waiting",
            ][..],
            "refused by llm-d too",
        ),
        (&["--zap-log-level", "loud"][..], "zap-log-level"),
        (&["--refresh-metrics-interval", "10"][..], "needs a unit"),
    ] {
        let mut args = vec!["--endpoints-file", pool.as_str()];
        args.extend_from_slice(flags);
        let stderr = serve_refused(&args, &[]);
        assert!(stderr.contains(reason), "{flags:?}: {stderr}");
    }
}
