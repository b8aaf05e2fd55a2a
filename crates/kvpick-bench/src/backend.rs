//! A minimal HTTP backend that answers every request at once with a small JSON body, for
//! measuring proxy overhead without model time in the way. `GET /metrics` answers an idle
//! vLLM's scheduling metrics, so kvpick scrapes it as it would a real pod.
//!
//! A request whose body asks for `"stream":true` is answered like vLLM's stream instead: a
//! server-sent event of ~150 bytes per token (`chunks` of them), then one with `usage`, then
//! `data: [DONE]`, each written to the socket on its own (so a proxy that streams response
//! bodies through ext-proc sees one body message per event). `gap` between events stands
//! for a model server's decode step; without one a busy proxy reads several events at once.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Body, Frame};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Serves until the process ends; streamed answers carry `chunks` token events, `gap`
/// apart.
pub async fn serve(listener: TcpListener, chunks: usize, gap: Duration) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                answer(addr, chunks, gap, request)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// An idle vLLM's scheduling metrics.
const IDLE_METRICS: &str =
    "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n";

type Answer = Either<Full<Bytes>, SseBody>;

async fn answer(
    addr: SocketAddr,
    chunks: usize,
    gap: Duration,
    request: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<Answer>, Infallible> {
    // `/metrics/` is where vLLM answers metrics by name (kvpick asks there first); the whole
    // idle page is a valid answer to it too.
    if request.method() == hyper::Method::GET
        && matches!(request.uri().path(), "/metrics" | "/metrics/")
    {
        return Ok(hyper::Response::new(Either::Left(Full::new(
            Bytes::from_static(IDLE_METRICS.as_bytes()),
        ))));
    }
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if asks_stream(&body) {
        let mut response = hyper::Response::new(Either::Right(SseBody::new(chunks, gap)));
        response.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream"),
        );
        return Ok(response);
    }
    let body = format!(r#"{{"backend":"{addr}","bytes":{}}}"#, body.len());
    let mut response = hyper::Response::new(Either::Left(Full::new(Bytes::from(body))));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

/// Whether a request body asks for a streamed answer (`"stream":true` near its end, where
/// the load generator puts it).
fn asks_stream(body: &[u8]) -> bool {
    const NEEDLE: &[u8] = br#""stream":true"#;
    let tail = &body[body.len().saturating_sub(128)..];
    tail.windows(NEEDLE.len()).any(|w| w == NEEDLE)
}

/// One token event, vLLM's shape.
const TOKEN_EVENT: &[u8] = br#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"bench-model","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}

"#;
/// The last events: usage, then the end marker.
const USAGE_EVENT: &[u8] = br#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"bench-model","choices":[],"usage":{"prompt_tokens":2048,"total_tokens":2112,"completion_tokens":64}}

"#;
const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// A vLLM-like event stream: `left` token events, the usage event and `[DONE]`, one frame
/// per poll with a `Pending` in between, so hyper writes each to the socket before the next.
pub struct SseBody {
    left: usize,
    gap: Duration,
    sent_usage: bool,
    done: bool,
    ready: bool,
}

impl SseBody {
    fn new(tokens: usize, gap: Duration) -> Self {
        Self {
            left: tokens,
            gap,
            sent_usage: false,
            done: false,
            ready: true,
        }
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        // NOTE: every other poll is Pending: hyper flushes what it holds when the body is not
        // ready, so each event leaves in its own write. The gap is slept on a blocking-pool
        // thread (tokio's timer has millisecond steps; decode steps are shorter than that).
        if !self.ready {
            self.ready = true;
            let waker = cx.waker().clone();
            if self.gap.is_zero() {
                waker.wake();
            } else {
                let gap = self.gap;
                tokio::task::spawn_blocking(move || {
                    std::thread::sleep(gap);
                    waker.wake();
                });
            }
            return Poll::Pending;
        }
        self.ready = false;
        let event = if self.left > 0 {
            self.left -= 1;
            TOKEN_EVENT
        } else if !self.sent_usage {
            self.sent_usage = true;
            USAGE_EVENT
        } else {
            self.done = true;
            DONE_EVENT
        };
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(event)))))
    }
}
