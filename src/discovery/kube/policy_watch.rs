//! The policy task: watches InferenceObjectives and InferenceModelRewrites of both API groups
//! in the pool's namespace and swaps the merged objectives and rewrite rules into the
//! request path ([`Live`] values the ext-proc streams read per request).
//!
//! Concurrency rules: one task owns the four watch streams and every object it has seen;
//! its only outputs are the two [`Live`] values and the `synced` watch channel. It runs
//! under the supervisor like discovery (a restart re-lists everything).
//!
//! A CRD that is not installed answers the list with 404 (and an RBAC role without it with
//! 403): that resource then counts as empty and synced, is logged once, and is looked for
//! again every `retry` (a cluster often has only one of the two groups installed). Other
//! failures are retried by kube's watcher with discovery's backoff, and the task publishes
//! since when a watch has been failing ([`PolicyHealth`]), so readiness goes off once the
//! objectives and rewrites may be stale, as it does for the pool. While a watch fails, a
//! cheap list (limit 1) probes its resource every tick: the watcher yields nothing when it
//! re-establishes a watch, so only the probe can tell that the resource answers again.

use std::collections::{BTreeMap, HashMap};
use std::future::poll_fn;
use std::task::Poll;
use std::time::Duration;

use futures::StreamExt;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch as channel;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::metrics::DiscoveryMetrics;
use super::policy::{
    ApiRewrite, Invalid, PolicyGroup, PolicyKind, PoolRef, merge_objectives, merge_rewrites,
    parse_objective, parse_rewrite,
};
use super::watch::{WatchStream, answers, next_of, tick_interval, watch};
use crate::live::Live;
use crate::request::ModelRewriteRules;

/// Most objects of one kind kept (both groups together); more are left out, logged and
/// counted, so a namespace full of objects cannot grow kvpick's memory without bound.
pub const MAX_OBJECTS: usize = 1000;

/// Everything the policy task needs.
pub struct PolicyParts {
    /// The pool's namespace (objects must be in it).
    pub namespace: String,
    /// Our pool, as `spec.poolRef` must name it.
    pub pool: PoolRef,
    /// The API client.
    pub client: Client,
    /// Discovery's metrics.
    pub metrics: DiscoveryMetrics,
    /// `--objective` values (API objects of the same name override them).
    pub flag_objectives: HashMap<String, i32>,
    /// `--model-rewrites` rules (merged after the API's; see [`merge_rewrites`]).
    pub file_rewrites: ModelRewriteRules,
    /// Where merged objectives go.
    pub objectives: Live<HashMap<String, i32>>,
    /// Where merged rewrite rules go.
    pub rewrites: Live<ModelRewriteRules>,
    /// Whether every resource has been listed (or found not installed), and since when a
    /// watch has been failing.
    pub health: channel::Sender<PolicyHealth>,
    /// How long to wait before looking for a CRD that was not installed again.
    pub retry: Duration,
    /// `--discovery-stale-after` (sets how often a failing resource is probed).
    pub stale_after: Duration,
}

/// What the policy task tells readiness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyHealth {
    /// Every resource has been listed once (or found not installed).
    pub synced: bool,
    /// Since when the longest-failing watch has been failing (`None`: none is).
    pub failing_since: Option<Instant>,
}

/// One watched resource (a kind in one group).
struct Resource {
    kind: PolicyKind,
    group: PolicyGroup,
    api: Api<DynamicObject>,
    stream: Option<WatchStream<DynamicObject>>,
    retry_at: Option<Instant>,
    /// Objects of a list in progress (between Init and InitDone).
    listing: Option<Vec<DynamicObject>>,
    synced: bool,
    /// Not installed (404/403), already logged.
    missing: bool,
    /// Since when its watch has been failing (a 404/403 is not failing).
    failing_since: Option<Instant>,
}

impl Resource {
    fn label(&self) -> &'static str {
        match self.kind {
            PolicyKind::Objective => "inferenceobjective",
            PolicyKind::Rewrite => "inferencemodelrewrite",
        }
    }

    fn start(&mut self) {
        self.stream = Some(watch(self.api.clone(), watcher::Config::default()));
        self.retry_at = None;
    }
}

/// The objects seen, valid and naming our pool, by group and name.
#[derive(Default)]
struct Store {
    objectives: BTreeMap<(PolicyGroup, String), i32>,
    rewrites: BTreeMap<(PolicyGroup, String), ApiRewrite>,
    /// The resourceVersion last logged as invalid, per object: each bad version is logged
    /// once, not on every re-list.
    logged: HashMap<(PolicyKind, PolicyGroup, String), String>,
}

/// What a valid object turned into.
enum Parsed {
    Objective(i32),
    Rewrite(ApiRewrite),
}

fn parse(
    kind: PolicyKind,
    object: &DynamicObject,
    pool: &PoolRef,
) -> Result<Option<Parsed>, Invalid> {
    Ok(match kind {
        PolicyKind::Objective => parse_objective(object, pool)?.map(Parsed::Objective),
        PolicyKind::Rewrite => parse_rewrite(object, pool)?.map(Parsed::Rewrite),
    })
}

impl Store {
    fn len(&self, kind: PolicyKind) -> usize {
        match kind {
            PolicyKind::Objective => self.objectives.len(),
            PolicyKind::Rewrite => self.rewrites.len(),
        }
    }

    fn contains(&self, kind: PolicyKind, key: &(PolicyGroup, String)) -> bool {
        match kind {
            PolicyKind::Objective => self.objectives.contains_key(key),
            PolicyKind::Rewrite => self.rewrites.contains_key(key),
        }
    }

    fn remove(&mut self, kind: PolicyKind, key: &(PolicyGroup, String)) -> bool {
        match kind {
            PolicyKind::Objective => self.objectives.remove(key).is_some(),
            PolicyKind::Rewrite => self.rewrites.remove(key).is_some(),
        }
    }

    /// Applies one object; true when the store changed. An invalid object is logged and
    /// counted, and its last valid version (if any) stays.
    fn apply(&mut self, parts: &PolicyParts, resource: &Resource, object: &DynamicObject) -> bool {
        let (kind, group) = (resource.kind, resource.group);
        let name = object.metadata.name.clone().unwrap_or_default();
        let key = (group, name.clone());
        match parse(kind, object, &parts.pool) {
            Ok(None) => self.remove(kind, &key),
            Ok(Some(parsed)) => {
                self.logged.remove(&(kind, group, name.clone()));
                if self.len(kind) >= MAX_OBJECTS && !self.contains(kind, &key) {
                    tracing::warn!(kind = kind.kind(), group = group.group(), object = %format!("{}/{name}", parts.namespace), limit = MAX_OBJECTS, "too many objects; leaving this one out");
                    parts
                        .metrics
                        .invalid
                        .with_label_values(&[kind.kind(), "count"])
                        .inc();
                    return false;
                }
                match parsed {
                    Parsed::Objective(priority) => {
                        self.objectives.insert(key, priority) != Some(priority)
                    }
                    Parsed::Rewrite(rewrite) => {
                        let changed = self.rewrites.get(&key) != Some(&rewrite);
                        self.rewrites.insert(key, rewrite);
                        changed
                    }
                }
            }
            Err(invalid) => {
                let version = object.metadata.resource_version.clone().unwrap_or_default();
                let logged = self
                    .logged
                    .insert((kind, group, name.clone()), version.clone());
                if logged.as_ref() != Some(&version) {
                    let kept = self.contains(kind, &key);
                    tracing::warn!(kind = kind.kind(), group = group.group(), object = %format!("{}/{name}", parts.namespace), field = invalid.field, reason = %invalid.reason, kept_last_valid = kept, "invalid object ignored");
                    parts
                        .metrics
                        .invalid
                        .with_label_values(&[kind.kind(), invalid.field])
                        .inc();
                }
                // Bounded: entries of objects that are gone are dropped on delete and here.
                if self.logged.len() > 2 * MAX_OBJECTS {
                    self.logged.clear();
                }
                false
            }
        }
    }

    /// Deletes one object; true when it was held.
    fn delete(&mut self, resource: &Resource, object: &DynamicObject) -> bool {
        let name = object.metadata.name.clone().unwrap_or_default();
        self.logged
            .remove(&(resource.kind, resource.group, name.clone()));
        self.remove(resource.kind, &(resource.group, name))
    }

    /// Replaces every object of `resource` with a fresh list; an invalid object keeps its
    /// last valid version. True when the store changed.
    fn replace(
        &mut self,
        parts: &PolicyParts,
        resource: &Resource,
        listed: &[DynamicObject],
    ) -> bool {
        let (kind, group) = (resource.kind, resource.group);
        let names: std::collections::HashSet<&str> = listed
            .iter()
            .filter_map(|o| o.metadata.name.as_deref())
            .collect();
        let mut changed = false;
        let gone: Vec<(PolicyGroup, String)> = match kind {
            PolicyKind::Objective => self.objectives.keys().cloned().collect(),
            PolicyKind::Rewrite => self.rewrites.keys().cloned().collect(),
        };
        for key in gone {
            if key.0 == group && !names.contains(key.1.as_str()) {
                changed |= self.remove(kind, &key);
            }
        }
        for object in listed {
            changed |= self.apply(parts, resource, object);
        }
        changed
    }

    /// Forgets every object of `resource` (its CRD is not installed).
    fn clear(&mut self, resource: &Resource) -> bool {
        self.replace_none(resource.kind, resource.group)
    }

    fn replace_none(&mut self, kind: PolicyKind, group: PolicyGroup) -> bool {
        let before = self.len(kind);
        match kind {
            PolicyKind::Objective => self.objectives.retain(|(g, _), _| *g != group),
            PolicyKind::Rewrite => self.rewrites.retain(|(g, _), _| *g != group),
        }
        before != self.len(kind)
    }
}

fn resource(client: &Client, namespace: &str, kind: PolicyKind, group: PolicyGroup) -> Resource {
    let gvk = GroupVersionKind::gvk(group.group(), group.version(), kind.kind());
    let api = Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::from_gvk_with_plural(&gvk, kind.plural()),
    );
    Resource {
        kind,
        group,
        api,
        stream: None,
        retry_at: None,
        listing: None,
        synced: false,
        missing: false,
        failing_since: None,
    }
}

/// The next event of any running stream, with its index (round-robin start, so one busy
/// stream cannot starve the others).
async fn next_event(
    resources: &mut [Resource],
    start: usize,
) -> (usize, Option<Result<Event<DynamicObject>, watcher::Error>>) {
    let count = resources.len();
    poll_fn(|cx| {
        for offset in 0..count {
            let i = (start + offset) % count;
            if let Some(stream) = resources.get_mut(i).and_then(|r| r.stream.as_mut())
                && let Poll::Ready(item) = stream.poll_next_unpin(cx)
            {
                return Poll::Ready((i, item));
            }
        }
        Poll::Pending
    })
    .await
}

/// Whether a failed list means "this resource is not served to us" (CRD not installed, or
/// the role does not grant it), rather than a failing API.
fn not_served(error: &watcher::Error) -> Option<u16> {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
            if status.code == 404 || status.code == 403 =>
        {
            Some(status.code)
        }
        _ => None,
    }
}

/// Runs the policy watches until `cancel`.
pub async fn run_policy(parts: std::sync::Arc<PolicyParts>, cancel: CancellationToken) {
    let mut resources: Vec<Resource> = [PolicyKind::Objective, PolicyKind::Rewrite]
        .into_iter()
        .flat_map(|kind| PolicyGroup::ALL.map(|group| (kind, group)))
        .map(|(kind, group)| resource(&parts.client, &parts.namespace, kind, group))
        .collect();
    for resource in &mut resources {
        resource.start();
    }
    let mut store = Store::default();
    let mut turn = 0;
    let mut probe: Option<futures::stream::BoxStream<'static, Vec<(usize, bool)>>> = None;
    let mut tick = tokio::time::interval(tick_interval(parts.stale_after));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let retry_at = resources.iter().filter_map(|r| r.retry_at).min();
        let retry = async {
            match retry_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let changed = tokio::select! {
            () = cancel.cancelled() => return,
            () = retry => {
                let now = Instant::now();
                for resource in resources.iter_mut().filter(|r| r.retry_at.is_some_and(|at| at <= now)) {
                    resource.start();
                }
                false
            }
            answered = next_of(&mut probe) => {
                probe = None;
                for (i, answered) in answered.unwrap_or_default() {
                    if let Some(resource) = resources.get_mut(i).filter(|r| answered && r.failing_since.is_some()) {
                        tracing::info!(kind = resource.kind.kind(), group = resource.group.group(), "watch answers again");
                        resource.failing_since = None;
                    }
                }
                false
            }
            _ = tick.tick() => {
                if probe.is_none() {
                    probe = probe_failing(&resources);
                }
                false
            }
            (i, event) = next_event(&mut resources, turn) => {
                turn = turn.wrapping_add(1);
                let Some(resource) = resources.get_mut(i) else { continue };
                match event {
                    Some(event) => on_event(&parts, &mut store, resource, event),
                    None => {
                        // The watcher never ends by itself; start a fresh one if it does.
                        resource.start();
                        false
                    }
                }
            }
        };
        if changed {
            publish(&parts, &store);
        }
        let health = PolicyHealth {
            synced: resources.iter().all(|r| r.synced),
            failing_since: resources.iter().filter_map(|r| r.failing_since).min(),
        };
        if health.synced && !parts.health.borrow().synced {
            publish(&parts, &store);
            tracing::info!("objectives and model rewrites synced from Kubernetes");
        }
        parts.health.send_if_modified(|before| {
            let changed = *before != health;
            *before = health;
            changed
        });
    }
}

/// One list (limit 1) of every failing resource, answering which answered; `None` when none
/// is failing.
fn probe_failing(
    resources: &[Resource],
) -> Option<futures::stream::BoxStream<'static, Vec<(usize, bool)>>> {
    let lists: Vec<_> = resources
        .iter()
        .enumerate()
        .filter(|(_, r)| r.failing_since.is_some())
        .map(|(i, r)| {
            let api = r.api.clone();
            async move { (i, answers(&api, &kube::api::ListParams::default()).await) }
        })
        .collect();
    (!lists.is_empty()).then(|| futures::stream::once(futures::future::join_all(lists)).boxed())
}

fn on_event(
    parts: &PolicyParts,
    store: &mut Store,
    resource: &mut Resource,
    event: Result<Event<DynamicObject>, watcher::Error>,
) -> bool {
    let metrics = &parts.metrics;
    let event = match event {
        Ok(event) => event,
        Err(error) => {
            if let Some(code) = not_served(&error) {
                if !resource.missing {
                    let why = if code == 404 {
                        "its CRD is not installed"
                    } else {
                        "kvpick's role may not list it (RBAC)"
                    };
                    tracing::info!(kind = resource.kind.kind(), group = resource.group.group(), code, retry = ?parts.retry, "{}: {why}; none used, looking again periodically", resource.kind.kind());
                    resource.missing = true;
                }
                metrics
                    .crd_missing
                    .with_label_values(&[resource.label(), resource.group.group()])
                    .set(1);
                resource.stream = None;
                resource.listing = None;
                resource.retry_at = Some(Instant::now() + parts.retry);
                resource.synced = true;
                resource.failing_since = None;
                return store.clear(resource);
            }
            if resource.failing_since.is_none() {
                tracing::warn!(%error, kind = resource.kind.kind(), group = resource.group.group(), "watch failed; retrying (further failures at debug until it answers)");
                resource.failing_since = Some(Instant::now());
            } else {
                tracing::debug!(%error, kind = resource.kind.kind(), "watch failed again");
            }
            metrics
                .watch_errors
                .with_label_values(&[resource.label()])
                .inc();
            return false;
        }
    };
    if !matches!(event, Event::Init) {
        // NOTE: Init is not an answer from the API: the watcher yields it before it lists.
        resource.failing_since = None;
    }
    match event {
        Event::Init => {
            metrics.relists.with_label_values(&[resource.label()]).inc();
            resource.listing = Some(Vec::new());
            false
        }
        Event::InitApply(object) => {
            if let Some(listing) = resource.listing.as_mut()
                && listing.len() < MAX_OBJECTS
            {
                listing.push(object);
            }
            false
        }
        Event::InitDone => {
            if resource.missing {
                tracing::info!(
                    kind = resource.kind.kind(),
                    group = resource.group.group(),
                    "now served; using its objects"
                );
                resource.missing = false;
                metrics
                    .crd_missing
                    .with_label_values(&[resource.label(), resource.group.group()])
                    .set(0);
            }
            let listed = resource.listing.take().unwrap_or_default();
            resource.synced = true;
            store.replace(parts, resource, &listed)
        }
        Event::Apply(object) => store.apply(parts, resource, &object),
        Event::Delete(object) => store.delete(resource, &object),
    }
}

fn publish(parts: &PolicyParts, store: &Store) {
    let objectives = merge_objectives(&parts.flag_objectives, &store.objectives);
    let rewrites = merge_rewrites(&parts.file_rewrites, &store.rewrites);
    tracing::info!(
        objectives = store.objectives.len(),
        rewrites = store.rewrites.len(),
        rules = rewrites.rules.len(),
        "objectives and model rewrites from Kubernetes applied"
    );
    let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    parts
        .metrics
        .policy_objects
        .with_label_values(&[PolicyKind::Objective.kind()])
        .set(count(store.objectives.len()));
    parts
        .metrics
        .policy_objects
        .with_label_values(&[PolicyKind::Rewrite.kind()])
        .set(count(store.rewrites.len()));
    parts.objectives.store(objectives);
    parts.rewrites.store(rewrites);
}
