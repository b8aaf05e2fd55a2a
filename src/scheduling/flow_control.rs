//! Flow control: while the pool is saturated, requests wait here instead of piling onto
//! model servers, and leave in priority order as capacity frees.
//!
//! - Strict priority between levels (higher `priority` first); within one level, round-robin
//!   over fairness ids (`x-gateway-inference-fairness-id`), FIFO within one id — so one tenant's
//!   burst cannot starve another tenant of the same priority.
//! - Bounded by request count and by body bytes: a request that does not fit is refused at
//!   once ([`FlowError::QueueFull`] → 429).
//! - Each request waits at most its TTL. At its TTL a request that is not sheddable
//!   (priority ≥ 0) is dispatched anyway if the pool finished a request while it waited
//!   ([`FlowController::completed`]): the fleet is making progress, so the engines' own queue
//!   can take it, and failing work the fleet can serve helps nobody. A sheddable request, or
//!   one that waited through a pool that finished nothing, fails ([`FlowError::TimedOut`] →
//!   503). A client that goes away drops its `admit` future, which takes it out of the queue.
//! - With zero endpoints the capacity check says no, so requests queue until an endpoint
//!   appears (scale from zero) or their TTL ends.
//!
//! How capacity is known: the controller is built with a `has_capacity(pending)` function (the
//! caller wires it to the saturation detector); `pending` is the number of requests admitted
//! whose [`Permit`] is still alive, i.e. dispatched but not yet counted in the endpoints'
//! in-flight load — so one capacity signal does not release the whole queue at once. The
//! caller drops the permit once the pick has started the in-flight count. [`FlowController::
//! dispatch`] releases waiters while `has_capacity` says yes; call it when load falls (a
//! response ends, a scrape arrives, an endpoint joins) and on a short ticker
//! ([`FlowController::run_dispatcher`]).
//!
//! Concurrency rules: one std mutex over the queues, held for an enqueue, a removal or one
//! dispatch round, never across an `.await`. `has_capacity` is called with the mutex held: it
//! must not call back into the controller.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// Limits of the queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowControlConfig {
    /// Requests waiting at most, over all priorities.
    pub max_requests: usize,
    /// Body bytes waiting at most, over all priorities.
    pub max_bytes: usize,
    /// How long a request may wait when it names no TTL.
    pub default_ttl: Duration,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        Self {
            max_requests: 10_000,
            max_bytes: 1 << 30,
            default_ttl: Duration::from_secs(30),
        }
    }
}

/// What flow control needs to know of a request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FlowRequest {
    /// Higher is more important.
    pub priority: i32,
    /// The tenant; requests without one share the empty id.
    pub fairness_id: String,
    /// Body bytes (counted against `max_bytes`, with the fairness id's length).
    pub bytes: usize,
    /// How long it may wait (`None`: the configured default).
    pub ttl: Option<Duration>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlowError {
    /// The queues are full (count or bytes): answer 429.
    #[error("flow control queue is full")]
    QueueFull,
    /// It waited its whole TTL: answer 503.
    #[error("queued past its TTL")]
    TimedOut,
}

impl FlowError {
    /// The HTTP status the gateway should answer with.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::QueueFull => 429,
            Self::TimedOut => 503,
        }
    }
}

/// The capacity check: `has_capacity(pending)`.
pub type CapacityFn = dyn Fn(usize) -> bool + Send + Sync;

struct Waiter {
    id: u64,
    bytes: usize,
    tx: oneshot::Sender<Permit>,
}

#[derive(Default)]
struct Band {
    /// Fairness ids with waiters, in round-robin order.
    ring: VecDeque<String>,
    flows: HashMap<String, VecDeque<Waiter>>,
}

#[derive(Default)]
struct Queues {
    /// By priority, ascending (dispatch takes the last).
    bands: BTreeMap<i32, Band>,
    count: usize,
    bytes: usize,
}

impl Queues {
    fn remove(&mut self, priority: i32, fairness_id: &str, id: u64) -> bool {
        let Some(band) = self.bands.get_mut(&priority) else {
            return false;
        };
        let Some(flow) = band.flows.get_mut(fairness_id) else {
            return false;
        };
        let Some(position) = flow.iter().position(|w| w.id == id) else {
            return false;
        };
        if let Some(waiter) = flow.remove(position) {
            self.count = self.count.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub(waiter.bytes);
        }
        if flow.is_empty() {
            band.flows.remove(fairness_id);
            band.ring.retain(|f| f != fairness_id);
        }
        if band.flows.is_empty() {
            self.bands.remove(&priority);
        }
        true
    }

    /// The next waiter: highest priority, round-robin over fairness ids.
    fn pop(&mut self) -> Option<Waiter> {
        let (&priority, band) = self.bands.iter_mut().next_back()?;
        let fairness_id = band.ring.pop_front()?;
        let flow = band.flows.get_mut(&fairness_id)?;
        let waiter = flow.pop_front();
        if flow.is_empty() {
            band.flows.remove(&fairness_id);
        } else {
            band.ring.push_back(fairness_id);
        }
        if band.flows.is_empty() {
            self.bands.remove(&priority);
        }
        if let Some(w) = &waiter {
            self.count = self.count.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub(w.bytes);
        }
        waiter
    }
}

struct Shared {
    config: FlowControlConfig,
    has_capacity: Box<CapacityFn>,
    queues: Mutex<Queues>,
    pending: AtomicUsize,
    next_id: AtomicU64,
    /// Responses finished so far (the pool's progress).
    completions: AtomicU64,
    /// Requests dispatched at their TTL because the pool was making progress.
    overdue: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        // NOTE: the queues stay structurally valid on a panic elsewhere; keep serving.
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Admission of one request; while alive it counts as `pending` in the capacity check.
/// Drop it once the request's in-flight load is counted (right after the pick).
#[derive(Debug)]
pub struct Permit {
    shared: Option<Arc<SharedHandle>>,
}

/// A handle that decrements `pending` (kept separate so [`Permit`] can be `Debug`).
struct SharedHandle(Arc<Shared>);

impl std::fmt::Debug for SharedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FlowControlPermit")
    }
}

impl Permit {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.pending.fetch_add(1, Ordering::AcqRel);
        Self {
            shared: Some(Arc::new(SharedHandle(Arc::clone(shared)))),
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(handle) = self.shared.take() {
            handle.0.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Removes a waiter that stops waiting (dropped future or TTL) from the queue.
struct QueuedGuard<'a> {
    shared: &'a Arc<Shared>,
    priority: i32,
    fairness_id: &'a str,
    id: u64,
}

impl Drop for QueuedGuard<'_> {
    fn drop(&mut self) {
        self.shared
            .lock()
            .remove(self.priority, self.fairness_id, self.id);
    }
}

/// The flow controller (cheap to clone; clones share the queues).
#[derive(Clone)]
pub struct FlowController {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FlowController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowController")
            .field("config", &self.shared.config)
            .field("queued", &self.queued())
            .finish_non_exhaustive()
    }
}

impl FlowController {
    /// A controller with these limits and capacity check.
    pub fn new(
        config: FlowControlConfig,
        has_capacity: impl Fn(usize) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                config,
                has_capacity: Box::new(has_capacity),
                queues: Mutex::new(Queues::default()),
                pending: AtomicUsize::new(0),
                next_id: AtomicU64::new(0),
                completions: AtomicU64::new(0),
                overdue: AtomicU64::new(0),
            }),
        }
    }

    /// Waits until the request may be scheduled. Immediate when nothing is queued and there
    /// is capacity; otherwise queued (see the module docs). Dropping the future leaves the
    /// queue.
    pub async fn admit(&self, request: FlowRequest) -> Result<Permit, FlowError> {
        let shared = &self.shared;
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        // The fairness id is stored while queued: it counts against the byte bound too.
        let bytes = request.bytes.saturating_add(request.fairness_id.len());
        let rx = {
            let mut queues = shared.lock();
            if queues.count == 0 && (shared.has_capacity)(shared.pending.load(Ordering::Acquire)) {
                return Ok(Permit::new(shared));
            }
            if queues.count >= shared.config.max_requests
                || queues.bytes.saturating_add(bytes) > shared.config.max_bytes
            {
                return Err(FlowError::QueueFull);
            }
            let (tx, rx) = oneshot::channel();
            let band = queues.bands.entry(request.priority).or_default();
            let flow = band.flows.entry(request.fairness_id.clone()).or_default();
            if flow.is_empty() {
                band.ring.push_back(request.fairness_id.clone());
            }
            flow.push_back(Waiter { id, bytes, tx });
            queues.count += 1;
            queues.bytes += bytes;
            rx
        };
        let _guard = QueuedGuard {
            shared,
            priority: request.priority,
            fairness_id: &request.fairness_id,
            id,
        };
        let completions = shared.completions.load(Ordering::Acquire);
        let ttl = request.ttl.unwrap_or(shared.config.default_ttl);
        match tokio::time::timeout(ttl, rx).await {
            Ok(Ok(permit)) => Ok(permit),
            // The sender is only dropped by dispatch after a failed send, never while we
            // wait; treat it like a timeout.
            Ok(Err(_)) | Err(_) => {
                let progressed = shared.completions.load(Ordering::Acquire) > completions;
                if request.priority >= 0 && progressed {
                    shared.overdue.fetch_add(1, Ordering::Relaxed);
                    Ok(Permit::new(shared))
                } else {
                    Err(FlowError::TimedOut)
                }
            }
        }
    }

    /// A response finished: counts the pool's progress and releases what fits now.
    pub fn completed(&self) -> usize {
        self.shared.completions.fetch_add(1, Ordering::AcqRel);
        self.dispatch()
    }

    /// Requests dispatched at their TTL because the pool was making progress.
    pub fn overdue_dispatches(&self) -> u64 {
        self.shared.overdue.load(Ordering::Relaxed)
    }

    /// Releases queued requests in order while there is capacity; returns how many.
    pub fn dispatch(&self) -> usize {
        let shared = &self.shared;
        let mut released = 0;
        let mut queues = shared.lock();
        while queues.count > 0 && (shared.has_capacity)(shared.pending.load(Ordering::Acquire)) {
            let Some(waiter) = queues.pop() else {
                break;
            };
            // A failed send means the waiter just gave up; its permit is dropped at once.
            if waiter.tx.send(Permit::new(shared)).is_ok() {
                released += 1;
            }
        }
        released
    }

    /// Calls [`Self::dispatch`] every `interval` until `cancel` fires.
    pub async fn run_dispatcher(self, interval: Duration, cancel: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = ticker.tick() => {}
            }
            self.dispatch();
        }
    }

    /// Requests waiting.
    pub fn queued(&self) -> usize {
        self.shared.lock().count
    }

    /// Body bytes waiting.
    pub fn queued_bytes(&self) -> usize {
        self.shared.lock().bytes
    }

    /// Admitted requests whose permit is still alive.
    pub fn pending(&self) -> usize {
        self.shared.pending.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use tokio::task::JoinHandle;

    fn request(priority: i32, tenant: &str) -> FlowRequest {
        FlowRequest {
            priority,
            fairness_id: tenant.to_owned(),
            bytes: 10,
            ttl: None,
        }
    }

    /// A controller whose capacity is a switch (and ≤ `max_pending` pending permits).
    fn switched(
        config: FlowControlConfig,
        max_pending: usize,
    ) -> (FlowController, Arc<AtomicBool>) {
        let open = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&open);
        let fc = FlowController::new(config, move |pending| {
            flag.load(Ordering::SeqCst) && pending < max_pending
        });
        (fc, open)
    }

    async fn settle(fc: &FlowController, queued: usize) {
        for _ in 0..100 {
            if fc.queued() == queued {
                return;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(fc.queued(), queued, "queue did not settle");
    }

    fn spawn_admit(
        fc: &FlowController,
        r: FlowRequest,
        log: &Arc<Mutex<Vec<String>>>,
        tag: &str,
    ) -> JoinHandle<Result<(), FlowError>> {
        let fc = fc.clone();
        let log = Arc::clone(log);
        let tag = tag.to_owned();
        tokio::spawn(async move {
            let permit = fc.admit(r).await?;
            log.lock().expect("log").push(tag);
            drop(permit);
            Ok(())
        })
    }

    #[tokio::test(start_paused = true)]
    async fn immediate_with_capacity_and_pending_counts_permits() {
        let (fc, open) = switched(FlowControlConfig::default(), 2);
        open.store(true, Ordering::SeqCst);
        let a = fc.admit(request(0, "")).await.expect("a");
        let b = fc.admit(request(0, "")).await.expect("b");
        assert_eq!(fc.pending(), 2);
        let log = Arc::new(Mutex::new(Vec::new()));
        let c = spawn_admit(&fc, request(0, ""), &log, "c");
        settle(&fc, 1).await;
        assert_eq!(fc.dispatch(), 0, "two permits pending: no capacity");
        drop(a);
        assert_eq!(fc.dispatch(), 1);
        c.await.expect("join").expect("admitted");
        drop(b);
        assert_eq!(fc.pending(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn ttl_expires_and_leaves_the_queue() {
        let (fc, _open) = switched(FlowControlConfig::default(), usize::MAX);
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut short = request(0, "t");
        short.ttl = Some(Duration::from_secs(2));
        let waiting = spawn_admit(&fc, short, &log, "x");
        settle(&fc, 1).await;
        tokio::time::sleep(Duration::from_millis(1999)).await;
        assert_eq!(fc.queued(), 1, "still waiting just before its TTL");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(waiting.await.expect("join"), Err(FlowError::TimedOut));
        assert_eq!(fc.queued(), 0);
        assert_eq!(fc.queued_bytes(), 0);
        assert_eq!(FlowError::TimedOut.http_status(), 503);
    }

    #[tokio::test(start_paused = true)]
    async fn at_its_ttl_a_request_is_dispatched_while_the_pool_makes_progress() {
        let (fc, _open) = switched(FlowControlConfig::default(), usize::MAX);
        let log = Arc::new(Mutex::new(Vec::new()));
        let ttl = |mut r: FlowRequest| {
            r.ttl = Some(Duration::from_secs(2));
            r
        };
        let served = spawn_admit(&fc, ttl(request(0, "a")), &log, "served");
        let sheddable = spawn_admit(&fc, ttl(request(-1, "b")), &log, "shed");
        settle(&fc, 2).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        // Capacity never opens, but a response finishes: the pool is making progress.
        assert_eq!(fc.completed(), 0, "still no capacity");
        tokio::time::sleep(Duration::from_millis(1600)).await;
        assert_eq!(served.await.expect("join"), Ok(()), "dispatched at its TTL");
        assert_eq!(
            sheddable.await.expect("join"),
            Err(FlowError::TimedOut),
            "a sheddable request still fails"
        );
        assert_eq!(fc.overdue_dispatches(), 1);
        // A request that waits through a pool that finishes nothing fails.
        let stuck = spawn_admit(&fc, ttl(request(0, "c")), &log, "stuck");
        settle(&fc, 1).await;
        tokio::time::sleep(Duration::from_millis(2100)).await;
        assert_eq!(stuck.await.expect("join"), Err(FlowError::TimedOut));
        assert_eq!(fc.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn strict_priority_then_round_robin_fairness() {
        let (fc, open) = switched(FlowControlConfig::default(), 1);
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (p, tenant, tag) in [
            (0, "a", "a1"),
            (0, "a", "a2"),
            (0, "a", "a3"),
            (0, "b", "b1"),
            (-1, "c", "low"),
            (5, "z", "high"),
            (0, "b", "b2"),
        ] {
            tasks.push(spawn_admit(&fc, request(p, tenant), &log, tag));
            settle(&fc, tasks.len()).await;
        }
        open.store(true, Ordering::SeqCst);
        // One at a time: each released request drops its permit once it runs.
        for n in (0..tasks.len()).rev() {
            assert_eq!(fc.dispatch(), 1);
            settle(&fc, n).await;
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        }
        for t in tasks {
            t.await.expect("join").expect("admitted");
        }
        assert_eq!(
            *log.lock().expect("log"),
            vec!["high", "a1", "b1", "a2", "b2", "a3", "low"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_by_count_and_bytes() {
        let config = FlowControlConfig {
            max_requests: 2,
            max_bytes: 25,
            ..FlowControlConfig::default()
        };
        let (fc, _open) = switched(config, usize::MAX);
        let log = Arc::new(Mutex::new(Vec::new()));
        let _a = spawn_admit(&fc, request(0, ""), &log, "a");
        settle(&fc, 1).await;
        let mut big = request(0, "");
        big.bytes = 20;
        assert_eq!(
            fc.admit(big).await.err(),
            Some(FlowError::QueueFull),
            "bytes"
        );
        // 10 body bytes + a 6-byte fairness id do not fit in the 15 bytes left either.
        let mut long_id = request(0, "tenant");
        long_id.bytes = 10;
        assert_eq!(fc.admit(long_id).await.err(), Some(FlowError::QueueFull));
        assert_eq!(fc.queued_bytes(), 10);
        let _b = spawn_admit(&fc, request(0, ""), &log, "b");
        settle(&fc, 2).await;
        assert_eq!(
            fc.admit(request(9, "")).await.err(),
            Some(FlowError::QueueFull),
            "count"
        );
        assert_eq!(FlowError::QueueFull.http_status(), 429);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_goes_away_leaves_the_queue() {
        let (fc, open) = switched(FlowControlConfig::default(), usize::MAX);
        let log = Arc::new(Mutex::new(Vec::new()));
        let gone = spawn_admit(&fc, request(0, "a"), &log, "gone");
        let stays = spawn_admit(&fc, request(0, "a"), &log, "stays");
        settle(&fc, 2).await;
        gone.abort();
        assert!(gone.await.expect_err("aborted").is_cancelled());
        assert_eq!(fc.queued(), 1);
        open.store(true, Ordering::SeqCst);
        assert_eq!(fc.dispatch(), 1);
        stays.await.expect("join").expect("admitted");
        assert_eq!(*log.lock().expect("log"), vec!["stays"]);
    }

    #[tokio::test(start_paused = true)]
    async fn zero_endpoints_queue_until_one_appears() {
        let endpoints = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&endpoints);
        let fc = FlowController::new(FlowControlConfig::default(), move |_| {
            seen.load(Ordering::SeqCst) > 0
        });
        let cancel = CancellationToken::new();
        let dispatcher = tokio::spawn(
            fc.clone()
                .run_dispatcher(Duration::from_millis(10), cancel.clone()),
        );
        let log = Arc::new(Mutex::new(Vec::new()));
        let waiting = spawn_admit(&fc, request(0, ""), &log, "r");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(fc.queued(), 1, "no endpoint, still queued");
        endpoints.store(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiting
            .await
            .expect("join")
            .expect("admitted once an endpoint appeared");
        cancel.cancel();
        dispatcher.await.expect("dispatcher stops");
    }
}
