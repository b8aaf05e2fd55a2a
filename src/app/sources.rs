//! Starts the one endpoint source the config names (the pool file or Kubernetes discovery)
//! under the supervisor, and hands back what readiness needs from it.
//!
//! Both sources feed the same path: a `Vec<Endpoint>` into [`Datastore::set_endpoints`].
//! The file source is ready as soon as its first pool is applied (before `serve` binds its
//! ports); Kubernetes discovery publishes its own [`Readiness`] (synced, pool present, not
//! stale), which `serve` folds into the gRPC readiness services.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::ServeError;
use super::subsystems;
use super::supervise::{Policy as SupervisorPolicy, Supervisor};
use crate::config::{EndpointSource, Live};
use crate::discovery::kube::policy::PoolRef;
use crate::discovery::kube::{
    DiscoveryMetrics, DiscoveryParts, DiscoveryTarget, NotReady, PolicyParts, Readiness,
    run_discovery, run_policy,
};
use crate::discovery::{PoolFileError, parse_pool};
use crate::endpoints::Datastore;
use crate::telemetry::EppMetrics;

/// The objectives and rewrite rules the request path reads, and their flag/file values.
pub struct Policy {
    /// What the ext-proc streams read.
    pub objectives: Live<std::collections::HashMap<String, i32>>,
    /// What the ext-proc streams read.
    pub rewrites: Live<crate::request::ModelRewriteRules>,
    /// `--objective`.
    pub flag_objectives: std::collections::HashMap<String, i32>,
    /// `--model-rewrites`.
    pub file_rewrites: crate::request::ModelRewriteRules,
}

/// Loads the first pool (file) or connects the client (Kubernetes), then starts the source's
/// subsystem (and, for an InferencePool, the objective/rewrite watches). Returns the
/// source's readiness.
pub async fn start(
    source: &EndpointSource,
    policy: Policy,
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
                SupervisorPolicy::RESTART,
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
            let metrics = DiscoveryMetrics::new(registry)?;
            let parts = Arc::new(DiscoveryParts {
                config: config.clone(),
                client: client.clone(),
                datastore: Arc::clone(datastore),
                metrics: metrics.clone(),
                readiness,
            });
            let discovery_cancel = cancel.clone();
            supervisor.spawn(
                "kube-discovery",
                SupervisorPolicy::RESTART,
                Box::new(move || {
                    Box::pin(run_discovery(Arc::clone(&parts), discovery_cancel.clone()))
                }),
            );
            // NOTE: objectives and rewrites name a pool; in selector mode there is none, so
            // they come from the flags and files only.
            let DiscoveryTarget::Pool { name, group } = &config.target else {
                return Ok(ready);
            };
            let (synced, policy_synced) = watch::channel(false);
            let parts = Arc::new(PolicyParts {
                namespace: config.namespace.clone(),
                pool: PoolRef {
                    name: name.clone(),
                    group: group.group().to_owned(),
                },
                client,
                metrics,
                flag_objectives: policy.flag_objectives,
                file_rewrites: policy.file_rewrites,
                objectives: policy.objectives,
                rewrites: policy.rewrites,
                synced,
                retry: config
                    .stale_after
                    .clamp(Duration::from_secs(1), Duration::from_secs(30)),
            });
            let policy_cancel = cancel.clone();
            supervisor.spawn(
                "kube-policy",
                SupervisorPolicy::RESTART,
                Box::new(move || Box::pin(run_policy(Arc::clone(&parts), policy_cancel.clone()))),
            );
            let (combined, combined_ready) = watch::channel(Err(NotReady::Syncing));
            tokio::spawn(combine(ready, policy_synced, combined, cancel.clone()));
            Ok(combined_ready)
        }
    }
}

/// Readiness of Kubernetes discovery and of the objective/rewrite watches together: not
/// ready (syncing) until both have listed, then discovery's own readiness.
async fn combine(
    mut discovery: watch::Receiver<Readiness>,
    mut policy: watch::Receiver<bool>,
    out: watch::Sender<Readiness>,
    cancel: CancellationToken,
) {
    loop {
        let now = match (*discovery.borrow_and_update(), *policy.borrow_and_update()) {
            (Err(reason), _) => Err(reason),
            (Ok(()), false) => Err(NotReady::Syncing),
            (Ok(()), true) => Ok(()),
        };
        out.send_if_modified(|before| std::mem::replace(before, now) != now);
        tokio::select! {
            () = cancel.cancelled() => return,
            Ok(()) = discovery.changed() => {}
            Ok(()) = policy.changed() => {}
            else => return cancel.cancelled().await,
        }
    }
}
