//! Large chat bodies (220 KB and 400 KB, several at once) through a real Envoy, the real
//! kvpick binary with the shipped tokenizer, and real backends: each arrives byte for byte
//! at the backend kvpick picked, and each was routed and tokenized by kvpick (not failed
//! open, not approximated).

use crate::support;

use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::post_json;
use support::kvpick::Kvpick;

/// A chat body of about `bytes` bytes: a shared system text, then a user turn unique to
/// `seed`. Its strings carry JSON escapes and multi-byte UTF-8, so any re-encoding,
/// shift or loss of a chunk boundary shows as a changed byte.
fn chat_body(bytes: usize, seed: u32) -> Vec<u8> {
    let mut shared = String::with_capacity(bytes);
    let mut i = 0u32;
    while shared.len() < bytes * 95 / 100 {
        // Words of varying length, a quote, a newline and non-ASCII now and then.
        let word_len = 2 + (i.wrapping_mul(2654435761) >> 29) as usize;
        for k in 0..word_len {
            shared.push(char::from(b'a' + ((i as usize * 7 + k * 3) % 26) as u8));
        }
        shared.push_str(match i % 41 {
            0 => "\\n",
            13 => " \\\"quoted\\\" ",
            29 => " 헬로 🦀 ",
            _ => " ",
        });
        i += 1;
    }
    let user: String = (0..bytes / 20)
        .map(|k| char::from(b'a' + ((k as u32 * 11 + seed * 5) % 26) as u8))
        .collect();
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{shared}"}},{{"role":"user","content":"request {seed}: {user}"}}],"max_tokens":1}}"#
    )
    .into_bytes()
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_220kb_and_400kb_chat_bodies_arrive_intact_at_the_picked_backend() {
    concurrent_large_bodies_through(EnvoyOptions::default()).await;
}

/// The same with Envoy holding each body (`request_body_mode: BUFFERED`): kvpick answers the
/// whole body with the pick and sends none of it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_bodies_held_by_envoy_arrive_intact_at_the_picked_backend() {
    concurrent_large_bodies_through(EnvoyOptions {
        request_body_buffered: true,
        ..Default::default()
    })
    .await;
}

async fn concurrent_large_bodies_through(options: EnvoyOptions) {
    let (a, b) = (
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    );
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_string_lossy().into_owned();
    // No fallbacks: the destination header names exactly the backend that must serve.
    let kvpick = Kvpick::start(
        &pool_yaml(&[&a, &b]),
        &["--tokenizer", &tokenizer, "--max-fallbacks", "0"],
    )
    .await;
    let envoy = Envoy::start(&kvpick, options).await;
    let url = envoy.url("/v1/chat/completions");
    let bodies: Vec<Vec<u8>> = (0..4)
        .map(|seed| chat_body(220_000, seed))
        .chain((4..8).map(|seed| chat_body(400_000, seed)))
        .collect();
    assert!(
        bodies[..4]
            .iter()
            .all(|b| (220_000..240_000).contains(&b.len()))
    );
    assert!(
        bodies[4..]
            .iter()
            .all(|b| (400_000..430_000).contains(&b.len()))
    );

    let mut handles = Vec::new();
    for body in bodies.clone() {
        let url = url.clone();
        handles.push(tokio::spawn(async move { post_json(&url, &body).await }));
    }
    for handle in handles {
        let reply = handle.await.expect("join");
        assert_eq!(reply.status, 200, "{}", reply.text());
    }

    let mut arrived = 0;
    for backend in [&a, &b] {
        for seen in backend.seen() {
            arrived += 1;
            // The destination header is set by kvpick alone (the client sent none).
            assert_eq!(
                seen.headers
                    .get("x-gateway-destination-endpoint")
                    .map(|v| v.to_str().unwrap_or_default()),
                Some(backend.addr.to_string().as_str()),
                "routed by kvpick to this backend"
            );
            assert!(
                bodies.iter().any(|b| b.as_slice() == seen.body.as_ref()),
                "a body of {} bytes changed in transit",
                seen.body.len()
            );
        }
    }
    assert_eq!(arrived, bodies.len(), "each request arrived once");
    let metrics = support::http::send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    assert_eq!(
        metric(&metrics, "inference_objective_request_total{"),
        bodies.len() as f64,
        "every request was picked by kvpick"
    );
    assert_eq!(
        metric(&metrics, "inference_objective_request_error_total{"),
        0.0
    );
    assert_eq!(
        metric(&metrics, "kvpick_tokenize_exact_total"),
        bodies.len() as f64,
        "every prompt was tokenized exactly"
    );
}

/// A profile that reads no prompt: load scorers only.
const PROMPT_FREE_PROFILE: &str = "\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: max-score-picker
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_that_reads_no_prompt_routes_without_tokenizing() {
    let a = Backend::start("127.0.0.1").await;
    let tokenizer = support::repo_root().join("assets/tokenizer");
    let tokenizer = tokenizer.to_string_lossy().into_owned();
    let kvpick = Kvpick::start(
        &pool_yaml(&[&a]),
        &[
            "--tokenizer",
            &tokenizer,
            "--config-text",
            PROMPT_FREE_PROFILE,
        ],
    )
    .await;
    let envoy = Envoy::start(&kvpick, EnvoyOptions::default()).await;
    let body = chat_body(400_000, 1);
    let reply = post_json(&envoy.url("/v1/chat/completions"), &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    // Still parsed: a body that is no request keeps its 400.
    let bad = post_json(&envoy.url("/v1/chat/completions"), br#"{"model":"m"}"#).await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    let seen = a.seen();
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].body.as_ref() == body.as_slice(),
        "body changed in transit"
    );
    assert_eq!(
        seen[0].headers.get("x-gateway-destination-endpoint"),
        Some(&a.addr.to_string().parse().expect("header value"))
    );
    let metrics = support::http::send("GET", &kvpick.metrics_url("/metrics"), &[], Vec::new())
        .await
        .expect("metrics")
        .text();
    assert_eq!(metric(&metrics, "inference_objective_request_total{"), 1.0);
    assert_eq!(
        metric(&metrics, "kvpick_tokenize_exact_total"),
        0.0,
        "no prompt tokenized"
    );
    assert_eq!(metric(&metrics, "kvpick_tokenize_approximate_total"), 0.0);
    assert_eq!(
        metric(
            &metrics,
            "kvpick_request_stage_seconds_count{stage=\"parse\"}"
        ),
        1.0,
        "parsed once (the 400 stops before its stage is counted)"
    );
}
