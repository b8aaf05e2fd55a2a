//! parse + template + tokenize for chat bodies of 8 KB, 100 KB and 400 KB:
//! - `cold`: a prompt never seen before (its first bytes differ), through the whole path;
//! - `bare_encode`: the tokenizers crate's `encode` of the same rendered text (the floor);
//! - `warm95`: the first 95% of the prompt was tokenized before (the last 5% is new).
//!
//! The fast encoder's word cache is warm for the corpus' words in `cold` (as it is in a
//! server after a few requests); the stage table also prints a cold encode without it.
//!
//! Run: `cargo bench --bench tokenize`. A ratio summary is printed at the end.
//! `TOKENIZE_PROFILE_WARM=N cargo bench --bench tokenize` instead only runs the 400 KB warm
//! path N times (for `perf record`), with the bodies built beforehand;
//! `TOKENIZE_PROFILE_COLD=N` the same for the cold path.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion};
use kvpick::request::{self, Prompt};
use kvpick::tokenize::{FastEncoder, MergeTable, PromptTokens, Tokenizers, TokenizersConfig};
use random_text::random_token_text;
use serde_json::json;

// Random-token prompts, shared with the tokenizer tests.
#[path = "../tests/support/random_text.rs"]
mod random_text;

const SIZES: [(&str, usize); 3] = [("8KB", 8 << 10), ("100KB", 100 << 10), ("400KB", 400 << 10)];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Natural text (prose + Python) of at least `len` bytes.
fn corpus(len: usize) -> String {
    let base = std::fs::read_to_string(repo().join("../shared/fixtures/tokenizer/corpus.txt"))
        .or_else(|_| std::fs::read_to_string(repo().join("assets/tokenizer/chat_template.jinja")))
        .expect("corpus text");
    let mut out = String::with_capacity(len + base.len());
    while out.len() < len {
        out.push_str(&base);
    }
    let mut end = len;
    while !out.is_char_boundary(end) {
        end -= 1;
    }
    out.truncate(end);
    out
}

fn body(user: &str) -> Vec<u8> {
    json!({
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a careful code reviewer."},
            {"role": "user", "content": user}
        ],
        "max_tokens": 16
    })
    .to_string()
    .into_bytes()
}

fn run(tok: &Tokenizers, body: &[u8]) -> usize {
    let req =
        request::parse_cached("/v1/chat/completions", body, tok.long_strings()).expect("parse");
    match tok.prompt_tokens(&req) {
        PromptTokens::Exact(ids) => ids.len(),
        other => panic!("not exact: {other:?}"),
    }
}

/// Only the 400 KB warm (or cold) path, `n` times, bodies built beforehand (in batches of 64).
fn profile(tok: &Tokenizers, n: usize, warm: bool) {
    let size = 400 << 10;
    let text = corpus(size);
    let prefix_len = (size * 95 / 100..)
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(size);
    let (prefix, tail) = text.split_at(prefix_len);
    let make_body = |i: usize| {
        if warm {
            body(&format!("{prefix}{i} {tail}"))
        } else {
            body(&format!("{i} {text}"))
        }
    };
    run(tok, &body(&format!("{prefix}{} {tail}", usize::MAX)));
    let mut done = 0;
    let mut spent = Duration::ZERO;
    while done < n {
        let bodies: Vec<Vec<u8>> = (done..(done + 64).min(n)).map(make_body).collect();
        let t = Instant::now();
        for b in &bodies {
            black_box(run(tok, b));
        }
        spent += t.elapsed();
        done += bodies.len();
    }
    let name = if warm { "warm" } else { "cold" };
    println!(
        "{name} 400KB: {:.2?} per request over {n}",
        spent / n as u32
    );
}

/// About `len` bytes of Chinese: sentences of 3–12 CJK words drawn from the vocabulary (a fixed
/// seed), ended by full-width punctuation, sometimes a space or a newline.
fn cjk_text(tokenizer: &tokenizers::Tokenizer, len: usize) -> String {
    // GPT-2's byte-level alphabet, inverted: printable bytes map to themselves, the others to
    // U+0100 onwards in order.
    let mut decode = std::collections::HashMap::new();
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("char")
        };
        decode.insert(c, b);
    }
    let mut words: Vec<String> = tokenizer
        .get_vocab(false)
        .keys()
        .filter_map(|t| {
            let bytes: Option<Vec<u8>> = t.chars().map(|c| decode.get(&c).copied()).collect();
            String::from_utf8(bytes?).ok()
        })
        .filter(|w| !w.is_empty() && w.chars().all(|c| ('\u{4e00}'..='\u{9fff}').contains(&c)))
        .collect();
    words.sort();
    let mut rng = fastrand::Rng::with_seed(1);
    let mut out = String::with_capacity(len + 64);
    while out.len() < len {
        for _ in 0..rng.usize(3..=12) {
            out.push_str(&words[rng.usize(..words.len())]);
        }
        out.push(['，', '。', '、', '：', '！', '？', '；'][rng.usize(..7)]);
        out.push_str(["", "", "", " ", "\n"][rng.usize(..5)]);
    }
    out
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let tok = Tokenizers::new(
        TokenizersConfig {
            models: vec![("tiny".into(), repo().join("assets/tokenizer"))],
            prefix_cache_bytes: 256 << 20,
            ..Default::default()
        },
        &prometheus::Registry::new(),
    )
    .expect("tokenizer");
    let model = tok.tokenizer_for("tiny").expect("model");
    for (var, warm) in [
        ("TOKENIZE_PROFILE_WARM", true),
        ("TOKENIZE_PROFILE_COLD", false),
    ] {
        if let Some(n) = std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
        {
            profile(&tok, n, warm);
            return;
        }
    }
    let counter = AtomicUsize::new(0);
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1))
        .configure_from_args();
    let mut summary = Vec::new();
    let mut stages = Vec::new();
    for (name, size) in SIZES {
        let text = corpus(size);
        let prefix_len = (size * 95 / 100..)
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(size);
        let (prefix, tail) = text.split_at(prefix_len);
        let cold_body = |i: usize| body(&format!("{i} {text}"));
        let warm_body = |i: usize| body(&format!("{prefix}{i} {tail}"));
        let rendered = {
            let req = request::parse("/v1/chat/completions", &cold_body(0)).expect("parse");
            let Prompt::Chat(chat) = &req.prompt else {
                panic!("chat")
            };
            model.render(chat).expect("render")
        };
        // Prime: the 95% prefix has been seen before.
        run(&tok, &warm_body(usize::MAX));

        let mut g = c.benchmark_group(format!("tokenize/{name}"));
        g.bench_function("bare_encode", |b| {
            b.iter(|| {
                black_box(
                    model
                        .tokenizer()
                        .encode(rendered.as_str(), false)
                        .unwrap()
                        .len(),
                )
            })
        });
        g.bench_function("cold", |b| {
            b.iter_batched(
                || cold_body(counter.fetch_add(1, Ordering::Relaxed)),
                |body| black_box(run(&tok, &body)),
                BatchSize::PerIteration,
            )
        });
        g.bench_function("warm95", |b| {
            b.iter_batched(
                || warm_body(counter.fetch_add(1, Ordering::Relaxed)),
                |body| black_box(run(&tok, &body)),
                BatchSize::PerIteration,
            )
        });
        g.finish();

        // A plain median over a few runs for the summary table.
        let reps = if size > 200_000 { 7 } else { 15 };
        let mut bare = Vec::new();
        let mut cold = Vec::new();
        let mut warm = Vec::new();
        let mut parse = Vec::new();
        let mut render = Vec::new();
        for _ in 0..reps {
            let b = cold_body(counter.fetch_add(1, Ordering::Relaxed));
            let t = Instant::now();
            let req = request::parse("/v1/chat/completions", &b).expect("parse");
            parse.push(t.elapsed());
            let Prompt::Chat(chat) = &req.prompt else {
                panic!("chat")
            };
            let t = Instant::now();
            black_box(model.render(chat).expect("render").len());
            render.push(t.elapsed());
            let t = Instant::now();
            black_box(
                model
                    .tokenizer()
                    .encode(rendered.as_str(), false)
                    .unwrap()
                    .len(),
            );
            bare.push(t.elapsed());
            let b = cold_body(counter.fetch_add(1, Ordering::Relaxed));
            let t = Instant::now();
            black_box(run(&tok, &b));
            cold.push(t.elapsed());
            let b = warm_body(counter.fetch_add(1, Ordering::Relaxed));
            let t = Instant::now();
            black_box(run(&tok, &b));
            warm.push(t.elapsed());
        }
        // Stage breakdown of the warm path (and the cold encode), medians.
        let mut w_parse = Vec::new();
        let mut w_render = Vec::new();
        let mut w_encode = Vec::new();
        let mut c_encode = Vec::new();
        let mut c_encode_no_words = Vec::new();
        let mut tail_floor = Vec::new();
        let no_word_cache = FastEncoder::new(model.tokenizer())
            .expect("fast path")
            .with_word_cache_capacity(0);
        for _ in 0..reps {
            let i = counter.fetch_add(1, Ordering::Relaxed);
            let b = warm_body(i);
            let t = Instant::now();
            let req = request::parse_cached("/v1/chat/completions", &b, tok.long_strings())
                .expect("parse");
            w_parse.push(t.elapsed());
            let Prompt::Chat(chat) = &req.prompt else {
                panic!("chat")
            };
            let t = Instant::now();
            let text = model.render(chat).expect("render");
            w_render.push(t.elapsed());
            let t = Instant::now();
            black_box(model.encode(&text, false).expect("encode").ids.len());
            w_encode.push(t.elapsed());
            // The floor: encoding only the text after the 95% point, no cache.
            let tail_head = &tail[..tail.len().min(64)];
            let cut = text.rfind(tail_head).expect("tail") - format!("{i} ").len();
            let t = Instant::now();
            black_box(
                model
                    .word_encoder()
                    .encode(&text[cut..])
                    .expect("tail")
                    .0
                    .len(),
            );
            tail_floor.push(t.elapsed());
            let b = cold_body(counter.fetch_add(1, Ordering::Relaxed));
            let req = request::parse("/v1/chat/completions", &b).expect("parse");
            let Prompt::Chat(chat) = &req.prompt else {
                panic!("chat")
            };
            let text = model.render(chat).expect("render");
            let t = Instant::now();
            black_box(model.encode(&text, false).expect("encode").ids.len());
            c_encode.push(t.elapsed());
            let t = Instant::now();
            black_box(
                no_word_cache
                    .encode(model.tokenizer(), &text)
                    .expect("encode"),
            );
            c_encode_no_words.push(t.elapsed());
        }
        stages.push((
            name,
            median(w_parse),
            median(w_render),
            median(w_encode),
            median(tail_floor),
            median(c_encode),
            median(c_encode_no_words),
        ));
        summary.push((
            name,
            body(&text).len(),
            median(bare),
            median(cold),
            median(warm),
            median(parse),
            median(render),
        ));
    }
    // Non-English text: 400 KB of CJK words from the vocabulary, with full-width punctuation.
    let cjk = cjk_text(model.tokenizer(), 400 << 10);
    let mut g = c.benchmark_group("tokenize/400KB-cjk");
    g.bench_function("bare_encode", |b| {
        b.iter(|| black_box(model.tokenizer().encode(cjk.as_str(), false).unwrap().len()))
    });
    g.bench_function("encode", |b| {
        b.iter(|| black_box(model.word_encoder().encode(&cjk).expect("encode").0.len()))
    });
    g.finish();
    // Word-cache misses: prompts of 2,200 random vocab tokens (the no-sharing workload's),
    // a new one each iteration (the crate's own BPE cache holds 10,000 words and then stops
    // inserting, so it cannot answer most of them either), every pre-token merged by the
    // crate's BPE or by kvpick's merge table; no word cache.
    let prompts: Vec<String> = (0..256)
        .map(|seed| random_token_text(model.tokenizer(), seed, 2_200))
        .collect();
    let json = std::fs::read(repo().join("assets/tokenizer/tokenizer.json")).expect("read");
    let crate_merges = FastEncoder::new(model.tokenizer())
        .expect("fast path")
        .with_word_cache_capacity(0);
    let table =
        || MergeTable::from_tokenizer_json(&json, crate_merges.byte_chars()).expect("merges");
    let own_merges = FastEncoder::new(model.tokenizer())
        .expect("fast path")
        .with_word_cache_capacity(0)
        .with_merge_table(table());
    let mut g = c.benchmark_group("tokenize/2200-random-tokens");
    for (name, encoder) in [
        ("crate_merges", &crate_merges),
        ("merge_table", &own_merges),
    ] {
        let next = AtomicUsize::new(0);
        g.bench_function(name, |b| {
            b.iter(|| {
                let prompt = &prompts[next.fetch_add(1, Ordering::Relaxed) % prompts.len()];
                black_box(
                    encoder
                        .encode(model.tokenizer(), prompt)
                        .expect("encode")
                        .0
                        .len(),
                )
            })
        });
    }
    g.bench_function("build_merge_table", |b| b.iter(|| black_box(table().len())));
    g.finish();
    c.final_summary();
    println!(
        "\nsize   body_bytes  bare_encode  cold(parse+template+tokenize)  cold/bare  warm95  cold/warm95  bare/warm95  parse  render"
    );
    for (name, bytes, bare, cold, warm, parse, render) in summary {
        println!(
            "{name:<6} {bytes:>10}  {bare:>10.2?}  {cold:>10.2?}  {:>5.2}x  {warm:>8.2?}  {:>6.1}x  {:>6.1}x  {parse:>8.2?}  {render:>8.2?}",
            cold.as_secs_f64() / bare.as_secs_f64(),
            cold.as_secs_f64() / warm.as_secs_f64(),
            bare.as_secs_f64() / warm.as_secs_f64()
        );
    }
    println!(
        "\nwarm95 stages: parse  render  encode(prefix cache)  | tail-only encode (floor)  cold encode  cold encode, word cache off"
    );
    for (name, parse, render, encode, floor, cold_encode, no_words) in stages {
        println!(
            "{name:<6} {parse:>10.2?}  {render:>10.2?}  {encode:>10.2?}  | {floor:>10.2?}  {cold_encode:>10.2?}  {no_words:>10.2?}"
        );
    }
}
