//! The simulator's KV-event publisher through real ZMQ sockets on 127.0.0.1: a SUB sees
//! vLLM's 3-frame messages with seq from 0, and a DEALER replays what the SUB missed.

use std::time::Duration;

use bytes::Bytes;
use kvpick_sim::events::{EngineHash, EventBatch, EventLayout, KvEvent};
use kvpick_sim::publisher::{END_MARKER_SEQ, PublisherConfig, PublisherHandle, spawn_publisher};
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const TOPIC: &str = "kv@127.0.0.1:8101@sim-model";

fn batch(n: u64) -> EventBatch {
    EventBatch {
        ts: 1_700_000_000.0 + n as f64,
        events: vec![KvEvent::BlockRemoved {
            block_hashes: vec![EngineHash::Int(u64::MAX - n)],
            medium: Some("GPU".into()),
            group_idx: Some(0),
        }],
        data_parallel_rank: Some(0),
    }
}

async fn start(buffer_steps: usize) -> PublisherHandle {
    let (handle, _task) = spawn_publisher(PublisherConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: TOPIC.into(),
        buffer_steps,
        layout: EventLayout::Map,
        queue_capacity: 64,
        seed: 7,
    })
    .await
    .expect("bind");
    handle
}

fn frames(m: ZmqMessage) -> Vec<Bytes> {
    m.into_vec()
}

fn seq_of(frame: &Bytes) -> u64 {
    u64::from_be_bytes(frame.as_ref().try_into().expect("8-byte seq"))
}

/// Publishes probes until the SUB receives one (the slow-joiner window); returns its seq.
async fn connect_sub(handle: &PublisherHandle) -> (SubSocket, u64) {
    let mut sub = SubSocket::new();
    sub.connect(&handle.endpoint).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    for n in 0..200 {
        assert!(handle.publish(batch(1000 + n)));
        if let Ok(Ok(m)) = timeout(Duration::from_millis(25), sub.recv()).await {
            let f = frames(m);
            return (sub, seq_of(&f[1]));
        }
    }
    panic!("SUB never connected");
}

async fn replay_from(handle: &PublisherHandle, start: u64) -> Vec<(u64, Bytes)> {
    let mut dealer = DealerSocket::new();
    dealer
        .connect(handle.replay_endpoint.as_deref().expect("replay endpoint"))
        .await
        .expect("connect dealer");
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .expect("frames");
    dealer.send(request).await.expect("send");
    let mut out = Vec::new();
    loop {
        let m = timeout(Duration::from_secs(5), dealer.recv())
            .await
            .expect("replay reply in time")
            .expect("recv");
        let f = frames(m);
        assert_eq!(f.len(), 4, "[b\"\", topic, seq, payload]");
        assert!(f[0].is_empty());
        if f[2].as_ref() == END_MARKER_SEQ {
            assert!(f[1].is_empty() && f[3].is_empty(), "end marker");
            return out;
        }
        assert_eq!(f[1].as_ref(), TOPIC.as_bytes());
        out.push((seq_of(&f[2]), f[3].clone()));
    }
}

#[tokio::test]
async fn pub_frames_are_vllm_shaped_and_replay_returns_what_was_missed() {
    let handle = start(10_000).await;
    let (mut sub, first_seen) = connect_sub(&handle).await;

    // Live traffic, then a window where every PUB send is dropped, then live again.
    let base = handle.next_seq().await.expect("running");
    for n in 0..3 {
        handle.publish(batch(n));
    }
    handle.set_drop_fraction(1.0).await;
    for n in 3..6 {
        handle.publish(batch(n));
    }
    handle.set_drop_fraction(0.0).await;
    handle.publish(batch(6));

    let mut live = Vec::new();
    while live.len() < 4 {
        let m = timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("live")
            .expect("recv");
        let f = frames(m);
        assert_eq!(f.len(), 3);
        assert_eq!(f[0].as_ref(), TOPIC.as_bytes());
        let seq = seq_of(&f[1]);
        if seq < base {
            continue; // leftover probes
        }
        let decoded = EventBatch::decode(&f[2]).expect("payload decodes");
        assert_eq!(decoded, batch(seq - base));
        live.push(seq);
    }
    assert_eq!(live, vec![base, base + 1, base + 2, base + 6], "a gap of 3");

    // Replay from the first missed seq returns the missed batches and what follows.
    let replayed = replay_from(&handle, base + 3).await;
    let seqs: Vec<u64> = replayed.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![base + 3, base + 4, base + 5, base + 6]);
    for (i, (_, payload)) in replayed.iter().enumerate() {
        assert_eq!(
            EventBatch::decode(payload).expect("decodes"),
            batch(3 + i as u64)
        );
        assert_eq!(
            payload.as_ref(),
            batch(3 + i as u64).encode(EventLayout::Map)
        );
    }
    // Replay from 0 starts at seq 0: the probes before the SUB joined are still buffered.
    let all = replay_from(&handle, 0).await;
    assert_eq!(all.first().map(|(s, _)| *s), Some(0));
    assert!(first_seen <= base);
    assert_eq!(all.len() as u64, base + 7);
}

#[tokio::test]
async fn buffer_is_bounded_and_restart_resets_seq() {
    let handle = start(3).await;
    let (mut sub, _) = connect_sub(&handle).await;
    for n in 0..5 {
        handle.publish(batch(n));
    }
    let total = handle.next_seq().await.expect("running");
    let seqs: Vec<u64> = replay_from(&handle, 0)
        .await
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(seqs, vec![total - 3, total - 2, total - 1]);

    handle.restart().await;
    handle.publish(batch(42));
    let seq = loop {
        let m = timeout(Duration::from_secs(5), sub.recv())
            .await
            .expect("live")
            .expect("recv");
        let f = frames(m);
        let decoded = EventBatch::decode(&f[2]).expect("decodes");
        if decoded == batch(42) {
            break seq_of(&f[1]);
        }
    };
    assert_eq!(seq, 0, "seq restarts at 0");
    let after: Vec<u64> = replay_from(&handle, 0)
        .await
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(
        after,
        vec![0],
        "the replay buffer does not survive a restart"
    );
}
