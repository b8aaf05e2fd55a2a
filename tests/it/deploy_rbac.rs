//! The chart's RBAC against what kvpick really does: kvpick runs with the exact arguments the
//! rendered Deployment gives it (ports aside) against the fake API server, which records the
//! (verb, group, resource) of every request; the rendered Roles must allow each of them and
//! grant nothing else.

use crate::deploy_manifests::{render, values_file};
use crate::fake_kube::{FakeKube, pool_resource};
use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use support::kvpick::{Kvpick, health};
use support::wait_until;
use tonic_health::pb::health_check_response::ServingStatus;

const NS: &str = "llm";
const LIMIT: Duration = Duration::from_secs(20);

type Rule = (String, String, String);

/// Every (verb, group, resource) the rendered Roles grant.
fn granted(objects: &[Value]) -> BTreeSet<Rule> {
    let mut rules = BTreeSet::new();
    for role in objects.iter().filter(|o| o["kind"] == "Role") {
        for rule in role["rules"].as_array().expect("rules") {
            let strings = |key: &str| -> Vec<String> {
                rule[key]
                    .as_array()
                    .expect(key)
                    .iter()
                    .map(|v| v.as_str().expect("string").to_owned())
                    .collect()
            };
            for group in strings("apiGroups") {
                for resource in strings("resources") {
                    for verb in strings("verbs") {
                        rules.insert((verb.clone(), group.clone(), resource.clone()));
                    }
                }
            }
        }
    }
    rules
}

/// The rendered Deployment's kvpick arguments, less `serve` and the three ports (the test
/// gives free ones), with `--config-file /config/X` pointing at the rendered ConfigMap's X.
fn chart_args(objects: &[Value], dir: &std::path::Path) -> Vec<String> {
    let config = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "kvpick-epp")
        .expect("the plugins ConfigMap");
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("Deployment");
    let rendered: Vec<String> = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("arg").to_owned())
        .collect();
    let mut args = Vec::new();
    let mut rest = rendered.iter().skip(1);
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--grpc-port" | "--grpc-health-port" | "--metrics-port" => {
                rest.next();
            }
            "--config-file" => {
                let path = rest.next().expect("config path");
                let file = path.strip_prefix("/config/").expect("mounted at /config");
                let local = dir.join(file);
                let text = config["data"][file].as_str().expect("the ConfigMap has it");
                std::fs::write(&local, text).expect("write config");
                args.push(arg.clone());
                args.push(local.display().to_string());
            }
            _ => args.push(arg.clone()),
        }
    }
    args
}

fn pod() -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "vllm-0", "namespace": NS, "uid": "uid-vllm-0",
                     "labels": {"app": "vllm-llama3-8b", "llm-d.ai/inference-serving": "true"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.9",
                   "conditions": [{"type": "Ready", "status": "True"}]}})
}

fn pool() -> Value {
    json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "kvpick", "namespace": NS, "uid": "pool-uid"},
        "spec": {"selector": {"matchLabels": {"app": "vllm-llama3-8b"}},
                 "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "kvpick-epp", "port": {"number": 9002}}}})
}

/// What kvpick, started as the chart renders it for `values`, requests from the API once it
/// is ready and watching; and what the chart grants.
async fn requested_and_granted(values: &str) -> (BTreeSet<Rule>, BTreeSet<Rule>) {
    let objects = render(&[&values_file(values)]);
    let dir = tempfile::tempdir().expect("tempdir");
    let args = chart_args(&objects, dir.path());
    let fake = FakeKube::start().await;
    fake.apply("pods", pod());
    fake.apply(&pool_resource("inference.networking.k8s.io"), pool());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let kvpick = Kvpick::start_kube(&fake.kubeconfig(NS), &refs, &[]).await;
    wait_until("kvpick ready", LIMIT, || async {
        health(kvpick.health_port, "readiness").await == Some(ServingStatus::Serving)
    })
    .await;
    wait_until("the pods watched", LIMIT, || async {
        fake.watches("pods") > 0
    })
    .await;
    // Some granted verbs come later than readiness: a leader renews its Lease (`update`) one
    // retry period (2s) after taking it. Wait for what the Role grants to be used, up to the
    // limit (a verb never used still fails `assert_all_used` below, after the wait).
    let granted = granted(&objects);
    let deadline = std::time::Instant::now() + LIMIT;
    while std::time::Instant::now() < deadline && !granted.is_subset(&fake.requests()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // NOTE: watches of other resources open concurrently; a moment more lets every one of
    // them reach the API (a request later than this is missed, never invented).
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(kvpick);
    (fake.requests(), granted)
}

fn assert_allowed(requested: &BTreeSet<Rule>, granted: &BTreeSet<Rule>, values: &str) {
    let denied: Vec<&Rule> = requested.difference(granted).collect();
    assert!(
        denied.is_empty(),
        "{values}: kvpick makes requests its Role does not allow: {denied:?} (granted {granted:?})"
    );
}

fn assert_all_used(requested: &BTreeSet<Rule>, granted: &BTreeSet<Rule>, values: &str) {
    let unused: Vec<&Rule> = granted.difference(requested).collect();
    assert!(
        unused.is_empty(),
        "{values}: the Role grants what kvpick never uses: {unused:?} (requested {requested:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_modes_role_allows_every_request_kvpick_makes() {
    let (requested, granted) = requested_and_granted("default").await;
    assert!(
        requested.contains(&("watch".into(), "".into(), "pods".into())),
        "{requested:?}"
    );
    assert_allowed(&requested, &granted, "default");
}

/// Fails until kvpick watches InferenceObjective and InferenceModelRewrite (both groups):
/// the Role grants those reads for that feature (issue #15's helper adds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_modes_role_grants_nothing_kvpick_does_not_use() {
    let (requested, granted) = requested_and_granted("default").await;
    assert_all_used(&requested, &granted, "default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standalone_role_is_exactly_what_kvpick_uses() {
    let (requested, granted) = requested_and_granted("standalone").await;
    assert_allowed(&requested, &granted, "standalone");
    assert_all_used(&requested, &granted, "standalone");
}

/// Fails until kvpick has `--ha-enable-leader-election` (a coordination.k8s.io Lease:
/// get, create, update; issue #15's helper adds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_election_role_is_exactly_what_kvpick_uses() {
    let (requested, granted) = requested_and_granted("leader-election").await;
    assert!(
        granted.contains(&(
            "update".into(),
            "coordination.k8s.io".into(),
            "leases".into()
        )),
        "{granted:?}"
    );
    assert_allowed(&requested, &granted, "leader-election");
    assert_all_used(&requested, &granted, "leader-election");
}
