//! The least time to first token any router could have given a request (`--request-log`'s
//! `floor_s`): a lower bound that a benchmark sets beside what each router achieved, so a
//! goal like "0.8× the best peer's TTFT" can be checked against what is reachable at all.
//!
//! The bound assumes the best a placement could ever do:
//! - caches without limit, shared by the whole fleet: every block any earlier request of the
//!   run brought is still there (`SeenPrefixes`), however the requests were placed;
//! - an idle pod of the fleet's fastest speed: the request's prefill starts at once, alone in
//!   its steps, with no decode batch beside it.
//!
//! What remains is the engine's own cost of the request's uncached tokens, in the steps the
//! token budget allows: `steps × overhead + uncached × per_prefill_token`, times the fastest
//! pod's time factor. As in vLLM (and `engine::Engine::admit`), only the whole blocks before a
//! prompt's last token can be hits: a prompt held whole recomputes its partial tail, or its
//! last block when it ends on a block boundary.
//!
//! Every real placement waits at least this long on the pod (arrival to first token), so the
//! k-th fastest of a stage's real TTFTs is at least the k-th smallest floor: the bound holds
//! for the mean and for every percentile, not only request by request.
//! NOTE: the seen set ignores `cache_salt` and LoRA adapters (both separate caches in vLLM)
//! and counts the blocks of requests still being prefilled or later refused: each only lowers
//! the floor, so it stays a bound. Past `SEEN_BLOCKS_MAX` blocks the set stops growing and no
//! further floors are given (a floor from an incomplete set could be too high).

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use crate::engine::{EngineConfig, StepCost};

/// Distinct blocks the seen set holds before it stops (8 bytes each in the set: ~64 MiB of
/// hashes plus the table's overhead, far above a benchmark run's tens of thousands).
pub const SEEN_BLOCKS_MAX: usize = 8 << 20;

/// What the floor of a request costs on the fleet's fastest pod.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FloorModel {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Token budget per step (`--max-num-batched-tokens`): a longer prefill takes more steps.
    pub max_num_batched_tokens: usize,
    /// The engine's step costs.
    pub cost: StepCost,
    /// The fastest pod's multiplier on step times (`--time-scale` × its slow-down factor).
    pub time_factor: f64,
}

impl FloorModel {
    /// The model of a fleet whose pods run `engine`, the fastest of them with `time_factor`.
    pub fn for_engine(engine: &EngineConfig, time_factor: f64) -> Self {
        Self {
            block_size: engine.block_size,
            max_num_batched_tokens: engine.max_num_batched_tokens,
            cost: engine.cost,
            time_factor,
        }
    }

    /// Seconds from arrival to first token for a request computing `uncached` prompt tokens on
    /// an idle pod.
    pub fn first_token_s(&self, uncached: usize) -> f64 {
        let uncached = uncached.max(1);
        let steps = uncached.div_ceil(self.max_num_batched_tokens.max(1));
        let engine = self.cost.overhead.as_secs_f64() * steps as f64
            + self.cost.per_prefill_token.as_secs_f64() * uncached as f64;
        engine * self.time_factor.max(0.0)
    }
}

/// The chained hashes of every full block the run's requests have brought, fleet-wide.
#[derive(Debug, Default)]
pub struct SeenPrefixes {
    blocks: Mutex<SeenState>,
}

#[derive(Debug, Default)]
struct SeenState {
    hashes: HashSet<u64>,
    /// Set once the set reached `SEEN_BLOCKS_MAX`: no floor is given from then on.
    full: bool,
}

impl SeenPrefixes {
    /// Tokens of `prompt` an unlimited, fleet-wide cache could serve (whole blocks seen in
    /// earlier prompts, at most those before the prompt's last token), then records `prompt`'s
    /// full blocks. `None` once the set is full.
    pub fn reusable_then_record(&self, prompt: &[u32], block_size: usize) -> Option<usize> {
        let block_size = block_size.max(1);
        let hashes = chain_hashes(prompt, block_size);
        let max_hit_blocks = prompt.len().saturating_sub(1) / block_size;
        let Ok(mut seen) = self.blocks.lock() else {
            return None;
        };
        if seen.full {
            return None;
        }
        let reusable = hashes
            .iter()
            .take(max_hit_blocks)
            .take_while(|h| seen.hashes.contains(h))
            .count();
        for h in hashes {
            if seen.hashes.len() >= SEEN_BLOCKS_MAX {
                seen.full = true;
                tracing::warn!(
                    blocks = SEEN_BLOCKS_MAX,
                    "request log: the seen-prefix set is full; no more floors"
                );
                return None;
            }
            seen.hashes.insert(h);
        }
        Some(reusable * block_size)
    }
}

/// Each full block's hash, chained over the blocks before it (a block's identity is its
/// whole prefix, as in vLLM's prefix cache).
fn chain_hashes(prompt: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = 0u64;
    prompt
        .chunks_exact(block_size)
        .map(|block| {
            // NOTE: DefaultHasher::new() has fixed keys: the same prompt hashes the same in
            // every pod of the fleet and in every run.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            parent.hash(&mut h);
            block.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// Least first-token times of a fleet's requests: what [`crate::request_log::RequestLog`]
/// writes as `reusable_tokens` and `floor_s`.
#[derive(Debug)]
pub struct Floors {
    model: FloorModel,
    seen: SeenPrefixes,
}

impl Floors {
    /// Floors under `model`, with nothing seen yet.
    pub fn new(model: FloorModel) -> Self {
        Self {
            model,
            seen: SeenPrefixes::default(),
        }
    }

    /// `(reusable tokens, floor seconds)` of a request arriving with `prompt` (recorded as
    /// seen for the requests after it); `None` once the seen set is full.
    pub fn arrive(&self, prompt: &[u32]) -> Option<(usize, f64)> {
        let reusable = self
            .seen
            .reusable_then_record(prompt, self.model.block_size)?;
        let uncached = prompt.len().saturating_sub(reusable);
        Some((reusable, self.model.first_token_s(uncached)))
    }

    /// The model the floors are computed with.
    pub fn model(&self) -> &FloorModel {
        &self.model
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn model(time_factor: f64) -> FloorModel {
        FloorModel {
            block_size: 4,
            max_num_batched_tokens: 100,
            cost: StepCost {
                overhead: Duration::from_millis(6),
                per_prefill_token: Duration::from_micros(50),
                per_decode_seq: Duration::from_micros(300),
                lora_load: Duration::from_millis(25),
            },
            time_factor,
        }
    }

    #[test]
    fn a_prefill_costs_its_steps_and_tokens_at_the_fastest_speed() {
        let m = model(2.0);
        // 10 tokens, one step: (6 ms + 10 × 0.05 ms) × 2.
        assert!((m.first_token_s(10) - 0.013).abs() < 1e-12);
        // 250 tokens, three steps of at most 100: (3 × 6 + 250 × 0.05) × 2 ms.
        assert!((m.first_token_s(250) - 0.061).abs() < 1e-12);
        // Nothing uncached still computes one token (the prompt's last).
        assert_eq!(m.first_token_s(0), m.first_token_s(1));
    }

    #[test]
    fn a_prompt_reuses_the_whole_blocks_earlier_prompts_brought_but_not_its_last_token() {
        let floors = Floors::new(model(1.0));
        let shared: Vec<u32> = (0..12).collect();
        let first = [shared.clone(), vec![100, 101, 102]].concat();
        // Nothing seen: all 15 tokens are computed.
        assert_eq!(floors.arrive(&first).map(|f| f.0), Some(0));
        // Same 3 blocks of prefix, then something new: 12 reusable.
        let second = [shared.clone(), vec![200, 201, 202, 203, 204]].concat();
        let (reusable, floor) = floors.arrive(&second).expect("a floor");
        assert_eq!(reusable, 12);
        assert!((floor - floors.model().first_token_s(5)).abs() < 1e-12);
        // The first prompt again: its 3 full blocks are held, its 3 tail tokens are not.
        assert_eq!(floors.arrive(&first).map(|f| f.0), Some(12));
        // A prompt held whole, ending on a block boundary, recomputes its last block.
        let aligned: Vec<u32> = (0..16).collect();
        assert_eq!(floors.arrive(&aligned).map(|f| f.0), Some(12));
        assert_eq!(floors.arrive(&aligned).map(|f| f.0), Some(12));
        // A block equal to a seen one but behind another prefix is not the same block.
        let moved = [vec![9, 9, 9, 9], (0..12).collect()].concat();
        assert_eq!(floors.arrive(&moved).map(|f| f.0), Some(0));
        // Reuse stops at the first unseen block, even if later ones were seen.
        let gap = [
            (0..4).collect(),
            vec![7, 7, 7, 7],
            (8..12).collect(),
            vec![1],
        ]
        .concat();
        assert_eq!(floors.arrive(&gap).map(|f| f.0), Some(4));
    }
}
