//! The precise prefix index: which pods hold which blocks, fed by KV events.
//!
//! Two structures, kept consistent by one writer per pod:
//! - the global block map `BlockKey → holders (pod slot, tier, refs)`, read by matching;
//! - per pod, `engine hash → BlockKey`, used to key `BlockRemoved` events (which carry only
//!   engine hashes) and to chain `BlockStored` events that start at a parent. References are
//!   counted on the holders of the block map, per (pod, tier): vLLM can store the same hash
//!   twice and remove it twice (DESIGN §3), so a block leaves the index at its last removal.
//!
//! # Concurrency rules
//! - Matching never blocks on a whole pod: it takes one shard read lock of the block map per
//!   block, so it sees each holder change atomically but may see a batch half applied (a
//!   batch is a few blocks; the next lookup sees the rest).
//! - All writes for a pod (apply, clear, purge) take that pod's mutex first, then touch block
//!   map shards one at a time (never two at once). Lock order: pod table → pod mutex → shard.
//!   No lock is held across an `.await`.
//! - The mutex makes concurrent writers for one pod safe, not ordered: the caller (the pod's
//!   subscriber) must feed batches in sequence order from one task.
//! - A purged pod is marked retired under its mutex before its slot is freed, so a writer
//!   that raced the purge cannot re-insert holders under a slot that may be reused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use tokio::time::Instant;

use super::approx::LruBlocks;
use super::blockmap::{BlockMap, MAX_SLOTS};
use super::homes::PrefixHomes;
use super::key::{BlockKey, PrehashedState};
use super::metrics::IndexMetrics;
use super::span::{SpanBook, SpanIntact, SpanRef};
use super::speculative::Speculative;
use crate::endpoints::PodId;
use kvpick_kvevents_wire::{EngineHash, Tier};

/// Weight of a matched block per tier (index = [`Tier::index`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWeights(pub [f64; 3]);

impl Default for TierWeights {
    /// gpu 1.0, cpu 0.8 (DESIGN §5), anything slower 0.5.
    fn default() -> Self {
        TierWeights([1.0, 0.8, 0.5])
    }
}

impl TierWeights {
    /// The weight of one tier.
    pub fn of(&self, tier: Tier) -> f64 {
        self.0.get(tier.index()).copied().unwrap_or(0.0)
    }
}

/// Limits and defaults of the index.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// Hard cap of (block, tier) entries per pod, whatever the pod reports.
    pub max_blocks_per_pod: usize,
    /// Headroom over a learned capacity (`num_gpu_blocks`): limit = capacity × this + 64
    /// (offload tiers and re-announcements need some room), never above the hard cap.
    pub capacity_headroom: f64,
    /// Tier weights for matching.
    pub tier_weights: TierWeights,
    /// Block size assumed for a pod whose events have not told it yet.
    pub default_block_size: u32,
    /// How long a routed request's blocks count as speculatively held by its pod.
    pub speculative_ttl: std::time::Duration,
    /// Bound on speculative (block, pod) entries in total.
    pub max_speculative_entries: usize,
    /// Bound on the block keys remembered as prefix homes (about 7 per routed request; ~22 MB
    /// at the default 2^18; 0 keeps none).
    pub max_prefix_home_keys: usize,
    /// Blocks remembered per pod in approximate mode (pods without events), until a learned
    /// capacity replaces it.
    pub approx_capacity_blocks: usize,
    /// Whether walks may jump over runs they can prove held (spans, speculative runs). Off,
    /// they step block by block: the same answers, slower (kept to compare the two).
    pub gallop: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_blocks_per_pod: 4 << 20,
            capacity_headroom: 2.0,
            tier_weights: TierWeights::default(),
            default_block_size: 16,
            speculative_ttl: std::time::Duration::from_secs(2),
            max_speculative_entries: 1 << 20,
            max_prefix_home_keys: 1 << 18,
            approx_capacity_blocks: 16_384,
            gallop: true,
        }
    }
}

/// What applying one batch did (also accumulated per pod).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ApplyStats {
    /// Blocks newly held (a tier went from 0 to 1 reference).
    pub blocks_added: u64,
    /// Blocks no longer held (last reference removed).
    pub blocks_removed: u64,
    /// Stores of a hash already held, counted as another reference.
    pub duplicate_stores: u64,
    /// Stores re-announcing blocks already held (a chain from block 0 whose blocks are all
    /// held: `kv_cache_report_mode: "full"`), not counted again.
    pub reannounced: u64,
    /// Removals of hashes not held (events lost before we subscribed, or already cleared).
    pub unknown_removals: u64,
    /// Blocks whose parent is unknown (so their key cannot be computed); skipped.
    pub orphan_blocks: u64,
    /// Events that contradict themselves (token count ≠ blocks × block size); skipped.
    pub inconsistent_events: u64,
    /// Blocks refused because the pod reached its block limit.
    pub capacity_drops: u64,
    /// `AllBlocksCleared` events applied.
    pub cleared: u64,
}

impl ApplyStats {
    pub(super) fn add(&mut self, other: &ApplyStats) {
        self.blocks_added += other.blocks_added;
        self.blocks_removed += other.blocks_removed;
        self.duplicate_stores += other.duplicate_stores;
        self.reannounced += other.reannounced;
        self.unknown_removals += other.unknown_removals;
        self.orphan_blocks += other.orphan_blocks;
        self.inconsistent_events += other.inconsistent_events;
        self.capacity_drops += other.capacity_drops;
        self.cleared += other.cleared;
    }
}

/// Per pod state guarded by the pod's mutex.
#[derive(Default)]
pub(super) struct PodBlocks {
    /// Engine hash → kvpick's key. References live in the block map's holders: a store of a
    /// hash adds one to (key, pod, tier), a removal drops one, and the hash leaves this map
    /// when the pod holds its key in no tier.
    pub(super) by_hash: HashMap<EngineHash, BlockKey, PrehashedState>,
    /// (block, tier) entries held: the quantity bounded by `limit`.
    pub(super) entries: usize,
    pub(super) limit: usize,
    pub(super) retired: bool,
    pub(super) stats: ApplyStats,
    /// Set by the first event batch: from then on routing records are speculative only.
    pub(super) precise: bool,
    /// Set when its KV-event subscriber is registered ([`PrefixIndex::ensure_pod`]): its
    /// events are expected, so routing records before the first one are written as
    /// speculative entries too, which outlive the switch to precise (the approximate
    /// entries are dropped then).
    pub(super) events_expected: bool,
    /// Approximate mode (no events yet): blocks learned from routing.
    pub(super) approx: LruBlocks,
    pub(super) approx_capacity: usize,
    /// The writer's side of the pod's spans (see [`super::span`]).
    pub(super) spans: SpanBook,
}

/// One pod known to the index.
pub(crate) struct PodEntry {
    pub(super) slot: u32,
    state: Mutex<PodBlocks>,
    /// Mirrors `PodBlocks::entries` for lock-free status reads.
    pub(super) entries: AtomicU64,
    /// Block size learned from events (0 = unknown).
    pub(super) block_size: AtomicU32,
    /// Intact lengths of the pod's spans, read by walks without a lock.
    pub(super) spans: SpanIntact,
}

impl PodEntry {
    pub(super) fn lock(&self) -> MutexGuard<'_, PodBlocks> {
        // NOTE: a panic while holding the lock cannot leave the maps unsafe to read, only
        // incomplete; keep serving rather than propagate the poison.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
pub(super) struct PodTable {
    pub(super) by_id: HashMap<PodId, Arc<PodEntry>>,
    pub(super) slots: Vec<Option<PodId>>,
    free: Vec<u32>,
}

/// Receives each routing record kvpick makes (the replica exchange, `exchange`): the pod,
/// the block size its keys were computed at, and the prompt's keys from the first block on.
/// Called on the request's task, so it must not block.
pub type RouteSink = Box<dyn Fn(PodId, u32, &[BlockKey]) + Send + Sync>;

/// The precise prefix index (see the module docs for its concurrency rules).
pub struct PrefixIndex {
    config: IndexConfig,
    pub(super) blocks: BlockMap,
    pods: RwLock<PodTable>,
    pub(super) speculative: Speculative,
    /// Where kvpick last routed each prefix (`homes`).
    pub(super) homes: PrefixHomes,
    pub(super) metrics: Option<IndexMetrics>,
    /// The block size last learned from any pod's events (0: none yet).
    pub(super) learned_block_size: AtomicU32,
    /// Pods purged recently, and when: a routing record applied after its pod left the pool
    /// (records trail the reply) must not bring the pod back. Bounded (see `purge_pod`).
    purged: Mutex<HashMap<PodId, Instant>>,
    /// Where routing records also go (the replica exchange; `exchange`), when set.
    pub(super) route_sink: std::sync::OnceLock<RouteSink>,
}

/// How long a purged pod is not re-created by a late routing record (a pod that returns to
/// the pool with events is re-registered at once by its subscriber).
const PURGE_MEMORY: std::time::Duration = std::time::Duration::from_secs(60);
/// Purged pods remembered at most (beyond it, the oldest are forgotten first).
const PURGE_MEMORY_PODS: usize = 4096;

impl PrefixIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        Self {
            blocks: BlockMap::default(),
            pods: RwLock::new(PodTable::default()),
            speculative: Speculative::new(config.speculative_ttl, config.max_speculative_entries),
            homes: PrefixHomes::new(config.max_prefix_home_keys),
            config,
            metrics: None,
            learned_block_size: AtomicU32::new(0),
            purged: Mutex::new(HashMap::new()),
            route_sink: std::sync::OnceLock::new(),
        }
    }

    /// The block size requests are best keyed at ahead of a lookup: the one pods' events
    /// last reported (pools run one engine configuration), else the configured default.
    pub fn typical_block_size(&self) -> u32 {
        match self.learned_block_size.load(Ordering::Relaxed) {
            0 => self.config.default_block_size.max(1),
            size => size,
        }
    }

    /// An empty index whose lookups are measured in `registry` (latency, hit ratio).
    pub fn with_registry(
        config: IndexConfig,
        registry: &prometheus::Registry,
    ) -> prometheus::Result<Self> {
        let mut index = Self::new(config);
        index.metrics = Some(IndexMetrics::new(registry)?);
        Ok(index)
    }

    /// The index's configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    pub(super) fn table_read(&self) -> std::sync::RwLockReadGuard<'_, PodTable> {
        self.pods.read().unwrap_or_else(|e| e.into_inner())
    }

    fn table_write(&self) -> std::sync::RwLockWriteGuard<'_, PodTable> {
        self.pods.write().unwrap_or_else(|e| e.into_inner())
    }

    fn pod(&self, pod: PodId) -> Option<Arc<PodEntry>> {
        self.table_read().by_id.get(&pod).cloned()
    }

    pub(super) fn pod_or_insert(&self, pod: PodId) -> Arc<PodEntry> {
        if let Some(entry) = self.pod(pod) {
            return entry;
        }
        let mut table = self.table_write();
        if let Some(entry) = table.by_id.get(&pod) {
            return entry.clone();
        }
        let slot = match table.free.pop() {
            Some(slot) => slot,
            None if table.slots.len() < MAX_SLOTS as usize => {
                table.slots.push(None);
                (table.slots.len() - 1) as u32
            }
            None => {
                // NOTE: a million pods in one index cannot happen in a real pool; rather than
                // alias a slot, such a pod gets a retired entry: it holds nothing, matches
                // nothing and its events are ignored.
                tracing::error!(%pod, "prefix index full ({MAX_SLOTS} pods); pod not indexed");
                return Arc::new(PodEntry {
                    slot: u32::MAX,
                    state: Mutex::new(PodBlocks {
                        retired: true,
                        ..PodBlocks::default()
                    }),
                    entries: AtomicU64::new(0),
                    block_size: AtomicU32::new(0),
                    spans: SpanIntact::default(),
                });
            }
        };
        if let Some(cell) = table.slots.get_mut(slot as usize) {
            *cell = Some(pod);
        }
        let entry = Arc::new(PodEntry {
            slot,
            state: Mutex::new(PodBlocks {
                limit: self.config.max_blocks_per_pod,
                approx_capacity: self.config.approx_capacity_blocks,
                ..PodBlocks::default()
            }),
            entries: AtomicU64::new(0),
            block_size: AtomicU32::new(0),
            spans: SpanIntact::default(),
        });
        table.by_id.insert(pod, entry.clone());
        entry
    }

    /// Registers a pod whose KV events are subscribed to (idempotent); matching treats
    /// unknown pods as holding nothing anyway.
    pub fn ensure_pod(&self, pod: PodId) {
        self.purged_pods().remove(&pod);
        self.pod_or_insert(pod).lock().events_expected = true;
    }

    fn purged_pods(&self) -> MutexGuard<'_, HashMap<PodId, Instant>> {
        // NOTE: a plain map; a panic mid-update loses at most a remembered purge.
        self.purged.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `pod` was purged within [`PURGE_MEMORY`].
    pub(super) fn recently_purged(&self, pod: PodId) -> bool {
        self.purged_pods()
            .get(&pod)
            .is_some_and(|at| at.elapsed() < PURGE_MEMORY)
    }

    /// Bounds a pod by its learned capacity (`num_gpu_blocks` from `cache_config_info`).
    pub fn set_pod_capacity(&self, pod: PodId, num_blocks: usize) {
        let entry = self.pod_or_insert(pod);
        let limit = (num_blocks as f64 * self.config.capacity_headroom) as usize + 64;
        let mut state = entry.lock();
        state.limit = limit.min(self.config.max_blocks_per_pod);
        state.approx_capacity = num_blocks.min(self.config.max_blocks_per_pod);
    }

    /// Sets a pod's block size (when known from configuration or metrics before any event).
    pub fn set_pod_block_size(&self, pod: PodId, block_size: u32) {
        if block_size > 0 {
            self.pod_or_insert(pod)
                .block_size
                .store(block_size, Ordering::Relaxed);
        }
    }

    /// Adds a reference of (slot, tier) to `key` (a new holder takes `span`); returns the
    /// references after it and the holder's span.
    pub(super) fn add_holder(
        &self,
        key: BlockKey,
        slot: u32,
        tier: Tier,
        span: SpanRef,
    ) -> (u16, SpanRef) {
        let added = self.blocks.add(key, slot, tier, span);
        self.speculative.confirm(&key, slot);
        added
    }

    /// Drops one reference of the pod's holder of `key` in `tier`, leaving its span when the
    /// holder goes; the references left (`None`: the pod was no holder).
    pub(super) fn remove_holder(
        &self,
        entry: &PodEntry,
        spans: &mut SpanBook,
        key: BlockKey,
        tier: Tier,
    ) -> Option<u16> {
        self.blocks
            .remove(key, entry.slot, tier, |span| spans.left(span, &entry.spans))
    }

    pub(super) fn drop_approx(&self, entry: &PodEntry, state: &mut PodBlocks) {
        for key in state.approx.drain() {
            if self.remove_holder(entry, &mut state.spans, key, Tier::Gpu) == Some(0) {
                state.entries = state.entries.saturating_sub(1);
            }
        }
    }

    /// Speculative entries currently stored (expired ones included until purged).
    pub fn speculative_entries(&self) -> usize {
        self.speculative.len()
    }

    /// Drops expired speculative entries (matching ignores them anyway; this frees memory).
    pub fn purge_expired_speculation(&self) {
        self.speculative.purge_expired(Instant::now());
    }

    /// Drops the pod's entries in one tier (or all), keeping the pod registered.
    pub(super) fn clear_locked(&self, entry: &PodEntry, state: &mut PodBlocks, tier: Option<Tier>) {
        let mut removed = 0usize;
        let PodBlocks { by_hash, spans, .. } = state;
        by_hash.retain(|_, key| {
            for t in Tier::ALL {
                if tier.is_none_or(|only| only == t)
                    && self
                        .blocks
                        .remove_all(*key, entry.slot, t, |span| spans.left(span, &entry.spans))
                {
                    removed += 1;
                }
            }
            tier.is_some() && self.blocks.holds(*key, entry.slot)
        });
        state.entries = state.entries.saturating_sub(removed);
        if tier.is_none() {
            state.by_hash = HashMap::default();
            self.drop_approx(entry, state);
            state.spans.clear(&entry.spans);
            state.entries = 0;
        }
        entry.entries.store(state.entries as u64, Ordering::Relaxed);
    }

    /// Drops everything known about a pod's cache (engine restart, unrecoverable gap); the pod
    /// stays registered and rebuilds from new events.
    pub fn clear_pod(&self, pod: PodId) {
        if let Some(entry) = self.pod(pod) {
            let mut state = entry.lock();
            self.clear_locked(&entry, &mut state, None);
        }
    }

    /// Removes a pod entirely (it left the pool): its entries, counters and slot.
    pub fn purge_pod(&self, pod: PodId) {
        let Some(entry) = self.table_write().by_id.remove(&pod) else {
            return;
        };
        {
            let mut state = entry.lock();
            state.retired = true;
            self.clear_locked(&entry, &mut state, None);
        }
        self.speculative.remove_slot(entry.slot);
        {
            let mut purged = self.purged_pods();
            if purged.len() >= PURGE_MEMORY_PODS {
                purged.retain(|_, at| at.elapsed() < PURGE_MEMORY);
            }
            if purged.len() >= PURGE_MEMORY_PODS
                && let Some(oldest) = purged.iter().min_by_key(|(_, at)| **at).map(|(p, _)| *p)
            {
                purged.remove(&oldest);
            }
            purged.insert(pod, Instant::now());
        }
        let mut table = self.table_write();
        if let Some(cell) = table.slots.get_mut(entry.slot as usize) {
            *cell = None;
        }
        table.free.push(entry.slot);
    }

    /// Pods the index knows.
    pub fn pods(&self) -> Vec<PodId> {
        let mut pods: Vec<PodId> = self.table_read().by_id.keys().copied().collect();
        pods.sort();
        pods
    }

    /// (block, tier) entries a pod holds.
    pub fn pod_entries(&self, pod: PodId) -> usize {
        self.pod(pod)
            .map_or(0, |e| e.entries.load(Ordering::Relaxed) as usize)
    }

    /// The block size learned for a pod, when any.
    pub fn pod_block_size(&self, pod: PodId) -> Option<u32> {
        self.pod(pod)
            .map(|e| e.block_size.load(Ordering::Relaxed))
            .filter(|b| *b > 0)
    }

    /// Counters accumulated over every batch applied for a pod.
    pub fn pod_stats(&self, pod: PodId) -> Option<ApplyStats> {
        self.pod(pod).map(|e| e.lock().stats)
    }

    /// The engine hashes a pod holds, per tier (for tests and debugging; copies the map).
    pub fn pod_engine_hashes(&self, pod: PodId) -> Vec<(EngineHash, Tier)> {
        let Some(entry) = self.pod(pod) else {
            return Vec::new();
        };
        let state = entry.lock();
        let mut out: Vec<(EngineHash, Tier)> = state
            .by_hash
            .iter()
            .flat_map(|(hash, key)| {
                Tier::ALL
                    .into_iter()
                    .filter(|t| self.blocks.tier_refs(*key, entry.slot, *t) > 0)
                    .map(|t| (*hash, t))
            })
            .collect();
        out.sort();
        out
    }

    /// Distinct block keys in the index.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Whether `pod` holds `key` in any tier.
    pub fn holds(&self, pod: PodId, key: BlockKey) -> bool {
        let Some(entry) = self.pod(pod) else {
            return false;
        };
        self.blocks.holds(key, entry.slot)
    }

    /// An estimate of the bytes the index uses (tables at their capacity, plus boxed holder
    /// lists), for the memory-per-entry figure.
    pub fn memory_bytes(&self) -> usize {
        let mut bytes = self.blocks.memory_bytes();
        let hash_entry = std::mem::size_of::<(EngineHash, BlockKey)>() + 1;
        for entry in self.table_read().by_id.values() {
            let state = entry.lock();
            bytes += state.by_hash.capacity() * hash_entry
                + state.spans.memory_bytes()
                + entry.spans.memory_bytes();
        }
        bytes
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;
