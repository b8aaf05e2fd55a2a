//! kvpick-bench's load generator against its own backend, over real HTTP.

use kvpick_bench::workload::{ChatWorkload, Workload};
use kvpick_bench::{backend, load};

/// The bench backend on a free loopback port (streamed answers: `chunks` events, `gap` apart).
async fn start_backend(chunks: usize, gap: std::time::Duration) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(backend::serve(listener, chunks, gap));
    addr
}

#[tokio::test]
async fn load_run_counts_every_request_and_orders_percentiles() {
    let addr = start_backend(4, std::time::Duration::ZERO).await;
    let body = load::completion_body("m", 8192);
    assert!(
        (8000..=8300).contains(&body.len()),
        "body of {} bytes",
        body.len()
    );
    let parsed: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON body");
    assert_eq!(parsed["model"], "m");
    let report = load::run(load::LoadPlan {
        url: format!("http://{addr}/v1/completions"),
        pace: load::Pace::Closed(4),
        requests: 120,
        warmup: 10,
        workload: Workload::Fixed(body),
        cpu_pid: None,
    })
    .await
    .expect("run");
    assert_eq!(report.errors, 0);
    assert_eq!(report.latency.count, 120);
    assert!(report.latency.p50_ms <= report.latency.p99_ms);
    assert!(report.latency.p99_ms <= report.latency.max_ms);
    assert!(report.requests_per_second > 0.0);
}

#[tokio::test]
async fn failures_are_counted_not_timed() {
    // Nothing listens on the port of a listener that was just dropped.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let report = load::run(load::LoadPlan {
        url: format!("http://127.0.0.1:{port}/"),
        pace: load::Pace::Closed(2),
        requests: 10,
        warmup: 0,
        workload: Workload::Fixed(load::completion_body("m", 100)),
        cpu_pid: None,
    })
    .await
    .expect("run");
    assert_eq!(report.errors, 10);
    assert_eq!(report.latency.count, 0);
}

#[tokio::test]
async fn open_loop_chat_run_keeps_its_rate_and_reads_the_cpu_of_a_process() {
    let addr = start_backend(4, std::time::Duration::ZERO).await;
    let started = std::time::Instant::now();
    let report = load::run(load::LoadPlan {
        url: format!("http://{addr}/v1/chat/completions"),
        pace: load::Pace::Open(200.0),
        requests: 40,
        warmup: 4,
        workload: Workload::Chat(ChatWorkload::new("m", 8192, 0.95, 3)),
        cpu_pid: Some(std::process::id()),
    })
    .await
    .expect("run");
    assert_eq!(report.errors, 0);
    assert_eq!(report.latency.count, 40);
    // 40 requests at 200/s are spread over at least 195 ms.
    assert!(started.elapsed() >= std::time::Duration::from_millis(195));
    assert!(
        report.requests_per_second < 260.0,
        "{}",
        report.requests_per_second
    );
    assert!(report.cpu_us_per_request.is_some_and(|us| us >= 0.0));
    assert!((8000..8400).contains(&report.body_bytes));
}

#[tokio::test]
async fn a_streamed_request_gets_vllm_shaped_events_with_usage_last() {
    use http_body_util::{BodyExt, Full};
    let addr = start_backend(5, std::time::Duration::from_micros(100)).await;
    let workload = Workload::Streamed(Box::new(Workload::Fixed(load::completion_body("m", 200))));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let request = hyper::Request::post(format!("http://{addr}/v1/completions"))
        .body(Full::new(workload.body(0)))
        .expect("request");
    let response = client.request(request).await.expect("answered");
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let text = std::str::from_utf8(&body).expect("utf-8");
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 5 + 2, "{text}");
    assert!(
        events[..5]
            .iter()
            .all(|e| e.contains("chat.completion.chunk"))
    );
    assert!(events[5].contains(r#""usage":{"prompt_tokens""#));
    assert_eq!(events[6], "data: [DONE]");
    // The same load run with streamed bodies reads every stream to its end.
    let report = load::run(load::LoadPlan {
        url: format!("http://{addr}/v1/completions"),
        pace: load::Pace::Closed(2),
        requests: 20,
        warmup: 2,
        workload,
        cpu_pid: None,
    })
    .await
    .expect("run");
    assert_eq!(report.errors, 0);
    assert_eq!(report.latency.count, 20);
}
