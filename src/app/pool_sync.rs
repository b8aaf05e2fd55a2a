//! Keeps the subsystems that follow the pool in step with it.
//!
//! One task: on every new pool snapshot it re-syncs the KV-event subscriptions and the
//! metric scrapers (each starts tasks for new endpoints and stops and purges those that
//! left); once a second it feeds what the scrapes learned about each pod's cache shape
//! (`cache_config_info`) to the prefix index and drops expired speculative entries.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::endpoints::PodId;
use crate::endpoints::{Endpoint, PoolSnapshot};
use crate::kvcache::PrefixIndex;
use crate::kvevents::KvEventsManager;
use crate::scrape::{MetricsStore, ScrapeManager, ScrapeObserver};

/// What the scrapes see that the KV-event subscriptions act on: a pod answering again
/// (reconnect now rather than at the end of the backoff) and an engine restart (its cache is
/// gone: clear its entries now rather than at its first new batch).
pub struct ScrapeToKvEvents(pub Arc<KvEventsManager>);

impl ScrapeObserver for ScrapeToKvEvents {
    fn recovered(&self, pod: PodId) {
        self.0.pod_reachable(pod);
    }

    fn restarted(&self, pod: PodId) {
        self.0.engine_restarted(pod);
    }
}

/// How often cache shapes are copied into the index and speculation is purged.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(1);

/// Follows `pool` until `cancel`.
pub async fn follow_pool(
    mut pool: watch::Receiver<Arc<PoolSnapshot>>,
    kv_events: Arc<KvEventsManager>,
    mut scrapers: ScrapeManager,
    store: Arc<MetricsStore>,
    index: Arc<PrefixIndex>,
    cancel: CancellationToken,
) {
    let mut housekeeping = tokio::time::interval(HOUSEKEEPING_INTERVAL);
    housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut current = sync(&pool, &kv_events, &mut scrapers).await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            changed = pool.changed() => {
                if changed.is_err() {
                    break;
                }
                current = sync(&pool, &kv_events, &mut scrapers).await;
            }
            _ = housekeeping.tick() => {
                for endpoint in &current {
                    let status = store.status(endpoint.id);
                    if let Some(metrics) = &status.metrics {
                        if let Some(block_size) = metrics.block_size {
                            index.set_pod_block_size(endpoint.id, block_size);
                        }
                        if let Some(blocks) = metrics.num_blocks.and_then(|b| usize::try_from(b).ok()) {
                            index.set_pod_capacity(endpoint.id, blocks);
                        }
                    }
                }
                index.purge_expired_speculation();
            }
        }
    }
    // NOTE: the KV-event subscriptions outlive one follower run (a restarted run re-syncs
    // them); `serve` shuts the manager down when kvpick stops.
}

async fn sync(
    pool: &watch::Receiver<Arc<PoolSnapshot>>,
    kv_events: &KvEventsManager,
    scrapers: &mut ScrapeManager,
) -> Vec<Endpoint> {
    let states = pool.borrow().endpoints.clone();
    let endpoints: Vec<Endpoint> = states.iter().map(|e| e.endpoint.clone()).collect();
    scrapers.sync(&states);
    kv_events.sync(&endpoints).await;
    endpoints
}
