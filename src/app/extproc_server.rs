//! The ext-proc gRPC server: HTTP/2 connections accepted here, each served for its whole
//! life by one of a few single-threaded runtimes (`--extproc-threads`, one per core by
//! default), the connections dealt round-robin.
//!
//! Why: on the shared multi-threaded runtime a request's messages crossed threads. The h2
//! connection's task and each stream's task are separate tasks, and a work-stealing worker
//! often picked up the one the other had just woken, so every message cost a futex wake-up
//! and a park each way (~5 voluntary context switches per 8 KB request, and a response
//! streamed through ext-proc has one message per token). On a connection's own thread the
//! socket's readiness, the h2 connection task and its streams' tasks are all local: a
//! message is an `epoll_wait`, a read, the handling and a write. Connections still spread
//! over the cores (a gateway opens one per worker thread). What is heavy stays off these
//! threads as before: large bodies are prepared and long routing records applied on the
//! blocking pool.
//!
//! With `--extproc-threads 0` the connections are served on the shared runtime instead.
//!
//! Shutdown: when `drain` is cancelled the listener closes (new connections are refused),
//! every connection is asked to finish (HTTP/2 GOAWAY: open streams complete, no new ones)
//! and [`serve`] returns once all have closed. Dropping the [`serve`] future (the drain
//! timeout) stops the threads, closing whatever is still open.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::extproc::ExtProcService;
use crate::tls::{Conn, TlsMetrics};

/// The service every connection serves.
pub type Service = ExternalProcessorServer<ExtProcService>;

/// How the server is run.
pub struct Settings {
    /// Single-threaded runtimes serving connections (0: the shared runtime).
    pub threads: usize,
    /// HTTP/2 streams a connection may have open at once.
    pub max_streams: u32,
    /// TLS for the port, with its handshake metrics.
    pub tls: Option<(Arc<rustls::ServerConfig>, TlsMetrics)>,
}

/// Serves `listener` until `drain` is cancelled and every connection has closed.
pub async fn serve(
    listener: TcpListener,
    service: Service,
    settings: Settings,
    drain: CancellationToken,
) -> io::Result<()> {
    let lanes = Lanes::start(settings.threads)?;
    let tls = settings
        .tls
        .map(|(config, metrics)| (TlsAcceptor::from(config), metrics));
    let handshakes = Arc::new(Semaphore::new(crate::tls::incoming::MAX_HANDSHAKES));
    let connection = Arc::new(ConnectionSettings {
        service,
        max_streams: settings.max_streams,
        tls,
    });
    // Each connection holds a receiver: the send asks them to finish, `closed` says they have.
    let (finish, finishing) = watch::channel(());
    loop {
        // A TLS connection holds a handshake place until its handshake is over; past
        // MAX_HANDSHAKES accepting waits.
        let permit = match &connection.tls {
            None => None,
            Some(_) => tokio::select! {
                () = drain.cancelled() => break,
                permit = Arc::clone(&handshakes).acquire_owned() => permit.ok(),
            },
        };
        let stream = tokio::select! {
            () = drain.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors and the like: pause instead of spinning.
                    tracing::warn!(%error, "ext-proc accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "ext-proc connection gone before it was served");
            continue;
        }
        let connection = Arc::clone(&connection);
        let finishing = finishing.clone();
        match &lanes {
            Some(lanes) => match stream.into_std() {
                // The socket leaves this runtime's reactor and joins the lane's (in the task).
                Ok(stream) => {
                    let accepted = Accepted::Std(stream);
                    lanes
                        .next()
                        .spawn(serve_connection(connection, finishing, permit, accepted));
                }
                Err(error) => tracing::debug!(%error, "ext-proc connection not handed over"),
            },
            None => {
                let accepted = Accepted::Tokio(stream);
                tokio::spawn(serve_connection(connection, finishing, permit, accepted));
            }
        }
    }
    // Stop accepting at once: the kernel refuses new connections instead of queueing them.
    drop(listener);
    let _ = finish.send(());
    drop(finishing);
    finish.closed().await;
    drop(lanes);
    Ok(())
}

/// What every connection shares.
struct ConnectionSettings {
    service: Service,
    max_streams: u32,
    tls: Option<(TlsAcceptor, TlsMetrics)>,
}

/// An accepted socket: still on the accepting runtime, or detached to join a lane's.
enum Accepted {
    Tokio(TcpStream),
    Std(std::net::TcpStream),
}

/// Serves one connection (on its lane: the socket joins the lane's reactor here).
async fn serve_connection(
    settings: Arc<ConnectionSettings>,
    mut finishing: watch::Receiver<()>,
    handshake: Option<OwnedSemaphorePermit>,
    accepted: Accepted,
) {
    let stream = match accepted {
        Accepted::Tokio(stream) => stream,
        Accepted::Std(stream) => match TcpStream::from_std(stream) {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%error, "ext-proc connection could not join its thread");
                return;
            }
        },
    };
    let io = match &settings.tls {
        None => Conn::Plain(stream),
        Some((acceptor, metrics)) => {
            let tls = crate::tls::incoming::handshake(acceptor, stream, metrics).await;
            drop(handshake);
            match tls {
                Some(tls) => Conn::Tls(Box::new(tls)),
                None => return,
            }
        }
    };
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(settings.max_streams);
    let service = TowerToHyperService::new(settings.service.clone());
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let mut asked = false;
    loop {
        tokio::select! {
            served = &mut connection => {
                if let Err(error) = served {
                    tracing::debug!(%error, "ext-proc connection ended with an error");
                }
                return;
            }
            _ = finishing.changed(), if !asked => {
                asked = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The single-threaded runtimes connections are dealt to; dropping it stops them (and
/// closes the connections still on them).
struct Lanes {
    handles: Vec<Handle>,
    turn: AtomicUsize,
    _stop: DropGuard,
}

impl Lanes {
    /// `threads` runtimes on their own threads (`None` for 0: the shared runtime serves).
    fn start(threads: usize) -> io::Result<Option<Self>> {
        if threads == 0 {
            return Ok(None);
        }
        let stop = CancellationToken::new();
        let mut handles = Vec::with_capacity(threads);
        for lane in 0..threads {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .thread_name("ext-proc-pool")
                .build()?;
            handles.push(runtime.handle().clone());
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("ext-proc-{lane}"))
                .spawn(move || {
                    runtime.block_on(stop.cancelled());
                    // NOTE: without waiting for this runtime's blocking work (a long routing
                    // record in progress): the process is ending.
                    runtime.shutdown_background();
                })?;
        }
        Ok(Some(Self {
            handles,
            turn: AtomicUsize::new(0),
            _stop: stop.drop_guard(),
        }))
    }

    /// The lane for the next connection.
    fn next(&self) -> &Handle {
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        &self.handles[turn % self.handles.len()]
    }
}
