//! Fidelity against the real vLLM 0.32 CPU capture: the fixture's request sequence (the token
//! ids vLLM used) is replayed through the simulator's engine with the capture's settings
//! (block_size 32, 64 blocks, max_num_seqs 8, sha256), and what is comparable is compared:
//! per request, which prompt blocks were announced and how many were prefix hits, plus the
//! run's totals, for the main (sha256) capture and the sha256_cbor capture. Generated tokens are
//! synthetic, so decode-block hashes cannot match; their counts can. Run with `--nocapture` to
//! print the table used in docs/simulator.md.

// The workspace's one fixture lookup (tests/support/paths.rs).
#[path = "../../../tests/support/paths.rs"]
mod paths;

use std::collections::HashSet;
use std::path::PathBuf;

use kvpick_sim::engine::{Engine, EngineConfig, SimRequest, StepOutput};
use kvpick_sim::events::{EngineHash, EventBatch, EventLayout, KvEvent, event_keys};
use kvpick_sim::hashing::HashAlgo;
use serde_json::Value;

fn dir(capture: &str) -> PathBuf {
    paths::fixtures().join(capture)
}

fn jsonl(capture: &str, name: &str) -> Vec<Value> {
    std::fs::read_to_string(dir(capture).join(name))
        .expect("fixture")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Tally {
    stored_prompt_blocks: HashSet<u64>,
    stored_blocks: usize,
    stored_events: usize,
    removed: usize,
    /// Removed hashes that are some request's prompt block, in order.
    removed_known: Vec<u64>,
}

fn int(h: &EngineHash) -> u64 {
    match h {
        EngineHash::Int(v) => *v,
        EngineHash::Bytes(_) => 0,
    }
}

fn tally_ours(steps: &[StepOutput], prompt_hashes: &HashSet<u64>, known: &HashSet<u64>) -> Tally {
    let mut t = Tally::default();
    for e in steps.iter().flat_map(|s| &s.events) {
        match e {
            KvEvent::BlockStored(s) => {
                t.stored_events += 1;
                t.stored_blocks += s.block_hashes.len();
                t.stored_prompt_blocks.extend(
                    s.block_hashes
                        .iter()
                        .map(int)
                        .filter(|h| prompt_hashes.contains(h)),
                );
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                t.removed += block_hashes.len();
                t.removed_known
                    .extend(block_hashes.iter().map(int).filter(|h| known.contains(h)));
            }
            KvEvent::AllBlocksCleared => {}
        }
    }
    t
}

fn tally_real(
    batches: &[Value],
    indices: &[u64],
    prompt_hashes: &HashSet<u64>,
    known: &HashSet<u64>,
) -> Tally {
    let mut t = Tally::default();
    for b in batches
        .iter()
        .filter(|b| indices.contains(&b["seq"].as_u64().unwrap_or(u64::MAX)))
    {
        for e in b["events"].as_array().expect("events") {
            let hashes: Vec<u64> = e["block_hashes"]
                .as_array()
                .map(|a| a.iter().filter_map(|h| h.as_str()?.parse().ok()).collect())
                .unwrap_or_default();
            match e["type"].as_str() {
                Some("BlockStored") => {
                    t.stored_events += 1;
                    t.stored_blocks += hashes.len();
                    t.stored_prompt_blocks
                        .extend(hashes.into_iter().filter(|h| prompt_hashes.contains(h)));
                }
                Some("BlockRemoved") => {
                    t.removed += hashes.len();
                    t.removed_known
                        .extend(hashes.into_iter().filter(|h| known.contains(h)));
                }
                _ => {}
            }
        }
    }
    t
}

/// Position of the first real `BlockStored` event that announces `request`'s first block.
fn first_announcement(batches: &[Value], request: &Value) -> usize {
    let first = request["prompt_block_hashes"][0]
        .as_str()
        .unwrap_or_default();
    batches
        .iter()
        .flat_map(|b| b["events"].as_array().cloned().unwrap_or_default())
        .position(|e| {
            e["type"] == "BlockStored"
                && e["block_hashes"]
                    .as_array()
                    .is_some_and(|h| h.iter().any(|h| h.as_str() == Some(first)))
        })
        .unwrap_or(usize::MAX)
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .expect("metric present")
}

#[test]
fn replaying_the_main_capture_matches_the_real_engine() {
    let evictions = replay_capture("vllm-0.32-kv-events", HashAlgo::Sha256);
    assert!(evictions > 150, "{evictions}");
}

#[test]
fn replaying_the_sha256_cbor_capture_matches_the_real_engine() {
    let evictions = replay_capture("vllm-0.32-kv-events-sha256cbor", HashAlgo::Sha256Cbor);
    assert!(evictions > 30, "{evictions}");
}

/// Replays one capture's requests and asserts what is comparable; returns the number of
/// prompt-block evictions compared in order.
fn replay_capture(capture: &str, algo: HashAlgo) -> usize {
    let requests = jsonl(capture, "requests.jsonl");
    let batches = jsonl(capture, "expected.jsonl");
    let mut engine = Engine::new(EngineConfig {
        block_size: 32,
        num_gpu_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 2048,
        max_model_len: 1536,
        hash_algo: algo,
        ..EngineConfig::default()
    });
    println!(
        "| i | label | prompt blocks | hit blocks real / sim | prompt blocks stored real / sim | blocks stored real / sim | removed real / sim |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut sim_key_sets: HashSet<Vec<String>> = HashSet::new();
    let known: HashSet<u64> = requests
        .iter()
        .flat_map(|r| {
            r["prompt_block_hashes"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|h| h.as_str()?.parse().ok())
        .collect();
    let (mut same_removed, mut known_evictions, mut batch_checks) = (0, 0, 0);
    let mut i = 0;
    let (mut same_prompt_sets, mut same_hits, mut compared) = (0, 0, 0);
    let (
        mut real_stored_total,
        mut sim_stored_total,
        mut real_removed_total,
        mut sim_removed_total,
    ) = (0, 0, 0, 0);
    while i < requests.len() {
        // Requests flagged concurrent ran together: submit the group, then run it.
        let mut group: Vec<&Value> = if requests[i]["concurrent"].as_bool() == Some(true) {
            requests[i..]
                .iter()
                .take_while(|r| r["concurrent"].as_bool() == Some(true))
                .collect()
        } else {
            vec![&requests[i]]
        };
        // Concurrent requests reached the real engine in an order the client did not control
        // (its API server tokenizes them concurrently): submit them in the order the engine
        // announced their first blocks, i.e. the order it admitted them.
        group.sort_by_key(|r| first_announcement(&batches, r));
        let mut prompt_hashes = HashSet::new();
        let mut prompt_blocks = 0;
        for r in &group {
            let body = &r["body"];
            let full_report = body["vllm_xargs"]["kv_cache_report_mode"].as_str() == Some("full");
            engine
                .add_request(SimRequest {
                    prompt: r["prompt_token_ids"]
                        .as_array()
                        .expect("ids")
                        .iter()
                        .map(|v| v.as_u64().expect("id") as u32)
                        .collect(),
                    max_tokens: r["usage"]["completion_tokens"].as_u64().expect("usage") as usize,
                    cache_salt: body["cache_salt"].as_str().map(str::to_owned),
                    session_id: body["session_id"].as_str().map(str::to_owned),
                    full_report,
                    ..SimRequest::default()
                })
                .expect("admitted");
            let hashes = r["prompt_block_hashes"].as_array().expect("hashes");
            prompt_blocks += hashes.len();
            prompt_hashes.extend(
                hashes
                    .iter()
                    .filter_map(|h| h.as_str()?.parse::<u64>().ok()),
            );
        }
        let mut steps = Vec::new();
        while engine.has_work() {
            steps.push(engine.step());
        }
        for step in steps.iter().filter(|s| !s.events.is_empty()) {
            let payload = EventBatch {
                ts: 0.0,
                events: step.events.clone(),
                data_parallel_rank: Some(0),
            }
            .encode(EventLayout::Map);
            sim_key_sets.extend(event_keys(&payload).expect("sim payload decodes"));
        }
        let hit_sim: usize = steps
            .iter()
            .flat_map(|s| &s.tokens)
            .filter(|t| t.index == 0)
            .map(|t| t.cached_tokens / 32)
            .sum();
        let indices: Vec<u64> = group
            .iter()
            .flat_map(|r| r["event_indices"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_u64())
            .collect();
        let real = tally_real(&batches, &indices, &prompt_hashes, &known);
        let ours = tally_ours(&steps, &prompt_hashes, &known);
        same_removed += usize::from(real.removed == ours.removed);
        // A sequential request publishes as many batches (engine steps with events) as the real one.
        let sim_batches = steps.iter().filter(|s| !s.events.is_empty()).count();
        if group.len() == 1 {
            assert_eq!(sim_batches, indices.len(), "batches of request {i}");
            batch_checks += 1;
        }
        // The exact eviction order of prompt blocks agrees too.
        assert_eq!(
            real.removed_known, ours.removed_known,
            "eviction order at request {i}"
        );
        known_evictions += real.removed_known.len();
        // Real hits: prompt blocks that the request did not have to store (full-report
        // requests re-announce their hits, so count those from the sim's own definition).
        let full_report = group.iter().any(|r| r["body"]["vllm_xargs"].is_object());
        let hit_real = if full_report {
            hit_sim
        } else {
            prompt_blocks - real.stored_prompt_blocks.len()
        };
        compared += 1;
        same_prompt_sets += usize::from(real.stored_prompt_blocks == ours.stored_prompt_blocks);
        same_hits += usize::from(hit_real == hit_sim);
        real_stored_total += real.stored_blocks;
        sim_stored_total += ours.stored_blocks;
        real_removed_total += real.removed;
        sim_removed_total += ours.removed;
        let label = group
            .iter()
            .map(|r| r["label"].as_str().unwrap_or("?"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {} | {} | {} | {} / {} | {} / {} | {} / {} | {} / {} |",
            i,
            label,
            prompt_blocks,
            hit_real,
            hit_sim,
            real.stored_prompt_blocks.len(),
            ours.stored_prompt_blocks.len(),
            real.stored_blocks,
            ours.stored_blocks,
            real.removed,
            ours.removed
        );
        i += group.len();
    }
    let stats = engine.stats();
    let final_metrics =
        std::fs::read_to_string(dir(capture).join("metrics-final.txt")).expect("metrics");
    let real_queries = metric(&final_metrics, "vllm:prefix_cache_queries_total{");
    let real_hits = metric(&final_metrics, "vllm:prefix_cache_hits_total{");
    println!(
        "\ntotals: blocks stored real {real_stored_total} / sim {sim_stored_total}; removed real {real_removed_total} / sim {sim_removed_total}"
    );
    println!(
        "prefix_cache_queries_total real {real_queries} / sim {}; prefix_cache_hits_total real {real_hits} / sim {}",
        stats.prefix_queries, stats.prefix_hits
    );
    println!(
        "requests (groups) compared {compared}: same prompt blocks announced {same_prompt_sets}, same hit blocks {same_hits}, same evictions {same_removed}; prompt-block evictions compared in order: {known_evictions}"
    );

    // Every event shape the simulator emitted (key names, in wire order) is one the real
    // engine emitted in this run, and every real shape was produced.
    let mut real_key_sets: HashSet<Vec<String>> = HashSet::new();
    for b in &batches {
        for e in b["events"].as_array().expect("events") {
            real_key_sets.insert(e.as_object().expect("map").keys().cloned().collect());
        }
    }
    assert_eq!(sim_key_sets, real_key_sets, "event field sets");

    // What must agree: the prompt blocks each request announces and the hits it gets, for
    // every request or concurrent group; the queries counted; the hits to within 2%.
    assert_eq!(same_prompt_sets, compared, "prompt blocks announced");
    assert_eq!(same_hits, compared, "hit blocks");
    assert_eq!(stats.prefix_queries, real_queries);
    let diff = (stats.prefix_hits as f64 - real_hits as f64).abs() / real_hits as f64;
    assert!(
        diff < 0.02,
        "hits real {real_hits} sim {}",
        stats.prefix_hits
    );
    // Block counts (prompt + decode blocks): within 5%.
    let stored_diff =
        (sim_stored_total as f64 - real_stored_total as f64).abs() / real_stored_total as f64;
    assert!(
        stored_diff < 0.05,
        "stored real {real_stored_total} sim {sim_stored_total}"
    );
    // Evictions: the same count for every request/group, and (checked above) the same prompt
    // blocks evicted in the same order for every sequential request.
    assert_eq!(same_removed, compared, "removed per request");
    assert_eq!(sim_removed_total, real_removed_total);
    let sequential = requests
        .iter()
        .filter(|r| r["concurrent"].as_bool() != Some(true))
        .count();
    assert_eq!(batch_checks, sequential);
    known_evictions
}
