//! One pod's `/metrics` connection: HTTP/1.1, kept alive between scrapes, and driven by that
//! pod's scrape task itself.
//!
//! Why not hyper's pooled client: it runs every connection as a task of its own and hands
//! each request to it and each response back (a pool checkout, channels, two tasks woken per
//! scrape), for 20 scrapes a second per pod. A scrape task talks to one address, one request
//! at a time, so it owns its connection and polls it while it waits for its answer; between
//! scrapes nothing runs. `cargo bench --bench scrape` prices a scrape; docs/benchmarks.md
//! (session 21) has it against the pooled client.
//!
//! Concurrency rules: a [`MetricsConnection`] belongs to one task and is used by `&mut`; a
//! GET that does not end in a complete 200 answer (timeout, error, other status, body over
//! the limit) drops the connection, so no answer of one scrape is ever read by the next.
//! A kept-alive connection the pod closed while it sat idle is noticed before it is used;
//! one that breaks during a GET is retried once on a new connection (a GET changes
//! nothing), so a pod that closes idle connections costs no failed scrape.

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::error::ScrapeError;

type Driver = http1::Connection<TokioIo<TcpStream>, Empty<Bytes>>;

/// An open connection: the request half, and the future that reads and writes the socket
/// (`None` once it ended: the connection is then used up by the GET in progress).
struct Open {
    sender: http1::SendRequest<Empty<Bytes>>,
    driver: Option<Pin<Box<Driver>>>,
}

/// One pod's metrics endpoint and the connection to it, if one is open.
pub struct MetricsConnection {
    target: SocketAddr,
    path: hyper::Uri,
    host: hyper::header::HeaderValue,
    timeout: Duration,
    max_body_bytes: usize,
    open: Option<Open>,
    /// Whether a GET is connecting (what a timeout then means: the pod was never reached).
    connecting: bool,
}

/// `path` as the target of a GET: a path (and query) without scheme or host.
fn url_path(path: &str) -> Result<hyper::Uri, ScrapeError> {
    path.parse::<hyper::Uri>()
        .ok()
        .filter(|uri| uri.scheme().is_none() && uri.path().starts_with('/'))
        .ok_or_else(|| ScrapeError::Http(format!("`{path}` is not a URL path")))
}

impl MetricsConnection {
    /// A connection to `target` for GETs of `path` (no socket yet: the first GET opens it).
    /// `timeout` bounds each GET, connecting included; bodies over `max_body_bytes` fail.
    pub fn new(
        target: SocketAddr,
        path: &str,
        timeout: Duration,
        max_body_bytes: usize,
    ) -> Result<Self, ScrapeError> {
        let path = url_path(path)?;
        let host = hyper::header::HeaderValue::from_str(&target.to_string())
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        Ok(Self {
            target,
            path,
            host,
            timeout,
            max_body_bytes,
            open: None,
            connecting: false,
        })
    }

    /// GETs `path` from now on (from the same server).
    pub fn set_path(&mut self, path: &str) -> Result<(), ScrapeError> {
        self.path = url_path(path)?;
        Ok(())
    }

    /// The address GETs go to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// GETs the path: the body of a 200 answer.
    pub async fn get(&mut self) -> Result<Bytes, ScrapeError> {
        let result = match tokio::time::timeout(self.timeout, self.get_retrying_once()).await {
            Ok(result) => result,
            Err(_) if self.connecting => Err(ScrapeError::ConnectTimeout),
            Err(_) => Err(ScrapeError::Timeout),
        };
        self.connecting = false;
        if result.is_err() {
            // Whatever the GET left on the connection (a request half sent, an answer half
            // read) must not meet the next one.
            self.open = None;
        }
        result
    }

    async fn get_retrying_once(&mut self) -> Result<Bytes, ScrapeError> {
        let reused = self.open_or_reuse().await?;
        match self.exchange().await {
            Err(ScrapeError::Http(_) | ScrapeError::Connect(_)) if reused => {
                tracing::debug!(metrics_at = %self.target, "metrics connection broke; retrying on a new one");
                self.open = None;
                self.open_or_reuse().await?;
                self.exchange().await
            }
            result => result,
        }
    }

    /// Makes sure a connection is open; whether it was one kept from an earlier GET.
    async fn open_or_reuse(&mut self) -> Result<bool, ScrapeError> {
        if let Some(Open {
            driver: Some(driver),
            ..
        }) = &mut self.open
        {
            // One poll of the idle driver: an idle connection's driver only finishes (or
            // fails) when the pod closed or broke it.
            let alive =
                std::future::poll_fn(|cx| Poll::Ready(driver.as_mut().poll(cx).is_pending())).await;
            if alive {
                return Ok(true);
            }
            self.open = None;
        }
        self.connecting = true;
        let stream = TcpStream::connect(self.target)
            .await
            .map_err(|e| connection_error(&e, e.to_string()))?;
        self.connecting = false;
        if let Err(error) = stream.set_nodelay(true) {
            // Only latency is at stake (as hyper's own connector treats it).
            tracing::debug!(metrics_at = %self.target, %error, "metrics connection without TCP_NODELAY");
        }
        let (sender, driver) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| hyper_error(&e))?;
        self.open = Some(Open {
            sender,
            driver: Some(Box::pin(driver)),
        });
        Ok(false)
    }

    /// One GET on the open connection, polling its driver while the answer comes.
    async fn exchange(&mut self) -> Result<Bytes, ScrapeError> {
        let Some(Open { sender, driver }) = &mut self.open else {
            return Err(ScrapeError::Http("no open connection".to_owned()));
        };
        let request = hyper::Request::get(self.path.clone())
            .header(hyper::header::HOST, self.host.clone())
            .body(Empty::new())
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        let mut driver_error = None;
        let result = {
            let answer = fetch(sender, request, self.max_body_bytes);
            tokio::pin!(answer);
            loop {
                let Some(running) = driver.as_mut() else {
                    break answer.as_mut().await;
                };
                let ended = tokio::select! {
                    biased;
                    result = answer.as_mut() => break result,
                    ended = running.as_mut() => ended,
                };
                // The connection is over: the pod closed or reset it, or sent bytes after its
                // answer. Dropping the driver hands the outcome to the answer: one already read
                // completes, one cut off (or never sent) fails at once instead of waiting out
                // the timeout. A failed driver's error is kept: it names a reset as such.
                *driver = None;
                if let Err(error) = ended {
                    driver_error = Some(hyper_error(&error));
                }
            }
        };
        let used_up = self.open.as_ref().is_none_or(|open| open.driver.is_none());
        if used_up {
            self.open = None;
        }
        result.map_err(|answer_error| driver_error.unwrap_or(answer_error))
    }
}

async fn fetch(
    sender: &mut http1::SendRequest<Empty<Bytes>>,
    request: hyper::Request<Empty<Bytes>>,
    max_body_bytes: usize,
) -> Result<Bytes, ScrapeError> {
    sender.ready().await.map_err(|e| hyper_error(&e))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| hyper_error(&e))?;
    if response.status() != hyper::StatusCode::OK {
        return Err(ScrapeError::Status(response.status().as_u16()));
    }
    Limited::new(response.into_body(), max_body_bytes)
        .collect()
        .await
        .map(|body| body.to_bytes())
        .map_err(|e| ScrapeError::Body(e.to_string()))
}

/// Whether `error` (or what caused it) says nothing listens at the address: refused, reset,
/// aborted or unroutable. Timeouts are not: a slow pod is not a gone pod.
fn is_connection_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind;
    let mut current = Some(error);
    while let Some(error) = current {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::NotConnected
                    | ErrorKind::HostUnreachable
                    | ErrorKind::NetworkUnreachable
            );
        }
        current = error.source();
    }
    false
}

fn connection_error(error: &(dyn std::error::Error + 'static), message: String) -> ScrapeError {
    if is_connection_failure(error) {
        ScrapeError::Connect(message)
    } else {
        ScrapeError::Http(message)
    }
}

fn hyper_error(error: &hyper::Error) -> ScrapeError {
    // hyper's Display names the kind ("connection closed before message completed"); the
    // cause, when there is one, is below.
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    connection_error(error, message)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// What the test server does with one request.
    #[derive(Clone, Copy)]
    enum Answer {
        /// 200 with `body`, the connection kept.
        Keep(&'static str),
        /// 200 with `body`, then the connection closed.
        Close(&'static str),
        /// 200 with `body` in chunked encoding, kept.
        Chunked(&'static str),
        /// These raw bytes, then the connection closed.
        Raw(&'static str),
        /// Nothing: the connection closed unanswered.
        Hangup,
        /// 200 with `body`, then a stray `\r\n`, kept.
        Stray(&'static str),
        /// 200 with `body`, then the connection reset (RST, not FIN).
        Reset(&'static str),
        /// 404 with a body, kept.
        NotFound,
        /// 200 with `body`, then the connection closed 50 ms later (while idle).
        CloseIdle(&'static str),
    }

    /// A loopback server answering the `n`th request it gets (over all its connections) with
    /// `script(n)`; counts connections and requests.
    struct Server {
        addr: SocketAddr,
        connections: Arc<AtomicUsize>,
        requests: Arc<AtomicUsize>,
    }

    async fn server(script: fn(usize) -> Answer) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let (accepted, counted) = (Arc::clone(&connections), Arc::clone(&requests));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let counted = Arc::clone(&counted);
                tokio::spawn(async move {
                    let mut held = Vec::new();
                    let mut buf = [0u8; 1024];
                    loop {
                        let Some(end) = held.windows(4).position(|w| w == b"\r\n\r\n") else {
                            match socket.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => held.extend_from_slice(&buf[..n]),
                            }
                            continue;
                        };
                        let request = String::from_utf8_lossy(&held[..end]).into_owned();
                        held.drain(..end + 4);
                        assert!(
                            request.starts_with("GET /metrics HTTP/1.1\r\n"),
                            "{request}"
                        );
                        assert!(
                            request
                                .to_ascii_lowercase()
                                .contains("\r\nhost: 127.0.0.1:"),
                            "a Host header (uvicorn's h11 refuses HTTP/1.1 without one): {request}"
                        );
                        let n = counted.fetch_add(1, Ordering::SeqCst);
                        let (bytes, keep) = match script(n) {
                            Answer::Keep(body) => (plain(body), true),
                            Answer::Close(body) => (plain(body), false),
                            Answer::Chunked(body) => {
                                let mut out =
                                    "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                                        .to_owned();
                                for piece in body.as_bytes().chunks(7) {
                                    out.push_str(&format!(
                                        "{:x}\r\n{}\r\n",
                                        piece.len(),
                                        String::from_utf8_lossy(piece)
                                    ));
                                }
                                out.push_str("0\r\n\r\n");
                                (out, true)
                            }
                            Answer::Raw(raw) => (raw.to_owned(), false),
                            Answer::Hangup => (String::new(), false),
                            Answer::Stray(body) => (plain(body) + "\r\n", true),
                            Answer::Reset(body) => {
                                let _ = socket.write_all(plain(body).as_bytes()).await;
                                let _ = socket.set_zero_linger();
                                return;
                            }
                            Answer::CloseIdle(body) => {
                                let _ = socket.write_all(plain(body).as_bytes()).await;
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                return;
                            }
                            Answer::NotFound => (
                                "HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnope"
                                    .to_owned(),
                                true,
                            ),
                        };
                        if socket.write_all(bytes.as_bytes()).await.is_err() || !keep {
                            return;
                        }
                    }
                });
            }
        });
        Server {
            addr,
            connections,
            requests,
        }
    }

    fn plain(body: &str) -> String {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    fn connection(server: &Server) -> MetricsConnection {
        MetricsConnection::new(server.addr, "/metrics", Duration::from_secs(5), 1024)
            .expect("connection")
    }

    #[tokio::test]
    async fn one_kept_alive_connection_serves_every_scrape() {
        let server = server(|_| Answer::Keep("up 1\n")).await;
        let mut connection = connection(&server);
        for _ in 0..5 {
            assert_eq!(connection.get().await.expect("body"), "up 1\n");
        }
        assert_eq!(server.connections.load(Ordering::SeqCst), 1);
        assert_eq!(server.requests.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn a_connection_the_pod_closes_is_replaced_without_a_failed_scrape() {
        // Closed after its answer (`connection: close` is not said: the pod just closes).
        let server = server(|_| Answer::Close("up 1\n")).await;
        let mut connection = connection(&server);
        for _ in 0..3 {
            assert_eq!(connection.get().await.expect("body"), "up 1\n");
            // Let the close reach the client before the next scrape, as between two ticks.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(server.connections.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_kept_connection_that_breaks_during_a_get_is_retried_once_on_a_new_one() {
        // The second request meets a hang-up (a pod restarting its listener between two
        // scrapes, faster than the client noticed): retried on a new connection, no error.
        let server = server(|n| {
            if n == 1 {
                Answer::Hangup
            } else {
                Answer::Keep("up 1\n")
            }
        })
        .await;
        let mut connection = connection(&server);
        assert_eq!(connection.get().await.expect("first"), "up 1\n");
        assert_eq!(connection.get().await.expect("retried"), "up 1\n");
        assert_eq!(server.connections.load(Ordering::SeqCst), 2);
        assert_eq!(server.requests.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_new_connection_that_breaks_is_an_error_not_a_retry() {
        let server = server(|_| Answer::Hangup).await;
        let mut connection = connection(&server);
        let error = connection.get().await.expect_err("no answer");
        assert!(
            matches!(error, ScrapeError::Http(_) | ScrapeError::Connect(_)),
            "{error:?}"
        );
        assert_eq!(server.requests.load(Ordering::SeqCst), 1, "not retried");
    }

    #[tokio::test]
    async fn chunked_bodies_are_read_whole() {
        let server = server(|_| Answer::Chunked("vllm:num_requests_waiting 3\n")).await;
        let mut connection = connection(&server);
        for _ in 0..2 {
            assert_eq!(
                connection.get().await.expect("body"),
                "vllm:num_requests_waiting 3\n"
            );
        }
        assert_eq!(server.connections.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn bad_answers_are_errors_and_the_next_scrape_starts_clean() {
        let server = server(|n| match n {
            0 => Answer::Raw("HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnope"),
            1 => Answer::Raw("this is not HTTP\r\n\r\n"),
            2 => Answer::Raw("HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\ncut short"),
            3 => Answer::Keep(
                "a body over the 64-byte limit of this connection: ..................................",
            ),
            _ => Answer::Keep("up 1\n"),
        })
        .await;
        let mut connection =
            MetricsConnection::new(server.addr, "/metrics", Duration::from_secs(5), 64)
                .expect("connection");
        assert_eq!(connection.get().await, Err(ScrapeError::Status(404)));
        assert!(matches!(connection.get().await, Err(ScrapeError::Http(_))));
        assert!(
            matches!(
                connection.get().await,
                Err(ScrapeError::Body(_) | ScrapeError::Http(_))
            ),
            "a body cut short"
        );
        let over = connection.get().await;
        assert!(matches!(over, Err(ScrapeError::Body(_))), "{over:?}");
        assert_eq!(connection.get().await.expect("recovered"), "up 1\n");
        // Every failed GET dropped its connection; the last one opened a fresh one.
        assert_eq!(server.connections.load(Ordering::SeqCst), 5);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_read_whole_survives_what_the_connection_does_next() {
        // Bytes after a complete answer break the connection, and so does a reset right
        // after it; the answer was read, so the scrape succeeds (a reset must not make a
        // live pod look gone) and the next one opens a new connection.
        for script in [(|_| Answer::Stray("up 1\n")) as fn(usize) -> Answer, |_| {
            Answer::Reset("up 1\n")
        }] {
            let server = server(script).await;
            let mut connection = connection(&server);
            for _ in 0..20 {
                assert_eq!(connection.get().await, Ok(Bytes::from_static(b"up 1\n")));
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_close_that_lands_after_the_idle_check_fails_the_get_at_once() {
        let server = server(|_| Answer::CloseIdle("up 1\n")).await;
        let mut connection = connection(&server);
        assert_eq!(connection.get().await.expect("body"), "up 1\n");
        // The close arrives; the idle check before the next GET has not seen it (the race
        // this reproduces: it lands between that check and the request).
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(connection.open.is_some(), "kept after the first answer");
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(Duration::from_secs(4), connection.exchange())
            .await
            .expect("the GET failed at once instead of waiting out its timeout");
        assert!(
            matches!(result, Err(ScrapeError::Http(_) | ScrapeError::Connect(_))),
            "{result:?} after {:?}",
            started.elapsed()
        );
        assert!(connection.open.is_none(), "the used-up connection went");
        // And a GET (open, exchange) after it is served.
        assert_eq!(connection.get().await.expect("body"), "up 1\n");
    }

    #[tokio::test]
    async fn a_kept_alive_error_answer_does_not_keep_its_connection() {
        let server = server(|n| {
            if n == 0 {
                Answer::NotFound
            } else {
                Answer::Keep("up 1\n")
            }
        })
        .await;
        let mut connection = connection(&server);
        assert_eq!(connection.get().await, Err(ScrapeError::Status(404)));
        assert_eq!(connection.get().await.expect("body"), "up 1\n");
        assert_eq!(server.connections.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_pod_that_accepts_and_never_answers_is_a_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let mut connection = MetricsConnection::new(
            listener.local_addr().expect("addr"),
            "/metrics",
            Duration::from_millis(300),
            1024,
        )
        .expect("connection");
        assert_eq!(connection.get().await, Err(ScrapeError::Timeout));
        drop(listener);
    }

    #[tokio::test]
    async fn a_pod_that_never_completes_the_connection_is_a_connect_timeout() {
        // A listener whose accept queue is full: the kernel drops further SYNs, so a connect
        // hangs as it does to an unroutable or firewalled pod.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.1:0".parse().expect("addr"))
            .expect("bind");
        let listener = socket.listen(0).expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut queued = Vec::new();
        let mut connection =
            MetricsConnection::new(addr, "/metrics", Duration::from_millis(300), 1024)
                .expect("connection");
        // Fill the queue (one connection with a backlog of 0, a few more to be sure).
        for _ in 0..4 {
            match tokio::time::timeout(Duration::from_millis(100), TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => queued.push(stream),
                _ => break,
            }
        }
        assert_eq!(connection.get().await, Err(ScrapeError::ConnectTimeout));
        // Room in the queue again: the next GET connects, and a silent pod is a plain
        // timeout.
        drop(queued);
        let (accepted, _) = listener.accept().await.expect("accept");
        assert_eq!(connection.get().await, Err(ScrapeError::Timeout));
        drop((accepted, listener));
    }

    #[test]
    fn a_path_must_be_a_url_path() {
        let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let new = |path| MetricsConnection::new(addr, path, Duration::from_secs(1), 1);
        assert!(new("/metrics").is_ok());
        assert!(new("/stats/prometheus?format=text").is_ok());
        for bad in ["metrics", "http://other/metrics", "/a b"] {
            assert!(matches!(new(bad), Err(ScrapeError::Http(_))), "{bad}");
        }
    }
}
