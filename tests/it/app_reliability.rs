//! Reliability of the kvpick process through its real interfaces: SIGTERM under traffic
//! behind a real Envoy, slow uploaders against the body budget, idle ext-proc streams.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::send;
use support::kvpick::Kvpick;

const BODY: &[u8] = br#"{"model":"m","prompt":"hello"}"#;

/// Outcome of one request of the steady traffic: its status (0: transport error).
async fn post(url: &str) -> u16 {
    match send(
        "POST",
        url,
        &[("content-type", "application/json")],
        BODY.to_vec(),
    )
    .await
    {
        Ok(reply) => reply.status,
        Err(error) => {
            eprintln!("request failed: {error}");
            0
        }
    }
}

#[tokio::test]
async fn sigterm_under_steady_traffic_loses_no_request() {
    let a = Backend::start("127.0.0.1").await;
    let grace = Duration::from_secs(3);
    let mut kvpick = Kvpick::start(
        &pool_yaml(&[&a]),
        &["--shutdown-grace-period", "3s", "--drain-timeout", "5s"],
    )
    .await;
    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            fallback: vec![a.addr],
            ..Default::default()
        },
    )
    .await;
    let url = envoy.url("/v1/completions");
    // Until Envoy's health check has seen kvpick SERVING, requests fall open: wait for a
    // routed one so the traffic below really goes through kvpick when SIGTERM comes.
    support::wait_until("routing through kvpick", Duration::from_secs(10), || {
        let (url, a) = (url.clone(), a.clone());
        async move {
            post(&url).await == 200
                && a.seen()
                    .last()
                    .is_some_and(|r| r.headers.contains_key("x-gateway-destination-endpoint"))
        }
    })
    .await;
    let before = a.seen().len();

    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (url, stop) = (url.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    statuses.push(post(&url).await);
                }
                statuses
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let terminated = Instant::now();
    kvpick.terminate();
    let code = kvpick.wait_exit(Duration::from_secs(20)).await;
    let ran = terminated.elapsed();
    // Traffic goes on a little past the exit: the gateway must have let go of kvpick.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut statuses = Vec::new();
    for client in clients {
        statuses.extend(client.await.expect("client task"));
    }

    let mut lost = std::collections::BTreeMap::<u16, usize>::new();
    for status in statuses.iter().filter(|s| !(200..300).contains(*s)) {
        *lost.entry(*status).or_default() += 1;
    }
    let lost_total: usize = lost.values().sum();
    let seen = &a.seen()[before..];
    let routed = seen
        .iter()
        .filter(|r| r.headers.contains_key("x-gateway-destination-endpoint"))
        .count();
    eprintln!(
        "SIGTERM under traffic: {} requests sent, {lost_total} lost (by status: {lost:?}), {routed} routed by kvpick, {} fell open; kvpick exited {code:?} after {ran:?}",
        statuses.len(),
        seen.len() - routed,
    );
    assert!(statuses.len() >= 20, "steady traffic: {}", statuses.len());
    assert_eq!(
        lost_total, 0,
        "requests lost during shutdown, by status: {lost:?}"
    );
    assert_eq!(
        seen.len(),
        statuses.len(),
        "every request reached the backend"
    );
    assert!(routed > 0, "kvpick routed traffic before the shutdown");
    assert_eq!(code, Some(0));
    assert!(
        ran >= grace,
        "kvpick kept accepting for the grace period ({ran:?})"
    );
}

pub(crate) mod raw {
    //! Raw ext-proc gRPC clients against the kvpick binary (no Envoy in between).

    use kvpick::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use kvpick::pb::envoy::service::ext_proc::v3::processing_request::Request;
    use kvpick::pb::envoy::service::ext_proc::v3::processing_response::Response;
    use kvpick::pb::envoy::service::ext_proc::v3::{
        HttpBody, ProcessingRequest, ProcessingResponse,
    };
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::Streaming;
    use tonic::transport::Channel;

    pub struct Stream {
        pub tx: mpsc::Sender<ProcessingRequest>,
        pub rx: Streaming<ProcessingResponse>,
    }

    /// Opens a stream; `Err` when kvpick refuses it.
    pub async fn open(
        client: &mut ExternalProcessorClient<Channel>,
    ) -> Result<Stream, tonic::Status> {
        let (tx, rx) = mpsc::channel(1024);
        let response = client.process(ReceiverStream::new(rx)).await?;
        Ok(Stream {
            tx,
            rx: response.into_inner(),
        })
    }

    impl Stream {
        pub async fn send(&self, request: Request) {
            self.tx
                .send(ProcessingRequest {
                    request: Some(request),
                    ..Default::default()
                })
                .await
                .expect("send");
        }

        pub async fn post_headers(&self) {
            self.send(crate::support::extproc::headers(
                &[(":method", "POST"), ("content-type", "application/json")],
                false,
            ))
            .await;
        }

        pub async fn body(&self, bytes: &[u8], end_of_stream: bool) {
            self.send(Request::RequestBody(HttpBody {
                body: bytes.to_vec().into(),
                end_of_stream,
                ..Default::default()
            }))
            .await;
        }
    }

    /// What a reply means for the request.
    #[derive(Debug, PartialEq, Eq)]
    pub enum Outcome {
        /// Routed: the headers response.
        Routed,
        /// Answered directly with this HTTP status and body.
        Immediate(u32, String),
        /// The gRPC stream ended with this status code (or `Ok` when it just ended).
        Closed(tonic::Code),
    }

    pub fn outcome(reply: Result<Option<ProcessingResponse>, tonic::Status>) -> Outcome {
        match reply {
            Ok(Some(reply)) => match reply.response {
                Some(Response::RequestHeaders(_)) => Outcome::Routed,
                Some(Response::ImmediateResponse(immediate)) => Outcome::Immediate(
                    immediate.status.map(|s| s.code as u32).unwrap_or(0),
                    String::from_utf8_lossy(&immediate.body).into_owned(),
                ),
                other => panic!("unexpected reply {other:?}"),
            },
            Ok(None) => Outcome::Closed(tonic::Code::Ok),
            Err(status) => Outcome::Closed(status.code()),
        }
    }
}

const MIB: usize = 1 << 20;

#[tokio::test]
async fn slow_uploaders_hold_the_budget_yet_normal_requests_are_routed() {
    let a = Backend::start("127.0.0.1").await;
    let body_timeout = Duration::from_secs(3);
    let kvpick = Kvpick::start(
        &pool_yaml(&[&a]),
        &[
            "--max-body-bytes",
            "1048576",
            "--max-buffered-bytes",
            "8388608",
            "--request-body-timeout",
            "3s",
        ],
    )
    .await;
    let mut client = support::extproc::connect(kvpick.grpc_port).await;

    // 16 uploaders send all but the last byte of a 1 MiB body, then stall: together twice
    // the budget.
    let uploaders = 16;
    let mut slow = Vec::new();
    let chunk = vec![b' '; 64 * 1024];
    for _ in 0..uploaders {
        let stream = raw::open(&mut client).await.expect("stream");
        stream.post_headers().await;
        let started = Instant::now();
        let mut sent = 0;
        while sent < MIB - 1 {
            let n = (MIB - 1 - sent).min(chunk.len());
            stream.body(&chunk[..n], false).await;
            sent += n;
        }
        slow.push((stream, started));
    }
    let kv = &kvpick;
    support::wait_until(
        "the uploads to be buffered",
        Duration::from_secs(10),
        || async move {
            kv.metric("kvpick_extproc_buffered_body_bytes").await >= (6 * (MIB - 1)) as f64
        },
    )
    .await;
    let held = kvpick.metric("kvpick_extproc_buffered_body_bytes").await;

    // Meanwhile normal requests come and go.
    let mut latencies = Vec::new();
    for _ in 0..20 {
        let mut stream = raw::open(&mut client).await.expect("stream");
        let started = Instant::now();
        stream.post_headers().await;
        stream.body(BODY, true).await;
        let outcome = raw::outcome(stream.rx.message().await);
        latencies.push(started.elapsed());
        assert_eq!(
            outcome,
            raw::Outcome::Routed,
            "a normal request while uploads stall"
        );
    }
    latencies.sort();

    // The stalled uploads: those past the bulk share were refused at once (503), the rest
    // are answered 408 once the body timeout has passed.
    let mut timed_out = 0;
    let mut refused = 0;
    for (mut stream, started) in slow {
        let reply = tokio::time::timeout(Duration::from_secs(10), stream.rx.message())
            .await
            .expect("every stalled upload is answered");
        match raw::outcome(reply) {
            raw::Outcome::Immediate(408, text) => {
                assert_eq!(text, "inference error: request body not received within 3s");
                let waited = started.elapsed();
                assert!(
                    waited >= body_timeout && waited < body_timeout + Duration::from_secs(3),
                    "408 after {waited:?}"
                );
                timed_out += 1;
            }
            raw::Outcome::Immediate(503, text) => {
                assert!(text.contains("budget"), "{text}");
                refused += 1;
            }
            other => panic!("stalled upload: {other:?}"),
        }
    }
    let after = kvpick.metric("kvpick_extproc_buffered_body_bytes").await;
    eprintln!(
        "slow uploaders: {uploaders} × {} B stalled, {held} B held, {timed_out} answered 408, {refused} refused 503; 20 normal requests routed meanwhile, latency min {:?} p50 {:?} max {:?}; {after} B buffered after",
        MIB - 1,
        latencies[0],
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1],
    );
    assert_eq!(timed_out + refused, uploaders);
    assert!(timed_out >= 6, "the bulk share was held: {timed_out}");
    assert!(
        latencies[latencies.len() - 1] < Duration::from_secs(1),
        "{latencies:?}"
    );
    assert_eq!(after, 0.0, "the budget is returned");
}

#[tokio::test]
async fn idle_streams_are_bounded_and_closed_after_the_headers_timeout() {
    let a = Backend::start("127.0.0.1").await;
    let bound = 40;
    let kvpick = Kvpick::start(
        &pool_yaml(&[&a]),
        &[
            "--max-extproc-streams",
            "40",
            "--request-headers-timeout",
            "1s",
        ],
    )
    .await;
    // Two connections, 30 idle streams each: the bound is across connections.
    let mut accepted = Vec::new();
    let mut refused = 0;
    let opened = Instant::now();
    for _ in 0..2 {
        let mut client = support::extproc::connect(kvpick.grpc_port).await;
        for _ in 0..30 {
            match raw::open(&mut client).await {
                Ok(stream) => accepted.push(stream),
                Err(status) => {
                    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                    refused += 1;
                }
            }
        }
    }
    let open_while_idle = kvpick.metric("kvpick_extproc_open_streams").await;
    let refused_metric = kvpick.metric("kvpick_extproc_refused_streams_total").await;

    let mut closed = 0;
    for stream in &mut accepted {
        let reply = tokio::time::timeout(Duration::from_secs(5), stream.rx.message())
            .await
            .expect("the idle stream is closed");
        assert_eq!(
            raw::outcome(reply),
            raw::Outcome::Closed(tonic::Code::DeadlineExceeded)
        );
        closed += 1;
    }
    let closed_after = opened.elapsed();
    let kv = &kvpick;
    support::wait_until(
        "idle streams to be gone",
        Duration::from_secs(5),
        || async move { kv.metric("kvpick_extproc_open_streams").await == 0.0 },
    )
    .await;
    // The bound is free again: a real request gets through.
    let mut client = support::extproc::connect(kvpick.grpc_port).await;
    let mut stream = raw::open(&mut client).await.expect("a place again");
    stream.post_headers().await;
    stream.body(BODY, true).await;
    assert_eq!(
        raw::outcome(stream.rx.message().await),
        raw::Outcome::Routed
    );

    eprintln!(
        "idle streams: 60 opened, {} held (bound {bound}), {refused} refused; open gauge {open_while_idle}; all {closed} closed after {closed_after:?}",
        accepted.len()
    );
    assert_eq!(accepted.len(), bound);
    assert_eq!(refused, 60 - bound);
    assert_eq!(open_while_idle, bound as f64);
    assert_eq!(refused_metric, (60 - bound) as f64);
    assert!(closed_after < Duration::from_secs(4), "{closed_after:?}");
}

#[tokio::test]
async fn a_slow_upload_through_envoy_gets_408_while_normal_requests_pass() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let a = Backend::start("127.0.0.1").await;
    let kvpick = Kvpick::start(&pool_yaml(&[&a]), &["--request-body-timeout", "1s"]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    support::wait_until("routing through kvpick", Duration::from_secs(10), || {
        let url = url.clone();
        async move { post(&url).await == 200 }
    })
    .await;

    // A client that announces 100 KB and sends 1 KB, then stalls.
    let mut slow = tokio::net::TcpStream::connect(("127.0.0.1", envoy.port))
        .await
        .expect("connect");
    let started = Instant::now();
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"model\":\"m\",\"prompt\":\"",
    )
    .await
    .expect("write");
    slow.write_all(&[b'x'; 1000]).await.expect("write");
    // Normal requests are not held up meanwhile.
    assert_eq!(post(&url).await, 200);
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the reason has arrived (or Envoy closed the connection).
    while !String::from_utf8_lossy(&answer).contains("within 1s") {
        let n = tokio::time::timeout(Duration::from_secs(10), slow.read(&mut buf))
            .await
            .expect("an answer to the stalled upload")
            .expect("read");
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    let waited = started.elapsed();
    let text = String::from_utf8_lossy(&answer);
    eprintln!("slow upload through Envoy answered after {waited:?}: {text:?}");
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("inference error: request body not received within 1s"),
        "{text}"
    );
    assert!(waited >= Duration::from_secs(1) && waited < Duration::from_secs(5));
    assert!(
        a.seen().iter().all(|r| r.body.len() != 100_000),
        "the stalled upload never reached the backend"
    );
}
