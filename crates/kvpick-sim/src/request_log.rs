//! `--request-log FILE`: one JSON line per request that reached its first token — which pod
//! served it, when it arrived, how much of its prompt the pod had cached, a digest of its
//! prompt's head, and the least first-token time any placement could have given it
//! ([`crate::floor`]) — so a benchmark can say where each prefix went (copies per prefix, a
//! group moving between pods, which requests missed), which the engines' summed counters
//! cannot, and how far each router's TTFT is from what is reachable at all.
//!
//! Lines are written as requests start decoding, under a mutex, one `write` per line (a
//! `LineWriter`), so a reader sees whole lines while the simulator runs and nothing is lost
//! when it is stopped. The file grows with the run; it is opt-in, for benchmarks.

use std::fs::File;
use std::hash::{Hash, Hasher};
use std::io::{LineWriter, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::floor::{FloorModel, Floors};

/// Prompt tokens digested into [`RequestRecord::head`]: one 16-token block.
pub const HEAD_TOKENS: usize = 16;
/// Prompt tokens digested into [`RequestRecord::head_long`]: sixteen 16-token blocks.
pub const HEAD_LONG_TOKENS: usize = 256;

/// One served request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// The pod's index in the fleet.
    pub pod: usize,
    /// Arrival, Unix seconds.
    pub arrived: f64,
    /// Arrival to first token, seconds.
    pub first_token_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of them, served from the pod's prefix cache.
    pub cached_tokens: usize,
    /// Digest of the first [`HEAD_TOKENS`] prompt tokens (a shared prefix's identity).
    pub head: u64,
    /// Digest of the first [`HEAD_LONG_TOKENS`] prompt tokens (a conversation's identity when
    /// a short preamble is shared by all).
    pub head_long: u64,
    /// `(reusable tokens, floor seconds)` from [`Floors::arrive`]; `None` (JSON nulls) once
    /// the floors' seen set is full.
    pub floor: Option<(usize, f64)>,
}

impl RequestRecord {
    /// The digests of `prompt`'s head.
    pub fn heads(prompt: &[u32]) -> (u64, u64) {
        let digest = |n: usize| {
            // NOTE: DefaultHasher::new() has fixed keys, so the digests are the same in every
            // process and run (the harness compares runs of different systems).
            let mut h = std::collections::hash_map::DefaultHasher::new();
            prompt
                .get(..n.min(prompt.len()))
                .unwrap_or_default()
                .hash(&mut h);
            h.finish()
        };
        (digest(HEAD_TOKENS), digest(HEAD_LONG_TOKENS))
    }

    fn json_line(&self) -> String {
        format!(
            "{{\"pod\":{},\"arrived\":{:.6},\"first_token_s\":{:.6},\"prompt_tokens\":{},\
             \"cached_tokens\":{},\"head\":\"{:016x}\",\"head_long\":\"{:016x}\",\
             \"reusable_tokens\":{},\"floor_s\":{}}}\n",
            self.pod,
            self.arrived,
            self.first_token_s,
            self.prompt_tokens,
            self.cached_tokens,
            self.head,
            self.head_long,
            self.floor
                .map_or_else(|| "null".to_owned(), |(tokens, _)| tokens.to_string()),
            self.floor
                .map_or_else(|| "null".to_owned(), |(_, s)| format!("{s:.6}")),
        )
    }
}

/// The log file, and the fleet-wide record of prefixes the floors are computed from.
#[derive(Debug)]
pub struct RequestLog {
    out: Mutex<LineWriter<File>>,
    floors: Floors,
}

impl RequestLog {
    /// Creates (truncates) `path`; floors follow `floor`.
    pub fn create(path: &Path, floor: FloorModel) -> std::io::Result<Self> {
        Ok(Self {
            out: Mutex::new(LineWriter::new(File::create(path)?)),
            floors: Floors::new(floor),
        })
    }

    /// A request arriving with `prompt`, at any pod of the fleet: its reusable tokens and
    /// floor ([`Floors::arrive`]).
    pub fn arrive(&self, prompt: &[u32]) -> Option<(usize, f64)> {
        self.floors.arrive(prompt)
    }

    /// Appends one record. A failed write is logged once per call and dropped: the log must
    /// never hold up serving.
    pub fn write(&self, record: &RequestRecord) {
        let line = record.json_line();
        let Ok(mut out) = self.out.lock() else {
            return;
        };
        if let Err(error) = out.write_all(line.as_bytes()) {
            tracing::warn!(%error, "request log write failed");
        }
    }
}

/// Unix seconds now.
pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_json_with_every_field_and_heads_tell_prefixes_apart() {
        let dir = std::env::temp_dir().join(format!("kvpick-sim-reqlog-{}", std::process::id()));
        let model = FloorModel::for_engine(&crate::engine::EngineConfig::default(), 1.0);
        let log = RequestLog::create(&dir, model).expect("create");
        let shared: Vec<u32> = (0..300).collect();
        let mut other = shared.clone();
        other[200] = 9; // same first block, different conversation
        let (h1, l1) = RequestRecord::heads(&shared);
        let (h2, l2) = RequestRecord::heads(&other);
        assert_eq!(h1, h2);
        assert_ne!(l1, l2);
        assert_ne!(RequestRecord::heads(&[1, 2, 3]).0, h1);
        let floors = [log.arrive(&shared), None];
        for ((pod, head_long), floor) in [(0, l1), (3, l2)].into_iter().zip(floors) {
            log.write(&RequestRecord {
                pod,
                arrived: 1.5,
                first_token_s: 0.25,
                prompt_tokens: 300,
                cached_tokens: 288,
                head: h1,
                head_long,
                floor,
            });
        }
        let text = std::fs::read_to_string(&dir).expect("read");
        let _ = std::fs::remove_file(&dir);
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["pod"], 3);
        assert_eq!(lines[0]["cached_tokens"], 288);
        assert_eq!(lines[0]["head"], format!("{h1:016x}"));
        assert_eq!(lines[1]["head_long"], format!("{l2:016x}"));
        assert_eq!(lines[0]["first_token_s"].as_f64(), Some(0.25));
        // Nothing seen before the first: its 300 tokens at the default costs, 6.2 + 15 ms.
        assert_eq!(lines[0]["reusable_tokens"], 0);
        let floor = lines[0]["floor_s"].as_f64().expect("a floor");
        assert!((floor - 0.0212).abs() < 1e-6, "{floor}");
        assert!(lines[1]["reusable_tokens"].is_null());
        assert!(lines[1]["floor_s"].is_null());
    }
}
