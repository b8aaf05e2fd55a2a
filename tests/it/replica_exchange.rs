//! Active-active replicas through the real binary: two kvpick replicas with static peers
//! (`--replica-peers`), pods without KV-event sources (so nothing but the exchange can tell
//! one replica what the other routed), requests sent straight to each replica's ext-proc
//! port. Also: in-flight counts cross over, and a hostile peer is bounded and counted; and
//! the Kubernetes shape, against the fake API: replicas that find each other by
//! `--peer-selector` and their model servers by `--pool-name`.

use std::time::{Duration, Instant};

use kvpick::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kvpick::pb::envoy::service::ext_proc::v3::processing_request::Request;
use kvpick::pb::envoy::service::ext_proc::v3::processing_response::Response;
use kvpick::pb::envoy::service::ext_proc::v3::{HttpBody, ProcessingRequest, ProcessingResponse};
use kvpick::replica::proto::replica_exchange_client::ReplicaExchangeClient;
use kvpick::replica::proto::{Batch, EndpointLoad, RoutingRecord};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::support;
use support::backend::{Backend, pool_yaml};
use support::http::{post_json, send};
use support::kvpick::Kvpick;

/// The sum of a metric's samples over all its label sets.
async fn metric_sum(kvpick: &Kvpick, name: &str) -> f64 {
    kvpick
        .metrics_text()
        .await
        .lines()
        .filter(|line| line.starts_with(name) && !line.starts_with('#'))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A port for a replica's exchange, outside the OS's ephemeral range that `free_port` (and so
/// every other port of the tests' processes) comes from. NOTE: kvpick is told this port up
/// front and `Kvpick::start` retries with fresh ports but not this one: a port from the
/// ephemeral range could be handed to another replica's gRPC or metrics port meanwhile (seen:
/// "kvpick did not start in 4 attempts").
pub(crate) fn exchange_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(7919);
    loop {
        let n = seed.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % 8000;
        let port = 12000 + u16::try_from(n).expect("below 8000");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// An open ext-proc stream whose request was routed: dropping it ends the request.
struct Routed {
    endpoint: String,
    _tx: mpsc::Sender<ProcessingRequest>,
    _rx: tonic::Streaming<ProcessingResponse>,
}

/// Sends one completion request for `prompt` and returns the endpoint kvpick picked (the
/// first of the destination list; the others are fallbacks).
async fn route(client: &mut ExternalProcessorClient<Channel>, prompt: &str) -> Routed {
    let (tx, rx) = mpsc::channel(8);
    let mut replies = client
        .process(ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4}).to_string();
    for request in [
        support::extproc::headers(
            &[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("content-type", "application/json"),
            ],
            false,
        ),
        Request::RequestBody(HttpBody {
            body: body.into_bytes().into(),
            end_of_stream: true,
            ..Default::default()
        }),
    ] {
        tx.send(ProcessingRequest {
            request: Some(request),
            ..Default::default()
        })
        .await
        .expect("send");
    }
    let reply = replies.message().await.expect("reply").expect("a reply");
    let Some(Response::RequestHeaders(headers)) = reply.response else {
        panic!("not routed: {reply:?}");
    };
    let endpoint = headers
        .response
        .and_then(|r| r.header_mutation)
        .and_then(|m| {
            m.set_headers.into_iter().find_map(|option| {
                let header = option.header?;
                (header.key == "x-gateway-destination-endpoint").then(|| {
                    if header.raw_value.is_empty() {
                        header.value
                    } else {
                        String::from_utf8_lossy(&header.raw_value).into_owned()
                    }
                })
            })
        })
        .expect("a destination header");
    let endpoint = endpoint.split(',').next().unwrap_or_default().to_owned();
    Routed {
        endpoint,
        _tx: tx,
        _rx: replies,
    }
}

/// A prompt of a few hundred tokens, distinct from the first word on.
fn prompt(i: usize) -> String {
    format!("Case {i}. ")
        + &format!("Summarise invoice {i} for the customer in one line. ").repeat(30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_made_by_one_replica_steers_the_other_and_in_flight_counts_cross_over() {
    let backends = [
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    ];
    let pool = pool_yaml(&backends.iter().collect::<Vec<_>>());
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_str().expect("path");
    let (port_a, port_b) = (exchange_port(), exchange_port());
    let replica = |own: u16, peer: u16| {
        [
            "--tokenizer".to_owned(),
            tokenizer.to_owned(),
            "--replica-exchange-port".to_owned(),
            own.to_string(),
            "--replica-peers".to_owned(),
            format!("127.0.0.1:{peer}"),
        ]
    };
    let (args_a, args_b) = (replica(port_a, port_b), replica(port_b, port_a));
    let args_a: Vec<&str> = args_a.iter().map(String::as_str).collect();
    let args_b: Vec<&str> = args_b.iter().map(String::as_str).collect();
    let (a, b) = tokio::join!(Kvpick::start(&pool, &args_a), Kvpick::start(&pool, &args_b));
    for kvpick in [&a, &b] {
        support::wait_until("the peers to connect", Duration::from_secs(10), || async {
            kvpick.metric("kvpick_replica_peers_connected").await == 1.0
        })
        .await;
    }
    // Active-active: without leader election every replica takes traffic as a leader.
    assert_eq!(a.metric("kvpick_leader").await, 1.0);
    let (mut client_a, mut client_b) = (
        support::extproc::connect(a.grpc_port).await,
        support::extproc::connect(b.grpc_port).await,
    );

    // Each new prefix routed by A; B, which has no event and did not route it, follows.
    let mut picked = std::collections::BTreeSet::new();
    for i in 0..6 {
        let first = route(&mut client_a, &prompt(i)).await.endpoint;
        picked.insert(first.clone());
        // Eventually consistent within the batch interval (10 ms): wait for the record.
        let want = (i + 1) as f64;
        support::wait_until(
            "B to receive A's record",
            Duration::from_secs(5),
            || async {
                b.metric("kvpick_replica_records_total{direction=\"received\"}")
                    .await
                    >= want
            },
        )
        .await;
        let second = route(&mut client_b, &prompt(i)).await.endpoint;
        assert_eq!(second, first, "prefix {i}: B follows A's route");
    }
    assert!(
        picked.len() >= 2,
        "new prefixes spread over the idle pods ({picked:?}), so following A is no accident"
    );

    // A request in flight on A counts on B (as the foreign term of its load).
    let held = route(&mut client_a, "a request held open").await;
    let gauge = format!(
        "kvpick_endpoint_in_flight_requests{{endpoint=\"{}\"}}",
        held.endpoint
    );
    support::wait_until("B to count A's request", Duration::from_secs(5), || async {
        b.metric(&gauge).await == 1.0
    })
    .await;
    drop(held);
    support::wait_until("B to see it end", Duration::from_secs(5), || async {
        b.metric(&gauge).await == 0.0
    })
    .await;

    // What A sent is what B received, counted in encoded bytes (B hears from A only).
    support::wait_until(
        "bytes sent = bytes received",
        Duration::from_secs(5),
        || async {
            let sent = a
                .metric("kvpick_replica_bytes_total{direction=\"sent\"}")
                .await;
            let got = b
                .metric("kvpick_replica_bytes_total{direction=\"received\"}")
                .await;
            sent > 6.0 * 16.0 && sent == got
        },
    )
    .await;

    // A hostile peer: more records than a batch may carry, bad and unknown endpoints, a
    // wrong block size, counts for endpoints not in the pool. All bounded and counted.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port_b}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to B's exchange");
    let mut hostile = ReplicaExchangeClient::new(channel);
    let good = backends[0].addr.to_string();
    let mut records: Vec<RoutingRecord> = (0..1500)
        .map(|i| RoutingRecord {
            endpoint: good.clone(),
            block_size: 16,
            block_keys: vec![i; 4],
        })
        .collect();
    records[0].endpoint = "not an address".into();
    records[1].endpoint = "10.9.9.9:8000".into();
    records[2].block_size = 7;
    let batch = Batch {
        replica: "x".repeat(10_000),
        records,
        in_flight: vec![
            EndpointLoad {
                endpoint: "10.9.9.9:8000".into(),
                in_flight: u64::MAX,
            },
            EndpointLoad {
                endpoint: good.clone(),
                in_flight: 5,
            },
        ],
    };
    let summary = hostile
        .exchange(tokio_stream::iter([batch]))
        .await
        .expect("B answers a hostile stream")
        .into_inner();
    assert_eq!(summary.records, 1024 - 3, "bounded to one batch's records");
    for (reason, count) in [
        ("oversized", 1500.0 - 1024.0),
        ("bad_endpoint", 1.0),
        ("unknown_endpoint", 1.0),
        ("block_size", 1.0),
    ] {
        let series = format!("kvpick_replica_dropped_records_total{{reason=\"{reason}\"}}");
        assert_eq!(b.metric(&series).await, count, "{series}");
    }
    let good_gauge = format!("kvpick_endpoint_in_flight_requests{{endpoint=\"{good}\"}}");
    assert_eq!(b.metric(&good_gauge).await, 5.0, "known endpoint counted");
    // B still routes.
    let after = route(&mut client_b, &prompt(0)).await;
    assert!(!after.endpoint.is_empty());
}

/// A pod of kvpick's own Deployment in the fake API: its IP and its exchange port declared
/// as the chart does (a container port named `replica`).
fn replica_pod(name: &str, port: u16, ready: bool) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                     "labels": {"app": "kvpick-epp"}},
        "spec": {"containers": [{"name": "epp", "image": "kvpick",
                                 "ports": [{"name": "replica", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
    })
}

/// Waits until `kvpick` has received more routing records than `before`.
async fn arrived(kvpick: &Kvpick, before: f64) {
    let received = "kvpick_replica_records_total{direction=\"received\"}";
    support::wait_until("the record to arrive", Duration::from_secs(5), || async {
        kvpick.metric(received).await > before
    })
    .await;
}

/// Routes a new prefix by `from` and checks that `to`, which has no KV event and did not
/// route it, picks the same pod once `from`'s record has arrived; then waits for `to`'s own
/// record of it to reach `from`, so that the next call counts only its own records.
async fn steers(
    from: (&Kvpick, &mut ExternalProcessorClient<Channel>),
    to: (&Kvpick, &mut ExternalProcessorClient<Channel>),
    i: usize,
) {
    let received = "kvpick_replica_records_total{direction=\"received\"}";
    let (before_from, before_to) = (from.0.metric(received).await, to.0.metric(received).await);
    let first = route(from.1, &prompt(i)).await.endpoint;
    arrived(to.0, before_to).await;
    let second = route(to.1, &prompt(i)).await.endpoint;
    assert_eq!(second, first, "prefix {i}: the peer follows the route");
    arrived(from.0, before_from).await;
}

/// Waits until `kvpick` knows `want` peers and has an open stream to each.
async fn peers(kvpick: &Kvpick, want: f64) {
    for series in ["kvpick_replica_peers", "kvpick_replica_peers_connected"] {
        let what = format!("{series} = {want}");
        support::wait_until(&what, Duration::from_secs(10), || async {
            kvpick.metric(series).await == want
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_from_the_api_exchange_and_follow_the_pods_of_the_deployment() {
    use crate::fake_kube::{FakeKube, pool_resource};
    let fake = FakeKube::start().await;
    let kubeconfig = fake.kubeconfig("default");
    let backends = [
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    ];
    // The model servers come from the API too: an InferencePool whose one pod serves three
    // data-parallel ranks (one target port each), as a Deployment of kvpick replicas would
    // find them.
    let mut pool_endpoints: Vec<String> = backends.iter().map(|b| b.addr.to_string()).collect();
    pool_endpoints.sort();
    let target_ports: Vec<serde_json::Value> = backends
        .iter()
        .map(|b| serde_json::json!({"number": b.addr.port()}))
        .collect();
    fake.apply(
        &pool_resource(crate::k8s_discovery::V1),
        serde_json::json!({
            "apiVersion": format!("{}/v1", crate::k8s_discovery::V1), "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": "default", "uid": "pool-uid"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": target_ports,
                     "endpointPickerRef": {"name": "kvpick", "port": {"number": 9002}}}
        }),
    );
    fake.apply(
        "pods",
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "vllm-0", "namespace": "default", "uid": "uid-vllm-0",
                         "labels": {"app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }),
    );
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_str().expect("path");
    // Every replica on 127.0.0.1 (kvpick's servers all bind --bind-address), each on its own
    // exchange port, which its pod declares: the peers' addresses come from the pods only.
    let ports = [exchange_port(), exchange_port(), exchange_port()];
    let start = |name: &'static str, port: u16| {
        let kubeconfig = kubeconfig.clone();
        async move {
            let port = port.to_string();
            Kvpick::start_kube_env(
                &kubeconfig,
                &["--pool-name", "pool", "--pool-namespace", "default"],
                &[
                    "--tokenizer",
                    tokenizer,
                    "--replica-exchange-port",
                    &port,
                    "--peer-selector",
                    "app=kvpick-epp",
                ],
                &[("POD_NAME", name)],
            )
            .await
        }
    };
    let pods = "pods";
    fake.apply(pods, replica_pod("kvpick-a", ports[0], true));
    fake.apply(pods, replica_pod("kvpick-b", ports[1], true));
    // C, the replica of a later scale-up, starts now to save time; its pod comes later.
    let (a, b, c) = tokio::join!(
        start("kvpick-a", ports[0]),
        start("kvpick-b", ports[1]),
        start("kvpick-c", ports[2])
    );
    // Each finds the pool's endpoints, and the other replica (not itself), through the API.
    let want: Vec<&str> = pool_endpoints.iter().map(String::as_str).collect();
    for (kvpick, name) in [(&a, "A"), (&b, "B"), (&c, "C")] {
        crate::k8s_discovery::wait_endpoints(kvpick, &want, name).await;
    }
    peers(&a, 1.0).await;
    peers(&b, 1.0).await;
    let (mut client_a, mut client_b) = (
        support::extproc::connect(a.grpc_port).await,
        support::extproc::connect(b.grpc_port).await,
    );
    for i in 0..2 {
        steers((&a, &mut client_a), (&b, &mut client_b), i).await;
        steers((&b, &mut client_b), (&a, &mut client_a), 100 + i).await;
    }

    // B's pod turns unready: A drops it at once; ready again, A takes it back; deleted, A
    // drops it for good.
    fake.apply(pods, replica_pod("kvpick-b", ports[1], false));
    peers(&a, 0.0).await;
    fake.apply(pods, replica_pod("kvpick-b", ports[1], true));
    peers(&a, 1.0).await;
    fake.delete(pods, "default", "kvpick-b");
    peers(&a, 0.0).await;
    let sent = "kvpick_replica_records_total{direction=\"sent\"}";
    let sent_before = a.metric(sent).await;
    let alone = "kvpick_replica_dropped_records_total{reason=\"no_peer\"}";
    let alone_before = a.metric(alone).await;
    route(&mut client_a, &prompt(200)).await;
    // The record leaves A's batcher within a batch interval; C's pod comes only after, or a
    // quick enough watch event would hand it to C as a peer's.
    support::wait_until(
        "A drops the record made alone",
        Duration::from_secs(10),
        || async { a.metric(alone).await == alone_before + 1.0 },
    )
    .await;
    drop(b);

    // A new replica (a scale-up) is picked up by its pod and steered by A's routes.
    fake.apply(pods, replica_pod("kvpick-c", ports[2], true));
    peers(&a, 1.0).await;
    peers(&c, 1.0).await;
    let mut client_c = support::extproc::connect(c.grpc_port).await;
    for i in 300..302 {
        steers((&a, &mut client_a), (&c, &mut client_c), i).await;
    }
    assert_eq!(
        a.metric(sent).await,
        sent_before + 2.0,
        "the record made while A had no peer went nowhere; the 2 later ones went to C"
    );
}

/// One answer seen by a load client: when the request started and ended, its status, and
/// whether kvpick picked its destination (else Envoy failed open to the fallback cluster).
#[derive(Debug, Clone, Copy)]
struct Answer {
    start: Instant,
    end: Instant,
    status: u16,
    picked: bool,
}

/// Sends `body` to `url` in a loop until `stop`, returning every answer.
async fn load(
    url: String,
    body: Vec<u8>,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<Answer> {
    let mut seen = Vec::new();
    while !stop.is_cancelled() {
        let start = Instant::now();
        let (status, picked) = send(
            "POST",
            &url,
            &[("content-type", "application/json")],
            body.clone(),
        )
        .await
        .map(|r| {
            let picked = r
                .header(support::envoy::METADATA_ECHO_HEADER)
                .is_some_and(|h| !h.is_empty() && h != "-");
            (r.status, picked)
        })
        .unwrap_or((0, false));
        seen.push(Answer {
            start,
            end: Instant::now(),
            status,
            picked,
        });
    }
    seen
}

/// Two replicas (A with `extra_a`) exchanging with each other behind one real Envoy whose
/// ext_proc cluster holds both, the FailOpen fallback listing the two backends; returns once
/// both replicas have taken streams.
async fn two_replicas_behind_envoy(
    backends: &[Backend; 2],
    extra_a: &[&str],
) -> (Kvpick, Kvpick, support::envoy::Envoy) {
    use support::envoy::{Envoy, EnvoyOptions};
    let pool = pool_yaml(&backends.iter().collect::<Vec<_>>());
    let (port_a, port_b) = (exchange_port(), exchange_port());
    // Envoy speaks TLS to both replicas' ext-proc ports, as a production gateway should.
    let replica = |own: u16, peer: u16| {
        [
            "--replica-exchange-port".to_owned(),
            own.to_string(),
            "--replica-peers".to_owned(),
            format!("127.0.0.1:{peer}"),
            "--secure-serving".to_owned(),
        ]
    };
    let (mut args_a, args_b) = (replica(port_a, port_b).to_vec(), replica(port_b, port_a));
    args_a.extend(extra_a.iter().map(|s| (*s).to_owned()));
    let args_a: Vec<&str> = args_a.iter().map(String::as_str).collect();
    let args_b: Vec<&str> = args_b.iter().map(String::as_str).collect();
    let (a, b) = tokio::join!(Kvpick::start(&pool, &args_a), Kvpick::start(&pool, &args_b));
    let envoy = Envoy::start(
        &a,
        EnvoyOptions {
            extra_kvpicks: vec![(b.grpc_port, b.health_port)],
            fallback: backends.iter().map(|b| b.addr).collect(),
            echo_metadata: true,
            kvpick_tls: true,
            ..Default::default()
        },
    )
    .await;
    let url = envoy.url("/v1/completions");
    let body = completion_body();
    // Both replicas take streams before the fault.
    let streams = "inference_objective_request_total{";
    support::wait_until("both replicas to route", Duration::from_secs(10), || {
        let (url, body, a, b) = (&url, &body, &a, &b);
        async move {
            let reply = send(
                "POST",
                url,
                &[("content-type", "application/json")],
                body.clone(),
            )
            .await;
            assert_eq!(reply.map(|r| r.status).ok(), Some(200));
            metric_sum(a, streams).await > 0.0 && metric_sum(b, streams).await > 0.0
        }
    })
    .await;
    let tls = "kvpick_tls_handshakes_total{result=\"ok\"}";
    assert!(
        a.metric(tls).await >= 1.0 && b.metric(tls).await >= 1.0,
        "TLS to both"
    );
    (a, b, envoy)
}

fn completion_body() -> Vec<u8> {
    serde_json::json!({"model": "m", "prompt": "hello there", "max_tokens": 4})
        .to_string()
        .into_bytes()
}

/// Runs `clients` load clients against `url`, applies `fault` after 300 ms, keeps the load
/// up for `after` more, and returns every answer with the instants before and after `fault`.
async fn under_load(
    url: &str,
    clients: usize,
    after: Duration,
    fault: impl FnOnce(),
) -> (Vec<Answer>, std::ops::RangeInclusive<Instant>) {
    let stop = tokio_util::sync::CancellationToken::new();
    let tasks: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(load(url.to_owned(), completion_body(), stop.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = Instant::now();
    fault();
    let done = Instant::now();
    tokio::time::sleep(after).await;
    stop.cancel();
    let mut seen = Vec::new();
    for task in tasks {
        seen.extend(task.await.expect("client"));
    }
    (seen, before..=done)
}

/// After a fault B serves every request itself (no fail-open).
async fn only_b_routes(url: &str) {
    for _ in 0..5 {
        let reply = post_json(url, &completion_body()).await;
        assert_eq!(reply.status, 200);
        assert!(
            reply
                .header(support::envoy::METADATA_ECHO_HEADER)
                .is_some_and(|h| !h.is_empty() && h != "-")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leaving_behind_envoy_loses_no_request() {
    let backends = [
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    ];
    // Past Envoy's next health check (every 1 s) before A stops taking streams.
    let grace = ["--shutdown-grace-period", "1200ms", "--drain-timeout", "2s"];
    let (mut a, _b, envoy) = two_replicas_behind_envoy(&backends, &grace).await;
    let url = envoy.url("/v1/completions");

    // Two clients keep requests coming while replica A leaves (SIGTERM, as in a scale-down
    // or a rolling update): readiness off, Envoy's health check moves new streams to B, A
    // drains its open ones.
    let (seen, _) = under_load(&url, 2, Duration::from_millis(1600), || a.terminate()).await;
    let lost: Vec<_> = seen.iter().filter(|r| r.status != 200).collect();
    let picked = seen.iter().filter(|r| r.picked).count();
    eprintln!(
        "replica left under load: {} requests, {} lost, {} picked by kvpick",
        seen.len(),
        lost.len(),
        picked
    );
    assert!(seen.len() > 20, "the load ran ({} requests)", seen.len());
    assert!(lost.is_empty(), "requests lost: {lost:?}");
    assert_eq!(
        picked,
        seen.len(),
        "B picked every request A no longer took (none failed open)"
    );
    assert_eq!(
        a.wait_exit(Duration::from_secs(5)).await,
        Some(0),
        "A drained and exited"
    );
    only_b_routes(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_behind_envoy_loses_no_request() {
    let backends = [
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    ];
    let (mut a, _b, envoy) = two_replicas_behind_envoy(&backends, &[]).await;
    let url = envoy.url("/v1/completions");

    // Responses streaming when A dies: the backends hold them open (first event sent, the
    // rest after the kill), each watched by an observing stream on A or on B. Enough of them
    // that A watches at least two (its open streams are observing ones: a routing stream
    // ends with its decision).
    let held_url = envoy.url("/hold");
    let reached = || backends.iter().map(|b| b.seen().len()).sum::<usize>();
    let mut held = Vec::new();
    while a.metric("kvpick_extproc_open_streams").await < 2.0 {
        assert!(
            held.len() < 40,
            "A watches no held response after {}",
            held.len()
        );
        let url = held_url.clone();
        let before = reached();
        held.push(tokio::spawn(async move {
            post_json(&url, &completion_body()).await
        }));
        support::wait_until(
            "a held request to reach a backend",
            Duration::from_secs(10),
            || {
                let now = reached();
                async move { now > before }
            },
        )
        .await;
    }

    // A crashes (SIGKILL: no drain, its sockets reset) while four clients keep requests
    // coming. A stream refused by the dead A (or reset before A answered) is replayed on B
    // by the ext_proc stream's retry policy, outlier detection ejects A at its first refused
    // connect, and no response waits on A: it only watched them (deploy/envoy/envoy.yaml).
    let clients = 4;
    // The kill spans from the signal to the reaped process (a request started in between
    // may still have reached A alive).
    let (seen, killed) = under_load(&url, clients, Duration::from_millis(1500), || {
        a.child.kill().expect("SIGKILL A");
        a.child.wait().expect("reap A");
    })
    .await;
    let in_flight = seen
        .iter()
        .filter(|r| r.start <= *killed.end() && r.end >= *killed.start())
        .count();
    let lost: Vec<_> = seen.iter().filter(|r| r.status != 200).collect();
    let picked = seen.iter().filter(|r| r.picked).count();
    let failed_open = seen.iter().filter(|r| r.status == 200 && !r.picked).count();
    eprintln!(
        "replica killed under load: {} requests, {} in flight at the kill, {} lost {lost:?}, \
         {} picked by kvpick, {} failed open, {} held responses",
        seen.len(),
        in_flight,
        lost.len(),
        picked,
        failed_open,
        held.len()
    );
    assert!(seen.len() > 40, "the load ran ({} requests)", seen.len());
    assert!(lost.is_empty(), "requests lost: {lost:?}");
    assert!(
        seen.iter()
            .filter(|r| r.start > *killed.end())
            .all(|r| r.picked),
        "B picked every request sent after the kill (none failed open)"
    );
    backends.iter().for_each(Backend::release);
    for (i, response) in held.into_iter().enumerate() {
        let reply = response.await.expect("held client");
        assert_eq!(reply.status, 200, "held response {i}");
        assert_eq!(
            reply.text(),
            "data: first\n\ndata: [DONE]\n\n",
            "held response {i} streamed to its end"
        );
    }
    only_b_routes(&url).await;
}

#[test]
fn replica_flags_are_validated_at_start() {
    let pool = ["--endpoints-file", "pool.yaml"];
    let cases: [(Vec<&str>, &str); 4] = [
        (
            [&pool[..], &["--replica-peers", "10.0.0.2:9010"]].concat(),
            "--replica-peers: needs --replica-exchange-port",
        ),
        (
            [
                &pool[..],
                &[
                    "--replica-exchange-port",
                    "9010",
                    "--replica-peers",
                    "no-port",
                ],
            ]
            .concat(),
            "--replica-peers: `no-port` is not HOST:PORT",
        ),
        (
            [
                &pool[..],
                &[
                    "--replica-exchange-port",
                    "9010",
                    "--replica-peers",
                    "a:1",
                    "--peer-selector",
                    "app=kvpick",
                ],
            ]
            .concat(),
            "--peer-selector: and --replica-peers are given together",
        ),
        (
            [
                &pool[..],
                &["--replica-exchange-port", "9002", "--grpc-port", "9002"],
            ]
            .concat(),
            "--grpc-port and --replica-exchange-port both use port 9002",
        ),
    ];
    for (args, want) in cases {
        let stderr = support::kvpick::serve_refused(&args, &[]);
        assert!(stderr.contains(want), "{args:?}: stderr {stderr}");
    }
}
