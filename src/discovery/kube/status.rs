//! Discovery's readiness: ready once the pool (when there is one) and its pods have been
//! listed; not ready while the pool object is missing or invalid, or once the watches have
//! been failing for longer than `--discovery-stale-after`. Every transition is logged with
//! its reason and counted (`kvpick_discovery_not_ready_total{reason}`,
//! `kvpick_discovery_ready`). Owned by the discovery task; `serve` reads the published value.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::metrics::DiscoveryMetrics;

/// Why discovery is not ready (the `reason` label and the log's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotReady {
    /// The first lists have not completed.
    Syncing,
    /// The InferencePool does not exist (never created, or deleted).
    PoolNotFound,
    /// The InferencePool exists but no version of its spec was ever valid.
    PoolInvalid,
    /// The watches have been failing for longer than the stale period.
    Stale,
    /// Leader election is on and another replica holds the Lease.
    NotLeader,
}

impl NotReady {
    /// The metric label and log text.
    pub fn label(self) -> &'static str {
        match self {
            Self::Syncing => "syncing",
            Self::PoolNotFound => "pool_not_found",
            Self::PoolInvalid => "pool_invalid",
            Self::Stale => "stale",
            Self::NotLeader => "not_leader",
        }
    }
}

/// `Ok` when discovery is ready, else why not; what `serve` folds into gRPC readiness.
pub type Readiness = Result<(), NotReady>;

/// What is known of the pool object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolPhase {
    /// Not listed yet.
    Unknown,
    /// Listed: not there.
    Absent,
    /// There, but no spec version was ever valid.
    Invalid,
    /// There, with a valid spec (possibly an older one, kept over an invalid edit).
    Valid,
}

/// The inputs of readiness, updated by the watch task.
pub struct Status {
    /// The pool object's phase.
    pub pool: PoolPhase,
    /// Whether the pods have been listed once under a valid spec.
    pub pods_synced: bool,
    failing_since: Option<Instant>,
    stale_after: Duration,
    published: watch::Sender<Readiness>,
    metrics: DiscoveryMetrics,
}

impl Status {
    /// A status that publishes into `published` (starting not ready: syncing).
    pub fn new(
        stale_after: Duration,
        published: watch::Sender<Readiness>,
        metrics: DiscoveryMetrics,
    ) -> Self {
        let _initial = published.send_replace(Err(NotReady::Syncing));
        metrics.ready.set(0);
        Self {
            pool: PoolPhase::Unknown,
            pods_synced: false,
            failing_since: None,
            stale_after,
            published,
            metrics,
        }
    }

    /// A watch yielded an error: the failing period starts now unless it already runs.
    /// True when this error starts it (the first of a streak is logged loudly, the rest at
    /// debug: a watcher retries every few hundred milliseconds during an outage).
    pub fn watch_failed(&mut self) -> bool {
        let first = self.failing_since.is_none();
        self.failing_since.get_or_insert_with(Instant::now);
        first
    }

    /// The API answered (a watch event, or the probe): the failing period ends.
    pub fn api_answered(&mut self) {
        self.failing_since = None;
    }

    /// Whether the watches are failing (the probe then runs).
    pub fn failing(&self) -> bool {
        self.failing_since.is_some()
    }

    /// Recomputes readiness and publishes a change (logged and counted).
    pub fn evaluate(&mut self) {
        let stale = self
            .failing_since
            .is_some_and(|since| since.elapsed() >= self.stale_after);
        let now: Readiness = match self.pool {
            _ if stale => Err(NotReady::Stale),
            PoolPhase::Unknown => Err(NotReady::Syncing),
            PoolPhase::Absent => Err(NotReady::PoolNotFound),
            PoolPhase::Invalid => Err(NotReady::PoolInvalid),
            PoolPhase::Valid if !self.pods_synced => Err(NotReady::Syncing),
            PoolPhase::Valid => Ok(()),
        };
        let before = *self.published.borrow();
        if before == now {
            return;
        }
        match now {
            Ok(()) => tracing::info!("kubernetes discovery ready"),
            Err(reason) => {
                let failing_for = self.failing_since.map(|since| since.elapsed());
                tracing::warn!(
                    reason = reason.label(),
                    ?failing_for,
                    "kubernetes discovery not ready"
                );
                self.metrics
                    .not_ready
                    .with_label_values(&[reason.label()])
                    .inc();
            }
        }
        self.metrics.ready.set(i64::from(now.is_ok()));
        let _before = self.published.send_replace(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn ready_after_sync_stale_after_the_period_and_back() {
        let metrics = DiscoveryMetrics::new(&prometheus::Registry::new()).expect("metrics");
        let (tx, rx) = watch::channel(Ok(()));
        let mut status = Status::new(Duration::from_secs(30), tx, metrics.clone());
        assert_eq!(*rx.borrow(), Err(NotReady::Syncing));
        status.pool = PoolPhase::Valid;
        status.evaluate();
        assert_eq!(*rx.borrow(), Err(NotReady::Syncing), "pods not listed yet");
        status.pods_synced = true;
        status.evaluate();
        assert_eq!(*rx.borrow(), Ok(()));
        status.watch_failed();
        tokio::time::sleep(Duration::from_secs(29)).await;
        status.watch_failed();
        status.evaluate();
        assert_eq!(*rx.borrow(), Ok(()), "failing, not yet stale");
        tokio::time::sleep(Duration::from_secs(1)).await;
        status.evaluate();
        assert_eq!(*rx.borrow(), Err(NotReady::Stale));
        status.api_answered();
        status.evaluate();
        assert_eq!(*rx.borrow(), Ok(()));
        status.pool = PoolPhase::Absent;
        status.evaluate();
        assert_eq!(*rx.borrow(), Err(NotReady::PoolNotFound));
        assert_eq!(metrics.not_ready.with_label_values(&["stale"]).get(), 1);
        assert_eq!(metrics.ready.get(), 0);
    }
}
