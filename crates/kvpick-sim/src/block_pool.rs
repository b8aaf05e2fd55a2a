//! The paged KV cache: a fixed pool of blocks, a prefix cache keyed by block digest, and an LRU
//! free queue, modelled on vLLM v1's `BlockPool` / `FreeKVCacheBlockQueue`.
//!
//! Why this shape: routing quality depends on *which* blocks survive, so eviction must follow
//! vLLM's rules, not a generic LRU over hashes:
//! - block 0 is the null block and is never handed out (vLLM reserves it), so
//!   `num_gpu_blocks - 1` blocks are usable;
//! - a block with `ref_cnt > 0` belongs to a running request and is pinned;
//! - freed blocks that hold a cached digest join the tail of the free queue, freed blocks that
//!   do not (a request's partial last block) go to its head, so they are reused before any
//!   cached content is evicted; allocation takes from the head; if the head block holds a cached
//!   digest it is evicted then (a `BlockRemoved`). The head rule is what makes the replay of the
//!   real capture evict exactly the same blocks in the same order (`tests/sim_fidelity.rs`);
//!   with plain tail insertion the simulator evicted 245 blocks where vLLM evicted 241;
//! - a cache hit on a free block takes it out of the free queue (it becomes pinned again);
//! - the same digest may live in several physical blocks (vLLM does not deduplicate).
//!
//! Owned by one engine; no interior mutability, no locking.

use std::collections::{BTreeMap, HashMap};

use super::hashing::BlockDigest;

/// Index of a physical block.
pub type BlockId = usize;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    digest: Option<BlockDigest>,
    /// Position in the free queue, when free.
    free_stamp: Option<i64>,
}

/// The block pool.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Free queue: stamp order = LRU order (smallest stamp is evicted first).
    free: BTreeMap<i64, BlockId>,
    next_stamp: i64,
    front_stamp: i64,
    cached: HashMap<BlockDigest, Vec<BlockId>>,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (one of them the null block).
    pub fn new(num_gpu_blocks: usize) -> Self {
        let total = num_gpu_blocks.max(2);
        let mut pool = Self {
            blocks: vec![Block::default(); total],
            free: BTreeMap::new(),
            next_stamp: 0,
            front_stamp: 0,
            cached: HashMap::new(),
        };
        for id in 1..total {
            pool.push_free(id);
        }
        pool
    }

    fn push_free(&mut self, id: BlockId) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.free.insert(stamp, id);
        if let Some(block) = self.blocks.get_mut(id) {
            block.free_stamp = Some(stamp);
        }
    }

    /// Usable blocks (all but the null block).
    pub fn capacity(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Blocks in the free queue (including free blocks that still hold cached content).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// vLLM's `kv_cache_usage_perc`: the share of usable blocks held by running requests.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free() as f64 / self.capacity() as f64
    }

    /// Number of distinct cached digests.
    pub fn cached_digests(&self) -> usize {
        self.cached.len()
    }

    /// A block currently caching `digest`, if any.
    pub fn lookup(&self, digest: &BlockDigest) -> Option<BlockId> {
        self.cached.get(digest).and_then(|ids| ids.first().copied())
    }

    /// Whether `id` is pinned by a running request.
    pub fn is_pinned(&self, id: BlockId) -> bool {
        self.blocks.get(id).is_some_and(|b| b.ref_cnt > 0)
    }

    /// Whether `id` is in the free queue (so `touch` would consume a free slot).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks.get(id).is_some_and(|b| b.free_stamp.is_some())
    }

    /// Takes a reference on a cached block (a prefix hit), pulling it out of the free queue.
    pub fn touch(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id) else {
            return;
        };
        if let Some(stamp) = block.free_stamp.take() {
            self.free.remove(&stamp);
        }
        block.ref_cnt += 1;
    }

    /// Allocates `n` blocks from the head of the free queue, all or nothing. Cached content of
    /// the blocks taken is evicted; the evicted digests are appended to `evicted` in order.
    pub fn allocate(&mut self, n: usize, evicted: &mut Vec<BlockDigest>) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.free.pop_first()?;
            if let Some(block) = self.blocks.get_mut(id) {
                block.free_stamp = None;
                block.ref_cnt = 1;
                if let Some(digest) = block.digest.take() {
                    if let Some(ids) = self.cached.get_mut(&digest) {
                        ids.retain(|&b| b != id);
                        if ids.is_empty() {
                            self.cached.remove(&digest);
                        }
                    }
                    evicted.push(digest);
                }
            }
            out.push(id);
        }
        Some(out)
    }

    /// Marks a full block as holding `digest` (it enters the prefix cache).
    pub fn cache(&mut self, id: BlockId, digest: BlockDigest) {
        if let Some(block) = self.blocks.get_mut(id) {
            if block.digest.is_some() {
                return;
            }
            block.digest = Some(digest);
            self.cached.entry(digest).or_default().push(id);
        }
    }

    /// Drops one reference from each block, in the order given; blocks reaching zero join the
    /// free queue's tail (so the first ones given are evicted first), or its head when they
    /// hold no cached content.
    pub fn release(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let Some(block) = self.blocks.get_mut(id) else {
                continue;
            };
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 && block.free_stamp.is_none() {
                if block.digest.is_none() {
                    self.front_stamp -= 1;
                    let stamp = self.front_stamp;
                    block.free_stamp = Some(stamp);
                    self.free.insert(stamp, id);
                    continue;
                }
                self.push_free(id);
            }
        }
    }

    /// Forgets all cached content (vLLM `reset_prefix_cache`); succeeds only when no block is
    /// pinned, like vLLM.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.blocks.iter().any(|b| b.ref_cnt > 0) {
            return false;
        }
        for block in &mut self.blocks {
            block.digest = None;
        }
        self.cached.clear();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> BlockDigest {
        [n; 32]
    }

    #[test]
    fn lru_eviction_takes_the_oldest_freed_block_first() {
        let mut pool = BlockPool::new(4); // 3 usable
        let mut ev = Vec::new();
        let ids = pool.allocate(3, &mut ev).expect("fits");
        for (i, &id) in ids.iter().enumerate() {
            pool.cache(id, d(i as u8));
        }
        pool.release(ids.iter().rev().copied());
        assert_eq!(pool.usage(), 0.0);
        assert_eq!(pool.cached_digests(), 3);
        // A hit on digest 0 pins it; the next allocation evicts digest 2 (freed first).
        let hit = pool.lookup(&d(0)).expect("cached");
        pool.touch(hit);
        assert!(
            pool.allocate(3, &mut ev).is_none(),
            "pinned block is not allocatable"
        );
        pool.allocate(1, &mut ev).expect("one free");
        assert_eq!(ev, vec![d(2)]);
        assert!(pool.lookup(&d(0)).is_some());
    }

    #[test]
    fn unhashed_freed_blocks_are_reused_before_cached_ones_are_evicted() {
        let mut pool = BlockPool::new(4); // 3 usable
        let mut ev = Vec::new();
        let ids = pool.allocate(3, &mut ev).expect("fits");
        pool.cache(ids[0], d(1));
        pool.cache(ids[1], d(2));
        // ids[2] is a partial block: no digest.
        pool.release(ids.iter().rev().copied());
        let again = pool.allocate(1, &mut ev).expect("one");
        assert_eq!(again, vec![ids[2]]);
        assert!(
            ev.is_empty(),
            "no cached block evicted while an empty one was free"
        );
        pool.allocate(1, &mut ev).expect("one");
        assert_eq!(ev, vec![d(2)]);
    }
}
