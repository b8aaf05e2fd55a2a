//! Prefix index figures: ingest rate (blocks/s, one core), match latency for a 2,048-block
//! prompt over 100 pods, the routing record of a warm 6,250-block prompt and of a cold
//! 3,500-block one (with the index in the CPU caches and pushed out of them), and memory per
//! (block, pod) entry (printed); and decoding a store of 512 blocks and an eviction of 512, the
//! one-pass reader against the reference; and a full fleet's steady ingest (a store and an
//! eviction of 512 blocks, with tables larger than the CPU's caches).
//!
//! Run: `cargo bench --bench kvcache`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvpick::endpoints::PodId;
use kvpick::kvcache::{IndexConfig, KeyContext, PrefixIndex, PrefixLookup, PromptKeys, block_keys};
use kvpick::kvevents::{
    BlockExtra, BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Tier,
};

const BLOCK: usize = 16;

/// Counts live heap bytes, so memory figures are what the index really allocates (tables at
/// their real bucket counts, holder lists, pod maps), not an estimate.
struct CountingAllocator;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

// SAFETY: delegates every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout as requested.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: ptr was allocated by `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn pod(i: usize) -> PodId {
    PodId(SocketAddr::from((
        [10, 0, (i / 250) as u8, (i % 250) as u8],
        8000,
    )))
}

/// A store of one chain from block 0 in GPU, as vLLM sends it: `block_hashes` and their
/// `BLOCK` tokens each.
fn gpu_chain(block_hashes: Vec<EngineHash>, token_ids: Vec<u32>) -> KvEvent {
    let blocks = block_hashes.len();
    KvEvent::BlockStored(BlockStored {
        block_hashes,
        parent_block_hash: None,
        token_ids,
        block_size: Some(BLOCK as u32),
        tier: Tier::Gpu,
        extra: vec![BlockExtra::default(); blocks],
        ..BlockStored::default()
    })
}

/// `chains` chains of `per_chain` blocks each, with distinct tokens; engine hashes are
/// arbitrary distinct numbers (the index never interprets them).
fn store_batch(seed: u32, chains: usize, per_chain: usize) -> (EventBatch, Vec<EngineHash>) {
    let mut events = Vec::new();
    let mut hashes = Vec::new();
    for chain in 0..chains {
        let tokens: Vec<u32> = (0..per_chain * BLOCK)
            .map(|t| seed.wrapping_mul(7919) ^ (chain as u32 * 100_003 + t as u32))
            .collect();
        let chain_hashes: Vec<EngineHash> = (0..per_chain)
            .map(|b| {
                EngineHash(
                    (u64::from(seed) << 40) ^ ((chain as u64) << 20) ^ b as u64 ^ 0x9e37_79b9,
                )
            })
            .collect();
        hashes.extend(&chain_hashes);
        events.push(gpu_chain(chain_hashes, tokens));
    }
    let batch = EventBatch {
        ts: 0.0,
        events,
        dp_rank: Some(0),
    };
    (batch, hashes)
}

fn remove_batch(hashes: &[EngineHash]) -> EventBatch {
    EventBatch {
        ts: 0.0,
        // vLLM sends one hash per BlockRemoved event.
        events: hashes
            .iter()
            .rev()
            .map(|h| {
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![*h],
                    tier: Tier::Gpu,
                    group_idx: None,
                })
            })
            .collect(),
        dp_rank: Some(0),
    }
}

fn ingest(c: &mut Criterion) {
    let (stores, hashes) = store_batch(1, 64, 64);
    let removes = remove_batch(&hashes);
    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(hashes.len() as u64));
    group.bench_function("store_4096_blocks", |b| {
        b.iter_batched(
            || PrefixIndex::new(IndexConfig::default()),
            |index| {
                index.apply_batch(pod(0), "m", &stores);
                index
            },
            BatchSize::LargeInput,
        )
    });
    group.bench_function("remove_4096_blocks", |b| {
        b.iter_batched(
            || {
                let index = PrefixIndex::new(IndexConfig::default());
                index.apply_batch(pod(0), "m", &stores);
                index
            },
            |index| {
                index.apply_batch(pod(0), "m", &removes);
                index
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

/// Pods of the steady-state ingest, and blocks each holds (a full cache: every store of a
/// chain evicts the pod's oldest chain, as a vLLM pod at capacity does).
const STEADY_PODS: usize = 8;
const STEADY_CHAIN: usize = 512;
const STEADY_HELD_CHAINS: usize = 200;

/// Chain `n` of pod `p` in the steady-state ingest: one store of 512 blocks, its tokens and
/// engine hashes derived from (p, n), so the eviction of chain `n` can be rebuilt later.
fn steady_store(p: usize, n: usize) -> EventBatch {
    let seed = (p * 1_000_003 + n) as u32;
    let tokens: Vec<u32> = (0..STEADY_CHAIN * BLOCK)
        .map(|t| seed.wrapping_mul(2_654_435_761) ^ t as u32)
        .collect();
    EventBatch {
        ts: 0.0,
        events: vec![gpu_chain(steady_hashes(p, n), tokens)],
        dp_rank: Some(0),
    }
}

fn steady_hashes(p: usize, n: usize) -> Vec<EngineHash> {
    (0..STEADY_CHAIN)
        .map(|b| {
            let raw = ((p as u64) << 48) ^ ((n as u64) << 16) ^ b as u64;
            EngineHash(raw.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        })
        .collect()
}

/// A full fleet's steady state: 8 pods holding 102,400 blocks each (~820k entries, tables
/// larger than the CPU's caches, as in a production fleet), where each step one pod stores a
/// new 512-block chain (one chunked-prefill step) and evicts its oldest 512 blocks, one
/// `BlockRemoved` event each. What a step costs when every block is a cache miss.
fn ingest_steady(c: &mut Criterion) {
    let index = PrefixIndex::new(IndexConfig::default());
    for n in 0..STEADY_HELD_CHAINS {
        for p in 0..STEADY_PODS {
            index.apply_batch(pod(p), "m", &steady_store(p, n));
        }
    }
    let step = std::cell::Cell::new(0usize);
    let mut group = c.benchmark_group("ingest_steady_8_pods_102400_blocks");
    group.throughput(Throughput::Elements(2 * STEADY_CHAIN as u64));
    group.bench_function("store_512_evict_512", |b| {
        b.iter_batched(
            || {
                let s = step.get();
                step.set(s + 1);
                let (p, n) = (s % STEADY_PODS, STEADY_HELD_CHAINS + s / STEADY_PODS);
                let evicted = steady_hashes(p, n - STEADY_HELD_CHAINS);
                (p, steady_store(p, n), remove_batch(&evicted))
            },
            |(p, store, evict)| {
                index.apply_batch(pod(p), "m", &store);
                index.apply_batch(pod(p), "m", &evict);
                (store, evict)
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
    assert_eq!(
        index.pod_entries(pod(0)),
        STEADY_HELD_CHAINS * STEADY_CHAIN,
        "every step evicts as much as it stores"
    );
}

/// One chunked-prefill step's store event as vLLM publishes it (tagged map, 512 blocks of 16
/// tokens, u64 hashes, one nil extra key per block and the spec kind, as vLLM 0.32 does):
/// what a pod sends per 8,192 prompt tokens it computes.
fn store_payload() -> Vec<u8> {
    use rmpv::Value;
    let tokens = (0..512 * BLOCK as u64).map(|t| Value::from(t * 7_919 % 151_000));
    let hashes = (0..512u64).map(|b| Value::from(b.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    let event = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(hashes.collect())),
        ("parent_block_hash".into(), Value::from(42u64)),
        ("token_ids".into(), Value::Array(tokens.collect())),
        ("block_size".into(), Value::from(BLOCK as u64)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
        ("extra_keys".into(), Value::Array(vec![Value::Nil; 512])),
        ("group_idx".into(), Value::from(0)),
        ("kv_cache_spec_kind".into(), "full_attention".into()),
    ]);
    let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![event]), Value::Nil]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("encoding into a Vec");
    out
}

/// The eviction of 512 blocks as vLLM publishes it: one `BlockRemoved` event per block.
fn removal_payload() -> Vec<u8> {
    use rmpv::Value;
    let events = (0..512u64).map(|b| {
        Value::Map(vec![
            ("type".into(), "BlockRemoved".into()),
            (
                "block_hashes".into(),
                Value::Array(vec![Value::from(b.wrapping_mul(0x9e37_79b9_7f4a_7c15))]),
            ),
            ("medium".into(), "GPU".into()),
            ("group_idx".into(), Value::from(0)),
            ("kv_cache_spec_kind".into(), "full_attention".into()),
        ])
    });
    let batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(events.collect()),
        Value::Nil,
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("encoding into a Vec");
    out
}

/// Decoding those payloads: the one-pass reader against the reference (rmpv's whole tree
/// first).
fn decode(c: &mut Criterion) {
    for (name, payload) in [
        ("decode_store_512_blocks", store_payload()),
        ("decode_remove_512_blocks", removal_payload()),
    ] {
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Bytes(payload.len() as u64));
        group.bench_function("reader", |b| {
            b.iter(|| kvpick::kvevents::decode_payload(black_box(&payload)))
        });
        group.bench_function("reference", |b| {
            b.iter(|| kvpick::kvevents::decode::decode_payload_reference(black_box(&payload)))
        });
        group.finish();
    }
}

/// A 2,048-block prompt and an index of 100 pods; `shared` makes every pod hold a prefix of
/// it (pod i the first 2048·(i+1)/100 blocks: the worst case, ~100 holders per block), else one pod
/// holds it all and the others hold unrelated blocks.
fn match_setup(shared: bool) -> (PrefixIndex, Vec<u32>, Vec<PodId>) {
    let index = PrefixIndex::new(IndexConfig::default());
    let context = KeyContext::model("m");
    let prompt: Vec<u32> = (0..2048 * BLOCK as u32)
        .map(|t| t.wrapping_mul(31))
        .collect();
    let pods: Vec<PodId> = (0..100).map(pod).collect();
    for (i, p) in pods.iter().enumerate() {
        let held = if shared {
            2048 * (i + 1) / 100
        } else if i == 0 {
            2048
        } else {
            0
        };
        let mut stored = BlockStored {
            block_hashes: (0..held).map(|b| EngineHash(b as u64 + 1)).collect(),
            token_ids: prompt[..held * BLOCK].to_vec(),
            block_size: Some(BLOCK as u32),
            extra: vec![BlockExtra::default(); held],
            ..BlockStored::default()
        };
        if held == 0 {
            let (other, _) = store_batch(i as u32 + 10, 4, 512);
            index.apply_batch(*p, "m", &other);
            continue;
        }
        stored.tier = if i % 2 == 0 { Tier::Gpu } else { Tier::Cpu };
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(stored)],
            dp_rank: None,
        };
        index.apply_batch(*p, "m", &batch);
    }
    let found = index.match_prefix(&context, &prompt, &pods);
    assert_eq!(found.iter().map(|m| m.matched_blocks).max(), Some(2048));
    (index, prompt, pods)
}

fn matching(c: &mut Criterion) {
    let context = KeyContext::model("m");
    let mut group = c.benchmark_group("match_2048_blocks_100_pods");
    for shared in [false, true] {
        let (index, prompt, pods) = match_setup(shared);
        let name = if shared {
            "all_pods_hold_prefixes"
        } else {
            "one_pod_holds_it"
        };
        group.bench_function(format!("{name}/tokens"), |b| {
            b.iter(|| black_box(index.match_prefix(&context, black_box(&prompt), &pods)))
        });
        let keys = block_keys(&context, &prompt, BLOCK as u32);
        group.bench_function(format!("{name}/keys_precomputed"), |b| {
            b.iter(|| black_box(index.match_keys(black_box(&keys), BLOCK as u32, &pods)))
        });
    }
    group.bench_function("keying_only", |b| {
        let prompt: Vec<u32> = (0..2048 * BLOCK as u32).collect();
        b.iter(|| black_box(block_keys(&context, black_box(&prompt), BLOCK as u32)))
    });
    group.finish();
}

/// Blocks of a 400 KB chat prompt (~100k tokens at 16 tokens a block) and how many of them a
/// warm request shares with the previous one (95%).
const WARM_BLOCKS: usize = 6_250;
const WARM_SHARED: usize = 5_937;

/// A warm prompt: the shared bundle, then a tail of its own (`tail` picks it).
fn warm_prompt(tail: u32) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..(WARM_SHARED * BLOCK) as u32)
        .map(|t| t.wrapping_mul(2_654_435_761))
        .collect();
    tokens.extend(
        (0..((WARM_BLOCKS - WARM_SHARED) * BLOCK) as u32)
            .map(|t| (tail << 16 | t).wrapping_mul(40_503)),
    );
    tokens
}

/// An index that knows pod 0 (block size [`BLOCK`]); `precise`: the pod publishes events
/// (an empty event batch says so).
fn one_pod_index(precise: bool) -> PrefixIndex {
    let index = PrefixIndex::new(IndexConfig::default());
    index.set_pod_block_size(pod(0), BLOCK as u32);
    if precise {
        let batch = EventBatch {
            ts: 0.0,
            events: vec![],
            dp_rank: None,
        };
        index.apply_batch(pod(0), "m", &batch);
    }
    index
}

/// A record bench's next request (`prompt` of the next number): its keys, computed, and its
/// lookup, as on the request path. Speculative entries live 2 s: the index starts over
/// (`fresh`) before their bound is near.
fn next_request(
    state: &RefCell<(PrefixIndex, u32)>,
    fresh: impl Fn() -> PrefixIndex,
    context: &KeyContext,
    prompt: fn(u32) -> Vec<u32>,
) -> (PromptKeys, PrefixLookup) {
    let mut state = state.borrow_mut();
    if state.0.speculative_entries() > 400_000 {
        *state = (fresh(), 1);
    }
    state.1 += 1;
    let keys = PromptKeys::exact(context.clone(), prompt(state.1));
    keys.warm(BLOCK as u32);
    let lookup = state.0.lookup(&keys, &[pod(0)]);
    (keys, lookup)
}

/// The routing record of a warm 6,250-block prompt (`PrefixIndex::record_routed` after the
/// request's lookup, its keys already computed, as on the request path): on a pod without
/// events (approximate LRU set, at its default 16,384-block capacity, so it evicts) and on
/// a pod with events (speculative runs). Each iteration is a new request: the same bundle
/// and a new tail.
fn record(c: &mut Criterion) {
    let context = KeyContext::model("m");
    let mut group = c.benchmark_group("record_warm_6250_blocks");
    group.throughput(Throughput::Elements(WARM_BLOCKS as u64));
    for precise in [false, true] {
        let fresh = || {
            let index = one_pod_index(precise);
            index.record_routed_tokens(pod(0), &context, &warm_prompt(0));
            index
        };
        let state = RefCell::new((fresh(), 1u32));
        let name = if precise {
            "speculative"
        } else {
            "approximate"
        };
        group.bench_function(name, |b| {
            b.iter_batched(
                || next_request(&state, fresh, &context, warm_prompt),
                |(keys, lookup)| {
                    state.borrow().0.record_routed(pod(0), &keys, Some(&lookup));
                    (keys, lookup)
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

/// Blocks of a cold 220 KB chat prompt (~56k tokens at 16 tokens a block).
const COLD_BLOCKS: usize = 3_500;

/// A cold prompt: no block shared with any other (`seed` picks it).
fn cold_prompt(seed: u32) -> Vec<u32> {
    (0..(COLD_BLOCKS * BLOCK) as u32)
        .map(|t| (seed.wrapping_mul(1_000_003) ^ t).wrapping_mul(2_246_822_519))
        .collect()
}

/// The routing record of a cold 3,500-block prompt, after its lookup (keys computed), as on
/// the request path: on a pod without events whose approximate set is full (every block added
/// evicts one), and on a pod with events (a new speculative run).
fn record_cold(c: &mut Criterion) {
    let context = KeyContext::model("m");
    let mut group = c.benchmark_group("record_cold_3500_blocks");
    group.throughput(Throughput::Elements(COLD_BLOCKS as u64));
    for precise in [false, true] {
        let fresh = || {
            let index = one_pod_index(precise);
            if !precise {
                // Fill the approximate set to its capacity, so every record evicts.
                for seed in 0..5 {
                    index.record_routed_tokens(pod(0), &context, &cold_prompt(u32::MAX - seed));
                }
            }
            index
        };
        let state = RefCell::new((fresh(), 1u32));
        let mut sweep = vec![0u64; SWEEP_BYTES / 8];
        let pod_kind = if precise {
            "speculative"
        } else {
            "approximate"
        };
        for (warm_caches, caches) in [(true, "warm_caches"), (false, "cold_caches")] {
            group.bench_function(format!("{pod_kind}/{caches}"), |b| {
                b.iter_batched(
                    || {
                        let request = next_request(&state, fresh, &context, cold_prompt);
                        if !warm_caches {
                            // What the request did before its record (tokenizing 220 KB, other
                            // requests) has pushed the index out of the CPU caches.
                            for (i, word) in sweep.iter_mut().enumerate() {
                                *word = word.wrapping_add(i as u64);
                            }
                            black_box(&sweep);
                        }
                        request
                    },
                    |(keys, lookup)| {
                        state.borrow().0.record_routed(pod(0), &keys, Some(&lookup));
                        (keys, lookup)
                    },
                    BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
}

/// Memory written between cold-cache iterations: more than the machine's last-level cache.
const SWEEP_BYTES: usize = 64 << 20;

/// Prints bytes per (block, pod) entry, measured by the counting allocator, for 100 pods at
/// several fill levels (hash tables double, so the figure moves with the fill level): every
/// block held by one pod, and every block held by 10 pods.
fn memory(_: &mut Criterion) {
    for holders_per_block in [1usize, 10] {
        let mut figures = Vec::new();
        for per_pod in [12_000usize, 16_000, 20_000, 24_000, 28_000] {
            let pods = 100;
            let batches: Vec<EventBatch> = (0..pods)
                .map(|i| store_batch((i / holders_per_block) as u32 + 1, 20, per_pod / 20).0)
                .collect();
            let before = LIVE_BYTES.load(Ordering::Relaxed);
            let index = PrefixIndex::new(IndexConfig::default());
            for (i, batch) in batches.iter().enumerate() {
                // Pods in groups of `holders_per_block` store the same chains.
                index.apply_batch(pod(i), "m", batch);
            }
            let bytes = LIVE_BYTES.load(Ordering::Relaxed) - before;
            let entries: usize = (0..pods).map(|i| index.pod_entries(pod(i))).sum();
            let per_entry = bytes as f64 / entries as f64;
            println!(
                "memory: {holders_per_block} pod(s) per block, {entries} (block, pod) entries, \
                 {} distinct blocks: {bytes} bytes allocated, {per_entry:.1} B/entry \
                 (index's own estimate {:.1} B/entry)",
                index.distinct_blocks(),
                index.memory_bytes() as f64 / entries as f64
            );
            figures.push(per_entry);
            drop(index);
        }
        let mean = figures.iter().sum::<f64>() / figures.len() as f64;
        let max = figures.iter().copied().fold(0.0, f64::max);
        println!(
            "memory: {holders_per_block} pod(s) per block: mean {mean:.1} B/entry, max {max:.1} over 1.2–2.8 M entries"
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = memory, decode, ingest, ingest_steady, matching, record, record_cold
}
criterion_main!(benches);
