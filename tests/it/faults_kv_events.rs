//! Hostile KV-event peers against the real `kvpick` binary, in both modes: kvpick dialing a
//! pod's PUB (connect mode) and pods dialing kvpick (`--kv-events-bind`). A raw ZMTP peer
//! sends what no library would — a frame header declaring 2^50 bytes, MORE frames that never
//! end, more connections than allowed — and then behaves. kvpick must stay up, keep its
//! memory bounded, drop and count the bad connections, and apply the good peer's events.

use crate::support;

use std::time::Duration;

use support::http::send;
use support::kvpick::Kvpick;
use support::zmtp_peer::{RawPub, long_frame_header, memory_of};
use support::{free_port, wait_until};
use tokio::net::TcpListener;

/// Peak RSS kvpick may reach in these tests (it idles at a few tens of MB without
/// tokenizers; one unbounded 16 MiB message per connection would already show).
const PEAK_RSS_LIMIT: u64 = 200 * 1024 * 1024;

/// The payloads of the real vLLM capture, in seq order.
fn capture() -> Vec<Vec<u8>> {
    let dir = support::fixtures().join("vllm-0.32-kv-events");
    (0..)
        .map_while(|i| std::fs::read(dir.join(format!("{i:04}.msgpack"))).ok())
        .collect()
}

/// Whether the whole capture (seqs 0..=67, 62 blocks) has been applied.
async fn capture_applied(kvpick: &Kvpick) -> bool {
    let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .expect("/debug/pods")
        .json();
    let pod = &pods["pods"][0];
    pod["index_blocks"] == 62 && pod["kv_events"]["last_seq"] == 67
}

/// Publishes the whole capture under `topic` and waits until kvpick has applied it.
async fn publish_capture(publisher: &mut RawPub, topic: &str, kvpick: &Kvpick) {
    for (seq, payload) in capture().iter().enumerate() {
        publisher
            .send_batch(topic.as_bytes(), seq as u64, payload)
            .await;
    }
    wait_until("the capture applied", Duration::from_secs(10), || async {
        capture_applied(kvpick).await
    })
    .await;
}

async fn index_blocks(kvpick: &Kvpick) -> u64 {
    let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
        .await
        .expect("/debug/pods")
        .json();
    pods["pods"][0]["index_blocks"].as_u64().unwrap_or(0)
}

/// Sends 1 MiB frames with MORE set until kvpick hangs up; returns the bytes written.
async fn endless_more_frames(publisher: &mut RawPub) -> usize {
    let body = vec![0u8; 1024 * 1024];
    let mut sent = 0;
    for _ in 0..64 {
        if publisher
            .send_raw(&long_frame_header(body.len() as u64, true))
            .await
            .is_err()
            || publisher.send_raw(&body).await.is_err()
        {
            break;
        }
        sent += body.len();
    }
    sent
}

fn assert_alive_and_bounded(kvpick: &mut Kvpick) {
    assert!(
        kvpick.child.try_wait().expect("try_wait").is_none(),
        "kvpick died"
    );
    let (peak, _) = memory_of(kvpick.child.id());
    eprintln!("kvpick peak RSS {} MB", peak / (1024 * 1024));
    assert!(
        peak < PEAK_RSS_LIMIT,
        "kvpick peak RSS {} MB",
        peak / (1024 * 1024)
    );
}

fn counted(metrics: &str, name: &str, reason: &str) -> bool {
    metrics.lines().any(|line| {
        line.starts_with(name)
            && line.contains(&format!("reason=\"{reason}\""))
            && line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v >= 1.0)
    })
}

/// kvpick with one pod (nothing listens at its address) whose KV-event publisher is the
/// returned listener, which kvpick dials (connect mode); and the pod's address.
async fn kvpick_subscribing() -> (TcpListener, String, Kvpick) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let events = listener.local_addr().unwrap();
    let pod = format!("127.0.0.1:{}", free_port());
    let pool = format!("endpoints:\n  - address: {pod}\n    kvEvents: tcp://{events}\n");
    let kvpick = Kvpick::start(&pool, &[]).await;
    (listener, pod, kvpick)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_pod_publisher_cannot_crash_or_bloat_kvpick() {
    let (listener, pod, mut kvpick) = kvpick_subscribing().await;

    // One header declaring 2^50 bytes: the connection is dropped before anything is reserved.
    let mut publisher = RawPub::accept(&listener, Duration::from_secs(10)).await;
    publisher
        .send_raw(&long_frame_header(1 << 50, false))
        .await
        .unwrap();
    assert!(publisher.closed_within(Duration::from_secs(5)).await);
    assert_alive_and_bounded(&mut kvpick);

    // MORE frames that never end: dropped at the message bound (16 MiB / 16 frames).
    let mut publisher = RawPub::accept(&listener, Duration::from_secs(5)).await;
    let sent = endless_more_frames(&mut publisher).await;
    assert!(publisher.closed_within(Duration::from_secs(5)).await);
    assert!(
        sent < 48 * 1024 * 1024,
        "kvpick read {sent} bytes of one message"
    );
    assert_alive_and_bounded(&mut kvpick);

    // The same pod then behaves: reconnected within the capped backoff, events applied.
    let mut publisher = RawPub::accept(&listener, Duration::from_secs(3)).await;
    let topic = format!("kv@{pod}@tiny");
    publish_capture(&mut publisher, &topic, &kvpick).await;
    let metrics = kvpick.metrics_text().await;
    for reason in ["message_too_large", "too_many_frames"] {
        assert!(
            counted(&metrics, "kvpick_kv_events_connection_errors_total", reason),
            "{reason} not counted:\n{metrics}"
        );
    }
    assert_alive_and_bounded(&mut kvpick);
}

/// A msgpack string of up to 31 bytes.
fn fixstr(text: &str) -> Vec<u8> {
    let mut out = vec![0xa0 | text.len() as u8];
    out.extend(text.as_bytes());
    out
}

/// `[1, [event], 0]` (rank 0, the capture's) where `event` is a map of `pairs` key–field
/// pairs: `head` first (already encoded), then `fill` (one-byte values) to make up the count.
fn one_event_batch(pairs: u32, head: &[u8], fill: &[u8]) -> Vec<u8> {
    let mut out = vec![0x93, 0x01, 0x91, 0xdf];
    out.extend(pairs.to_be_bytes());
    out.extend(head);
    out.extend(fill);
    out.push(0x00);
    out
}

/// Well-framed payloads of 15 MiB built of one-byte elements that no decoded event keeps;
/// read into msgpack values (32 bytes each, a map pair 64) they grew ~30×, ~500 MB. Each
/// with whether it decodes (the others are malformed batches, counted and skipped).
fn amplifying_payloads() -> Vec<(&'static str, Vec<u8>, bool)> {
    const ELEMENTS: u32 = 15 << 20;
    let nils = |n: u32| {
        let mut out = vec![0xdd];
        out.extend(n.to_be_bytes());
        out.resize(out.len() + n as usize, 0xc0);
        out
    };
    let removal_head = [
        fixstr("type"),
        fixstr("BlockRemoved"),
        fixstr("block_hashes"),
        vec![0x91, 0x05],
    ]
    .concat();
    // A removal whose map is followed by pairs of one-byte keys and fields.
    let pairs = ELEMENTS / 2;
    let fill = vec![0x01; 2 * (pairs as usize - 2)];
    let many_pairs = one_event_batch(pairs, &removal_head, &fill);
    // An events array of nils.
    let mut nil_events = vec![0x93, 0x01];
    nil_events.extend(nils(ELEMENTS));
    nil_events.push(0x00);
    // A removal with a field no version knows, an array of nils.
    let unknown_field = one_event_batch(
        3,
        &[removal_head.clone(), fixstr("future_field"), nils(ELEMENTS)].concat(),
        &[],
    );
    // A store of one block whose extra keys are nils.
    let store_head = [
        fixstr("type"),
        fixstr("BlockStored"),
        fixstr("block_hashes"),
        vec![0x91, 0x05],
        fixstr("extra_keys"),
        nils(ELEMENTS),
    ]
    .concat();
    let long_extra = one_event_batch(3, &store_head, &[]);
    vec![
        ("one event of 7.5 M pairs", many_pairs, true),
        ("15 M events that are nil", nil_events, false),
        ("an unknown field of 15 M nils", unknown_field, true),
        ("extra keys of 15 M nils for one block", long_extra, false),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_that_grew_as_they_were_read_keep_kvpick_bounded() {
    let (listener, pod, mut kvpick) = kvpick_subscribing().await;
    let mut publisher = RawPub::accept(&listener, Duration::from_secs(10)).await;
    let topic = format!("kv@{pod}@tiny");
    publish_capture(&mut publisher, &topic, &kvpick).await;

    let payloads = amplifying_payloads();
    let malformed = payloads.iter().filter(|(_, _, decodes)| !decodes).count() as u64;
    for (i, (shape, payload, _)) in payloads.iter().enumerate() {
        assert!(payload.len() < 16 << 20, "{shape}: {} bytes", payload.len());
        publisher
            .send_batch(topic.as_bytes(), 68 + i as u64, payload)
            .await;
    }
    let last = 67 + payloads.len() as u64;
    wait_until("the payloads handled", Duration::from_secs(30), || async {
        let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
            .await
            .expect("/debug/pods")
            .json();
        let stream = &pods["pods"][0]["kv_events"];
        stream["last_seq"] == last && stream["malformed"] == malformed
    })
    .await;
    assert_alive_and_bounded(&mut kvpick);
    // The stream is still in order and applied: the capture's blocks are all there (the
    // removals named a hash the pod never stored).
    assert_eq!(index_blocks(&kvpick).await, 62);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peers_dialing_the_bind_socket_are_bounded() {
    let bind = format!("127.0.0.1:{}", free_port());
    let pod = format!("127.0.0.1:{}", free_port());
    let pool = format!("endpoints:\n  - address: {pod}\n");
    let bind_flag = format!("tcp://{bind}");
    let mut kvpick = Kvpick::start(
        &pool,
        &["--kv-events-bind", &bind_flag, "--kv-events-max-peers", "3"],
    )
    .await;

    let mut hostile = RawPub::connect(&bind).await;
    hostile
        .send_raw(&long_frame_header(1 << 50, true))
        .await
        .unwrap();
    assert!(hostile.closed_within(Duration::from_secs(5)).await);

    let mut hostile = RawPub::connect(&bind).await;
    let sent = endless_more_frames(&mut hostile).await;
    assert!(hostile.closed_within(Duration::from_secs(5)).await);
    assert!(
        sent < 48 * 1024 * 1024,
        "kvpick read {sent} bytes of one message"
    );
    assert_alive_and_bounded(&mut kvpick);

    // Three idle peers fill the connection limit; a fourth is closed at once.
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(RawPub::connect(&bind).await);
    }
    let mut refused = RawPub::try_connect(&bind).await.expect("tcp connect");
    assert!(refused.closed_within(Duration::from_secs(5)).await);
    drop(idle);

    // A real pod dialing in (its topic names it) is heard once the idle peers are gone.
    let topic = format!("kv@{pod}@tiny");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut publisher = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no connection slot freed"
        );
        let mut publisher = RawPub::try_connect(&bind).await.expect("connect");
        // Refused peers are closed before kvpick's greeting; accepted ones get it.
        let mut greeting = [0u8; 64];
        let accepted = tokio::time::timeout(
            Duration::from_millis(500),
            tokio::io::AsyncReadExt::read_exact(&mut publisher.stream, &mut greeting),
        )
        .await
        .is_ok_and(|read| read.is_ok());
        if accepted {
            break publisher;
        }
    };
    publish_capture(&mut publisher, &topic, &kvpick).await;
    let metrics = kvpick.metrics_text().await;
    for reason in ["message_too_large", "too_many_frames", "too_many_peers"] {
        assert!(
            counted(&metrics, "kvpick_kv_events_rejected_total", reason),
            "{reason} not counted:\n{metrics}"
        );
    }
    assert_alive_and_bounded(&mut kvpick);

    // The pod's connection ends: it counts as disconnected (the liveness rule reads this).
    drop(publisher);
    wait_until("the pod disconnected", Duration::from_secs(5), || async {
        let pods = send("GET", &kvpick.debug_url("/debug/pods"), &[], Vec::new())
            .await
            .expect("/debug/pods")
            .json();
        pods["pods"][0]["kv_events"]["connected"] == false
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_stalling_mid_message_is_dropped_but_an_idle_one_is_not() {
    use kvpick::kvevents::transport::{Connection, Role, TransportConfig, TransportError};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let config = TransportConfig {
        message_timeout: Duration::from_millis(300),
        ..TransportConfig::default()
    };
    let (connection, publisher) = tokio::join!(
        Connection::connect(&endpoint, Role::Sub, config),
        RawPub::accept(&listener, Duration::from_secs(5)),
    );
    let (mut connection, mut publisher) = (connection.expect("handshake"), publisher);

    // Idle for three message timeouts: nothing has started, nothing times out.
    let idle = tokio::time::timeout(Duration::from_millis(900), connection.recv()).await;
    assert!(
        idle.is_err(),
        "an idle connection must not time out: {idle:?}"
    );

    // Half a frame, then silence: dropped once the message timeout passes.
    publisher
        .send_raw(&long_frame_header(1000, false))
        .await
        .unwrap();
    publisher.send_raw(&[0u8; 400]).await.unwrap();
    let started = std::time::Instant::now();
    let stalled = tokio::time::timeout(Duration::from_secs(5), connection.recv())
        .await
        .expect("recv returns");
    assert!(
        matches!(stalled, Err(TransportError::MessageTimeout)),
        "{stalled:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// A pod's `/metrics` whose `process_start_time_seconds` the test sets (an engine restart
/// changes it). Runs until dropped.
struct FakeEngineMetrics {
    addr: std::net::SocketAddr,
    start_time: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeEngineMetrics {
    async fn start() -> Self {
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let start_time = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(1_795_967_548));
        let served = start_time.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let served = served.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |_req| {
                        let text = format!(
                            "vllm:num_requests_waiting{{model_name=\"tiny\"}} 0.0\n\
                             vllm:num_requests_running{{model_name=\"tiny\"}} 0.0\n\
                             vllm:kv_cache_usage_perc{{model_name=\"tiny\"}} 0.0\n\
                             process_start_time_seconds {}.5\n",
                            served.load(Ordering::Relaxed)
                        );
                        async move {
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(
                                http_body_util::Full::new(bytes::Bytes::from(text)),
                            ))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            start_time,
            task,
        }
    }

    fn restart(&self) {
        self.start_time
            .fetch_add(120, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for FakeEngineMetrics {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_cleared_at_once_and_resubscribed_within_the_backoff_cap() {
    let engine = FakeEngineMetrics::start().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let events = listener.local_addr().unwrap();
    let pod = engine.addr;
    let pool = format!("endpoints:\n  - address: {pod}\n    kvEvents: tcp://{events}\n");
    let kvpick = Kvpick::start(&pool, &[]).await;
    let mut publisher = RawPub::accept(&listener, Duration::from_secs(10)).await;
    let topic = format!("kv@{pod}@tiny");
    publish_capture(&mut publisher, &topic, &kvpick).await;

    // The engine restarts: its /metrics shows a new process start time while its event
    // stream has said nothing yet. Its entries go at once (within a few scrapes).
    engine.restart();
    wait_until(
        "entries cleared on restart",
        Duration::from_secs(3),
        || async { index_blocks(&kvpick).await == 0 },
    )
    .await;

    // Its KV-event port is gone for 4 s (a slow restart), then listens again: kvpick is
    // back within the 1 s backoff cap, not tens of seconds later.
    drop(publisher);
    drop(listener);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let listener = TcpListener::bind(events).await.unwrap();
    let back = std::time::Instant::now();
    let mut publisher = RawPub::accept(&listener, Duration::from_secs(5)).await;
    let waited = back.elapsed();
    assert!(
        waited < Duration::from_millis(2500),
        "resubscribed after {waited:?}"
    );
    publisher
        .send_batch(topic.as_bytes(), 0, &capture()[0])
        .await;
    wait_until(
        "the new life's first batch",
        Duration::from_secs(5),
        || async { index_blocks(&kvpick).await > 0 },
    )
    .await;
}
