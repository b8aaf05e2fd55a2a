//! `kvpick-bench`: load generator and a trivial backend for whole-system benchmarks.
//! Wiring only; the work lives in `kvpick_bench`.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvpick_bench::{backend, load};

#[derive(Parser)]
#[command(name = "kvpick-bench", about = "Load generator for kvpick benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Closed-loop load: prints a JSON report of latency percentiles and throughput.
    Load {
        /// Target URL.
        #[arg(long)]
        url: String,
        /// Parallel workers.
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Counted requests.
        #[arg(long, default_value_t = 2000)]
        requests: usize,
        /// Uncounted warm-up requests.
        #[arg(long, default_value_t = 200)]
        warmup: usize,
        /// Size of the JSON completion body.
        #[arg(long, default_value_t = 8192)]
        body_bytes: usize,
        /// Model named in the body.
        #[arg(long, default_value = "bench-model")]
        model: String,
    },
    /// A backend that answers every request at once (for proxy-overhead runs).
    Backend {
        /// Listen address.
        #[arg(long)]
        listen: SocketAddr,
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
                requests,
                warmup,
                body_bytes,
                model,
            } => {
                let plan = load::LoadPlan {
                    url,
                    concurrency,
                    requests,
                    warmup,
                    body: load::completion_body(&model, body_bytes),
                };
                let report = load::run(plan).await.map_err(|e| e.to_string())?;
                let json = serde_json::to_string(&report).map_err(|e| e.to_string())?;
                println!("{json}");
                Ok(())
            }
            Command::Backend { listen } => {
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .map_err(|e| format!("bind {listen}: {e}"))?;
                backend::serve(listener).await.map_err(|e| e.to_string())
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
