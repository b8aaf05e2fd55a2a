//! The one endpoint source the flags name: the pool file, an InferencePool, or a label
//! selector (llm-d's standalone mode). Two sources, or a source's flag without its source,
//! are a start-up error naming the flags.

use std::path::PathBuf;
use std::time::Duration;

use super::{ConfigError, ServeArgs};

/// Where the pool's endpoints come from (exactly one).
#[derive(Debug, Clone)]
pub enum EndpointSource {
    /// The static pool file, polled.
    File {
        /// The file.
        path: PathBuf,
        /// Poll interval.
        reload_interval: Duration,
    },
    /// An InferencePool or a label selector, watched through the Kubernetes API.
    Kube(crate::discovery::kube::KubeDiscoveryConfig),
}

impl ServeArgs {
    /// The one endpoint source the flags name; a second one, or a source's flag without its
    /// source, is an error naming the flags.
    pub(super) fn endpoint_source(&self) -> Result<EndpointSource, ConfigError> {
        use crate::discovery::kube::{
            DiscoveryTarget, KubeDiscoveryConfig, KvPorts, LabelSelector, PoolGroup, PoolSpec,
            default_namespace,
        };
        let given: Vec<&str> = [
            (self.endpoints_file.is_some(), "--endpoints-file"),
            (self.pool_name.is_some(), "--pool-name"),
            (self.endpoint_selector.is_some(), "--endpoint-selector"),
        ]
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect();
        if given.len() > 1 {
            return Err(ConfigError::ConflictingSources(given.join(" and ")));
        }
        let invalid = |flag, reason: &str| ConfigError::Discovery {
            flag,
            reason: reason.to_owned(),
        };
        if self.endpoint_selector.is_none() && !self.endpoint_target_ports.is_empty() {
            return Err(invalid(
                "endpoint-target-ports",
                "needs --endpoint-selector (an InferencePool names its own ports)",
            ));
        }
        let target = match (
            &self.endpoints_file,
            &self.pool_name,
            &self.endpoint_selector,
        ) {
            (Some(path), _, _) => {
                let kube_only = [
                    (self.ha_enable_leader_election, "ha-enable-leader-election"),
                    (self.pool_namespace.is_some(), "pool-namespace"),
                    (self.kv_events_port.is_some(), "kv-events-port"),
                    (self.kv_replay_port.is_some(), "kv-replay-port"),
                ];
                if let Some((_, flag)) = kube_only.into_iter().find(|(given, _)| *given) {
                    return Err(invalid(
                        flag,
                        "applies to Kubernetes discovery, not to --endpoints-file",
                    ));
                }
                return Ok(EndpointSource::File {
                    path: path.clone(),
                    reload_interval: self.endpoints_reload_interval,
                });
            }
            (None, Some(name), _) => {
                if name.trim().is_empty() {
                    return Err(invalid("pool-name", "is empty"));
                }
                let group = PoolGroup::from_group(&self.pool_group).ok_or_else(|| {
                    invalid(
                        "pool-group",
                        &format!(
                            "`{}` is neither inference.networking.k8s.io nor inference.networking.x-k8s.io",
                            self.pool_group
                        ),
                    )
                })?;
                DiscoveryTarget::Pool {
                    name: name.trim().to_owned(),
                    group,
                }
            }
            (None, None, Some(selector)) => {
                let selector = LabelSelector::parse(selector)
                    .map_err(|reason| invalid("endpoint-selector", &reason))?;
                let ports = &self.endpoint_target_ports;
                if ports.is_empty()
                    || ports.len() > crate::discovery::kube::pool_spec::MAX_TARGET_PORTS
                {
                    return Err(invalid(
                        "endpoint-target-ports",
                        "give 1 to 8 ports with --endpoint-selector",
                    ));
                }
                if ports.contains(&0) {
                    return Err(invalid("endpoint-target-ports", "port 0"));
                }
                DiscoveryTarget::Selector(PoolSpec {
                    selector,
                    target_ports: ports.clone(),
                })
            }
            (None, None, None) => return Err(ConfigError::NoEndpointSource),
        };
        if self.discovery_stale_after.is_zero() {
            return Err(invalid("discovery-stale-after", "must be more than 0"));
        }
        let namespace = self
            .pool_namespace
            .clone()
            .filter(|ns| !ns.trim().is_empty())
            .unwrap_or_else(default_namespace);
        let leader = self.leader_config(&namespace, &target)?;
        Ok(EndpointSource::Kube(KubeDiscoveryConfig {
            namespace,
            leader,
            target,
            kv_ports: KvPorts {
                events: self.kv_events_port,
                replay: self.kv_replay_port,
            },
            stale_after: self.discovery_stale_after,
        }))
    }

    /// Leader election's settings (`None` when off): the Lease is named after the pool as
    /// llm-d names it, or in selector mode after the Deployment of `POD_NAME`.
    fn leader_config(
        &self,
        namespace: &str,
        target: &crate::discovery::kube::DiscoveryTarget,
    ) -> Result<Option<crate::discovery::kube::leader::LeaderConfig>, ConfigError> {
        use crate::discovery::kube::DiscoveryTarget;
        use crate::discovery::kube::leader::{LeaderConfig, deployment_of, lease_name};
        if !self.ha_enable_leader_election {
            return Ok(None);
        }
        let invalid = |flag, reason: &str| ConfigError::Discovery {
            flag,
            reason: reason.to_owned(),
        };
        let owner = match target {
            DiscoveryTarget::Pool { name, .. } => name.clone(),
            DiscoveryTarget::Selector(_) => {
                let pod = std::env::var("POD_NAME").unwrap_or_default();
                deployment_of(&pod)
                    .ok_or_else(|| {
                        invalid(
                            "ha-enable-leader-election",
                            "with --endpoint-selector needs POD_NAME (<deployment>-<hash>-<hash>) to name the Lease",
                        )
                    })?
                    .to_owned()
            }
        };
        let (lease, renew, retry) = (
            self.ha_lease_duration,
            self.ha_renew_deadline,
            self.ha_retry_period,
        );
        if lease < Duration::from_secs(1) || lease.subsec_nanos() != 0 {
            return Err(invalid(
                "ha-lease-duration",
                "must be whole seconds, at least 1s (a Lease counts in seconds)",
            ));
        }
        // client-go's checks: leaseDuration > renewDeadline > retryPeriod × 1.2 (jitter).
        if renew >= lease {
            return Err(invalid(
                "ha-renew-deadline",
                "must be less than --ha-lease-duration",
            ));
        }
        if retry.is_zero() || retry.mul_f64(1.2) >= renew {
            return Err(invalid(
                "ha-retry-period",
                "must be more than 0 and less than --ha-renew-deadline / 1.2",
            ));
        }
        Ok(Some(LeaderConfig {
            namespace: namespace.to_owned(),
            name: lease_name(namespace, &owner),
            lease_duration: lease,
            renew_deadline: renew,
            retry_period: retry,
        }))
    }
}
