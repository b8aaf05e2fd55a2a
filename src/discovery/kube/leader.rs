//! Leader election on a `coordination.k8s.io/v1` Lease (`--ha-enable-leader-election`), with
//! client-go's algorithm as controller-runtime (and so llm-d) uses it: only the leader
//! reports ready, so the gateway sends traffic to one replica (GIE's active-passive).
//!
//! - A candidate reads the Lease every retry period. It takes the Lease when there is none
//!   (create), when it has no holder (released), or when the holder has not renewed it for
//!   the lease duration *as this replica observed it* (its own clock since the record last
//!   changed, as client-go does, so clock skew between nodes does not matter).
//! - The leader renews every retry period (an update carrying the resourceVersion it read:
//!   a concurrent writer gets 409 Conflict and loses that round). A leader that cannot renew
//!   within the renew deadline stops being the leader.
//! - On shutdown the leader releases the Lease (holder cleared), so a standby takes over at
//!   its next retry instead of after the lease duration.
//!
//! NOTE: controller-runtime exits the process when it loses the lease; kvpick steps back
//! to candidate instead (readiness off, index and subscriptions kept warm), which gives the
//! gateway the same single ready replica without a restart.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Leader election's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderConfig {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name (`epp-<namespace>-<pool>.llm-d.ai`, as llm-d names it).
    pub name: String,
    /// How long a Lease holds without renewal (controller-runtime: 15 s).
    pub lease_duration: Duration,
    /// How long a leader keeps trying to renew before it steps back (10 s).
    pub renew_deadline: Duration,
    /// How often candidates try to acquire and the leader renews (2 s).
    pub retry_period: Duration,
}

/// The Lease name llm-d uses for a pool (or, in selector mode, a Deployment).
pub fn lease_name(namespace: &str, name: &str) -> String {
    format!("epp-{namespace}-{name}.llm-d.ai")
}

/// The Deployment a pod name belongs to (`<deployment>-<replicaset hash>-<pod hash>`), as
/// llm-d derives the Lease name in selector mode.
pub fn deployment_of(pod_name: &str) -> Option<&str> {
    let (rest, _pod) = pod_name.rsplit_once('-')?;
    let (deployment, _hash) = rest.rsplit_once('-')?;
    (!deployment.is_empty()).then_some(deployment)
}

/// What one attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    /// We hold the Lease (acquired or renewed).
    Held,
    /// Someone else holds it, unexpired.
    Other,
    /// The API failed or a write conflicted.
    Failed,
}

/// What identifies one version of the Lease's record: its holder and renewTime.
type Record = (Option<String>, Option<Timestamp>);

/// When this replica last saw the Lease's record change, on its own clock.
#[derive(Debug, Default)]
struct Observed(Option<(Record, Instant)>);

impl Observed {
    /// How long `record` (just read) has been unchanged; a new record restarts the clock.
    fn unchanged_for(&mut self, record: Record) -> Duration {
        match &self.0 {
            Some((seen, at)) if *seen == record => at.elapsed(),
            _ => {
                self.0 = Some((record, Instant::now()));
                Duration::ZERO
            }
        }
    }
}

/// Whether the Lease may be written by `identity`: it has no holder, is ours, or its record
/// has gone unchanged for the holder's lease duration.
fn may_take(
    holder: Option<&str>,
    identity: &str,
    unchanged_for: Duration,
    duration: Duration,
) -> bool {
    match holder {
        None => true,
        Some(holder) => holder == identity || unchanged_for >= duration,
    }
}

/// One replica's elector.
pub struct Elector {
    api: Api<Lease>,
    config: LeaderConfig,
    identity: String,
    /// The record last read and when (on this replica's clock) it last changed.
    observed: Observed,
    leading: watch::Sender<bool>,
}

impl Elector {
    /// An elector for `identity` that publishes whether it leads into `leading`.
    pub fn new(
        client: Client,
        config: LeaderConfig,
        identity: String,
        leading: watch::Sender<bool>,
    ) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            config,
            identity,
            observed: Observed::default(),
            leading,
        }
    }

    fn set_leading(&self, leading: bool) {
        if *self.leading.borrow() != leading {
            if leading {
                tracing::info!(lease = %self.config.name, identity = %self.identity, "became the leader");
            } else {
                tracing::warn!(lease = %self.config.name, identity = %self.identity, "no longer the leader");
            }
            let _ = self.leading.send_replace(leading);
        }
    }

    /// Runs until `cancel`, then releases the Lease if it holds it.
    pub async fn run(mut self, cancel: CancellationToken) {
        let _ = self.leading.send_replace(false);
        let mut last_renewed: Option<Instant> = None;
        tracing::info!(lease = %self.config.name, identity = %self.identity, "leader election: candidate");
        loop {
            let attempt = tokio::select! {
                () = cancel.cancelled() => break,
                attempt = tokio::time::timeout(self.config.retry_period.max(Duration::from_secs(1)), self.try_acquire_or_renew()) => {
                    attempt.unwrap_or(Attempt::Failed)
                }
            };
            match attempt {
                Attempt::Held => {
                    last_renewed = Some(Instant::now());
                    self.set_leading(true);
                }
                Attempt::Other => {
                    last_renewed = None;
                    self.set_leading(false);
                }
                Attempt::Failed => {
                    // A leader keeps leading until the renew deadline passes without a renewal.
                    let lapsed =
                        last_renewed.is_none_or(|at| at.elapsed() >= self.config.renew_deadline);
                    if lapsed {
                        last_renewed = None;
                        self.set_leading(false);
                    }
                }
            }
            let wait = jittered(self.config.retry_period, *self.leading.borrow());
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
        if *self.leading.borrow() {
            self.release().await;
        }
        let _ = self.leading.send_replace(false);
    }

    /// client-go's tryAcquireOrRenew.
    async fn try_acquire_or_renew(&mut self) -> Attempt {
        let now = Timestamp::now();
        let current = match self.api.get_opt(&self.config.name).await {
            Ok(current) => current,
            Err(error) => {
                tracing::debug!(%error, lease = %self.config.name, "reading the lease failed");
                return Attempt::Failed;
            }
        };
        let Some(mut lease) = current else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.config.name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(now, now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Attempt::Held,
                Err(error) => {
                    tracing::debug!(%error, lease = %self.config.name, "creating the lease failed");
                    Attempt::Failed
                }
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (holder.clone(), spec.renew_time.as_ref().map(|t| t.0));
        let unchanged_for = self.observed.unchanged_for(record);
        let ours = holder.as_deref() == Some(self.identity.as_str());
        // The holder's own lease duration (a released lease says 1 s), bounded to sane values.
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.config.lease_duration, Duration::from_secs)
            .min(Duration::from_secs(3600));
        if !may_take(holder.as_deref(), &self.identity, unchanged_for, duration) {
            return Attempt::Other;
        }
        let transitions = spec.lease_transitions.unwrap_or(0);
        let (acquired, transitions) = if ours {
            (spec.acquire_time.map_or(now, |t| t.0), transitions)
        } else {
            (now, transitions.saturating_add(1))
        };
        lease.spec = Some(self.spec(acquired, now, transitions));
        // The resourceVersion read above travels with the update: a concurrent writer wins.
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(written) => {
                let spec = written.spec.unwrap_or_default();
                self.observed
                    .unchanged_for((spec.holder_identity, spec.renew_time.map(|t| t.0)));
                if !ours {
                    tracing::info!(lease = %self.config.name, previous = ?holder, "took the lease");
                }
                Attempt::Held
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Attempt::Other,
            Err(error) => {
                tracing::debug!(%error, lease = %self.config.name, "updating the lease failed");
                Attempt::Failed
            }
        }
    }

    fn spec(&self, acquired: Timestamp, renewed: Timestamp, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.config.lease_duration.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(renewed)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Clears the holder (client-go's release: a 1 s duration, so others take it at once).
    async fn release(&self) {
        let attempt = async {
            let mut lease = self.api.get(&self.config.name).await?;
            let spec = lease.spec.clone().unwrap_or_default();
            if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return Ok(());
            }
            let now = MicroTime(Timestamp::now());
            lease.spec = Some(LeaseSpec {
                holder_identity: None,
                lease_duration_seconds: Some(1),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: spec.lease_transitions,
                ..LeaseSpec::default()
            });
            self.api
                .replace(&self.config.name, &PostParams::default(), &lease)
                .await
                .map(|_| ())
        };
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(())) => tracing::info!(lease = %self.config.name, "released the lease"),
            Ok(Err(error)) => {
                tracing::warn!(%error, lease = %self.config.name, "releasing the lease failed; the standby takes over when it expires");
            }
            Err(_) => {
                tracing::warn!(lease = %self.config.name, "releasing the lease timed out; the standby takes over when it expires");
            }
        }
    }
}

/// The wait before the next attempt: the retry period for a leader; with up to 20 % jitter
/// for a candidate (client-go's JitterFactor 1.2), so candidates do not retry in step.
fn jittered(period: Duration, leading: bool) -> Duration {
    if leading {
        period
    } else {
        period.mul_f64(1.0 + fastrand::f64() * 0.2)
    }
}

/// Keeps `gauge` (`kvpick_leader`) at 1 while `leading` says this replica leads, else 0.
pub async fn export_leading(
    mut leading: watch::Receiver<bool>,
    gauge: prometheus::IntGauge,
    cancel: CancellationToken,
) {
    loop {
        gauge.set(i64::from(*leading.borrow_and_update()));
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = leading.changed() => if changed.is_err() { return },
        }
    }
}

/// This replica's identity: the pod name (or host name) and a random suffix, as
/// controller-runtime's `hostname_<uuid>`.
pub fn identity() -> String {
    let host = std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kvpick".to_owned());
    format!("{host}_{:016x}", fastrand::u64(..))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_follow_llm_d() {
        assert_eq!(lease_name("llm", "pool"), "epp-llm-pool.llm-d.ai");
        assert_eq!(deployment_of("kvpick-7d9f8b6c5d-x2x7q"), Some("kvpick"));
        assert_eq!(deployment_of("my-epp-7d9f8b6c5d-x2x7q"), Some("my-epp"));
        assert_eq!(deployment_of("nodashes"), None);
        assert_eq!(deployment_of("-a-b"), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_expires_after_its_duration_of_our_own_clock_without_change() {
        let duration = Duration::from_secs(15);
        let mut observed = Observed::default();
        let record = |renewed: &str| -> Record {
            (
                Some("other".to_owned()),
                Some(renewed.parse().expect("timestamp")),
            )
        };
        // An old renewTime in the record does not matter: the clock starts when we read it.
        let stale = record("2020-01-01T00:00:00Z");
        assert_eq!(observed.unchanged_for(stale.clone()), Duration::ZERO);
        tokio::time::advance(Duration::from_secs(14)).await;
        let held_for = observed.unchanged_for(stale.clone());
        assert!(!may_take(Some("other"), "me", held_for, duration));
        tokio::time::advance(Duration::from_secs(1)).await;
        let held_for = observed.unchanged_for(stale);
        assert!(may_take(Some("other"), "me", held_for, duration));
        // A renewal restarts the clock.
        let renewed = record("2020-01-01T00:00:02Z");
        let held_for = observed.unchanged_for(renewed);
        assert!(!may_take(Some("other"), "me", held_for, duration));
        assert!(may_take(None, "me", Duration::ZERO, duration), "released");
        assert!(may_take(Some("me"), "me", Duration::ZERO, duration), "ours");
    }

    #[test]
    fn only_candidates_jitter() {
        let period = Duration::from_secs(2);
        assert_eq!(jittered(period, true), period);
        for _ in 0..100 {
            let wait = jittered(period, false);
            assert!(wait >= period && wait <= period.mul_f64(1.2));
        }
    }
}
