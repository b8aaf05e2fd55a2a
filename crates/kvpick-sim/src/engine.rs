//! The engine model: a deterministic, clock-free core of vLLM v1's scheduler.
//!
//! Why: routing experiments only mean something if the simulated pods queue, hit and evict the
//! way vLLM does. Each [`Engine::step`] is one engine iteration: it schedules running requests
//! first (decodes take 1 token, unfinished chunked prefills take what the token budget allows),
//! then admits waiting requests FCFS while `max_num_seqs` and the budget allow, looking up their
//! prefix in the cache (full blocks only, at most `len - 1` tokens, like vLLM). When a running
//! request needs a block and none is free, the most recently admitted running request is
//! preempted (recompute mode: blocks freed, back to the front of the queue).
//!
//! Blocks are announced (`BlockStored`) when scheduled tokens fill them, evictions
//! (`BlockRemoved`) happen when the free-queue head is reused: both in the order vLLM emits them.
//!
//! The core never reads a clock: `step` returns how long the iteration takes under the cost
//! model, and the async driver (`pod.rs`) sleeps that long on tokio's clock. Tests run it
//! synchronously or under paused time. Owned by one task; no locking.
//!
//! NOTE: the waiting queue is unbounded, as vLLM's is; what bounds it is the number of open
//! HTTP requests (each waiting request belongs to one) and `max_request_tokens` per request.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::block_pool::{BlockId, BlockPool};
use super::events::{BlockStored, EngineHash, KvEvent};
use super::hashing::{BlockDigest, HashAlgo, block_extra_keys, hash_block, low64, none_hash};

/// Identifies a request inside one engine.
pub type RequestId = u64;

/// Step-time cost model: `overhead + prefill_tokens × per_prefill_token + decode_seqs ×
/// per_decode_seq (+ adapter loads)`. Defaults: Llama-3.1-8B on one H100 (docs/simulator.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Fixed cost of one iteration (weights read once per step).
    pub overhead: Duration,
    /// Cost per prompt token actually computed (cached tokens cost nothing).
    pub per_prefill_token: Duration,
    /// Cost per sequence decoding in the step.
    pub per_decode_seq: Duration,
    /// Cost of loading a LoRA adapter that is not resident.
    pub lora_load: Duration,
}

impl Default for StepCost {
    fn default() -> Self {
        Self {
            overhead: Duration::from_micros(6_200),
            per_prefill_token: Duration::from_micros(50),
            per_decode_seq: Duration::from_micros(300),
            lora_load: Duration::from_millis(25),
        }
    }
}

/// Engine configuration (vLLM flag names in the docs).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block (`--block-size`).
    pub block_size: usize,
    /// Blocks in the pool, including vLLM's null block (`--num-gpu-blocks-override`).
    pub num_gpu_blocks: usize,
    /// Max running requests (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Token budget per step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Max prompt + output tokens of one request (`--max-model-len`).
    pub max_model_len: usize,
    /// `--prefix-caching-hash-algo`.
    pub hash_algo: HashAlgo,
    /// Publish full digests instead of their low 64 bits.
    pub bytes_hashes: bool,
    /// Adapters resident at once (`--max-loras`); 0 disables LoRA.
    pub max_loras: usize,
    /// The cost model.
    pub cost: StepCost,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 4096,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32_768,
            hash_algo: HashAlgo::Sha256,
            bytes_hashes: false,
            max_loras: 0,
            cost: StepCost::default(),
        }
    }
}

/// A request handed to the engine (already tokenized).
#[derive(Debug, Clone, Default)]
pub struct SimRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate (the simulator never stops early).
    pub max_tokens: usize,
    /// `cache_salt`: enters block 0's hash.
    pub cache_salt: Option<String>,
    /// LoRA adapter name, if the request names one.
    pub lora: Option<String>,
    /// `session_id`, echoed on BlockStored.
    pub session_id: Option<String>,
    /// `kv_cache_report_mode: "full"`: re-announce cached prefix blocks.
    pub full_report: bool,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// Prompt plus output exceed `max_model_len` or the whole cache.
    #[error(
        "This model's maximum context length is {max} tokens. However, you requested {requested} tokens ({prompt} in the messages, {output} in the completion). Please reduce the length of the messages or completion."
    )]
    TooLong {
        /// The limit.
        max: usize,
        /// prompt + output.
        requested: usize,
        /// Prompt tokens.
        prompt: usize,
        /// Output tokens.
        output: usize,
    },
    /// Empty prompt.
    #[error("The prompt cannot be empty")]
    EmptyPrompt,
    /// A LoRA adapter was named but LoRA is disabled.
    #[error("LoRA is not enabled")]
    LoraDisabled,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    /// The request.
    pub id: RequestId,
    /// The token id.
    pub token: u32,
    /// 0 for the first generated token.
    pub index: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
}

/// What one iteration did.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Simulated wall time of the iteration (before `--time-scale`).
    pub duration: Duration,
    /// Tokens produced, in scheduling order.
    pub tokens: Vec<TokenOut>,
    /// KV events, in emission order (one batch per step).
    pub events: Vec<KvEvent>,
    /// Prompt tokens computed in this step.
    pub prefill_tokens: usize,
    /// Sequences that decoded in this step.
    pub decode_seqs: usize,
}

/// Counters and gauges for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Requests in the waiting queue.
    pub waiting: usize,
    /// Requests scheduled (running).
    pub running: usize,
    /// `kv_cache_usage_perc`.
    pub kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache (cumulative).
    pub prefix_queries: u64,
    /// Of those, tokens found (cumulative).
    pub prefix_hits: u64,
    /// Preemptions (cumulative).
    pub preemptions: u64,
    /// Distinct cached digests.
    pub cached_blocks: usize,
    /// Adapters of running requests.
    pub running_loras: Vec<String>,
    /// Adapters of waiting requests.
    pub waiting_loras: Vec<String>,
}

#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    computed: usize,
    blocks: Vec<BlockId>,
    digests: Vec<BlockDigest>,
    /// Blocks already in the prefix cache (announced or hit).
    cached_blocks: usize,
    cached_tokens: Option<usize>,
    output_seed: u64,
    req: SimRequest,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// The engine.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    pool: BlockPool,
    none_hash: BlockDigest,
    seqs: HashMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    next_id: RequestId,
    prefix_queries: u64,
    prefix_hits: u64,
    preemptions: u64,
    /// Resident adapters, least recently used first.
    resident_loras: Vec<String>,
    lora_ids: HashMap<String, i64>,
    /// Events queued outside a step (vLLM's `BlockPool.kv_event_queue`): published with the
    /// next step's batch, ahead of that step's own events.
    pending_events: Vec<KvEvent>,
}

impl Engine {
    /// A fresh engine with an empty cache.
    pub fn new(mut cfg: EngineConfig) -> Self {
        cfg.block_size = cfg.block_size.max(1);
        cfg.max_num_seqs = cfg.max_num_seqs.max(1);
        cfg.max_num_batched_tokens = cfg.max_num_batched_tokens.max(1);
        Self {
            pool: BlockPool::new(cfg.num_gpu_blocks),
            none_hash: none_hash(cfg.hash_algo),
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            resident_loras: Vec::new(),
            lora_ids: HashMap::new(),
            pending_events: Vec::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The longest request (prompt + output) this engine accepts: `max_model_len`, capped by
    /// what the KV cache can hold (vLLM refuses to start otherwise).
    pub fn max_request_tokens(cfg: &EngineConfig) -> usize {
        let usable = cfg.num_gpu_blocks.max(2) - 1;
        cfg.max_model_len
            .min(usable.saturating_mul(cfg.block_size.max(1)))
    }

    /// Queues a request.
    pub fn add_request(&mut self, req: SimRequest) -> Result<RequestId, AdmitError> {
        let prompt = req.prompt.len();
        if prompt == 0 {
            return Err(AdmitError::EmptyPrompt);
        }
        if req.lora.is_some() && self.cfg.max_loras == 0 {
            return Err(AdmitError::LoraDisabled);
        }
        let requested = prompt.saturating_add(req.max_tokens);
        let max = Self::max_request_tokens(&self.cfg);
        if requested > max {
            return Err(AdmitError::TooLong {
                max,
                requested,
                prompt,
                output: req.max_tokens,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        if let Some(name) = &req.lora {
            let next = self.lora_ids.len() as i64 + 1;
            self.lora_ids.entry(name.clone()).or_insert(next);
        }
        let output_seed = xxhash_rust::xxh3::xxh3_64(
            &req.prompt
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        self.seqs.insert(
            id,
            Seq {
                tokens: req.prompt.clone(),
                prompt_len: prompt,
                max_tokens: req.max_tokens,
                computed: 0,
                blocks: Vec::new(),
                digests: Vec::new(),
                cached_blocks: 0,
                cached_tokens: None,
                output_seed,
                req,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Drops a request (client gone); its blocks are released.
    pub fn abort(&mut self, id: RequestId) {
        if let Some(seq) = self.seqs.remove(&id) {
            self.pool.release(seq.blocks.iter().rev().copied());
        }
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Clears the prefix cache when idle (vLLM `reset_prefix_cache`); false when blocks are in
    /// use. Like vLLM 0.32, the `AllBlocksCleared` is not published now: it is queued and goes
    /// out first in the batch of the next step (the next request), so an idle engine announces
    /// its reset only once traffic comes (captured in tests/fixtures/vllm-e2e/).
    pub fn reset_prefix_cache(&mut self) -> bool {
        let cleared = self.pool.reset_prefix_cache();
        if cleared {
            self.pending_events.push(KvEvent::AllBlocksCleared);
        }
        cleared
    }

    /// A process restart: every request is dropped and the cache is empty; nothing is announced.
    pub fn restart(&mut self) -> Vec<RequestId> {
        let dropped: Vec<RequestId> = self.seqs.keys().copied().collect();
        *self = Engine::new(self.cfg.clone());
        dropped
    }

    /// Current counters.
    pub fn stats(&self) -> EngineStats {
        let loras = |ids: &mut dyn Iterator<Item = &RequestId>| {
            let mut names: Vec<String> = ids
                .filter_map(|id| self.seqs.get(id).and_then(|s| s.req.lora.clone()))
                .collect();
            names.sort();
            names.dedup();
            names
        };
        EngineStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_usage: self.pool.usage(),
            prefix_queries: self.prefix_queries,
            prefix_hits: self.prefix_hits,
            preemptions: self.preemptions,
            cached_blocks: self.pool.cached_digests(),
            running_loras: loras(&mut self.running.iter()),
            waiting_loras: loras(&mut self.waiting.iter()),
        }
    }

    /// The digests of `tokens`' full blocks, as this engine hashes them (for tests and tools).
    pub fn block_digests(
        &self,
        tokens: &[u32],
        salt: Option<&str>,
        lora: Option<&str>,
    ) -> Vec<BlockDigest> {
        super::hashing::chain_hashes(self.cfg.hash_algo, tokens, self.cfg.block_size, salt, lora)
    }

    fn engine_hash(&self, digest: &BlockDigest) -> EngineHash {
        if self.cfg.bytes_hashes {
            EngineHash::Bytes(digest.to_vec())
        } else {
            EngineHash::Int(low64(digest))
        }
    }

    fn ensure_digests(&mut self, id: RequestId, n_blocks: usize) {
        let (algo, bs, none) = (self.cfg.hash_algo, self.cfg.block_size, self.none_hash);
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        while seq.digests.len() < n_blocks {
            let i = seq.digests.len();
            let Some(block) = seq.tokens.get(i * bs..(i + 1) * bs) else {
                break;
            };
            let parent = seq.digests.last().copied().unwrap_or(none);
            let extra = block_extra_keys(i, seq.req.cache_salt.as_deref(), seq.req.lora.as_deref());
            seq.digests.push(hash_block(algo, &parent, block, &extra));
        }
    }

    /// Allocates blocks so `id` can hold `upto` tokens; evictions go to `events`.
    fn grow(&mut self, id: RequestId, upto: usize, events: &mut Vec<KvEvent>) -> bool {
        let bs = self.cfg.block_size;
        let Some(have) = self.seqs.get(&id).map(|s| s.blocks.len()) else {
            return false;
        };
        let need = upto.div_ceil(bs).saturating_sub(have);
        if need == 0 {
            return true;
        }
        let mut evicted = Vec::new();
        let Some(new) = self.pool.allocate(need, &mut evicted) else {
            return false;
        };
        for digest in &evicted {
            events.push(KvEvent::BlockRemoved {
                block_hashes: vec![self.engine_hash(digest)],
                medium: Some("GPU".to_owned()),
                group_idx: Some(0),
            });
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.blocks.extend(new);
        }
        true
    }

    /// Caches and announces the blocks that `upto` computed tokens fill.
    fn store_full_blocks(&mut self, id: RequestId, upto: usize, events: &mut Vec<KvEvent>) {
        let bs = self.cfg.block_size;
        let full = upto / bs;
        self.ensure_digests(id, full);
        let Some(seq) = self.seqs.get(&id) else {
            return;
        };
        let first = seq.cached_blocks;
        if full <= first {
            return;
        }
        let mut hashes = Vec::with_capacity(full - first);
        let mut extra = Vec::with_capacity(full - first);
        let mut cache = Vec::with_capacity(full - first);
        for i in first..full {
            let (Some(&block), Some(&digest)) = (seq.blocks.get(i), seq.digests.get(i)) else {
                break;
            };
            cache.push((block, digest));
            hashes.push(self.engine_hash(&digest));
            let keys = block_extra_keys(i, seq.req.cache_salt.as_deref(), seq.req.lora.as_deref());
            extra.push((!keys.is_empty()).then(|| keys.into_iter().map(|k| k.value).collect()));
        }
        let stored = cache.len();
        let parent = first
            .checked_sub(1)
            .and_then(|p| seq.digests.get(p))
            .map(|d| self.engine_hash(d));
        let event = self.stored_event(seq, hashes, parent, first, first + stored, extra);
        for (block, digest) in cache {
            self.pool.cache(block, digest);
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.cached_blocks = first + stored;
        }
        if stored > 0 {
            events.push(event);
        }
    }

    fn stored_event(
        &self,
        seq: &Seq,
        block_hashes: Vec<EngineHash>,
        parent_block_hash: Option<EngineHash>,
        from: usize,
        to: usize,
        extra_keys: Vec<Option<Vec<String>>>,
    ) -> KvEvent {
        let bs = self.cfg.block_size;
        KvEvent::BlockStored(BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids: seq
                .tokens
                .get(from * bs..to * bs)
                .unwrap_or_default()
                .to_vec(),
            block_size: bs as u32,
            lora_id: seq
                .req
                .lora
                .as_ref()
                .and_then(|n| self.lora_ids.get(n).copied()),
            medium: Some("GPU".to_owned()),
            lora_name: seq.req.lora.clone(),
            extra_keys: Some(extra_keys),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".to_owned()),
            session_id: seq.req.session_id.clone(),
        })
    }

    /// Preempts the most recently admitted running request; returns it.
    fn preempt_last(&mut self) -> Option<RequestId> {
        let victim = self.running.pop()?;
        if let Some(seq) = self.seqs.get_mut(&victim) {
            let blocks = std::mem::take(&mut seq.blocks);
            seq.computed = 0;
            seq.cached_blocks = 0;
            self.pool.release(blocks.into_iter().rev());
        }
        self.waiting.push_front(victim);
        self.preemptions += 1;
        Some(victim)
    }

    /// Makes `name` resident; returns whether a load was needed, or `None` if no slot is free.
    fn load_lora(&mut self, name: &str) -> Option<bool> {
        if let Some(pos) = self.resident_loras.iter().position(|n| n == name) {
            let n = self.resident_loras.remove(pos);
            self.resident_loras.push(n);
            return Some(false);
        }
        if self.resident_loras.len() >= self.cfg.max_loras {
            let busy: Vec<String> = self
                .running
                .iter()
                .filter_map(|id| self.seqs.get(id).and_then(|s| s.req.lora.clone()))
                .collect();
            let pos = self.resident_loras.iter().position(|n| !busy.contains(n))?;
            self.resident_loras.remove(pos);
        }
        self.resident_loras.push(name.to_owned());
        Some(true)
    }

    /// Runs one iteration.
    pub fn step(&mut self) -> StepOutput {
        let mut out = StepOutput {
            events: std::mem::take(&mut self.pending_events),
            ..StepOutput::default()
        };
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut scheduled: Vec<(RequestId, usize)> = Vec::new();
        let mut preempted = false;
        let mut lora_loads = 0u32;

        // 1. Running requests, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some((computed, known)) = self.seqs.get(&id).map(|s| (s.computed, s.tokens.len()))
            else {
                self.running.remove(i);
                continue;
            };
            let n = (known - computed).min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let mut fits = self.grow(id, computed + n, &mut out.events);
            while !fits {
                preempted = true;
                match self.preempt_last() {
                    Some(victim) if victim == id => break,
                    Some(_) => fits = self.grow(id, computed + n, &mut out.events),
                    None => break,
                }
            }
            if !fits {
                break;
            }
            self.store_full_blocks(id, computed + n, &mut out.events);
            scheduled.push((id, n));
            budget -= n;
            i += 1;
        }

        // 2. Waiting requests, FCFS, unless this step had to preempt.
        let mut skipped = VecDeque::new();
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(id) = self.waiting.pop_front() else {
                break;
            };
            let Some(lora) = self.seqs.get(&id).map(|s| s.req.lora.clone()) else {
                continue;
            };
            if let Some(name) = &lora {
                match self.load_lora(name) {
                    Some(true) => lora_loads += 1,
                    Some(false) => {}
                    None => {
                        skipped.push_back(id);
                        continue;
                    }
                }
            }
            if !self.admit(id, &mut budget, &mut scheduled, &mut out.events) {
                self.waiting.push_front(id);
                break;
            }
        }
        while let Some(id) = skipped.pop_back() {
            self.waiting.push_front(id);
        }

        // 3. The forward pass: advance, sample, finish.
        for (id, n) in scheduled {
            let bs_done = {
                let Some(seq) = self.seqs.get_mut(&id) else {
                    continue;
                };
                let is_decode =
                    n == 1 && seq.generated() > 0 && seq.computed + 1 == seq.tokens.len();
                if !is_decode {
                    out.prefill_tokens += n;
                } else {
                    out.decode_seqs += 1;
                }
                seq.computed += n;
                if seq.computed < seq.tokens.len() {
                    continue;
                }
                let index = seq.generated();
                let token = synthetic_token(seq.output_seed, index);
                seq.tokens.push(token);
                let done = seq.generated() >= seq.max_tokens;
                out.tokens.push(TokenOut {
                    id,
                    token,
                    index,
                    prompt_tokens: seq.prompt_len,
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                    finish: done.then_some(FinishReason::Length),
                });
                done
            };
            if bs_done {
                self.finish(id);
            }
        }
        let cost = self.cfg.cost;
        out.duration = if out.prefill_tokens + out.decode_seqs == 0 && lora_loads == 0 {
            Duration::ZERO
        } else {
            cost.overhead
                + cost.per_prefill_token * out.prefill_tokens as u32
                + cost.per_decode_seq * out.decode_seqs as u32
                + cost.lora_load * lora_loads
        };
        out
    }

    /// Admits one waiting request: prefix lookup, block allocation, first chunk.
    fn admit(
        &mut self,
        id: RequestId,
        budget: &mut usize,
        scheduled: &mut Vec<(RequestId, usize)>,
        events: &mut Vec<KvEvent>,
    ) -> bool {
        let bs = self.cfg.block_size;
        let Some(known) = self.seqs.get(&id).map(|s| s.tokens.len()) else {
            return true;
        };
        let max_hit_blocks = known.saturating_sub(1) / bs;
        self.ensure_digests(id, max_hit_blocks);
        let Some(seq) = self.seqs.get(&id) else {
            return true;
        };
        let hits: Vec<BlockId> = seq
            .digests
            .iter()
            .take(max_hit_blocks)
            .map_while(|d| self.pool.lookup(d))
            .collect();
        let hit_tokens = hits.len() * bs;
        let n = (known - hit_tokens).min(*budget);
        let need = (hit_tokens + n).div_ceil(bs) - hits.len();
        let free_hits = hits.iter().filter(|&&b| self.pool.is_free(b)).count();
        if need + free_hits > self.pool.num_free() {
            return false;
        }
        for &b in &hits {
            self.pool.touch(b);
        }
        self.prefix_queries += known as u64;
        self.prefix_hits += hit_tokens as u64;
        let mut report = None;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.blocks = hits.clone();
            seq.computed = hit_tokens;
            seq.cached_blocks = hits.len();
            seq.cached_tokens.get_or_insert(hit_tokens);
            if seq.req.full_report && !hits.is_empty() {
                report = Some(hits.len());
            }
        }
        if let (Some(count), Some(seq)) = (report, self.seqs.get(&id)) {
            let hashes = seq
                .digests
                .get(..count)
                .unwrap_or_default()
                .iter()
                .map(|d| self.engine_hash(d))
                .collect();
            let extra = (0..count)
                .map(|i| {
                    let keys =
                        block_extra_keys(i, seq.req.cache_salt.as_deref(), seq.req.lora.as_deref());
                    (!keys.is_empty()).then(|| keys.into_iter().map(|k| k.value).collect())
                })
                .collect();
            events.push(self.stored_event(seq, hashes, None, 0, count, extra));
        }
        if !self.grow(id, hit_tokens + n, events) {
            // Cannot happen after the free-count check; undo to stay consistent.
            if let Some(seq) = self.seqs.get_mut(&id) {
                let blocks = std::mem::take(&mut seq.blocks);
                seq.computed = 0;
                seq.cached_blocks = 0;
                self.pool.release(blocks.into_iter().rev());
            }
            return false;
        }
        self.store_full_blocks(id, hit_tokens + n, events);
        self.running.push(id);
        scheduled.push((id, n));
        *budget -= n;
        true
    }

    fn finish(&mut self, id: RequestId) {
        self.running.retain(|&r| r != id);
        if let Some(seq) = self.seqs.remove(&id) {
            // vLLM frees tail-first, so a request's last blocks are evicted first.
            self.pool.release(seq.blocks.iter().rev().copied());
        }
    }
}

/// A deterministic "greedy" output: the same prompt always yields the same tokens, and ids
/// stay clear of the special tokens at the top of the vocabulary.
fn synthetic_token(seed: u64, index: usize) -> u32 {
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(&(index as u64).to_le_bytes(), seed);
    1_000 + (h % 30_000) as u32
}
