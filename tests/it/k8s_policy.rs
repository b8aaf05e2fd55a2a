//! InferenceObjectives and InferenceModelRewrites from the (fake) API through the real
//! `kvpick serve` binary and a real Envoy: added, edited, made invalid and deleted objects
//! take effect on the next request without a restart; both API groups; a CRD that is not
//! installed at start and installed later.

use crate::fake_kube;
use crate::k8s_discovery::{LIMIT, NS, V1, pod, pool_v1, wait_readiness};
use crate::support;

use std::time::{Duration, Instant};

use fake_kube::{FakeKube, pool_resource, resource};
use serde_json::{Value, json};
use support::backend::Backend;
use support::envoy::{Envoy, EnvoyOptions};
use support::http::{Reply, send};
use support::kvpick::Kvpick;
use tonic_health::pb::health_check_response::ServingStatus;

const LLM_D: &str = "llm-d.ai";
const LEGACY: &str = "inference.networking.x-k8s.io";

/// What a vLLM with 100 requests waiting reports (the pool is saturated).
const OVERLOADED_METRICS: &str = "vllm:num_requests_waiting{model_name=\"m\"} 100.0\n\
    vllm:num_requests_running{model_name=\"m\"} 8.0\n\
    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n";

fn objective(group: &str, name: &str, pool: &str, priority: Value) -> Value {
    json!({
        "apiVersion": format!("{group}/v1alpha2"), "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"poolRef": {"name": pool}, "priority": priority}
    })
}

fn rewrite(group: &str, name: &str, created: &str, rules: Value) -> Value {
    json!({
        "apiVersion": format!("{group}/v1alpha2"), "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": NS, "creationTimestamp": created},
        "spec": {"poolRef": {"group": V1, "name": "pool"}, "rules": rules}
    })
}

fn exact(model: &str, targets: Value) -> Value {
    json!({"matches": [{"model": {"type": "Exact", "value": model}}], "targets": targets})
}

/// One backend as the pool's only pod, kvpick watching the pool, and Envoy in front
/// (over TLS to kvpick).
async fn pool_with_one_pod(fake: &FakeKube, backend: &Backend, extra: &[&str]) -> (Kvpick, Envoy) {
    let ip = backend.addr.ip().to_string();
    fake.apply("pods", pod("a", Some(&ip), "vllm", true));
    fake.apply(&pool_resource(V1), pool_v1("vllm", &[backend.addr.port()]));
    // Envoy speaks TLS to kvpick's ext-proc port here, as a production gateway should.
    let mut args = vec!["--discovery-stale-after", "2s", "--secure-serving"];
    args.extend_from_slice(extra);
    let kvpick = Kvpick::start_kube(
        &fake.kubeconfig(NS),
        &["--pool-name", "pool", "--pool-namespace", NS],
        &args,
    )
    .await;
    wait_readiness(&kvpick, ServingStatus::Serving, "pool synced").await;
    // Envoy's pool is the discovered pod (kvpick has no pool file in this mode).
    std::fs::write(&kvpick.pool_file, "endpoints: []\n").expect("write envoy's pool");
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            extra_pool: vec![backend.addr],
            kvpick_tls: true,
            ..EnvoyOptions::default()
        },
    )
    .await;
    (kvpick, envoy)
}

async fn completion(envoy: &Envoy, model: &str, objective: Option<&str>) -> Reply {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(objective) = objective {
        headers.push(("x-gateway-inference-objective", objective));
    }
    let body = json!({"model": model, "prompt": "hello"}).to_string();
    send(
        "POST",
        &envoy.url("/v1/completions"),
        &headers,
        body.into_bytes(),
    )
    .await
    .expect("request")
}

/// Polls until a request with `objective` gets `status` (the next request after the API
/// change must see it; polling only covers the watch's delivery).
async fn wait_status(envoy: &Envoy, objective: &str, status: u16, step: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let reply = completion(envoy, "m", Some(objective)).await;
        if reply.status == status {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{step}: objective {objective} got {} ({}), want {status}",
            reply.status,
            reply.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objectives_from_the_api_override_flags_and_follow_edits_and_deletes() {
    let fake = FakeKube::start().await;
    // The older group's objectives are not installed at start.
    let legacy = resource("inferenceobjectives", LEGACY);
    fake.set_missing(&legacy, true);
    let backend = Backend::start("127.0.0.1").await;
    backend.set_metrics(OVERLOADED_METRICS);
    let (kvpick, envoy) = pool_with_one_pod(&fake, &backend, &["--objective", "batch=-1"]).await;
    let objectives = resource("inferenceobjectives", LLM_D);

    // The flag: sheddable in a saturated pool.
    wait_status(&envoy, "batch", 429, "flag objective").await;
    assert!(
        kvpick
            .metric("kvpick_tls_handshakes_total{result=\"ok\"}")
            .await
            >= 1.0,
        "Envoy's ext_proc streams come over TLS"
    );
    assert!(fake.lists(&legacy) > 0, "the missing CRD was asked for");
    assert_eq!(
        kvpick
            .metric(&format!(
                "kvpick_discovery_crd_missing{{group=\"{LEGACY}\",resource=\"inferenceobjective\"}}"
            ))
            .await,
        1.0
    );

    // An API object of the same name overrides the flag.
    fake.apply(&objectives, objective(LLM_D, "batch", "pool", json!(0)));
    wait_status(&envoy, "batch", 200, "API objective added").await;
    // Edited back to sheddable.
    fake.apply(&objectives, objective(LLM_D, "batch", "pool", json!(-5)));
    wait_status(&envoy, "batch", 429, "API objective edited").await;
    fake.apply(&objectives, objective(LLM_D, "batch", "pool", json!(3)));
    wait_status(&envoy, "batch", 200, "API objective edited again").await;

    // A hostile edit: logged, counted, the last valid version stays.
    fake.apply(
        &objectives,
        objective(LLM_D, "batch", "pool", json!(1_u64 << 40)),
    );
    support::wait_until("the bad priority is counted", LIMIT, || async {
        kvpick.metric("kvpick_discovery_invalid_total{field=\"spec.priority\",kind=\"InferenceObjective\"}",
        )
        .await
            >= 1.0
    })
    .await;
    kvpick
        .wait_log(&[
            "invalid object ignored",
            "llm/batch",
            "spec.priority",
            "1099511627776",
        ])
        .await;
    assert_eq!(completion(&envoy, "m", Some("batch")).await.status, 200);

    // An objective of another pool is not ours.
    fake.apply(
        &objectives,
        objective(LLM_D, "other-pool", "elsewhere", json!(-9)),
    );
    // Deleted: the flag's value is back.
    fake.delete(&objectives, NS, "batch");
    wait_status(&envoy, "batch", 429, "API objective deleted").await;
    assert_eq!(
        completion(&envoy, "m", Some("other-pool")).await.status,
        200
    );

    // The older group's CRD is installed later: its objects are picked up without a restart.
    fake.set_missing(&legacy, false);
    fake.apply(
        &legacy,
        objective(LEGACY, "legacy-batch", "pool", json!(-2)),
    );
    wait_status(&envoy, "legacy-batch", 429, "older group's objective").await;
    assert_eq!(
        kvpick
            .metric("kvpick_discovery_policy_objects{kind=\"InferenceObjective\"}")
            .await,
        1.0
    );
}

/// The model the backend received last.
fn last_model(backend: &Backend) -> Option<String> {
    let seen = backend.seen();
    let body: Value = serde_json::from_slice(&seen.last()?.body).ok()?;
    body["model"].as_str().map(str::to_owned)
}

async fn wait_rewrite(envoy: &Envoy, backend: &Backend, model: &str, want: &str, step: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let reply = completion(envoy, model, None).await;
        assert_eq!(reply.status, 200, "{step}: {}", reply.text());
        let got = last_model(backend);
        if got.as_deref() == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{step}: {model} reached the backend as {got:?}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_rewrites_from_the_api_follow_gie_precedence_edits_and_deletes() {
    let fake = FakeKube::start().await;
    let backend = Backend::start("127.0.0.1").await;
    let (kvpick, envoy) = pool_with_one_pod(&fake, &backend, &[]).await;
    let (llm_d, legacy) = (
        resource("inferencemodelrewrites", LLM_D),
        resource("inferencemodelrewrites", LEGACY),
    );
    wait_rewrite(&envoy, &backend, "alias", "alias", "no rewrites yet").await;

    fake.apply(
        &llm_d,
        rewrite(
            LLM_D,
            "alias",
            "2026-02-01T00:00:00Z",
            json!([exact("alias", json!([{"modelRewrite": "real-v1"}]))]),
        ),
    );
    wait_rewrite(&envoy, &backend, "alias", "real-v1", "rewrite added").await;
    fake.apply(
        &llm_d,
        rewrite(
            LLM_D,
            "alias",
            "2026-02-01T00:00:00Z",
            json!([exact(
                "alias",
                json!([{"modelRewrite": "real-v2", "weight": 10}])
            )]),
        ),
    );
    wait_rewrite(&envoy, &backend, "alias", "real-v2", "rewrite edited").await;

    // An older catch-all in the other group: exact matches still win for `alias`, every
    // other model goes to the fallback.
    fake.apply(
        &legacy,
        rewrite(
            LEGACY,
            "catch-all",
            "2026-01-01T00:00:00Z",
            json!([{"targets": [{"modelRewrite": "fallback"}]}]),
        ),
    );
    wait_rewrite(&envoy, &backend, "anything", "fallback", "generic rewrite").await;
    wait_rewrite(&envoy, &backend, "alias", "real-v2", "exact beats generic").await;
    // An older exact match for the same model wins the tie.
    fake.apply(
        &legacy,
        rewrite(
            LEGACY,
            "older-alias",
            "2025-12-01T00:00:00Z",
            json!([exact("alias", json!([{"modelRewrite": "oldest"}]))]),
        ),
    );
    wait_rewrite(&envoy, &backend, "alias", "oldest", "oldest exact wins").await;

    // Hostile: weight 0 and a Prefix match are rejected, counted, and change nothing.
    fake.apply(
        &llm_d,
        rewrite(
            LLM_D,
            "bad",
            "2025-01-01T00:00:00Z",
            json!([exact("alias", json!([{"modelRewrite": "x", "weight": 0}]))]),
        ),
    );
    fake.apply(
        &llm_d,
        rewrite(LLM_D, "bad2", "2025-01-01T00:00:00Z", json!([{"matches": [{"model": {"type": "Prefix", "value": "a"}}], "targets": [{"modelRewrite": "x"}]}])),
    );
    support::wait_until("both bad rewrites are counted", LIMIT, || async {
        kvpick.metric("kvpick_discovery_invalid_total{field=\"spec.rules.targets\",kind=\"InferenceModelRewrite\"}").await >= 1.0
            && kvpick.metric("kvpick_discovery_invalid_total{field=\"spec.rules.matches\",kind=\"InferenceModelRewrite\"}").await >= 1.0
    })
    .await;
    wait_rewrite(&envoy, &backend, "alias", "oldest", "bad rewrites ignored").await;

    // Deletes: back to the next rule in precedence, then to no rewrite at all.
    fake.delete(&legacy, NS, "older-alias");
    wait_rewrite(&envoy, &backend, "alias", "real-v2", "older exact deleted").await;
    fake.delete(&legacy, NS, "catch-all");
    wait_rewrite(&envoy, &backend, "anything", "anything", "generic deleted").await;
    fake.delete(&llm_d, NS, "alias");
    wait_rewrite(&envoy, &backend, "alias", "alias", "all deleted").await;
}

#[tokio::test]
async fn a_failing_objective_watch_turns_readiness_off_after_the_stale_period_and_back() {
    let fake = FakeKube::start().await;
    let backend = Backend::start("127.0.0.1").await;
    let (kvpick, _envoy) = pool_with_one_pod(&fake, &backend, &[]).await;
    let objectives = resource("inferenceobjectives", LLM_D);
    let stale = "kvpick_discovery_not_ready_total{reason=\"stale\"}";
    assert_eq!(kvpick.metric(stale).await, 0.0);

    // Only the objectives fail (the pool and pods keep answering): after the stale period
    // (2 s) readiness goes off, since the objectives kvpick applies may be out of date.
    fake.set_resource_failing(&objectives, true);
    fake.end_watches();
    let failed_at = Instant::now();
    wait_readiness(&kvpick, ServingStatus::NotServing, "objectives failing").await;
    assert!(
        failed_at.elapsed() >= Duration::from_millis(1500),
        "not before the stale period ({:?})",
        failed_at.elapsed()
    );
    assert_eq!(kvpick.metric(stale).await, 1.0);
    kvpick
        .wait_log(&["InferenceObjective", "llm-d.ai", "watch failed"])
        .await;
    kvpick
        .wait_log(&["objective/rewrite watches failing", "readiness off"])
        .await;

    // The resource answers again: the probe notices (the re-established watch says nothing).
    fake.set_resource_failing(&objectives, false);
    wait_readiness(&kvpick, ServingStatus::Serving, "objectives answer again").await;
    kvpick
        .wait_log(&["InferenceObjective", "answers again"])
        .await;
}
