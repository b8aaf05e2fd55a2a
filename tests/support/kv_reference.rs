//! A naive model of what pods hold, for differential tests of the prefix index: references
//! per (engine hash, tier), and matching that walks a request block by block by content.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use std::net::SocketAddr;

use kvpick::endpoints::PodId;
use kvpick::kvevents::{EngineHash, EventBatch, KvEvent, Tier};

/// Test pod `i` (a loopback address; no socket is opened).
pub fn pod(i: usize) -> PodId {
    PodId(SocketAddr::from(([127, 0, 0, 1], 9000 + i as u16)))
}

/// Tier `0` is GPU, anything else CPU.
pub fn tier(i: u8) -> Tier {
    if i == 0 { Tier::Gpu } else { Tier::Cpu }
}

/// The engine's hash of a token prefix (any deterministic function of the content will do).
pub fn engine_hash(prefix: &[u32]) -> EngineHash {
    let mut hasher = DefaultHasher::new();
    prefix.hash(&mut hasher);
    EngineHash(hasher.finish())
}

/// One event as a batch.
pub fn batch(event: KvEvent) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events: vec![event],
        dp_rank: Some(0),
    }
}

/// Per pod, engine hash → references in tier 0 (GPU) and 1 (CPU).
pub struct Reference {
    pub refs: Vec<HashMap<EngineHash, [i64; 2]>>,
    block: usize,
}

impl Reference {
    /// `pods` pods holding nothing, blocks of `block` tokens.
    pub fn new(pods: usize, block: usize) -> Self {
        Self {
            refs: vec![HashMap::new(); pods],
            block,
        }
    }

    /// Whether `pod` holds `hash` in any tier.
    pub fn held_any(&self, pod: usize, hash: EngineHash) -> bool {
        self.refs[pod]
            .get(&hash)
            .is_some_and(|r| r.iter().any(|c| *c > 0))
    }

    /// A store of blocks `start..end` of `doc` in tier `t`, continuing block `start − 1`:
    /// skipped when that parent is not held (it cannot be keyed); a chain from block 0 whose
    /// leading blocks are held is a re-announcement of them.
    pub fn store(&mut self, pod: usize, doc: &[u32], start: usize, end: usize, t: usize) {
        let block = self.block;
        if start > 0 && !self.held_any(pod, engine_hash(&doc[..start * block])) {
            return;
        }
        let mut reannounce = start == 0;
        for b in start..end {
            let h = engine_hash(&doc[..(b + 1) * block]);
            let entry = self.refs[pod].entry(h).or_default();
            if entry[t] > 0 && reannounce {
                continue;
            }
            reannounce = false;
            entry[t] += 1;
        }
    }

    /// One reference of `hash` in tier `t` removed (if held).
    pub fn remove(&mut self, pod: usize, hash: EngineHash, t: usize) {
        if let Some(r) = self.refs[pod].get_mut(&hash)
            && r[t] > 0
        {
            r[t] -= 1;
        }
    }

    /// Leading blocks of `request` `pod` holds, and their weight (GPU 1.0, CPU 0.8).
    pub fn matched(&self, pod: usize, request: &[u32]) -> (usize, f64) {
        let mut blocks = 0;
        let mut weighted = 0.0;
        for b in 0..request.len() / self.block {
            let h = engine_hash(&request[..(b + 1) * self.block]);
            let Some(r) = self.refs[pod].get(&h) else {
                break;
            };
            if r[0] > 0 {
                weighted += 1.0;
            } else if r[1] > 0 {
                weighted += 0.8;
            } else {
                break;
            }
            blocks += 1;
        }
        (blocks, weighted)
    }
}
