//! Prefix homes: the pod kvpick last routed a prefix to, remembered after that pod has evicted
//! it.
//!
//! Why: with full caches a prefix is evicted between its requests, and the next one finds no
//! holder anywhere. Placed as if it were new (by load and by what it would evict), it lands on
//! whichever pod is a little less busy at that instant, so a group's requests wander over
//! the pods, every pod's cache sees every group, and each pod evicts more (measured on the
//! side-by-side smoke run: 1.6–2.0 pods per prefix and 12–25 moves in 160 requests, where
//! smg, which never forgets a prefix, keeps each on one pod). The home lets the placement
//! scorer tell a prefix that returns from one never seen, and keep the returning one where
//! it was unless another pod is clearly better (`crate::scheduling::placement`).
//!
//! What is remembered: for each routing record, the keys of the prompt's blocks at depths
//! 1, 2, 4, 8, … up to 4,096 (and its last block, within that), each mapped to the pod. A
//! lookup probes the same depths from the deepest down and answers the deepest one
//! remembered, so a home is found for any prompt that shares at least half of its keyed
//! blocks with one routed before (the chained keys make a key at depth d stand for the whole
//! prefix up to d). A record costs about log2(blocks) map writes.
//!
//! # Bounds and concurrency
//! Two generations of at most `capacity / 2` keys each: writes go to the current one; when it
//! is full it becomes the previous one and the old previous one is dropped whole. So memory
//! is bounded, and a home lives at least `capacity / 2` recorded keys. One mutex, held for a
//! few map operations: it is taken after the index's pod and shard locks are released, may be
//! taken while a request's key lock (`prompt_keys`) is held, and nothing is taken while it is
//! held.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::key::{BlockKey, PrehashedState};
use crate::endpoints::PodId;

/// Deepest block probed: a prompt longer than this is remembered by its first 4,096 blocks
/// (64 Ki tokens at 16 per block), so a lookup never keys more of a prompt than that.
const MAX_DEPTH: usize = 4096;

/// Where a prompt's prefix was last routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixHome {
    /// The pod it was routed to.
    pub pod: PodId,
    /// Leading blocks of this prompt that the remembered prefix covers.
    pub blocks: usize,
}

/// The prefix homes (see the module docs).
pub(crate) struct PrefixHomes {
    generations: Mutex<Generations>,
    /// Keys per generation (0: nothing is remembered).
    half: usize,
}

#[derive(Default)]
struct Generations {
    current: HashMap<BlockKey, PodId, PrehashedState>,
    previous: HashMap<BlockKey, PodId, PrehashedState>,
}

impl PrefixHomes {
    /// Homes for at most `capacity` keys (below 2: none are kept, and records cost nothing).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            generations: Mutex::new(Generations::default()),
            half: capacity / 2,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Generations> {
        // A panic while holding the lock leaves two valid maps: keep using them.
        self.generations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers that the prompt with these block keys was routed to `pod`.
    pub(crate) fn record(&self, pod: PodId, keys: &[BlockKey]) {
        if keys.is_empty() || self.half == 0 {
            return;
        }
        let mut generations = self.lock();
        for depth in depths(keys.len()) {
            if generations.current.len() >= self.half {
                generations.previous = std::mem::take(&mut generations.current);
            }
            generations.current.insert(keys[depth - 1], pod);
        }
    }

    /// The deepest remembered prefix of the prompt whose first keys `key_at` gives (`key_at(i)`
    /// is block `i`'s key; `total` blocks in all).
    pub(crate) fn find(
        &self,
        total: usize,
        mut key_at: impl FnMut(usize) -> Option<BlockKey>,
    ) -> Option<PrefixHome> {
        if total == 0 || self.half == 0 {
            return None;
        }
        let probes: Vec<(usize, BlockKey)> = depths(total)
            .rev()
            .filter_map(|depth| Some((depth, key_at(depth - 1)?)))
            .collect();
        let generations = self.lock();
        probes.into_iter().find_map(|(depth, key)| {
            let pod = generations
                .current
                .get(&key)
                .or_else(|| generations.previous.get(&key))?;
            Some(PrefixHome {
                pod: *pod,
                blocks: depth,
            })
        })
    }

    /// Keys remembered (both generations).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        let generations = self.lock();
        generations.current.len() + generations.previous.len()
    }
}

/// The depths (in blocks, 1-based) probed for a prompt of `total` blocks: powers of two up to
/// [`MAX_DEPTH`], then the prompt's last block when within it, ascending and without repeats.
fn depths(total: usize) -> impl DoubleEndedIterator<Item = usize> {
    let powers = (0..usize::BITS)
        .map(|k| 1usize << k)
        .take_while(move |d| *d <= total.min(MAX_DEPTH));
    let last = Some(total).filter(|t| *t > 0 && *t <= MAX_DEPTH && !t.is_power_of_two());
    powers.collect::<Vec<_>>().into_iter().chain(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(i: u8) -> PodId {
        PodId(std::net::SocketAddr::from(([10, 0, 0, i], 8000)))
    }

    fn keys(seed: u64, n: usize) -> Vec<BlockKey> {
        (0..n as u64).map(|i| BlockKey(seed << 32 | i)).collect()
    }

    #[test]
    fn depths_are_powers_of_two_then_the_last_block() {
        assert_eq!(depths(1).collect::<Vec<_>>(), [1]);
        assert_eq!(depths(8).collect::<Vec<_>>(), [1, 2, 4, 8]);
        assert_eq!(depths(34).collect::<Vec<_>>(), [1, 2, 4, 8, 16, 32, 34]);
        assert_eq!(depths(0).count(), 0);
        let long: Vec<_> = depths(10_000).collect();
        assert_eq!(long.last(), Some(&4096), "no deeper than MAX_DEPTH");
    }

    #[test]
    fn the_deepest_remembered_prefix_is_found() {
        let homes = PrefixHomes::new(1024);
        let a = keys(1, 34);
        homes.record(pod(1), &a);
        // The same prompt: its last block.
        let found = homes.find(34, |i| a.get(i).copied());
        assert_eq!(
            found,
            Some(PrefixHome {
                pod: pod(1),
                blocks: 34
            })
        );
        // A prompt sharing the first 20 blocks: the deepest shared probe is block 16.
        let mut b = a[..20].to_vec();
        b.extend(keys(2, 14));
        assert_eq!(
            homes.find(34, |i| b.get(i).copied()),
            Some(PrefixHome {
                pod: pod(1),
                blocks: 16
            })
        );
        // A later record of the shared part elsewhere moves the home of that part only.
        homes.record(pod(2), &a[..8]);
        assert_eq!(
            homes.find(34, |i| b.get(i).copied()),
            Some(PrefixHome {
                pod: pod(1),
                blocks: 16
            })
        );
        assert_eq!(
            homes.find(8, |i| a.get(i).copied()),
            Some(PrefixHome {
                pod: pod(2),
                blocks: 8
            })
        );
        // Nothing shared, or keys not available: no home.
        let c = keys(3, 34);
        assert_eq!(homes.find(34, |i| c.get(i).copied()), None);
        assert_eq!(homes.find(34, |_| None), None);
    }

    #[test]
    fn memory_is_bounded_and_recent_homes_survive() {
        let homes = PrefixHomes::new(64);
        for seed in 0..1000 {
            homes.record(pod((seed % 4) as u8), &keys(seed, 34));
        }
        assert!(homes.len() <= 64, "{}", homes.len());
        let last = keys(999, 34);
        assert_eq!(
            homes.find(34, |i| last.get(i).copied()).map(|h| h.pod),
            Some(pod(3))
        );
        let first = keys(0, 34);
        assert_eq!(homes.find(34, |i| first.get(i).copied()), None);
        // No capacity (no scorer reads homes): nothing is kept.
        let off = PrefixHomes::new(0);
        off.record(pod(1), &last);
        assert_eq!(off.len(), 0);
        assert_eq!(off.find(34, |i| last.get(i).copied()), None);
    }
}
