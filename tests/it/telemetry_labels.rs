//! Label values taken from requests are bounded, through the real kvpick binary and a real
//! Envoy: huge and many distinct model names and fairness ids keep `/metrics` small, and the
//! llm-d request series carry each request's tenant and priority.

use crate::support;

use support::backend::Backend;
use support::envoy::{Envoy, EnvoyOptions};
use support::http::{post_json, send};
use support::kvpick::Kvpick;

fn body(model: &str) -> Vec<u8> {
    serde_json::json!({"model": model, "prompt": "hello"})
        .to_string()
        .into_bytes()
}

/// A request for `model` from tenant `tenant` under objective `critical`.
async fn post_as(url: &str, model: &str, tenant: &str) -> support::http::Reply {
    send(
        "POST",
        url,
        &[
            ("content-type", "application/json"),
            ("x-gateway-inference-fairness-id", tenant),
            ("x-gateway-inference-objective", "critical"),
        ],
        body(model),
    )
    .await
    .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_and_many_distinct_model_names_keep_metrics_small() {
    let backend = Backend::start("127.0.0.1").await;
    let pool = format!("endpoints:\n  - address: {}\n", backend.addr);
    let kvpick = Kvpick::start(&pool, &["--objective", "critical=7"]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");

    // Four 1 MB model names (before the bound each one was a 1 MB label value in every
    // series of six metrics), then more distinct names than the distinct-value bound.
    for i in 0..4u8 {
        let huge: String = std::iter::repeat_n(char::from(b'a' + i), 1 << 20).collect();
        let reply = post_json(&url, &body(&huge)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    // Each of them from its own tenant: fairness ids have a bound of their own.
    for i in 0..1100 {
        let reply = post_as(&url, &format!("model-{i}"), &format!("tenant-{i}")).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    assert_eq!(backend.seen().len(), 1104, "every request was routed");

    let metrics = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics");
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    eprintln!("/metrics: {} bytes", text.len());
    // 1,000 series of a counter and a 12-bucket histogram with short names, under GIE's
    // and llm-d's names (llm-d's with the tenant too), are ~4 MB; unbounded, this was
    // > 100 MB.
    assert!(text.len() < 6 << 20, "/metrics is {} bytes", text.len());
    let longest = text.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 1024, "a {longest}-byte line in /metrics");
    assert!(
        text.contains(
            "inference_objective_request_total{model_name=\"other\",priority=\"7\",target_model_name=\"other\"}"
        ),
        "names past the bound are counted as `other`"
    );
    assert!(
        text.contains("inference_objective_request_total{model_name=\"model-0\",priority=\"7\",target_model_name=\"model-0\"} 1"),
        "names within the bound keep their series, with the objective's priority"
    );
    assert!(
        text.contains("llm_d_epp_request_total{fairness_id=\"tenant-0\",model_name=\"model-0\",priority=\"7\",target_model_name=\"model-0\"} 1"),
        "llm-d's series name the tenant"
    );
    assert!(
        text.contains("llm_d_epp_request_total{fairness_id=\"default-flow\",model_name=\"a"),
        "a request without a tenant is llm-d's default flow"
    );
    assert!(
        text.contains("llm_d_epp_request_total{fairness_id=\"other\",model_name=\"other\",priority=\"7\",target_model_name=\"other\"}"),
        "tenants past the bound are counted as `other`"
    );
    assert!(
        !text.contains("inference_objective_request_total{fairness_id"),
        "GIE's names have no tenant label"
    );
    let cut = "a".repeat(256);
    assert!(
        text.contains(&format!("model_name=\"{cut}\"")),
        "a huge name is cut to 256 bytes"
    );
    let collapsed = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("kvpick_metric_label_values_bounded_total{action=\"collapsed\"} ")
        })
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(collapsed > 0.0, "collapses are counted");
}

/// llm-d's `--fairness-id-metric-label-limit`: past the limit, tenants are counted as `other`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fairness_id_label_limit_is_the_flags() {
    let backend = Backend::start("127.0.0.1").await;
    let pool = format!("endpoints:\n  - address: {}\n", backend.addr);
    let kvpick = Kvpick::start(
        &pool,
        &[
            "--objective",
            "critical=7",
            "--fairness-id-metric-label-limit=1",
        ],
    )
    .await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    for tenant in ["tenant-a", "tenant-b", "tenant-c"] {
        let reply = post_as(&url, "m", tenant).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let text = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    let series = |tenant: &str| {
        format!(
            "llm_d_epp_request_total{{fairness_id=\"{tenant}\",model_name=\"m\",priority=\"7\",target_model_name=\"m\"}}"
        )
    };
    assert!(
        text.contains(&format!("{} 1", series("tenant-a"))),
        "{text}"
    );
    assert!(text.contains(&format!("{} 2", series("other"))), "{text}");
    assert!(!text.contains("fairness_id=\"tenant-b\""), "{text}");
}
