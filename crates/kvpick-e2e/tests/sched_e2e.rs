//! Scheduling end to end: kvpick-sim pods (real HTTP, real ZMQ KV events), the real kvpick
//! binary with the shipped recommended profile (deploy/config/kvpick-recommended.yaml), and
//! a real Envoy. What a client sees is what is asserted: prefix-cache hits reported by the
//! pods, statuses, and kvpick's per-endpoint counters.

#[path = "../../../tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvpick_sim::engine::EngineConfig;
use kvpick_sim::events::EventLayout;
use kvpick_sim::fleet::{FleetConfig, FleetPod, PodOverride, start_fleet};
use kvpick_sim::tokenizer::SimTokenizer;
use serde_json::{Value, json};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::{post_json, send};
use support::kvpick::Kvpick;

const MODEL: &str = "sim-model";

fn repo(path: &str) -> String {
    support::repo_root()
        .join(path)
        .to_string_lossy()
        .into_owned()
}

async fn fleet(
    pods: usize,
    time_scale: f64,
    overrides: Vec<(usize, PodOverride)>,
) -> Vec<FleetPod> {
    let tokenizer =
        SimTokenizer::load(&PathBuf::from(repo("assets/tokenizer"))).expect("tokenizer");
    start_fleet(
        FleetConfig {
            pods,
            host: [127, 0, 0, 1].into(),
            base_port: 0,
            events_base_port: Some(0),
            replay_base_port: Some(0),
            model: MODEL.into(),
            engine: EngineConfig {
                block_size: 16,
                num_gpu_blocks: 4096,
                max_num_seqs: 8,
                ..EngineConfig::default()
            },
            time_scale,
            buffer_steps: 10_000,
            layout: EventLayout::Map,
            overrides,
            request_log: None,
        },
        Arc::new(tokenizer),
    )
    .await
    .expect("fleet")
}

/// The same override for each of `pods` pods.
fn on_every_pod(pods: usize, each: PodOverride) -> Vec<(usize, PodOverride)> {
    (0..pods).map(|i| (i, each.clone())).collect()
}

fn pool_yaml(pods: &[FleetPod]) -> String {
    let mut yaml = String::from("endpoints:\n");
    for pod in pods {
        yaml.push_str(&format!("  - address: {}\n", pod.http));
        if let Some(publisher) = &pod.pod.publisher {
            yaml.push_str(&format!("    kvEvents: {}\n", publisher.endpoint));
            if let Some(replay) = &publisher.replay_endpoint {
                yaml.push_str(&format!("    kvReplay: {replay}\n"));
            }
        }
    }
    yaml
}

async fn kvpick(pods: &[FleetPod], extra: &[&str]) -> Kvpick {
    kvpick_with(pods, &repo("deploy/config/kvpick-recommended.yaml"), extra).await
}

/// kvpick with the EndpointPickerConfig at `config`.
async fn kvpick_with(pods: &[FleetPod], config: &str, extra: &[&str]) -> Kvpick {
    let tokenizer = repo("assets/tokenizer");
    let mut args = vec![
        "--config-file",
        config,
        "--tokenizer",
        tokenizer.as_str(),
        "--scrape-timeout",
        "150ms",
    ];
    args.extend_from_slice(extra);
    Kvpick::start(&pool_yaml(pods), &args).await
}

/// A shared system prompt of several hundred tokens.
fn system_prompt() -> String {
    (0..60)
        .map(|i| format!("Rule {i}: answer billing questions about invoice {i} politely. "))
        .collect()
}

fn completion(prompt: &str, max_tokens: u32) -> Vec<u8> {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
        .to_string()
        .into_bytes()
}

fn cached_tokens(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// Waits until kvpick's index shows some pod holding `blocks` leading blocks of `body`.
async fn wait_for_index(kvpick: &Kvpick, body: &[u8], blocks: u64) -> String {
    let url = kvpick.debug_url("/debug/prefix?path=/v1/completions");
    for _ in 0..200 {
        let view = send("POST", &url, &[], body.to_vec())
            .await
            .expect("debug prefix")
            .json();
        if let Some(pod) = view["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["matched_blocks"].as_u64().unwrap_or(0) >= blocks)
        {
            return pod["address"].as_str().expect("address").to_owned();
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("kvpick's index never learned the prefix");
}

async fn pod_view(kvpick: &Kvpick, address: &str) -> Value {
    let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .expect("debug pods")
        .json();
    pods["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["address"] == address)
        .cloned()
        .unwrap_or(Value::Null)
}

/// kvpick's `kvpick_prompt_tokens_total` for one endpoint (0 before its first response).
async fn prompt_tokens_served(kvpick: &Kvpick, address: &str) -> u64 {
    served_in(&metrics_text(kvpick).await, address)
}

async fn metrics_text(kvpick: &Kvpick) -> String {
    send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text()
}

/// `kvpick_prompt_tokens_total` of `address` in a `/metrics` text (0 before any).
fn served_in(metrics: &str, address: &str) -> u64 {
    let series = format!("kvpick_prompt_tokens_total{{endpoint=\"{address}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_requests_land_on_the_pod_that_holds_the_prefix() {
    let pods = fleet(3, 0.05, Vec::new()).await;
    let kvpick = kvpick(&pods, &[]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let system = system_prompt();
    let url = envoy.url("/v1/completions");

    let first = post_json(&url, &completion(&format!("{system}Question 0?"), 4)).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let prompt_tokens = first.json()["usage"]["prompt_tokens"]
        .as_u64()
        .expect("usage");
    assert!(
        prompt_tokens > 400,
        "a long shared prefix ({prompt_tokens} tokens)"
    );
    let probe = completion(&format!("{system}Question 1?"), 4);
    let holder = wait_for_index(&kvpick, &probe, prompt_tokens / 16 - 2).await;

    let mut sent = prompt_tokens;
    for i in 1..=6 {
        let reply = post_json(&url, &completion(&format!("{system}Question {i}?"), 4)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        sent += reply.json()["usage"]["prompt_tokens"]
            .as_u64()
            .expect("usage");
        let cached = cached_tokens(&reply.json());
        assert!(
            cached + 32 >= prompt_tokens,
            "request {i}: {cached} of {prompt_tokens} prompt tokens cached: not routed to the holder {holder}"
        );
    }
    // Usage reaches kvpick on the observing stream, which the gateway does not wait for:
    // once all seven answers' prompt tokens are counted, the per-pod counts are final.
    wait_served(&kvpick, &pods, sent).await;
    let others: u64 = tokens_served_by(&kvpick, &pods, Some(&holder)).await;
    assert_eq!(others, 0, "no shared-prefix request went to another pod");
    let metrics = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    for plugin in [
        "extension_point=\"Filter\",plugin_name=\"fresh-metrics-filter\",plugin_type=\"fresh-metrics-filter\"",
        "extension_point=\"Scorer\",plugin_name=\"kv-placement-scorer\",plugin_type=\"kv-placement-scorer\"",
        "extension_point=\"DataProducer\",plugin_name=\"prefix-cache-match\",plugin_type=\"prefix-cache-match\"",
        "extension_point=\"Picker\",plugin_name=\"max-score-picker\",plugin_type=\"max-score-picker\"",
    ] {
        assert!(
            metrics.contains(&format!(
                "inference_extension_plugin_duration_seconds_count{{{plugin}}} 7"
            )),
            "seven picks timed for {plugin}"
        );
    }
}

/// Waits until kvpick has counted at least `tokens` prompt tokens served by all of `pods`
/// together (usage arrives on the observing ext_proc stream, shortly after the client has
/// its answer).
async fn wait_served(kvpick: &Kvpick, pods: &[FleetPod], tokens: u64) {
    support::wait_until(
        "the responses' usage to reach kvpick",
        Duration::from_secs(10),
        || async move { tokens_served_by(kvpick, pods, None).await >= tokens },
    )
    .await;
}

/// Prompt tokens kvpick counted as served by `pods`, `except` one of them (one `/metrics`
/// read).
async fn tokens_served_by(kvpick: &Kvpick, pods: &[FleetPod], except: Option<&str>) -> u64 {
    let metrics = metrics_text(kvpick).await;
    pods.iter()
        .map(|pod| pod.http.to_string())
        .filter(|address| Some(address.as_str()) != except)
        .map(|address| served_in(&metrics, &address))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_owner_whose_queue_outgrows_the_savings_loses_new_requests() {
    // One request at a time per pod, so a burst builds a visible queue.
    let one_at_a_time = on_every_pod(
        3,
        PodOverride {
            max_num_seqs: Some(1),
            ..PodOverride::default()
        },
    );
    let pods = fleet(3, 0.2, one_at_a_time).await;
    let kvpick = kvpick(&pods, &[]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let system = system_prompt();
    let url = envoy.url("/v1/completions");

    let first = post_json(&url, &completion(&format!("{system}Question 0?"), 4)).await;
    assert_eq!(first.status, 200);
    let prompt_tokens = first.json()["usage"]["prompt_tokens"]
        .as_u64()
        .expect("usage");
    let probe = completion(&format!("{system}Question 1?"), 4);
    let holder = wait_for_index(&kvpick, &probe, prompt_tokens / 16 - 2).await;
    let holder_pod = pods
        .iter()
        .find(|p| p.http.to_string() == holder)
        .expect("holder is a pod");

    // Load the owner directly (not through kvpick): only its scraped queue shows it.
    let direct = format!("http://{}/v1/completions", holder_pod.http);
    let mut load = Vec::new();
    for i in 0..6 {
        let (direct, body) = (
            direct.clone(),
            completion(&format!("unrelated load {i}"), 300),
        );
        load.push(tokio::spawn(async move { post_json(&direct, &body).await }));
    }
    support::wait_until(
        "the owner's queue to show in kvpick",
        Duration::from_secs(10),
        || {
            let (kvpick, holder) = (&kvpick, holder.clone());
            async move {
                pod_view(kvpick, &holder).await["metrics"]["waiting"]
                    .as_f64()
                    .unwrap_or(0.0)
                    >= 3.0
            }
        },
    )
    .await;

    let reply = post_json(&url, &completion(&format!("{system}Question 2?"), 4)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        cached_tokens(&reply.json()),
        0,
        "with the owner's queue costing more than the prefill it saves, the request went to an idle pod"
    );
    // The usage of the request served elsewhere arrives on the observing stream, shortly
    // after the client has its answer.
    support::wait_until(
        "the request served elsewhere to be counted",
        Duration::from_secs(10),
        || {
            let (kvpick, pods, holder) = (&kvpick, &pods, holder.as_str());
            async move { tokens_served_by(kvpick, pods, Some(holder)).await > 0 }
        },
    )
    .await;
    for handle in load {
        assert_eq!(handle.await.expect("join").status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_get_429_under_saturation_while_critical_ones_queue_and_complete() {
    let pods = fleet(
        1,
        1.0,
        vec![(
            0,
            PodOverride {
                max_num_seqs: Some(1),
                ..PodOverride::default()
            },
        )],
    )
    .await;
    let kvpick = kvpick(
        &pods,
        &["--objective", "critical=10", "--objective", "batch=-1"],
    )
    .await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    let address = pods[0].http.to_string();

    let mut critical = Vec::new();
    for i in 0..10 {
        let (url, body) = (
            url.clone(),
            completion(&format!("critical work item {i}"), 48),
        );
        critical.push(tokio::spawn(async move {
            send(
                "POST",
                &url,
                &[
                    ("content-type", "application/json"),
                    ("x-gateway-inference-objective", "critical"),
                ],
                body,
            )
            .await
            .expect("critical request")
        }));
    }
    // Saturated: the pod's queue reached the detector's threshold (5 waiting).
    support::wait_until("the pool to saturate", Duration::from_secs(15), || {
        let (kvpick, address) = (&kvpick, address.clone());
        async move {
            pod_view(kvpick, &address).await["metrics"]["waiting"]
                .as_f64()
                .unwrap_or(0.0)
                >= 5.0
        }
    })
    .await;
    let shed = send(
        "POST",
        &url,
        &[
            ("content-type", "application/json"),
            ("x-gateway-inference-objective", "batch"),
        ],
        completion("batch work", 4),
    )
    .await
    .expect("sheddable request");
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert!(shed.text().contains("sheddable"), "{}", shed.text());

    for handle in critical {
        let reply = handle.await.expect("join");
        assert_eq!(
            reply.status,
            200,
            "critical requests complete: {}",
            reply.text()
        );
    }
    let metrics = send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    assert!(
        metrics.contains(
            "inference_objective_request_error_total{error_code=\"InferencePoolResourceExhausted\""
        ),
        "the 429 is counted: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_metrics_hang_gets_no_traffic_until_it_recovers() {
    let pods = fleet(2, 0.05, Vec::new()).await;
    let kvpick = kvpick(&pods, &[]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    let (healthy, hung) = (pods[0].http.to_string(), pods[1].http.to_string());
    let faults = format!("http://{hung}/admin/faults");

    let stall = send("POST", &faults, &[], br#"{"metrics":"stall"}"#.to_vec())
        .await
        .expect("fault");
    assert_eq!(stall.status, 200);
    support::wait_until(
        "kvpick to see the hung scrape",
        Duration::from_secs(10),
        || {
            let (kvpick, hung) = (&kvpick, hung.clone());
            async move { pod_view(kvpick, &hung).await["ready"] == false }
        },
    )
    .await;
    let mut sent = 0;
    for i in 0..12 {
        let reply = post_json(
            &url,
            &completion(&format!("independent prompt number {i}"), 2),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        sent += reply.json()["usage"]["prompt_tokens"]
            .as_u64()
            .expect("usage");
    }
    // Once all twelve answers' prompt tokens are counted, the per-pod counts are final.
    wait_served(&kvpick, &pods, sent).await;
    assert!(prompt_tokens_served(&kvpick, &healthy).await >= sent);
    assert_eq!(
        prompt_tokens_served(&kvpick, &hung).await,
        0,
        "the hung pod got no traffic"
    );

    let ok = send("POST", &faults, &[], br#"{"metrics":"ok"}"#.to_vec())
        .await
        .expect("fault");
    assert_eq!(ok.status, 200);
    support::wait_until("the pod to come back", Duration::from_secs(10), || {
        let (kvpick, hung) = (&kvpick, hung.clone());
        async move { pod_view(kvpick, &hung).await["ready"] == true }
    })
    .await;
    for i in 0..40 {
        let reply = post_json(&url, &completion(&format!("after recovery {i}"), 2)).await;
        assert_eq!(reply.status, 200);
        if prompt_tokens_served(&kvpick, &hung).await > 0 {
            return;
        }
    }
    panic!("the recovered pod never got traffic again");
}

/// A metric's value in a Prometheus text scrape (0 when absent).
fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_placement_model_calibrates_itself_from_first_bytes() {
    // Pods 8× slower than the simulator's default step costs (50 ms a step + 0.4 ms per
    // prompt token) and short prompts: the prior (0.1 ms per token, no base) under-predicts
    // them several times (observed / predicted ≈ 9.5 with the fit disabled).
    let pods = fleet(2, 8.0, Vec::new()).await;
    let kvpick = kvpick(&pods, &[]).await;
    predictions_converge_after_first_bytes(&kvpick).await;
}

/// A profile scored by the cost scorer alone (no placement scorer).
const COST_SCORED: &str = "apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: ttft-cost-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: ttft-cost-scorer
  - pluginRef: max-score-picker
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cost_scorer_calibrates_itself_from_first_bytes() {
    // The same slow pods under `ttft-cost-scorer` alone: its coefficients (0.1 ms per token,
    // nothing per step) are the prior the fitted lines replace.
    let dir = std::env::temp_dir().join(format!("kvpick-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("cost.yaml");
    std::fs::write(&config, COST_SCORED).expect("write the config");
    let pods = fleet(2, 8.0, Vec::new()).await;
    let kvpick = kvpick_with(&pods, config.to_str().expect("utf-8 path"), &[]).await;
    predictions_converge_after_first_bytes(&kvpick).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends 24 streamed requests one at a time (the fit's first bytes), then 24 more, and checks
/// that each of the later ones was predicted, within a quarter of what happened on average.
async fn predictions_converge_after_first_bytes(kvpick: &Kvpick) {
    let envoy = Envoy::start(kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    let streamed = |i: usize| {
        // Unique prompts of ~15 to ~300 tokens, one at a time: no cache, no queue, so the
        // time to first byte is a step plus the prefill of the prompt's own tokens.
        let words: String = (0..(3 + (i * 7) % 60))
            .map(|w| format!("w{i}x{w} "))
            .collect();
        json!({"model": MODEL, "prompt": words, "max_tokens": 3, "stream": true})
            .to_string()
            .into_bytes()
    };
    let scrape = || async {
        send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
            .await
            .expect("metrics")
            .text()
    };
    for i in 0..24 {
        let reply = post_json(&url, &streamed(i)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let warm = scrape().await;
    assert_eq!(
        metric_value(&warm, "kvpick_ttft_observed_seconds_count"),
        24.0,
        "every streamed first byte was timed"
    );
    // Each pick was counted from its decision, and its observing stream (the second filter,
    // through Envoy's forwarded metadata) took that count over: its first byte is timed from
    // the pick.
    assert_eq!(
        metric_value(
            &warm,
            "kvpick_extproc_pick_reservations_total{result=\"taken\"}"
        ),
        24.0,
        "{warm}"
    );
    for i in 24..48 {
        let reply = post_json(&url, &streamed(i)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let after = scrape().await;
    let delta = |series: &str| metric_value(&after, series) - metric_value(&warm, series);
    let count = delta("kvpick_ttft_prediction_ratio_count");
    assert_eq!(count, 24.0, "each later request was predicted: {after}");
    let mean_ratio = delta("kvpick_ttft_prediction_ratio_sum") / count;
    // Once calibrated the predictions are within a quarter of what happens.
    assert!(
        (0.75..1.33).contains(&mean_ratio),
        "observed / predicted = {mean_ratio:.2} after calibration"
    );
}

/// A prompt of ~28 blocks (450 tokens) of its own, `tag` making it unique from its first block.
fn long_prompt(tag: &str) -> String {
    (0..30)
        .map(|i| format!("{tag} rule {i}: keep invoice {i} for client {tag}. "))
        .collect()
}

/// Waits until no pod is known to hold even one block of `body`'s prompt.
async fn wait_held_nowhere(kvpick: &Kvpick, body: &[u8]) {
    let url = kvpick.debug_url("/debug/prefix?path=/v1/completions");
    support::wait_until(
        "the evicted prefix to be held nowhere",
        Duration::from_secs(10),
        || {
            let (url, body) = (url.clone(), body.to_vec());
            async move {
                let view = send("POST", &url, &[], body)
                    .await
                    .expect("debug prefix")
                    .json();
                view["pods"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .all(|p| p["matched_blocks"].as_u64().unwrap_or(0) == 0)
            }
        },
    )
    .await;
}

/// Sends `body` through Envoy and returns the pod that served it (whose prompt-token count
/// kvpick saw grow).
async fn served_by(kvpick: &Kvpick, pods: &[FleetPod], url: &str, body: &[u8]) -> String {
    let addresses: Vec<String> = pods.iter().map(|pod| pod.http.to_string()).collect();
    let metrics = metrics_text(kvpick).await;
    let before: Vec<u64> = addresses.iter().map(|a| served_in(&metrics, a)).collect();
    let reply = post_json(url, body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    for _ in 0..400 {
        let metrics = metrics_text(kvpick).await;
        for (address, before) in addresses.iter().zip(&before) {
            if served_in(&metrics, address) > *before {
                return address.clone();
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("kvpick never counted the answer");
}

/// Prefix homes through the real binary: four prefixes routed over two pods, all evicted
/// from every pod by traffic that bypassed kvpick (both caches full of other text, so neither
/// pod has free blocks to offer), each goes back to the pod it was on. Without homes a
/// returning prefix is placed as a new one: with `homeBias: 1` this test failed 10 runs of
/// 10, and with the shipped profile it passed 18 of 18 (6 of them with both cores busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_prefixes_go_back_to_the_pods_they_were_routed_to() {
    // 40 usable blocks of 16 tokens per pod (plus vLLM's null block): one 28-block prefix,
    // or two 23-block fillers, but not a prefix and a filler.
    let small = on_every_pod(
        2,
        PodOverride {
            num_gpu_blocks: Some(41),
            ..PodOverride::default()
        },
    );
    let pods = fleet(2, 0.05, small).await;
    let kvpick = kvpick(&pods, &[]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    let prefixes: Vec<Vec<u8>> = ["alpha", "bravo", "charlie", "delta"]
        .iter()
        .map(|tag| completion(&long_prompt(tag), 2))
        .collect();

    // The first prefix goes to some pod; the second to the other, where it evicts nothing;
    // the others wherever (each evicts one of those).
    let mut homes = Vec::new();
    for body in &prefixes {
        let reply = post_json(&url, body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let tokens = reply.json()["usage"]["prompt_tokens"]
            .as_u64()
            .expect("usage");
        assert!(tokens > 26 * 16, "{tokens} prompt tokens");
        homes.push(wait_for_index(&kvpick, body, tokens / 16 - 1).await);
    }
    assert_ne!(
        homes[0], homes[1],
        "the second prefix went to the pod with free blocks"
    );

    // Every pod's cache filled with other text, sent to the pods directly: both prefixes
    // evicted everywhere, and the pods alike again.
    for (p, pod) in pods.iter().enumerate() {
        let direct = format!("http://{}/v1/completions", pod.http);
        for f in 0..2 {
            let filler: String = (0..24)
                .map(|i| format!("filler {p}-{f} line {i}: nothing routed here. "))
                .collect();
            let reply = post_json(&direct, &completion(&filler, 2)).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
    }
    for body in &prefixes {
        wait_held_nowhere(&kvpick, body).await;
    }
    // And kvpick's scrapes show them idle again (a scrape taken while a filler waited would
    // charge its pod a queue that is gone).
    for pod in &pods {
        let address = pod.http.to_string();
        support::wait_until("a scrape of the idle pod", Duration::from_secs(10), || {
            let (kvpick, address) = (&kvpick, address.clone());
            async move {
                let metrics = &pod_view(kvpick, &address).await["metrics"];
                metrics["waiting"].as_f64() == Some(0.0) && metrics["running"].as_f64() == Some(0.0)
            }
        })
        .await;
    }

    for (body, home) in prefixes.iter().zip(&homes) {
        let server = served_by(&kvpick, &pods, &url, body).await;
        assert_eq!(&server, home, "the evicted prefix went back to its pod");
    }
}
