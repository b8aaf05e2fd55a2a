//! Huge prompts through the real kvpick binary (with the Qwen2 tokenizer) and a real Envoy:
//! 16 MB prompts without a space are routed, and preparing three at once stays within a
//! memory bound (peak RSS of the kvpick process, `VmHWM`); 16 MB prompts of words wait
//! their turn to be tokenized.

use crate::support;

use std::time::Instant;

use support::backend::Backend;
use support::envoy::{Envoy, EnvoyOptions};
use support::http::post_json;
use support::kvpick::Kvpick;

/// Prompt bytes: 16 MB of letters, no space, under the default 16 MiB body limit.
const PROMPT_BYTES: usize = 16_000_000;

/// A body whose prompt is `PROMPT_BYTES` pseudo-random lowercase letters (one pre-token).
fn no_space_body(seed: u64) -> Vec<u8> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut body = Vec::with_capacity(PROMPT_BYTES + 64);
    body.extend_from_slice(br#"{"model":"m","prompt":""#);
    for _ in 0..PROMPT_BYTES {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        body.push(b'a' + ((state >> 33) % 26) as u8);
    }
    body.extend_from_slice(br#""}"#);
    body
}

/// A body whose prompt is `PROMPT_BYTES` of words (from a 2,197-word vocabulary) and
/// spaces: text that tokenizes exactly, all of it.
fn words_body(seed: u64) -> Vec<u8> {
    const SYLLABLES: [&str; 13] = [
        "ka", "lo", "mer", "tin", "os", "va", "ble", "ri", "dun", "se", "pha", "gor", "ul",
    ];
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut body = Vec::with_capacity(PROMPT_BYTES + 64);
    body.extend_from_slice(br#"{"model":"m","prompt":""#);
    let end = PROMPT_BYTES + body.len() - 16;
    while body.len() < end {
        for _ in 0..3 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            body.extend_from_slice(SYLLABLES[((state >> 33) % 13) as usize].as_bytes());
        }
        body.push(if (state >> 20).is_multiple_of(11) {
            b'.'
        } else {
            b' '
        });
    }
    body.extend_from_slice(br#""}"#);
    body
}

/// A `/proc/PID/status` figure of kvpick (`VmHWM:` peak, `VmRSS:` now), in MB.
fn status_mb(kvpick: &Kvpick, key: &str) -> u64 {
    kvpick.status_kib(key) / 1024
}

/// kvpick's peak resident memory so far, in MB.
fn peak_rss_mb(kvpick: &Kvpick) -> u64 {
    status_mb(kvpick, "VmHWM:")
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_concurrent_16mb_no_space_prompts_are_routed_within_a_memory_bound() {
    let backend = Backend::start("127.0.0.1").await;
    let pool = format!("endpoints:\n  - address: {}\n", backend.addr);
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_string_lossy().into_owned();
    let kvpick = Kvpick::start(&pool, &["--tokenizer", &tokenizer]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    let bodies: Vec<Vec<u8>> = (0..3).map(no_space_body).collect();
    let idle = peak_rss_mb(&kvpick);

    let started = Instant::now();
    let reply = post_json(&url, &bodies[0]).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let one = (started.elapsed(), peak_rss_mb(&kvpick));

    let started = Instant::now();
    let mut handles = Vec::new();
    for body in bodies {
        let url = url.clone();
        handles.push(tokio::spawn(async move { post_json(&url, &body).await }));
    }
    for handle in handles {
        let reply = handle.await.expect("join");
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let three = (started.elapsed(), peak_rss_mb(&kvpick));
    eprintln!(
        "peak RSS: idle {idle} MB; one 16 MB prompt {} MB in {:?}; then three at once {} MB in {:?}",
        one.1, one.0, three.1, three.0
    );
    assert_eq!(backend.seen().len(), 4, "every request reached the backend");
    // NOTE: a memory bound, not a timing one. Before the bound the BPE of one 16 MB
    // pre-token alone peaked above 1 GB.
    assert!(three.1 < 600, "peak RSS {} MB", three.1);
    let metrics = support::http::send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    assert!(
        metric(&metrics, "kvpick_tokenize_cut_prompts_total ") >= 4.0,
        "the cuts are counted"
    );
}

/// Eight 16 MB prompts of words at once: the body budget admits them all, but at most
/// `--max-preparing-bytes` (32 MiB: two) are tokenized at a time; the others wait and are
/// routed after. Measured peak RSS: 1,171 MB without the gate, 999 MB with it (the rest is
/// the bodies themselves and the prefix-token and long-string caches, bounded by their own
/// budgets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_16mb_word_prompts_wait_for_the_prepare_gate_and_are_routed() {
    let backend = Backend::start("127.0.0.1").await;
    let pool = format!("endpoints:\n  - address: {}\n", backend.addr);
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_string_lossy().into_owned();
    let kvpick = Kvpick::start(&pool, &["--tokenizer", &tokenizer]).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    let idle = peak_rss_mb(&kvpick);
    let started = Instant::now();
    let mut handles = Vec::new();
    for seed in 0..8 {
        let url = url.clone();
        let body = words_body(seed);
        handles.push(tokio::spawn(async move { post_json(&url, &body).await }));
    }
    for handle in handles {
        let reply = handle.await.expect("join");
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let peak = peak_rss_mb(&kvpick);
    eprintln!(
        "peak RSS: idle {idle} MB; eight 16 MB word prompts at once {peak} MB in {:?}",
        started.elapsed()
    );
    assert_eq!(backend.seen().len(), 8, "every request reached the backend");
    let metrics = support::http::send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    assert!(
        metric(&metrics, "kvpick_tokenize_prepare_waits_total ") >= 1.0,
        "some bodies waited for the gate"
    );
    assert_eq!(
        metric(&metrics, "kvpick_tokenize_preparing_bytes "),
        0.0,
        "every permit was returned"
    );
    assert!(peak < 1536, "peak RSS {peak} MB");
}

/// After six 16 MB prompts of words (with the token caches off, so nothing is held by
/// design), kvpick's resident memory falls back: the allocator's freed pages are returned.
/// Measured (debug build): idle 189 MB and 428 MB after, before `malloc_trim`; idle 98 MB and
/// 245 MB after, with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_freed_by_large_prompts_is_returned() {
    let backend = Backend::start("127.0.0.1").await;
    let pool = format!("endpoints:\n  - address: {}\n", backend.addr);
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_string_lossy().into_owned();
    let args = ["--tokenizer", &tokenizer, "--prefix-token-cache-bytes", "0"];
    let kvpick = Kvpick::start(&pool, &args).await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    let idle = status_mb(&kvpick, "VmRSS:");
    for round in 0..2 {
        let mut handles = Vec::new();
        for seed in 0..3 {
            let url = url.clone();
            let body = words_body(100 + round * 10 + seed);
            handles.push(tokio::spawn(async move { post_json(&url, &body).await }));
        }
        for handle in handles {
            let reply = handle.await.expect("join");
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
    }
    let peak = peak_rss_mb(&kvpick);
    // The trim runs on a 1 s timer: poll (bounded) for resident memory to fall.
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    let mut now = status_mb(&kvpick, "VmRSS:");
    while now > 340 && Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        now = status_mb(&kvpick, "VmRSS:");
    }
    eprintln!("RSS: idle {idle} MB, peak {peak} MB, after six 16 MB prompts {now} MB");
    assert!(
        now <= 340,
        "{now} MB still resident (idle {idle} MB, peak {peak} MB)"
    );
}
