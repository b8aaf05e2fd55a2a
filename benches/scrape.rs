//! One pod's `/metrics` scrape, 20 times a second per pod in kvpick's defaults (50 ms).
//!
//! - `parse vLLM page`: reading the scheduling signals out of a real vLLM 0.32 page (55 KB,
//!   669 lines, `../shared/fixtures/vllm-0.32-kv-events/metrics-load.txt`);
//! - `scrape over loopback`: one whole scrape as a scrape task does it (request, response,
//!   parse) against a loopback server that answers every request with that page from memory
//!   (its own cost is a write of a prepared buffer, the same for every variant), both on one
//!   thread, so the time is the CPU both sides and the loopback spend;
//! - `scrape over loopback, 2 workers (CPU time)`: the same on a runtime like kvpick's (two
//!   worker threads), timed as the process's CPU time per scrape.
//!
//! Run: `cargo bench --bench scrape`.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::Criterion;
use kvpick::endpoints::PodId;
use kvpick::scrape::connection::MetricsConnection;
use kvpick::scrape::{EngineKind, ScrapeConfig, prom_text};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn vllm_page() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures/vllm-0.32-kv-events/metrics-load.txt");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A loopback server answering each request on a connection with `page` (keep-alive).
async fn page_server(page: String) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let mut response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\ncontent-length: {}\r\n\r\n",
        page.len()
    )
    .into_bytes();
    response.extend_from_slice(page.as_bytes());
    let response = std::sync::Arc::new(response);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let response = response.clone();
            tokio::spawn(async move {
                let _ = socket.set_nodelay(true);
                let mut buf = vec![0u8; 4096];
                let mut held = 0;
                loop {
                    match socket.read(&mut buf[held..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => held += n,
                    }
                    if buf[..held].windows(4).any(|w| w == b"\r\n\r\n") {
                        held = 0;
                        if socket.write_all(&response).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

/// The process's CPU time so far (user + system, all threads).
fn cpu_time() -> Duration {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// `n` scrapes, one after the other.
async fn scrapes(connection: &mut MetricsConnection, n: u64) {
    for _ in 0..n {
        let metrics = kvpick::scrape::scraper::scrape_once(connection, EngineKind::Vllm)
            .await
            .expect("scrape");
        black_box(metrics);
    }
}

fn main() {
    let page = vllm_page();
    let mut c = Criterion::default()
        .configure_from_args()
        .measurement_time(Duration::from_secs(5));
    c.bench_function("parse vLLM page", |b| {
        b.iter(|| {
            let exposition =
                prom_text::parse_wanted(black_box(&page), EngineKind::Vllm.read_names());
            black_box(
                EngineKind::Vllm
                    .extract(&exposition.samples)
                    .expect("signals"),
            )
        })
    });

    // One thread for the server and the scrapes: the time a scrape takes is then the CPU
    // both sides and the loopback spend on it, without cross-thread wake-up latency.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let addr = runtime.block_on(page_server(page.clone()));
    let config = ScrapeConfig::default();
    let mut connection =
        kvpick::scrape::scraper::metrics_connection(PodId(addr), &config).expect("connection");
    c.bench_function("scrape over loopback", |b| {
        b.iter_custom(|iterations| {
            runtime.block_on(async {
                let started = std::time::Instant::now();
                scrapes(&mut connection, iterations).await;
                started.elapsed()
            })
        })
    });

    // The runtime kvpick scrapes on (several workers, scrape tasks among other tasks). Wall
    // time would include waiting for another thread to wake up; this measures the process's
    // CPU time (user + system, both sides of the loopback) per scrape instead.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let addr = runtime.block_on(page_server(page.clone()));
    let connection = std::sync::Arc::new(tokio::sync::Mutex::new(
        kvpick::scrape::scraper::metrics_connection(PodId(addr), &config).expect("connection"),
    ));
    c.bench_function("scrape over loopback, 2 workers (CPU time)", |b| {
        b.iter_custom(|iterations| {
            let connection = connection.clone();
            let scrapes = async move {
                let mut connection = connection.lock().await;
                scrapes(&mut connection, iterations).await;
            };
            let before = cpu_time();
            let scrapes = runtime.spawn(scrapes);
            runtime.block_on(scrapes).expect("scrapes");
            cpu_time() - before
        })
    });
    c.final_summary();
}
