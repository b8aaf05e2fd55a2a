//! An exactly equivalent faster encoder for the Qwen2-style byte-level BPE layout
//! (NFC normalizer, `Split(<Qwen2 regex>, Isolated)` + `ByteLevel(use_regex=false)`, BPE).
//!
//! The tokenizers crate spends most of its time in the Oniguruma pre-tokenizer regex (and, for
//! non-ASCII text, in NFC with offset tracking). This encoder splits added (special) tokens
//! itself, and for every segment that is pure ASCII runs a hand-written scanner that implements
//! the regex's leftmost-first alternation exactly on ASCII (where `\p{L}` = `[A-Za-z]`, `\p{N}`
//! = `[0-9]`, `\s` = `[\t\n\v\f\r ]`, and NFC is the identity). A segment with other
//! characters is cut where the pattern and NFC cannot act across ([`split_points`]); runs made
//! only of characters [`unicode_pretoken`] classifies (most Latin, Greek, Cyrillic, CJK, kana,
//! Hangul, full-width and emoji text) get the same scanner over character classes, and the
//! remaining runs go through the crate's full pipeline. Each pre-token's ids come from a
//! [`WordCache`] of earlier results, or from the model's [`MergeTable`] (once built; after the
//! crate's whole-word lookup, so `ignore_merges` is the crate's), or from the crate's own BPE
//! model on the byte-level mapped pre-token, then memoised.
//! [`FastEncoder::new`] returns `None` for any other tokenizer layout, which then always uses
//! the crate.
//!
//! Equivalence is tested against the crate on the fixtures, the 400 KB corpus, random text,
//! and every character of the [`unicode_pretoken`] table in context (`tests/tok_fast_bpe.rs`).
//!
//! Bounded: a pre-token longer than [`MAX_PRETOKEN_BYTES`] (or a run for the crate that long)
//! is not tokenized; [`FastEncoder::encode`] then fails with
//! [`TokenizeError::PretokenTooLong`] naming where it starts, a place where the ids before it
//! are exactly the whole text's ([`super::bounds`]).
//!
//! Concurrency: shared by all encodes of a model; the word cache and the crate's BPE cache are
//! internally synchronised.

use serde_json::json;
use tokenizers::models::ModelWrapper;
use tokenizers::{Model, Tokenizer};

use super::bounds::MAX_PRETOKEN_BYTES;
use super::error::TokenizeError;
use super::merge_table::{LazyMerges, MergeTable};
use super::unicode_pretoken;
use super::word_cache::{self, Probe, WordCache};

/// Pre-tokens found (and their word-cache sets prefetched) ahead of their encoding: enough
/// for their memory waits to overlap, few enough that their lines are still cached when read.
const LOOKAHEAD: usize = 16;

/// The Qwen2 / cl100k-style split pattern this scanner implements.
pub const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token ids plus `(byte offset, token index)` of every pre-token (word) start after the first.
pub type WordEncoding = (Vec<u32>, Vec<(usize, usize)>);

/// The fast encoder for one tokenizer.
#[derive(Debug)]
pub struct FastEncoder {
    /// Added tokens (content, id), matched leftmost-longest like the crate.
    added: Vec<(String, u32)>,
    /// The distinct first bytes of the added tokens, as a list and as a table.
    first_bytes: Vec<u8>,
    is_first: [bool; 256],
    byte_chars: [char; 256],
    /// Ids of ASCII pre-tokens seen before.
    words: WordCache,
    /// The model's merges, for the pre-tokens the word cache misses (else the crate's BPE):
    /// given, or built once the crate has merged enough misses.
    merges: Option<MergeTable>,
    lazy_merges: Option<LazyMerges>,
    /// Longest pre-token (and run for the crate) tokenized, in bytes.
    max_pretoken: usize,
}

impl FastEncoder {
    /// A fast encoder if `tokenizer` has exactly the supported layout.
    pub fn new(tokenizer: &Tokenizer) -> Option<Self> {
        let expected_pre = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]});
        let pre = serde_json::to_value(tokenizer.get_pre_tokenizer()?).ok()?;
        if pre != expected_pre {
            return None;
        }
        if let Some(n) = tokenizer.get_normalizer()
            && serde_json::to_value(n).ok()? != json!({"type": "NFC"})
        {
            return None;
        }
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return None;
        };
        if bpe.dropout.is_some_and(|d| d > 0.0) {
            return None;
        }
        let mut added = Vec::new();
        for (id, tok) in tokenizer.get_added_vocabulary().get_added_tokens_decoder() {
            if tok.lstrip
                || tok.rstrip
                || tok.single_word
                || tok.normalized
                || tok.content.is_empty()
            {
                return None;
            }
            added.push((tok.content.clone(), *id));
        }
        let mut first_bytes: Vec<u8> = added.iter().filter_map(|(t, _)| t.bytes().next()).collect();
        first_bytes.sort_unstable();
        first_bytes.dedup();
        let mut is_first = [false; 256];
        for &b in &first_bytes {
            is_first[usize::from(b)] = true;
        }
        Some(Self {
            added,
            first_bytes,
            is_first,
            byte_chars: byte_chars(),
            words: WordCache::new(word_cache::DEFAULT_CAPACITY),
            merges: None,
            lazy_merges: None,
            max_pretoken: MAX_PRETOKEN_BYTES,
        })
    }

    /// The same encoder merging word-cache misses itself with `table`, which must be the
    /// tokenizer's own (`MergeTable::from_tokenizer_json` on the file it was loaded from).
    pub fn with_merge_table(mut self, table: MergeTable) -> Self {
        self.merges = Some(table);
        self
    }

    /// The same encoder merging word-cache misses itself once `lazy` has been built (it must
    /// be the tokenizer's own file).
    pub fn with_lazy_merges(mut self, lazy: LazyMerges) -> Self {
        self.lazy_merges = Some(lazy);
        self
    }

    /// Whether word-cache misses are merged here rather than by the crate (now).
    pub fn has_merge_table(&self) -> bool {
        self.merge_table().is_some()
    }

    fn merge_table(&self) -> Option<&MergeTable> {
        self.merges
            .as_ref()
            .or_else(|| self.lazy_merges.as_ref().and_then(LazyMerges::get))
    }

    /// The byte-level alphabet (byte → the character standing for it in the vocab).
    pub fn byte_chars(&self) -> &[char; 256] {
        &self.byte_chars
    }

    /// The same encoder with another pre-token bound (tests use small ones).
    pub fn with_max_pretoken_bytes(mut self, max: usize) -> Self {
        self.max_pretoken = max.max(1);
        self
    }

    /// The same encoder with a word cache of `capacity` pre-tokens (0 turns it off).
    pub fn with_word_cache_capacity(mut self, capacity: usize) -> Self {
        self.words = WordCache::new(capacity);
        self
    }

    /// Pre-tokens memoised by the word cache right now.
    pub fn cached_words(&self) -> usize {
        self.words.len()
    }

    /// The leftmost added token at or after `from`, the longest of those starting there (the
    /// crate's LeftmostLongest): `(start, index into added)`. One memchr pass over the text for
    /// the tokens' first bytes, instead of one substring search per token.
    fn next_added(&self, text: &str, from: usize) -> Option<(usize, usize)> {
        let bytes = text.as_bytes();
        let mut at = from;
        loop {
            let rest = bytes.get(at..)?;
            let offset = match self.first_bytes[..] {
                [] => None,
                [a] => memchr::memchr(a, rest),
                [a, b] => memchr::memchr2(a, b, rest),
                [a, b, c] => memchr::memchr3(a, b, c, rest),
                _ => rest.iter().position(|&b| self.is_first[usize::from(b)]),
            }?;
            let start = at + offset;
            let tail = bytes.get(start..).unwrap_or(&[]);
            let longest = self
                .added
                .iter()
                .enumerate()
                .filter(|(_, (content, _))| tail.starts_with(content.as_bytes()))
                .max_by_key(|(_, (content, _))| content.len());
            if let Some((k, _)) = longest {
                return Some((start, k));
            }
            at = start + 1;
        }
    }

    /// Encodes `text` without special tokens, exactly like `tokenizer.encode(text, false)`,
    /// or fails with [`TokenizeError::PretokenTooLong`] at the first pre-token over the bound.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<WordEncoding, TokenizeError> {
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return Err(TokenizeError::Encode("fast path needs a BPE model".into()));
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut words = Vec::with_capacity(text.len() / 4);
        let mut pos = 0;
        loop {
            let best = self.next_added(text, pos);
            let seg_end = best.map_or(text.len(), |(s, _)| s);
            let segment = text.get(pos..seg_end).unwrap_or("");
            if !segment.is_empty() {
                if !ids.is_empty() {
                    words.push((pos, ids.len()));
                }
                self.encode_segment(tokenizer, bpe, segment, pos, &mut ids, &mut words)?;
            }
            let Some((start, k)) = best else { break };
            let Some((content, id)) = self.added.get(k) else {
                break;
            };
            if !ids.is_empty() {
                words.push((start, ids.len()));
            }
            ids.push(*id);
            pos = start + content.len();
        }
        Ok((ids, words))
    }

    fn encode_segment(
        &self,
        tokenizer: &Tokenizer,
        bpe: &tokenizers::models::bpe::BPE,
        segment: &str,
        base: usize,
        ids: &mut Vec<u32>,
        words: &mut Vec<(usize, usize)>,
    ) -> Result<(), TokenizeError> {
        if !segment.is_ascii() {
            // Split at guaranteed pre-token boundaries into runs scanned here (ASCII, or only
            // characters `unicode_pretoken` handles) and runs for the crate.
            let mut run_start = 0;
            let mut run_fast = true;
            let mut piece_start = 0;
            for c in split_points(segment).chain(std::iter::once(segment.len())) {
                let piece = segment.get(piece_start..c).unwrap_or("");
                let fast = piece.is_ascii() || unicode_pretoken::handles(piece);
                if piece_start > run_start && fast != run_fast {
                    self.encode_run(
                        tokenizer,
                        bpe,
                        segment,
                        run_start..piece_start,
                        run_fast,
                        base,
                        ids,
                        words,
                    )?;
                    run_start = piece_start;
                }
                if piece_start == run_start {
                    run_fast = fast;
                }
                piece_start = c;
            }
            if segment.len() > run_start {
                self.encode_run(
                    tokenizer,
                    bpe,
                    segment,
                    run_start..segment.len(),
                    run_fast,
                    base,
                    ids,
                    words,
                )?;
            }
            return Ok(());
        }
        self.encode_pretokens(bpe, segment, true, base, ids, words)
    }

    /// Encodes `segment[range]`, a run that starts at a pre-token boundary.
    #[allow(clippy::too_many_arguments)]
    fn encode_run(
        &self,
        tokenizer: &Tokenizer,
        bpe: &tokenizers::models::bpe::BPE,
        segment: &str,
        range: std::ops::Range<usize>,
        fast: bool,
        base: usize,
        ids: &mut Vec<u32>,
        words: &mut Vec<(usize, usize)>,
    ) -> Result<(), TokenizeError> {
        let start = range.start;
        let run = segment.get(range).unwrap_or("");
        if !fast && run.len() > self.max_pretoken {
            // The run starts at a split point: a pre-token boundary in any context, where
            // NFC does not act across, so the ids before it are exact.
            return Err(TokenizeError::PretokenTooLong {
                at: Some(base + start),
                limit: self.max_pretoken,
            });
        }
        if start > 0 {
            words.push((base + start, ids.len()));
        }
        if fast {
            // NOTE: the grouping above classified every character of this run already; the
            // Unicode scanner classifies them again as it goes rather than keeping a class per
            // character, which would cost 24 bytes per character of a long run.
            return self.encode_pretokens(bpe, run, run.is_ascii(), base + start, ids, words);
        }
        let enc = tokenizer
            .encode(run, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let (w, o) = (enc.get_word_ids(), enc.get_offsets());
        let first = ids.len();
        for i in 1..enc.len() {
            if let (Some(a), Some(b), Some(prev), Some(off)) =
                (w.get(i - 1), w.get(i), o.get(i - 1), o.get(i))
                && a != b
                && prev.1 <= off.0
            {
                words.push((base + start + off.0, first + i));
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Encodes `text` pre-token by pre-token with the hand-written pre-tokenizer: the byte
    /// scanner if `ascii`, else the [`unicode_pretoken`] one (every character of `text` must
    /// then be one it [`unicode_pretoken::handles`]). Records each word start after the first.
    fn encode_pretokens(
        &self,
        bpe: &tokenizers::models::bpe::BPE,
        text: &str,
        ascii: bool,
        base: usize,
        ids: &mut Vec<u32>,
        words: &mut Vec<(usize, usize)>,
    ) -> Result<(), TokenizeError> {
        let bytes = text.as_bytes();
        let mut scratch = WordScratch::default();
        // NOTE: pre-tokens are found a batch ahead of their encoding, each one's word-cache
        // set located (prefetched) as it is found, so that the batch's cache misses overlap
        // instead of each lookup waiting on memory in turn. Encoding stays in text order, so
        // a word memoised by an earlier one of the batch is a hit for a later one.
        let mut ahead = [(0usize, 0usize, None::<Probe>); LOOKAHEAD];
        let mut i = 0;
        while i < bytes.len() {
            let mut found = 0;
            let mut too_long = None;
            while found < LOOKAHEAD && i < bytes.len() {
                // `max` only guards progress: a pre-token is never empty.
                let end = if ascii {
                    ascii_pretoken_end(bytes, i)
                } else {
                    unicode_pretoken::pretoken_end(text, i)
                }
                .max(i + 1);
                if end - i > self.max_pretoken {
                    too_long = Some(i);
                    break;
                }
                let probe = self.words.locate(bytes.get(i..end).unwrap_or(&[]));
                if let Some(entry) = ahead.get_mut(found) {
                    *entry = (i, end, probe);
                }
                found += 1;
                i = end;
            }
            for &(start, end, probe) in ahead.get(..found).unwrap_or(&[]) {
                if start > 0 {
                    words.push((base + start, ids.len()));
                }
                let word = bytes.get(start..end).unwrap_or(&[]);
                self.encode_word(bpe, word, probe, &mut scratch, ids)?;
            }
            if let Some(at) = too_long {
                // `at` starts a pre-token of the whole text; the ids before it are final
                // (module docs of `bounds`). In a Unicode run every character is NFC-inert
                // (`unicode_pretoken`), so NFC does not act across `at` either.
                return Err(TokenizeError::PretokenTooLong {
                    at: Some(base + at),
                    limit: self.max_pretoken,
                });
            }
        }
        Ok(())
    }

    /// Appends the ids of one pre-token (raw UTF-8 bytes): from the word cache, else from the
    /// merge table (after the crate's whole-word lookup when it ignores merges for vocab
    /// words), else from the crate's BPE model on its byte-level mapping; then memoised.
    fn encode_word(
        &self,
        bpe: &tokenizers::models::bpe::BPE,
        word: &[u8],
        located: Option<Probe>,
        scratch: &mut WordScratch,
        ids: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        if located.is_some_and(|probe| self.words.extend_located(&probe, ids)) {
            return Ok(());
        }
        let WordScratch { mapped, pairs } = scratch;
        mapped.clear();
        for &b in word {
            mapped.push(self.byte_chars[usize::from(b)]);
        }
        let first = ids.len();
        let merged_here = match self.merge_table() {
            Some(table) => match bpe.token_to_id(mapped).filter(|_| bpe.ignore_merges) {
                Some(id) => {
                    ids.push(id);
                    true
                }
                None => table.encode(word, ids, pairs),
            },
            None => {
                if let Some(lazy) = &self.lazy_merges {
                    lazy.note_miss();
                }
                false
            }
        };
        if !merged_here {
            let toks = bpe
                .tokenize(mapped)
                .map_err(|e| TokenizeError::Encode(e.to_string()))?;
            ids.extend(toks.iter().map(|t| t.id));
        }
        self.words.insert(word, ids.get(first..).unwrap_or(&[]));
        Ok(())
    }
}

/// Buffers one pre-token's encode reuses from the last: its byte-level mapping and the merge
/// table's pairs.
#[derive(Default)]
struct WordScratch {
    mapped: String,
    pairs: Vec<(u32, u32)>,
}

/// Positions `c` (ascending, `c > 0`) that are pre-token boundaries of `segment` whatever its
/// context, and where NFC does not act across: `segment[c]` is a space or tab and the character
/// before is not whitespace. No alternative of the pattern continues from a non-space character
/// into a following space/tab (letter runs, digits and symbol runs stop there; the symbol run's
/// `[\r\n]*` takes only newlines), every decision before `c` looks at `segment[c]` at most
/// (where a space/tab and the end of text behave alike), and an ASCII starter never composes
/// with what precedes it.
fn split_points(segment: &str) -> impl Iterator<Item = usize> + '_ {
    segment
        .char_indices()
        .scan(None::<char>, |prev, (i, ch)| {
            let before = prev.replace(ch);
            Some((i, ch, before))
        })
        .filter_map(move |(i, ch, before)| {
            let is_cut = matches!(ch, ' ' | '\t') && before.is_some_and(|p| !maybe_space(p));
            is_cut.then_some(i)
        })
}

/// Unicode White_Space (Oniguruma's `\s`), widened with characters some Unicode versions or
/// Python treat as spaces, so that a regex-table difference can only make us cut less.
pub(crate) fn maybe_space(c: char) -> bool {
    c.is_whitespace()
        || matches!(c, '\u{1c}'..='\u{1f}' | '\u{180e}' | '\u{200b}'..='\u{200d}' | '\u{2060}' | '\u{feff}')
}

/// GPT-2's byte → printable char table (the ByteLevel pre-tokenizer's alphabet).
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[usize::from(b)] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    table
}

fn is_letter(b: u8) -> bool {
    b.is_ascii_alphabetic()
}
fn is_digit(b: u8) -> bool {
    b.is_ascii_digit()
}
/// Oniguruma's `\s` on ASCII.
fn is_space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
}
fn is_newline(b: u8) -> bool {
    matches!(b, b'\r' | b'\n')
}
/// `[^\s\p{L}\p{N}]` on ASCII.
fn is_other(b: u8) -> bool {
    !is_space(b) && !is_letter(b) && !is_digit(b)
}

fn run_end(s: &[u8], mut i: usize, class: fn(u8) -> bool) -> usize {
    while s.get(i).is_some_and(|&b| class(b)) {
        i += 1;
    }
    i
}

/// End of the pre-token starting at `i` (an ASCII segment), following the alternatives of
/// [`QWEN2_PATTERN`] in order.
fn ascii_pretoken_end(s: &[u8], i: usize) -> usize {
    let at = |k: usize| s.get(k).copied();
    let Some(c) = at(i) else { return i };
    // 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == b'\'' {
        let l = |k: usize| at(k).map(|b| b.to_ascii_lowercase());
        match (l(i + 1), l(i + 2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
            (Some(b'r'), Some(b'e')) | (Some(b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => {
                return i + 3;
            }
            _ => {}
        }
    }
    // 2. [^\r\n\p{L}\p{N}]?\p{L}+
    if !is_newline(c) && !is_letter(c) && !is_digit(c) && at(i + 1).is_some_and(is_letter) {
        return run_end(s, i + 1, is_letter);
    }
    if is_letter(c) {
        return run_end(s, i, is_letter);
    }
    // 3. \p{N}
    if is_digit(c) {
        return i + 1;
    }
    // 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    let punct_start = if c == b' ' && at(i + 1).is_some_and(is_other) {
        Some(i + 1)
    } else if is_other(c) {
        Some(i)
    } else {
        None
    };
    if let Some(p) = punct_start {
        let e = run_end(s, p, is_other);
        return run_end(s, e, is_newline);
    }
    // Only whitespace remains.
    let ws_end = run_end(s, i, is_space);
    // 5. \s*[\r\n]+ : up to and including the last newline of the whitespace run.
    if let Some(last_nl) = (i..ws_end).rev().find(|&k| at(k).is_some_and(is_newline)) {
        return last_nl + 1;
    }
    // 6. \s+(?!\S)
    if ws_end == s.len() {
        return ws_end;
    }
    if ws_end - 1 > i {
        return ws_end - 1;
    }
    // 7. \s+
    ws_end
}
