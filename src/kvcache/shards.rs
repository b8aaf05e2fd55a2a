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
    each_shard(shards, keys, shard_of, |shard, positions| {
        for &k in positions {
            if let Some(key) = keys.get(k) {
                visit(shard, k, *key);
            }
        }
    });
}

/// Keys a shard's batch reads ahead of writing them ([`write_by_shard_reading_ahead`]).
const BATCH_READ_AHEAD: usize = 16;

/// [`write_by_shard`], with each shard's keys taken [`BATCH_READ_AHEAD`] at a time: `read` is
/// called for every key of a batch before `visit` is called for any of them.
///
/// Why: a write to a large table waits on its entry's cache miss, and the write's own work
/// keeps the next key's miss from starting early. Plain lookups of a batch's keys have
/// nothing to wait for between them, so their misses overlap, and the writes then find their
/// entries in cache (the events' removals do the same in `apply`, 256 blocks ahead). `read`
/// returns whether the key is there; the count is kept (`black_box`) so that the lookups are
/// not optimised away.
///
/// NOTE: not limited to large tables as the events' read-ahead is: a record's batch is a few
/// hundred keys at most per shard, and a lookup that hits the CPU's caches costs ~10 ns.
pub(crate) fn write_by_shard_reading_ahead<T>(
    shards: &[RwLock<T>],
    keys: &[BlockKey],
    shard_of: impl Fn(BlockKey) -> usize,
    read: impl Fn(&T, BlockKey) -> bool,
    mut visit: impl FnMut(&mut T, usize, BlockKey),
) {
    each_shard(shards, keys, shard_of, |shard, positions| {
        for batch in positions.chunks(BATCH_READ_AHEAD) {
            let held = batch
                .iter()
                .filter_map(|&k| keys.get(k))
                .filter(|key| read(shard, **key))
                .count();
            std::hint::black_box(held);
            for &k in batch {
                if let Some(key) = keys.get(k) {
                    visit(shard, k, *key);
                }
            }
        }
    });
}

/// Calls `visit` with each shard's write guard and the positions in `keys` of the keys it
/// holds (in `keys`' order), shard by shard, each shard locked once; shards with no key are
/// not locked.
fn each_shard<T>(
    shards: &[RwLock<T>],
    keys: &[BlockKey],
    shard_of: impl Fn(BlockKey) -> usize,
    mut visit: impl FnMut(&mut T, &[usize]),
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
        visit(&mut shard, positions);
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

    #[test]
    fn a_batch_is_read_whole_before_any_of_it_is_written() {
        use std::cell::RefCell;
        let shards: Vec<RwLock<Vec<u64>>> = (0..2).map(|_| RwLock::default()).collect();
        // 40 keys: 20 per shard, so each shard has a full batch and a part of one.
        let keys: Vec<BlockKey> = (0..40u64).map(BlockKey).collect();
        let log = RefCell::new(Vec::new());
        write_by_shard_reading_ahead(
            &shards,
            &keys,
            |key| (key.0 % 2) as usize,
            |_, key| {
                log.borrow_mut().push(('r', key.0));
                true
            },
            |shard, k, key| {
                assert_eq!(keys[k], key);
                shard.push(key.0);
                log.borrow_mut().push(('w', key.0));
            },
        );
        let evens: Vec<u64> = (0..40).step_by(2).collect();
        let odds: Vec<u64> = (1..40).step_by(2).collect();
        let mut expected = Vec::new();
        for shard in [&evens, &odds] {
            for batch in shard.chunks(BATCH_READ_AHEAD) {
                expected.extend(batch.iter().map(|k| ('r', *k)));
                expected.extend(batch.iter().map(|k| ('w', *k)));
            }
        }
        assert_eq!(log.into_inner(), expected);
        let written: Vec<Vec<u64>> = shards
            .into_iter()
            .map(|s| s.into_inner().unwrap_or_default())
            .collect();
        assert_eq!(written, vec![evens, odds]);
    }
}
