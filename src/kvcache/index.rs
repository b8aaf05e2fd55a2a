//! The precise prefix index: which pods hold which blocks, fed by KV events.
//!
//! Two structures, kept consistent by one writer per pod:
//! - the global block map `BlockKey → holders (pod slot, tier, refs)`, read by matching;
//! - per pod, `engine hash → (BlockKey, refs per tier)`, used to key `BlockRemoved` events
//!   (which carry only engine hashes), to chain `BlockStored` events that start at a parent,
//!   and to count references: vLLM can store the same hash twice and remove it twice (DESIGN
//!   §3), so a block leaves the index at its last removal.
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

use dashmap::DashMap;

use super::holders::Holders;
use super::key::{BlockKey, KeyContext, KeyHasherScratch, PrehashedState, block_keys};
use crate::endpoints::PodId;
use crate::kvevents::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Tier};

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
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_blocks_per_pod: 4 << 20,
            capacity_headroom: 2.0,
            tier_weights: TierWeights::default(),
            default_block_size: 16,
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
    fn add(&mut self, other: &ApplyStats) {
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

/// How much of a request's prefix one candidate pod holds.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PrefixMatch {
    /// The candidate (serialized as `ip:port`).
    #[serde(serialize_with = "serialize_pod")]
    pub pod: PodId,
    /// The block size the request was keyed at for this pod.
    pub block_size: u32,
    /// Full blocks in the request.
    pub total_blocks: usize,
    /// Leading blocks the pod holds in any tier.
    pub matched_blocks: usize,
    /// The same run, each block weighted by its best tier (gpu 1.0, cpu 0.8 by default).
    pub weighted_blocks: f64,
}

/// Serializes a [`PodId`] as its `ip:port` string.
pub fn serialize_pod<S: serde::Serializer>(pod: &PodId, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(pod)
}

impl PrefixMatch {
    /// Tokens covered by the matched blocks.
    pub fn matched_tokens(&self) -> usize {
        self.matched_blocks * self.block_size as usize
    }

    /// The prefix-cache score in [0, 1]: weighted matched blocks / total blocks.
    pub fn score(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            (self.weighted_blocks / self.total_blocks as f64).clamp(0.0, 1.0)
        }
    }
}

/// References of one engine hash on one pod.
#[derive(Clone, Copy, Debug)]
struct HashEntry {
    key: BlockKey,
    refs: [u16; 3],
}

/// Per pod state guarded by the pod's mutex.
#[derive(Default)]
struct PodBlocks {
    by_hash: HashMap<EngineHash, HashEntry, PrehashedState>,
    /// (block, tier) entries held: the quantity bounded by `limit`.
    entries: usize,
    limit: usize,
    retired: bool,
    stats: ApplyStats,
}

/// One pod known to the index.
pub(crate) struct PodEntry {
    id: PodId,
    slot: u32,
    state: Mutex<PodBlocks>,
    /// Mirrors `PodBlocks::entries` for lock-free status reads.
    entries: AtomicU64,
    /// Block size learned from events (0 = unknown).
    block_size: AtomicU32,
}

impl PodEntry {
    fn lock(&self) -> MutexGuard<'_, PodBlocks> {
        // NOTE: a panic while holding the lock cannot leave the maps unsafe to read, only
        // incomplete; keep serving rather than propagate the poison.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Default)]
struct PodTable {
    by_id: HashMap<PodId, Arc<PodEntry>>,
    slots: Vec<Option<PodId>>,
    free: Vec<u32>,
}

/// The precise prefix index (see the module docs for its concurrency rules).
pub struct PrefixIndex {
    config: IndexConfig,
    blocks: DashMap<BlockKey, Holders, PrehashedState>,
    pods: RwLock<PodTable>,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            blocks: DashMap::with_hasher(PrehashedState::default()),
            pods: RwLock::new(PodTable::default()),
        }
    }

    /// The index's configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    fn table_read(&self) -> std::sync::RwLockReadGuard<'_, PodTable> {
        self.pods.read().unwrap_or_else(|e| e.into_inner())
    }

    fn table_write(&self) -> std::sync::RwLockWriteGuard<'_, PodTable> {
        self.pods.write().unwrap_or_else(|e| e.into_inner())
    }

    fn pod(&self, pod: PodId) -> Option<Arc<PodEntry>> {
        self.table_read().by_id.get(&pod).cloned()
    }

    fn pod_or_insert(&self, pod: PodId) -> Arc<PodEntry> {
        if let Some(entry) = self.pod(pod) {
            return entry;
        }
        let mut table = self.table_write();
        if let Some(entry) = table.by_id.get(&pod) {
            return entry.clone();
        }
        let slot = match table.free.pop() {
            Some(slot) => slot,
            None => {
                table.slots.push(None);
                (table.slots.len() - 1) as u32
            }
        };
        if let Some(cell) = table.slots.get_mut(slot as usize) {
            *cell = Some(pod);
        }
        let entry = Arc::new(PodEntry {
            id: pod,
            slot,
            state: Mutex::new(PodBlocks {
                limit: self.config.max_blocks_per_pod,
                ..PodBlocks::default()
            }),
            entries: AtomicU64::new(0),
            block_size: AtomicU32::new(0),
        });
        table.by_id.insert(pod, entry.clone());
        entry
    }

    /// Registers a pod (idempotent); matching treats unknown pods as holding nothing anyway.
    pub fn ensure_pod(&self, pod: PodId) {
        self.pod_or_insert(pod);
    }

    /// Bounds a pod by its learned capacity (`num_gpu_blocks` from `cache_config_info`).
    pub fn set_pod_capacity(&self, pod: PodId, num_blocks: usize) {
        let entry = self.pod_or_insert(pod);
        let limit = (num_blocks as f64 * self.config.capacity_headroom) as usize + 64;
        entry.lock().limit = limit.min(self.config.max_blocks_per_pod);
    }

    /// Sets a pod's block size (when known from configuration or metrics before any event).
    pub fn set_pod_block_size(&self, pod: PodId, block_size: u32) {
        if block_size > 0 {
            self.pod_or_insert(pod)
                .block_size
                .store(block_size, Ordering::Relaxed);
        }
    }

    /// Applies one decoded batch from `pod`, whose topic names `model`. Batches of one pod must
    /// be applied in sequence order, from one task at a time.
    pub fn apply_batch(&self, pod: PodId, model: &str, batch: &EventBatch) -> ApplyStats {
        let entry = self.pod_or_insert(pod);
        let mut state = entry.lock();
        let mut stats = ApplyStats::default();
        if state.retired {
            return stats;
        }
        let mut scratch = KeyHasherScratch::default();
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => {
                    self.apply_stored(&entry, &mut state, model, stored, &mut scratch, &mut stats)
                }
                KvEvent::BlockRemoved(removed) => {
                    self.apply_removed(&entry, &mut state, removed, &mut stats)
                }
                KvEvent::AllBlocksCleared { tier } => {
                    self.clear_locked(&entry, &mut state, *tier);
                    stats.cleared += 1;
                }
                KvEvent::Unknown(_) => {}
            }
        }
        state.stats.add(&stats);
        entry.entries.store(state.entries as u64, Ordering::Relaxed);
        stats
    }

    fn apply_stored(
        &self,
        entry: &PodEntry,
        state: &mut PodBlocks,
        model: &str,
        stored: &BlockStored,
        scratch: &mut KeyHasherScratch,
        stats: &mut ApplyStats,
    ) {
        let blocks = stored.block_hashes.len();
        if blocks == 0 {
            return;
        }
        let tier = stored.tier;
        if stored.token_ids.is_empty() {
            // Offload tiers may omit tokens: the same hash is already keyed in another tier.
            for hash in &stored.block_hashes {
                match state.by_hash.get(hash).map(|e| e.key) {
                    Some(key) => {
                        self.insert(entry, state, *hash, key, tier, false, stats);
                    }
                    None => stats.orphan_blocks += 1,
                }
            }
            return;
        }
        let block_size = match stored.block_size {
            Some(size) if size as usize * blocks == stored.token_ids.len() => size as usize,
            None if stored.token_ids.len().is_multiple_of(blocks) => {
                stored.token_ids.len() / blocks
            }
            _ => {
                stats.inconsistent_events += 1;
                return;
            }
        };
        if block_size == 0 {
            stats.inconsistent_events += 1;
            return;
        }
        entry.block_size.store(block_size as u32, Ordering::Relaxed);
        let mut previous = match stored.parent_block_hash {
            None => KeyContext {
                model: model.to_string(),
                lora_name: stored.lora_name.clone(),
                cache_salt: stored.extra.first().and_then(|e| e.cache_salt.clone()),
            }
            .seed(),
            Some(parent) => match state.by_hash.get(&parent) {
                Some(parent) => parent.key.0,
                None => {
                    stats.orphan_blocks += blocks as u64;
                    return;
                }
            },
        };
        // NOTE: a chain from block 0 whose leading blocks are all held already is a
        // re-announcement (`kv_cache_report_mode: "full"`), not new physical blocks; counting it
        // would keep those blocks in the index after their single real eviction (a false
        // positive). The cost: two identical physical copies of block 0 stored concurrently are
        // counted once, so the index may forget them one removal early (a false negative).
        let mut reannounce = stored.parent_block_hash.is_none();
        for (i, (hash, tokens)) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(block_size))
            .enumerate()
        {
            let opaque = stored.extra.get(i).and_then(|e| e.opaque);
            let key = scratch.next_key(previous, tokens, opaque);
            previous = key.0;
            reannounce = self.insert(entry, state, *hash, key, tier, reannounce, stats);
        }
    }

    /// Adds one reference of `hash` in `tier`; returns whether the re-announcement run
    /// continues (the block was already held).
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &self,
        entry: &PodEntry,
        state: &mut PodBlocks,
        hash: EngineHash,
        key: BlockKey,
        tier: Tier,
        reannounce: bool,
        stats: &mut ApplyStats,
    ) -> bool {
        let t = tier.index();
        let limit = state.limit;
        let at_limit = state.entries >= limit;
        let held = state.by_hash.get(&hash).map(|e| (e.key, e.refs[t]));
        match held {
            Some((_, refs)) if refs > 0 => {
                if reannounce {
                    stats.reannounced += 1;
                    return true;
                }
                if let Some(e) = state.by_hash.get_mut(&hash)
                    && let Some(r) = e.refs.get_mut(t)
                {
                    *r = r.saturating_add(1);
                }
                stats.duplicate_stores += 1;
                false
            }
            Some((existing_key, _)) => {
                if at_limit {
                    stats.capacity_drops += 1;
                    return false;
                }
                if let Some(e) = state.by_hash.get_mut(&hash)
                    && let Some(r) = e.refs.get_mut(t)
                {
                    *r = 1;
                }
                self.add_holder(existing_key, entry.slot, tier);
                state.entries += 1;
                stats.blocks_added += 1;
                false
            }
            None => {
                if at_limit {
                    stats.capacity_drops += 1;
                    return false;
                }
                let mut refs = [0u16; 3];
                if let Some(r) = refs.get_mut(t) {
                    *r = 1;
                }
                state.by_hash.insert(hash, HashEntry { key, refs });
                self.add_holder(key, entry.slot, tier);
                state.entries += 1;
                stats.blocks_added += 1;
                false
            }
        }
    }

    fn apply_removed(
        &self,
        entry: &PodEntry,
        state: &mut PodBlocks,
        removed: &BlockRemoved,
        stats: &mut ApplyStats,
    ) {
        let t = removed.tier.index();
        for hash in &removed.block_hashes {
            let Some(e) = state.by_hash.get_mut(hash) else {
                stats.unknown_removals += 1;
                continue;
            };
            let Some(r) = e.refs.get_mut(t).filter(|r| **r > 0) else {
                stats.unknown_removals += 1;
                continue;
            };
            *r -= 1;
            if *r > 0 {
                continue;
            }
            let key = e.key;
            if e.refs.iter().all(|r| *r == 0) {
                state.by_hash.remove(hash);
            }
            self.remove_holder(key, entry.slot, removed.tier);
            state.entries = state.entries.saturating_sub(1);
            stats.blocks_removed += 1;
        }
    }

    fn add_holder(&self, key: BlockKey, slot: u32, tier: Tier) {
        self.blocks
            .entry(key)
            .and_modify(|h| h.add(slot, tier))
            .or_insert_with(|| Holders::new(slot, tier));
    }

    fn remove_holder(&self, key: BlockKey, slot: u32, tier: Tier) {
        if let dashmap::Entry::Occupied(mut occupied) = self.blocks.entry(key)
            && occupied.get_mut().remove(slot, tier)
        {
            occupied.remove();
        }
    }

    /// Drops the pod's entries in one tier (or all), keeping the pod registered.
    fn clear_locked(&self, entry: &PodEntry, state: &mut PodBlocks, tier: Option<Tier>) {
        let mut emptied = Vec::new();
        for (hash, e) in state.by_hash.iter_mut() {
            for t in Tier::ALL {
                if tier.is_some_and(|only| only != t) {
                    continue;
                }
                let Some(r) = e.refs.get_mut(t.index()) else {
                    continue;
                };
                if *r > 0 {
                    *r = 0;
                    self.remove_holder(e.key, entry.slot, t);
                    state.entries = state.entries.saturating_sub(1);
                }
            }
            if e.refs.iter().all(|r| *r == 0) {
                emptied.push(*hash);
            }
        }
        for hash in emptied {
            state.by_hash.remove(&hash);
        }
        if tier.is_none() {
            state.by_hash = HashMap::default();
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
            .flat_map(|(hash, e)| {
                Tier::ALL
                    .into_iter()
                    .filter(|t| e.refs.get(t.index()).is_some_and(|r| *r > 0))
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
        self.blocks
            .get(&key)
            .is_some_and(|h| h.as_slice().iter().any(|h| h.slot == entry.slot))
    }

    /// An estimate of the bytes the index uses (tables at their capacity, plus boxed holder
    /// lists), for the memory-per-entry figure.
    pub fn memory_bytes(&self) -> usize {
        let block_entry = std::mem::size_of::<(BlockKey, Holders)>() + 1;
        let mut bytes = self.blocks.capacity() * block_entry;
        for item in self.blocks.iter() {
            bytes += item.value().heap_bytes();
        }
        let hash_entry = std::mem::size_of::<(EngineHash, HashEntry)>() + 1;
        for entry in self.table_read().by_id.values() {
            bytes += entry.lock().by_hash.capacity() * hash_entry;
        }
        bytes
    }

    /// For each candidate, the longest run of leading blocks of `tokens` it holds, keyed in
    /// `context` at the pod's block size. Cost O(matched blocks × holders per block) per
    /// distinct block size among the candidates; stops at the first block no candidate holds.
    pub fn match_prefix(
        &self,
        context: &KeyContext,
        tokens: &[u32],
        candidates: &[PodId],
    ) -> Vec<PrefixMatch> {
        let mut sizes: Vec<u32> = candidates
            .iter()
            .map(|pod| self.block_size_for(*pod))
            .collect();
        let per_candidate = sizes.clone();
        sizes.sort_unstable();
        sizes.dedup();
        let mut out: Vec<Option<PrefixMatch>> = vec![None; candidates.len()];
        for size in sizes {
            let group: Vec<(usize, PodId)> = candidates
                .iter()
                .enumerate()
                .filter(|(i, _)| per_candidate.get(*i) == Some(&size))
                .map(|(i, pod)| (i, *pod))
                .collect();
            let keys = block_keys(context, tokens, size);
            let pods: Vec<PodId> = group.iter().map(|(_, pod)| *pod).collect();
            for ((i, _), found) in group.iter().zip(self.match_keys(&keys, size, &pods)) {
                if let Some(cell) = out.get_mut(*i) {
                    *cell = Some(found);
                }
            }
        }
        out.into_iter().flatten().collect()
    }

    fn block_size_for(&self, pod: PodId) -> u32 {
        self.pod_block_size(pod)
            .unwrap_or(self.config.default_block_size.max(1))
    }

    /// Like [`Self::match_prefix`] for keys already computed at `block_size`.
    pub fn match_keys(
        &self,
        keys: &[BlockKey],
        block_size: u32,
        candidates: &[PodId],
    ) -> Vec<PrefixMatch> {
        let weights = self.config.tier_weights.0;
        let mut run = vec![0usize; candidates.len()];
        let mut weighted = vec![0f64; candidates.len()];
        let mut last_weight = vec![0f64; candidates.len()];
        // slot → candidate position, built once per call (slots are small dense integers).
        let mut position_of_slot: Vec<u32> = Vec::new();
        let mut alive = 0usize;
        {
            let table = self.table_read();
            position_of_slot.resize(table.slots.len(), u32::MAX);
            for (position, pod) in candidates.iter().enumerate() {
                if let Some(entry) = table.by_id.get(pod)
                    && let Some(cell) = position_of_slot.get_mut(entry.slot as usize)
                {
                    *cell = position as u32;
                    alive += 1;
                }
            }
        }
        for (i, key) in keys.iter().enumerate() {
            if alive == 0 {
                break;
            }
            let Some(holders) = self.blocks.get(key) else {
                break;
            };
            let mut extended = 0;
            for holder in holders.as_slice() {
                let Some(&position) = position_of_slot.get(holder.slot as usize) else {
                    continue;
                };
                let p = position as usize;
                let (Some(r), Some(w), Some(last)) =
                    (run.get_mut(p), weighted.get_mut(p), last_weight.get_mut(p))
                else {
                    continue;
                };
                let tier_weight = weights.get(holder.tier as usize).copied().unwrap_or(0.0);
                if *r == i {
                    *r = i + 1;
                    *w += tier_weight;
                    *last = tier_weight;
                    extended += 1;
                } else if *r == i + 1 && tier_weight > *last {
                    *w += tier_weight - *last;
                    *last = tier_weight;
                }
            }
            alive = extended;
        }
        candidates
            .iter()
            .enumerate()
            .map(|(p, pod)| PrefixMatch {
                pod: *pod,
                block_size,
                total_blocks: keys.len(),
                matched_blocks: run.get(p).copied().unwrap_or(0),
                weighted_blocks: weighted.get(p).copied().unwrap_or(0.0),
            })
            .collect()
    }

    /// Pod id of a slot (for diagnostics).
    #[allow(dead_code)]
    pub(crate) fn pod_of_slot(&self, slot: u32) -> Option<PodId> {
        self.table_read()
            .slots
            .get(slot as usize)
            .copied()
            .flatten()
    }

    #[allow(dead_code)]
    pub(crate) fn entry_id(entry: &PodEntry) -> PodId {
        entry.id
    }
}
