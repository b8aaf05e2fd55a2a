//! A prefix token cache: a text whose beginning was tokenized before is only tokenized from a
//! safe cut point on, with results identical to tokenizing it whole.
//!
//! # Where it is safe to cut
//! Byte-level BPE runs per pre-token, so `tokens(T) = tokens(T[..c]) ++ tokens(T[c..])`
//! whenever `c` is a pre-token boundary of `T` that does not depend on text after `c`, and the
//! normalizer (NFC) does not act across `c`. We only cut at a position `c` of a previously
//! tokenized text `P` where, in `P`'s own encoding, a new pre-token (word) starts, and where:
//! - the character at `c` is ASCII: an ASCII starter never composes with what precedes it, so
//!   `NFC(T) = NFC(T[..c]) ++ NFC(T[c..])`;
//! - the character before `c` is not whitespace (nor a control): the pre-token ending at `c`
//!   then ends in a letter, digit or symbol, and every regex decision for matches before `c`
//!   (greedy runs of letters/symbols/newlines, whitespace backtracking, `(?!\S)`, and the
//!   3-character contraction alternatives) looks at most 2 characters past `c`;
//! - `c + margin <= L`, where `L` is the length `P` and `T` have in common and `margin` exceeds
//!   both that look-ahead and the longest added (special) token, so the added-token split and
//!   the regex see identical text in `P` and `T` up to everything they inspect.
//!
//! Then `P`'s tokens before `c` are `T`'s tokens before `c`, and `T[c..]` is tokenized alone
//! (the regex has no look-behind). The property test in `tests/tok_prefix_cache.rs` checks
//! this against full tokenization on random texts and cut points.
//!
//! # Memory
//! Entries (text, ids, sparse cut points) are bounded in total by an LRU by bytes. Lookup uses
//! chained xxh3 hashes of every [`ANCHOR_BYTES`]-byte block of the text, then a byte
//! comparison, so a lookup costs O(len) and never trusts a hash alone.
//!
//! Concurrency: one mutex around the index; tokenization runs outside it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::error::TokenizeError;
use super::fast_bpe::{FastEncoder, WordEncoding, maybe_space};

/// Texts are indexed at every multiple of this many bytes; shorter texts are not cached.
pub const ANCHOR_BYTES: usize = 1024;
/// Minimum distance between two stored cut points (keeps entries small).
const CUT_SPACING: usize = 32;
/// Fixed per-entry bookkeeping charged to the byte budget.
const ENTRY_OVERHEAD: usize = 128;

/// Token ids plus safe cut points, and how many leading ids were reused.
type Encoded = (Vec<u32>, Vec<(u32, u32)>, usize);

/// The result of a cached encode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedTokens {
    /// The token ids of the whole text.
    pub ids: Vec<u32>,
    /// How many leading ids came from the cache.
    pub reused_tokens: usize,
}

/// What [`PrefixTokenCache::tokenize`] found.
enum Outcome {
    /// Final tokens, nothing to insert (a short text, or an exact hit).
    Done(CachedTokens),
    /// A fresh encoding to insert.
    Fresh {
        ids: Vec<u32>,
        cuts: Vec<(u32, u32)>,
        reused: usize,
        anchors: Vec<u64>,
    },
}

#[derive(Debug)]
struct Entry {
    text: String,
    ids: Vec<u32>,
    /// `(byte offset, token index)` of safe cut points, ascending.
    cuts: Vec<(u32, u32)>,
    anchors: Vec<u64>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.text.len()
            + self.ids.len() * 4
            + self.cuts.len() * 8
            + self.anchors.len() * 24
            + ENTRY_OVERHEAD
    }
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<u64, (Arc<Entry>, u64)>,
    anchors: HashMap<u64, u64>,
    lru: BTreeMap<u64, u64>,
    next_id: u64,
    tick: u64,
    bytes: usize,
}

/// A bounded prefix token cache for one tokenizer.
#[derive(Debug)]
pub struct PrefixTokenCache {
    inner: Mutex<Inner>,
    max_bytes: usize,
    margin: usize,
}

impl PrefixTokenCache {
    /// A cache holding at most `max_bytes`; `margin` must exceed the longest added token
    /// (see the module docs).
    pub fn new(max_bytes: usize, margin: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            max_bytes,
            margin: margin.max(16),
        }
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        self.inner.lock().map(|g| g.bytes).unwrap_or(0)
    }

    /// Encodes `text` without special tokens, reusing a cached prefix when one is safe.
    pub fn encode(
        &self,
        encoder: &WordEncoder<'_>,
        text: &str,
    ) -> Result<CachedTokens, TokenizeError> {
        let outcome = self.tokenize(encoder, text)?;
        Ok(self.remember(outcome, || text.to_owned()))
    }

    /// [`Self::encode`] for an owned text, which the cache then keeps without copying it (a
    /// rendered chat prompt is not needed afterwards). On error the text is handed back.
    pub fn encode_owned(
        &self,
        encoder: &WordEncoder<'_>,
        text: String,
    ) -> Result<CachedTokens, (TokenizeError, String)> {
        match self.tokenize(encoder, &text) {
            Ok(outcome) => Ok(self.remember(outcome, move || text)),
            Err(e) => Err((e, text)),
        }
    }

    /// Inserts a fresh encoding (its text from `text`) and returns the tokens.
    fn remember(&self, outcome: Outcome, text: impl FnOnce() -> String) -> CachedTokens {
        match outcome {
            Outcome::Done(tokens) => tokens,
            Outcome::Fresh {
                ids,
                cuts,
                reused,
                anchors,
            } => {
                let mut text = text();
                text.shrink_to_fit();
                self.insert(Entry {
                    text,
                    ids: ids.clone(),
                    cuts,
                    anchors,
                });
                CachedTokens {
                    ids,
                    reused_tokens: reused,
                }
            }
        }
    }

    /// Tokenizes `text` through the cache, without inserting it.
    fn tokenize(&self, encoder: &WordEncoder<'_>, text: &str) -> Result<Outcome, TokenizeError> {
        if text.len() < ANCHOR_BYTES || self.max_bytes == 0 {
            let (ids, _) = encoder.encode(text)?;
            return Ok(Outcome::Done(CachedTokens {
                ids,
                reused_tokens: 0,
            }));
        }
        let anchors = anchor_hashes(text.as_bytes());
        let hit = self.lookup(text, &anchors);
        let (ids, cuts, reused) = match hit {
            Some((entry, common)) if common == text.len() && common == entry.text.len() => {
                return Ok(Outcome::Done(CachedTokens {
                    ids: entry.ids.clone(),
                    reused_tokens: entry.ids.len(),
                }));
            }
            Some((entry, common)) => {
                let limit = common.saturating_sub(self.margin);
                let idx = entry.cuts.partition_point(|&(c, _)| c as usize <= limit);
                match idx.checked_sub(1).and_then(|i| entry.cuts.get(i)) {
                    Some(&(c, j)) if text.is_char_boundary(c as usize) => {
                        let (c, j) = (c as usize, j as usize);
                        let tail = text.get(c..).unwrap_or("");
                        let (tail_ids, words) = encoder.encode(tail)?;
                        let mut ids = Vec::with_capacity(j + tail_ids.len());
                        ids.extend_from_slice(entry.ids.get(..j).unwrap_or(&[]));
                        ids.extend_from_slice(&tail_ids);
                        let mut cuts: Vec<(u32, u32)> =
                            entry.cuts.get(..idx).unwrap_or(&[]).to_vec();
                        collect_cuts(text, &words, c, j, &mut cuts);
                        (ids, cuts, j)
                    }
                    _ => full(encoder, text)?,
                }
            }
            None => full(encoder, text)?,
        };
        Ok(Outcome::Fresh {
            ids,
            cuts,
            reused,
            anchors,
        })
    }

    /// The cached entry sharing the longest verified prefix with `text`, and that length.
    fn lookup(&self, text: &str, anchors: &[u64]) -> Option<(Arc<Entry>, usize)> {
        let mut inner = self.inner.lock().ok()?;
        for (k, h) in anchors.iter().enumerate().rev() {
            let Some(&id) = inner.anchors.get(h) else {
                continue;
            };
            let Some((entry, _)) = inner.entries.get(&id) else {
                continue;
            };
            let anchored = (k + 1) * ANCHOR_BYTES;
            let (a, b) = (entry.text.as_bytes(), text.as_bytes());
            if a.get(..anchored) != b.get(..anchored) {
                continue; // hash collision
            }
            let common = anchored
                + a.get(anchored..)
                    .unwrap_or(&[])
                    .iter()
                    .zip(b.get(anchored..).unwrap_or(&[]))
                    .take_while(|(x, y)| x == y)
                    .count();
            let entry = Arc::clone(entry);
            inner.touch(id);
            return Some((entry, common));
        }
        None
    }

    fn insert(&self, entry: Entry) {
        let size = entry.bytes();
        if size > self.max_bytes {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        while inner.bytes + size > self.max_bytes {
            if !inner.evict_oldest() {
                break;
            }
        }
        let id = inner.next_id;
        inner.next_id += 1;
        for &h in &entry.anchors {
            inner.anchors.insert(h, id);
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.lru.insert(tick, id);
        inner.entries.insert(id, (Arc::new(entry), tick));
        inner.bytes += size;
    }
}

impl Inner {
    fn touch(&mut self, id: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((_, t)) = self.entries.get_mut(&id) {
            let old = std::mem::replace(t, tick);
            self.lru.remove(&old);
            self.lru.insert(tick, id);
        }
    }

    fn evict_oldest(&mut self) -> bool {
        let Some((_, id)) = self.lru.pop_first() else {
            return false;
        };
        if let Some((entry, _)) = self.entries.remove(&id) {
            for h in &entry.anchors {
                if self.anchors.get(h) == Some(&id) {
                    self.anchors.remove(h);
                }
            }
            self.bytes = self.bytes.saturating_sub(entry.bytes());
        }
        true
    }
}

fn full(encoder: &WordEncoder<'_>, text: &str) -> Result<Encoded, TokenizeError> {
    let (ids, words) = encoder.encode(text)?;
    let mut cuts = Vec::new();
    collect_cuts(text, &words, 0, 0, &mut cuts);
    Ok((ids, cuts, 0))
}

/// Encodes text without special tokens, reporting where pre-tokens (words) start: through the
/// exact fast path when the tokenizer supports it, else through the tokenizers crate.
#[derive(Debug, Clone, Copy)]
pub struct WordEncoder<'a> {
    tokenizer: &'a Tokenizer,
    fast: Option<&'a FastEncoder>,
}

impl<'a> WordEncoder<'a> {
    /// An encoder using the fast path when `fast` is given.
    pub fn new(tokenizer: &'a Tokenizer, fast: Option<&'a FastEncoder>) -> Self {
        Self { tokenizer, fast }
    }

    /// Ids plus `(byte offset, token index)` of each word start after the first.
    pub fn encode(&self, text: &str) -> Result<WordEncoding, TokenizeError> {
        if let Some(fast) = self.fast {
            return fast.encode(self.tokenizer, text);
        }
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let (w, o) = (enc.get_word_ids(), enc.get_offsets());
        let mut words = Vec::new();
        for i in 1..enc.len() {
            if let (Some(a), Some(b), Some(prev), Some(off)) =
                (w.get(i - 1), w.get(i), o.get(i - 1), o.get(i))
                && a != b
                && prev.1 <= off.0
            {
                words.push((off.0, i));
            }
        }
        Ok((enc.get_ids().to_vec(), words))
    }
}

/// Chained xxh3 of each full [`ANCHOR_BYTES`] block.
fn anchor_hashes(text: &[u8]) -> Vec<u64> {
    let mut h = 0u64;
    text.chunks_exact(ANCHOR_BYTES)
        .map(|block| {
            h = xxh3_64_with_seed(block, h);
            h
        })
        .collect()
}

/// Appends the safe cut points among `words` (word starts of the encoding of `text[base..]`,
/// whose first token is token `tok_base` of the whole text) to `cuts`.
fn collect_cuts(
    text: &str,
    words: &[(usize, usize)],
    base: usize,
    tok_base: usize,
    cuts: &mut Vec<(u32, u32)>,
) {
    let mut last = cuts.last().map_or(0, |&(c, _)| c as usize);
    for &(offset, tok) in words {
        let c = base + offset;
        if c < last + CUT_SPACING || !is_safe_cut(text, c) {
            continue;
        }
        let (Ok(c32), Ok(t32)) = (u32::try_from(c), u32::try_from(tok_base + tok)) else {
            return;
        };
        cuts.push((c32, t32));
        last = c;
    }
}

/// The character conditions of a safe cut (module docs).
fn is_safe_cut(text: &str, c: usize) -> bool {
    let (Some(before), Some(after)) = (text.get(..c), text.get(c..)) else {
        return false;
    };
    let next_ascii = after.as_bytes().first().is_some_and(u8::is_ascii);
    let prev_ok = before
        .chars()
        .next_back()
        .is_some_and(|p| !maybe_space(p) && !p.is_control());
    next_ascii && prev_ok
}
