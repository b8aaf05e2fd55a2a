//! A minimal HTTP backend that answers every request at once with a small JSON body, for
//! measuring proxy overhead without model time in the way. `GET /metrics` answers an idle
//! vLLM's scheduling metrics, so kvpick scrapes it as it would a real pod.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Serves until the process ends.
pub async fn serve(listener: TcpListener) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                answer(addr, request)
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

async fn answer(
    addr: SocketAddr,
    request: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    if request.method() == hyper::Method::GET && request.uri().path() == "/metrics" {
        return Ok(hyper::Response::new(Full::new(Bytes::from_static(
            IDLE_METRICS.as_bytes(),
        ))));
    }
    let bytes = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes().len())
        .unwrap_or(0);
    let body = format!(r#"{{"backend":"{addr}","bytes":{bytes}}}"#);
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    Ok(response)
}
