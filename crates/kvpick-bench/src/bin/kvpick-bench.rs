//! `kvpick-bench`: load generator and a trivial backend for whole-system benchmarks.
//! Wiring only; the work lives in `kvpick_bench`.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvpick_bench::workload::{ChatWorkload, Workload};
use kvpick_bench::{backend, load};

#[derive(Parser)]
#[command(name = "kvpick-bench", about = "Load generator for kvpick benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Closed- or open-loop load: prints a JSON report of latency percentiles, throughput
    /// and (with `--cpu-pid`) a process's CPU time per request.
    Load {
        /// Target URL.
        #[arg(long)]
        url: String,
        /// Parallel workers (closed loop).
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Open loop at this many requests per second instead of the closed loop.
        #[arg(long)]
        rate: Option<f64>,
        /// Chat bodies (`/v1/chat/completions`) instead of the fixed completion body.
        #[arg(long)]
        chat: bool,
        /// Share of a chat body's text every request has in common (0: cold).
        #[arg(long, default_value_t = 0.95)]
        shared: f64,
        /// Seed of the chat text (vary it between runs against the same kvpick).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Read this process's CPU time around the counted requests.
        #[arg(long)]
        cpu_pid: Option<u32>,
        /// Counted requests.
        #[arg(long, default_value_t = 2000)]
        requests: usize,
        /// Uncounted warm-up requests.
        #[arg(long, default_value_t = 200)]
        warmup: usize,
        /// Size of the JSON body.
        #[arg(long, default_value_t = 8192)]
        body_bytes: usize,
        /// Model named in the body.
        #[arg(long, default_value = "bench-model")]
        model: String,
        /// Ask for streamed answers (`"stream":true`; the bench backend then streams SSE).
        #[arg(long)]
        stream: bool,
    },
    /// A backend that answers every request at once (for proxy-overhead runs).
    Backend {
        /// Listen address.
        #[arg(long)]
        listen: SocketAddr,
        /// Token events in a streamed answer (one write each, then usage and `[DONE]`).
        #[arg(long, default_value_t = 64)]
        stream_chunks: usize,
        /// Microseconds between a streamed answer's events (a decode step).
        #[arg(long, default_value_t = 0)]
        chunk_gap_us: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvpick-bench: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<(), String> = runtime.block_on(async {
        match cli.command {
            Command::Load {
                url,
                concurrency,
                rate,
                chat,
                shared,
                seed,
                cpu_pid,
                requests,
                warmup,
                body_bytes,
                model,
                stream,
            } => {
                let workload = if chat {
                    Workload::Chat(ChatWorkload::new(&model, body_bytes, shared, seed))
                } else {
                    Workload::Fixed(load::completion_body(&model, body_bytes))
                };
                let workload = if stream {
                    Workload::Streamed(Box::new(workload))
                } else {
                    workload
                };
                let pace = match rate {
                    Some(rate) => load::Pace::Open(rate),
                    None => load::Pace::Closed(concurrency),
                };
                let plan = load::LoadPlan {
                    url,
                    pace,
                    requests,
                    warmup,
                    workload,
                    cpu_pid,
                };
                let report = load::run(plan).await.map_err(|e| e.to_string())?;
                let json = serde_json::to_string(&report).map_err(|e| e.to_string())?;
                println!("{json}");
                Ok(())
            }
            Command::Backend {
                listen,
                stream_chunks,
                chunk_gap_us,
            } => {
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .map_err(|e| format!("bind {listen}: {e}"))?;
                backend::serve(
                    listener,
                    stream_chunks,
                    std::time::Duration::from_micros(chunk_gap_us),
                )
                .await
                .map_err(|e| e.to_string())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvpick-bench: {error}");
            ExitCode::FAILURE
        }
    }
}
