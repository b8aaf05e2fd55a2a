//! A model-server stand-in: records what it receives and answers with who it is.
//!
//! `POST /hold` answers headers and a first chunk at once, then holds the rest of the body
//! until the test calls [`Backend::release`], so a test can keep a request in flight.
//! [`Backend::stop`] closes the listener and every open connection (a dead pod: connects
//! are refused); [`Backend::restart`] listens on the same address again.
//! [`Backend::blackhole`] plays a pod whose host went silent: its connections close and new
//! connects hang (the accept queue is shrunk to nothing and filled, so the kernel drops every
//! further SYN, as a dead node's network does); [`Backend::unblackhole`] undoes it.
//! `GET /metrics` and `/metrics/` (kvpick's scrapes) answer an idle vLLM's metrics (or what
//! [`Backend::set_metrics`] set) and are not recorded.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// One request as the backend saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

struct Shared {
    seen: Mutex<Vec<Seen>>,
    released: watch::Sender<bool>,
    /// Cancelled by `stop`: ends the accept loop and every connection.
    running: Mutex<CancellationToken>,
    /// A child of `running` that the connections watch (`blackhole` cancels only them).
    connections: Mutex<CancellationToken>,
    /// The listener while it runs (the accept loop holds the other reference, so `stop`
    /// closes it).
    listener: Mutex<Option<Arc<TcpListener>>>,
    /// Whether the accept loop is paused (`blackhole`).
    blackholed: watch::Sender<bool>,
    /// Connections parked in the accept queue to fill it (`blackhole`).
    fillers: Mutex<Vec<tokio::net::TcpStream>>,
    metrics: Mutex<String>,
    /// Whether `GET /metrics/` is answered (else 404: a server without vLLM's by-name app).
    metrics_by_name: std::sync::atomic::AtomicBool,
}

/// A running backend.
#[derive(Clone)]
pub struct Backend {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

/// A pool file (DESIGN §2.1) listing `backends`.
pub fn pool_yaml(backends: &[&Backend]) -> String {
    let mut yaml = String::from("endpoints:\n");
    for b in backends {
        yaml.push_str(&format!("  - address: {}\n", b.addr));
    }
    yaml
}

impl Backend {
    /// Starts a backend on `ip` (any loopback address) and a free port.
    pub async fn start(ip: &str) -> Backend {
        let listener = TcpListener::bind((ip, 0)).await.expect("bind backend");
        let addr = listener.local_addr().expect("addr");
        let shared = Arc::new(Shared {
            seen: Mutex::new(Vec::new()),
            released: watch::Sender::new(false),
            running: Mutex::new(CancellationToken::new()),
            connections: Mutex::new(CancellationToken::new()),
            listener: Mutex::new(None),
            blackholed: watch::Sender::new(false),
            fillers: Mutex::new(Vec::new()),
            metrics: Mutex::new(IDLE_VLLM_METRICS.to_owned()),
            metrics_by_name: std::sync::atomic::AtomicBool::new(true),
        });
        let backend = Backend {
            addr,
            shared: Arc::clone(&shared),
        };
        backend.serve(listener);
        backend
    }

    fn serve(&self, listener: TcpListener) {
        let (addr, shared) = (self.addr, Arc::clone(&self.shared));
        let running = shared.running.lock().expect("lock").clone();
        *shared.connections.lock().expect("lock") = running.child_token();
        let listener = Arc::new(listener);
        *shared.listener.lock().expect("lock") = Some(Arc::clone(&listener));
        let mut blackholed = shared.blackholed.subscribe();
        tokio::spawn(async move {
            loop {
                if *blackholed.borrow_and_update() {
                    tokio::select! {
                        _ = running.cancelled() => return,
                        _ = blackholed.changed() => continue,
                    }
                }
                let accepted = tokio::select! {
                    _ = running.cancelled() => return,
                    _ = blackholed.changed() => continue,
                    accepted = listener.accept() => accepted,
                };
                let Ok((stream, _)) = accepted else {
                    return;
                };
                let shared = Arc::clone(&shared);
                let closed = shared.connections.lock().expect("lock").clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| handle(addr, Arc::clone(&shared), req));
                    let connection = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = closed.cancelled() => {}
                        _ = connection => {}
                    }
                });
            }
        });
    }

    /// Closes the listener and every connection: from now on connects are refused.
    pub fn stop(&self) {
        self.shared.listener.lock().expect("lock").take();
        self.shared.running.lock().expect("lock").cancel();
    }

    /// Listens again on the same address after [`Backend::stop`].
    pub async fn restart(&self) {
        *self.shared.running.lock().expect("lock") = CancellationToken::new();
        // The old listener is dropped by its task, a moment after `stop`.
        for _ in 0..250 {
            if let Ok(listener) = TcpListener::bind(self.addr).await {
                self.serve(listener);
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("cannot listen on {} again", self.addr);
    }

    /// From now on the pod's host answers nothing: no new connection completes (connects
    /// time out) and the open ones are closed.
    pub async fn blackhole(&self) {
        let listener = self
            .shared
            .listener
            .lock()
            .expect("lock")
            .clone()
            .expect("a running backend");
        self.shared.blackholed.send_replace(true);
        // A listening socket may listen again: Linux then only changes its backlog. With a
        // backlog of 0 one queued connection fills the queue, and a full queue drops SYNs.
        socket2::SockRef::from(&*listener)
            .listen(0)
            .expect("shrink the accept queue");
        let mut fillers = Vec::new();
        for _ in 0..4 {
            match tokio::time::timeout(
                std::time::Duration::from_millis(100),
                tokio::net::TcpStream::connect(self.addr),
            )
            .await
            {
                Ok(Ok(stream)) => fillers.push(stream),
                _ => break,
            }
        }
        assert!(!fillers.is_empty(), "the accept queue took no connection");
        *self.shared.fillers.lock().expect("lock") = fillers;
        self.shared.connections.lock().expect("lock").cancel();
    }

    /// Undoes [`Backend::blackhole`]: connects complete and are served again.
    pub fn unblackhole(&self) {
        let listener = self.shared.listener.lock().expect("lock").clone();
        let listener = listener.expect("a running backend");
        let running = self.shared.running.lock().expect("lock").clone();
        *self.shared.connections.lock().expect("lock") = running.child_token();
        socket2::SockRef::from(&*listener)
            .listen(1024)
            .expect("restore the accept queue");
        self.shared.fillers.lock().expect("lock").clear();
        self.shared.blackholed.send_replace(false);
    }

    /// Everything received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().expect("lock").clone()
    }

    /// What `GET /metrics` answers from now on (vLLM text format).
    pub fn set_metrics(&self, text: &str) {
        *self.shared.metrics.lock().expect("lock") = text.to_owned();
    }

    /// Answers `GET /metrics/` with 404 from now on, as a server without vLLM's by-name
    /// metrics app does.
    pub fn refuse_metrics_by_name(&self) {
        self.shared
            .metrics_by_name
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Lets held `/hold` responses finish.
    pub fn release(&self) {
        self.shared.released.send_replace(true);
    }
}

type Body = BoxBody<Bytes, Infallible>;

/// What an idle vLLM reports (enough for kvpick's scrape to count the pod as fresh).
pub const IDLE_VLLM_METRICS: &str = "vllm:num_requests_waiting{model_name=\"m\"} 0.0\n\
    vllm:num_requests_running{model_name=\"m\"} 0.0\n\
    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.0\n";

async fn handle(
    addr: SocketAddr,
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    // `/metrics/` is where vLLM answers metrics by name (kvpick's scrapes ask there first);
    // the whole idle page is a valid answer to it too.
    if req.method() == hyper::Method::GET
        && path == "/metrics/"
        && !shared
            .metrics_by_name
            .load(std::sync::atomic::Ordering::SeqCst)
    {
        return Ok(Response::builder()
            .status(404)
            .body(BodyExt::boxed(http_body_util::Full::new(Bytes::new())))
            .expect("response"));
    }
    if req.method() == hyper::Method::GET && (path == "/metrics" || path == "/metrics/") {
        return Ok(Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(BodyExt::boxed(http_body_util::Full::new(Bytes::from(
                shared.metrics.lock().expect("lock").clone(),
            ))))
            .expect("response"));
    }
    let headers = req.headers().clone();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    // The model the request named, echoed as a model server does (for rewrite restores).
    let model = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["model"].as_str().map(str::to_owned));
    let answer = serde_json::json!({
        "backend": addr.to_string(),
        "bytes": body.len(),
        "model": model,
    })
    .to_string();
    shared.seen.lock().expect("lock").push(Seen {
        path: path.clone(),
        headers,
        body,
    });
    if path == "/hold" {
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
        let mut released = shared.released.subscribe();
        tokio::spawn(async move {
            let _ = tx
                .send(Ok(Frame::data(Bytes::from("data: first\n\n"))))
                .await;
            let _ = released.wait_for(|released| *released).await;
            let _ = tx
                .send(Ok(Frame::data(Bytes::from("data: [DONE]\n\n"))))
                .await;
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        return Ok(Response::builder()
            .header("content-type", "text/event-stream")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .expect("response"));
    }
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(BodyExt::boxed(http_body_util::Full::new(Bytes::from(
            answer,
        ))))
        .expect("response"))
}
