//! Byte-pair merges applied by kvpick itself to the pre-tokens the word cache has not seen.
//!
//! A word-cache miss used to go to the tokenizers crate's `BPE::tokenize`: a cache probe and
//! insert keyed by the mapped `String`, a `Word` of symbols merged through a binary heap, and a
//! `Token` with its own `String` per id. Text no earlier request had (random-token prompts, new
//! identifiers, base64) is mostly misses, and there the crate's BPE was the largest part of
//! kvpick's CPU per request. This table holds the same merges keyed by the pair of ids and
//! merges a short pre-token in place, on buffers reused from one word to the next.
//!
//! Exactness: the crate (no dropout) repeatedly merges the adjacent pair of lowest rank, the
//! leftmost of equal ranks (its heap orders merges by rank, then position, and skips stale
//! ones); [`MergeTable::encode`] rescans for that same pair after each merge. The table is
//! built from `tokenizer.json`'s own `model.merges` in file order, a later duplicate pair
//! replacing an earlier one as in the crate's map, and every id from the same file's
//! `model.vocab`, which is the crate's BPE vocab (the file's hash is checked). With
//! `ignore_merges` the crate first returns a pre-token that is itself in the vocab; the caller
//! does that lookup ([`super::fast_bpe`]). Equivalence is tested with the cache off, against the
//! crate, on the fixtures, the 400 KB corpus and random text (`tests/it/tok_fast_bpe.rs`).
//!
//! Bounds: pre-tokens over [`MAX_MERGE_BYTES`] bytes are left to the crate (the rescan is
//! quadratic in the symbols; its heap is not).
//!
//! When: building the table reads `tokenizer.json` a second time (its vocab and 294k merges
//! for the shared tokenizer: ~0.5 s unoptimised). A process whose text the word cache covers
//! never needs it, so it is built only once the crate has merged [`LAZY_AFTER_MISSES`]
//! pre-tokens, on a thread of its own, from the same bytes the tokenizer was loaded from
//! (their hash is checked); misses go to the crate until it is there ([`LazyMerges`]).
//! NOTE: the first cold requests of a process pay the crate's price; in exchange nothing is
//! paid at start-up or by a fleet whose prompts are natural text.
//!
//! Memory: the table is ~9 MB (294k merges in 512 Ki buckets of 17 bytes). The build's
//! temporary strings stay under what loading the tokenizer took: a process that loads the
//! shared tokenizer and builds the table peaks at the same RSS as one that does not (265 MB).
//!
//! Concurrency: immutable once built; shared by every encode of the model. [`LazyMerges`]
//! starts at most one build (an atomic flag) and publishes it through a `OnceLock`.

use std::collections::HashMap as StdHashMap;
use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use hashbrown::HashMap;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64;

/// Longest pre-token, in bytes, merged here rather than by the crate.
pub const MAX_MERGE_BYTES: usize = 128;

/// Pre-tokens the crate merges before the table is built.
pub const LAZY_AFTER_MISSES: usize = 4096;

/// Why a tokenizer's merges could not be taken over (the crate then merges every miss).
#[derive(Debug, thiserror::Error)]
pub enum MergeTableError {
    /// `tokenizer.json` could not be read again.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The IO error.
        source: std::io::Error,
    },
    /// `tokenizer.json` changed since the tokenizer was loaded from it.
    #[error("{0} changed since it was loaded")]
    Changed(String),
    /// `tokenizer.json` has no `model.vocab` map or `model.merges` list of the expected shape.
    #[error("tokenizer.json merges: {0}")]
    Parse(#[from] serde_json::Error),
    /// The model adds a prefix or suffix to subwords, which this table does not model.
    #[error("the BPE model has a continuing-subword prefix or end-of-word suffix")]
    Affixes,
    /// A byte's character, a merge's part or its result is not in the vocab.
    #[error("`{0}` is not in the vocab")]
    NotInVocab(String),
}

/// The merges of one byte-level BPE model (see the module docs).
pub struct MergeTable {
    /// The id of each byte's single-character token.
    byte_ids: [u32; 256],
    /// `(left id, right id)` packed as `left << 32 | right` → `(rank, merged id)`.
    merges: HashMap<u64, (u32, u32), PairHash>,
}

impl std::fmt::Debug for MergeTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergeTable")
            .field("merges", &self.merges.len())
            .finish()
    }
}

impl MergeTable {
    /// The table of the BPE model in `json` (a `tokenizer.json`: its `model.vocab` and
    /// `model.merges`); `byte_chars` is the byte-level alphabet (byte → character).
    pub fn from_tokenizer_json(
        json: &[u8],
        byte_chars: &[char; 256],
    ) -> Result<Self, MergeTableError> {
        let file: TokenizerFile = serde_json::from_slice(json)?;
        if file.model.continuing_subword_prefix.is_some() || file.model.end_of_word_suffix.is_some()
        {
            return Err(MergeTableError::Affixes);
        }
        let vocab = &file.model.vocab;
        let id = |token: &str| {
            vocab
                .get(token)
                .copied()
                .ok_or_else(|| MergeTableError::NotInVocab(token.to_owned()))
        };
        let mut byte_ids = [0; 256];
        let mut one = [0u8; 4];
        for (slot, &c) in byte_ids.iter_mut().zip(byte_chars) {
            *slot = id(c.encode_utf8(&mut one))?;
        }
        let mut merges = HashMap::with_capacity_and_hasher(file.model.merges.len(), PairHash);
        let mut joined = String::new();
        for (rank, Merge(left, right)) in (0u32..).zip(&file.model.merges) {
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let value = (rank, id(&joined)?);
            merges.insert(pair(id(left)?, id(right)?), value);
        }
        Ok(Self { byte_ids, merges })
    }

    /// Merges the pre-token `word` (raw bytes) and appends its ids to `out`, exactly as the
    /// crate's BPE without its whole-word lookup; `false` (and nothing appended) when `word`
    /// is empty or longer than [`MAX_MERGE_BYTES`]. `pairs` is scratch space (reused across
    /// calls, so that a word costs no allocation).
    pub fn encode(&self, word: &[u8], out: &mut Vec<u32>, pairs: &mut Vec<(u32, u32)>) -> bool {
        if word.is_empty() || word.len() > MAX_MERGE_BYTES {
            return false;
        }
        // The word's symbols are the tail of `out`, merged in place.
        let first = out.len();
        out.extend(word.iter().map(|&b| self.byte_ids[usize::from(b)]));
        let symbols = &mut out[first..];
        // `pairs[i]`: the (rank, merged id) of symbols i and i + 1, rank `u32::MAX` if none.
        pairs.clear();
        pairs.extend(symbols.windows(2).map(|w| self.lookup(w[0], w[1])));
        let mut len = symbols.len();
        while let Some((best, &(rank, merged))) = pairs
            .iter()
            .enumerate()
            .min_by_key(|(i, (rank, _))| (*rank, *i))
        {
            if rank == u32::MAX {
                break;
            }
            symbols[best] = merged;
            symbols.copy_within(best + 2..len, best + 1);
            pairs.remove(best);
            len -= 1;
            if best > 0 {
                pairs[best - 1] = self.lookup(symbols[best - 1], merged);
            }
            if best + 1 < len {
                pairs[best] = self.lookup(merged, symbols[best + 1]);
            }
        }
        out.truncate(first + len);
        true
    }

    /// Merges in the table.
    pub fn len(&self) -> usize {
        self.merges.len()
    }

    /// Whether the model has no merges.
    pub fn is_empty(&self) -> bool {
        self.merges.is_empty()
    }

    fn lookup(&self, left: u32, right: u32) -> (u32, u32) {
        self.merges
            .get(&pair(left, right))
            .copied()
            .unwrap_or((u32::MAX, 0))
    }
}

/// Where a model's table comes from, and when it is built (see the module docs).
pub struct LazyMerges {
    /// The `tokenizer.json` the tokenizer was loaded from, and the xxh3 of its bytes then.
    path: PathBuf,
    hash: u64,
    byte_chars: [char; 256],
    /// Misses merged by the crate before the build starts.
    after: usize,
    misses: AtomicUsize,
    started: AtomicBool,
    table: Arc<OnceLock<MergeTable>>,
}

impl std::fmt::Debug for LazyMerges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyMerges")
            .field("path", &self.path)
            .field("built", &self.table.get().is_some())
            .finish()
    }
}

impl LazyMerges {
    /// The table of the file at `path`, whose bytes were `json` when the tokenizer was loaded,
    /// built once `after` misses have been merged by the crate (0: at the first).
    pub fn new(path: PathBuf, json: &[u8], byte_chars: [char; 256], after: usize) -> Self {
        Self {
            path,
            hash: xxh3_64(json),
            byte_chars,
            after,
            misses: AtomicUsize::new(0),
            started: AtomicBool::new(false),
            table: Arc::default(),
        }
    }

    /// The table, once built.
    pub fn get(&self) -> Option<&MergeTable> {
        self.table.get()
    }

    /// Counts a miss the crate merged; the one that reaches the threshold starts the build.
    /// Once it has started (or failed), a miss costs one shared read, not a contended write.
    pub fn note_miss(&self) {
        if self.started.load(Ordering::Relaxed)
            || self.misses.fetch_add(1, Ordering::Relaxed) < self.after
            || self.started.swap(true, Ordering::Relaxed)
        {
            return;
        }
        let (path, hash, byte_chars) = (self.path.clone(), self.hash, self.byte_chars);
        let table = Arc::clone(&self.table);
        let spawned = std::thread::Builder::new()
            .name("kvpick-merges".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                match build(&path, hash, &byte_chars) {
                    Ok(built) => {
                        tracing::info!(path = %path.display(), merges = built.len(), took_ms = started.elapsed().as_millis() as u64, "BPE merge table built; word-cache misses are merged by kvpick");
                        let _ = table.set(built);
                    }
                    Err(error) => {
                        tracing::warn!(path = %path.display(), %error, "BPE merges left to the tokenizers crate");
                    }
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "cannot start the BPE merge-table build; merges left to the tokenizers crate");
        }
    }
}

/// Reads `path` again and builds its table, if its bytes still hash to `hash`.
fn build(
    path: &std::path::Path,
    hash: u64,
    byte_chars: &[char; 256],
) -> Result<MergeTable, MergeTableError> {
    let json = std::fs::read(path).map_err(|source| MergeTableError::Io {
        path: path.display().to_string(),
        source,
    })?;
    if xxh3_64(&json) != hash {
        return Err(MergeTableError::Changed(path.display().to_string()));
    }
    MergeTable::from_tokenizer_json(&json, byte_chars)
}

fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// A multiply-fold hash for the packed id pairs: hashbrown needs good high bits (its control
/// bytes) and low bits (the bucket), which the 128-bit product's halves folded together give.
#[derive(Clone, Copy, Default)]
struct PairHash;

impl BuildHasher for PairHash {
    type Hasher = PairHasher;
    fn build_hasher(&self) -> PairHasher {
        PairHasher(0)
    }
}

#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        let product = u128::from(self.0 ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15;
        (product as u64) ^ ((product >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (the key is a `u64`); fold anything else in byte by byte.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

/// The part of `tokenizer.json` read here (everything else is skipped unparsed into values).
#[derive(serde::Deserialize)]
struct TokenizerFile {
    model: ModelMerges,
}

#[derive(serde::Deserialize)]
struct ModelMerges {
    vocab: StdHashMap<String, u32>,
    merges: Vec<Merge>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
}

/// One merge, written `"left right"` (one space, as the crate requires) or `["left", "right"]`.
struct Merge(String, String);

impl<'de> serde::Deserialize<'de> for Merge {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(MergeVisitor)
    }
}

struct MergeVisitor;

impl<'de> Visitor<'de> for MergeVisitor {
    type Value = Merge;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(r#"a merge: "left right" or ["left", "right"]"#)
    }

    fn visit_str<E: de::Error>(self, line: &str) -> Result<Merge, E> {
        let mut parts = line.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(left), Some(right), None) => Ok(Merge(left.to_owned(), right.to_owned())),
            _ => Err(E::custom(format!("merge {line:?} is not two tokens"))),
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merge, A::Error> {
        let left: String = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let right: String = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?;
        if seq.next_element::<de::IgnoredAny>()?.is_some() {
            return Err(de::Error::invalid_length(3, &self));
        }
        Ok(Merge(left, right))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::Model;
    use tokenizers::models::bpe::BPE;

    fn chars() -> [char; 256] {
        let mut table = ['\0'; 256];
        for (b, slot) in (0u8..=255).zip(table.iter_mut()) {
            // Not the GPT-2 alphabet: a toy one where every byte is its own Latin-1 char.
            *slot = char::from(b);
        }
        table
    }

    /// A toy `tokenizer.json` over the bytes with `merges`; the vocab has every byte and
    /// `ab`, `bc`, `abc`, `aa`.
    fn toy_json(merges: serde_json::Value) -> serde_json::Value {
        let mut vocab: serde_json::Map<String, serde_json::Value> = (0u8..=255)
            .map(|b| (char::from(b).to_string(), u32::from(b).into()))
            .collect();
        for (i, t) in (256u32..).zip(["ab", "bc", "abc", "aa"]) {
            vocab.insert(t.to_owned(), i.into());
        }
        serde_json::json!({"model": {"type": "BPE", "vocab": vocab, "merges": merges}})
    }

    /// Merges `a b` (rank 0), `b c` (1), `ab c` (2), `a a` (3), in both spellings: checks
    /// lowest rank first, leftmost of equals, and merges of merges.
    fn toy() -> (BPE, MergeTable) {
        // The crate takes one spelling per file; this table either, mixed.
        let pairs = toy_json(serde_json::json!([
            ["a", "b"],
            ["b", "c"],
            ["ab", "c"],
            ["a", "a"]
        ]));
        let bpe: BPE = serde_json::from_str(&pairs["model"].to_string()).unwrap();
        let json = toy_json(serde_json::json!(["a b", ["b", "c"], "ab c", ["a", "a"]]));
        let table = MergeTable::from_tokenizer_json(json.to_string().as_bytes(), &chars()).unwrap();
        (bpe, table)
    }

    fn crate_ids(bpe: &BPE, word: &str) -> Vec<u32> {
        bpe.tokenize(word).unwrap().iter().map(|t| t.id).collect()
    }

    #[test]
    fn merges_like_the_crate_on_a_toy_model() {
        let (bpe, table) = toy();
        let mut pairs = Vec::new();
        assert_eq!(table.len(), 4);
        for word in [
            "abc", "aaa", "aaaa", "aabc", "bcab", "cab", "x", "abcabc", "aab",
        ] {
            let mut ids = Vec::new();
            assert!(table.encode(word.as_bytes(), &mut ids, &mut pairs));
            assert_eq!(ids, crate_ids(&bpe, word), "{word}");
        }
        // "abc": a b (rank 0) before b c (rank 1), then ab c.
        let mut ids = Vec::new();
        table.encode(b"abc", &mut ids, &mut pairs);
        assert_eq!(ids, [258]);
        // "aaa": the leftmost a a first.
        ids.clear();
        table.encode(b"aaa", &mut ids, &mut pairs);
        assert_eq!(ids, [259, u32::from(b'a')]);
    }

    #[test]
    fn long_or_empty_words_are_left_to_the_crate() {
        let (_, table) = toy();
        let (mut ids, mut pairs) = (vec![7], Vec::new());
        assert!(!table.encode(b"", &mut ids, &mut pairs));
        assert!(!table.encode(&[b'a'; MAX_MERGE_BYTES + 1], &mut ids, &mut pairs));
        assert_eq!(ids, [7]);
        assert!(table.encode(&[b'a'; MAX_MERGE_BYTES], &mut ids, &mut pairs));
        assert_eq!(ids.len(), 1 + MAX_MERGE_BYTES / 2);
    }

    #[test]
    fn bad_merge_lists_are_errors() {
        for (merges, want) in [
            (serde_json::json!(["a b c"]), "not two tokens"),
            (serde_json::json!([["a"]]), "invalid length"),
            (serde_json::json!([["a", "b", "c"]]), "invalid length"),
            (serde_json::json!([7]), "a merge"),
            (serde_json::json!("a b"), "invalid type"),
            (serde_json::json!(["a z"]), "`az` is not in the vocab"),
        ] {
            let json = toy_json(merges.clone()).to_string();
            let error = MergeTable::from_tokenizer_json(json.as_bytes(), &chars())
                .unwrap_err()
                .to_string();
            assert!(error.contains(want), "{merges}: {error}");
        }
        for (json, want) in [
            (r#"{"model": {"vocab": {}}}"#, "missing field `merges`"),
            (
                r#"{"model": {"vocab": {}, "merges": []}}"#,
                "not in the vocab",
            ),
            (
                r#"{"model": {"vocab": {}, "merges": [], "end_of_word_suffix": "</w>"}}"#,
                "suffix",
            ),
            (r#"[1]"#, "invalid type"),
        ] {
            let error = MergeTable::from_tokenizer_json(json.as_bytes(), &chars())
                .unwrap_err()
                .to_string();
            assert!(error.contains(want), "{json}: {error}");
        }
    }

    /// Waits (bounded) for a lazy build that was started.
    fn wait_built(lazy: &LazyMerges) -> bool {
        for _ in 0..500 {
            if lazy.get().is_some() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn the_lazy_table_is_built_after_its_misses_from_the_unchanged_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let json = toy_json(serde_json::json!(["a b"])).to_string();
        std::fs::write(&path, &json).unwrap();
        let lazy = LazyMerges::new(path.clone(), json.as_bytes(), chars(), 3);
        for _ in 0..3 {
            lazy.note_miss();
        }
        assert!(lazy.get().is_none(), "built before its threshold");
        lazy.note_miss();
        assert!(wait_built(&lazy), "not built after the threshold");
        assert_eq!(lazy.get().map(MergeTable::len), Some(1));

        // A file edited since the load is not taken over.
        let error = build(&path, xxh3_64(b"other bytes"), &chars()).unwrap_err();
        assert!(matches!(error, MergeTableError::Changed(_)), "{error}");
    }
}
