//! Why the flags do not make a runnable configuration: one error enum for `kvpick serve`'s
//! start-up, each variant naming the flag.

use std::path::PathBuf;

/// Why the flags do not make a runnable configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No source of endpoints was given.
    #[error(
        "no endpoint source: pass --endpoints-file FILE, --pool-name NAME or --endpoint-selector K=V,..."
    )]
    NoEndpointSource,
    /// More than one source of endpoints was given.
    #[error("{0} are given together: pass exactly one endpoint source")]
    ConflictingSources(String),
    /// A Kubernetes discovery flag is invalid or given without its source.
    #[error("--{flag}: {reason}")]
    Discovery {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        reason: String,
    },
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
    /// The EndpointPickerConfig cannot be read or is invalid.
    #[error("scheduler config: {0}")]
    Picker(String),
    /// The model rewrite file cannot be read or is invalid.
    #[error("--model-rewrites {path}: {reason}")]
    ModelRewrites {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The bearer token file cannot be used.
    #[error("--metrics-bearer-token-file: {0}")]
    BearerToken(#[from] crate::admin::auth::TokenError),
    /// A TLS flag is given without the flag it refines.
    #[error("--{flag}: {reason}")]
    Tls {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// A replica-exchange flag is invalid.
    #[error(transparent)]
    Replica(#[from] crate::replica::config::ReplicaFlagError),
    /// An llm-d flag is invalid or asks for what kvpick does not do.
    #[error(transparent)]
    Llmd(#[from] super::llmd_flags::LlmdFlagError),
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
