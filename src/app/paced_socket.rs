//! An ext-proc connection's socket, read at a pace while the connection only carries
//! observing streams.
//!
//! Why: an observing stream (the gateway's `observability_mode` filter) sends kvpick one
//! message per response chunk, ~65 for a 64-token streamed answer, and waits for no answer.
//! Each message reaching an idle lane woke its thread (`epoll_wait` returning, a context
//! switch), and those wake-ups, not the messages' handling, were most of what a chunk cost
//! (docs/benchmarks.md, sessions 20, 25 and 40). Nothing in a chunk is urgent to the
//! millisecond: the first one ends a prefill in kvpick's accounting and times it, the rest
//! time the decode.
//!
//! How: the socket's receive low-water mark (`SO_RCVLOWAT`). With the mark at N bytes the
//! kernel neither reports the socket readable nor wakes a thread waiting on it until N bytes
//! are queued (or the peer closes, or the receive window runs low), while a read still
//! returns whatever is queued. After a read that returned data, the mark is raised to
//! [`LOW_WATER`] and a timer of one pace starts; when it fires, the mark goes back to one
//! byte, and Linux, re-checking readiness when the mark is lowered, signals the socket
//! readable if anything arrived meanwhile. So while messages keep coming a lane wakes for
//! them once per pace (or per [`LOW_WATER`] bytes), and the first message after a quiet
//! pace is read at once.
//!
//! The price: an observing message is read up to one pace late, so a response's first byte
//! (the end of its prefill for kvpick, and the time to first token it observes) is seen up to
//! that late. A routing stream's messages are waited for by the gateway and are never paced:
//! a connection is paced only once its first stream was an observing one, and the first
//! routing stream it carries ends pacing there for good (that stream's first message may
//! have waited one pace).
//!
//! NOTE: Envoy opens a connection per cluster and worker. The shipped config gives the
//! observing filter a cluster of its own (`kvpick-observe`, the same address), so observing
//! streams have connections of their own. Where both filters share a cluster, a
//! connection's first stream is a routing one (a request is routed before its response is
//! observed) and nothing is paced, as before.
//!
//! Concurrency: the socket belongs to its connection's task; what the streams report
//! ([`ConnectionUse`]) is read at each read.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::{IntGaugeVec, Opts, Registry};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::extproc::connection_use::{Carried, ConnectionUse};

/// The low-water mark while a pace runs: queued bytes that wake the lane before the pace
/// ends, so a burst is read in pieces of this size and never waits for the timer.
pub const LOW_WATER: usize = 32 * 1024;

/// `kvpick_extproc_connections`: open ext-proc connections by what they carried.
#[derive(Clone)]
pub struct ConnectionMetrics {
    open: IntGaugeVec,
}

impl ConnectionMetrics {
    /// Creates and registers the metric.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let open = IntGaugeVec::new(
            Opts::new(
                "kvpick_extproc_connections",
                "Open ext-proc connections, by what they carried: `routing` (a routing stream), \
                 `observing` (only observing streams; read at --observe-read-pace), `new` (no stream yet)",
            ),
            &["carried"],
        )?;
        registry.register(Box::new(open.clone()))?;
        Ok(Self { open })
    }

    /// A gauge outside any registry.
    #[cfg(test)]
    pub fn unregistered() -> Self {
        Self::new(&Registry::new()).unwrap_or_else(|_| unreachable!("a fresh registry"))
    }

    /// Connections counted as `carried` now.
    #[cfg(test)]
    pub fn open(&self, carried: Carried) -> i64 {
        self.open.with_label_values(&[carried.label()]).get()
    }

    fn add(&self, carried: Carried, delta: i64) {
        self.open.with_label_values(&[carried.label()]).add(delta);
    }
}

/// A connection's TCP socket, its reads paced while it only carries observing streams.
pub struct PacedSocket {
    stream: TcpStream,
    connection: ConnectionUse,
    /// One pace (zero: never paced).
    pace: Duration,
    /// The mark is raised and `flush` runs.
    raised: bool,
    /// The end of the pace; polled only while `raised`.
    flush: Pin<Box<Sleep>>,
    /// What the gauge counts this connection as.
    counted: Carried,
    metrics: ConnectionMetrics,
}

impl PacedSocket {
    /// `stream`, paced by `pace` once `connection` reports observing streams only (must be
    /// called on a runtime with time enabled).
    pub fn new(
        stream: TcpStream,
        connection: ConnectionUse,
        pace: Duration,
        metrics: ConnectionMetrics,
    ) -> Self {
        let counted = connection.carried();
        metrics.add(counted, 1);
        Self {
            stream,
            connection,
            pace,
            raised: false,
            flush: Box::pin(tokio::time::sleep_until(Instant::now())),
            counted,
            metrics,
        }
    }

    /// The socket underneath.
    #[cfg(test)]
    pub fn get_ref(&self) -> &TcpStream {
        &self.stream
    }

    fn recount(&mut self, carried: Carried) {
        self.metrics.add(self.counted, -1);
        self.metrics.add(carried, 1);
        self.counted = carried;
    }

    /// Raises the mark and starts a pace; a socket that refuses the mark is not paced.
    fn raise(&mut self) {
        match set_low_water(self.stream.as_raw_fd(), LOW_WATER) {
            Ok(()) => {
                self.raised = true;
                self.flush.as_mut().reset(Instant::now() + self.pace);
            }
            Err(error) => {
                tracing::warn!(%error, "ext-proc socket refused a receive low-water mark; not paced");
                self.pace = Duration::ZERO;
            }
        }
    }

    /// Lowers the mark to one byte: whatever is queued becomes readable (signalled at once).
    fn lower(&mut self) {
        self.raised = false;
        if let Err(error) = set_low_water(self.stream.as_raw_fd(), 1) {
            // NOTE: a socket that took the mark but refuses to lower it is broken; bytes
            // below the mark would be read only with the next LOW_WATER bytes or the close.
            tracing::warn!(%error, "ext-proc socket refused to lower its receive low-water mark");
        }
    }
}

impl Drop for PacedSocket {
    fn drop(&mut self) {
        self.metrics.add(self.counted, -1);
    }
}

/// Sets `SO_RCVLOWAT` on `fd`.
fn set_low_water(fd: RawFd, bytes: usize) -> io::Result<()> {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: `fd` is an open socket owned by the caller for the call's duration, and the
    // option's value is a `c_int` passed with its size, as SO_RCVLOWAT expects.
    let done = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl AsyncRead for PacedSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let carried = this.connection.carried();
        if carried != this.counted {
            this.recount(carried);
        }
        if carried != Carried::Observing || this.pace.is_zero() {
            if this.raised {
                this.lower();
            }
            return Pin::new(&mut this.stream).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && !this.raised {
                    this.raise();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => {
                // Nothing readable at the mark. This task is registered for the socket's
                // readiness (LOW_WATER bytes, the close) by the read above, and for the
                // pace's end here; at the end the lowered mark signals what is queued.
                if this.raised && this.flush.as_mut().poll(cx).is_ready() {
                    this.lower();
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for PacedSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    //! Real loopback sockets, the kernel's low-water mark, tokio's paused clock: a read that
    //! would complete is polled before the clock advances, so "not read within half a pace"
    //! means the kernel did not signal the socket, not that the test was slow.

    use std::io::Write;
    use std::net::TcpStream as StdStream;

    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;
    use tokio::time::timeout;

    use super::*;

    const PACE: Duration = Duration::from_millis(40);

    /// A paced socket and the peer writing to it (a plain blocking socket).
    async fn pair(
        carried: &ConnectionUse,
        metrics: &ConnectionMetrics,
    ) -> (PacedSocket, StdStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let peer = StdStream::connect(address).expect("connect");
        peer.set_nodelay(true).expect("nodelay");
        let (stream, _) = listener.accept().await.expect("accept");
        let socket = PacedSocket::new(stream, carried.clone(), PACE, metrics.clone());
        (socket, peer)
    }

    /// Bytes queued on `socket` (FIONREAD), once the kernel has `at_least` of them.
    fn queued(socket: &PacedSocket, at_least: usize) -> usize {
        let fd = socket.get_ref().as_raw_fd();
        for _ in 0..100_000 {
            let mut bytes: libc::c_int = 0;
            // SAFETY: FIONREAD writes one c_int to the pointer given.
            let done = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut bytes) };
            assert_eq!(done, 0, "FIONREAD");
            if usize::try_from(bytes).unwrap_or(0) >= at_least {
                return usize::try_from(bytes).unwrap_or(0);
            }
            std::thread::yield_now();
        }
        panic!("the peer's bytes never arrived");
    }

    /// Whether the kernel reports `socket` readable now (what wakes a waiting thread).
    fn readable(socket: &PacedSocket) -> bool {
        let mut poll = libc::pollfd {
            fd: socket.get_ref().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, a zero timeout.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        assert!(ready >= 0, "poll");
        poll.revents & libc::POLLIN != 0
    }

    async fn read_some(socket: &mut PacedSocket) -> Vec<u8> {
        let mut buf = vec![0; 4 * LOW_WATER];
        let n = socket.read(&mut buf).await.expect("read");
        buf.truncate(n);
        buf
    }

    #[tokio::test(start_paused = true)]
    async fn an_observing_connection_gathers_small_messages_for_a_pace_and_loses_none() {
        let carried = ConnectionUse::default();
        carried.report(true);
        let metrics = ConnectionMetrics::unregistered();
        let (mut socket, mut peer) = pair(&carried, &metrics).await;

        // A quiet connection's first message is read at once.
        peer.write_all(b"first").expect("write");
        let first = timeout(PACE / 2, read_some(&mut socket)).await;
        assert_eq!(first.expect("read at once"), b"first");

        // The messages right after it wait for the pace: queued, yet not signalled.
        let started = Instant::now();
        let mut sent = Vec::new();
        for chunk in 0..10 {
            let message = format!("chunk {chunk};");
            peer.write_all(message.as_bytes()).expect("write");
            sent.extend_from_slice(message.as_bytes());
        }
        assert_eq!(queued(&socket, sent.len()), sent.len());
        assert!(
            !readable(&socket),
            "the raised mark holds the socket unreadable"
        );
        assert!(
            timeout(PACE / 2, read_some(&mut socket)).await.is_err(),
            "read before the pace ended"
        );
        // At the pace's end all of them arrive, in one read.
        let gathered = timeout(PACE, read_some(&mut socket)).await;
        assert_eq!(gathered.expect("read at the pace's end"), sent);
        assert!(started.elapsed() >= PACE);

        // Nothing came during the next pace: a message after it is read at once again.
        let quiet = tokio::time::sleep(PACE * 2);
        let nothing = timeout(PACE * 2, read_some(&mut socket));
        assert!(nothing.await.is_err());
        quiet.await;
        peer.write_all(b"later").expect("write");
        let later = timeout(PACE / 2, read_some(&mut socket)).await;
        assert_eq!(later.expect("read at once"), b"later");
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_or_the_peers_close_is_read_before_the_pace_ends() {
        let carried = ConnectionUse::default();
        carried.report(true);
        let metrics = ConnectionMetrics::unregistered();
        let (mut socket, mut peer) = pair(&carried, &metrics).await;
        peer.write_all(b"first").expect("write");
        assert_eq!(read_some(&mut socket).await, b"first");

        // LOW_WATER bytes wake the reader at once.
        let burst = vec![7u8; LOW_WATER + 100];
        peer.write_all(&burst).expect("write");
        queued(&socket, burst.len());
        let mut got = timeout(PACE / 2, read_some(&mut socket))
            .await
            .expect("a burst is read at once");
        while got.len() < burst.len() {
            got.extend(read_some(&mut socket).await);
        }
        assert_eq!(got, burst);

        // So does the close, with a message below the mark before it.
        peer.write_all(b"last").expect("write");
        drop(peer);
        let mut rest = Vec::new();
        loop {
            let read = timeout(PACE / 2, read_some(&mut socket))
                .await
                .expect("the close is read at once");
            if read.is_empty() {
                break;
            }
            rest.extend(read);
        }
        assert_eq!(rest, b"last");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_carries_a_routing_stream_is_never_paced() {
        let metrics = ConnectionMetrics::unregistered();
        // Routing from the start: every message is read at once.
        let routing = ConnectionUse::default();
        routing.report(false);
        let (mut socket, mut peer) = pair(&routing, &metrics).await;
        for message in [&b"one"[..], b"two", b"three"] {
            peer.write_all(message).expect("write");
            let read = timeout(PACE / 2, read_some(&mut socket)).await;
            assert_eq!(read.expect("read at once"), message);
        }

        // Observing first, then a routing stream: pacing ends with the pace then running.
        let carried = ConnectionUse::default();
        carried.report(true);
        let (mut socket, mut peer) = pair(&carried, &metrics).await;
        peer.write_all(b"observed").expect("write");
        assert_eq!(read_some(&mut socket).await, b"observed");
        peer.write_all(b"held").expect("write");
        queued(&socket, 4);
        assert!(!readable(&socket));
        carried.report(false);
        let read = timeout(PACE / 2, read_some(&mut socket)).await;
        assert_eq!(read.expect("read at once"), b"held");
        peer.write_all(b"routed").expect("write");
        let read = timeout(PACE / 2, read_some(&mut socket)).await;
        assert_eq!(read.expect("read at once"), b"routed");
    }

    #[tokio::test(start_paused = true)]
    async fn open_connections_are_counted_by_what_they_carried() {
        let metrics = ConnectionMetrics::unregistered();
        let carried = ConnectionUse::default();
        let (mut socket, mut peer) = pair(&carried, &metrics).await;
        assert_eq!(metrics.open(Carried::Nothing), 1);
        carried.report(true);
        peer.write_all(b"x").expect("write");
        read_some(&mut socket).await;
        assert_eq!(metrics.open(Carried::Nothing), 0);
        assert_eq!(metrics.open(Carried::Observing), 1);
        carried.report(false);
        peer.write_all(b"y").expect("write");
        read_some(&mut socket).await;
        assert_eq!(metrics.open(Carried::Observing), 0);
        assert_eq!(metrics.open(Carried::Routing), 1);
        drop(socket);
        assert_eq!(metrics.open(Carried::Routing), 0);
    }
}
