//! Approximate prefix matching for prompts kvpick cannot tokenize exactly: the prompt text is
//! cut into fixed-size character chunks, chained by hash, and each endpoint remembers (in a
//! bounded LRU) the chunks of the requests kvpick routed to it — GIE's approximate
//! prefix-cache scorer. The precise index works on token ids only, hence this store.
//!
//! Concurrency rules: one mutex over the whole store; a match or a record holds it for one
//! walk over at most `max_chunks` chunks. NOTE: a single lock is simpler than sharding and the
//! walks are short (≤ 256 hash lookups); approximate prompts are the fallback path.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::endpoints::PodId;

/// Chained hashes of a text's leading full chunks.
pub fn chunk_hashes(seed: u64, text: &str, chunk_chars: usize, max_chunks: usize) -> Vec<u64> {
    let mut out = Vec::new();
    if chunk_chars == 0 {
        return out;
    }
    let mut previous = seed;
    let mut start = 0;
    let mut count = 0;
    for (i, _) in text.char_indices() {
        if count == chunk_chars {
            if out.len() >= max_chunks {
                return out;
            }
            let chunk = text.get(start..i).unwrap_or_default();
            previous = xxh3_64_with_seed(chunk.as_bytes(), previous);
            out.push(previous);
            start = i;
            count = 0;
        }
        count += 1;
    }
    if count == chunk_chars && out.len() < max_chunks {
        let chunk = text.get(start..).unwrap_or_default();
        out.push(xxh3_64_with_seed(chunk.as_bytes(), previous));
    }
    out
}

#[derive(Default)]
struct PodChunks {
    tick_of: HashMap<u64, u64>,
    by_tick: BTreeMap<u64, u64>,
    last_used: u64,
}

/// Per endpoint LRU sets of chunk hashes, with a reverse map for one-pass matching.
pub struct ApproxPrefixStore {
    capacity_per_pod: usize,
    max_pods: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    pods: HashMap<PodId, PodChunks>,
    holders: HashMap<u64, Vec<PodId>>,
    tick: u64,
}

impl ApproxPrefixStore {
    /// A store remembering `capacity_per_pod` chunks for at most `max_pods` endpoints.
    pub fn new(capacity_per_pod: usize, max_pods: usize) -> Self {
        Self {
            capacity_per_pod: capacity_per_pod.max(1),
            max_pods: max_pods.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // NOTE: a poisoned lock leaves a consistent-enough cache; keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Per candidate, how many leading `chunks` it holds.
    pub fn match_chunks(&self, chunks: &[u64], candidates: &[PodId]) -> Vec<usize> {
        let mut run = vec![0usize; candidates.len()];
        let inner = self.lock();
        for (i, chunk) in chunks.iter().enumerate() {
            let Some(holders) = inner.holders.get(chunk) else {
                break;
            };
            let mut extended = false;
            for (p, pod) in candidates.iter().enumerate() {
                if let Some(r) = run.get_mut(p)
                    && *r == i
                    && holders.contains(pod)
                {
                    *r = i + 1;
                    extended = true;
                }
            }
            if !extended {
                break;
            }
        }
        run
    }

    /// Records that a request with these chunks was routed to `pod`.
    pub fn record(&self, pod: PodId, chunks: &[u64]) {
        if chunks.is_empty() {
            return;
        }
        let mut guard = self.lock();
        let inner = &mut *guard;
        if !inner.pods.contains_key(&pod) && inner.pods.len() >= self.max_pods {
            // Forget the endpoint used least recently (pods that left the pool age out).
            if let Some(oldest) = inner
                .pods
                .iter()
                .min_by_key(|(_, c)| c.last_used)
                .map(|(p, _)| *p)
                && let Some(chunks) = inner.pods.remove(&oldest)
            {
                for hash in chunks.tick_of.keys() {
                    unhold(&mut inner.holders, *hash, oldest);
                }
            }
        }
        let entry = inner.pods.entry(pod).or_default();
        // Last to first, so the first chunks are the most recent (evicted last).
        for hash in chunks.iter().rev() {
            inner.tick += 1;
            let tick = inner.tick;
            match entry.tick_of.insert(*hash, tick) {
                Some(old) => {
                    entry.by_tick.remove(&old);
                }
                None => inner.holders.entry(*hash).or_default().push(pod),
            }
            entry.by_tick.insert(tick, *hash);
        }
        entry.last_used = inner.tick;
        while entry.tick_of.len() > self.capacity_per_pod {
            let Some((_, hash)) = entry.by_tick.pop_first() else {
                break;
            };
            entry.tick_of.remove(&hash);
            unhold(&mut inner.holders, hash, pod);
        }
    }

    /// Chunks remembered for `pod`.
    pub fn pod_chunks(&self, pod: PodId) -> usize {
        self.lock().pods.get(&pod).map_or(0, |c| c.tick_of.len())
    }

    /// Distinct chunks remembered over all endpoints.
    pub fn distinct_chunks(&self) -> usize {
        self.lock().holders.len()
    }
}

fn unhold(holders: &mut HashMap<u64, Vec<PodId>>, hash: u64, pod: PodId) {
    if let Some(list) = holders.get_mut(&hash) {
        list.retain(|p| *p != pod);
        if list.is_empty() {
            holders.remove(&hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(i: u8) -> PodId {
        format!("10.0.0.{i}:80").parse().expect("pod")
    }

    #[test]
    fn chunks_are_chained_and_partial_tail_dropped() {
        let a = chunk_hashes(1, "abcdefgh", 4, 10);
        let b = chunk_hashes(1, "abcdefghij", 4, 10);
        assert_eq!(a.len(), 2);
        assert_eq!(a, b, "a partial tail chunk has no hash");
        let c = chunk_hashes(1, "XbcdefghXXXX", 4, 10);
        assert_ne!(a[1], c[1], "a change in chunk 0 changes every later hash");
        assert_eq!(chunk_hashes(1, "abcdefghijkl", 4, 2).len(), 2, "capped");
        assert_ne!(a, chunk_hashes(2, "abcdefgh", 4, 10), "seeded by model");
        assert_eq!(chunk_hashes(1, "äöüß", 2, 10).len(), 2, "counts characters");
    }

    #[test]
    fn matches_leading_runs_per_pod() {
        let store = ApproxPrefixStore::new(100, 8);
        let long = chunk_hashes(0, &"x".repeat(40), 4, 100);
        store.record(pod(1), &long);
        store.record(pod(2), &long[..3]);
        let runs = store.match_chunks(&long, &[pod(1), pod(2), pod(3)]);
        assert_eq!(runs, vec![10, 3, 0]);
    }

    #[test]
    fn lru_bounds_chunks_per_pod_and_pods() {
        let store = ApproxPrefixStore::new(4, 2);
        let first = chunk_hashes(0, &"a".repeat(16), 4, 100);
        let second = chunk_hashes(0, &"b".repeat(16), 4, 100);
        store.record(pod(1), &first);
        store.record(pod(1), &second[..2]);
        assert_eq!(store.pod_chunks(pod(1)), 4);
        // The tail of the first request went first; its head is still matched.
        assert_eq!(store.match_chunks(&first, &[pod(1)]), vec![2]);
        store.record(pod(2), &first);
        store.record(pod(3), &first);
        assert_eq!(
            store.pod_chunks(pod(1)),
            0,
            "least recently used pod forgotten"
        );
        assert!(store.distinct_chunks() <= 8);
    }
}
