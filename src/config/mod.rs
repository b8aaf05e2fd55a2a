//! Flags → one validated [`ServeConfig`], built once at start-up.
//!
//! Everything downstream takes the typed config; nothing re-reads flags or re-validates.

mod duration;
pub mod picker_config;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

pub use duration::{DurationError, parse_duration};

/// Flags of `kvpick serve` (GIE-compatible names and defaults where GIE has them).
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Port of the ext-proc gRPC server (HTTP/2).
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,
    /// Port of the gRPC health server (`liveness`, `readiness`, `""`, ext-proc service).
    #[arg(long, default_value_t = 9003)]
    pub grpc_health_port: u16,
    /// Port of the HTTP server with Prometheus `/metrics` and the `/debug/*` views.
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,
    /// Address all three servers bind to.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind_address: IpAddr,
    /// Static pool file (YAML, see DESIGN §2.1); re-read when it changes.
    #[arg(long)]
    pub endpoints_file: Option<PathBuf>,
    /// How often the endpoints file is checked for changes.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub endpoints_reload_interval: Duration,
    /// Largest request body kvpick buffers; larger bodies get 413.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Bytes of request bodies buffered across all streams at once; past it new bodies get 503.
    #[arg(long, default_value_t = 1024 * 1024 * 1024)]
    pub max_buffered_bytes: usize,
    /// How many fallback endpoints follow the primary in the destination header.
    ///
    /// 0 by default: Envoy's ORIGINAL_DST cluster (deploy/envoy/envoy.yaml) needs a single
    /// `ip:port`. Gateways that retry through the list (GIE protocol fallbacks, e.g. Envoy's
    /// override_host load-balancing policy) can take more.
    #[arg(long, default_value_t = 0)]
    pub max_fallbacks: usize,
    /// How long in-flight streams may run after SIGTERM before kvpick exits anyway.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
}

/// Why the flags do not make a runnable configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No source of endpoints was given.
    #[error("no endpoint source: pass --endpoints-file FILE")]
    NoEndpointSource,
    /// Two servers would bind the same port.
    #[error("--{first} and --{second} both use port {port}")]
    PortClash {
        /// First flag.
        first: &'static str,
        /// Second flag.
        second: &'static str,
        /// The shared port.
        port: u16,
    },
    /// A size flag is out of range.
    #[error("--{flag} must be at least {min} (got {value})")]
    TooSmall {
        /// The flag.
        flag: &'static str,
        /// Its minimum.
        min: usize,
        /// What was given.
        value: usize,
    },
}

/// The validated configuration of `kvpick serve`.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Ext-proc gRPC listen address.
    pub grpc_addr: SocketAddr,
    /// gRPC health listen address.
    pub health_addr: SocketAddr,
    /// Metrics/admin HTTP listen address.
    pub metrics_addr: SocketAddr,
    /// The static pool file.
    pub endpoints_file: PathBuf,
    /// Poll interval of the pool file.
    pub endpoints_reload_interval: Duration,
    /// Per-request body limit.
    pub max_body_bytes: usize,
    /// Global body buffer budget.
    pub max_buffered_bytes: usize,
    /// Fallbacks after the primary.
    pub max_fallbacks: usize,
    /// Drain timeout on shutdown.
    pub drain_timeout: Duration,
}

impl ServeArgs {
    /// Validates the flags into a [`ServeConfig`].
    pub fn validate(self) -> Result<ServeConfig, ConfigError> {
        let endpoints_file = self.endpoints_file.ok_or(ConfigError::NoEndpointSource)?;
        let ports = [
            ("grpc-port", self.grpc_port),
            ("grpc-health-port", self.grpc_health_port),
            ("metrics-port", self.metrics_port),
        ];
        for (i, (first, a)) in ports.iter().enumerate() {
            for (second, b) in &ports[i + 1..] {
                // Port 0 asks the OS for a fresh port each time, so it never clashes.
                if a == b && *a != 0 {
                    return Err(ConfigError::PortClash {
                        first,
                        second,
                        port: *a,
                    });
                }
            }
        }
        if self.max_body_bytes < 1024 {
            return Err(ConfigError::TooSmall {
                flag: "max-body-bytes",
                min: 1024,
                value: self.max_body_bytes,
            });
        }
        if self.max_buffered_bytes < self.max_body_bytes {
            return Err(ConfigError::TooSmall {
                flag: "max-buffered-bytes",
                min: self.max_body_bytes,
                value: self.max_buffered_bytes,
            });
        }
        let ip = self.bind_address;
        Ok(ServeConfig {
            grpc_addr: SocketAddr::new(ip, self.grpc_port),
            health_addr: SocketAddr::new(ip, self.grpc_health_port),
            metrics_addr: SocketAddr::new(ip, self.metrics_port),
            endpoints_file,
            endpoints_reload_interval: self.endpoints_reload_interval,
            max_body_bytes: self.max_body_bytes,
            max_buffered_bytes: self.max_buffered_bytes,
            max_fallbacks: self.max_fallbacks,
            drain_timeout: self.drain_timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<ServeConfig, ConfigError> {
        let mut argv = vec!["kvpick"];
        argv.extend_from_slice(args);
        Cli::parse_from(argv).serve.validate()
    }

    #[test]
    fn gie_defaults() {
        let config = parse(&["--endpoints-file", "pool.yaml"]).expect("valid");
        assert_eq!(config.grpc_addr.port(), 9002);
        assert_eq!(config.health_addr.port(), 9003);
        assert_eq!(config.metrics_addr.port(), 9090);
        assert_eq!(config.max_body_bytes, 16 * 1024 * 1024);
    }

    #[test]
    fn rejects_missing_source_and_port_clash() {
        assert!(matches!(parse(&[]), Err(ConfigError::NoEndpointSource)));
        let clash = parse(&["--endpoints-file", "p", "--metrics-port", "9002"]);
        assert!(matches!(
            clash,
            Err(ConfigError::PortClash { port: 9002, .. })
        ));
        let small = parse(&["--endpoints-file", "p", "--max-body-bytes", "10"]);
        assert!(matches!(small, Err(ConfigError::TooSmall { .. })));
    }
}
