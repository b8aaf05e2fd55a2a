//! Applying KV-event batches to the index: stores (keyed from their tokens, chained to their
//! parent, placed in spans), removals and clears, with the bounds and the statistics of each
//! batch. The concurrency rules are the index's ([`super::index`]): one writer per pod, under
//! the pod's mutex.
//!
//! # Runs and reading ahead (why)
//! A pod at capacity reports each chunked-prefill step as a store of up to 512 blocks and as
//! many `BlockRemoved` events. In a fleet's index (tables larger than the CPU's caches) each
//! block is then a cache miss in the pod's hash map and one in the block map, and applied one
//! block after another, under a lock per block, those misses are paid one after the other
//! (`Shard::remove` and `Shard::add` were a quarter of kvpick's CPU with pods publishing
//! events, nearly all of it waiting on two loads). So:
//! - a store's blocks new to the pod go in as runs ([`PrefixIndex::store_run`]): their hashes
//!   claimed in one loop, the block map written shard by shard, so the misses overlap;
//! - removals, and stores that go block by block, are read ahead: a stretch of up to
//!   [`READ_AHEAD`] blocks is looked up once, results unused (independent reads, whose misses
//!   overlap), and the apply that follows finds its memory in cache and decides exactly as
//!   before. Only for pods whose maps are large ([`READ_AHEAD_FROM_HASHES`]): in cache, the
//!   second lookup is only extra work.

use std::collections::hash_map::Entry;
use std::sync::atomic::Ordering;

use super::index::{ApplyStats, PodBlocks, PodEntry, PrefixIndex};
use super::key::{BlockKey, KeyContext, next_key};
use super::record::RUN_FROM;
use super::span::SpanRef;
use crate::endpoints::PodId;
use kvpick_kvevents_wire::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Tier};

/// Blocks read ahead at a time: their hash-map and block-map lines (~4 per block) stay well
/// within a core's L2 cache until they are applied.
const READ_AHEAD: usize = 256;

/// Hashes a pod's map must hold for removals and block-by-block stores to be read ahead.
///
/// NOTE: reading ahead is a second lookup of each block; with tables that fit the CPU's
/// caches it only adds that work (`ingest/*` in benches/kvcache.rs: 10–20% slower), while a
/// fleet's index that does not fit gains more than it costs (`ingest_steady`). A pod's map
/// of 16k hashes is ~400 KB, beside a block map at least as large.
const READ_AHEAD_FROM_HASHES: usize = 16 << 10;

/// One block of a store event, keyed.
#[derive(Clone, Copy, Debug)]
struct StoredBlock {
    hash: EngineHash,
    key: BlockKey,
    tier: Tier,
}

/// Whether the blocks of a store chain may still be a re-announcement of blocks the pod
/// already holds (`kv_cache_report_mode: "full"`: a chain from block 0 whose blocks are all
/// held), or are new physical blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Announcement {
    /// New blocks: each store adds a reference.
    New,
    /// Every block so far was held already: a held block adds no reference.
    MaybeRepeat,
}

/// Where a stored block sits in its event's chain, which decides its span.
#[derive(Clone, Copy, Debug)]
enum ChainLink {
    /// Nothing shows which block precedes it: no span.
    Unchained,
    /// The first block of a chain whose predecessor the pod does not hold: a new span.
    Start,
    /// After a block the pod holds in this span: continue it if that block is its tail.
    After(SpanRef),
}

impl ChainLink {
    /// The link after a block held in `span`: continue it when the block is the chain's own.
    fn continuing(chained: bool, span: SpanRef, restart: ChainLink) -> ChainLink {
        if chained && span.is_some() {
            ChainLink::After(span)
        } else {
            restart
        }
    }
}

impl PrefixIndex {
    /// Applies one decoded batch from `pod`, whose topic names `model`. Batches of one pod must
    /// be applied in sequence order, from one task at a time.
    pub fn apply_batch(&self, pod: PodId, model: &str, batch: &EventBatch) -> ApplyStats {
        self.apply_batch_runs_from(pod, model, batch, RUN_FROM)
    }

    /// [`Self::apply_batch`], adding a store's new blocks as runs when `run_from` or more
    /// lead a stretch (`usize::MAX`: block by block; tests compare the two).
    pub(super) fn apply_batch_runs_from(
        &self,
        pod: PodId,
        model: &str,
        batch: &EventBatch,
        run_from: usize,
    ) -> ApplyStats {
        let entry = self.pod_or_insert(pod);
        let mut state = entry.lock();
        let mut stats = ApplyStats::default();
        if state.retired {
            return stats;
        }
        if !state.precise {
            // The pod publishes events: what routing history suggested is replaced by facts.
            state.precise = true;
            self.drop_approx(&entry, &mut state);
        }
        // Removals read ahead up to (not including) this event.
        let mut read_until = 0;
        for (i, event) in batch.events.iter().enumerate() {
            match event {
                KvEvent::BlockStored(stored) => {
                    self.apply_stored(&entry, &mut state, model, stored, run_from, &mut stats)
                }
                KvEvent::BlockRemoved(removed) => {
                    if i >= read_until && state.by_hash.len() >= READ_AHEAD_FROM_HASHES {
                        let ahead = batch.events.get(i..).unwrap_or_default();
                        read_until = i + self.read_ahead_removals(&state, ahead);
                    }
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
        run_from: usize,
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
                match state.by_hash.get(hash).copied() {
                    Some(key) => {
                        // NOTE: without tokens nothing shows that the listed blocks follow one
                        // another (an offload store may skip blocks it holds): no spans.
                        let block = StoredBlock {
                            hash: *hash,
                            key,
                            tier,
                        };
                        self.insert(
                            entry,
                            state,
                            block,
                            Announcement::New,
                            ChainLink::Unchained,
                            stats,
                        );
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
        self.learned_block_size
            .store(block_size as u32, Ordering::Relaxed);
        let mut previous = match stored.parent_block_hash {
            None => KeyContext {
                model: model.to_string(),
                lora_name: stored.lora_name.clone(),
                cache_salt: stored.extra.first().and_then(|e| e.cache_salt.clone()),
            }
            .seed(),
            Some(parent) => match state.by_hash.get(&parent) {
                Some(parent) => parent.0,
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
        let mut announcement = if stored.parent_block_hash.is_none() {
            Announcement::MaybeRepeat
        } else {
            Announcement::New
        };
        let mut link = match self.parent_span(entry, state, stored.parent_block_hash, tier) {
            Some(span) => ChainLink::After(span),
            None => ChainLink::Start,
        };
        // Every block keyed first, so a stretch of them can be added as a run or read ahead
        // (module docs).
        let keys: Vec<BlockKey> = stored
            .token_ids
            .chunks_exact(block_size)
            .enumerate()
            .map(|(i, tokens)| {
                let opaque = stored.extra.get(i).and_then(|e| e.opaque);
                let key = next_key(previous, tokens, opaque);
                previous = key.0;
                key
            })
            .collect();
        let hashes = &stored.block_hashes;
        let (mut read_until, mut next_run) = (0, 0);
        let mut i = 0;
        while let (Some(hash), Some(key)) = (hashes.get(i), keys.get(i)) {
            let end = (i + READ_AHEAD).min(keys.len());
            if announcement == Announcement::New && i >= next_run {
                let stretch = (
                    hashes.get(i..end).unwrap_or_default(),
                    keys.get(i..end).unwrap_or_default(),
                );
                let stretch_len = stretch.0.len();
                match self.store_run(entry, state, stretch, tier, link, run_from, stats) {
                    Some((handled, next)) => {
                        (i, link) = (i + handled, next);
                        // A run cut short (a block already held, the pod's limit): block by
                        // block for a while, so blocks held under new hashes (an engine that
                        // hashes anew) cost no run attempt each.
                        if handled < stretch_len {
                            next_run = i.saturating_add(run_from.max(1));
                        }
                        continue;
                    }
                    // Not a run of new blocks here: block by block for a while.
                    None => next_run = i.saturating_add(run_from.max(1)),
                }
            }
            if i >= read_until && state.by_hash.len() >= READ_AHEAD_FROM_HASHES {
                self.read_ahead(
                    state,
                    hashes.get(i..end).unwrap_or_default(),
                    keys.get(i..end).unwrap_or_default(),
                );
                read_until = end;
            }
            let block = StoredBlock {
                hash: *hash,
                key: *key,
                tier,
            };
            (announcement, link) = self.insert(entry, state, block, announcement, link, stats);
            i += 1;
        }
    }

    /// Adds the leading blocks of `stretch` (engine hashes, keys) as one run when they are new
    /// to the pod ([`PrefixIndex::add_new_run`]: shard by shard, so their cache misses
    /// overlap); returns how many blocks it applied and the link of the next, or `None` (nothing
    /// applied) when fewer than `run_from` lead the stretch.
    ///
    /// Block by block ([`Self::insert`]), a block whose hash the pod has not keyed, stored
    /// after a chained block while no re-announcement is possible and below the pod's limits,
    /// is keyed, added, and continues its predecessor's span when it is a new holder; a run
    /// does exactly that for each. So a run takes the leading blocks whose hashes are new
    /// (each claimed in the pod's map in turn, so a hash repeated in the stretch ends it), if
    /// the pod's limits leave room for all of them; `add_new_run` stops at a block the pod
    /// already holds in this tier, which counts one more reference (a duplicate store) as
    /// block by block, and the blocks after it are given back to the caller, hashes unclaimed.
    #[allow(clippy::too_many_arguments)]
    fn store_run(
        &self,
        entry: &PodEntry,
        state: &mut PodBlocks,
        (hashes, keys): (&[EngineHash], &[BlockKey]),
        tier: Tier,
        link: ChainLink,
        run_from: usize,
        stats: &mut ApplyStats,
    ) -> Option<(usize, ChainLink)> {
        let previous = match link {
            ChainLink::Unchained => return None,
            ChainLink::Start => None,
            ChainLink::After(span) => Some(span),
        };
        let room = state
            .limit
            .saturating_sub(state.entries.max(state.by_hash.len()));
        let wanted = hashes.len().min(keys.len()).min(room);
        if wanted < run_from.max(1) {
            return None;
        }
        // A stretch whose first block the pod holds already is no run (and would be taken
        // back whole): one lookup spares the attempt.
        let first = keys.first()?;
        if self.blocks.tier_refs(*first, entry.slot, tier) > 0 {
            return None;
        }
        let mut claimed = 0;
        for (hash, key) in hashes.iter().zip(keys).take(wanted) {
            match state.by_hash.entry(*hash) {
                Entry::Vacant(vacant) => {
                    vacant.insert(*key);
                    claimed += 1;
                }
                Entry::Occupied(_) => break,
            }
        }
        let (handled, new, last) = if claimed >= run_from.max(1) {
            let run = keys.get(..claimed).unwrap_or_default();
            self.add_new_run(entry, &mut state.spans, run, previous, tier)
        } else {
            (0, 0, previous)
        };
        for hash in hashes.get(handled..claimed).unwrap_or_default() {
            state.by_hash.remove(hash);
        }
        if handled == 0 {
            return None;
        }
        state.entries += new;
        stats.blocks_added += new as u64;
        stats.duplicate_stores += (handled - new) as u64;
        let last = last.unwrap_or(SpanRef::NONE);
        Some((handled, ChainLink::continuing(true, last, ChainLink::Start)))
    }

    /// Reads what applying `hashes` (the pod's map) and `keys` (the block map) will read,
    /// results unused, so that their cache misses overlap (module docs). Decides nothing.
    fn read_ahead(&self, state: &PodBlocks, hashes: &[EngineHash], keys: &[BlockKey]) {
        let mut sum = 0u64;
        for hash in hashes {
            sum = sum.wrapping_add(state.by_hash.get(hash).map_or(0, |key| key.0));
        }
        std::hint::black_box(sum);
        std::hint::black_box(self.blocks.reader(keys.len()).probe(keys));
    }

    /// Reads ahead the removals at the start of `events` (consecutive `BlockRemoved` events, up
    /// to [`READ_AHEAD`] hashes); returns how many events it covered (at least one).
    fn read_ahead_removals(&self, state: &PodBlocks, events: &[KvEvent]) -> usize {
        let mut keys = Vec::with_capacity(READ_AHEAD);
        let mut covered = 0;
        for event in events {
            let KvEvent::BlockRemoved(removed) = event else {
                break;
            };
            if keys.len() + removed.block_hashes.len() > READ_AHEAD && covered > 0 {
                break;
            }
            covered += 1;
            // The pod's map is read here already: these lookups are the read-ahead of it.
            keys.extend(
                removed
                    .block_hashes
                    .iter()
                    .take(READ_AHEAD)
                    .filter_map(|hash| state.by_hash.get(hash).copied()),
            );
        }
        std::hint::black_box(self.blocks.reader(keys.len()).probe(&keys));
        covered.max(1)
    }

    /// The span of a chain's parent block on (pod, tier), which the chain may continue.
    fn parent_span(
        &self,
        entry: &PodEntry,
        state: &PodBlocks,
        parent: Option<EngineHash>,
        tier: Tier,
    ) -> Option<SpanRef> {
        let key = state.by_hash.get(&parent?)?;
        self.blocks.span_of(*key, entry.slot, tier)
    }

    /// Adds one reference of `block`, placed in a span as `link` says; returns whether the
    /// re-announcement run continues (the block was already held) and the link of the chain's
    /// next block.
    fn insert(
        &self,
        entry: &PodEntry,
        state: &mut PodBlocks,
        block: StoredBlock,
        announcement: Announcement,
        link: ChainLink,
        stats: &mut ApplyStats,
    ) -> (Announcement, ChainLink) {
        let StoredBlock { hash, key, tier } = block;
        let reannounce = announcement == Announcement::MaybeRepeat;
        // NOTE: the map of hashes is bounded too: several hashes of one key share one entry.
        let at_limit = state.entries >= state.limit || state.by_hash.len() >= state.limit;
        // The chain continues through this block only if the hash is keyed as the chain keys it:
        // a hash the pod already keyed otherwise (reused by the engine, or a hostile
        // publisher) is held under its old key, which is not this chain's block.
        let mut chained = !matches!(link, ChainLink::Unchained);
        // What the next block continues when this one cannot be continued.
        let restart = if chained {
            ChainLink::Start
        } else {
            ChainLink::Unchained
        };
        let key = match state.by_hash.get(&hash) {
            Some(existing) => {
                chained &= *existing == key;
                *existing
            }
            None => {
                if at_limit {
                    stats.capacity_drops += 1;
                    return (Announcement::New, restart);
                }
                state.by_hash.insert(hash, key);
                key
            }
        };
        if reannounce || at_limit {
            // Only a read first: a held block is either re-announced or, at the limit, the
            // only kind of store still accepted.
            let held = self.blocks.span_of(key, entry.slot, tier);
            if let Some(span) = held
                && reannounce
            {
                stats.reannounced += 1;
                return (
                    Announcement::MaybeRepeat,
                    ChainLink::continuing(chained, span, restart),
                );
            }
            if held.is_none() && at_limit {
                stats.capacity_drops += 1;
                self.forget_hash_if_unheld(entry, state, hash, key);
                return (Announcement::New, restart);
            }
        }
        let next = match link {
            _ if !chained => SpanRef::NONE,
            ChainLink::After(previous) => state.spans.next_after(Some(previous), &entry.spans),
            _ => state.spans.next_after(None, &entry.spans),
        };
        let (refs, span) = self.add_holder(key, entry.slot, tier, next);
        let continued = ChainLink::continuing(chained, span, restart);
        if refs > 1 {
            stats.duplicate_stores += 1;
            return (Announcement::New, continued);
        }
        state.spans.commit(span, &entry.spans);
        state.entries += 1;
        stats.blocks_added += 1;
        (Announcement::New, continued)
    }

    /// Drops `hash` from the pod's map when the pod holds its key in no tier.
    fn forget_hash_if_unheld(
        &self,
        entry: &PodEntry,
        state: &mut PodBlocks,
        hash: EngineHash,
        key: BlockKey,
    ) {
        if !self.blocks.holds(key, entry.slot) {
            state.by_hash.remove(&hash);
        }
    }

    fn apply_removed(
        &self,
        entry: &PodEntry,
        state: &mut PodBlocks,
        removed: &BlockRemoved,
        stats: &mut ApplyStats,
    ) {
        for hash in &removed.block_hashes {
            let Some(key) = state.by_hash.get(hash).copied() else {
                stats.unknown_removals += 1;
                continue;
            };
            match self.remove_holder(entry, &mut state.spans, key, removed.tier) {
                None => stats.unknown_removals += 1,
                Some(0) => {
                    state.entries = state.entries.saturating_sub(1);
                    stats.blocks_removed += 1;
                    self.forget_hash_if_unheld(entry, state, *hash, key);
                }
                Some(_) => {}
            }
        }
    }
}

#[cfg(test)]
#[path = "apply_tests.rs"]
mod tests;
