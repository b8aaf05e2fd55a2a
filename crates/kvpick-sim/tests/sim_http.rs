//! The simulator's HTTP surface through real HTTP on 127.0.0.1 (hyper client), with the real
//! tokenizer, plus its KV events through real ZMQ sockets: the fixture's own request bodies give
//! the same token counts and the same event payload as the real vLLM engine.

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
use kvpick_sim::events::{EventBatch, EventLayout};
use kvpick_sim::fleet::{
    DEFAULT_TOPIC_TEMPLATE, FleetConfig, FleetPod, render_topic, start_fleet_with_topic,
};
use kvpick_sim::floor::FloorModel;
use kvpick_sim::hashing::HashAlgo;
use kvpick_sim::request_log::RequestLog;
use kvpick_sim::tokenizer::SimTokenizer;
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv, SubSocket};

fn fixtures() -> PathBuf {
    paths::fixtures().join("vllm-0.32-kv-events")
}

fn fixture_requests() -> Vec<Value> {
    std::fs::read_to_string(fixtures().join("requests.jsonl"))
        .expect("requests.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

async fn fleet(pods: usize, max_loras: usize) -> Vec<FleetPod> {
    fleet_with_topic(pods, max_loras, DEFAULT_TOPIC_TEMPLATE).await
}

async fn fleet_with_topic(pods: usize, max_loras: usize, topic: &str) -> Vec<FleetPod> {
    fleet_with(pods, max_loras, topic, None, 0.0).await
}

/// The test engine (32-token blocks, 64 of them per pod).
fn test_engine(max_loras: usize) -> EngineConfig {
    EngineConfig {
        block_size: 32,
        num_gpu_blocks: 64,
        max_num_seqs: 8,
        max_model_len: 1536,
        hash_algo: HashAlgo::Sha256,
        max_loras,
        ..EngineConfig::default()
    }
}

async fn fleet_with(
    pods: usize,
    max_loras: usize,
    topic: &str,
    request_log: Option<Arc<RequestLog>>,
    time_scale: f64,
) -> Vec<FleetPod> {
    let tok = SimTokenizer::load(&paths::repo_root().join("assets/tokenizer")).expect("tokenizer");
    start_fleet_with_topic(
        FleetConfig {
            pods,
            host: [127, 0, 0, 1].into(),
            base_port: 0,
            events_base_port: Some(0),
            replay_base_port: Some(0),
            model: "tiny".into(),
            engine: test_engine(max_loras),
            time_scale,
            buffer_steps: 10_000,
            layout: EventLayout::Map,
            overrides: Vec::new(),
            request_log,
        },
        Arc::new(tok),
        topic,
    )
    .await
    .expect("fleet")
}

/// The topic frame is deployment config in vLLM (`--kv-events-config '{"topic": …}'`): the
/// default template gives the fixture's llm-d-style topic, and `""` gives vLLM's own default,
/// the only topic vllm-router 0.1.17's static `--kv-event-source` accepts (it drops every
/// message whose topic frame is not exactly "", docs/benchmarks.md). Live and replayed frames
/// carry it; the payload stays the real engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_topic_is_the_configured_one_live_and_replayed() {
    let real_topic = std::fs::read(fixtures().join("0000.topic")).expect("fixture topic");
    let real_addr = "127.0.0.1:8101".parse().expect("addr");
    assert_eq!(
        render_topic(DEFAULT_TOPIC_TEMPLATE, real_addr, "tiny").as_bytes(),
        real_topic.as_slice(),
        "the default template is the captured engine's topic"
    );
    let real = std::fs::read(fixtures().join("0000.msgpack")).expect("fixture");
    let requests = fixture_requests();

    // vLLM's default, the empty topic (every other test here runs the default template).
    let pods = fleet_with_topic(1, 0, "").await;
    let pod = &pods[0];
    let publisher = pod.pod.publisher.as_ref().expect("events");
    let mut sub = SubSocket::new();
    sub.connect(publisher.endpoint.as_str())
        .await
        .expect("connect");
    sub.subscribe("").await.expect("subscribe");
    let mut live = None;
    for probe in 0..100 {
        let body = json!({"prompt": format!("probe {probe} ").repeat(20), "max_tokens": 1});
        post(pod, "/v1/completions", &body).await;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            live = Some(m.into_vec());
            break;
        }
    }
    let live = live.expect("SUB connected");
    assert_eq!(live.len(), 3, "[topic, seq, payload]");
    assert!(live[0].is_empty(), "live topic frame {:?}", live[0]);

    let (status, body) = post(pod, "/v1/completions", &requests[0]["body"]).await;
    assert_eq!(status, 200, "{body}");
    // The fixture request's batch is the last one: replayed, its topic frame is empty too
    // and its payload the real engine's.
    let last = publisher.next_seq().await.expect("running") - 1;
    let ours = replay_one(pod, last).await;
    assert!(ours[0].is_empty(), "replay topic frame {:?}", ours[0]);
    let ours = EventBatch::decode(&ours[2]).expect("decodes");
    let mut theirs = EventBatch::decode(&real).expect("decodes");
    theirs.ts = ours.ts;
    assert_eq!(ours, theirs, "the real engine's event, ts aside");
}

/// Replays exactly `seq` from `pod`; returns its `[topic, seq, payload]`.
async fn replay_one(pod: &FleetPod, seq: u64) -> Vec<Bytes> {
    use zeromq::{DealerSocket, SocketSend, ZmqMessage};
    let publisher = pod.pod.publisher.as_ref().expect("events");
    let mut dealer = DealerSocket::new();
    dealer
        .connect(publisher.replay_endpoint.as_deref().expect("replay"))
        .await
        .expect("dealer");
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
    ])
    .expect("frames");
    dealer.send(req).await.expect("send");
    let reply = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
        .await
        .expect("replay in time")
        .expect("recv")
        .into_vec();
    reply[1..].to_vec()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_chat_and_tokenize_match_the_real_engine() {
    let pods = fleet(1, 0).await;
    let pod = &pods[0];
    let requests = fixture_requests();

    // The first fixture request (completion); its KV event is read back below.
    let (status, body) = post(pod, "/v1/completions", &requests[0]["body"]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 483);
    assert_eq!(body["usage"]["completion_tokens"], 16);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["finish_reason"], "length");

    // Read it back through the replay socket (a real DEALER): deterministic, unlike a SUB
    // that may join late, and byte-identical to the live message.
    let msg = replay_one(pod, 0).await;
    let ours = EventBatch::decode(&msg[2]).expect("decodes");
    let real = std::fs::read(fixtures().join("0000.msgpack")).expect("fixture");
    let mut theirs = EventBatch::decode(&real).expect("decodes");
    theirs.ts = ours.ts;
    assert_eq!(ours, theirs, "the same event as the real engine, ts aside");
    assert_eq!(
        ours.encode(EventLayout::Map),
        theirs.encode(EventLayout::Map)
    );

    // The repeat is a full prefix hit (comp-doc-q1-repeat: no event at all).
    let (_, body) = post(pod, "/v1/completions", &requests[0]["body"]).await;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 480);

    // Chat, non-streaming: chat-billing.
    let (status, body) = post(pod, "/v1/chat/completions", &requests[2]["body"]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["usage"]["prompt_tokens"],
        requests[2]["usage"]["prompt_tokens"]
    );
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");

    // /tokenize equals vLLM's answer for every fixture request (tools included).
    for r in &requests {
        let (status, body) = post(pod, "/tokenize", &r["tokenize_request"]).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["tokens"], r["prompt_token_ids"], "{}", r["label"]);
        assert_eq!(body["count"], r["prompt_token_count"]);
    }

    // Token-id prompts and lists of strings.
    let (status, body) = post(
        pod,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        (status, body["usage"]["prompt_tokens"].clone()),
        (200, json!(3))
    );
    let (status, body) = post(
        pod,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": ["hello", "hello world"], "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(2));
    assert_eq!(body["usage"]["completion_tokens"], 6);
}

/// `--request-log`: a line per request names the pod that served it and what its cache held,
/// prompts sharing a head share its digest (the harness counts copies per prefix by it), and
/// each line's floor counts what any pod of the fleet had seen before (an unlimited shared
/// cache on an idle pod) and is never above the first-token time the pod took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_log_names_the_pod_and_the_cached_tokens_of_each_request() {
    let path = std::env::temp_dir().join(format!("sim-http-reqlog-{}", std::process::id()));
    let engine = test_engine(0);
    // Real time at a tenth of the default step costs: a step of these prompts is ~1–2 ms.
    let time_scale = 0.1;
    let floor = FloorModel::for_engine(&engine, time_scale);
    let log = Arc::new(RequestLog::create(&path, floor).expect("log"));
    let pods = fleet_with(2, 0, DEFAULT_TOPIC_TEMPLATE, Some(log), time_scale).await;
    let shared = "You are a careful assistant who answers briefly. ".repeat(12);
    let prompt = |q: &str| format!("{shared}Question: {q}");
    // Pod 1 twice (the second reuses the first's blocks, streamed), pod 0 once, another head,
    // then pod 0 with the first prompt again: pod 0 never held it, the fleet had seen it.
    let mut served = Vec::new();
    for (pod, text, stream) in [
        (1, prompt("why?"), false),
        (1, prompt("how?"), true),
        (0, "Something else entirely. ".repeat(20), false),
        (0, prompt("why?"), false),
    ] {
        let body = json!({"prompt": text, "max_tokens": 2, "stream": stream,
            "stream_options": {"include_usage": true}});
        let (status, answer) = call(
            &pods[pod],
            "POST",
            "/v1/completions",
            Some(body.to_string()),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        let usage_line = answer
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: ").or(Some(e)))
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find(|v| v.get("usage").is_some_and(|u| !u.is_null()))
            .expect("usage");
        served.push(usage_line["usage"].clone());
    }
    let text = std::fs::read_to_string(&path).expect("read the log");
    let _ = std::fs::remove_file(&path);
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    for (line, (pod, usage)) in lines.iter().zip([1, 1, 0, 0].iter().zip(&served)) {
        assert_eq!(line["pod"], *pod, "{text}");
        assert_eq!(line["prompt_tokens"], usage["prompt_tokens"], "{text}");
        assert_eq!(
            line["cached_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
            "{text}"
        );
        let first_token_s = line["first_token_s"].as_f64().expect("first_token_s");
        assert!(first_token_s >= 0.0, "{text}");
        assert!(
            line["arrived"].as_f64().is_some_and(|s| s > 1.6e9),
            "{text}"
        );
        // The floor: the prompt's uncached part at the model's costs, below what it took.
        let prompt_tokens = line["prompt_tokens"].as_u64().expect("prompt_tokens") as usize;
        let reusable = line["reusable_tokens"].as_u64().expect("reusable_tokens") as usize;
        let floor_s = line["floor_s"].as_f64().expect("floor_s");
        let expected = floor.first_token_s(prompt_tokens - reusable);
        assert!((floor_s - expected).abs() < 1e-6, "{floor_s} vs {expected}");
        assert!(floor_s > 0.0 && floor_s <= first_token_s, "{text}");
    }
    assert_eq!(lines[0]["cached_tokens"], 0, "a cold pod");
    assert_eq!(lines[0]["reusable_tokens"], 0, "nothing seen yet");
    assert!(
        lines[1]["cached_tokens"].as_u64().is_some_and(|c| c >= 64),
        "{text}"
    );
    // On the pod that held the first, the fleet saw no more than the pod held.
    assert_eq!(lines[1]["reusable_tokens"], lines[1]["cached_tokens"]);
    assert_eq!(lines[2]["reusable_tokens"], 0, "another head");
    // The first prompt on pod 0: a miss there, all but its tail reusable fleet-wide.
    assert_eq!(lines[3]["cached_tokens"], 0, "{text}");
    let whole_blocks = (lines[3]["prompt_tokens"].as_u64().expect("tokens") - 1) / 32 * 32;
    assert_eq!(lines[3]["reusable_tokens"], whole_blocks, "{text}");
    assert_eq!(lines[0]["head"], lines[1]["head"], "one shared head");
    assert_ne!(lines[0]["head"], lines[2]["head"], "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_sse_chunks_usage_and_done() {
    let pods = fleet(1, 0).await;
    let requests = fixture_requests();
    // chat-password-stream: 48 tokens, include_usage.
    let (status, text) = call(
        &pods[0],
        "POST",
        "/v1/chat/completions",
        Some(requests[3]["body"].to_string()),
    )
    .await;
    assert_eq!(status, 200);
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data: prefix"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"].get("content").is_some())
        .count();
    assert_eq!(content, 1 + 48);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(
        usage["prompt_tokens"],
        requests[3]["usage"]["prompt_tokens"]
    );
    assert_eq!(usage["completion_tokens"], 48);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );

    // Completions streaming (comp-doc-q2-stream): 16 token chunks + usage = the real 17.
    let (_, text) = call(
        &pods[0],
        "POST",
        "/v1/completions",
        Some(requests[1]["body"].to_string()),
    )
    .await;
    let n = text.split("\n\n").filter(|e| !e.is_empty()).count();
    assert_eq!(
        n - 1,
        requests[1]["sse_chunks"].as_u64().expect("count") as usize
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_gets_vllm_style_errors() {
    let pods = fleet(1, 0).await;
    let pod = &pods[0];
    for (path, body) in [
        ("/v1/completions", "{not json"),
        ("/v1/completions", "[]"),
        ("/v1/completions", r#"{"model":"tiny"}"#),
        ("/v1/completions", r#"{"model":"tiny","prompt":""}"#),
        ("/v1/completions", r#"{"model":"tiny","prompt":[]}"#),
        ("/v1/completions", r#"{"model":"tiny","prompt":[-1]}"#),
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":[99999999999]}"#,
        ),
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":"x","max_tokens":-3}"#,
        ),
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":"x","max_tokens":100000}"#,
        ),
        (
            "/v1/completions",
            r#"{"model":"tiny","prompt":"x","stream":"yes"}"#,
        ),
        ("/v1/completions", r#"{"model":7,"prompt":"x"}"#),
        ("/v1/completions", r#"{"model":"tiny","prompt":{"a":1}}"#),
        ("/v1/chat/completions", r#"{"model":"tiny","messages":[]}"#),
        ("/v1/chat/completions", r#"{"model":"tiny","messages":[1]}"#),
        (
            "/v1/chat/completions",
            r#"{"model":"tiny","messages":[{"content":"x"}]}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"tiny","messages":[{"role":"user","content":"a"},{"role":"system","content":"late"}]}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"tiny","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
        ),
        ("/tokenize", r#"{"prompt":[1,2]}"#),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        ),
    ] {
        let (status, text) = call(pod, "POST", path, Some(body.to_owned())).await;
        assert_eq!(status, 400, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).expect("json error");
        assert_eq!(v["error"]["type"], "BadRequestError", "{text}");
        assert_eq!(v["error"]["code"], 400);
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    let (status, text) = call(
        pod,
        "POST",
        "/v1/completions",
        Some(r#"{"model":"nope","prompt":"x"}"#.into()),
    )
    .await;
    assert_eq!(status, 404, "{text}");
    let (status, _) = call(pod, "GET", "/health", None).await;
    assert_eq!(status, 200);
    let (status, text) = call(pod, "GET", "/v1/models", None).await;
    assert_eq!(status, 200);
    assert!(text.contains("\"id\":\"tiny\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_every_design_name_the_real_engine_carries() {
    let pods = fleet(2, 0).await;
    let (status, ours) = call(&pods[1], "GET", "/metrics", None).await;
    assert_eq!(status, 200);
    let design = [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ];
    let mut carried = 0;
    for file in ["metrics-idle.txt", "metrics-load.txt", "metrics-final.txt"] {
        let real = std::fs::read_to_string(fixtures().join(file)).expect("metrics fixture");
        for name in design {
            let in_real = real.lines().any(|l| l.starts_with(&format!("{name}{{")));
            if in_real {
                carried += 1;
                assert!(
                    ours.lines().any(|l| l.starts_with(&format!("{name}{{"))),
                    "{name} missing"
                );
            }
        }
    }
    assert!(carried >= 3 * 8, "{carried}");
    assert!(ours.contains("block_size=\"32\"") && ours.contains("num_gpu_blocks=\"64\""));

    // Faults: broken and refused.
    let (status, _) = call(
        &pods[1],
        "POST",
        "/admin/faults",
        Some(r#"{"metrics":"error","refuse":true}"#.into()),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(call(&pods[1], "GET", "/metrics", None).await.0, 500);
    let (status, _) = call(
        &pods[1],
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"x"}"#.into()),
    )
    .await;
    assert_eq!(status, 503);
    // Pod 0 is unaffected.
    assert_eq!(call(&pods[0], "GET", "/metrics", None).await.0, 200);
}

/// As vLLM serves them (its routing checked against prometheus_client 0.26 and
/// prometheus-fastapi-instrumentator 8.1): `/metrics` ignores any query and answers the whole
/// page; `/metrics/` answers `?name[]=…` with only the named metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_by_name_answer_only_the_named_ones_behind_the_slash() {
    let pods = fleet(1, 0).await;
    let families = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .map(str::to_owned)
            .collect()
    };
    let query = "?name%5B%5D=vllm%3Anum_requests_waiting&name[]=process_start_time_seconds\
                 &name%5B%5D=vllm%3Aprefix_cache_hits_total&name%5B%5D=vllm%3Ano_such_metric";
    let (status, whole) = call(&pods[0], "GET", &format!("/metrics{query}"), None).await;
    assert_eq!(status, 200);
    assert!(families(&whole).len() > 10, "{whole}");
    let (status, named) = call(&pods[0], "GET", &format!("/metrics/{query}"), None).await;
    assert_eq!(status, 200);
    let mut got = families(&named);
    got.sort();
    assert_eq!(
        got,
        [
            "process_start_time_seconds",
            "vllm:num_requests_waiting",
            "vllm:prefix_cache_hits_total"
        ]
    );
    assert!(
        named.contains("vllm:num_requests_waiting{engine=\"0\""),
        "{named}"
    );
    // Without names, everything.
    let (status, all) = call(&pods[0], "GET", "/metrics/", None).await;
    assert_eq!(status, 200);
    assert_eq!(families(&all), families(&whole));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_get_their_own_cache_and_info_metric() {
    let pods = fleet(1, 2).await;
    let pod = &pods[0];
    let body = |model: &str| json!({"model": model, "prompt": "shared prefix ".repeat(40), "max_tokens": 2});
    let (status, first) = post(pod, "/v1/completions", &body("adapter-a")).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["model"], "adapter-a");
    let (_, again) = post(pod, "/v1/completions", &body("adapter-a")).await;
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    let (_, other) = post(pod, "/v1/completions", &body("adapter-b")).await;
    assert_eq!(
        other["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "LoRA name enters the hash"
    );
    let (_, base) = post(pod, "/v1/completions", &body("tiny")).await;
    assert_eq!(base["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, metrics) = call(pod, "GET", "/metrics", None).await;
    assert!(
        metrics.contains("vllm:lora_requests_info{max_lora=\"2\""),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_faults_drop_events_and_restart_the_pod() {
    let pods = fleet(1, 0).await;
    let pod = &pods[0];
    let publisher = pod.pod.publisher.as_ref().expect("events");
    let mut sub = SubSocket::new();
    sub.connect(publisher.endpoint.as_str())
        .await
        .expect("connect");
    sub.subscribe("").await.expect("subscribe");
    // Probe until the SUB is connected (bounded): each probe is a fresh prompt.
    let mut probe = 0;
    loop {
        probe += 1;
        assert!(probe < 100, "SUB never connected");
        let body = json!({"prompt": format!("probe {probe} ").repeat(20), "max_tokens": 1});
        post(pod, "/v1/completions", &body).await;
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            break;
        }
    }
    // Every batch of the probes was queued before their responses: this is the next seq.
    let next_seq = publisher.next_seq().await.expect("publisher running");

    // Drop every event of one request, then let the next through: the SUB sees a gap.
    let doc = |tag: &str| json!({"prompt": format!("{tag} document ").repeat(30), "max_tokens": 1});
    let (status, _) = post(pod, "/admin/faults", &json!({"drop_fraction": 1.0})).await;
    assert_eq!(status, 200);
    post(pod, "/v1/completions", &doc("missed")).await;
    post(pod, "/admin/faults", &json!({"drop_fraction": 0.0})).await;
    post(pod, "/v1/completions", &doc("seen")).await;
    let seen = loop {
        let f = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("in time")
            .expect("recv")
            .into_vec();
        let s = u64::from_be_bytes(f[1].as_ref().try_into().expect("seq"));
        if s >= next_seq {
            break s;
        }
    };
    assert!(
        seen > next_seq,
        "gap: expected seq {next_seq} to be missing, got {seen}"
    );

    // Replay fills the gap with the dropped batch.
    let first = replay_one(pod, next_seq).await;
    assert_eq!(
        u64::from_be_bytes(first[1].as_ref().try_into().expect("seq")),
        next_seq
    );
    let missed = EventBatch::decode(&first[2]).expect("payload");
    assert!(!missed.events.is_empty());

    // Restart: seq back to 0, cache cleared.
    let (_, again) = post(pod, "/v1/completions", &doc("seen")).await;
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    let (status, _) = post(pod, "/admin/faults", &json!({"restart": true})).await;
    assert_eq!(status, 200);
    let (_, after) = post(pod, "/v1/completions", &doc("seen")).await;
    assert_eq!(after["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let seq = loop {
        let f = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("in time")
            .expect("recv")
            .into_vec();
        let s = u64::from_be_bytes(f[1].as_ref().try_into().expect("seq"));
        if s < seen {
            break s;
        }
    };
    assert_eq!(seq, 0, "seq restarts at 0 after a restart");
}

/// Render answers with the token ids the real engine used for every fixture request, in the
/// shapes of vllm-project/vllm `tests/entrypoints/scale_out/render/test_render.py` (a list of
/// `GenerateRequest`s for completions, one for chat), without running the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_and_detokenize_answer_as_vllm_does() {
    let pods = fleet(1, 0).await;
    let pod = &pods[0];
    let queries = || async {
        let (_, text) = call(pod, "GET", "/metrics", None).await;
        text.lines()
            .find(|l| l.starts_with("vllm:prefix_cache_queries_total"))
            .map(str::to_owned)
    };
    let before = queries().await;
    for r in fixture_requests() {
        let body = &r["body"];
        let chat = body.get("messages").is_some();
        let path = if chat {
            "/v1/chat/completions/render"
        } else {
            "/v1/completions/render"
        };
        let (status, out) = post(pod, path, body).await;
        assert_eq!(status, 200, "{}: {out}", r["label"]);
        let one = if chat {
            assert!(out.is_object(), "chat render is one GenerateRequest: {out}");
            out.clone()
        } else {
            let list = out.as_array().expect("completions render is a list");
            assert_eq!(list.len(), 1);
            list[0].clone()
        };
        assert_eq!(one["token_ids"], r["prompt_token_ids"], "{}", r["label"]);
        let prefix = if chat { "chatcmpl-" } else { "cmpl-" };
        assert!(
            one["request_id"]
                .as_str()
                .is_some_and(|id| id.starts_with(prefix))
        );
        assert_eq!(one["model"], "tiny");
        assert!(
            one["sampling_params"]["max_tokens"]
                .as_u64()
                .is_some_and(|n| n >= 1)
        );
        assert_eq!(one["token_offsets"], Value::Null);
    }
    assert_eq!(queries().await, before, "render never reaches the engine");

    // Several prompts: one GenerateRequest each; sampling and stream fields echoed.
    let (status, out) = post(
        pod,
        "/v1/completions/render",
        &json!({"model": "tiny", "prompt": ["Hello world", "Goodbye world"], "temperature": 0.25,
            "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 7}),
    )
    .await;
    assert_eq!(status, 200, "{out}");
    let list = out.as_array().expect("list");
    assert_eq!(list.len(), 2);
    for (item, text) in list.iter().zip(["Hello world", "Goodbye world"]) {
        let (_, tok) = post(pod, "/tokenize", &json!({"model": "tiny", "prompt": text})).await;
        assert_eq!(item["token_ids"], tok["tokens"]);
        assert_eq!(item["sampling_params"]["temperature"], 0.25);
        assert_eq!(item["sampling_params"]["max_tokens"], 7);
        assert_eq!(item["stream"], true);
        assert_eq!(item["stream_options"]["include_usage"], true);
    }

    // Unknown model: 404 with an error object, as vLLM.
    for (path, body) in [
        (
            "/v1/completions/render",
            json!({"model": "nope", "prompt": "Hello"}),
        ),
        (
            "/v1/chat/completions/render",
            json!({"model": "nope", "messages": [{"role": "user", "content": "Hello"}]}),
        ),
    ] {
        let (status, out) = post(pod, path, &body).await;
        assert_eq!(status, 404, "{path}: {out}");
        assert!(out["error"]["message"].is_string());
    }
    // Hostile bodies: 400, never a panic.
    for (path, body) in [
        ("/v1/completions/render", "[1,2]"),
        ("/v1/completions/render", r#"{"prompt": 5}"#),
        ("/v1/chat/completions/render", r#"{"messages": []}"#),
        ("/detokenize", r#"{"tokens": "abc"}"#),
        ("/detokenize", r#"{"tokens": [-1]}"#),
        ("/detokenize", r#"{"tokens": [4294967296]}"#),
        ("/detokenize", r#"{"tokens": [999999999]}"#),
    ] {
        let (status, text) = call(pod, "POST", path, Some(body.into())).await;
        assert_eq!(status, 400, "{path} {body}: {text}");
    }

    // /detokenize inverts /tokenize.
    let text = "The quick brown fox jumps over the lazy dog.";
    let (_, tok) = post(pod, "/tokenize", &json!({"model": "tiny", "prompt": text})).await;
    let (status, out) = post(
        pod,
        "/detokenize",
        &json!({"model": "tiny", "tokens": tok["tokens"]}),
    )
    .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["prompt"], text);
}
