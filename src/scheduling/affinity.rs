//! Stateful scorers that remember past picks: session affinity (a session's requests go back
//! to the endpoint that served it, where its conversation is cached) and no-hit-LRU (requests
//! whose prefix is cached nowhere are spread over the endpoints that got a cold prefix least
//! recently, so new prefixes land on different endpoints instead of piling on one).
//!
//! Concurrency rules: each keeps one mutex-guarded bounded LRU map, held only for a lookup or
//! one update; the pick itself runs outside the lock. Two concurrent picks may both read the
//! state before either records — harmless for scores.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::Mutex;

use crate::endpoints::PodId;

/// A bounded map with least-recently-used eviction.
#[derive(Debug)]
struct LruMap<K: Hash + Eq + Clone, V> {
    entries: HashMap<K, (V, u64)>,
    by_tick: BTreeMap<u64, K>,
    tick: u64,
    capacity: usize,
}

impl<K: Hash + Eq + Clone, V> LruMap<K, V> {
    fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            by_tick: BTreeMap::new(),
            tick: 0,
            capacity: capacity.max(1),
        }
    }

    fn insert(&mut self, key: K, value: V) {
        self.tick += 1;
        if let Some((_, old)) = self.entries.insert(key.clone(), (value, self.tick)) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.tick, key);
        while self.entries.len() > self.capacity {
            let Some((_, oldest)) = self.by_tick.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
        }
    }

    fn get(&self, key: &K) -> Option<(&V, u64)> {
        self.entries.get(key).map(|(v, t)| (v, *t))
    }
}

/// Session id → the endpoint that served the session last.
///
/// Sessions are keyed by a 64-bit hash of the id, so memory is bounded by the session count
/// whatever the header sizes clients send.
#[derive(Debug)]
pub struct SessionAffinity {
    sessions: Mutex<LruMap<u64, PodId>>,
}

fn session_key(session: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(session.as_bytes())
}

impl SessionAffinity {
    /// Remembers at most `max_sessions` sessions.
    pub fn new(max_sessions: usize) -> Self {
        Self {
            sessions: Mutex::new(LruMap::new(max_sessions)),
        }
    }

    /// 1.0 for the session's last endpoint, 0 for the others (all 0 without a session).
    pub fn score(&self, session: Option<&str>, candidates: &[PodId], out: &mut [f64]) {
        let last = session.and_then(|s| {
            let map = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            map.get(&session_key(s)).map(|(pod, _)| *pod)
        });
        for (slot, pod) in out.iter_mut().zip(candidates) {
            *slot = if Some(*pod) == last { 1.0 } else { 0.0 };
        }
    }

    /// Records that `session` was sent to `pod`.
    pub fn record(&self, session: Option<&str>, pod: PodId) {
        if let Some(session) = session {
            let mut map = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            map.insert(session_key(session), pod);
        }
    }
}

/// Endpoint → when it last received a request with a cold prefix.
#[derive(Debug)]
pub struct NoHitLru {
    last_cold: Mutex<LruMap<PodId, ()>>,
}

impl NoHitLru {
    /// Remembers at most `max_endpoints` endpoints.
    pub fn new(max_endpoints: usize) -> Self {
        Self {
            last_cold: Mutex::new(LruMap::new(max_endpoints)),
        }
    }

    /// With a cache hit anywhere (`hit`): 0.5 for all (neutral). Otherwise endpoints never
    /// given a cold prefix score 1.0 and the rest are ranked by recency: the least recent 1.0
    /// … the most recent 0.0.
    pub fn score(&self, hit: bool, candidates: &[PodId], out: &mut [f64]) {
        if hit {
            out.iter_mut().for_each(|s| *s = 0.5);
            return;
        }
        let map = self.last_cold.lock().unwrap_or_else(|e| e.into_inner());
        let ticks: Vec<Option<u64>> = candidates
            .iter()
            .map(|p| map.get(p).map(|(_, t)| t))
            .collect();
        drop(map);
        let mut used: Vec<u64> = ticks.iter().flatten().copied().collect();
        used.sort_unstable();
        let n = used.len();
        for (slot, tick) in out.iter_mut().zip(&ticks) {
            *slot = match tick {
                None => 1.0,
                Some(_) if n <= 1 => 0.0,
                Some(t) => {
                    let rank = used.partition_point(|u| u < t);
                    1.0 - rank as f64 / (n - 1) as f64
                }
            };
        }
    }

    /// Records that a cold request went to `pod` (no-op when the request hit a cache).
    pub fn record(&self, hit: bool, pod: PodId) {
        if !hit {
            let mut map = self.last_cold.lock().unwrap_or_else(|e| e.into_inner());
            map.insert(pod, ());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods(n: u8) -> Vec<PodId> {
        (1..=n)
            .map(|i| format!("10.0.0.{i}:80").parse().expect("pod"))
            .collect()
    }

    #[test]
    fn session_goes_back_to_its_pod_and_is_bounded() {
        let p = pods(3);
        let s = SessionAffinity::new(2);
        let mut out = vec![9.0; 3];
        s.score(Some("a"), &p, &mut out);
        assert_eq!(out, vec![0.0; 3], "unknown session is neutral");
        s.record(Some("a"), p[1]);
        s.score(Some("a"), &p, &mut out);
        assert_eq!(out, vec![0.0, 1.0, 0.0]);
        s.score(None, &p, &mut out);
        assert_eq!(out, vec![0.0; 3], "no session id, no affinity");
        s.record(Some("b"), p[0]);
        s.record(Some("c"), p[2]);
        s.score(Some("a"), &p, &mut out);
        assert_eq!(out, vec![0.0; 3], "oldest session evicted beyond capacity");
    }

    #[test]
    fn cold_prefixes_rotate_over_pods() {
        let p = pods(3);
        let lru = NoHitLru::new(16);
        let mut out = vec![0.0; 3];
        lru.record(false, p[0]);
        lru.record(false, p[1]);
        lru.score(false, &p, &mut out);
        assert_eq!(
            out,
            vec![1.0, 0.0, 1.0],
            "never used best, most recent worst"
        );
        lru.record(false, p[2]);
        lru.score(false, &p, &mut out);
        assert_eq!(out, vec![1.0, 0.5, 0.0]);
        lru.record(true, p[0]);
        lru.score(false, &p, &mut out);
        assert_eq!(out, vec![1.0, 0.5, 0.0], "a hit does not count as cold");
        lru.score(true, &p, &mut out);
        assert_eq!(out, vec![0.5; 3], "neutral on a hit");
    }
}
