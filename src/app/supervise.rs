//! Supervision of kvpick's background subsystems (pool-file watcher, pool follower, flow
//! dispatcher, KV-event index writer).
//!
//! Each subsystem is a future that runs until kvpick shuts down. One that ends earlier — it
//! panicked, or returned — is a failure: it is logged, counted
//! (`kvpick_subsystem_failures_total{subsystem}`) and readiness goes NOT_SERVING, because a
//! kvpick whose pool or index silently stopped updating must not keep taking traffic. Then
//! its [`Policy`] decides: restart it (after a backoff, readiness back on once it runs
//! again), or give up, in which case [`Supervisor::run`] returns the failure and `serve`
//! shuts down and exits non-zero, so the orchestrator restarts the whole process.
//!
//! Subsystems are stopped through the cancellation token they were given, never aborted:
//! [`Supervisor::stop`] waits (bounded) for them to see it.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use futures::future::BoxFuture;
use prometheus::IntCounterVec;
use tokio::sync::watch;
use tokio::task::{Id, JoinSet};
use tokio::time::Instant;

/// What happens when a subsystem dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Start it again after `backoff`; more than `max` failures within `window` are fatal.
    Restart {
        /// Failures tolerated within `window`.
        max: usize,
        /// The window failures are counted in.
        window: Duration,
        /// Wait before the restart (readiness is off meanwhile).
        backoff: Duration,
    },
    /// The process shuts down and exits non-zero.
    Fatal,
}

impl Policy {
    /// The restart policy of the stateless subsystems: a few restarts a minute, 1 s apart.
    pub const RESTART: Self = Self::Restart {
        max: 5,
        window: Duration::from_secs(60),
        backoff: Duration::from_secs(1),
    };
}

/// A subsystem that died for good.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("subsystem {subsystem} failed: {cause}")]
pub struct SubsystemFailed {
    /// The subsystem's name.
    pub subsystem: &'static str,
    /// Why: the panic message, or that it ended, and whether restarts ran out.
    pub cause: String,
}

/// Makes a fresh run of a subsystem (called again on each restart).
pub type Start = Box<dyn FnMut() -> BoxFuture<'static, ()> + Send>;

struct Subsystem {
    name: &'static str,
    policy: Policy,
    start: Start,
    failures: VecDeque<Instant>,
}

/// Owns the running subsystems.
pub struct Supervisor {
    tasks: JoinSet<()>,
    running: HashMap<Id, Subsystem>,
    failures: IntCounterVec,
    healthy: watch::Sender<bool>,
}

impl Supervisor {
    /// A supervisor counting failures in `failures` (label `subsystem`).
    pub fn new(failures: IntCounterVec) -> Self {
        Self {
            tasks: JoinSet::new(),
            running: HashMap::new(),
            failures,
            healthy: watch::Sender::new(true),
        }
    }

    /// Whether every subsystem runs (false while one is down or after a fatal failure).
    pub fn healthy(&self) -> watch::Receiver<bool> {
        self.healthy.subscribe()
    }

    /// Starts a subsystem under `policy`.
    pub fn spawn(&mut self, name: &'static str, policy: Policy, mut start: Start) {
        // The series exists at 0 from the start, so an alert on its increase fires at the
        // first failure (Prometheus cannot see a counter's first sample as an increase).
        let _ = self.failures.with_label_values(&[name]);
        let id = self.tasks.spawn(start()).id();
        self.running.insert(
            id,
            Subsystem {
                name,
                policy,
                start,
                failures: VecDeque::new(),
            },
        );
    }

    /// Supervises until a subsystem fails for good, and returns that failure; restarts the
    /// others. Pending forever while all run (and when there are none).
    ///
    /// NOTE: not cancel-safe across a restart's backoff: poll one `run` future to the end
    /// (pin it once) rather than re-creating it in a loop.
    pub async fn run(&mut self) -> SubsystemFailed {
        loop {
            let Some(joined) = self.tasks.join_next_with_id().await else {
                return std::future::pending().await;
            };
            let (id, cause) = match joined {
                Ok((id, ())) => (id, "ended while kvpick was running".to_owned()),
                Err(error) if error.is_panic() => {
                    let id = error.id();
                    (
                        id,
                        format!("panicked: {}", panic_message(error.into_panic())),
                    )
                }
                Err(error) => (error.id(), "was cancelled".to_owned()),
            };
            let Some(mut subsystem) = self.running.remove(&id) else {
                continue;
            };
            let name = subsystem.name;
            self.failures.with_label_values(&[name]).inc();
            self.healthy.send_replace(false);
            tracing::error!(subsystem = name, %cause, "subsystem died; readiness off");
            let Policy::Restart {
                max,
                window,
                backoff,
            } = subsystem.policy
            else {
                return SubsystemFailed {
                    subsystem: name,
                    cause,
                };
            };
            let now = Instant::now();
            subsystem.failures.push_back(now);
            while subsystem
                .failures
                .front()
                .is_some_and(|at| now.duration_since(*at) > window)
            {
                subsystem.failures.pop_front();
            }
            if subsystem.failures.len() > max {
                return SubsystemFailed {
                    subsystem: name,
                    cause: format!("{cause} ({} times within {window:?})", max + 1),
                };
            }
            tokio::time::sleep(backoff).await;
            tracing::warn!(subsystem = name, "restarting subsystem");
            let id = self.tasks.spawn((subsystem.start)()).id();
            self.running.insert(id, subsystem);
            self.healthy.send_replace(true);
        }
    }

    /// Waits at most `limit` for the subsystems to end (they were cancelled through their
    /// tokens); any still running then are aborted.
    pub async fn stop(mut self, limit: Duration) {
        let all = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(limit, all).await.is_err() {
            let left: Vec<_> = self.running.values().map(|s| s.name).collect();
            tracing::warn!(?left, "subsystems did not stop in time; aborting them");
            self.tasks.abort_all();
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => payload
            .downcast_ref::<&str>()
            .map_or_else(|| "(no message)".to_owned(), |s| (*s).to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio_util::sync::CancellationToken;

    fn counter() -> IntCounterVec {
        IntCounterVec::new(prometheus::Opts::new("f", "f"), &["subsystem"]).expect("metric")
    }

    /// A subsystem that panics on its first `panics` runs, then runs until `cancel`.
    fn flaky(panics: usize, runs: Arc<AtomicUsize>, cancel: CancellationToken) -> Start {
        Box::new(move || {
            let run = runs.fetch_add(1, Ordering::SeqCst);
            let cancel = cancel.clone();
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                if run < panics {
                    panic!("run {run} broke");
                }
                cancel.cancelled().await;
            })
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_restartable_subsystem_is_restarted_and_readiness_comes_back() {
        let failures = counter();
        let mut supervisor = Supervisor::new(failures.clone());
        let (runs, cancel) = (Arc::new(AtomicUsize::new(0)), CancellationToken::new());
        supervisor.spawn(
            "watcher",
            Policy::RESTART,
            flaky(1, Arc::clone(&runs), cancel.clone()),
        );
        let mut healthy = supervisor.healthy();
        let run = tokio::spawn(async move {
            let failed = supervisor.run().await;
            panic!("no fatal failure expected: {failed}");
        });
        healthy.changed().await.expect("change");
        assert!(!*healthy.borrow_and_update(), "readiness off while down");
        let down = Instant::now();
        healthy.changed().await.expect("change");
        assert!(
            *healthy.borrow_and_update(),
            "readiness back after the restart"
        );
        assert_eq!(down.elapsed(), Duration::from_secs(1), "after the backoff");
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert_eq!(failures.with_label_values(&["watcher"]).get(), 1);
        run.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_fatal_subsystem_ends_supervision_with_its_panic() {
        let failures = counter();
        let mut supervisor = Supervisor::new(failures.clone());
        let cancel = CancellationToken::new();
        let runs = Arc::new(AtomicUsize::new(0));
        supervisor.spawn(
            "steady",
            Policy::RESTART,
            flaky(0, Arc::clone(&runs), cancel.clone()),
        );
        supervisor.spawn(
            "kv-events",
            Policy::Fatal,
            flaky(1, Arc::new(AtomicUsize::new(0)), cancel.clone()),
        );
        let healthy = supervisor.healthy();
        let failed = supervisor.run().await;
        assert_eq!(failed.subsystem, "kv-events");
        assert_eq!(failed.cause, "panicked: run 0 broke");
        assert!(!*healthy.borrow());
        assert_eq!(failures.with_label_values(&["kv-events"]).get(), 1);
        assert_eq!(failures.with_label_values(&["steady"]).get(), 0);
        // Shutdown goes through cancellation: the steady subsystem ends by itself.
        cancel.cancel();
        supervisor.stop(Duration::from_secs(5)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1, "never restarted");
    }

    #[tokio::test(start_paused = true)]
    async fn restarts_run_out_and_an_early_return_counts_as_a_failure() {
        let failures = counter();
        let mut supervisor = Supervisor::new(failures.clone());
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        supervisor.spawn(
            "follower",
            Policy::Restart {
                max: 2,
                window: Duration::from_secs(60),
                backoff: Duration::from_secs(1),
            },
            Box::new(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                Box::pin(async {})
            }),
        );
        let failed = supervisor.run().await;
        assert_eq!(failed.subsystem, "follower");
        assert_eq!(
            failed.cause,
            "ended while kvpick was running (3 times within 60s)"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        assert_eq!(failures.with_label_values(&["follower"]).get(), 3);
    }
}
