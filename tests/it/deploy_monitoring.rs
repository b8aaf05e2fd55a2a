//! deploy/monitoring against a live kvpick: the Grafana dashboard parses, and every metric it
//! and the alert rules query is on the `/metrics` of real kvpick processes (one routing real
//! requests through Envoy to a kvpick-sim pod whose KV events have gaps, beside a dead pod;
//! one discovering its pool through the fake Kubernetes API); and each GIE family kvpick
//! exports is there under llm-d's `llm_d_epp_*` name too, with the same series.

use crate::deploy_manifests::documents;
use crate::fake_kube::{FakeKube, pool_resource};
use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::send;
use support::kvpick::Kvpick;
use support::sim_pod::SimPod;

const LIMIT: Duration = Duration::from_secs(30);

/// The metric names a PromQL expression (or Grafana query) reads: kvpick's, GIE's and
/// llm-d's (`kvpick_*`, `inference_*`, `llm_d_*`).
fn queried(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|word| {
            ["kvpick_", "inference_", "llm_d_"]
                .iter()
                .any(|p| word.starts_with(p))
        })
        .map(str::to_owned)
        .collect()
}

/// Every query of the dashboard: panel targets and template variables.
fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if let Some(query) = variable["query"]["query"].as_str() {
            queries.push(query.to_owned());
        }
    }
    queries
}

fn alert_queries() -> Vec<String> {
    let text = std::fs::read_to_string(support::repo_root().join("deploy/monitoring/alerts.yaml"))
        .expect("alerts.yaml");
    let rules = &documents(&text)[0];
    rules["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .map(|r| r["expr"].as_str().expect("expr").to_owned())
        .collect()
}

/// The series names on a `/metrics` page (`_bucket`, `_sum`, `_count` of histograms included).
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

async fn scrape(kvpick: &Kvpick) -> String {
    send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .map(|r| r.text())
        .unwrap_or_default()
}

/// A kvpick that found its pool through the (fake) Kubernetes API: the discovery metrics.
async fn discovering_kvpick(fake: &FakeKube) -> Kvpick {
    fake.apply(
        "pods",
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "vllm-0", "namespace": "llm", "uid": "u0", "labels": {"app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.9",
                       "conditions": [{"type": "Ready", "status": "True"}]}}),
    );
    fake.apply(
        &pool_resource("inference.networking.k8s.io"),
        json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": "llm", "uid": "p"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "kvpick-epp", "port": {"number": 9002}}}}),
    );
    Kvpick::start_kube(
        &fake.kubeconfig("llm"),
        &["--pool-name", "pool", "--pool-namespace", "llm"],
        &[],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_alerts_query_is_exported_by_a_live_kvpick() {
    let text = std::fs::read_to_string(
        support::repo_root().join("deploy/monitoring/grafana-dashboard.json"),
    )
    .expect("dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "kvpick");
    let mut wanted = BTreeSet::new();
    for query in dashboard_queries(&dashboard).iter().chain(&alert_queries()) {
        let names = queried(query);
        assert!(!names.is_empty(), "`{query}` reads no kvpick metric");
        wanted.extend(names);
    }

    // A live pod whose PUB drops half its KV-event batches (they stay replayable), and a
    // dead one (refused scrape and events).
    let sim = SimPod::start(&["--pod-override", "0:drop=0.5"]).await;
    let dead = support::free_port();
    let pool = format!(
        "endpoints:\n{}  - address: 127.0.0.1:{dead}\n    kvEvents: tcp://127.0.0.1:{dead}\n",
        sim.pool_entry()
    );
    let tokenizer = support::repo_root().join("assets/tokenizer");
    // GIE's default profile with flow control on, so the dashboard's flow-control panels
    // have series (a labelled family has none until a request passed through it).
    let default_with_flow_control = format!(
        "{}featureGates:\n- flowControl\n",
        kvpick::config::picker_config::GIE_DEFAULT_YAML
    );
    let routing = Kvpick::start(
        &pool,
        &[
            "--tokenizer",
            tokenizer.to_str().expect("path"),
            "--config-text",
            &default_with_flow_control,
        ],
    )
    .await;
    let envoy = Envoy::start(&routing, EnvoyOptions::default()).await;
    let system = "You are a helpful assistant who answers in one short sentence. ".repeat(20);
    for i in 0..12 {
        let body = json!({"model": "sim-model", "max_tokens": 8, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("Question number {i}?")}]});
        let reply = send(
            "POST",
            &envoy.url("/v1/chat/completions"),
            &[("content-type", "application/json")],
            body.to_string().into_bytes(),
        )
        .await
        .expect("request");
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let bad = send(
        "POST",
        &envoy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        b"{not json".to_vec(),
    )
    .await
    .expect("bad request");
    assert_eq!(bad.status, 400);

    let fake = FakeKube::start().await;
    let discovering = discovering_kvpick(&fake).await;

    // Counters appear with their first event (gaps, replays, down): poll, bounded.
    let deadline = Instant::now() + LIMIT;
    let (missing, routing_text) = loop {
        let routing_text = scrape(&routing).await;
        let mut have = exported(&routing_text);
        have.extend(exported(&scrape(&discovering).await));
        let missing: Vec<String> = wanted.difference(&have).cloned().collect();
        if missing.is_empty() || Instant::now() > deadline {
            break (missing, routing_text);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        missing.is_empty(),
        "queried by deploy/monitoring but not exported: {missing:?}"
    );

    // llm-d's names: the same series as GIE's, line for line; where GIE's name lacks
    // labels llm-d's has (the tenant, the priority), GIE's line is the sum of llm-d's.
    let lines: BTreeSet<&str> = routing_text.lines().collect();
    let mut mirrored = 0;
    for (gie, llmd) in kvpick::telemetry::llmd::ALIASES {
        let folded = kvpick::telemetry::llmd::GIE_FOLDED
            .iter()
            .find(|(name, _)| name == gie)
            .map(|(_, labels)| *labels);
        let ours = |name: &str, line: &str| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ', '_']))
        };
        if let Some(labels) = folded {
            let summed = |name: &str| sum_series(&routing_text, name, labels);
            let (gie_series, llmd_series) = (summed(gie), summed(llmd));
            assert!(!gie_series.is_empty(), "no `{gie}` series");
            assert_eq!(
                gie_series, llmd_series,
                "`{gie}` is not `{llmd}` summed over {labels:?}"
            );
            mirrored += gie_series.len();
            continue;
        }
        for line in routing_text.lines().filter(|l| ours(gie, l)) {
            let twin = format!("{llmd}{}", &line[gie.len()..]);
            assert!(lines.contains(twin.as_str()), "no `{twin}` beside `{line}`");
            mirrored += 1;
        }
    }
    assert!(
        routing_text.contains(
            "llm_d_epp_request_total{fairness_id=\"default-flow\",model_name=\"sim-model\",priority=\"0\""
        ),
        "no llm-d request counter with the tenant and priority"
    );
    assert!(mirrored > 20, "only {mirrored} llm-d series");
}

/// The series of family `name` (its `_bucket`/`_sum`/`_count` lines included) with `drop`
/// labels removed, summed: (the line's name suffix and the labels left) → value.
fn sum_series(text: &str, name: &str, drop: &[&str]) -> std::collections::BTreeMap<String, f64> {
    let mut sums = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some((series, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        let (suffix, labels) = match series.split_once('{') {
            Some((suffix, labels)) => (suffix, labels.trim_end_matches('}')),
            None => (series, ""),
        };
        if !suffix.is_empty() && !["_bucket", "_sum", "_count"].contains(&suffix) {
            continue;
        }
        // Label values here (model names, tenants, numbers, `le`) hold no commas.
        let kept: Vec<&str> = labels
            .split(',')
            .filter(|pair| !pair.is_empty())
            .filter(|pair| !drop.iter().any(|d| pair.starts_with(&format!("{d}=\""))))
            .collect();
        let value: f64 = value.parse().expect("a sample value");
        *sums
            .entry(format!("{suffix}{{{}}}", kept.join(",")))
            .or_insert(0.0) += value;
    }
    sums
}
