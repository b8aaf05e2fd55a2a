//! The ext-proc server's connections: plain TCP, or TLS handshaken on a task per connection
//! (a slow or silent client cannot hold up accepting others), bounded in number and time.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use prometheus::{IntCounterVec, Opts, Registry};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Longest a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; past it, accepting waits.
pub const MAX_HANDSHAKES: usize = 256;
/// Handshaken connections waiting for the server to take them.
const READY_QUEUE: usize = 64;

/// TLS metrics (`kvpick_tls_*`).
#[derive(Clone)]
pub struct TlsMetrics {
    /// Handshakes by result (`ok`, `failed`, `timeout`).
    pub handshakes: IntCounterVec,
    /// Certificate reloads by result (`ok`, `invalid`).
    pub reloads: IntCounterVec,
}

impl TlsMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let handshakes = IntCounterVec::new(
            Opts::new(
                "kvpick_tls_handshakes_total",
                "TLS handshakes on the ext-proc port, by result",
            ),
            &["result"],
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "kvpick_tls_cert_reloads_total",
                "Changed certificate files seen by --enable-cert-reload, by result (invalid: the last good pair stays)",
            ),
            &["result"],
        )?;
        registry.register(Box::new(handshakes.clone()))?;
        registry.register(Box::new(reloads.clone()))?;
        Ok(Self {
            handshakes,
            reloads,
        })
    }
}

/// One ext-proc connection.
pub enum Conn {
    /// Plain TCP (h2c).
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Self::Plain(stream) => stream.connect_info(),
            Self::Tls(stream) => stream.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(stream) => stream.is_write_vectored(),
            Self::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The connections of `listener`: plain, or TLS with `tls`.
pub fn incoming(
    listener: TcpListener,
    tls: Option<(Arc<rustls::ServerConfig>, TlsMetrics)>,
) -> BoxStream<'static, io::Result<Conn>> {
    let Some((config, metrics)) = tls else {
        return tokio_stream::wrappers::TcpListenerStream::new(listener)
            .map(|accepted| {
                let stream = accepted?;
                stream.set_nodelay(true)?;
                Ok(Conn::Plain(stream))
            })
            .boxed();
    };
    let (ready, rx) = mpsc::channel(READY_QUEUE);
    tokio::spawn(accept_tls(
        listener,
        TlsAcceptor::from(config),
        metrics,
        ready,
    ));
    tokio_stream::wrappers::ReceiverStream::new(rx).boxed()
}

/// Accepts until the server drops its end, handshaking each connection on its own task.
async fn accept_tls(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    metrics: TlsMetrics,
    ready: mpsc::Sender<io::Result<Conn>>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let permit = tokio::select! {
            () = ready.closed() => return,
            permit = Arc::clone(&handshakes).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            () = ready.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors and the like: pause instead of spinning.
                tracing::warn!(%error, "ext-proc accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (acceptor, metrics, ready) = (acceptor.clone(), metrics.clone(), ready.clone());
        tokio::spawn(async move {
            let _permit = permit;
            if let Some(tls) = handshake(&acceptor, stream, &metrics).await {
                let _ = ready.send(Ok(Conn::Tls(Box::new(tls)))).await;
            }
        });
    }
}

/// Handshakes one accepted connection within [`HANDSHAKE_TIMEOUT`], counting the result;
/// `None` when it failed or timed out (logged at debug: a client's problem, not ours).
pub async fn handshake(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
    metrics: &TlsMetrics,
) -> Option<TlsStream<TcpStream>> {
    let peer = stream.peer_addr().ok();
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => {
            metrics.handshakes.with_label_values(&["ok"]).inc();
            Some(tls)
        }
        Ok(Err(error)) => {
            metrics.handshakes.with_label_values(&["failed"]).inc();
            tracing::debug!(%error, ?peer, "ext-proc TLS handshake failed");
            None
        }
        Err(_) => {
            metrics.handshakes.with_label_values(&["timeout"]).inc();
            tracing::debug!(?peer, "ext-proc TLS handshake timed out");
            None
        }
    }
}
