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
use crate::config::EndpointSource;
use crate::discovery::kube::policy::PoolRef;
use crate::discovery::kube::{
    DiscoveryMetrics, DiscoveryParts, DiscoveryTarget, NotReady, PolicyHealth, PolicyParts,
    Readiness, run_discovery, run_policy,
};
use crate::discovery::{PoolFileError, parse_pool};
use crate::endpoints::Datastore;
use crate::live::Live;
use crate::telemetry::EppMetrics;

/// What a Kubernetes source needs besides its config: the objectives and rewrite rules the
/// request path reads (and their flag/file values), and when shutdown begins.
pub struct SourceInputs {
    /// What the ext-proc streams read.
    pub objectives: Live<std::collections::HashMap<String, i32>>,
    /// What the ext-proc streams read.
    pub rewrites: Live<crate::request::ModelRewriteRules>,
    /// `--objective`.
    pub flag_objectives: std::collections::HashMap<String, i32>,
    /// `--model-rewrites`.
    pub file_rewrites: crate::request::ModelRewriteRules,
    /// Fires when shutdown begins: a leader releases its Lease then (as llm-d does), so the
    /// standby takes over while this replica drains.
    pub stepping_down: CancellationToken,
}

/// Loads the first pool (file) or connects the client (Kubernetes), then starts the source's
/// subsystem (and, for an InferencePool, the objective/rewrite watches). Returns the
/// source's readiness.
pub async fn start(
    source: &EndpointSource,
    policy: SourceInputs,
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
            let metrics_leader = metrics.leader.clone();
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
            let leading = config.leader.as_ref().map(|leader| {
                let (leading, is_leader) = watch::channel(false);
                tokio::spawn(crate::discovery::kube::leader::export_leading(
                    is_leader.clone(),
                    metrics_leader.clone(),
                    cancel.clone(),
                ));
                // One identity for every run: a restarted elector renews the Lease it holds.
                let identity = crate::discovery::kube::leader::identity();
                tracing::info!(lease = %leader.name, %identity, "leader election on: only the leader reports ready");
                let (client, leader, stepping_down) =
                    (client.clone(), leader.clone(), policy.stepping_down.clone());
                supervisor.spawn(
                    "leader-election",
                    SupervisorPolicy::RESTART,
                    Box::new(move || {
                        let elector = crate::discovery::kube::leader::Elector::new(
                            client.clone(),
                            leader.clone(),
                            identity.clone(),
                            leading.clone(),
                        );
                        Box::pin(elector.run(stepping_down.clone()))
                    }),
                );
                is_leader
            });
            // NOTE: objectives and rewrites name a pool; in selector mode there is none, so
            // they come from the flags and files only.
            let DiscoveryTarget::Pool { name, group } = &config.target else {
                let (combined, combined_ready) = watch::channel(Err(NotReady::Syncing));
                let inputs = ReadinessInputs {
                    discovery: ready,
                    policy: None,
                    leading,
                    stale_after: config.stale_after,
                    metrics,
                };
                tokio::spawn(combine(inputs, combined, cancel.clone()));
                return Ok(combined_ready);
            };
            let (health, policy_health) = watch::channel(PolicyHealth::default());
            let parts = Arc::new(PolicyParts {
                namespace: config.namespace.clone(),
                pool: PoolRef {
                    name: name.clone(),
                    group: group.group().to_owned(),
                },
                client,
                metrics: metrics.clone(),
                flag_objectives: policy.flag_objectives,
                file_rewrites: policy.file_rewrites,
                objectives: policy.objectives,
                rewrites: policy.rewrites,
                health,
                retry: config
                    .stale_after
                    .clamp(Duration::from_secs(1), Duration::from_secs(30)),
                stale_after: config.stale_after,
            });
            let policy_cancel = cancel.clone();
            supervisor.spawn(
                "kube-policy",
                SupervisorPolicy::RESTART,
                Box::new(move || Box::pin(run_policy(Arc::clone(&parts), policy_cancel.clone()))),
            );
            let (combined, combined_ready) = watch::channel(Err(NotReady::Syncing));
            let inputs = ReadinessInputs {
                discovery: ready,
                policy: Some(policy_health),
                leading,
                stale_after: config.stale_after,
                metrics,
            };
            tokio::spawn(combine(inputs, combined, cancel.clone()));
            Ok(combined_ready)
        }
    }
}

/// What readiness is combined from.
struct ReadinessInputs {
    /// Discovery's own readiness (pool and pods).
    discovery: watch::Receiver<Readiness>,
    /// The objective/rewrite watches (none in selector mode).
    policy: Option<watch::Receiver<PolicyHealth>>,
    /// Whether this replica leads (with leader election on).
    leading: Option<watch::Receiver<bool>>,
    /// `--discovery-stale-after`, for the policy watches as for the pool's.
    stale_after: Duration,
    /// Where a stale policy watch is counted.
    metrics: DiscoveryMetrics,
}

/// Readiness of Kubernetes discovery, of the objective/rewrite watches and of leader
/// election together: discovery's own reason first, then syncing until the policy watches
/// have listed, then stale once a policy watch has failed for longer than the stale period
/// (objectives and rewrites may then be out of date, as the pool would be), then not_leader
/// while another replica holds the Lease.
async fn combine(
    mut inputs: ReadinessInputs,
    out: watch::Sender<Readiness>,
    cancel: CancellationToken,
) {
    async fn changed<T>(rx: &mut Option<watch::Receiver<T>>) {
        let closed = match rx {
            Some(rx) => rx.changed().await.is_err(),
            None => true,
        };
        if closed {
            // A closed or absent input never changes again.
            std::future::pending::<()>().await;
        }
    }
    let mut policy_stale = false;
    loop {
        let health = inputs.policy.as_mut().map_or(
            PolicyHealth {
                synced: true,
                failing_since: None,
            },
            |rx| *rx.borrow_and_update(),
        );
        let leader = inputs
            .leading
            .as_mut()
            .is_none_or(|rx| *rx.borrow_and_update());
        let stale_at = health.failing_since.map(|since| since + inputs.stale_after);
        let stale = stale_at.is_some_and(|at| tokio::time::Instant::now() >= at);
        let discovery = *inputs.discovery.borrow_and_update();
        let now = match discovery {
            Err(reason) => Err(reason),
            Ok(()) if !health.synced => Err(NotReady::Syncing),
            Ok(()) if stale => Err(NotReady::Stale),
            Ok(()) if !leader => Err(NotReady::NotLeader),
            Ok(()) => Ok(()),
        };
        // Logged and counted here only when the policy watches are the reason (discovery
        // logs and counts its own, e.g. the whole API being down).
        let stale_by_policy = stale && discovery.is_ok();
        if stale_by_policy != policy_stale {
            policy_stale = stale_by_policy;
            if stale_by_policy {
                tracing::warn!(failing_for = ?health.failing_since.map(|s| s.elapsed()), "objective/rewrite watches failing for longer than --discovery-stale-after; readiness off");
                inputs
                    .metrics
                    .not_ready
                    .with_label_values(&[NotReady::Stale.label()])
                    .inc();
            } else if !stale {
                tracing::info!("objective/rewrite watches answer again");
            }
        }
        out.send_if_modified(|before| std::mem::replace(before, now) != now);
        let until_stale = async {
            match stale_at.filter(|_| !stale) {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            Ok(()) = inputs.discovery.changed() => {}
            () = changed(&mut inputs.policy) => {}
            () = changed(&mut inputs.leading) => {}
            () = until_stale => {}
        }
    }
}
