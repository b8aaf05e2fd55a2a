//! Memory under many concurrent large bodies through the real kvpick binary and a real
//! Envoy: kvpick's peak resident memory grows with the bytes in flight, not with how many
//! threads happened to allocate and free them (issue 16).

use crate::support;

use support::backend::Backend;
use support::envoy::{Envoy, EnvoyOptions};
use support::http::post_json;
use support::kvpick::Kvpick;

/// Bodies sent at once, and each one's bytes (a 220 KB chat-sized prompt).
const BODIES: usize = 48;
const BODY_BYTES: usize = 225_280;

/// A completion body of `BODY_BYTES` whose prompt is words no other body shares.
fn body(seed: u64) -> Vec<u8> {
    const SYLLABLES: [&str; 13] = [
        "ka", "lo", "mer", "tin", "os", "va", "ble", "ri", "dun", "se", "pha", "gor", "ul",
    ];
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut body = Vec::with_capacity(BODY_BYTES);
    body.extend_from_slice(br#"{"model":"m","prompt":""#);
    while body.len() < BODY_BYTES - 8 {
        for _ in 0..3 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            body.extend_from_slice(SYLLABLES[((state >> 33) % 13) as usize].as_bytes());
        }
        body.push(b' ');
    }
    body.extend_from_slice(br#""}"#);
    body
}

/// glibc malloc heaps besides the main arena in kvpick: anonymous mappings tiling a 64 MiB
/// aligned window exactly (each heap of a non-main arena is reserved as one such window; an
/// arena has one, or a few once it outgrows 64 MiB).
fn malloc_heaps(kvpick: &Kvpick) -> usize {
    const HEAP: u64 = 64 << 20;
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", kvpick.child.id()))
        .expect("read /proc maps");
    let anon: Vec<(u64, u64)> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let range = fields.next()?;
            let inode = fields.nth(3)?;
            (inode == "0" && fields.next().is_none()).then_some(())?;
            let (start, end) = range.split_once('-')?;
            Some((
                u64::from_str_radix(start, 16).ok()?,
                u64::from_str_radix(end, 16).ok()?,
            ))
        })
        .collect();
    anon.iter()
        .enumerate()
        .filter(|(i, (start, _))| {
            if start % HEAP != 0 {
                return false;
            }
            // Contiguous anonymous pieces from `start` ending exactly at the window's end.
            let mut end = *start;
            for (s, e) in &anon[*i..] {
                if *s != end || *e > start + HEAP {
                    break;
                }
                end = *e;
            }
            end == start + HEAP
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_large_bodies_cost_about_the_bytes_in_flight() {
    let backend = Backend::start("127.0.0.1").await;
    let pool = format!("endpoints:\n  - address: {}\n", backend.addr);
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_string_lossy().into_owned();
    // No prefix token cache: what stays resident is then only what the requests hold.
    let kvpick = Kvpick::start(
        &pool,
        &["--tokenizer", &tokenizer, "--prefix-token-cache-bytes", "0"],
    )
    .await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let url = envoy.url("/v1/completions");
    // One body first: the tokenizer's lazily built tables and the first arena are in place.
    let reply = post_json(&url, &body(0)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let idle = kvpick.status_kib("VmRSS:");
    // The peak so far is loading the tokenizer: from here on, VmHWM is the waves' own peak.
    std::fs::write(format!("/proc/{}/clear_refs", kvpick.child.id()), "5")
        .expect("reset kvpick's peak RSS");
    for wave in 0..2u64 {
        let mut handles = Vec::new();
        for i in 0..BODIES as u64 {
            let (url, body) = (url.clone(), body(1 + wave * 1000 + i));
            handles.push(tokio::spawn(async move { post_json(&url, &body).await }));
        }
        for handle in handles {
            let reply = handle.await.expect("join");
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
    }
    let peak = kvpick.status_kib("VmHWM:");
    let in_flight = (BODIES * BODY_BYTES / 1024) as u64;
    eprintln!(
        "kvpick RSS: {} MiB after one body, peak {} MiB with {BODIES} × {BODY_BYTES} B \
         ({} MiB) in flight, two waves",
        idle / 1024,
        peak / 1024,
        in_flight / 1024
    );
    assert_eq!(
        backend.seen().len(),
        1 + 2 * BODIES,
        "every request reached the backend"
    );
    // Every arena keeps its own peak of freed memory: kvpick caps them at one per core
    // (glibc's default is 8 per core), whatever the number of threads that allocated.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let heaps = malloc_heaps(&kvpick);
    eprintln!("malloc heaps besides the main arena: {heaps} ({cores} cores)");
    assert!(
        heaps <= cores + 2,
        "{heaps} malloc heaps besides the main arena on {cores} cores"
    );
    // NOTE: a debug build prepares all 48 bodies at once, each holding ~5× its size (the
    // body, its parsed prompt, its tokens, the reply's copy); the release figures against
    // the goal's bound (2× in flight) are in docs/benchmarks.md. This bounds the rest.
    assert!(
        peak - idle.min(peak) <= 8 * in_flight + 16 * 1024,
        "peak {} MiB over {} MiB idle, {} MiB in flight",
        peak / 1024,
        idle / 1024,
        in_flight / 1024
    );
}
