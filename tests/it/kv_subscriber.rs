//! The event pipeline over real ZMQ sockets on 127.0.0.1: a test publisher (PUB + replay
//! ROUTER, DESIGN §3 protocol) replays the real vLLM capture; the manager's subscribers must
//! keep the index equal to applying every batch in order — through lost messages (replay),
//! missing replay (clear), publisher restarts (seq back to 0), pods leaving, and central mode.

use crate::support::paths;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvpick::endpoints::{Endpoint, PodId};
use kvpick::kvcache::{IndexConfig, PrefixIndex};
use kvpick::kvevents::{KvEventsConfig, KvEventsManager, KvEventsStatus, decode_payload};
use prometheus::Registry;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// (topic, payload) of every batch of a capture folder, by seq.
fn capture(dir: &str) -> Vec<(Bytes, Bytes)> {
    let dir = paths::fixtures().join(dir);
    let mut out = Vec::new();
    for index in 0.. {
        let base = dir.join(format!("{index:04}"));
        let Ok(payload) = std::fs::read(base.with_extension("msgpack")) else {
            break;
        };
        let topic = std::fs::read(base.with_extension("topic")).unwrap();
        out.push((Bytes::from(topic), Bytes::from(payload)));
    }
    out
}

type Buffer = Arc<Mutex<Vec<(u64, Bytes, Bytes)>>>;

/// A vLLM-like publisher: PUB for live batches, ROUTER serving replays from its buffer.
struct TestPublisher {
    socket: PubSocket,
    buffer: Buffer,
    router: JoinHandle<()>,
    events: String,
    replay: String,
}

impl TestPublisher {
    async fn bind() -> Self {
        let mut socket = PubSocket::new();
        let events = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        Self::with_socket(socket, events).await
    }

    async fn with_socket(socket: PubSocket, events: String) -> Self {
        Self::with_sockets(socket, events, "tcp://127.0.0.1:0").await
    }

    /// A publisher whose PUB and ROUTER listen on fixed endpoints (a restarted engine).
    async fn bind_at(events: &str, replay: &str) -> Self {
        let mut socket = PubSocket::new();
        let events = socket.bind(events).await.unwrap().to_string();
        Self::with_sockets(socket, events, replay).await
    }

    async fn with_sockets(socket: PubSocket, events: String, replay: &str) -> Self {
        let mut router = RouterSocket::new();
        let replay = router.bind(replay).await.unwrap().to_string();
        let buffer: Buffer = Arc::default();
        let served = buffer.clone();
        let router = tokio::spawn(async move {
            loop {
                let Ok(request) = router.recv().await else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                let frames = request.into_vec();
                let (Some(identity), Some(start)) = (frames.first(), frames.get(2)) else {
                    continue;
                };
                let start = u64::from_be_bytes(start[..].try_into().unwrap());
                let replies: Vec<(u64, Bytes, Bytes)> = served
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(seq, _, _)| *seq >= start)
                    .cloned()
                    .collect();
                for (seq, topic, payload) in replies {
                    let reply = ZmqMessage::try_from(vec![
                        identity.clone(),
                        Bytes::new(),
                        topic,
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ])
                    .unwrap();
                    let _ = router.send(reply).await;
                }
                let end = ZmqMessage::try_from(vec![
                    identity.clone(),
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::from_static(&[0xff; 8]),
                    Bytes::new(),
                ])
                .unwrap();
                let _ = router.send(end).await;
            }
        });
        Self {
            socket,
            buffer,
            router,
            events,
            replay,
        }
    }

    /// Buffers a batch for replay and, unless `lose`, publishes it live.
    async fn publish(&mut self, seq: u64, topic: &Bytes, payload: &Bytes, lose: bool) {
        self.buffer
            .lock()
            .unwrap()
            .push((seq, topic.clone(), payload.clone()));
        if !lose {
            let message = ZmqMessage::try_from(vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ])
            .unwrap();
            self.socket.send(message).await.unwrap();
        }
    }

    /// An engine restart: the in-memory replay buffer is gone and seq restarts at 0.
    fn restart(&mut self) {
        self.buffer.lock().unwrap().clear();
    }
}

impl Drop for TestPublisher {
    fn drop(&mut self) {
        self.router.abort();
    }
}

fn pod() -> PodId {
    // The capture's topic is kv@127.0.0.1:8101@tiny.
    PodId(SocketAddr::from(([127, 0, 0, 1], 8101)))
}

fn manager() -> (Arc<PrefixIndex>, KvEventsManager) {
    manager_with_channel(KvEventsConfig::default().channel_capacity)
}

fn manager_with_channel(channel_capacity: usize) -> (Arc<PrefixIndex>, KvEventsManager) {
    let (index, manager, _) = manager_with_registry(channel_capacity);
    (index, manager)
}

fn manager_with_registry(channel_capacity: usize) -> (Arc<PrefixIndex>, KvEventsManager, Registry) {
    let registry = Registry::new();
    let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
    let config = KvEventsConfig {
        replay_timeout: Duration::from_secs(2),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        channel_capacity,
        ..KvEventsConfig::default()
    };
    let manager = KvEventsManager::new(index.clone(), config, &registry).unwrap();
    (index, manager, registry)
}

/// The value of a per pod metric in the registry.
fn metric(registry: &Registry, name: &str) -> Option<f64> {
    let family = registry.gather().into_iter().find(|f| f.name() == name)?;
    let sample = family.get_metric().iter().find(|m| {
        m.get_label()
            .iter()
            .any(|l| l.name() == "pod" && l.value() == "127.0.0.1:8101")
    })?;
    Some(if name.ends_with("_total") {
        sample.get_counter().get_value()
    } else {
        sample.get_gauge().get_value()
    })
}

/// The index state of applying `batches` in order, directly.
fn reference(batches: &[(Bytes, Bytes)]) -> PrefixIndex {
    let index = PrefixIndex::new(IndexConfig::default());
    for (_, payload) in batches {
        index.apply_batch(pod(), "tiny", &decode_payload(payload).unwrap());
    }
    index
}

/// Polls until the pod's index equals applying `batches` in order (bounded wait).
async fn wait_for_index(
    index: &PrefixIndex,
    manager: &KvEventsManager,
    batches: &[(Bytes, Bytes)],
    what: &str,
) {
    let expected = reference(batches);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while index.pod_engine_hashes(pod()) != expected.pod_engine_hashes(pod()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: index {} entries, expected {} ({:?})",
            index.pod_entries(pod()),
            expected.pod_entries(pod()),
            manager.status(pod())
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls the pod's status until `done` holds (bounded wait on real sockets).
async fn wait_for(manager: &KvEventsManager, what: &str, done: impl Fn(&KvEventsStatus) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = manager.status(pod())
            && done(&status)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {:?}",
            manager.status(pod())
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Publishes `batches` as seqs `first..`, losing those `lose` selects. Until the subscriber
/// has received something, each publish waits briefly: batches sent before the subscription
/// reached the PUB are lost on the wire, which the first-seq-is-a-gap rule repairs.
async fn publish_all(
    publisher: &mut TestPublisher,
    manager: &KvEventsManager,
    batches: &[(Bytes, Bytes)],
    lose: impl Fn(u64) -> bool,
) {
    for (seq, (topic, payload)) in batches.iter().enumerate() {
        let seq = seq as u64;
        publisher.publish(seq, topic, payload, lose(seq)).await;
        if manager.status(pod()).is_none_or(|s| s.received == 0) {
            let deadline = tokio::time::Instant::now() + Duration::from_millis(100);
            while manager.status(pod()).is_none_or(|s| s.received == 0)
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }
}

fn endpoint(publisher: &TestPublisher, with_replay: bool) -> Endpoint {
    Endpoint {
        kv_events: Some(publisher.events.clone()),
        kv_replay: with_replay.then(|| publisher.replay.clone()),
        ..Endpoint::new(pod())
    }
}

#[tokio::test]
async fn lost_messages_are_replayed_exactly() {
    let batches = capture("vllm-0.32-kv-events");
    let mut publisher = TestPublisher::bind().await;
    let (index, manager, registry) = manager_with_registry(4096);
    manager.sync(&[endpoint(&publisher, true)]).await;
    wait_for(&manager, "connection", |s| s.connected).await;
    publish_all(&mut publisher, &manager, &batches, |seq| {
        (20..=25).contains(&seq) || seq == 40
    })
    .await;
    wait_for(&manager, "last seq 67 applied", |s| {
        s.last_seq == Some(67) && s.applied == 68
    })
    .await;
    let status = manager.status(pod()).unwrap();
    assert!(status.gaps >= 2, "{status:?}");
    assert!(status.replays >= 2, "{status:?}");
    assert_eq!(status.clears, 0, "replay covered every gap: {status:?}");
    let expected = reference(&batches);
    assert_eq!(
        index.pod_engine_hashes(pod()),
        expected.pod_engine_hashes(pod())
    );
    assert_eq!(manager.pod_status(pod()).index_blocks, 62);

    // The debug view (DESIGN §2.1 `GET /debug/pods`) and the metrics agree.
    let view = serde_json::to_value(manager.pod_status(pod())).unwrap();
    assert_eq!(view["address"], "127.0.0.1:8101");
    assert_eq!(view["index_blocks"], 62);
    assert_eq!(view["kv_events"]["connected"], true);
    assert_eq!(view["kv_events"]["last_seq"], 67);
    assert_eq!(view["kv_events"]["gaps"], status.gaps);
    assert_eq!(view["kv_events"]["replays"], status.replays);
    assert_eq!(view["kv_events"]["clears"], 0);
    assert_eq!(manager.pods_status(), vec![manager.pod_status(pod())]);

    // Hostile messages are counted and skipped; the index is untouched.
    let topic = batches[0].0.clone();
    publisher
        .publish(68, &topic, &Bytes::from_static(b"\xc1not msgpack"), false)
        .await;
    let two_frames = ZmqMessage::try_from(vec![topic, Bytes::from_static(b"x")]).unwrap();
    publisher.socket.send(two_frames).await.unwrap();
    wait_for(&manager, "two malformed", |s| s.malformed == 2).await;
    let status = manager.status(pod()).unwrap();
    // The undecodable batch's seq is kept (it is not a gap); the 2-frame message has none.
    assert_eq!(
        (status.last_seq, status.clears),
        (Some(68), 0),
        "{status:?}"
    );
    assert_eq!(
        index.pod_engine_hashes(pod()),
        expected.pod_engine_hashes(pod())
    );
    assert_eq!(
        metric(&registry, "kvpick_kv_events_malformed_total"),
        Some(2.0)
    );
    let gauge = metric(&registry, "kvpick_kv_index_entries").unwrap();
    assert_eq!(gauge, 62.0);
    let gaps = metric(&registry, "kvpick_kv_events_gaps_total").unwrap();
    assert_eq!(gaps, status.gaps as f64);
    let applied = metric(&registry, "kvpick_kv_events_applied_total").unwrap();
    assert_eq!(applied, 68.0);
    let received = metric(&registry, "kvpick_kv_events_received_total").unwrap();
    assert_eq!(received, status.received as f64);

    // The pod leaves the pool: subscription stopped, entries purged.
    manager.sync(&[]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !index.pods().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "purge");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(index.distinct_blocks(), 0);
    assert!(manager.status(pod()).is_none());
    assert!(metric(&registry, "kvpick_kv_index_entries").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_index_channel_drops_are_repaired() {
    // A one-slot channel: live batches arriving while the writer is busy are dropped
    // (counted), then repaired through replay like any gap.
    let batches = capture("vllm-0.32-kv-events");
    let mut publisher = TestPublisher::bind().await;
    let (index, manager) = manager_with_channel(1);
    manager.sync(&[endpoint(&publisher, true)]).await;
    wait_for(&manager, "connection", |s| s.connected).await;
    publish_all(&mut publisher, &manager, &batches, |_| false).await;
    wait_for(&manager, "all applied", |s| {
        s.last_seq == Some(67) && s.applied == 68
    })
    .await;
    let status = manager.status(pod()).unwrap();
    assert_eq!(status.clears, 0, "{status:?}");
    assert!(status.replays >= status.dropped.min(1), "{status:?}");
    assert_eq!(
        index.pod_engine_hashes(pod()),
        reference(&batches).pod_engine_hashes(pod())
    );
}

#[tokio::test]
async fn restart_clears_stale_entries() {
    let before = capture("vllm-0.32-kv-events");
    let after = capture("vllm-0.32-kv-events/restart/after");
    let mut publisher = TestPublisher::bind().await;
    let (index, manager) = manager();
    manager.sync(&[endpoint(&publisher, true)]).await;
    wait_for(&manager, "connection", |s| s.connected).await;
    publish_all(&mut publisher, &manager, &before, |_| false).await;
    wait_for(&manager, "first life applied", |s| s.last_seq == Some(67)).await;
    assert_eq!(index.pod_entries(pod()), 62);

    publisher.restart();
    publish_all(&mut publisher, &manager, &after, |_| false).await;
    wait_for(&manager, "second life applied", |s| {
        s.last_seq == Some(2) && s.clears >= 1
    })
    .await;
    // Wait for the writer to drain the last batch.
    wait_for_index(&index, &manager, &after, "after applied").await;
    // The first life's blocks that the second life did not store again are gone.
    assert!(index.pod_entries(pod()) < 62);
}

#[tokio::test]
async fn restart_unseen_across_a_reconnect_is_rebuilt_not_patched() {
    // Life A publishes 3 batches and dies; life B (same endpoints) publishes seq 0..=25 while
    // we are disconnected, then 26..=30 once we are back. Seq 26 > 2 looks like a gap; after
    // a reconnect it must be treated as a restart: clear, then rebuild B from seq 0.
    let life_a = capture("vllm-0.32-kv-events/restart/after");
    let life_b: Vec<(Bytes, Bytes)> = capture("vllm-0.32-kv-events")
        .into_iter()
        .take(31)
        .collect();
    let mut a = TestPublisher::bind().await;
    let (index, manager) = manager();
    manager.sync(&[endpoint(&a, true)]).await;
    wait_for(&manager, "connection", |s| s.connected).await;
    publish_all(&mut a, &manager, &life_a, |_| false).await;
    wait_for(&manager, "life A applied", |s| s.last_seq == Some(2)).await;
    let (events, replay) = (a.events.clone(), a.replay.clone());
    drop(a);
    wait_for(&manager, "disconnect", |s| !s.connected).await;
    let mut b = TestPublisher::bind_at(&events, &replay).await;
    for (seq, (topic, payload)) in life_b.iter().enumerate().take(26) {
        b.publish(seq as u64, topic, payload, true).await;
    }
    wait_for(&manager, "reconnect", |s| s.connected).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seq = 26;
    while manager.status(pod()).is_none_or(|s| s.last_seq != Some(30)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            manager.status(pod())
        );
        if seq <= 30 {
            let (topic, payload) = &life_b[seq as usize];
            b.publish(seq, topic, payload, false).await;
            seq += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for_index(&index, &manager, &life_b, "life_b applied").await;
    assert!(manager.status(pod()).unwrap().clears >= 1);
}

#[tokio::test]
async fn gap_without_replay_clears_and_rebuilds_a_subset() {
    let batches = capture("vllm-0.32-kv-events");
    let mut publisher = TestPublisher::bind().await;
    let (index, manager) = manager();
    manager.sync(&[endpoint(&publisher, false)]).await;
    wait_for(&manager, "connection", |s| s.connected).await;
    publish_all(&mut publisher, &manager, &batches, |seq| {
        (63..=64).contains(&seq)
    })
    .await;
    // 66 live batches applied (2 lost, none replayed).
    wait_for(&manager, "last seq 67", |s| {
        s.last_seq == Some(67) && s.applied == 66
    })
    .await;
    let status = manager.status(pod()).unwrap();
    assert_eq!(
        (status.clears, status.gaps, status.replays),
        (1, 1, 0),
        "{status:?}"
    );
    // Never a block the engine does not hold; the blocks stored before the gap are forgotten
    // (and chains continuing them cannot be keyed): only seq 66's block is left.
    let truth = reference(&batches).pod_engine_hashes(pod());
    let held = index.pod_engine_hashes(pod());
    assert!(held.iter().all(|h| truth.contains(h)), "{held:?}");
    assert_eq!(held.len(), 1, "{held:?}");
}

#[tokio::test]
async fn central_mode_takes_identity_from_the_topic() {
    let batches = capture("vllm-0.32-kv-events");
    let (index, manager) = manager();
    let bound = manager.bind_central("tcp://127.0.0.1:0").await.unwrap();
    // Only pods of the pool are accepted: first a publisher whose topic names another pod.
    let mut socket = PubSocket::new();
    socket.connect(&bound).await.unwrap();
    let mut publisher = TestPublisher::with_socket(socket, bound.clone()).await;
    let stranger = Endpoint::new(PodId(SocketAddr::from(([127, 0, 0, 1], 9999))));
    let mut member = Endpoint::new(pod());
    member.kv_replay = Some(publisher.replay.clone());
    manager.sync(&[stranger, member]).await;
    publish_all(&mut publisher, &manager, &batches, |seq| seq == 30).await;
    wait_for(&manager, "last seq 67", |s| {
        s.last_seq == Some(67) && s.applied == 68
    })
    .await;
    let status = manager.status(pod()).unwrap();
    assert!(
        status.connected && status.gaps >= 1 && status.replays >= 1,
        "{status:?}"
    );
    assert_eq!(
        index.pod_engine_hashes(pod()),
        reference(&batches).pod_engine_hashes(pod())
    );

    // A topic naming a pod outside the pool is ignored.
    let mut topic = b"kv@127.0.0.1:7777@tiny".to_vec();
    let payload = batches[0].1.clone();
    publisher
        .publish(0, &Bytes::from(std::mem::take(&mut topic)), &payload, false)
        .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !index
            .pods()
            .contains(&PodId(SocketAddr::from(([127, 0, 0, 1], 7777))))
    );
}

#[tokio::test]
async fn a_malformed_batch_is_not_a_gap() {
    // Without a replay endpoint a gap clears the pod; an undecodable batch must not look like
    // one, or one bad payload wipes the pod's index.
    let batches = capture("vllm-0.32-kv-events");
    let mut publisher = TestPublisher::bind().await;
    let (index, manager) = manager();
    manager.sync(&[endpoint(&publisher, false)]).await;
    wait_for(&manager, "connection", |s| s.connected).await;
    publish_all(&mut publisher, &manager, &batches[..30], |_| false).await;
    wait_for(&manager, "first 30 applied", |s| s.last_seq == Some(29)).await;
    let before = index.pod_entries(pod());
    assert!(before > 0);
    let topic = batches[0].0.clone();
    publisher
        .publish(30, &topic, &Bytes::from_static(b"\x93\xcb"), false)
        .await;
    let (next_topic, next_payload) = batches[30].clone();
    publisher
        .publish(31, &next_topic, &next_payload, false)
        .await;
    wait_for(&manager, "seq 31 applied", |s| s.last_seq == Some(31)).await;
    let status = manager.status(pod()).unwrap();
    assert_eq!(
        (status.malformed, status.gaps, status.clears),
        (1, 0, 0),
        "{status:?}"
    );
    let mut expected: Vec<(Bytes, Bytes)> = batches[..30].to_vec();
    expected.push(batches[30].clone());
    wait_for_index(&index, &manager, &expected, "index rebuilt").await;
}

#[tokio::test]
async fn an_engine_restart_signal_clears_at_once_and_the_next_batch_rebuilds() {
    // The scrape path saw the engine's process start time change: its entries go now, before
    // any batch of the new life arrives; the new life's first batch (seq > 0 after a lost
    // start) is then rebuilt from replay.
    let before = capture("vllm-0.32-kv-events");
    let after = capture("vllm-0.32-kv-events/restart/after");
    let mut publisher = TestPublisher::bind().await;
    let (index, manager) = manager();
    manager.sync(&[endpoint(&publisher, true)]).await;
    wait_for(&manager, "connection", |s| s.connected).await;
    publish_all(&mut publisher, &manager, &before, |_| false).await;
    wait_for(&manager, "first life applied", |s| s.last_seq == Some(67)).await;
    assert_eq!(index.pod_entries(pod()), 62);

    manager.engine_restarted(pod());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while index.pod_entries(pod()) != 0 {
        assert!(tokio::time::Instant::now() < deadline, "not cleared");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(manager.status(pod()).unwrap().last_seq, None);

    // The new life: seq 0 and 1 are lost on the wire, 2 arrives and the gap is replayed.
    publisher.restart();
    for (seq, (topic, payload)) in after.iter().enumerate() {
        publisher.publish(seq as u64, topic, payload, seq < 2).await;
    }
    wait_for(&manager, "second life applied", |s| s.last_seq == Some(2)).await;
    wait_for_index(&index, &manager, &after, "after applied").await;
}
