//! Approximate holdings of a pod without KV events, learned from kvpick's own routing: every
//! request routed there is assumed cached, least recently used blocks first out when the pod's
//! capacity (in blocks) is exceeded.
//!
//! Why LRU and tail-first: vLLM evicts free blocks in LRU order and frees a request's blocks
//! tail first; touching a request's blocks from last to first makes its first blocks the most
//! recent, so the model forgets prefixes from the tail like the engine does.

use std::collections::{BTreeMap, HashMap};

use super::key::{BlockKey, PrehashedState};

/// A bounded LRU set of block keys.
#[derive(Default)]
pub(crate) struct LruBlocks {
    tick_of: HashMap<BlockKey, u64, PrehashedState>,
    by_tick: BTreeMap<u64, BlockKey>,
    next_tick: u64,
}

impl LruBlocks {
    /// Touches `keys` (last to first); returns the keys newly added and those evicted to stay
    /// within `capacity`.
    pub(crate) fn touch(
        &mut self,
        keys: &[BlockKey],
        capacity: usize,
    ) -> (Vec<BlockKey>, Vec<BlockKey>) {
        let mut added = Vec::new();
        for key in keys.iter().rev() {
            self.next_tick += 1;
            let tick = self.next_tick;
            match self.tick_of.insert(*key, tick) {
                Some(old) => {
                    self.by_tick.remove(&old);
                }
                None => added.push(*key),
            }
            self.by_tick.insert(tick, *key);
        }
        let mut evicted = Vec::new();
        while self.tick_of.len() > capacity {
            let Some((_, key)) = self.by_tick.pop_first() else {
                break;
            };
            self.tick_of.remove(&key);
            evicted.push(key);
        }
        (added, evicted)
    }

    /// Empties the set, returning its keys.
    pub(crate) fn drain(&mut self) -> Vec<BlockKey> {
        self.by_tick.clear();
        self.tick_of.drain().map(|(key, _)| key).collect()
    }
}
