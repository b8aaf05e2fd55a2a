//! ZMTP over TCP on tokio: the SUB side of a pod's KV-event PUB (connect or accept) and the
//! DEALER side of its replay ROUTER, on the bounded codec in
//! [`kvpick_kvevents_wire::zmtp`].
//!
//! Why not a ZMQ library: see the codec's docs (unbounded allocation on a declared frame
//! length, unbounded multipart buffering). What this module adds on top of the codec:
//! - every wait is bounded: connect, handshake, each send, and a message once its first byte
//!   arrived ([`TransportConfig::message_timeout`]); only an idle connection may wait forever
//!   (KV events are bursty), and TCP keepalive ends it when the peer's host is gone: a pod
//!   whose node died or was cut off sends no FIN or RST, so without probes its idle stream
//!   would stay "connected" for ever and the pod would never be judged down
//!   (`endpoints::liveness`);
//! - reads grow the buffer by at most [`READ_CHUNK`] at a time, so memory follows the bytes a
//!   peer really sent, never what it declared;
//! - optionally, a byte budget shared by many connections ([`ByteBudget`], the bind mode):
//!   a connection holds permits for what it buffers and hands them to each message it
//!   delivers, released when the message is dropped after processing; an exhausted budget
//!   pauses reading (TCP pushes back on the peer) instead of growing memory.
//!
//! There is no reconnect logic here: a [`Connection`] is one TCP connection, and the callers
//! (`subscriber`, `replay`) own retries, so every reconnect delay is theirs to cap.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kvpick_kvevents_wire::zmtp::{
    self, Command, Decoder, GREETING_LEN, Inbound, Limits, ZmtpError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Most bytes read from the socket in one call (and so the most a read can over-allocate).
pub const READ_CHUNK: usize = 64 * 1024;

/// Bounds and timeouts of every KV-event connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransportConfig {
    /// Per-message bounds enforced before allocation.
    pub limits: Limits,
    /// Longest TCP connect.
    pub connect_timeout: Duration,
    /// Longest greeting + READY exchange, and longest single send.
    pub handshake_timeout: Duration,
    /// Longest time a message may take to arrive once its first byte has.
    pub message_timeout: Duration,
    /// TCP keepalive: idle time before the first probe.
    pub keepalive_idle: Duration,
    /// TCP keepalive: time between unanswered probes.
    pub keepalive_interval: Duration,
    /// TCP keepalive: unanswered probes before the kernel ends the connection.
    pub keepalive_probes: u32,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            connect_timeout: Duration::from_secs(2),
            handshake_timeout: Duration::from_secs(5),
            message_timeout: Duration::from_secs(10),
            // NOTE: a dead host is noticed ~11 s after its last packet (5 + 3 × 2), well
            // before Kubernetes marks a lost node's pods not ready (~40 s); one 66-byte
            // probe per idle pod every 5 s costs nothing.
            keepalive_idle: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(2),
            keepalive_probes: 3,
        }
    }
}

/// Turns on TCP keepalive with `config`'s timings (see the module docs).
fn set_keepalive(io: &TcpStream, config: &TransportConfig) -> std::io::Result<()> {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(config.keepalive_idle)
        .with_interval(config.keepalive_interval)
        .with_retries(config.keepalive_probes);
    socket2::SockRef::from(io).set_tcp_keepalive(&keepalive)
}

/// Which ZMQ socket we play.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Subscriber of a PUB (subscribes to everything once connected).
    Sub,
    /// Dealer talking to a ROUTER (replay).
    Dealer,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Self::Sub => "SUB",
            Self::Dealer => "DEALER",
        }
    }

    /// ZMTP's socket-type compatibility table, for our two roles.
    fn accepts(self, peer: &str) -> bool {
        match self {
            Self::Sub => matches!(peer, "PUB" | "XPUB"),
            Self::Dealer => matches!(peer, "ROUTER" | "DEALER"),
        }
    }
}

/// Why a connection could not be made or was dropped.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The endpoint is not `tcp://host:port`.
    #[error("unsupported endpoint {0:?} (expected tcp://host:port)")]
    Endpoint(String),
    /// TCP connect failed.
    #[error("connect failed: {0}")]
    Connect(std::io::Error),
    /// TCP connect took too long.
    #[error("connect timed out")]
    ConnectTimeout,
    /// The peer did not complete the handshake in time.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// A started message did not finish in time (or a send stalled).
    #[error("peer stalled mid-message")]
    MessageTimeout,
    /// The peer closed the connection.
    #[error("connection closed by the peer")]
    Closed,
    /// A socket read or write failed.
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol or a bound.
    #[error(transparent)]
    Protocol(#[from] ZmtpError),
}

impl TransportError {
    /// Every value [`Self::reason`] returns.
    pub const REASONS: [&'static str; 10] = [
        "endpoint",
        "connect",
        "connect_timeout",
        "handshake_timeout",
        "message_timeout",
        "closed",
        "io",
        "message_too_large",
        "too_many_frames",
        "protocol",
    ];

    /// A short, stable reason for metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Endpoint(_) => "endpoint",
            Self::Connect(_) => "connect",
            Self::ConnectTimeout => "connect_timeout",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::MessageTimeout => "message_timeout",
            Self::Closed => "closed",
            Self::Io(_) => "io",
            Self::Protocol(ZmtpError::MessageTooLarge { .. }) => "message_too_large",
            Self::Protocol(ZmtpError::TooManyFrames(_)) => "too_many_frames",
            Self::Protocol(_) => "protocol",
        }
    }
}

/// `tcp://host:port` → (host, port); `*` and `0.0.0.0` mean every address (binding only).
pub fn parse_tcp_endpoint(endpoint: &str) -> Result<(String, u16), TransportError> {
    let bad = || TransportError::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

/// A byte budget shared by connections (permits = bytes).
#[derive(Clone, Debug)]
pub struct ByteBudget {
    semaphore: Arc<Semaphore>,
}

impl ByteBudget {
    /// A budget of `bytes`, plus two read chunks of headroom: one connection buffering a
    /// whole message of the largest allowed size (plus the chunk it is reading) must always
    /// fit, or it would wait for permits that can never exist.
    pub fn new(bytes: usize) -> Self {
        let permits = bytes
            .saturating_add(2 * READ_CHUNK)
            .min(Semaphore::MAX_PERMITS);
        Self {
            semaphore: Arc::new(Semaphore::new(permits)),
        }
    }

    /// Bytes not held by any connection or undelivered message.
    pub fn available(&self) -> usize {
        self.semaphore.available_permits()
    }
}

/// Budget permits travelling with a received message: dropping the message's guard (after
/// processing it) returns its bytes to the budget.
#[derive(Debug)]
pub struct BudgetGuard(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// One ZMTP connection after a successful handshake.
pub struct Connection {
    io: TcpStream,
    buf: BytesMut,
    decoder: Decoder,
    peer: SocketAddr,
    config: TransportConfig,
    budget: Option<ByteBudget>,
    held: Option<OwnedSemaphorePermit>,
    message_started: Option<Instant>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Connects to `endpoint` and completes the handshake as `role` (a SUB also subscribes
    /// to every topic).
    pub async fn connect(
        endpoint: &str,
        role: Role,
        config: TransportConfig,
    ) -> Result<Self, TransportError> {
        let (host, port) = parse_tcp_endpoint(endpoint)?;
        let io = tokio::time::timeout(config.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| TransportError::ConnectTimeout)?
            .map_err(TransportError::Connect)?;
        Self::handshake(io, role, config, None).await
    }

    /// Completes the handshake on an accepted connection; reads are charged to `budget`.
    pub async fn accept(
        io: TcpStream,
        role: Role,
        config: TransportConfig,
        budget: Option<ByteBudget>,
    ) -> Result<Self, TransportError> {
        Self::handshake(io, role, config, budget).await
    }

    async fn handshake(
        mut io: TcpStream,
        role: Role,
        config: TransportConfig,
        budget: Option<ByteBudget>,
    ) -> Result<Self, TransportError> {
        let peer = io.peer_addr()?;
        set_keepalive(&io, &config)?;
        let exchange = async {
            let mut hello = zmtp::greeting().to_vec();
            zmtp::encode_ready(&mut hello, role.name());
            // NOTE: the whole greeting and READY go out at once; libzmq's staged greeting is
            // only needed to talk to ZMTP 1.0/2.0 peers, which we refuse anyway.
            io.write_all(&hello).await?;
            let mut greeting = [0u8; GREETING_LEN];
            io.read_exact(&mut greeting).await?;
            zmtp::parse_greeting(&greeting)?;
            let mut decoder = Decoder::new(config.limits);
            let mut buf = BytesMut::with_capacity(512);
            loop {
                match decoder.decode(&mut buf)? {
                    Some(Inbound::Command(Command::Ready { socket_type })) => {
                        if !role.accepts(&socket_type) {
                            return Err(ZmtpError::SocketType {
                                peer: socket_type,
                                ours: role.name(),
                            }
                            .into());
                        }
                        break;
                    }
                    Some(Inbound::Command(Command::Error(reason))) => {
                        return Err(ZmtpError::PeerError(reason).into());
                    }
                    Some(_) => {
                        return Err(ZmtpError::Handshake("expected READY first".to_owned()).into());
                    }
                    None => {
                        // The handshake is small: a peer cannot make this grow past one
                        // command (the codec caps commands) plus a chunk.
                        buf.reserve(READ_CHUNK.min(decoder.wants(buf.len()).max(512)));
                        if io.read_buf(&mut buf).await? == 0 {
                            return Err(TransportError::Closed);
                        }
                    }
                }
            }
            if role == Role::Sub {
                let mut subscribe = Vec::new();
                zmtp::encode_message(&mut subscribe, &[&zmtp::subscription(b"")]);
                io.write_all(&subscribe).await?;
            }
            Ok::<_, TransportError>((decoder, buf))
        };
        let (decoder, buf) = tokio::time::timeout(config.handshake_timeout, exchange)
            .await
            .map_err(|_| TransportError::HandshakeTimeout)??;
        let mut connection = Self {
            io,
            buf: BytesMut::new(),
            decoder,
            peer,
            config,
            budget,
            held: None,
            message_started: None,
        };
        // Bytes the peer sent right after READY (a first message) are kept, under budget.
        if !buf.is_empty() {
            connection.charge(buf.len()).await?;
            connection.buf = buf;
        }
        Ok(connection)
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), TransportError> {
        let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
        zmtp::encode_message(&mut out, frames);
        self.write(&out).await
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), TransportError> {
        tokio::time::timeout(self.config.handshake_timeout, self.io.write_all(bytes))
            .await
            .map_err(|_| TransportError::MessageTimeout)??;
        Ok(())
    }

    /// Receives the next whole message (answering PINGs, skipping other commands), with the
    /// budget permits of its bytes.
    pub async fn recv(&mut self) -> Result<(Vec<Bytes>, BudgetGuard), TransportError> {
        loop {
            if let Some(item) = self.decoder.decode(&mut self.buf)? {
                match item {
                    Inbound::Message(frames) => {
                        self.message_started = None;
                        let guard = self.release_delivered(&frames);
                        return Ok((frames, guard));
                    }
                    Inbound::Command(Command::Ping { context }) => {
                        let mut pong = Vec::new();
                        zmtp::encode_command(&mut pong, "PONG", &context);
                        self.write(&pong).await?;
                    }
                    Inbound::Command(Command::Error(reason)) => {
                        return Err(ZmtpError::PeerError(reason).into());
                    }
                    Inbound::Command(Command::Ready { .. }) => {
                        return Err(ZmtpError::Handshake("READY sent twice".to_owned()).into());
                    }
                    Inbound::Command(Command::Other(_)) => {}
                }
                self.release_consumed();
                continue;
            }
            self.fill().await?;
        }
    }

    /// Reads at most one chunk, under the message deadline once a message has begun.
    async fn fill(&mut self) -> Result<(), TransportError> {
        if self.message_started.is_none() && (self.decoder.mid_message() || !self.buf.is_empty()) {
            self.message_started = Some(Instant::now());
        }
        let deadline = self
            .message_started
            .map(|started| started + self.config.message_timeout);
        let chunk = READ_CHUNK.min(self.decoder.wants(self.buf.len()).max(4096));
        let step = async {
            let buffered = self.buf.len() + self.decoder.partial_message_bytes();
            self.charge(buffered + chunk).await?;
            self.buf.reserve(chunk);
            let read = (&mut self.io)
                .take(chunk as u64)
                .read_buf(&mut self.buf)
                .await?;
            if read == 0 {
                return Err(TransportError::Closed);
            }
            Ok(())
        };
        match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, step)
                .await
                .map_err(|_| TransportError::MessageTimeout)?,
            None => step.await,
        }
    }

    /// Makes sure `total` bytes are held from the budget (no-op without one).
    async fn charge(&mut self, total: usize) -> Result<(), TransportError> {
        let Some(budget) = &self.budget else {
            return Ok(());
        };
        let held = self.held.as_ref().map_or(0, |p| p.num_permits());
        if total <= held {
            return Ok(());
        }
        let more = u32::try_from(total - held).unwrap_or(u32::MAX);
        let permit = Arc::clone(&budget.semaphore)
            .acquire_many_owned(more)
            .await
            .map_err(|_| TransportError::Closed)?;
        match &mut self.held {
            Some(held) => held.merge(permit),
            None => self.held = Some(permit),
        }
        Ok(())
    }

    /// Moves the permits of a delivered message's bytes from the connection to the message.
    fn release_delivered(&mut self, frames: &[Bytes]) -> BudgetGuard {
        let bytes: usize = frames.iter().map(Bytes::len).sum();
        let guard = self.held.as_mut().and_then(|held| {
            let take = bytes.min(held.num_permits());
            held.split(take)
        });
        self.release_consumed();
        BudgetGuard(guard)
    }

    /// Returns permits beyond what is still buffered (commands, frame headers).
    fn release_consumed(&mut self) {
        if let Some(held) = &mut self.held {
            let keep = self.buf.len();
            if held.num_permits() > keep {
                drop(held.split(held.num_permits() - keep));
            }
        }
    }
}

/// A bound TCP listener that hands out handshaken SUB connections.
#[derive(Debug)]
pub struct SubListener {
    listener: TcpListener,
    local: SocketAddr,
}

impl SubListener {
    /// Binds `endpoint` (`tcp://*:5557`, `tcp://127.0.0.1:0`, …).
    pub async fn bind(endpoint: &str) -> Result<Self, TransportError> {
        let (host, port) = parse_tcp_endpoint(endpoint)?;
        let host = if host == "*" {
            "0.0.0.0".to_owned()
        } else {
            host
        };
        let listener = TcpListener::bind((host.as_str(), port)).await?;
        let local = listener.local_addr()?;
        Ok(Self { listener, local })
    }

    /// The bound address as a `tcp://` endpoint (port 0 resolved).
    pub fn endpoint(&self) -> String {
        format!("tcp://{}", self.local)
    }

    /// The next TCP connection (not yet handshaken: do that on its own task).
    pub async fn accept(&self) -> Result<TcpStream, TransportError> {
        Ok(self.listener.accept().await?.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plays a PUB on `io`: greeting and READY, then holds it.
    async fn raw_pub(mut io: TcpStream) -> TcpStream {
        let mut hello = zmtp::greeting().to_vec();
        zmtp::encode_ready(&mut hello, "PUB");
        io.write_all(&hello).await.expect("greeting");
        io
    }

    /// The keepalive the kernel was given for `io`: (on, idle, interval, probes).
    fn keepalive_of(io: &TcpStream) -> (bool, Duration, Duration, u32) {
        let socket = socket2::SockRef::from(io);
        (
            socket.keepalive().expect("SO_KEEPALIVE"),
            socket.tcp_keepalive_time().expect("TCP_KEEPIDLE"),
            socket.tcp_keepalive_interval().expect("TCP_KEEPINTVL"),
            socket.tcp_keepalive_retries().expect("TCP_KEEPCNT"),
        )
    }

    #[tokio::test]
    async fn connected_and_accepted_streams_probe_an_idle_peer() {
        let config = TransportConfig {
            keepalive_idle: Duration::from_secs(7),
            keepalive_interval: Duration::from_secs(3),
            keepalive_probes: 4,
            ..TransportConfig::default()
        };
        let expected = (true, Duration::from_secs(7), Duration::from_secs(3), 4);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let endpoint = format!("tcp://{}", listener.local_addr().expect("addr"));
        // A SUB that connects (kvpick dials the pod).
        let (connected, _publisher) =
            tokio::join!(Connection::connect(&endpoint, Role::Sub, config), async {
                raw_pub(listener.accept().await.expect("accept").0).await
            });
        assert_eq!(keepalive_of(&connected.expect("handshake").io), expected);
        // A SUB that accepts (the pod dials kvpick's bind address).
        let sub = SubListener::bind("tcp://127.0.0.1:0").await.expect("bind");
        let dialer = async { raw_pub(TcpStream::connect(sub.local).await.expect("connect")).await };
        let (accepted, _publisher) = tokio::join!(
            async {
                Connection::accept(sub.accept().await.expect("accept"), Role::Sub, config, None)
                    .await
            },
            dialer
        );
        assert_eq!(keepalive_of(&accepted.expect("handshake").io), expected);
        // The defaults: a dead host is noticed within ~11 s.
        let defaults = TransportConfig::default();
        let noticed =
            defaults.keepalive_idle + defaults.keepalive_interval * defaults.keepalive_probes;
        assert!(noticed <= Duration::from_secs(15), "{noticed:?}");
    }

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            parse_tcp_endpoint("tcp://127.0.0.1:5557").unwrap(),
            ("127.0.0.1".to_owned(), 5557)
        );
        assert_eq!(
            parse_tcp_endpoint("tcp://[::1]:80").unwrap(),
            ("::1".to_owned(), 80)
        );
        assert_eq!(
            parse_tcp_endpoint("tcp://*:5557").unwrap(),
            ("*".to_owned(), 5557)
        );
        for bad in [
            "ipc:///tmp/x",
            "tcp://host",
            "tcp://:1",
            "tcp://h:99999",
            "5557",
        ] {
            assert!(parse_tcp_endpoint(bad).is_err(), "{bad}");
        }
    }
}
