//! The background subsystems `serve` runs under its [`Supervisor`], each as a [`Start`]
//! that makes a fresh run, and the policy each gets (see [`super::supervise`]):
//!
//! | subsystem | policy | why |
//! | --- | --- | --- |
//! | `pool-file-watcher` | restart | stateless: a new run re-reads the file |
//! | `kube-discovery` | restart | a new run re-lists the InferencePool and its pods (`src/app/sources.rs`) |
//! | `pool-follower` | restart | a new run re-syncs subscriptions and scrapers from the pool |
//! | `flow-dispatcher` | restart | stateless: queued requests wait in the controller |
//! | `liveness` | restart | stateless: a new run re-judges every endpoint from its scrape and events |
//! | `kv-events-writer` | fatal | owns the index's event queue: see [`supervise_kv_events`] |

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::pool_sync;
use super::supervise::{Policy, Start, Supervisor};
use crate::discovery::watch_pool_file;
use crate::endpoints::Datastore;
use crate::kvcache::PrefixIndex;
use crate::kvevents::KvEventsManager;
use crate::scheduling::FlowController;
use crate::scrape::{MetricsStore, ScrapeConfig, ScrapeManager, ScrapeMetrics};
use crate::telemetry::EppMetrics;

/// Polls the pool file; the first run skips `initial` (already applied), later runs
/// re-apply the file as they find it.
pub fn pool_watcher(
    path: PathBuf,
    interval: Duration,
    initial: String,
    datastore: Arc<Datastore>,
    metrics: Arc<EppMetrics>,
    cancel: CancellationToken,
) -> Start {
    let mut initial = Some(initial);
    Box::new(move || {
        Box::pin(watch_pool_file(
            path.clone(),
            interval,
            initial.take(),
            Arc::clone(&datastore),
            Arc::clone(&metrics),
            cancel.clone(),
        ))
    })
}

/// What the pool follower works on.
pub struct FollowerParts {
    /// The pool.
    pub datastore: Arc<Datastore>,
    /// KV-event subscriptions to keep in step.
    pub kv_events: Arc<KvEventsManager>,
    /// Scrape settings.
    pub scrape: ScrapeConfig,
    /// Where scrapes land.
    pub store: Arc<MetricsStore>,
    /// Scrape metrics (registered once, shared by every run).
    pub scrape_metrics: ScrapeMetrics,
    /// The prefix index (cache shapes, speculation purge).
    pub index: Arc<PrefixIndex>,
}

/// Marks endpoints down and up again ([`super::liveness`]).
pub fn liveness(
    datastore: Arc<Datastore>,
    scrapes: Arc<MetricsStore>,
    kv_events: Arc<KvEventsManager>,
    metrics: Arc<EppMetrics>,
    interval: Duration,
    cancel: CancellationToken,
) -> Start {
    Box::new(move || {
        Box::pin(super::liveness::track_liveness(
            super::liveness::LivenessInputs {
                datastore: Arc::clone(&datastore),
                scrapes: Arc::clone(&scrapes),
                kv_events: Arc::clone(&kv_events),
                metrics: Arc::clone(&metrics),
            },
            interval,
            cancel.clone(),
        ))
    })
}

/// Follows the pool. Each run gets its own child token and scrape manager: when a run dies,
/// dropping it cancels the token, so its scrape tasks stop instead of running twice beside
/// the next run's.
pub fn pool_follower(parts: FollowerParts, cancel: CancellationToken) -> Start {
    Box::new(move || {
        let run = cancel.child_token();
        let stop_scrapers = run.clone().drop_guard();
        let scrapers = ScrapeManager::new(
            parts.scrape.clone(),
            Arc::clone(&parts.store),
            parts.scrape_metrics.clone(),
            run.clone(),
        )
        .with_observer(Arc::new(pool_sync::ScrapeToKvEvents(Arc::clone(
            &parts.kv_events,
        ))));
        let follow = pool_sync::follow_pool(
            parts.datastore.subscribe(),
            Arc::clone(&parts.kv_events),
            scrapers,
            Arc::clone(&parts.store),
            Arc::clone(&parts.index),
            run,
        );
        Box::pin(async move {
            let _stop_scrapers = stop_scrapers;
            follow.await;
        })
    })
}

/// Flow control's dispatcher.
pub fn flow_dispatcher(
    flow: FlowController,
    interval: Duration,
    cancel: CancellationToken,
) -> Start {
    Box::new(move || Box::pin(flow.clone().run_dispatcher(interval, cancel.clone())))
}

/// Puts the KV-event index writer under supervision, with [`Policy::Fatal`]: the writer owns
/// the receiving end of the index's event queue, so a new run cannot take over without the
/// manager, and an index that silently stopped learning routes worse than a restarted pod.
/// The writer ends only if it panics or the manager shuts down (then the supervisor is
/// stopping too).
pub fn supervise_kv_events(
    supervisor: &mut Supervisor,
    kv_events: &Arc<KvEventsManager>,
    cancel: &CancellationToken,
) {
    let Some(writer) = kv_events.take_writer() else {
        return;
    };
    let cancel = cancel.clone();
    let mut writer = Some(writer);
    supervisor.spawn(
        "kv-events-writer",
        Policy::Fatal,
        Box::new(move || match writer.take() {
            Some(handle) => {
                let cancel = cancel.clone();
                Box::pin(async move {
                    tokio::select! {
                        joined = handle => {
                            // A panic inside the writer surfaces here as the subsystem's own
                            // failure, so the supervisor logs, counts and ends kvpick.
                            if let Err(error) = joined
                                && error.is_panic()
                            {
                                std::panic::resume_unwind(error.into_panic());
                            }
                        }
                        () = cancel.cancelled() => {}
                    }
                })
            }
            None => Box::pin(std::future::pending()),
        }),
    );
}
