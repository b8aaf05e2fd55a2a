//! Request bodies for load runs: a fixed completion body, or chat bodies of a given size
//! that either share most of their text with earlier requests (warm) or share nothing (cold).
//!
//! Warm chat bodies model a shared RAG bundle: every request's system message is the same
//! bundle (`shared` of the body's text), followed by a user turn of new text unique to the
//! request. Cold bodies are new text throughout, starting with the request's number, so no
//! two share a prefix beyond the JSON before the first message. The text is words made of
//! syllables (a vocabulary of a few thousand words that tokenizes like prose) from a per-request
//! pseudo-random stream: the same `(seed, index)` always gives the same body.

use bytes::Bytes;

/// Which bodies a run sends.
#[derive(Debug, Clone)]
pub enum Workload {
    /// The same completion body every time.
    Fixed(Bytes),
    /// Chat bodies of about `bytes` bytes.
    Chat(ChatWorkload),
    /// The inner workload's bodies asking for a streamed answer (`"stream":true`, with
    /// usage in the last event, as vLLM clients ask).
    Streamed(Box<Workload>),
}

/// Chat bodies of one size and shared fraction.
#[derive(Debug, Clone)]
pub struct ChatWorkload {
    model: String,
    bytes: usize,
    /// The shared system text (empty when cold).
    bundle: String,
    /// Bytes of new text per request.
    fresh: usize,
    seed: u64,
}

const SYLLABLES: [&str; 16] = [
    "ka", "lo", "mer", "tin", "os", "va", "ble", "ri", "dun", "se", "pha", "gor", "ul", "ne", "st",
    "qui",
];

/// Appends pseudo-random prose of at least `bytes` bytes from the stream seeded by `seed`.
fn prose(out: &mut String, seed: u64, bytes: usize) {
    let end = out.len() + bytes;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < end {
        // xorshift64*: cheap and good enough for text that must not repeat.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // 1–3 syllables: a vocabulary of 4,368 words, so words repeat as in prose.
        for k in 0..(1 + (r >> 62) % 3) {
            out.push_str(SYLLABLES[((r >> (4 * k + 8)) & 15) as usize]);
        }
        out.push_str(match (r >> 40) % 23 {
            0 => ". ",
            1 => ", ",
            2 => "\\n",
            _ => " ",
        });
    }
}

/// JSON around the messages, to subtract from the target size.
fn envelope(model: &str) -> usize {
    format!(
        r#"{{"model":"{model}","messages":[{{"role":"system","content":""}},{{"role":"user","content":""}}],"max_tokens":1}}"#
    )
    .len()
}

impl ChatWorkload {
    /// Bodies of about `bytes` bytes whose text is `shared` (0..=1) the same for every
    /// request; `shared == 0` is the cold variant. `seed` varies the whole run.
    pub fn new(model: &str, bytes: usize, shared: f64, seed: u64) -> Self {
        let text = bytes.saturating_sub(envelope(model));
        let bundle_len = (text as f64 * shared.clamp(0.0, 1.0)) as usize;
        let mut bundle = String::with_capacity(bundle_len + 16);
        if bundle_len > 0 {
            prose(&mut bundle, seed, bundle_len);
            bundle.truncate(bundle_len);
            // Never end inside an escape.
            while bundle.ends_with('\\') {
                bundle.pop();
            }
        }
        Self {
            model: model.to_owned(),
            bytes,
            fresh: text.saturating_sub(bundle.len()),
            bundle,
            seed,
        }
    }

    /// The target size.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The body of request number `index`.
    pub fn body(&self, index: u64) -> Bytes {
        let mut out = String::with_capacity(self.bytes + 64);
        out.push_str(r#"{"model":""#);
        out.push_str(&self.model);
        out.push_str(r#"","messages":[{"role":"system","content":""#);
        if self.bundle.is_empty() {
            // Cold: the request's own number first, so even the first bytes differ.
            out.push_str(&format!("request {index}: "));
        } else {
            out.push_str(&self.bundle);
        }
        out.push_str(r#""},{"role":"user","content":""#);
        let before = out.len();
        let stream = self.seed ^ (index.wrapping_add(1)).wrapping_mul(0xD1B5_4A32_D192_ED03);
        let fresh = self.fresh.saturating_sub(out.len() - before);
        prose(&mut out, stream, fresh);
        while out.ends_with('\\') {
            out.pop();
        }
        out.push_str(r#""}],"max_tokens":1}"#);
        Bytes::from(out)
    }
}

impl Workload {
    /// The body of request number `index`.
    pub fn body(&self, index: u64) -> Bytes {
        match self {
            Self::Fixed(body) => body.clone(),
            Self::Chat(chat) => chat.body(index),
            Self::Streamed(inner) => streamed(&inner.body(index)),
        }
    }
}

/// `body` (a JSON object) with `"stream":true` and usage asked for, before its last `}`.
fn streamed(body: &[u8]) -> Bytes {
    let Some(end) = body.iter().rposition(|&b| b == b'}') else {
        return Bytes::copy_from_slice(body);
    };
    let mut out = Vec::with_capacity(body.len() + 64);
    out.extend_from_slice(&body[..end]);
    out.extend_from_slice(br#","stream_options":{"include_usage":true},"stream":true}"#);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes two bodies' message text has in common from the start (the JSON head excluded).
    fn common_prefix(a: &[u8], b: &[u8]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn warm_bodies_have_the_size_and_share_95_percent_with_earlier_ones() {
        for bytes in [8 * 1024, 220 * 1024, 400 * 1024] {
            let warm = ChatWorkload::new("bench-model", bytes, 0.95, 7);
            let bodies: Vec<Bytes> = (0..4).map(|i| warm.body(i)).collect();
            for body in &bodies {
                let len = body.len() as f64;
                assert!((len / bytes as f64 - 1.0).abs() < 0.01, "{len} for {bytes}");
                let json: serde_json::Value = serde_json::from_slice(body).expect("valid JSON");
                assert_eq!(json["messages"].as_array().map(Vec::len), Some(2));
            }
            for (i, later) in bodies.iter().enumerate().skip(1) {
                let shared = common_prefix(&bodies[i - 1], later) as f64 / later.len() as f64;
                assert!((0.945..0.96).contains(&shared), "{bytes}: shared {shared}");
                assert_ne!(bodies[i - 1], *later, "each request has new text");
            }
            assert_eq!(warm.body(2), bodies[2], "deterministic");
        }
    }

    #[test]
    fn streamed_bodies_ask_for_a_stream_with_usage() {
        let plain = Workload::Fixed(Bytes::from_static(br#"{"model":"m","max_tokens":1}"#));
        let body = Workload::Streamed(Box::new(plain)).body(0);
        let json: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        assert_eq!(json["stream"], true);
        assert_eq!(json["stream_options"]["include_usage"], true);
        assert_eq!(json["model"], "m");
    }

    #[test]
    fn cold_bodies_have_the_size_and_share_only_the_json_head() {
        let cold = ChatWorkload::new("bench-model", 220 * 1024, 0.0, 7);
        let (a, b) = (cold.body(1), cold.body(2));
        for body in [&a, &b] {
            assert!((body.len() as f64 / (220.0 * 1024.0) - 1.0).abs() < 0.01);
            serde_json::from_slice::<serde_json::Value>(body).expect("valid JSON");
        }
        let head = r#"{"model":"bench-model","messages":[{"role":"system","content":"request "#;
        assert!(
            common_prefix(&a, &b) <= head.len(),
            "cold bodies share no text"
        );
    }
}
