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
//! - A reader of one key ([`BlockMap::holds`], short walks) locks that key's shard only.
//! - A long walk ([`BlockMap::reader`] with many blocks) takes the read guards of **all** shards
//!   up front, in shard order, and keeps them for the walk: one lock operation per shard instead
//!   of two per block (half the cost of a 2,000-block match). Acquiring in one fixed order while
//!   writers hold at most one shard cannot deadlock, even with a writer-preferring lock. Writers
//!   wait at most one walk (tens of microseconds).

use std::collections::HashMap;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use hashbrown::HashTable;

use super::key::{BlockKey, PrehashedState};
use crate::kvevents::Tier;

/// Number of shards (a power of two).
pub(crate) const SHARDS: usize = 32;
const SHARD_SHIFT: u32 = 64 - SHARDS.trailing_zeros();

/// One (pod slot, tier) holding a block, with how many of the pod's engine hashes in that
/// tier map to it (usually 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) slot: u32,
    pub(crate) refs: u16,
    pub(crate) tier: u8,
}

/// A block with its first holder inline; `more` says whether `Shard::more` lists others.
#[derive(Clone, Copy, Debug)]
struct Entry {
    key: u64,
    slot: u32,
    refs: u16,
    tier: u8,
    more: bool,
}

impl Entry {
    fn holder(&self) -> Holder {
        Holder {
            slot: self.slot,
            refs: self.refs,
            tier: self.tier,
        }
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
    rest: Vec<Holder>,
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
        if entry.more
            && let Some(more) = self.more.get(&key)
        {
            more.rest.iter().copied().for_each(visit);
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
        if entry.more
            && let Some(more) = self.more.get(&key)
        {
            let stored = more.bits.len().min(scratch.len());
            let (head, tail) = scratch.split_at_mut(stored);
            head.copy_from_slice(more.bits.get(..stored).unwrap_or_default());
            tail.fill(0);
            return HeldBy::Many;
        }
        HeldBy::One {
            slot: entry.slot,
            tier: entry.tier,
        }
    }

    fn holds(&self, key: u64, slot: u32) -> bool {
        let mut held = false;
        self.visit(key, |h| held |= h.slot == slot);
        held
    }

    /// Adds one reference; returns the holder's references after it (1 = a new holder).
    fn add(&mut self, key: u64, slot: u32, tier: u8) -> u16 {
        let hash = table_hash(key);
        let Some(entry) = self.blocks.find_mut(hash, |e| e.key == key) else {
            self.blocks.insert_unique(
                hash,
                Entry {
                    key,
                    slot,
                    refs: 1,
                    tier,
                    more: false,
                },
                |e| table_hash(e.key),
            );
            return 1;
        };
        if entry.slot == slot && entry.tier == tier {
            entry.refs = entry.refs.saturating_add(1);
            return entry.refs;
        }
        let first = entry.holder();
        let was_single = !entry.more;
        entry.more = true;
        let more = self.more.entry(key).or_default();
        if was_single {
            more.rest.clear();
            more.bits.clear();
            more.set_bit(first.slot, first.tier, true);
        }
        match more
            .rest
            .iter_mut()
            .find(|h| h.slot == slot && h.tier == tier)
        {
            Some(holder) => {
                holder.refs = holder.refs.saturating_add(1);
                holder.refs
            }
            None => {
                more.rest.push(Holder {
                    slot,
                    refs: 1,
                    tier,
                });
                more.set_bit(slot, tier, true);
                1
            }
        }
    }

    /// References of (slot, tier) on `key` (0 when not a holder).
    fn tier_refs(&self, key: u64, slot: u32, tier: u8) -> u16 {
        let mut refs = 0;
        self.visit(key, |h| {
            if h.slot == slot && h.tier == tier {
                refs = h.refs;
            }
        });
        refs
    }

    /// Drops one reference (or all of them with `all`); returns the references left, or
    /// `None` when (slot, tier) did not hold `key`.
    fn remove(&mut self, key: u64, slot: u32, tier: u8, all: bool) -> Option<u16> {
        let hash = table_hash(key);
        let Ok(mut occupied) = self.blocks.find_entry(hash, |e| e.key == key) else {
            return None;
        };
        let entry = occupied.get_mut();
        if entry.slot == slot && entry.tier == tier {
            entry.refs = if all { 0 } else { entry.refs.saturating_sub(1) };
            if entry.refs > 0 {
                return Some(entry.refs);
            }
            // The inline holder is gone: another one moves inline, or the block leaves.
            let next = if entry.more {
                self.more.get_mut(&key).and_then(|more| more.rest.pop())
            } else {
                None
            };
            match next {
                Some(next) => {
                    entry.slot = next.slot;
                    entry.refs = next.refs;
                    entry.tier = next.tier;
                }
                None => {
                    occupied.remove();
                    self.more.remove(&key);
                    return Some(0);
                }
            }
        } else {
            let rest = &mut self.more.get_mut(&key)?.rest;
            let position = rest.iter().position(|h| h.slot == slot && h.tier == tier)?;
            if let Some(holder) = rest.get_mut(position) {
                holder.refs = if all {
                    0
                } else {
                    holder.refs.saturating_sub(1)
                };
                if holder.refs > 0 {
                    return Some(holder.refs);
                }
            }
            rest.swap_remove(position);
        }
        if self.more.get(&key).is_some_and(|more| more.rest.is_empty()) {
            self.more.remove(&key);
            occupied.get_mut().more = false;
        } else if let Some(more) = self.more.get_mut(&key) {
            more.set_bit(slot, tier, false);
        }
        Some(0)
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
                    more.rest.capacity() * std::mem::size_of::<Holder>()
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
    /// new holder).
    pub(crate) fn add(&self, key: BlockKey, slot: u32, tier: Tier) -> u16 {
        self.write(key.0)
            .map_or(0, |mut shard| shard.add(key.0, slot, tier.index() as u8))
    }

    /// Drops one reference of (slot, tier) from `key` (the block leaves with its last holder);
    /// returns the references left, `None` when (slot, tier) did not hold it.
    pub(crate) fn remove(&self, key: BlockKey, slot: u32, tier: Tier) -> Option<u16> {
        self.write(key.0)?
            .remove(key.0, slot, tier.index() as u8, false)
    }

    /// Drops (slot, tier) from `key` whatever its references; false when it was no holder.
    pub(crate) fn remove_all(&self, key: BlockKey, slot: u32, tier: Tier) -> bool {
        self.write(key.0)
            .and_then(|mut shard| shard.remove(key.0, slot, tier.index() as u8, true))
            .is_some()
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
            sum = sum.wrapping_add(u64::from(entry.slot));
            if entry.more
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
        assert_eq!(map.add(key, 1, Tier::Gpu), 1);
        assert_eq!(map.add(key, 2, Tier::Gpu), 1);
        assert_eq!(map.add(key, 1, Tier::Cpu), 1);
        assert_eq!(map.add(key, 1, Tier::Gpu), 2);
        assert_eq!(map.add(key, 2, Tier::Gpu), 2);
        assert_eq!(holders(&map, key), vec![(1, 1, 1), (1, 2, 0), (2, 2, 0)]);
        assert_eq!(map.tier_refs(key, 2, Tier::Gpu), 2);
        assert_eq!(map.remove(key, 1, Tier::Gpu), Some(1));
        assert_eq!(map.remove(key, 1, Tier::Gpu), Some(0)); // another holder moves inline
        assert_eq!(holders(&map, key), vec![(1, 1, 1), (2, 2, 0)]);
        assert_eq!(map.remove(key, 9, Tier::Gpu), None);
        assert!(map.remove_all(key, 2, Tier::Gpu), "both references at once");
        assert!(!map.remove_all(key, 2, Tier::Gpu));
        assert_eq!(map.tier_refs(key, 2, Tier::Gpu), 0);
        assert!(map.holds(key, 1));
        assert!(!map.holds(key, 2));
        assert_eq!(map.len(), 1);
        assert_eq!(map.remove(key, 1, Tier::Cpu), Some(0));
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
            map.add(*key, (i % 3) as u32, Tier::Gpu);
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
                    map.add(key, slot, tier);
                }
                2 => {
                    map.remove(key, slot, tier);
                }
                _ => {
                    map.remove_all(key, slot, tier);
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
