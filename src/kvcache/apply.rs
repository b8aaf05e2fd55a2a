//! Applying KV-event batches to the index: stores (keyed from their tokens, chained to their
//! parent, placed in spans), removals and clears, with the bounds and the statistics of each
//! batch. The concurrency rules are the index's ([`super::index`]): one writer per pod, under
//! the pod's mutex.

use std::sync::atomic::Ordering;

use super::index::{ApplyStats, PodBlocks, PodEntry, PrefixIndex};
use super::key::{BlockKey, KeyContext, next_key};
use super::span::SpanRef;
use crate::endpoints::PodId;
use kvpick_kvevents_wire::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Tier};

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
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => {
                    self.apply_stored(&entry, &mut state, model, stored, &mut stats)
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
        for (i, (hash, tokens)) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(block_size))
            .enumerate()
        {
            let opaque = stored.extra.get(i).and_then(|e| e.opaque);
            let key = next_key(previous, tokens, opaque);
            previous = key.0;
            let block = StoredBlock {
                hash: *hash,
                key,
                tier,
            };
            (announcement, link) = self.insert(entry, state, block, announcement, link, stats);
        }
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
