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
    let filter = log_filter(&cli.log);
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_client=off")),
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

/// The log filter for `--log`/`RUST_LOG`.
///
/// NOTE: kube's client logs every failed request at ERROR (twice a second while the API is
/// down), which kvpick's own watch logging already reports once per outage; it is off unless
/// the filter names it.
fn log_filter(given: &str) -> String {
    if given.contains("kube_client") {
        given.to_owned()
    } else {
        format!("{given},kube_client=off")
    }
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn kube_clients_request_errors_are_off_unless_named() {
        assert_eq!(log_filter("info"), "info,kube_client=off");
        assert_eq!(log_filter("kvpick=debug"), "kvpick=debug,kube_client=off");
        assert_eq!(
            log_filter("info,kube_client=debug"),
            "info,kube_client=debug"
        );
        for filter in [log_filter("info"), log_filter("warn,kvpick=trace")] {
            assert!(
                tracing_subscriber::EnvFilter::try_new(&filter).is_ok(),
                "{filter}"
            );
        }
    }
}
