//! Kubernetes discovery: the endpoints of an `InferencePool` (or of a label selector, llm-d's
//! standalone mode) from the API server, through kube-rs.
//!
//! [`pool_spec`] reads an InferencePool of either API group, [`pod_endpoints`] turns ready
//! pods into endpoints, [`watch`] is the one task that watches both and publishes into the
//! datastore, [`status`] decides readiness and [`metrics`] counts. [`policy`] reads
//! InferenceObjectives and InferenceModelRewrites and [`policy_watch`] is the task that
//! watches them and swaps the merged result into the request path. Concurrency: the task in
//! [`watch`] owns every watch stream and all discovery state; `serve` runs it under the
//! supervisor and stops it with its cancellation token (see [`watch`]'s docs).

pub mod leader;
pub mod metrics;
pub mod peers;
pub mod pod_endpoints;
pub mod policy;
pub mod policy_watch;
pub mod pool_spec;
pub mod selector;
pub mod status;
pub mod watch;

use std::time::Duration;

pub use metrics::DiscoveryMetrics;
pub use pod_endpoints::KvPorts;
pub use policy_watch::{PolicyHealth, PolicyParts, run_policy};
pub use pool_spec::{PoolGroup, PoolSpec};
pub use selector::LabelSelector;
pub use status::{NotReady, Readiness};
pub use watch::{DiscoveryParts, run_discovery};

/// Where the service account mount says which namespace kvpick runs in.
pub const SERVICE_ACCOUNT_NAMESPACE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// What to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryTarget {
    /// An InferencePool (`--pool-name`, `--pool-group`).
    Pool {
        /// Its name.
        name: String,
        /// Its API group.
        group: PoolGroup,
    },
    /// Pods matching a fixed selector on fixed ports (`--endpoint-selector`,
    /// `--endpoint-target-ports`).
    Selector(PoolSpec),
}

/// The validated configuration of Kubernetes discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeDiscoveryConfig {
    /// The namespace of the pool and its pods.
    pub namespace: String,
    /// The pool or the selector.
    pub target: DiscoveryTarget,
    /// KV-event ports applied to pod IPs when a pod has no annotation.
    pub kv_ports: KvPorts,
    /// How long the watches may fail before readiness turns off.
    pub stale_after: Duration,
    /// Leader election (`--ha-enable-leader-election`), when on.
    pub leader: Option<leader::LeaderConfig>,
}

/// The namespace when `--pool-namespace` is not given: the service account's, else `default`.
pub fn default_namespace() -> String {
    namespace_from(std::path::Path::new(SERVICE_ACCOUNT_NAMESPACE))
}

/// The namespace a service-account `namespace` file names; `default` when the file is
/// missing, unreadable, empty or not a valid namespace name (logged: a mount kvpick cannot
/// read should not silently pick another namespace's pool unnoticed).
fn namespace_from(path: &std::path::Path) -> String {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) => {
            if error.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), %error, "cannot read the service account's namespace; using `default`");
            }
            return "default".to_owned();
        }
    };
    let namespace = text.trim();
    // A DNS-1123 label, as Kubernetes requires of namespace names.
    if !namespace.is_empty()
        && namespace.len() <= 63
        && namespace
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        namespace.to_owned()
    } else {
        tracing::warn!(path = %path.display(), namespace = %namespace.escape_debug(), "the service account's namespace is not a valid name; using `default`");
        "default".to_owned()
    }
}

/// Why the Kubernetes client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// No kubeconfig and not in a cluster, or a broken kubeconfig.
    #[error(
        "kubernetes client config (KUBECONFIG, ~/.kube/config or the in-cluster service account): {0}"
    )]
    Config(#[from] ::kube::config::InferConfigError),
    /// The client could not be built from the config.
    #[error("kubernetes client: {0}")]
    Client(#[from] ::kube::Error),
}

/// The API client, from `KUBECONFIG`/`~/.kube/config` or the in-cluster service account.
pub async fn client() -> Result<::kube::Client, KubeError> {
    let config = ::kube::Config::infer().await?;
    Ok(::kube::Client::try_from(config)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_comes_from_the_service_account_mount_else_default() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("namespace");
        assert_eq!(namespace_from(&file), "default", "no mount");
        std::fs::write(&file, "llm-serving\n").expect("write");
        assert_eq!(namespace_from(&file), "llm-serving");
        for bad in ["", "  \n", "Upper", "a/b", "x\u{0}y", &"n".repeat(64)] {
            std::fs::write(&file, bad).expect("write");
            assert_eq!(namespace_from(&file), "default", "{bad:?}");
        }
        assert_eq!(
            namespace_from(dir.path()),
            "default",
            "a directory, not a file"
        );
    }
}
