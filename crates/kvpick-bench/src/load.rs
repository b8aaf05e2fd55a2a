//! A load generator: closed loop (`n` workers, each sending its next request when the last
//! is answered) or open loop (a fixed rate), with the bodies of a [`Workload`]. Used to
//! measure what a proxy hop adds.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::stats::{LatencySummary, summarize};
use super::workload::Workload;

/// One load run's settings.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// Target URL (`http://host:port/path`).
    pub url: String,
    /// Closed loop at a concurrency, or open loop at a rate.
    pub pace: Pace,
    /// Requests counted.
    pub requests: usize,
    /// Requests sent first (closed loop, before the counted part) and not counted.
    pub warmup: usize,
    /// The request bodies.
    pub workload: Workload,
    /// A process whose CPU time (utime + stime from `/proc`) is read around the counted part.
    pub cpu_pid: Option<u32>,
}

/// How requests are issued.
#[derive(Debug, Clone, Copy)]
pub enum Pace {
    /// `n` workers, each sending its next request when the last one is answered.
    Closed(usize),
    /// Requests sent at a fixed rate (per second) whatever the answers; latency counts
    /// from each request's scheduled time, so a stall is not hidden (no coordinated
    /// omission).
    Open(f64),
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
    /// CPU time of `cpu_pid` over the counted part per counted request, microseconds.
    pub cpu_us_per_request: Option<f64>,
    /// Size of the first counted body, bytes.
    pub body_bytes: usize,
    /// Length of the counted part, seconds.
    pub seconds: f64,
}

/// Why a run could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The URL does not parse.
    #[error("bad url {0}")]
    Url(String),
    /// The CPU time of the watched process could not be read.
    #[error("read /proc/{0}/stat: {1}")]
    Cpu(u32, String),
}

/// User + system CPU time of `pid` (all its threads), seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64, LoadError> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| LoadError::Cpu(pid, e.to_string()))?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| LoadError::Cpu(pid, "no command field".into()))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| -> Result<f64, LoadError> {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .ok_or_else(|| LoadError::Cpu(pid, format!("field {}", i + 3)))
    };
    // utime and stime are fields 14 and 15, in clock ticks of 1/100 s on Linux.
    Ok((tick(11)? + tick(12)?) / 100.0)
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

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Sends one request and reads the whole answer: whether it succeeded.
async fn send(client: &HttpClient, uri: &hyper::Uri, body: Bytes) -> bool {
    let request = hyper::Request::post(uri.clone())
        .header("content-type", "application/json")
        .body(Full::new(body));
    let Ok(request) = request else {
        return false;
    };
    match client.request(request).await {
        Ok(response) => {
            let success = response.status().is_success();
            success && response.into_body().collect().await.is_ok()
        }
        Err(_) => false,
    }
}

/// Runs the plan and reports.
pub async fn run(plan: LoadPlan) -> Result<LoadReport, LoadError> {
    let uri: hyper::Uri = plan
        .url
        .parse()
        .map_err(|_| LoadError::Url(plan.url.clone()))?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let workload = Arc::new(plan.workload.clone());
    let body_bytes = workload.body(plan.warmup as u64).len();
    // Warm-up: closed loop, not counted (connections opened, caches filled as in steady
    // state). Its indices come first, so the counted requests still bring new text.
    let warm_workers = match plan.pace {
        Pace::Closed(n) => n,
        Pace::Open(_) => 4,
    };
    closed(&client, &uri, &workload, warm_workers, 0, plan.warmup).await;
    let cpu_before = plan.cpu_pid.map(cpu_seconds).transpose()?;
    let started = Instant::now();
    let from = plan.warmup as u64;
    let (mut samples, errors) = match plan.pace {
        Pace::Closed(n) => closed(&client, &uri, &workload, n, from, plan.requests).await,
        Pace::Open(rate) => open(&client, &uri, &workload, rate, from, plan.requests).await,
    };
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    let cpu_us_per_request = match (plan.cpu_pid, cpu_before) {
        (Some(pid), Some(before)) => {
            Some((cpu_seconds(pid)? - before) * 1e6 / plan.requests.max(1) as f64)
        }
        _ => None,
    };
    Ok(LoadReport {
        requests_per_second: (samples.len() + errors) as f64 / elapsed,
        latency: summarize(&mut samples),
        errors,
        cpu_us_per_request,
        body_bytes,
        seconds: elapsed,
    })
}

/// `workers` closed-loop workers send requests `from..from + count`.
async fn closed(
    client: &HttpClient,
    uri: &hyper::Uri,
    workload: &Arc<Workload>,
    workers: usize,
    from: u64,
    count: usize,
) -> (Vec<Duration>, usize) {
    let issued = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::with_capacity(workers);
    for _ in 0..workers.max(1) {
        let (client, uri, workload, issued) = (
            client.clone(),
            uri.clone(),
            Arc::clone(workload),
            Arc::clone(&issued),
        );
        handles.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut errors = 0usize;
            loop {
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if n >= count {
                    break;
                }
                let body = workload.body(from + n as u64);
                let sent = Instant::now();
                if send(&client, &uri, body).await {
                    samples.push(sent.elapsed());
                } else {
                    errors += 1;
                }
            }
            (samples, errors)
        }));
    }
    gather(handles).await
}

/// Requests `from..from + count` sent at `rate` per second, each on its own task.
async fn open(
    client: &HttpClient,
    uri: &hyper::Uri,
    workload: &Arc<Workload>,
    rate: f64,
    from: u64,
    count: usize,
) -> (Vec<Duration>, usize) {
    let interval = Duration::from_secs_f64(1.0 / rate.max(1e-3));
    let start = tokio::time::Instant::now();
    let mut handles = Vec::with_capacity(count);
    for n in 0..count {
        // The body is made before its slot, so making it is not timed.
        let body = workload.body(from + n as u64);
        let due = start + interval.mul_f64(n as f64);
        tokio::time::sleep_until(due).await;
        let (client, uri) = (client.clone(), uri.clone());
        handles.push(tokio::spawn(async move {
            let ok = send(&client, &uri, body).await;
            let elapsed = due.elapsed();
            (
                if ok { vec![elapsed] } else { Vec::new() },
                usize::from(!ok),
            )
        }));
    }
    gather(handles).await
}

async fn gather(
    handles: Vec<tokio::task::JoinHandle<(Vec<Duration>, usize)>>,
) -> (Vec<Duration>, usize) {
    let mut samples = Vec::with_capacity(handles.len());
    let mut errors = 0;
    for handle in handles {
        match handle.await {
            Ok((s, e)) => {
                samples.extend(s);
                errors += e;
            }
            Err(_) => errors += 1,
        }
    }
    (samples, errors)
}
