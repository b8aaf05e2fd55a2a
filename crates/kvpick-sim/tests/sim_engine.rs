//! Engine-model tests: the deterministic core, stepped synchronously (no clock involved).

use std::time::Duration;

use kvpick_sim::engine::{Engine, EngineConfig, SimRequest, StepOutput};
use kvpick_sim::events::{EngineHash, KvEvent};
use kvpick_sim::hashing::low64;

fn cfg(num_gpu_blocks: usize) -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_gpu_blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: 2048,
        ..EngineConfig::default()
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 100 + seed * 1000 + i).collect()
}

fn req(tokens: Vec<u32>, max_tokens: usize) -> SimRequest {
    SimRequest {
        prompt: tokens,
        max_tokens,
        ..SimRequest::default()
    }
}

/// Steps until idle; returns every step's output.
fn run(engine: &mut Engine) -> Vec<StepOutput> {
    let mut steps = Vec::new();
    for _ in 0..10_000 {
        if !engine.has_work() {
            return steps;
        }
        steps.push(engine.step());
    }
    panic!("engine did not drain");
}

fn stored(steps: &[StepOutput]) -> Vec<u64> {
    steps
        .iter()
        .flat_map(|s| &s.events)
        .filter_map(|e| match e {
            KvEvent::BlockStored(b) => Some(b.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .filter_map(|h| match h {
            EngineHash::Int(v) => Some(v),
            EngineHash::Bytes(_) => None,
        })
        .collect()
}

fn removed(steps: &[StepOutput]) -> Vec<u64> {
    steps
        .iter()
        .flat_map(|s| &s.events)
        .filter_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .filter_map(|h| match h {
            EngineHash::Int(v) => Some(v),
            EngineHash::Bytes(_) => None,
        })
        .collect()
}

fn total(steps: &[StepOutput]) -> Duration {
    steps.iter().map(|s| s.duration).sum()
}

#[test]
fn repeated_prefix_is_a_cache_hit_and_cheaper() {
    let mut engine = Engine::new(cfg(64));
    let p = prompt(1, 100);
    engine.add_request(req(p.clone(), 4)).expect("admit");
    let first = run(&mut engine);
    let announced = stored(&first);
    let expected: Vec<u64> = engine
        .block_digests(&p, None, None)
        .iter()
        .map(low64)
        .collect();
    assert_eq!(expected.len(), 6);
    assert_eq!(
        &announced[..6],
        &expected[..],
        "prompt blocks announced with vLLM's hashes"
    );
    assert_eq!(first.iter().flat_map(|s| &s.tokens).count(), 4);

    engine.add_request(req(p.clone(), 4)).expect("admit");
    let second = run(&mut engine);
    let first_token = second.iter().flat_map(|s| &s.tokens).next().expect("token");
    assert_eq!(first_token.cached_tokens, 96);
    assert!(
        stored(&second).is_empty(),
        "reused blocks are not re-announced"
    );
    assert!(
        total(&second) < total(&first),
        "{:?} vs {:?}",
        total(&second),
        total(&first)
    );
    assert_eq!(
        second[0].prefill_tokens, 4,
        "only the uncached tail is computed"
    );
    let stats = engine.stats();
    assert_eq!((stats.prefix_queries, stats.prefix_hits), (200, 96));
    assert_eq!(
        stats.kv_usage, 0.0,
        "idle usage is 0 even with cached blocks"
    );
    assert!(stats.cached_blocks >= 6);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut engine = Engine::new(cfg(64));
    let p = prompt(2, 64);
    engine.add_request(req(p.clone(), 1)).expect("admit");
    run(&mut engine);
    engine.add_request(req(p, 1)).expect("admit");
    let steps = run(&mut engine);
    // 64 tokens = 4 full blocks, but at most len-1 tokens may hit: 3 blocks.
    assert_eq!(steps[0].tokens[0].cached_tokens, 48);
    assert_eq!(steps[0].prefill_tokens, 16);
    // The recomputed last block is stored again (vLLM does not deduplicate).
    assert_eq!(stored(&steps).len(), 1);
}

#[test]
fn eviction_is_lru_and_tail_first() {
    // 13 usable blocks (+ null block); each request holds 4 blocks of prompt.
    let mut engine = Engine::new(cfg(14));
    let prompts: Vec<Vec<u32>> = (0..3).map(|s| prompt(10 + s, 64)).collect();
    for p in &prompts {
        engine.add_request(req(p.clone(), 1)).expect("admit");
        let steps = run(&mut engine);
        assert!(removed(&steps).is_empty());
    }
    // A fourth 4-block prompt needs 4 blocks while only 1 block was never used: evict 3 blocks
    // of the least recently freed request (prompt 0), its tail first.
    engine.add_request(req(prompt(20, 64), 1)).expect("admit");
    let steps = run(&mut engine);
    let hashes0: Vec<u64> = engine
        .block_digests(&prompts[0], None, None)
        .iter()
        .map(low64)
        .collect();
    assert_eq!(removed(&steps), vec![hashes0[3], hashes0[2], hashes0[1]]);
    // Prompt 0 kept only its first block; its 3 new blocks come from the next least recently
    // freed request (prompt 1), tail first, while prompt 2 stays cached.
    engine
        .add_request(req(prompts[0].clone(), 1))
        .expect("admit");
    let steps = run(&mut engine);
    assert_eq!(steps[0].tokens[0].cached_tokens, 16);
    let hashes1: Vec<u64> = engine
        .block_digests(&prompts[1], None, None)
        .iter()
        .map(low64)
        .collect();
    assert_eq!(removed(&steps), vec![hashes1[3], hashes1[2], hashes1[1]]);
    engine
        .add_request(req(prompts[2].clone(), 1))
        .expect("admit");
    assert_eq!(run(&mut engine)[0].tokens[0].cached_tokens, 48);
}

#[test]
fn blocks_of_running_requests_are_pinned() {
    let mut engine = Engine::new(cfg(14));
    let long = prompt(30, 64);
    let long_hashes: Vec<u64> = engine
        .block_digests(&long, None, None)
        .iter()
        .map(low64)
        .collect();
    engine.add_request(req(long.clone(), 100)).expect("admit");
    let mut all = vec![engine.step()];
    // While it decodes, churn through other prompts that need the rest of the cache.
    for s in 0..6 {
        engine
            .add_request(req(prompt(40 + s, 48), 1))
            .expect("admit");
        for _ in 0..3 {
            all.push(engine.step());
        }
    }
    assert!(!removed(&all).is_empty(), "churn evicted something");
    for h in &long_hashes {
        assert!(!removed(&all).contains(h), "pinned block {h} evicted");
    }
    assert!(engine.stats().kv_usage > 0.0);
}

#[test]
fn overload_queues_requests_fcfs() {
    let mut config = cfg(256);
    config.max_num_seqs = 2;
    let mut engine = Engine::new(config);
    for s in 0..5 {
        engine
            .add_request(req(prompt(50 + s, 40), 8))
            .expect("admit");
    }
    engine.step();
    let stats = engine.stats();
    assert_eq!((stats.running, stats.waiting), (2, 3));
    let mut first_token_step = Vec::new();
    let mut step_no = 1;
    while engine.has_work() {
        for t in engine.step().tokens {
            if t.index == 0 {
                first_token_step.push((t.id, step_no));
            }
        }
        step_no += 1;
    }
    let ids: Vec<u64> = first_token_step.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, vec![2, 3, 4], "FCFS admission");
    assert!(first_token_step[2].1 > first_token_step[0].1);
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut config = cfg(64);
    config.max_num_batched_tokens = 64;
    let mut engine = Engine::new(config);
    engine.add_request(req(prompt(60, 200), 2)).expect("admit");
    let steps = run(&mut engine);
    let prefill: Vec<usize> = steps.iter().map(|s| s.prefill_tokens).collect();
    assert_eq!(&prefill[..4], &[64, 64, 64, 8]);
    assert!(steps[..3].iter().all(|s| s.tokens.is_empty()));
    assert_eq!(steps[3].tokens.len(), 1);
    assert_eq!(stored(&steps).len(), 12);
}

#[test]
fn kv_exhaustion_preempts_and_everything_completes() {
    // 9 usable blocks; two requests that each grow to 5 blocks cannot both run.
    let mut engine = Engine::new(cfg(10));
    engine.add_request(req(prompt(70, 40), 40)).expect("admit");
    engine.add_request(req(prompt(71, 40), 40)).expect("admit");
    let steps = run(&mut engine);
    assert!(engine.stats().preemptions > 0);
    assert_eq!(steps.iter().flat_map(|s| &s.tokens).count(), 80);
    assert!(
        engine.add_request(req(prompt(72, 100), 100)).is_err(),
        "larger than the cache"
    );
}

#[test]
fn salt_changes_every_hash_and_shows_in_extra_keys() {
    let mut engine = Engine::new(cfg(64));
    let p = prompt(80, 40);
    engine
        .add_request(SimRequest {
            cache_salt: Some("tenant-a".into()),
            ..req(p.clone(), 1)
        })
        .expect("admit");
    let steps = run(&mut engine);
    let KvEvent::BlockStored(event) = &steps[0].events[0] else {
        panic!("expected BlockStored");
    };
    assert_eq!(
        event.extra_keys,
        Some(vec![Some(vec!["tenant-a".to_owned()]), None])
    );
    let plain: Vec<u64> = engine
        .block_digests(&p, None, None)
        .iter()
        .map(low64)
        .collect();
    for h in stored(&steps) {
        assert!(!plain.contains(&h));
    }
    assert_eq!(event.medium.as_deref(), Some("GPU"));
    assert_eq!(event.parent_block_hash, None);
    assert_eq!(event.token_ids, p[..32].to_vec());
}

mod paused_time {
    use std::sync::Arc;
    use std::time::Duration;

    use kvpick_sim::engine::{EngineConfig, SimRequest, StepCost};
    use kvpick_sim::pod::{Faults, Pod, PodConfig, collect};
    use tokio::time::Instant;

    fn pod_config(max_num_seqs: usize) -> PodConfig {
        PodConfig {
            model: "sim-model".into(),
            engine: EngineConfig {
                block_size: 16,
                num_gpu_blocks: 256,
                max_num_seqs,
                cost: StepCost {
                    overhead: Duration::from_millis(5),
                    per_prefill_token: Duration::from_micros(100),
                    per_decode_seq: Duration::from_millis(1),
                    lora_load: Duration::from_millis(20),
                },
                ..EngineConfig::default()
            },
            time_scale: 1.0,
            publisher: None,
        }
    }

    fn request(len: u32, max_tokens: usize) -> SimRequest {
        SimRequest {
            prompt: (0..len).map(|i| 500 + i).collect(),
            max_tokens,
            ..SimRequest::default()
        }
    }

    /// Asserts `t` is `expected` up to tokio's 1 ms timer resolution.
    fn assert_close(t: Duration, expected: Duration) {
        assert!(
            t >= expected && t < expected + Duration::from_millis(1),
            "{t:?} vs {expected:?}"
        );
    }

    /// Time to first token of one request, on tokio's (paused) clock.
    async fn ttft(pod: &Pod, req: SimRequest) -> Duration {
        let start = Instant::now();
        let mut stream = pod.submit(req).await.expect("submit");
        stream.next().await.expect("first token");
        let t = start.elapsed();
        while stream.next().await.is_some_and(|t| t.finish.is_none()) {}
        t
    }

    #[tokio::test(start_paused = true)]
    async fn ttft_follows_the_cost_model_and_a_cached_prefix_is_cheaper() {
        let (pod, _task) = Pod::start(pod_config(8), Arc::new(Faults::default()))
            .await
            .expect("pod");
        // 200 prompt tokens: 5 ms + 200 × 0.1 ms = 25 ms.
        assert_eq!(ttft(&pod, request(200, 3)).await, Duration::from_millis(25));
        // 192 of them cached: 5 ms + 8 × 0.1 ms.
        assert_close(
            ttft(&pod, request(200, 3)).await,
            Duration::from_micros(5_800),
        );
        let stats = pod.stats();
        assert_eq!((stats.prefix_queries, stats.prefix_hits), (400, 192));
        // Slow-down fault doubles step time.
        pod.faults.set_slowdown(2.0);
        assert_close(
            ttft(&pod, request(200, 3)).await,
            Duration::from_micros(11_600),
        );
        let text = kvpick_sim::metrics::render(&pod.registry);
        assert!(
            text.contains(
                "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"sim-model\"} 3"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"sim-model\"} 384"
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn overload_builds_a_queue_and_delays_first_tokens() {
        let (pod, _task) = Pod::start(pod_config(1), Arc::new(Faults::default()))
            .await
            .expect("pod");
        let start = Instant::now();
        let a = pod.submit(request(100, 10)).await.expect("a");
        let b = pod.submit(SimRequest {
            prompt: (0..100).map(|i| 9000 + i).collect(),
            max_tokens: 10,
            ..SimRequest::default()
        });
        let b = b.await.expect("b");
        tokio::task::yield_now().await;
        let handle_b = tokio::spawn(async move {
            let mut b = b;
            b.next().await.expect("b first");
            let t = Instant::now();
            while b.next().await.is_some_and(|t| t.finish.is_none()) {}
            t
        });
        let tokens_a = collect(a).await;
        let a_done = Instant::now();
        assert_eq!(tokens_a.len(), 10);
        let b_first = handle_b.await.expect("join");
        assert!(b_first > a_done, "b waited for a's slot");
        // a: 15 ms prefill step + 9 decode steps of 6 ms; b's first token one prefill later.
        assert_eq!(a_done - start, Duration::from_millis(15 + 9 * 6));
        assert_eq!(b_first - start, Duration::from_millis(15 + 9 * 6 + 15));
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_a_stream_aborts_and_restart_empties_the_cache() {
        let (pod, _task) = Pod::start(pod_config(8), Arc::new(Faults::default()))
            .await
            .expect("pod");
        let mut s = pod.submit(request(64, 1000)).await.expect("submit");
        s.next().await.expect("token");
        assert_eq!(pod.stats().running, 1);
        drop(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(pod.stats().running, 0, "aborted");
        assert!(pod.stats().cached_blocks >= 4);
        pod.restart().await;
        assert_eq!(pod.stats().cached_blocks, 0);
        assert_close(
            ttft(&pod, request(64, 2)).await,
            Duration::from_micros(5_000 + 6_400),
        );
    }
}

#[test]
fn reset_prefix_cache_clears_only_when_idle_and_announces_it() {
    let mut engine = Engine::new(cfg(64));
    let p = prompt(90, 64);
    engine.add_request(req(p.clone(), 4)).expect("admit");
    engine.step();
    assert!(
        !engine.reset_prefix_cache(),
        "blocks in use: refused, like vLLM"
    );
    run(&mut engine);
    assert!(engine.reset_prefix_cache());
    assert_eq!(engine.stats().cached_blocks, 0);
    engine.add_request(req(p, 1)).expect("admit");
    let steps = run(&mut engine);
    assert_eq!(steps[0].tokens[0].cached_tokens, 0);
    // Announced with the next step's batch, ahead of that step's stores (vLLM 0.32).
    assert_eq!(steps[0].events.first(), Some(&KvEvent::AllBlocksCleared));
    assert!(
        steps[0].events[1..]
            .iter()
            .all(|e| matches!(e, KvEvent::BlockStored(_))),
        "{:?}",
        steps[0].events
    );
    assert!(
        removed(&steps).is_empty(),
        "cleared blocks are not removed again"
    );
}
