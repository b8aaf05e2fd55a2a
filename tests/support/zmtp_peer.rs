//! A raw ZMTP PUB over TCP for fault tests: it speaks the handshake, then writes whatever a
//! test wants — well-formed vLLM batches, or frames no library would send (a header
//! declaring 2^50 bytes, MORE frames that never end, a frame that stalls half way).

use std::time::Duration;

use bytes::BytesMut;
use kvpick_kvevents_wire::zmtp::{self, Command, Decoder, Inbound, Limits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One handshaken PUB connection.
pub struct RawPub {
    pub stream: TcpStream,
}

impl RawPub {
    /// Accepts one subscriber (kvpick connecting to its pod) and completes the handshake.
    pub async fn accept(listener: &TcpListener, limit: Duration) -> RawPub {
        let (stream, _) = tokio::time::timeout(limit, listener.accept())
            .await
            .expect("kvpick connects to the publisher")
            .expect("accept");
        Self::handshake(stream, true).await
    }

    /// Dials a bound SUB (kvpick's `--kv-events-bind`) and completes the handshake.
    pub async fn connect(addr: &str) -> RawPub {
        let stream = TcpStream::connect(addr).await.expect("connect to kvpick");
        Self::handshake(stream, true).await
    }

    /// Dials and handshakes, but does not wait for the subscription (for peers kvpick may
    /// refuse right after accepting).
    pub async fn try_connect(addr: &str) -> std::io::Result<RawPub> {
        let mut stream = TcpStream::connect(addr).await?;
        let mut hello = zmtp::greeting().to_vec();
        zmtp::encode_ready(&mut hello, "PUB");
        stream.write_all(&hello).await?;
        Ok(RawPub { stream })
    }

    async fn handshake(mut stream: TcpStream, want_subscription: bool) -> RawPub {
        let mut hello = zmtp::greeting().to_vec();
        zmtp::encode_ready(&mut hello, "PUB");
        stream.write_all(&hello).await.expect("send greeting");
        let mut greeting = [0u8; zmtp::GREETING_LEN];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut greeting))
            .await
            .expect("greeting in time")
            .expect("read greeting");
        zmtp::parse_greeting(&greeting).expect("kvpick's greeting is ZMTP 3");
        let mut decoder = Decoder::new(Limits::default());
        let mut buf = BytesMut::new();
        let (mut ready, mut subscribed) = (false, !want_subscription);
        while !(ready && subscribed) {
            match decoder.decode(&mut buf).expect("kvpick speaks ZMTP") {
                Some(Inbound::Command(Command::Ready { socket_type })) => {
                    assert_eq!(socket_type, "SUB");
                    ready = true;
                }
                Some(Inbound::Message(frames)) => {
                    assert_eq!(
                        frames,
                        vec![bytes::Bytes::from_static(&[1])],
                        "subscribe all"
                    );
                    subscribed = true;
                }
                Some(other) => panic!("unexpected {other:?}"),
                None => {
                    let read =
                        tokio::time::timeout(Duration::from_secs(5), stream.read_buf(&mut buf))
                            .await
                            .expect("handshake in time")
                            .expect("read");
                    assert!(read > 0, "kvpick closed during the handshake");
                }
            }
        }
        RawPub { stream }
    }

    /// Publishes one batch (topic, 8-byte seq, payload).
    pub async fn send_batch(&mut self, topic: &[u8], seq: u64, payload: &[u8]) {
        let mut out = Vec::new();
        zmtp::encode_message(&mut out, &[topic, &seq.to_be_bytes(), payload]);
        self.stream.write_all(&out).await.expect("publish");
    }

    /// Writes raw bytes; `Err` once kvpick has closed the connection.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Whether kvpick closes the connection within `limit` (reads until EOF or reset).
    pub async fn closed_within(&mut self, limit: Duration) -> bool {
        let mut sink = [0u8; 4096];
        let wait = async {
            loop {
                match self.stream.read(&mut sink).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }
}

/// A frame header declaring `len` body bytes (long form), with MORE when `more`.
pub fn long_frame_header(len: u64, more: bool) -> Vec<u8> {
    let mut header = vec![0x02 | u8::from(more)];
    header.extend_from_slice(&len.to_be_bytes());
    header
}

/// Peak and current resident memory of a process, in bytes (Linux `/proc`).
pub fn memory_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}
