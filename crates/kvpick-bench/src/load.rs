//! A closed-loop load generator: `concurrency` workers each send the same request back to
//! back until `requests` have completed. Used to measure what a proxy hop adds.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::stats::{LatencySummary, summarize};

/// One load run's settings.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// Target URL (`http://host:port/path`).
    pub url: String,
    /// Parallel workers.
    pub concurrency: usize,
    /// Requests counted.
    pub requests: usize,
    /// Requests sent first and not counted.
    pub warmup: usize,
    /// The request body.
    pub body: Bytes,
}

/// What a run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadReport {
    /// Latency of successful requests.
    pub latency: LatencySummary,
    /// Requests that failed or got a non-2xx status.
    pub errors: usize,
    /// Completed requests per second (counted part).
    pub requests_per_second: f64,
}

/// Why a run could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The URL does not parse.
    #[error("bad url {0}")]
    Url(String),
}

/// A JSON completion body of about `bytes` bytes.
pub fn completion_body(model: &str, bytes: usize) -> Bytes {
    let overhead = format!(r#"{{"model":"{model}","prompt":"","max_tokens":1}}"#).len();
    let prompt: String = "lorem ipsum dolor sit amet "
        .chars()
        .cycle()
        .take(bytes.saturating_sub(overhead))
        .collect();
    Bytes::from(serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1}).to_string())
}

/// Runs the plan and reports.
pub async fn run(plan: LoadPlan) -> Result<LoadReport, LoadError> {
    let uri: hyper::Uri = plan
        .url
        .parse()
        .map_err(|_| LoadError::Url(plan.url.clone()))?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let issued = Arc::new(AtomicUsize::new(0));
    let total = plan.warmup + plan.requests;
    let started = Instant::now();
    let mut workers = Vec::with_capacity(plan.concurrency);
    for _ in 0..plan.concurrency.max(1) {
        let (client, uri, body, issued) = (
            client.clone(),
            uri.clone(),
            plan.body.clone(),
            Arc::clone(&issued),
        );
        let warmup = plan.warmup;
        workers.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut errors = 0usize;
            let mut counted_from = None;
            loop {
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    break;
                }
                if n == warmup {
                    counted_from = Some(Instant::now());
                }
                let request = hyper::Request::post(uri.clone())
                    .header("content-type", "application/json")
                    .body(Full::new(body.clone()));
                let Ok(request) = request else {
                    errors += 1;
                    continue;
                };
                let sent = Instant::now();
                let ok = match client.request(request).await {
                    Ok(response) => {
                        let success = response.status().is_success();
                        success && response.into_body().collect().await.is_ok()
                    }
                    Err(_) => false,
                };
                let elapsed = sent.elapsed();
                if n >= warmup {
                    if ok {
                        samples.push(elapsed);
                    } else {
                        errors += 1;
                    }
                }
            }
            (samples, errors, counted_from)
        }));
    }
    let mut samples: Vec<Duration> = Vec::with_capacity(plan.requests);
    let mut errors = 0;
    let mut counted_from = started;
    for worker in workers {
        if let Ok((s, e, from)) = worker.await {
            samples.extend(s);
            errors += e;
            if let Some(from) = from {
                counted_from = from;
            }
        }
    }
    let elapsed = counted_from.elapsed().as_secs_f64().max(1e-9);
    Ok(LoadReport {
        requests_per_second: (samples.len() + errors) as f64 / elapsed,
        latency: summarize(&mut samples),
        errors,
    })
}
