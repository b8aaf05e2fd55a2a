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
//! (the regex has no look-behind). The cut `c` itself stays a safe cut of `T`'s encoding (the
//! text around it is the same), so `T`'s entry keeps it and `P`'s earlier cuts. The property
//! tests in `tests/tok_prefix_cache.rs` check all this against full tokenization on random
//! texts and cut points.
//!
//! # Cost of a hit
//! A hit costs one comparison pass over the common prefix, the tokenization of the tail, one
//! copy of the ids into the caller's `Vec`, and hashing the tail. No pass hashes the whole
//! text: the chained block hashes of the common prefix are the cached entry's own (same bytes,
//! same hashes). The new entry does not copy the reused ids either: an entry's ids are a list
//! of [`Piece`]s (runs of ids with their cut points) shared by `Arc` with the entry it was cut
//! from, plus one new piece for the tail. A text that extends a cached one (the next turn of a
//! conversation) replaces it.
//!
//! # Memory
//! Entries (text, anchors, pieces) are bounded in total by an LRU by bytes. Each entry is
//! charged the full size of every piece it references. NOTE: a piece shared by several
//! entries is charged to each of them, so the bytes really held are at most the bytes
//! counted: the bound is conservative, never exceeded. Lookup uses chained xxh3 hashes of
//! every [`ANCHOR_BYTES`]-byte block to find candidates, then a byte comparison, so a hash is
//! never trusted alone.
//!
//! Concurrency: one mutex around the index, held only for map operations; comparison and
//! tokenization run outside it, on `Arc`s of the entries.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
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
/// Fixed per-piece bookkeeping charged to the byte budget.
const PIECE_OVERHEAD: usize = 64;
/// Bytes charged per anchor (its slot in the entry and in the anchor map).
const ANCHOR_CHARGE: usize = 24;
/// At most this many candidate entries are compared per lookup (one pass each).
const MAX_PROBES: usize = 4;
/// An entry made of more pieces than this is flattened into one (a copy every so many turns
/// of a growing conversation, so a piece list never grows without bound).
const MAX_PIECES: usize = 16;

/// The result of a cached encode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedTokens {
    /// The token ids of the whole text.
    pub ids: Vec<u32>,
    /// How many leading ids came from the cache.
    pub reused_tokens: usize,
    /// Where exact tokenization stopped (byte offset), at a pre-token over
    /// [`super::MAX_PRETOKEN_BYTES`]: `ids` are then those of the text before it.
    pub cut_at: Option<usize>,
}

/// What [`PrefixTokenCache::tokenize`] found.
enum Outcome {
    /// Final tokens, nothing to insert (a short text, or an exact hit).
    Done(CachedTokens),
    /// A fresh encoding to insert.
    Fresh {
        ids: Vec<u32>,
        pieces: Vec<PieceRef>,
        reused: usize,
        anchors: Vec<u64>,
        /// The entry this text extends (it is dropped: the new one serves all its prefixes).
        replaces: Option<u64>,
    },
}

/// A run of token ids of some tokenized text, with its safe cut points; shared by `Arc`
/// between the entries that reuse it.
#[derive(Debug)]
struct Piece {
    ids: Vec<u32>,
    /// `(byte offset, token index)` of safe cut points relative to the piece's start,
    /// ascending, all after the start (the start of a piece is a cut point itself).
    cuts: Vec<(u32, u32)>,
}

impl Piece {
    fn bytes(&self) -> usize {
        self.ids.capacity() * 4 + self.cuts.capacity() * 8 + PIECE_OVERHEAD
    }
}

/// The leading part of a [`Piece`] an entry uses.
#[derive(Debug, Clone)]
struct PieceRef {
    piece: Arc<Piece>,
    /// Text bytes the used part covers.
    bytes: usize,
    /// Leading ids used.
    tokens: usize,
    /// Leading cut points used (all before `bytes`).
    cuts: usize,
}

impl PieceRef {
    /// A whole piece covering `bytes` of text.
    fn whole(piece: Piece, bytes: usize) -> Self {
        Self {
            bytes,
            tokens: piece.ids.len(),
            cuts: piece.cuts.len(),
            piece: Arc::new(piece),
        }
    }

    fn ids(&self) -> &[u32] {
        self.piece.ids.get(..self.tokens).unwrap_or(&[])
    }

    fn cuts(&self) -> &[(u32, u32)] {
        self.piece.cuts.get(..self.cuts).unwrap_or(&[])
    }
}

/// A safe cut of an entry: where, and the pieces before it.
struct Cut {
    byte: usize,
    token: usize,
    pieces: Vec<PieceRef>,
}

#[derive(Debug)]
struct Entry {
    /// Set when inserted.
    id: u64,
    text: String,
    /// The ids of `text`, in order; their `bytes` add up to `text.len()`.
    pieces: Vec<PieceRef>,
    /// Chained xxh3 of each full [`ANCHOR_BYTES`] block of `text`.
    anchors: Vec<u64>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.text.capacity()
            + self.anchors.capacity() * ANCHOR_CHARGE
            + self
                .pieces
                .iter()
                .map(|p| p.piece.bytes() + std::mem::size_of::<PieceRef>())
                .sum::<usize>()
            + ENTRY_OVERHEAD
    }

    fn ids(&self) -> Vec<u32> {
        let mut ids = Vec::with_capacity(self.pieces.iter().map(|p| p.tokens).sum());
        for p in &self.pieces {
            ids.extend_from_slice(p.ids());
        }
        ids
    }

    /// The last safe cut at or before byte `limit` (none at the very start).
    fn cut_before(&self, limit: usize) -> Option<Cut> {
        let (mut byte, mut token) = (0usize, 0usize);
        for (p, r) in self.pieces.iter().enumerate() {
            if byte + r.bytes <= limit {
                byte += r.bytes;
                token += r.tokens;
                continue;
            }
            let cuts = r.cuts();
            let idx = cuts.partition_point(|&(c, _)| byte + c as usize <= limit);
            let mut pieces = self.pieces.get(..p)?.to_vec();
            return match idx.checked_sub(1).and_then(|i| cuts.get(i)) {
                Some(&(c, t)) => {
                    let (c, t) = (c as usize, t as usize);
                    pieces.push(PieceRef {
                        piece: Arc::clone(&r.piece),
                        bytes: c,
                        tokens: t,
                        cuts: idx - 1,
                    });
                    Some(Cut {
                        byte: byte + c,
                        token: token + t,
                        pieces,
                    })
                }
                // The piece's start (a cut of the entry it was cut from), unless it is 0.
                None => (byte > 0).then_some(Cut {
                    byte,
                    token,
                    pieces,
                }),
            };
        }
        None
    }
}

/// Keys that are hashes or counters already: one multiply instead of SipHash.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// An indexed entry: the entry, its LRU tick and the bytes charged for it.
type Slot = (Arc<Entry>, u64, usize);

#[derive(Debug, Default)]
struct Inner {
    entries: KeyMap<Slot>,
    anchors: KeyMap<u64>,
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

    /// Texts currently held.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.entries.len()).unwrap_or(0)
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
                pieces,
                reused,
                anchors,
                replaces,
            } => {
                let mut text = text();
                text.shrink_to_fit();
                self.insert(
                    Entry {
                        id: 0,
                        text,
                        pieces,
                        anchors,
                    },
                    replaces,
                );
                CachedTokens {
                    ids,
                    reused_tokens: reused,
                    cut_at: None,
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
                cut_at: None,
            }));
        }
        let Some((entry, common)) = self.lookup(text.as_bytes()) else {
            return full(encoder, text);
        };
        if common == text.len() && common == entry.text.len() {
            let ids = entry.ids();
            return Ok(Outcome::Done(CachedTokens {
                reused_tokens: ids.len(),
                ids,
                cut_at: None,
            }));
        }
        let Some(cut) = entry
            .cut_before(common.saturating_sub(self.margin))
            .filter(|cut| text.is_char_boundary(cut.byte))
        else {
            return full(encoder, text);
        };
        let tail = text.get(cut.byte..).unwrap_or("");
        let (tail_ids, words) = encoder.encode(tail).map_err(|e| e.offset_by(cut.byte))?;
        let mut ids = Vec::with_capacity(cut.token + tail_ids.len());
        for p in &cut.pieces {
            ids.extend_from_slice(p.ids());
        }
        ids.extend_from_slice(&tail_ids);
        let mut pieces = cut.pieces;
        let piece = Piece {
            cuts: collect_cuts(text, &words, cut.byte),
            ids: tail_ids,
        };
        pieces.push(PieceRef::whole(piece, tail.len()));
        if pieces.len() > MAX_PIECES {
            pieces = vec![flatten(&pieces)];
        }
        // Blocks in the common prefix hash as the entry's did.
        let mut anchors = entry
            .anchors
            .get(..common / ANCHOR_BYTES)
            .unwrap_or(&[])
            .to_vec();
        extend_anchors(text.as_bytes(), &mut anchors);
        Ok(Outcome::Fresh {
            ids,
            pieces,
            reused: cut.token,
            anchors,
            replaces: (common == entry.text.len()).then_some(entry.id),
        })
    }

    /// The cached entry sharing the longest verified prefix with `text` among the candidates
    /// its block hashes lead to, and that length.
    fn lookup(&self, text: &[u8]) -> Option<(Arc<Entry>, usize)> {
        let mut probe = xxh3_64_with_seed(text.get(..ANCHOR_BYTES)?, 0);
        let mut best: Option<(Arc<Entry>, usize)> = None;
        for _ in 0..MAX_PROBES {
            let Some(candidate) = self.candidate(probe) else {
                break;
            };
            let common = common_prefix(candidate.text.as_bytes(), text);
            if best.as_ref().is_some_and(|(_, c)| *c >= common) {
                break;
            }
            // The first block of `text` not shared in full: its chained hash, seeded with the
            // hash of the shared blocks (the candidate's own), finds a longer match if any.
            let k = common / ANCHOR_BYTES;
            let next = k
                .checked_sub(1)
                .and_then(|i| candidate.anchors.get(i))
                .zip(text.get(k * ANCHOR_BYTES..(k + 1) * ANCHOR_BYTES))
                .map(|(&seed, block)| xxh3_64_with_seed(block, seed));
            best = Some((candidate, common));
            match next {
                Some(h) => probe = h,
                None => break,
            }
        }
        let best = best.filter(|(_, common)| *common > 0)?;
        if let Ok(mut inner) = self.inner.lock() {
            inner.touch(best.0.id);
        }
        Some(best)
    }

    /// The entry indexed under anchor hash `h`.
    fn candidate(&self, h: u64) -> Option<Arc<Entry>> {
        let inner = self.inner.lock().ok()?;
        let id = inner.anchors.get(&h)?;
        inner.entries.get(id).map(|(e, _, _)| Arc::clone(e))
    }

    fn insert(&self, mut entry: Entry, replaces: Option<u64>) {
        let size = entry.bytes();
        if size > self.max_bytes {
            return;
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if let Some(old) = replaces {
            inner.remove(old);
        }
        while inner.bytes + size > self.max_bytes {
            if !inner.evict_oldest() {
                break;
            }
        }
        let id = inner.next_id;
        inner.next_id += 1;
        entry.id = id;
        for &h in &entry.anchors {
            inner.anchors.insert(h, id);
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.lru.insert(tick, id);
        inner.entries.insert(id, (Arc::new(entry), tick, size));
        inner.bytes += size;
    }
}

impl Inner {
    fn touch(&mut self, id: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((_, t, _)) = self.entries.get_mut(&id) {
            let old = std::mem::replace(t, tick);
            self.lru.remove(&old);
            self.lru.insert(tick, id);
        }
    }

    fn evict_oldest(&mut self) -> bool {
        let Some((_, id)) = self.lru.pop_first() else {
            return false;
        };
        self.remove(id);
        true
    }

    /// Drops entry `id` (if still held) and its anchors.
    fn remove(&mut self, id: u64) {
        let Some((entry, tick, size)) = self.entries.remove(&id) else {
            return;
        };
        self.lru.remove(&tick);
        for h in &entry.anchors {
            if self.anchors.get(h) == Some(&id) {
                self.anchors.remove(h);
            }
        }
        self.bytes = self.bytes.saturating_sub(size);
    }
}

/// A fresh encoding of all of `text`.
fn full(encoder: &WordEncoder<'_>, text: &str) -> Result<Outcome, TokenizeError> {
    let (ids, words) = encoder.encode(text)?;
    let piece = Piece {
        cuts: collect_cuts(text, &words, 0),
        ids: ids.clone(),
    };
    let mut anchors = Vec::new();
    extend_anchors(text.as_bytes(), &mut anchors);
    Ok(Outcome::Fresh {
        ids,
        pieces: vec![PieceRef::whole(piece, text.len())],
        reused: 0,
        anchors,
        replaces: None,
    })
}

/// One piece holding everything `pieces` use, with their starts as cut points.
fn flatten(pieces: &[PieceRef]) -> PieceRef {
    let mut ids = Vec::with_capacity(pieces.iter().map(|p| p.tokens).sum());
    let mut cuts = Vec::new();
    let (mut byte, mut token) = (0usize, 0usize);
    let mut cuts_fit = true;
    for p in pieces {
        let start = (byte > 0).then_some((0u32, 0u32));
        for &(c, t) in start.iter().chain(p.cuts()) {
            match (
                u32::try_from(byte + c as usize),
                u32::try_from(token + t as usize),
            ) {
                (Ok(c), Ok(t)) if cuts_fit => cuts.push((c, t)),
                _ => cuts_fit = false,
            }
        }
        ids.extend_from_slice(p.ids());
        byte += p.bytes;
        token += p.tokens;
    }
    PieceRef::whole(Piece { ids, cuts }, byte)
}

/// Length of the common prefix of `a` and `b` (memcmp per chunk, bytes in the last one).
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const STEP: usize = 4096;
    let mut n = 0;
    for (x, y) in a.chunks(STEP).zip(b.chunks(STEP)) {
        if x == y {
            n += x.len();
        } else {
            return n + x.iter().zip(y).take_while(|(p, q)| p == q).count();
        }
    }
    n
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
        super::bounds::check_unbroken_runs(text, super::MAX_PRETOKEN_BYTES)?;
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

/// Appends to `anchors` (the chained hashes of `text`'s first blocks) those of the remaining
/// full [`ANCHOR_BYTES`] blocks.
fn extend_anchors(text: &[u8], anchors: &mut Vec<u64>) {
    let done = anchors.len();
    let mut h = anchors.last().copied().unwrap_or(0);
    let rest = text.get(done * ANCHOR_BYTES..).unwrap_or(&[]);
    anchors.reserve(rest.len() / ANCHOR_BYTES);
    for block in rest.chunks_exact(ANCHOR_BYTES) {
        h = xxh3_64_with_seed(block, h);
        anchors.push(h);
    }
}

/// The safe cut points among `words` (word starts of the encoding of `text[base..]`), as
/// `(byte offset, token index)` relative to `base` and to the encoding's first token.
fn collect_cuts(text: &str, words: &[(usize, usize)], base: usize) -> Vec<(u32, u32)> {
    let mut cuts = Vec::new();
    let mut last = 0;
    for &(offset, tok) in words {
        if offset < last + CUT_SPACING || !is_safe_cut(text, base + offset) {
            continue;
        }
        let (Ok(c32), Ok(t32)) = (u32::try_from(offset), u32::try_from(tok)) else {
            break;
        };
        cuts.push((c32, t32));
        last = offset;
    }
    cuts
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
