//! The global block map: `BlockKey → the (pod slot, tier) pairs that hold it`, read by matching.
//!
//! # Layout (why)
//! Most blocks are held by one pod, so each shard keeps one compact table of 16-byte entries
//! (the key and its first holder inline) and a second, small table with the further holders of
//! the blocks that have more than one (`more`, flagged in the inline entry so a single-holder
//! lookup never touches it). A block held by one pod thus costs 17 bytes of table at full load.
//! A block held by several pods also carries bitsets over pod slots (one per tier), so a
//! walk over a prefix every pod holds (a shared system prompt) intersects a few words per
//! block instead of visiting every holder.
//!
//! # Concurrency rules
//! - The map is split in [`SHARDS`] shards, each behind its own `RwLock`.
//! - Writers (event appliers, routing records, purges) lock one shard at a time and never hold
//!   any other index lock (pod table, speculative map) while waiting for a shard.
//! - A routing record's long stretch of new blocks (and its evictions) is written shard by
//!   shard ([`BlockMap::add_run`], [`BlockMap::remove_run`]): each shard locked once for its
//!   share of the keys, still one shard at a time.
//! - A reader of one key ([`BlockMap::holds`], short walks) locks that key's shard only.
//! - An event applier reading ahead (`apply`) takes every shard's read guard as a long walk
//!   does, under its pod's mutex (the index's lock order: pod mutex, then shards), and drops
//!   them before it writes.
//! - A long walk ([`BlockMap::reader`] with many blocks) takes the read guards of **all** shards
//!   up front, in shard order, and keeps them for the walk: one lock operation per shard instead
//!   of two per block (half the cost of a 2,000-block match). Acquiring in one fixed order while
//!   writers hold at most one shard cannot deadlock, even with a writer-preferring lock. Writers
//!   wait at most one walk (tens of microseconds).

use std::collections::HashMap;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use hashbrown::HashTable;

use super::key::{BlockKey, PrehashedState};
use super::shards::{write_by_shard, write_by_shard_reading_ahead};
use super::span::{SPAN_BITS, SpanRef};
use kvpick_kvevents_wire::Tier;

/// Number of shards (a power of two).
pub(crate) const SHARDS: usize = 32;
const SHARD_SHIFT: u32 = 64 - SHARDS.trailing_zeros();

/// One (pod slot, tier) holding a block, with how many of the pod's engine hashes in that
/// tier map to it (usually 1), and its place in the pod's spans (see [`super::span`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) slot: u32,
    pub(crate) refs: u16,
    pub(crate) tier: u8,
    pub(crate) span: SpanRef,
}

/// Pod slots a holder can name.
pub(crate) const MAX_SLOTS: u32 = 1 << SLOT_BITS;
const SLOT_BITS: u32 = 20;
const TIER_SHIFT: u32 = SLOT_BITS;
const MORE_BIT: u32 = TIER_SHIFT + 2;
const REFS_SHIFT: u32 = MORE_BIT + 1;
/// References beyond this saturate (see [`Holder::pack`]).
const MAX_REFS: u16 = 0xff;
const OFFSET_SHIFT: u32 = REFS_SHIFT + 8;
const SPAN_SHIFT: u32 = OFFSET_SHIFT + 16;
const _: () = assert!(SPAN_SHIFT + SPAN_BITS == 64);

impl Holder {
    /// Packs into one word: slot (20 bits), tier (2), the entry's `more` flag (1), refs (8),
    /// span offset (16), span id (17).
    ///
    /// NOTE: references saturate at 255 (the engine would have to store one hash 255 times
    /// without removing it); a saturated holder leaves 255 removals later, too early — a
    /// false negative, never a false positive. Slots are bounded by the index ([`MAX_SLOTS`]).
    #[inline]
    fn pack(self, more: bool) -> u64 {
        u64::from(self.slot & (MAX_SLOTS - 1))
            | u64::from(self.tier & 3) << TIER_SHIFT
            | u64::from(more) << MORE_BIT
            | u64::from(self.refs.min(MAX_REFS)) << REFS_SHIFT
            | u64::from(self.span.offset) << OFFSET_SHIFT
            | u64::from(self.span.id) << SPAN_SHIFT
    }

    #[inline]
    fn unpack(word: u64) -> Holder {
        Holder {
            slot: (word & u64::from(MAX_SLOTS - 1)) as u32,
            tier: (word >> TIER_SHIFT & 3) as u8,
            refs: (word >> REFS_SHIFT & u64::from(MAX_REFS)) as u16,
            span: SpanRef {
                id: (word >> SPAN_SHIFT) as u32,
                offset: (word >> OFFSET_SHIFT & 0xffff) as u16,
            },
        }
    }

    #[inline]
    fn is(&self, slot: u32, tier: u8) -> bool {
        self.slot == slot && self.tier == tier
    }
}

/// A block with its first holder inline (packed, see [`Holder::pack`]); the holder's `more`
/// bit says whether `Shard::more` lists others.
#[derive(Clone, Copy, Debug)]
struct Entry {
    key: u64,
    first: u64,
}

impl Entry {
    #[inline]
    fn holder(&self) -> Holder {
        Holder::unpack(self.first)
    }

    #[inline]
    fn more(&self) -> bool {
        self.first >> MORE_BIT & 1 == 1
    }

    #[inline]
    fn set_holder(&mut self, holder: Holder) {
        self.first = holder.pack(self.more());
    }

    #[inline]
    fn set_more(&mut self, more: bool) {
        self.first = self.holder().pack(more);
    }
}

/// One shard: blocks with their first holder inline, and the further holders.
#[derive(Default)]
pub(crate) struct Shard {
    blocks: HashTable<Entry>,
    more: HashMap<u64, More, PrehashedState>,
}

/// The holders of a block beyond its inline one, and bitsets over every holder's slot.
#[derive(Default)]
struct More {
    /// Packed holders ([`Holder::pack`]).
    rest: Vec<u64>,
    /// Per tier words, interleaved: `[gpu₀, cpu₀, other₀, gpu₁, …]`; bit `s % 64` of triple
    /// `s / 64` is set when slot `s` holds the block in that tier.
    bits: Vec<u64>,
}

impl More {
    fn set_bit(&mut self, slot: u32, tier: u8, held: bool) {
        let word = (slot / 64) as usize * TIERS + tier as usize;
        let bit = 1u64 << (slot % 64);
        let words = ((slot / 64) as usize + 1) * TIERS;
        if self.bits.len() < words {
            self.bits.resize(words, 0);
        }
        if let Some(w) = self.bits.get_mut(word) {
            *w = if held { *w | bit } else { *w & !bit };
        }
    }
}

/// Tiers kept apart in bitsets (gpu, cpu, anything slower).
pub(crate) const TIERS: usize = 3;

/// The holders of one block, as a walk reads them.
pub(crate) enum HeldBy {
    /// Nobody.
    Nobody,
    /// One (slot, tier): the scratch words were not touched.
    One { slot: u32, tier: u8 },
    /// Several: the scratch words (per tier, see [`More::bits`]) hold their slots.
    Many,
}

/// The table hash of a key: keys are already uniform, one multiply spreads them over both
/// ends of the word (hashbrown uses the low bits for the bucket, the top 7 for its tag).
#[inline]
fn table_hash(key: u64) -> u64 {
    key.wrapping_mul(0x517c_c1b7_2722_0a95)
}

impl Shard {
    fn find(&self, key: u64) -> Option<&Entry> {
        self.blocks.find(table_hash(key), |e| e.key == key)
    }

    /// Calls `visit` for each holder of `key`; false when it has none.
    #[inline]
    fn visit(&self, key: u64, mut visit: impl FnMut(Holder)) -> bool {
        let Some(entry) = self.find(key) else {
            return false;
        };
        visit(entry.holder());
        if entry.more()
            && let Some(more) = self.more.get(&key)
        {
            more.rest
                .iter()
                .for_each(|word| visit(Holder::unpack(*word)));
        }
        true
    }

    /// Who holds `key`; for several holders their per-tier bits are copied into `scratch`
    /// (its words beyond the block's are zeroed; slots beyond `scratch` are left out).
    #[inline]
    fn held_by(&self, key: u64, scratch: &mut [u64]) -> HeldBy {
        let Some(entry) = self.find(key) else {
            return HeldBy::Nobody;
        };
        if entry.more()
            && let Some(more) = self.more.get(&key)
        {
            let stored = more.bits.len().min(scratch.len());
            let (head, tail) = scratch.split_at_mut(stored);
            head.copy_from_slice(more.bits.get(..stored).unwrap_or_default());
            tail.fill(0);
            return HeldBy::Many;
        }
        let holder = entry.holder();
        HeldBy::One {
            slot: holder.slot,
            tier: holder.tier,
        }
    }

    fn holds(&self, key: u64, slot: u32) -> bool {
        let mut held = false;
        self.visit(key, |h| held |= h.slot == slot);
        held
    }

    /// The span of (slot, tier) on `key`, when it holds it.
    fn span_of(&self, key: u64, slot: u32, tier: u8) -> Option<SpanRef> {
        let mut span = None;
        self.visit(key, |h| {
            if h.is(slot, tier) {
                span = Some(h.span);
            }
        });
        span
    }

    /// Adds one reference; returns the holder's references after it (1 = a new holder, which
    /// took `span`) and its span.
    fn add(&mut self, key: u64, slot: u32, tier: u8, span: SpanRef) -> (u16, SpanRef) {
        let hash = table_hash(key);
        let new = Holder {
            slot,
            refs: 1,
            tier,
            span,
        };
        let Some(entry) = self.blocks.find_mut(hash, |e| e.key == key) else {
            self.blocks.insert_unique(
                hash,
                Entry {
                    key,
                    first: new.pack(false),
                },
                |e| table_hash(e.key),
            );
            return (1, span);
        };
        let mut first = entry.holder();
        if first.is(slot, tier) {
            first.refs = first.refs.saturating_add(1).min(MAX_REFS);
            entry.set_holder(first);
            return (first.refs, first.span);
        }
        let was_single = !entry.more();
        entry.set_more(true);
        let more = self.more.entry(key).or_default();
        if was_single {
            more.rest.clear();
            more.bits.clear();
            more.set_bit(first.slot, first.tier, true);
        }
        let found = more
            .rest
            .iter_mut()
            .find(|word| Holder::unpack(**word).is(slot, tier));
        match found {
            Some(word) => {
                let mut holder = Holder::unpack(*word);
                holder.refs = holder.refs.saturating_add(1).min(MAX_REFS);
                *word = holder.pack(false);
                (holder.refs, holder.span)
            }
            None => {
                more.rest.push(new.pack(false));
                more.set_bit(slot, tier, true);
                (1, span)
            }
        }
    }

    /// References of (slot, tier) on `key` (0 when not a holder).
    fn tier_refs(&self, key: u64, slot: u32, tier: u8) -> u16 {
        let mut refs = 0;
        self.visit(key, |h| {
            if h.is(slot, tier) {
                refs = h.refs;
            }
        });
        refs
    }

    /// Drops one reference (or all of them with `all`); returns the references left and the
    /// holder's span, or `None` when (slot, tier) did not hold `key`.
    fn remove(&mut self, key: u64, slot: u32, tier: u8, all: bool) -> Option<(u16, SpanRef)> {
        let hash = table_hash(key);
        let Ok(mut occupied) = self.blocks.find_entry(hash, |e| e.key == key) else {
            return None;
        };
        let entry = occupied.get_mut();
        let mut first = entry.holder();
        let span;
        if first.is(slot, tier) {
            span = first.span;
            first.refs = if all { 0 } else { first.refs.saturating_sub(1) };
            if first.refs > 0 {
                entry.set_holder(first);
                return Some((first.refs, span));
            }
            // The inline holder is gone: another one moves inline, or the block leaves.
            let next = if entry.more() {
                self.more.get_mut(&key).and_then(|more| more.rest.pop())
            } else {
                None
            };
            match next {
                Some(next) => entry.set_holder(Holder::unpack(next)),
                None => {
                    occupied.remove();
                    self.more.remove(&key);
                    return Some((0, span));
                }
            }
        } else {
            let rest = &mut self.more.get_mut(&key)?.rest;
            let position = rest
                .iter()
                .position(|word| Holder::unpack(*word).is(slot, tier))?;
            let word = rest.get_mut(position)?;
            let mut holder = Holder::unpack(*word);
            span = holder.span;
            holder.refs = if all {
                0
            } else {
                holder.refs.saturating_sub(1)
            };
            if holder.refs > 0 {
                *word = holder.pack(false);
                return Some((holder.refs, span));
            }
            rest.swap_remove(position);
        }
        if self.more.get(&key).is_some_and(|more| more.rest.is_empty()) {
            self.more.remove(&key);
            occupied.get_mut().set_more(false);
        } else if let Some(more) = self.more.get_mut(&key) {
            more.set_bit(slot, tier, false);
        }
        Some((0, span))
    }

    fn memory_bytes(&self) -> usize {
        // hashbrown: buckets = capacity × 8/7 (≥ 8 buckets), one control byte per bucket.
        fn buckets(capacity: usize) -> usize {
            if capacity < 7 {
                capacity.next_power_of_two()
            } else {
                capacity / 7 * 8
            }
        }
        let main = buckets(self.blocks.capacity()) * (std::mem::size_of::<Entry>() + 1);
        let more = buckets(self.more.capacity()) * (std::mem::size_of::<(u64, More)>() + 1)
            + self
                .more
                .values()
                .map(|more| {
                    more.rest.capacity() * std::mem::size_of::<u64>()
                        + more.bits.capacity() * std::mem::size_of::<u64>()
                })
                .sum::<usize>();
        main + more
    }
}

/// The sharded block map (see the module docs for its concurrency rules).
pub(crate) struct BlockMap {
    shards: Box<[RwLock<Shard>]>,
}

impl Default for BlockMap {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
        }
    }
}

/// Shard of a key: its top bits (the table hash uses all of them, so a shard's table still
/// sees uniform hashes).
#[inline]
fn shard_of(key: u64) -> usize {
    (key >> SHARD_SHIFT) as usize
}

impl BlockMap {
    fn read(&self, shard: usize) -> Option<RwLockReadGuard<'_, Shard>> {
        // NOTE: a panic while holding the lock cannot leave a table unsafe to read, only
        // incomplete; keep serving rather than propagate the poison.
        let lock = self.shards.get(shard)?;
        Some(lock.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn write(&self, key: u64) -> Option<RwLockWriteGuard<'_, Shard>> {
        let lock = self.shards.get(shard_of(key))?;
        Some(lock.write().unwrap_or_else(|e| e.into_inner()))
    }

    /// Adds one reference of (slot, tier) to `key`; returns its references after it (1 = a
    /// new holder, which took `span`) and the holder's span.
    pub(crate) fn add(
        &self,
        key: BlockKey,
        slot: u32,
        tier: Tier,
        span: SpanRef,
    ) -> (u16, SpanRef) {
        self.write(key.0).map_or((0, SpanRef::NONE), |mut shard| {
            shard.add(key.0, slot, tier.index() as u8, span)
        })
    }

    /// [`Self::add`] for each of `keys`, key `k` with span `first` + `k` (offsets one after
    /// another in `first`'s span), taking each shard's lock once for all its keys (in `keys`'
    /// order within a shard). Returns each key's (references after, the holder's span) as
    /// `add` does, in `keys`' order. The offsets must fit: `first.offset + keys.len()` below
    /// `u16::MAX` (the caller checks, as block by block a span never grows past it).
    ///
    /// NOTE: why not one `add` per key: a new key's table slot is a cache miss that the
    /// write stores into, and the lock's release (a locked instruction) waits for that store
    /// to complete, so a cold record of 3,500 new blocks paid 3,500 misses one after the
    /// other (43% of its adding time sat on the release, `perf annotate` of `record_cold` in
    /// benches/kvcache.rs). Here the stores to one shard's slots overlap, and only the 32
    /// releases wait. A writer still holds one shard at a time (the module's rules).
    pub(crate) fn add_run(
        &self,
        keys: &[BlockKey],
        slot: u32,
        tier: Tier,
        first: SpanRef,
    ) -> Vec<(u16, SpanRef)> {
        let mut added = vec![(0, SpanRef::NONE); keys.len()];
        let tier = tier.index() as u8;
        self.by_shard(keys, |shard, k, key| {
            if let Some(result) = added.get_mut(k) {
                *result = shard.add(key.0, slot, tier, first.advanced(k));
            }
        });
        added
    }

    /// [`Self::remove`] for each of `keys`, taking each shard's lock once for all its keys
    /// (see [`Self::add_run`] for why); `left` is called as `remove` calls it, for each holder
    /// that leaves, while its shard is write-locked. Returns how many holders left.
    ///
    /// NOTE: the keys leave in shard order, not in `keys`' order. A span's intact length is
    /// the same either way (the lowest offset gone), and it is lowered before the block goes,
    /// under the same lock, so a walk never credits a block that left; the span's recorded
    /// end may stay longer until its head is all that is left (`SpanBook::left`), which only
    /// delays continuing it.
    pub(crate) fn remove_run(
        &self,
        keys: &[BlockKey],
        slot: u32,
        tier: Tier,
        mut left: impl FnMut(SpanRef),
    ) -> usize {
        let tier = tier.index() as u8;
        let mut gone = 0;
        // NOTE: the keys of a run being removed are mostly the pod's oldest blocks, far out
        // of the CPU's caches: each shard's keys are looked up a batch at a time before
        // they are removed (`write_by_shard_reading_ahead`).
        write_by_shard_reading_ahead(
            &self.shards,
            keys,
            |key| shard_of(key.0),
            |shard, key| shard.find(key.0).is_some(),
            |shard, _, key| {
                if let Some((0, span)) = shard.remove(key.0, slot, tier, false) {
                    left(span);
                    gone += 1;
                }
            },
        );
        gone
    }

    /// Calls `visit` with each shard's write guard, each key's position and the key, for
    /// every key of `keys`: shard by shard, each shard locked once, keys in order within it.
    fn by_shard(&self, keys: &[BlockKey], visit: impl FnMut(&mut Shard, usize, BlockKey)) {
        write_by_shard(&self.shards, keys, |key| shard_of(key.0), visit);
    }

    /// Drops one reference of (slot, tier) from `key` (the block leaves with its last holder);
    /// returns the references left, `None` when (slot, tier) did not hold it. When the holder
    /// leaves, `left` is called with its span while the shard is still write-locked, so a walk
    /// holding the shard guards never sees the block gone and its span still intact.
    pub(crate) fn remove(
        &self,
        key: BlockKey,
        slot: u32,
        tier: Tier,
        left: impl FnOnce(SpanRef),
    ) -> Option<u16> {
        let mut shard = self.write(key.0)?;
        let (refs, span) = shard.remove(key.0, slot, tier.index() as u8, false)?;
        if refs == 0 {
            left(span);
        }
        Some(refs)
    }

    /// Drops (slot, tier) from `key` whatever its references (calling `left` as
    /// [`Self::remove`] does); false when it was no holder.
    pub(crate) fn remove_all(
        &self,
        key: BlockKey,
        slot: u32,
        tier: Tier,
        left: impl FnOnce(SpanRef),
    ) -> bool {
        let Some(mut shard) = self.write(key.0) else {
            return false;
        };
        match shard.remove(key.0, slot, tier.index() as u8, true) {
            Some((_, span)) => {
                left(span);
                true
            }
            None => false,
        }
    }

    /// The span of (slot, tier) on `key`, when it holds it.
    pub(crate) fn span_of(&self, key: BlockKey, slot: u32, tier: Tier) -> Option<SpanRef> {
        self.read(shard_of(key.0))
            .and_then(|shard| shard.span_of(key.0, slot, tier.index() as u8))
    }

    /// References of (slot, tier) on `key` (0 when not a holder).
    pub(crate) fn tier_refs(&self, key: BlockKey, slot: u32, tier: Tier) -> u16 {
        self.read(shard_of(key.0))
            .map_or(0, |shard| shard.tier_refs(key.0, slot, tier.index() as u8))
    }

    /// Whether `slot` holds `key` in any tier.
    pub(crate) fn holds(&self, key: BlockKey, slot: u32) -> bool {
        self.read(shard_of(key.0))
            .is_some_and(|shard| shard.holds(key.0, slot))
    }

    /// A reader for a walk over `blocks` keys: all shards' guards for long walks, one key's
    /// shard at a time for short ones.
    pub(crate) fn reader(&self, blocks: usize) -> BlockMapReader<'_> {
        if blocks < SHARDS {
            return BlockMapReader::PerKey(self);
        }
        BlockMapReader::Held((0..SHARDS).filter_map(|s| self.read(s)).collect())
    }

    /// Distinct blocks.
    pub(crate) fn len(&self) -> usize {
        (0..SHARDS)
            .filter_map(|s| self.read(s))
            .map(|shard| shard.blocks.len())
            .sum()
    }

    /// Bytes of the tables (at their capacity) and of the further-holder lists.
    pub(crate) fn memory_bytes(&self) -> usize {
        (0..SHARDS)
            .filter_map(|s| self.read(s))
            .map(|shard| shard.memory_bytes())
            .sum()
    }
}

/// Read access for one walk over many keys.
pub(crate) enum BlockMapReader<'a> {
    /// Lock each key's shard while reading it.
    PerKey(&'a BlockMap),
    /// Every shard's read guard, in shard order.
    Held(Vec<RwLockReadGuard<'a, Shard>>),
}

impl BlockMapReader<'_> {
    #[cfg(test)]
    /// Calls `visit` for each holder of `key`; false when it has none.
    #[inline]
    pub(crate) fn visit(&self, key: BlockKey, visit: impl FnMut(Holder)) -> bool {
        let shard = shard_of(key.0);
        match self {
            BlockMapReader::PerKey(map) => map
                .read(shard)
                .is_some_and(|guard| guard.visit(key.0, visit)),
            BlockMapReader::Held(guards) => guards
                .get(shard)
                .is_some_and(|guard| guard.visit(key.0, visit)),
        }
    }

    /// Whether `slot` holds `key` in any tier.
    pub(crate) fn holds(&self, key: BlockKey, slot: u32) -> bool {
        let shard = shard_of(key.0);
        match self {
            BlockMapReader::PerKey(map) => map.holds(key, slot),
            BlockMapReader::Held(guards) => guards
                .get(shard)
                .is_some_and(|guard| guard.holds(key.0, slot)),
        }
    }

    /// Who holds `key` (several holders: per-tier bits in `scratch`, see [`HeldBy`]).
    #[inline]
    pub(crate) fn held_by(&self, key: BlockKey, scratch: &mut [u64]) -> HeldBy {
        let shard = shard_of(key.0);
        let held = match self {
            BlockMapReader::PerKey(map) => {
                map.read(shard).map(|guard| guard.held_by(key.0, scratch))
            }
            BlockMapReader::Held(guards) => {
                guards.get(shard).map(|guard| guard.held_by(key.0, scratch))
            }
        };
        held.unwrap_or(HeldBy::Nobody)
    }

    /// Calls `visit` with (slot, span) of each holder of `key` in the GPU tier.
    #[inline]
    pub(crate) fn gpu_spans(&self, key: BlockKey, mut visit: impl FnMut(u32, SpanRef)) {
        let gpu = Tier::Gpu.index() as u8;
        let mut each = |h: Holder| {
            if h.tier == gpu {
                visit(h.slot, h.span);
            }
        };
        let shard = shard_of(key.0);
        match self {
            BlockMapReader::PerKey(map) => {
                if let Some(guard) = map.read(shard) {
                    guard.visit(key.0, &mut each);
                }
            }
            BlockMapReader::Held(guards) => {
                if let Some(guard) = guards.get(shard) {
                    guard.visit(key.0, &mut each);
                }
            }
        }
    }

    /// A checksum over what a walk will read for `keys` (entries, further holders' bits);
    /// with held guards only (a per-key reader returns 0 without looking). Used to bring a
    /// group of keys' memory into cache at once: the reads are independent, so their cache
    /// misses overlap.
    pub(crate) fn probe(&self, keys: &[BlockKey]) -> u64 {
        let BlockMapReader::Held(guards) = self else {
            return 0;
        };
        let mut sum = 0u64;
        for key in keys {
            let Some(shard) = guards.get(shard_of(key.0)) else {
                continue;
            };
            let Some(entry) = shard.find(key.0) else {
                continue;
            };
            sum = sum.wrapping_add(entry.first);
            if entry.more()
                && let Some(more) = shard.more.get(&key.0)
            {
                sum = sum.wrapping_add(more.bits.first().copied().unwrap_or(0));
            }
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holders(map: &BlockMap, key: BlockKey) -> Vec<(u32, u16, u8)> {
        let mut out = Vec::new();
        map.reader(1)
            .visit(key, |h| out.push((h.slot, h.refs, h.tier)));
        out.sort();
        out
    }

    #[test]
    fn holders_count_references_move_inline_and_leave_with_the_last() {
        assert_eq!(std::mem::size_of::<Entry>(), 16);
        let map = BlockMap::default();
        let key = BlockKey(0xfeed_beef_1234_5678);
        let span = |id| SpanRef { id, offset: 7 };
        assert_eq!(map.add(key, 1, Tier::Gpu, span(1)), (1, span(1)));
        assert_eq!(map.add(key, 2, Tier::Gpu, span(2)), (1, span(2)));
        assert_eq!(map.add(key, 1, Tier::Cpu, span(3)), (1, span(3)));
        // A further reference keeps the holder's span.
        assert_eq!(map.add(key, 1, Tier::Gpu, span(9)), (2, span(1)));
        assert_eq!(map.add(key, 2, Tier::Gpu, SpanRef::NONE), (2, span(2)));
        assert_eq!(map.span_of(key, 1, Tier::Cpu), Some(span(3)));
        assert_eq!(map.span_of(key, 3, Tier::Cpu), None);
        assert_eq!(holders(&map, key), vec![(1, 1, 1), (1, 2, 0), (2, 2, 0)]);
        assert_eq!(map.tier_refs(key, 2, Tier::Gpu), 2);
        let mut left = Vec::new();
        assert_eq!(map.remove(key, 1, Tier::Gpu, |s| left.push(s)), Some(1));
        assert!(left.is_empty(), "a reference is left");
        assert_eq!(map.remove(key, 1, Tier::Gpu, |s| left.push(s)), Some(0)); // another moves inline
        assert_eq!(left, vec![span(1)]);
        assert_eq!(holders(&map, key), vec![(1, 1, 1), (2, 2, 0)]);
        assert_eq!(map.remove(key, 9, Tier::Gpu, |_| {}), None);
        let mut gpu = Vec::new();
        map.reader(1)
            .gpu_spans(key, |slot, span| gpu.push((slot, span)));
        assert_eq!(gpu, vec![(2, span(2))]);
        let mut left = Vec::new();
        assert!(
            map.remove_all(key, 2, Tier::Gpu, |s| left.push(s)),
            "both references at once"
        );
        assert_eq!(left, vec![span(2)]);
        assert!(!map.remove_all(key, 2, Tier::Gpu, |_| {}));
        assert_eq!(map.tier_refs(key, 2, Tier::Gpu), 0);
        assert!(map.holds(key, 1));
        assert!(!map.holds(key, 2));
        assert_eq!(map.len(), 1);
        assert_eq!(map.remove(key, 1, Tier::Cpu, |_| {}), Some(0));
        assert_eq!(map.len(), 0);
        assert!(holders(&map, key).is_empty());
        // The further-holder table is emptied with its block.
        assert!(map.shards.iter().all(|s| s.read().unwrap().more.is_empty()));
    }

    #[test]
    fn long_walks_hold_every_shard_and_read_the_same_answers() {
        let map = BlockMap::default();
        let keys: Vec<BlockKey> = (0..500u64)
            .map(|i| BlockKey(table_hash(i + 1).rotate_left(17)))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            map.add(*key, (i % 3) as u32, Tier::Gpu, SpanRef::NONE);
        }
        assert_eq!(map.len(), 500);
        let reader = map.reader(keys.len());
        assert!(matches!(reader, BlockMapReader::Held(ref g) if g.len() == SHARDS));
        for (i, key) in keys.iter().enumerate() {
            assert!(reader.holds(*key, (i % 3) as u32));
            assert!(!reader.holds(*key, 7));
        }
        assert!(!reader.visit(BlockKey(42), |_| {}));
    }

    #[test]
    fn bitsets_follow_every_add_and_remove() {
        // Random adds and removes over a few keys and slots spanning three words; after each
        // step the bits a walk reads equal the holders a visit lists.
        let map = BlockMap::default();
        let keys: Vec<BlockKey> = (1..=4u64).map(|i| BlockKey(table_hash(i))).collect();
        let tiers = [Tier::Gpu, Tier::Cpu, Tier::Other];
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..5_000 {
            let key = keys[rng.usize(..keys.len())];
            let slot = [0, 1, 2, 63, 64, 65, 129][rng.usize(..7)];
            let tier = tiers[rng.usize(..3)];
            match rng.u8(..4) {
                0 | 1 => {
                    map.add(key, slot, tier, SpanRef::NONE);
                }
                2 => {
                    map.remove(key, slot, tier, |_| {});
                }
                _ => {
                    map.remove_all(key, slot, tier, |_| {});
                }
            }
            let reader = map.reader(1);
            let mut want = vec![0u64; 3 * TIERS];
            let mut listed = Vec::new();
            reader.visit(key, |h| {
                want[h.slot as usize / 64 * TIERS + h.tier as usize] |= 1 << (h.slot % 64);
                listed.push(h);
            });
            let mut scratch = vec![u64::MAX; 3 * TIERS];
            match reader.held_by(key, &mut scratch) {
                HeldBy::Nobody => assert!(listed.is_empty()),
                HeldBy::One { slot, tier } => {
                    assert_eq!(listed.len(), 1);
                    assert_eq!((listed[0].slot, listed[0].tier), (slot, tier));
                }
                HeldBy::Many => {
                    assert!(listed.len() > 1);
                    assert_eq!(scratch, want);
                }
            }
        }
    }
}

#[cfg(test)]
mod packing {
    use super::*;

    #[test]
    fn holders_pack_into_one_word_and_back() {
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..1_000 {
            let holder = Holder {
                slot: rng.u32(..MAX_SLOTS),
                refs: rng.u16(..=MAX_REFS),
                tier: rng.u8(..3),
                span: SpanRef {
                    id: rng.u32(..1 << SPAN_BITS),
                    offset: rng.u16(..),
                },
            };
            let more = rng.bool();
            let word = holder.pack(more);
            assert_eq!(Holder::unpack(word), holder);
            let entry = Entry {
                key: 1,
                first: word,
            };
            assert_eq!(entry.more(), more);
        }
        assert_eq!(std::mem::size_of::<Entry>(), 16);
    }
}
