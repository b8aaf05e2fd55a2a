//! Pool saturation through the real kvpick binary and a real Envoy, with model-server
//! stand-ins whose `/metrics` say how loaded they are: one overloaded pod must not make a
//! pool with idle pods shed (429) or queue (flow control) its traffic.

use crate::support;

use std::time::{Duration, Instant};

use support::backend::Backend;
use support::envoy::{Envoy, EnvoyOptions};
use support::http::send;
use support::kvpick::Kvpick;

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

/// What a vLLM with 100 requests waiting reports.
const OVERLOADED_METRICS: &str = "vllm:num_requests_waiting{model_name=\"m\"} 100.0\n\
    vllm:num_requests_running{model_name=\"m\"} 8.0\n\
    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n";

fn pool_yaml(backends: &[Backend]) -> String {
    let mut yaml = String::from("endpoints:\n");
    for b in backends {
        yaml.push_str(&format!("  - address: {}\n", b.addr));
    }
    yaml
}

/// Three backends, the first reporting 100 waiting requests, and kvpick once it has fresh
/// metrics of all three.
async fn one_overloaded_two_idle(extra: &[&str]) -> (Vec<Backend>, Kvpick) {
    let mut backends = Vec::new();
    for _ in 0..3 {
        backends.push(Backend::start("127.0.0.1").await);
    }
    backends[0].set_metrics(OVERLOADED_METRICS);
    let mut args = vec!["--objective", "batch=-1"];
    args.extend_from_slice(extra);
    let kvpick = Kvpick::start(&pool_yaml(&backends), &args).await;
    let url = kvpick.metrics_url("/metrics");
    support::wait_until("all three pods scraped", Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            let Ok(reply) = send("GET", &url, &[], Vec::new()).await else {
                return false;
            };
            let text = reply.text();
            text.contains("inference_pool_ready_pods{name=\"default\"} 3")
                && text.contains("inference_pool_average_queue_size{name=\"default\"} 33.3")
        }
    })
    .await;
    (backends, kvpick)
}

async fn sheddable(url: &str) -> support::http::Reply {
    send(
        "POST",
        url,
        &[
            ("content-type", "application/json"),
            ("x-gateway-inference-objective", "batch"),
        ],
        BODY.to_vec(),
    )
    .await
    .expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_are_routed_when_one_pod_is_overloaded_and_two_are_idle() {
    let (backends, kvpick) = one_overloaded_two_idle(&[]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    for i in 0..10 {
        let reply = sheddable(&url).await;
        assert_eq!(reply.status, 200, "request {i}: {}", reply.text());
    }
    let served: usize = backends.iter().map(|b| b.seen().len()).sum();
    assert_eq!(served, 10, "every sheddable request reached a backend");
}

/// A saturation filter, the cost scorer and flow control (kvpick's recommended profile
/// before the placement scorer).
const FLOW_CONTROLLED: &str = "apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: saturation-filter
- type: ttft-cost-scorer
- type: in-flight-requests-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: ttft-cost-scorer
    weight: 4
  - pluginRef: in-flight-requests-scorer
  - pluginRef: max-score-picker
featureGates:
- flowControl
";

/// Sends 5 normal then 5 sheddable requests through Envoy to kvpick started with `extra`
/// beside one overloaded and two idle pods: each must be served promptly, none by the
/// overloaded pod. Returns kvpick, still running.
async fn ten_requests_go_around_the_overloaded_pod(extra: &[&str]) -> Kvpick {
    let (backends, kvpick) = one_overloaded_two_idle(extra).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    for i in 0..10 {
        let started = Instant::now();
        // Normal-priority requests first (flow control's queue, when on), then sheddable ones.
        let reply = if i < 5 {
            support::http::post_json(&url, BODY).await
        } else {
            sheddable(&url).await
        };
        assert_eq!(reply.status, 200, "request {i}: {}", reply.text());
        // NOTE: a generous bound; before the fix each request waited out flow control's
        // 30 s queue timeout and got 503.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "request {i} waited {:?}",
            started.elapsed()
        );
    }
    assert!(
        backends[0].seen().is_empty(),
        "the overloaded pod got {} requests",
        backends[0].seen().len()
    );
    let served: usize = backends.iter().map(|b| b.seen().len()).sum();
    assert_eq!(served, 10);
    kvpick
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_control_serves_promptly_when_one_pod_is_overloaded_and_two_are_idle() {
    // The saturation filter removes the overloaded pod.
    let kvpick =
        ten_requests_go_around_the_overloaded_pod(&["--config-text", FLOW_CONTROLLED]).await;
    // Flow control's metrics carry GIE's and llm-d's labels: the tenant, the priority, the
    // pool, the models and (for the queue time) the outcome.
    let text = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    for name in [
        "inference_extension_flow_control_request_queue_duration_seconds_count",
        "llm_d_epp_flow_control_request_queue_duration_seconds_count",
    ] {
        for priority in ["0", "-1"] {
            let series = format!(
                "{name}{{fairness_id=\"default-flow\",inference_pool=\"default\",model_name=\"m\",outcome=\"Dispatched\",priority=\"{priority}\",target_model_name=\"m\"}} 5"
            );
            assert!(text.contains(&series), "no `{series}` in\n{text}");
        }
    }
    for name in [
        "inference_extension_flow_control_queue_size",
        "llm_d_epp_flow_control_queue_size",
    ] {
        let series = format!(
            "{name}{{fairness_id=\"default-flow\",inference_pool=\"default\",model_name=\"m\",priority=\"0\",target_model_name=\"m\"}} 0"
        );
        assert!(
            text.contains(&series),
            "no `{series}`: every request left the queue"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recommended_profile_places_around_an_overloaded_pod() {
    // 100 requests wait there that kvpick did not route: the placement scorer counts their
    // prefill as queued work.
    ten_requests_go_around_the_overloaded_pod(&["--recommended-profile"]).await;
}

/// What a vLLM with two requests running and none waiting reports.
const BUSY_METRICS: &str = "vllm:num_requests_waiting{model_name=\"m\"} 0.0\n\
    vllm:num_requests_running{model_name=\"m\"} 2.0\n\
    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheddable_request_no_pod_can_serve_within_its_slo_is_refused_and_others_are_served() {
    let backends = [
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    ];
    for b in &backends {
        b.set_metrics(BUSY_METRICS);
    }
    let kvpick = Kvpick::start(
        &pool_yaml(&backends),
        &["--recommended-profile", "--objective", "batch=-1"],
    )
    .await;
    let url = kvpick.metrics_url("/metrics");
    support::wait_until("both pods scraped", Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            send("GET", &url, &[], Vec::new()).await.is_ok_and(|r| {
                r.text()
                    .contains("inference_pool_ready_pods{name=\"default\"} 2")
            })
        }
    })
    .await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    // ~300 prompt tokens: a few tens of ms of predicted prefill at the prior's 0.1 ms/token.
    let body = serde_json::json!({"model": "m", "prompt": "many words ".repeat(150)})
        .to_string()
        .into_bytes();
    let post = |headers: Vec<(&'static str, &'static str)>| {
        let (url, body) = (url.clone(), body.clone());
        async move {
            let mut all = vec![("content-type", "application/json")];
            all.extend(headers);
            send("POST", &url, &all, body).await.expect("request")
        }
    };
    let refused = post(vec![
        ("x-gateway-inference-objective", "batch"),
        ("x-llm-d-slo-ttft-ms", "1"),
    ])
    .await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert!(refused.text().contains("latency SLO"), "{}", refused.text());
    // The same objective on a request that is not sheddable: served (by the least late pod).
    let served = post(vec![("x-llm-d-slo-ttft-ms", "1")]).await;
    assert_eq!(served.status, 200, "{}", served.text());
    // Sheddable, with an objective the pods are predicted to meet: served.
    let served = post(vec![
        ("x-gateway-inference-objective", "batch"),
        ("x-llm-d-slo-ttft-ms", "60000"),
        ("x-llm-d-slo-tpot-ms", "1000"),
    ])
    .await;
    assert_eq!(served.status, 200, "{}", served.text());
    // The deprecated alias is read too.
    let refused = post(vec![
        ("x-gateway-inference-objective", "batch"),
        ("x-slo-ttft-ms", "1"),
    ])
    .await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    let seen: usize = backends.iter().map(|b| b.seen().len()).sum();
    assert_eq!(seen, 2, "only the two admitted requests reached a pod");
}
