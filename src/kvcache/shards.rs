//! Writing many keys into a map split in locked shards, each shard locked once.
//!
//! Why: a write under its own lock pays the lock's release (a locked instruction) after the
//! write's store, which waits for that store's cache miss; a record of thousands of new blocks
//! then pays its misses one after the other. Grouped by shard, the stores to one shard overlap
//! and only one release per shard waits (see `BlockMap::add_run` for the measurement).

use std::sync::RwLock;

use super::key::BlockKey;

/// Calls `visit` with each shard's write guard, each key's position in `keys` and the key, for
/// every key of `keys`: shard by shard in shard order, each shard locked once for all its keys,
/// keys in `keys`' order within a shard. `shard_of` names a key's shard; keys it places beyond
/// the last shard are skipped. The caller holds no other lock of these shards (one shard is
/// held at a time).
pub(crate) fn write_by_shard<T>(
    shards: &[RwLock<T>],
    keys: &[BlockKey],
    shard_of: impl Fn(BlockKey) -> usize,
    mut visit: impl FnMut(&mut T, usize, BlockKey),
) {
    // A counting sort of the keys' positions by shard.
    let mut starts = vec![0usize; shards.len() + 1];
    for key in keys {
        if let Some(count) = starts.get_mut(shard_of(*key) + 1) {
            *count += 1;
        }
    }
    for s in 0..shards.len() {
        starts[s + 1] += starts[s];
    }
    let mut next = starts.clone();
    let mut order = vec![0usize; keys.len()];
    for (k, key) in keys.iter().enumerate() {
        if let Some(at) = next.get_mut(shard_of(*key))
            && let Some(place) = order.get_mut(*at)
        {
            *place = k;
            *at += 1;
        }
    }
    for (s, lock) in shards.iter().enumerate() {
        let Some(positions) = order.get(starts[s]..starts[s + 1]) else {
            continue;
        };
        if positions.is_empty() {
            continue;
        }
        // NOTE: a panic while holding the lock leaves a table incomplete, not unsafe; keep
        // serving rather than propagate the poison.
        let mut shard = lock.write().unwrap_or_else(|e| e.into_inner());
        for &k in positions {
            if let Some(key) = keys.get(k) {
                visit(&mut shard, k, *key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_visited_once_in_its_shard_in_order() {
        let shards: Vec<RwLock<Vec<(usize, u64)>>> = (0..4).map(|_| RwLock::default()).collect();
        // Shard = key % 5: keys in shard 4 are beyond the last shard and skipped.
        let keys: Vec<BlockKey> = [7u64, 3, 12, 8, 4, 2, 17, 9, 0].map(BlockKey).to_vec();
        let mut visited = Vec::new();
        write_by_shard(
            &shards,
            &keys,
            |key| (key.0 % 5) as usize,
            |shard, k, key| {
                shard.push((k, key.0));
                visited.push(k);
            },
        );
        let got: Vec<Vec<(usize, u64)>> = shards
            .into_iter()
            .map(|s| s.into_inner().unwrap_or_default())
            .collect();
        assert_eq!(got[0], vec![(8, 0)]);
        assert_eq!(got[1], vec![]);
        assert_eq!(got[2], vec![(0, 7), (2, 12), (5, 2), (6, 17)]);
        assert_eq!(got[3], vec![(1, 3), (3, 8)]);
        // Shard by shard; keys 4 and 9 (shard 4) never.
        assert_eq!(visited, vec![8, 0, 2, 5, 6, 1, 3]);
    }
}
