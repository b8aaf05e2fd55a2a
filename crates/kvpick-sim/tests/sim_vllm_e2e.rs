//! Golden tests from `scripts/vllm-e2e.sh`'s run against two real vLLM 0.32 engines: what the
//! run showed the simulator doing differently, captured from the real engine in
//! `tests/fixtures/vllm-e2e/` (README there says how).

// The workspace's one fixture lookup (tests/support/paths.rs).
#[path = "../../../tests/support/paths.rs"]
mod paths;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvpick_sim::engine::EngineConfig;
use kvpick_sim::events::{EngineHash, EventBatch, EventLayout, KvEvent};
use kvpick_sim::fleet::{FleetConfig, FleetPod, start_fleet};
use kvpick_sim::hashing::HashAlgo;
use kvpick_sim::tokenizer::SimTokenizer;
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv, SubSocket};

fn capture(file: &str) -> String {
    let path: PathBuf = paths::repo_root()
        .join("tests/fixtures/vllm-e2e")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// One pod with the engines' settings in the run (block 32, 64 blocks, sha256).
async fn pod() -> FleetPod {
    let tok = SimTokenizer::load(&paths::repo_root().join("assets/tokenizer")).expect("tokenizer");
    let mut pods = start_fleet(
        FleetConfig {
            pods: 1,
            host: [127, 0, 0, 1].into(),
            base_port: 0,
            events_base_port: Some(0),
            replay_base_port: Some(0),
            model: "tiny".into(),
            engine: EngineConfig {
                block_size: 32,
                num_gpu_blocks: 64,
                max_num_seqs: 8,
                max_model_len: 1536,
                hash_algo: HashAlgo::Sha256,
                ..EngineConfig::default()
            },
            time_scale: 0.0,
            buffer_steps: 10_000,
            layout: EventLayout::Map,
            overrides: Vec::new(),
            request_log: None,
        },
        Arc::new(tok),
    )
    .await
    .expect("fleet");
    pods.remove(0)
}

async fn call(pod: &FleetPod, method: &str, path: &str, body: Option<String>) -> (u16, String) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", pod.http))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("in time")
        .expect("response");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

async fn post(pod: &FleetPod, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = call(pod, "POST", path, Some(body.to_string())).await;
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The next batch on `sub`, or `None` when none comes within `wait`.
async fn next_batch(sub: &mut SubSocket, wait: Duration) -> Option<EventBatch> {
    let frames = tokio::time::timeout(wait, sub.recv()).await.ok()?;
    let frames = frames.expect("recv").into_vec();
    Some(EventBatch::decode(&frames[2]).expect("payload"))
}

fn kind(event: &KvEvent) -> &'static str {
    match event {
        KvEvent::BlockStored(_) => "BlockStored",
        KvEvent::BlockRemoved { .. } => "BlockRemoved",
        KvEvent::AllBlocksCleared => "AllBlocksCleared",
    }
}

/// vLLM 0.32 queues `AllBlocksCleared` at `POST /reset_prefix_cache` and publishes it with its
/// next step: an idle engine says nothing until the next request, whose batch then starts
/// with the clear, followed by that request's stores (the capture: the engine's batches from
/// the reset on, and the prompt sent after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cache_reset_is_announced_with_the_next_step_like_vllm() {
    let real: Vec<Value> = capture("reset-prefix-cache.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("capture line"))
        .collect();
    let first = &real[0];
    let real_kinds: Vec<&str> = first["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["type"].as_str().expect("type"))
        .collect();
    let real_hashes: Vec<u64> = first["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["type"] == "BlockStored")
        .flat_map(|e| e["block_hashes"].as_array().expect("hashes").clone())
        .map(|h| h.as_u64().expect("int hash"))
        .collect();
    assert_eq!(
        real_kinds.first(),
        Some(&"AllBlocksCleared"),
        "{real_kinds:?}"
    );

    let pod = pod().await;
    let publisher = pod.pod.publisher.as_ref().expect("events");
    let mut sub = SubSocket::new();
    sub.connect(publisher.endpoint.as_str())
        .await
        .expect("connect");
    sub.subscribe("").await.expect("subscribe");
    // Something cached, and the SUB connected (bounded probes, each a fresh prompt).
    let mut probe = 0;
    loop {
        probe += 1;
        assert!(probe < 100, "SUB never connected");
        let body = json!({"prompt": format!("probe {probe} ").repeat(20), "max_tokens": 1});
        post(&pod, "/v1/completions", &body).await;
        if next_batch(&mut sub, Duration::from_millis(50))
            .await
            .is_some()
        {
            break;
        }
    }
    while next_batch(&mut sub, Duration::from_millis(200))
        .await
        .is_some()
    {}

    let (status, _) = post(&pod, "/reset_prefix_cache", &json!({})).await;
    assert_eq!(status, 200);
    let idle = next_batch(&mut sub, Duration::from_millis(500)).await;
    assert!(
        idle.is_none(),
        "an idle engine publishes nothing at its reset: {idle:?}"
    );
    let prompt = first["prompt"].as_str().expect("prompt");
    let (status, body) = post(
        &pod,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let batch = next_batch(&mut sub, Duration::from_secs(5))
        .await
        .expect("the step's batch");
    let kinds: Vec<&str> = batch.events.iter().map(kind).collect();
    assert_eq!(kinds, real_kinds);
    let hashes: Vec<u64> = batch
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .map(|h| match h {
            EngineHash::Int(v) => v,
            EngineHash::Bytes(b) => panic!("int hashes expected, got {b:?}"),
        })
        .collect();
    assert_eq!(hashes, real_hashes);
}

/// `# TYPE name kind` lines and unlabelled-or-labelled sample values of a Prometheus page.
fn metric_types(text: &str) -> std::collections::BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect()
}

fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(_, v)| v.parse::<f64>().expect("sample value"))
        .reduce(|a, b| a + b)
}

/// A real engine killed and started again (scripts/vllm-e2e.sh, tests/fixtures/vllm-e2e/):
/// it is a new process, so `process_start_time_seconds` moves on and the counters start again
/// from 0. kvpick clears a pod's entries when that start time changes; the simulator's
/// restart must show the same, with the metric types the real engine declares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_looks_like_the_real_engines_on_metrics() {
    let dir = paths::repo_root().join("tests/fixtures/vllm-e2e");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).expect("fixture");
    let (real_before, real_after) = (
        read("metrics-before-kill.txt"),
        read("metrics-after-restart.txt"),
    );
    let start = "process_start_time_seconds";
    let hits = "vllm:prefix_cache_hits_total";
    // What the capture shows of the real engine.
    let real_start = (
        metric_value(&real_before, start).expect("real start time"),
        metric_value(&real_after, start).expect("real start time after"),
    );
    assert!(real_start.1 > real_start.0, "{real_start:?}");
    assert!(metric_value(&real_before, hits) > Some(0.0));
    assert_eq!(metric_value(&real_after, hits), Some(0.0));

    let pod = &pod().await;
    let page = || async { call(pod, "GET", "/metrics", None).await.1 };
    let sim_types = metric_types(&page().await);
    for (name, kind) in metric_types(&real_before) {
        assert_eq!(
            sim_types.get(&name),
            Some(&kind),
            "{name}: the real engine declares {kind}"
        );
    }
    let body = json!({"prompt": "restart probe ".repeat(40), "max_tokens": 1});
    post(pod, "/v1/completions", &body).await;
    post(pod, "/v1/completions", &body).await;
    let before = page().await;
    assert!(metric_value(&before, hits) > Some(0.0), "{before}");
    let (status, _) = post(pod, "/admin/faults", &json!({"restart": true})).await;
    assert_eq!(status, 200);
    let after = page().await;
    let sim_start = (
        metric_value(&before, start).expect("sim start time"),
        metric_value(&after, start).expect("sim start time after"),
    );
    assert!(
        sim_start.1 > sim_start.0 && sim_start.0 > 1.6e9,
        "{sim_start:?}"
    );
    assert_eq!(metric_value(&after, hits), Some(0.0), "{after}");
}

/// `return_token_ids: true` (what the run uses to read the ids an engine ran): vLLM 0.32 puts
/// a completion's prompt ids and output ids on its choice, and a chat's prompt ids at the top
/// with the output ids on the choice. The prompt ids must equal the real engine's; the output
/// ids are the (random) model's own, so only their count is compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn return_token_ids_answers_where_vllm_does() {
    let real: Value = serde_json::from_str(&capture("return-token-ids.json")).expect("capture");
    let pod = pod().await;
    let ids_len = |v: &Value| v.as_array().map(Vec::len);
    for (path, body, answer, prompt_at) in [
        (
            "/v1/completions",
            "completion_body",
            "completion",
            "/choices/0/prompt_token_ids",
        ),
        (
            "/v1/chat/completions",
            "chat_body",
            "chat",
            "/prompt_token_ids",
        ),
    ] {
        let (status, ours) = post(&pod, path, &real[body]).await;
        assert_eq!(status, 200, "{ours}");
        let theirs = &real[answer];
        assert!(
            theirs.pointer(prompt_at).is_some_and(Value::is_array),
            "{theirs}"
        );
        assert_eq!(
            ours.pointer(prompt_at),
            theirs.pointer(prompt_at),
            "{path}: {ours}"
        );
        let out = "/choices/0/token_ids";
        assert_eq!(
            ours.pointer(out).and_then(ids_len),
            theirs.pointer(out).and_then(ids_len),
            "{path}: {ours}"
        );
    }
}
