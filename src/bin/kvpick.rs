//! `kvpick`: the endpoint picker. Wiring only; the work lives in the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvpick::config::ServeArgs;

#[derive(Parser)]
#[command(
    name = "kvpick",
    version,
    about = "KV-cache-aware endpoint picker for LLM inference"
)]
struct Cli {
    /// Log filter (RUST_LOG syntax), e.g. `info` or `kvpick=debug`.
    #[arg(long, global = true, env = "RUST_LOG", default_value = "info")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the Envoy ext-proc endpoint-picker protocol.
    Serve(ServeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let Command::Serve(args) = cli.command;
    let config = match args.validate() {
        Ok(config) => config,
        Err(error) => {
            eprintln!("kvpick: {error}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvpick: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kvpick::app::serve(config, kvpick::app::shutdown_signal())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(%error, "kvpick failed");
            eprintln!("kvpick: {error}");
            ExitCode::FAILURE
        }
    }
}
