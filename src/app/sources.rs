//! Starts the one endpoint source the config names (the pool file or Kubernetes discovery)
//! under the supervisor, and hands back what readiness needs from it.
//!
//! Both sources feed the same path: a `Vec<Endpoint>` into [`Datastore::set_endpoints`].
//! The file source is ready as soon as its first pool is applied (before `serve` binds its
//! ports); Kubernetes discovery publishes its own [`Readiness`] (synced, pool present, not
//! stale), which `serve` folds into the gRPC readiness services.

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::ServeError;
use super::subsystems;
use super::supervise::{Policy, Supervisor};
use crate::config::EndpointSource;
use crate::discovery::kube::{DiscoveryMetrics, DiscoveryParts, Readiness, run_discovery};
use crate::discovery::{PoolFileError, parse_pool};
use crate::endpoints::Datastore;
use crate::telemetry::EppMetrics;

/// Loads the first pool (file) or connects the client (Kubernetes), then starts the source's
/// subsystem. Returns the source's readiness.
pub async fn start(
    source: &EndpointSource,
    datastore: &Arc<Datastore>,
    metrics: &Arc<EppMetrics>,
    registry: &prometheus::Registry,
    supervisor: &mut Supervisor,
    cancel: &CancellationToken,
) -> Result<watch::Receiver<Readiness>, ServeError> {
    match source {
        EndpointSource::File {
            path,
            reload_interval,
        } => {
            // The first pool must be valid: a kvpick that starts on a broken file would
            // route nowhere.
            let initial =
                tokio::fs::read_to_string(path)
                    .await
                    .map_err(|source| PoolFileError::Read {
                        path: path.clone(),
                        source,
                    })?;
            let endpoints = parse_pool(path, &initial)?;
            tracing::info!(endpoints = endpoints.len(), file = %path.display(), "pool loaded");
            datastore.set_endpoints(endpoints);
            supervisor.spawn(
                "pool-file-watcher",
                Policy::RESTART,
                subsystems::pool_watcher(
                    path.clone(),
                    *reload_interval,
                    initial,
                    Arc::clone(datastore),
                    Arc::clone(metrics),
                    cancel.clone(),
                ),
            );
            let (_, ready) = watch::channel(Ok(()));
            Ok(ready)
        }
        EndpointSource::Kube(config) => {
            let client = crate::discovery::kube::client().await?;
            tracing::info!(namespace = %config.namespace, target = ?config.target, "watching Kubernetes for the pool");
            let (readiness, ready) = watch::channel(Ok(()));
            let parts = Arc::new(DiscoveryParts {
                config: config.clone(),
                client,
                datastore: Arc::clone(datastore),
                metrics: DiscoveryMetrics::new(registry)?,
                readiness,
            });
            let cancel = cancel.clone();
            supervisor.spawn(
                "kube-discovery",
                Policy::RESTART,
                Box::new(move || Box::pin(run_discovery(Arc::clone(&parts), cancel.clone()))),
            );
            Ok(ready)
        }
    }
}
