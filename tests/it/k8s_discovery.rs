//! Kubernetes discovery through the real `kvpick serve` binary and kube's real client,
//! against the fake API server of `tests/support/fake_kube.rs`: the endpoint set
//! (`/debug/pods`) and gRPC readiness after each step of a pool's life, hostile objects, and
//! the start-up errors of conflicting sources.

use crate::fake_kube;
use crate::support;

use std::time::{Duration, Instant};

use fake_kube::{FakeKube, pool_resource};
use serde_json::{Value, json};
use support::http::send;
use support::kvpick::{Kvpick, health, serve_refused};
use support::wait_until;
use tonic_health::pb::health_check_response::ServingStatus;

pub(crate) const NS: &str = "llm";
pub(crate) const V1: &str = "inference.networking.k8s.io";
const V1ALPHA2: &str = "inference.networking.x-k8s.io";
pub(crate) const LIMIT: Duration = Duration::from_secs(15);

pub(crate) fn pod(name: &str, ip: Option<&str>, app: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                     "labels": {"app": app, "llm-d.ai/role": "decode"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
    })
}

pub(crate) fn pool_v1(app: &str, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "apiVersion": format!("{V1}/v1"), "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": NS, "uid": "pool-uid"},
        "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": ports,
                 "endpointPickerRef": {"name": "kvpick", "port": {"number": 9002}}}
    })
}

/// The pool's endpoints as `/debug/pods` shows them, sorted.
pub(crate) async fn endpoints(kvpick: &Kvpick) -> Vec<String> {
    let Ok(reply) = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new()).await else {
        return vec!["(debug server unreachable)".to_owned()];
    };
    let mut addresses: Vec<String> = reply.json()["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .map(|p| p["address"].as_str().expect("address").to_owned())
        .collect();
    addresses.sort();
    addresses
}

pub(crate) async fn wait_endpoints(kvpick: &Kvpick, want: &[&str], step: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let now = endpoints(kvpick).await;
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{step}: endpoints {now:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

pub(crate) async fn readiness(kvpick: &Kvpick) -> Option<ServingStatus> {
    health(kvpick.health_port, "readiness").await
}

pub(crate) async fn wait_readiness(kvpick: &Kvpick, want: ServingStatus, step: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let now = readiness(kvpick).await;
        if now == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{step}: readiness {now:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test]
async fn a_pools_life_through_the_api() {
    let fake = FakeKube::start().await;
    let pools = pool_resource(V1);
    let kubeconfig = fake.kubeconfig(NS);
    let kvpick = Kvpick::start_kube(
        &kubeconfig,
        &["--pool-name", "pool", "--pool-namespace", NS],
        &["--discovery-stale-after", "2s"],
    )
    .await;

    // No pool yet: live, not ready.
    wait_until("the pool is listed", LIMIT, || async {
        fake.lists(&pools) > 0
    })
    .await;
    assert_eq!(readiness(&kvpick).await, Some(ServingStatus::NotServing));
    wait_until("not ready counted as pool_not_found", LIMIT, || async {
        kvpick
            .metric("kvpick_discovery_not_ready_total{reason=\"pool_not_found\"}")
            .await
            >= 1.0
    })
    .await;

    // Pool created with one ready pod.
    fake.apply("pods", pod("a", Some("127.0.0.2"), "vllm", true));
    fake.apply(&pools, pool_v1("vllm", &[8000]));
    wait_endpoints(&kvpick, &["127.0.0.2:8000"], "pool created").await;
    wait_readiness(&kvpick, ServingStatus::Serving, "pool created").await;
    let reply = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .expect("debug pods");
    assert_eq!(
        reply.json()["pods"][0]["labels"]["llm-d.ai/role"],
        "decode",
        "the pod's labels travel with the endpoint"
    );

    // Scale 1 → 3 (plus a pod of another app that must stay out).
    fake.apply("pods", pod("b", Some("127.0.0.3"), "vllm", true));
    fake.apply("pods", pod("c", Some("127.0.0.4"), "vllm", true));
    fake.apply("pods", pod("other", Some("127.0.0.9"), "web", true));
    let three = ["127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.4:8000"];
    wait_endpoints(&kvpick, &three, "scaled to 3").await;

    // b turns unready; c is deleted; a starts terminating.
    fake.apply("pods", pod("b", Some("127.0.0.3"), "vllm", false));
    wait_endpoints(&kvpick, &["127.0.0.2:8000", "127.0.0.4:8000"], "b unready").await;
    fake.delete("pods", NS, "c");
    wait_endpoints(&kvpick, &["127.0.0.2:8000"], "c deleted").await;
    let mut terminating = pod("a", Some("127.0.0.2"), "vllm", true);
    terminating["metadata"]["deletionTimestamp"] = json!("2026-12-01T12:00:00Z");
    fake.apply("pods", terminating);
    wait_endpoints(&kvpick, &[], "a terminating").await;
    assert_eq!(
        readiness(&kvpick).await,
        Some(ServingStatus::Serving),
        "an empty pool is still a synced pool"
    );

    // The selector changes: every pod is re-evaluated.
    fake.apply("pods", pod("d", Some("127.0.0.5"), "vllm2", true));
    fake.apply("pods", pod("b", Some("127.0.0.3"), "vllm", true));
    wait_endpoints(&kvpick, &["127.0.0.3:8000"], "b ready again").await;
    fake.apply(&pools, pool_v1("vllm2", &[8000]));
    wait_endpoints(&kvpick, &["127.0.0.5:8000"], "selector changed").await;
    // targetPorts edited: each pod × each port.
    fake.apply(&pools, pool_v1("vllm2", &[8000, 8001]));
    wait_endpoints(
        &kvpick,
        &["127.0.0.5:8000", "127.0.0.5:8001"],
        "ports changed",
    )
    .await;

    // A watch that just ends is resumed (no re-list) and sees later changes.
    let pod_lists = fake.lists("pods");
    fake.end_watches();
    fake.apply("pods", pod("e", Some("127.0.0.6"), "vllm2", true));
    wait_endpoints(
        &kvpick,
        &[
            "127.0.0.5:8000",
            "127.0.0.5:8001",
            "127.0.0.6:8000",
            "127.0.0.6:8001",
        ],
        "after a watch ended",
    )
    .await;
    assert_eq!(fake.lists("pods"), pod_lists, "resumed, not re-listed");
    assert!(fake.watches("pods") >= 2, "the pod watch was opened again");

    // The history is compacted while a pod vanishes unseen: the resumed watch gets 410 Gone,
    // and only the re-list that follows can show that e is gone.
    let relists = kvpick
        .metric("kvpick_discovery_relists_total{resource=\"pod\"}")
        .await;
    fake.delete_unseen("pods", NS, "e");
    fake.expire();
    wait_endpoints(
        &kvpick,
        &["127.0.0.5:8000", "127.0.0.5:8001"],
        "re-list after 410",
    )
    .await;
    assert!(fake.lists("pods") > pod_lists, "410 Gone led to a re-list");
    assert!(
        kvpick
            .metric("kvpick_discovery_relists_total{resource=\"pod\"}")
            .await
            > relists
    );
    assert_eq!(readiness(&kvpick).await, Some(ServingStatus::Serving));

    // The API goes down: the last pool stays, readiness holds for the stale period, then goes.
    let down = Instant::now();
    fake.stop().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        readiness(&kvpick).await,
        Some(ServingStatus::Serving),
        "within the stale period"
    );
    wait_readiness(
        &kvpick,
        ServingStatus::NotServing,
        "API down past the stale period",
    )
    .await;
    assert!(
        down.elapsed() >= Duration::from_millis(1900),
        "not before the stale period: {:?}",
        down.elapsed()
    );
    assert_eq!(
        endpoints(&kvpick).await,
        ["127.0.0.5:8000", "127.0.0.5:8001"],
        "the last pool keeps serving"
    );
    assert!(
        kvpick
            .metric("kvpick_discovery_not_ready_total{reason=\"stale\"}")
            .await
            >= 1.0
    );
    assert!(
        kvpick
            .metric("kvpick_discovery_watch_errors_total{resource=\"pod\"}")
            .await
            >= 1.0
    );

    // The API comes back: ready again, and changes flow again.
    fake.restart().await;
    wait_readiness(&kvpick, ServingStatus::Serving, "API back").await;

    // The API answers, but with 500s, right when the watches must re-list (410): the list
    // attempts (each begun with the watcher's Init) are no answer, so readiness goes.
    fake.set_failing(true);
    fake.expire();
    wait_readiness(&kvpick, ServingStatus::NotServing, "API failing with 500").await;
    assert_eq!(
        endpoints(&kvpick).await,
        ["127.0.0.5:8000", "127.0.0.5:8001"]
    );
    fake.set_failing(false);
    wait_readiness(&kvpick, ServingStatus::Serving, "API healthy again").await;
    fake.apply("pods", pod("d", Some("127.0.0.5"), "vllm2", false));
    wait_endpoints(&kvpick, &[], "d unready after the outage").await;

    // The pool object is deleted: NOT_SERVING, last endpoints kept.
    fake.apply("pods", pod("d", Some("127.0.0.5"), "vllm2", true));
    wait_endpoints(&kvpick, &["127.0.0.5:8000", "127.0.0.5:8001"], "d back").await;
    fake.delete(&pools, NS, "pool");
    wait_readiness(&kvpick, ServingStatus::NotServing, "pool deleted").await;
    assert_eq!(
        endpoints(&kvpick).await,
        ["127.0.0.5:8000", "127.0.0.5:8001"]
    );
    fake.apply(&pools, pool_v1("vllm2", &[8000]));
    wait_readiness(&kvpick, ServingStatus::Serving, "pool re-created").await;
    wait_endpoints(&kvpick, &["127.0.0.5:8000"], "pool re-created").await;
}

#[tokio::test]
async fn hostile_objects_are_named_counted_and_the_last_good_state_kept() {
    let fake = FakeKube::start().await;
    let pools = pool_resource(V1);
    let nine: Vec<u16> = (8000..8009).collect();
    fake.apply(&pools, pool_v1("vllm", &nine));
    fake.apply("pods", pod("a", Some("127.0.0.2"), "vllm", true));
    let kvpick = Kvpick::start_kube(
        &fake.kubeconfig(NS),
        &["--pool-name", "pool", "--pool-namespace", NS],
        &["--kv-events-port", "5557"],
    )
    .await;

    // Invalid from the start (9 ports): not ready, counted by field, no endpoints.
    wait_until("9 ports rejected", LIMIT, || async {
        kvpick
            .metric(
                "kvpick_discovery_invalid_total{field=\"spec.targetPorts\",kind=\"InferencePool\"}",
            )
            .await
            >= 1.0
    })
    .await;
    assert_eq!(readiness(&kvpick).await, Some(ServingStatus::NotServing));
    assert_eq!(endpoints(&kvpick).await, Vec::<String>::new());
    kvpick
        .wait_log(&["invalid InferencePool", "llm/pool", "spec.targetPorts"])
        .await;

    // Fixed: ready. Then 0 ports: rejected, last good spec kept, still ready.
    fake.apply(&pools, pool_v1("vllm", &[8000]));
    wait_endpoints(&kvpick, &["127.0.0.2:8000"], "valid pool").await;
    wait_readiness(&kvpick, ServingStatus::Serving, "valid pool").await;
    fake.apply(&pools, pool_v1("vllm", &[]));
    wait_until("0 ports rejected", LIMIT, || async {
        kvpick
            .metric(
                "kvpick_discovery_invalid_total{field=\"spec.targetPorts\",kind=\"InferencePool\"}",
            )
            .await
            >= 2.0
    })
    .await;
    assert_eq!(endpoints(&kvpick).await, ["127.0.0.2:8000"]);
    assert_eq!(readiness(&kvpick).await, Some(ServingStatus::Serving));

    // A ready pod without an IP, and one with a bad annotation: named, counted; the second
    // still serves, on the flag's KV-event port.
    fake.apply("pods", pod("no-ip", None, "vllm", true));
    let mut bad = pod("bad", Some("127.0.0.3"), "vllm", true);
    bad["metadata"]["annotations"] = json!({"kvpick.io/kv-events": "tcp://nowhere"});
    fake.apply("pods", bad);
    wait_endpoints(
        &kvpick,
        &["127.0.0.2:8000", "127.0.0.3:8000"],
        "hostile pods",
    )
    .await;
    wait_until("pod problems counted", LIMIT, || async {
        kvpick.metric("kvpick_discovery_invalid_total{field=\"status.podIP\",kind=\"Pod\"}").await >= 1.0
            && kvpick.metric("kvpick_discovery_invalid_total{field=\"metadata.annotations[kvpick.io/kv-events]\",kind=\"Pod\"}").await >= 1.0
    })
    .await;
    kvpick
        .wait_log(&["unusable pod field", "llm/no-ip", "status.podIP"])
        .await;
    kvpick
        .wait_log(&["unusable pod field", "llm/bad", "kvpick.io/kv-events"])
        .await;

    // An edited selector that matches nothing: named and counted, and the last endpoints
    // stay (a typo or a rollout whose pods are not ready yet must not empty the pool).
    let selector = "kvpick_discovery_invalid_total{field=\"spec.selector\",kind=\"InferencePool\"}";
    fake.apply(&pools, pool_v1("nothing-has-this", &[8000]));
    wait_until("empty selector counted", LIMIT, || async {
        kvpick.metric(selector).await >= 1.0
    })
    .await;
    kvpick
        .wait_log(&[
            "matches no ready pod",
            "llm/pool",
            "spec.selector",
            "nothing-has-this",
        ])
        .await;
    assert_eq!(
        endpoints(&kvpick).await,
        ["127.0.0.2:8000", "127.0.0.3:8000"],
        "the last endpoints are kept"
    );
    assert_eq!(readiness(&kvpick).await, Some(ServingStatus::Serving));
    // An unready pod of the new selector changes nothing; a ready one takes over.
    fake.apply(
        "pods",
        pod("new-0", Some("127.0.0.7"), "nothing-has-this", false),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        endpoints(&kvpick).await,
        ["127.0.0.2:8000", "127.0.0.3:8000"]
    );
    fake.apply(
        "pods",
        pod("new-1", Some("127.0.0.8"), "nothing-has-this", true),
    );
    wait_endpoints(&kvpick, &["127.0.0.8:8000"], "a pod of the new selector").await;
    // Pods of an unchanged selector leaving do empty the pool: they are gone, not a typo.
    fake.delete("pods", NS, "new-1");
    wait_endpoints(&kvpick, &[], "the only pod deleted").await;
    assert_eq!(kvpick.metric(selector).await, 1.0, "counted once");
    assert!(kvpick_alive(&kvpick).await, "no panic on any of it");
}

async fn kvpick_alive(kvpick: &Kvpick) -> bool {
    health(kvpick.health_port, "liveness").await == Some(ServingStatus::Serving)
}

#[tokio::test]
async fn v1alpha2_pools_and_the_standalone_selector() {
    let fake = FakeKube::start().await;
    let alpha = pool_resource(V1ALPHA2);
    fake.apply(
        &alpha,
        json!({"apiVersion": format!("{V1ALPHA2}/v1alpha2"), "kind": "InferencePool",
               "metadata": {"name": "old", "namespace": NS},
               "spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000,
                        "extensionRef": {"name": "kvpick"}}}),
    );
    fake.apply("pods", pod("a", Some("127.0.0.2"), "vllm", true));
    fake.apply("pods", pod("b", Some("127.0.0.3"), "vllm", true));
    let kubeconfig = fake.kubeconfig(NS);
    let pooled = Kvpick::start_kube(
        &kubeconfig,
        &[
            "--pool-name",
            "old",
            "--pool-namespace",
            NS,
            "--pool-group",
            V1ALPHA2,
        ],
        &[],
    )
    .await;
    wait_endpoints(
        &pooled,
        &["127.0.0.2:8000", "127.0.0.3:8000"],
        "v1alpha2 pool",
    )
    .await;
    wait_readiness(&pooled, ServingStatus::Serving, "v1alpha2 pool").await;

    // llm-d's standalone mode: no InferencePool at all.
    let standalone = Kvpick::start_kube(
        &kubeconfig,
        &[
            "--endpoint-selector",
            "app=vllm",
            "--endpoint-target-ports",
            "8000,8001",
            "--pool-namespace",
            NS,
        ],
        &[],
    )
    .await;
    wait_endpoints(
        &standalone,
        &[
            "127.0.0.2:8000",
            "127.0.0.2:8001",
            "127.0.0.3:8000",
            "127.0.0.3:8001",
        ],
        "standalone selector",
    )
    .await;
    wait_readiness(&standalone, ServingStatus::Serving, "standalone selector").await;
    fake.delete("pods", NS, "a");
    wait_endpoints(
        &standalone,
        &["127.0.0.3:8000", "127.0.0.3:8001"],
        "standalone pod deleted",
    )
    .await;
    wait_endpoints(&pooled, &["127.0.0.3:8000"], "v1alpha2 pod deleted").await;
}

/// llm-d's `--endpoint-selector` takes the API's full selector syntax: sets and existence
/// requirements select the pods, and a label edit moves a pod in or out.
#[tokio::test]
async fn a_set_based_endpoint_selector_selects_by_sets_and_existence() {
    let fake = FakeKube::start().await;
    fake.apply("pods", pod("a", Some("127.0.0.2"), "vllm", true));
    fake.apply("pods", pod("b", Some("127.0.0.3"), "vllm-canary", true));
    fake.apply("pods", pod("c", Some("127.0.0.4"), "sglang", true));
    let mut retired = pod("d", Some("127.0.0.5"), "vllm", true);
    retired["metadata"]["labels"]["deprecated"] = json!("true");
    fake.apply("pods", retired.clone());
    let kubeconfig = fake.kubeconfig(NS);
    let kvpick = Kvpick::start_kube(
        &kubeconfig,
        &[
            "--endpoint-selector",
            "app in (vllm, vllm-canary),!deprecated,llm-d.ai/role",
            "--endpoint-target-ports",
            "8000",
            "--pool-namespace",
            NS,
        ],
        &[],
    )
    .await;
    wait_endpoints(
        &kvpick,
        &["127.0.0.2:8000", "127.0.0.3:8000"],
        "set-based selector",
    )
    .await;
    // The label that kept d out is removed: d is selected.
    if let Some(labels) = retired["metadata"]["labels"].as_object_mut() {
        labels.remove("deprecated");
    }
    fake.apply("pods", retired);
    wait_endpoints(
        &kvpick,
        &["127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.5:8000"],
        "label removed",
    )
    .await;
    // A selector the API would reject is refused at start with the reason.
    let refused = serve_refused(
        &[
            "--endpoint-selector",
            "app in (vllm",
            "--endpoint-target-ports",
            "8000",
        ],
        &[],
    );
    assert!(refused.contains("--endpoint-selector"), "{refused}");
    assert!(refused.contains("parenthesis"), "{refused}");
}

#[test]
fn conflicting_sources_are_a_start_up_error_naming_the_flags() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["--endpoints-file", "pool.yaml", "--pool-name", "pool"],
            "--endpoints-file and --pool-name are given together",
        ),
        (
            &[
                "--pool-name",
                "pool",
                "--endpoint-selector",
                "app=x",
                "--endpoint-target-ports",
                "8000",
            ],
            "--pool-name and --endpoint-selector are given together",
        ),
        (&["--endpoint-selector", "app=x"], "--endpoint-target-ports"),
    ];
    for (args, want) in cases {
        let stderr = support::kvpick::serve_refused(args, &[]);
        assert!(stderr.contains(want), "{args:?}: stderr {stderr}");
    }
}

/// KV-event subscriptions follow the pods: an annotated pod's address, the flag's port on a
/// pod without one, and a deleted pod's subscription closed.
#[tokio::test]
async fn kv_event_subscriptions_follow_annotations_flags_and_deletions() {
    use support::zmtp_peer::RawPub;
    let flagged = tokio::net::TcpListener::bind("127.0.0.3:0")
        .await
        .expect("bind");
    let flag_port = flagged.local_addr().expect("addr").port().to_string();
    let annotated = tokio::net::TcpListener::bind("127.0.0.5:0")
        .await
        .expect("bind");
    let annotation = format!("tcp://{}", annotated.local_addr().expect("addr"));

    let fake = FakeKube::start().await;
    fake.apply(&pool_resource(V1), pool_v1("vllm", &[8000]));
    fake.apply("pods", pod("flagged", Some("127.0.0.3"), "vllm", true));
    let mut with_annotation = pod("annotated", Some("127.0.0.4"), "vllm", true);
    with_annotation["metadata"]["annotations"] = json!({"kvpick.io/kv-events": annotation});
    fake.apply("pods", with_annotation);
    let kvpick = Kvpick::start_kube(
        &fake.kubeconfig(NS),
        &["--pool-name", "pool", "--pool-namespace", NS],
        &["--kv-events-port", &flag_port],
    )
    .await;
    wait_endpoints(&kvpick, &["127.0.0.3:8000", "127.0.0.4:8000"], "two pods").await;
    let _flagged = RawPub::accept(&flagged, LIMIT).await;
    let mut annotated = RawPub::accept(&annotated, LIMIT).await;

    fake.delete("pods", NS, "annotated");
    wait_endpoints(&kvpick, &["127.0.0.3:8000"], "annotated pod deleted").await;
    assert!(
        annotated.closed_within(LIMIT).await,
        "the deleted pod's KV-event subscription is closed"
    );
}
