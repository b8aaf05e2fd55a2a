//! `kvpick`: the endpoint picker. Wiring only; the work lives in the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvpick::config::ServeArgs;

#[derive(Parser)]
#[command(
    name = "kvpick",
    version,
    about = "KV-cache-aware endpoint picker for LLM inference",
    // A flag given twice takes its last value, as Go's flags do (a chart's default arguments
    // followed by the user's), instead of being an error; repeatable flags still repeat.
    args_override_self = true
)]
struct Cli {
    /// Log filter (RUST_LOG syntax), e.g. `info` or `kvpick=debug`; wins over llm-d's `-v`
    /// and `--zap-log-level`. Default: info.
    #[arg(long, global = true, env = "RUST_LOG")]
    log: Option<String>,
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
    let Command::Serve(args) = cli.command;
    // llm-d's `-v`/`--zap-*` decide the level and format unless RUST_LOG/--log names one.
    let settings = match args.llmd.log_settings() {
        Ok(settings) => settings,
        Err(error) => {
            eprintln!("kvpick: {error}");
            return ExitCode::from(2);
        }
    };
    let filter = log_filter(cli.log.as_deref().or(settings.level).unwrap_or("info"));
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_client=off"));
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    if settings.json {
        logs.json().init();
    } else {
        // Colours only on a terminal: a pod's log (a pipe) stays plain text for collectors.
        logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
    let config = match args.validate() {
        Ok(config) => config,
        Err(error) => {
            eprintln!("kvpick: {error}");
            return ExitCode::from(2);
        }
    };
    cap_malloc_arenas();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.background_threads)
        .enable_all()
        .build();
    let runtime = match runtime {
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

/// Caps glibc's malloc arenas at the number of cores, before any thread starts, unless
/// `MALLOC_ARENA_MAX` says otherwise.
///
/// NOTE: glibc gives each thread that allocates under contention an arena of its own, up to
/// 8 per core, and keeps what is freed in the arena it came from. Large bodies are buffered on
/// the async workers and prepared on blocking-pool threads (dozens at 150 concurrent 220 KB
/// requests), so every arena ends up holding its own peak: 150 concurrent 220 KB requests
/// (32 MiB in flight) grew kvpick by 385 MiB with the default arenas and by 37 MiB with one
/// arena per core (2 here), at the same latency and CPU (docs/benchmarks.md, issue 16).
/// `malloc_trim` after large work (`tokenize::gate`) cannot help while requests keep coming.
fn cap_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let arenas = i32::try_from(cores.clamp(1, 64)).unwrap_or(8);
        // SAFETY: mallopt only sets an allocator parameter; called before other threads exist.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, arenas);
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
