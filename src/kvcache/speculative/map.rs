//! The speculative entries' map: `BlockKey → its speculative holders`, split in shards that
//! each sit behind their own `RwLock`.
//!
//! Why not a `DashMap` (what it was): a record of a cold prompt writes thousands of new keys,
//! and taking and releasing a shard's lock per key made each insert's cache miss wait for the
//! release (a locked instruction). Our own shards let a record lock each shard once for all its
//! keys ([`SpecMap::write_keys`], the block map's `add_run` does the same).
//!
//! Concurrency: one shard locked at a time, by every operation; a caller holds no lock of
//! the block map while it waits for one of these (the parent module's rules).

use std::collections::HashMap;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use smallvec::SmallVec;

use super::super::key::{BlockKey, PrehashedState};
use super::super::shards::write_by_shard;
use super::SpecEntry;

/// A block's holders, in place rather than on the heap: nearly every block has one (a record
/// of a cold prompt writes thousands, and an allocation each was half of its cost).
pub(super) type Holders = SmallVec<[SpecEntry; 1]>;

/// One shard's table.
pub(super) type Table = HashMap<BlockKey, Holders, PrehashedState>;

/// Number of shards (a power of two).
const SHARDS: usize = 32;
const SHARD_SHIFT: u32 = 64 - SHARDS.trailing_zeros();

/// A key's shard: its top bits. The table hashes the whole key (one multiply), and the
/// counting filter uses middle bits, so neither sees a shard's keys as alike.
#[inline]
fn shard_of(key: BlockKey) -> usize {
    (key.0 >> SHARD_SHIFT) as usize
}

/// The sharded map.
pub(super) struct SpecMap {
    shards: Box<[RwLock<Table>]>,
}

impl Default for SpecMap {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
        }
    }
}

impl SpecMap {
    fn shard(&self, key: BlockKey) -> Option<&RwLock<Table>> {
        self.shards.get(shard_of(key))
    }

    /// `key`'s shard, read-locked.
    // NOTE: a panic while a lock was held leaves a table incomplete, not unsafe to read;
    // keep serving rather than propagate the poison (here and below).
    pub(super) fn read(&self, key: BlockKey) -> Option<RwLockReadGuard<'_, Table>> {
        Some(self.shard(key)?.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// `key`'s shard, write-locked.
    pub(super) fn write(&self, key: BlockKey) -> Option<RwLockWriteGuard<'_, Table>> {
        Some(self.shard(key)?.write().unwrap_or_else(|e| e.into_inner()))
    }

    /// Calls `visit` with each key's holders (inserted empty when absent), its position in
    /// `keys` and the key: shard by shard, each locked once, in `keys`' order within a shard.
    pub(super) fn write_keys(
        &self,
        keys: &[BlockKey],
        mut visit: impl FnMut(&mut Holders, usize, BlockKey),
    ) {
        write_by_shard(&self.shards, keys, shard_of, |table, k, key| {
            visit(table.entry(key).or_default(), k, key);
        });
    }

    /// Calls `visit` with the shard table of each key of `keys` and the key: shard by shard,
    /// each locked once, in `keys`' order within a shard.
    pub(super) fn write_tables(
        &self,
        keys: &[BlockKey],
        mut visit: impl FnMut(&mut Table, BlockKey),
    ) {
        write_by_shard(&self.shards, keys, shard_of, |table, _, key| {
            visit(table, key)
        });
    }

    /// Keeps the holders `keep` says to keep (it sees each key's list and trims it); a key
    /// whose list ends up empty leaves. One shard locked at a time.
    pub(super) fn retain(&self, mut keep: impl FnMut(&BlockKey, &mut Holders)) {
        for lock in &self.shards {
            let mut table = lock.write().unwrap_or_else(|e| e.into_inner());
            table.retain(|key, holders| {
                keep(key, holders);
                !holders.is_empty()
            });
        }
    }
}
