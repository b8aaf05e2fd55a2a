//! Long JSON strings parsed outside serde_json: the prompt text of a large body is one or a
//! few long strings, and serde_json unescapes them byte by byte into a scratch buffer, then
//! copies them. [`parse_with_long_strings`] instead parses a small copy of the body in which
//! each long string value is a placeholder, unescapes the long strings itself (copying the
//! runs between escapes while the scanner looks for the string's end), and puts them in place.
//!
//! Exactness: the small body has the same syntax as the original (a string replaced by a
//! string), and [`unescape`] produces serde_json's text for every string it accepts; anything
//! it does not handle (a raw control character, an unknown escape, a lone surrogate) returns
//! `None`, and so does a placeholder that is not found exactly once (a duplicate key dropped
//! it, or the body spelled one): the caller then parses the original body with serde_json,
//! which also produces the error a bad body gets.

use std::fmt::Write as _;
use std::ops::Range;

use serde_json::Value;

/// The value of four hex digits.
fn hex4(digits: &[u8]) -> Option<u32> {
    if digits.len() != 4 {
        return None;
    }
    digits.iter().try_fold(0u32, |acc, &d| {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            _ => return None,
        };
        Some(acc * 16 + u32::from(v))
    })
}

/// The character escaped at `body[i..]` (which starts with `\\`) and the escape's length;
/// `None` for what is left to serde_json (an unknown escape, a lone surrogate).
pub(crate) fn decode_escape(body: &[u8], i: usize) -> Option<(char, usize)> {
    let c = match *body.get(i + 1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let unit = hex4(body.get(i + 2..i + 6)?)?;
            return match unit {
                0xD800..=0xDBFF => {
                    if body.get(i + 6..i + 8)? != b"\\u" {
                        return None;
                    }
                    let low = hex4(body.get(i + 8..i + 12)?)?;
                    if !(0xDC00..=0xDFFF).contains(&low) {
                        return None;
                    }
                    let c = char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))?;
                    Some((c, 12))
                }
                0xDC00..=0xDFFF => None,
                _ => Some((char::from_u32(unit)?, 6)),
            };
        }
        _ => return None,
    };
    Some((c, 2))
}

/// Whether `raw` holds a control character (< 0x20), which JSON strings may not hold raw.
/// NOTE: a minimum without early exit, so that it vectorises (~4 µs for 400 KB here).
pub(crate) fn has_control(raw: &[u8]) -> bool {
    raw.iter().fold(u8::MAX, |acc, &b| acc.min(b)) < 0x20
}

/// A long string value found by the scanner.
#[derive(Debug)]
pub(crate) struct LongString {
    /// Its bytes in the body, quotes included.
    pub(crate) span: Range<usize>,
    /// Its text, or `None` when serde_json must decide (module docs).
    pub(crate) text: Option<String>,
}

/// `body` (valid UTF-8, already scanned) parsed with the `long` string values (ascending)
/// put in place as the scanner unescaped them; `None` when the caller must parse the original
/// body with serde_json instead (module docs).
pub(crate) fn parse_with_long_strings(body: &str, long: Vec<LongString>) -> Option<Value> {
    let nonce = fastrand::u64(..);
    let long_bytes: usize = long.iter().map(|l| l.span.len()).sum();
    let mut small = String::with_capacity(body.len().saturating_sub(long_bytes) + long.len() * 48);
    let mut texts = Vec::with_capacity(long.len());
    let mut at = 0;
    for (k, string) in long.into_iter().enumerate() {
        small.push_str(body.get(at..string.span.start)?);
        write!(small, "\"\\u0000kvpick-{nonce:016x}-{k}\"").ok()?;
        texts.push(Some(string.text?));
        at = string.span.end;
    }
    small.push_str(body.get(at..)?);
    let mut root: Value = serde_json::from_str(&small).ok()?;
    let marker = format!("\0kvpick-{nonce:016x}-");
    let mut restored = 0;
    if !restore(&mut root, &marker, &mut texts, &mut restored) || restored != texts.len() {
        return None;
    }
    Some(root)
}

/// Puts the texts back in place of their placeholders; false if one is seen twice.
fn restore(
    v: &mut Value,
    marker: &str,
    texts: &mut [Option<String>],
    restored: &mut usize,
) -> bool {
    match v {
        Value::String(s) => {
            let Some(k) = s.strip_prefix(marker) else {
                return true;
            };
            let Some(text) = k
                .parse::<usize>()
                .ok()
                .and_then(|k| texts.get_mut(k))
                .and_then(Option::take)
            else {
                return false;
            };
            *s = text;
            *restored += 1;
            true
        }
        Value::Array(items) => items
            .iter_mut()
            .all(|item| restore(item, marker, texts, restored)),
        Value::Object(map) => map
            .values_mut()
            .all(|item| restore(item, marker, texts, restored)),
        _ => true,
    }
}

/// Long strings are cached from this many raw bytes on (shorter ones unescape in a few
/// microseconds, less than looking them up).
pub(crate) const MIN_CACHED_STRING: usize = 32 * 1024;
/// Cached strings compared with a new one at most (most recent first).
const MAX_CANDIDATES: usize = 4;
/// Bytes compared before a cached string is considered (cheap rejection of unrelated ones).
const PROBE_BYTES: usize = 256;
/// Resume points are recorded at least this far apart (raw bytes).
pub(crate) const CHECKPOINT_EVERY: usize = 4 * 1024;
/// Strings kept at most, whatever their size.
const MAX_CACHED_STRINGS: usize = 64;

/// Long string values unescaped before, so that a body repeating one's beginning (a document
/// followed by a new question, a conversation that grew) copies the unescaped prefix instead
/// of unescaping it again.
///
/// Exact: a cached string is reused only as far as its raw bytes equal the new string's
/// (compared, never hashed), and only up to a *resume point* — a raw offset where the
/// unescaper was between escapes — with the text it had produced by then; unescaping is a
/// left-to-right function of the raw bytes, so it continues from there as if it had read the
/// prefix itself. Memory is bounded by bytes (raw + text of every entry) and entry count.
///
/// Concurrency: one mutex, held to pick candidates and to insert, never while comparing or
/// copying (entries are shared immutable `Arc`s).
pub struct LongStringCache {
    max_bytes: usize,
    inner: std::sync::Mutex<CacheInner>,
    /// Raw bytes taken from cached strings instead of unescaped.
    reused: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct CacheInner {
    entries: std::collections::VecDeque<std::sync::Arc<CachedString>>,
    bytes: usize,
}

/// One cached string: its raw content (between the quotes), its text, and resume points.
pub(crate) struct CachedString {
    raw: Box<[u8]>,
    text: Box<str>,
    /// `(raw offset, text length)` pairs, ascending, where unescaping may resume.
    resume: Vec<(u32, u32)>,
}

/// Where a string can resume from a cached one: raw bytes `..raw` are equal and unescape to
/// `entry.text[..text]`.
pub(crate) struct Resume {
    entry: std::sync::Arc<CachedString>,
    pub(crate) raw: usize,
    text: usize,
}

impl Resume {
    /// The text the equal raw prefix unescapes to.
    pub(crate) fn text(&self) -> &str {
        self.entry.text.get(..self.text).unwrap_or_default()
    }
}

impl LongStringCache {
    /// A cache of at most `max_bytes` (0 disables it).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            inner: std::sync::Mutex::new(CacheInner::default()),
            reused: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        // NOTE: a panic while holding the lock leaves a consistent list (entries are
        // immutable); keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The furthest resume point of a cached string for the string whose raw content starts
    /// `rest` (to the end of the body); `None` when none shares at least
    /// [`MIN_CACHED_STRING`] bytes with it.
    pub(crate) fn resume(&self, rest: &[u8]) -> Option<Resume> {
        if self.max_bytes == 0 {
            return None;
        }
        let probe = rest.get(..PROBE_BYTES)?;
        let candidates: Vec<std::sync::Arc<CachedString>> = self
            .lock()
            .entries
            .iter()
            .filter(|e| e.raw.get(..PROBE_BYTES) == Some(probe))
            .take(MAX_CANDIDATES)
            .cloned()
            .collect();
        let mut best: Option<Resume> = None;
        for entry in candidates {
            let equal = common_prefix(&entry.raw, rest);
            let at = entry
                .resume
                .partition_point(|(raw, _)| *raw as usize <= equal);
            let Some(&(raw, text)) = at.checked_sub(1).and_then(|i| entry.resume.get(i)) else {
                continue;
            };
            if (raw as usize) >= MIN_CACHED_STRING
                && best.as_ref().is_none_or(|b| b.raw < raw as usize)
            {
                best = Some(Resume {
                    entry,
                    raw: raw as usize,
                    text: text as usize,
                });
            }
        }
        if let Some(resume) = &best {
            self.reused
                .fetch_add(resume.raw as u64, std::sync::atomic::Ordering::Relaxed);
        }
        best
    }

    /// Raw bytes of long strings taken from cached ones (instead of unescaped) so far.
    pub fn reused_bytes(&self) -> u64 {
        self.reused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Keeps a string just unescaped (raw content `raw`, `text`, its resume points).
    pub(crate) fn insert(&self, raw: &[u8], text: &str, resume: Vec<(u32, u32)>) {
        let size = raw.len() + text.len() + resume.len() * 8;
        if self.max_bytes == 0 || size > self.max_bytes / 2 {
            return;
        }
        let entry = std::sync::Arc::new(CachedString {
            raw: raw.into(),
            text: text.into(),
            resume,
        });
        let mut inner = self.lock();
        // A string this one extends (same raw bytes, shorter) is no better a base: drop it.
        let before = inner.entries.len();
        let mut dropped = 0;
        inner.entries.retain(|old| {
            let extended = old.raw.len() <= raw.len()
                && old.raw.get(..PROBE_BYTES) == raw.get(..PROBE_BYTES)
                && raw.get(..old.raw.len()) == Some(old.raw.as_ref());
            if extended {
                dropped += old.raw.len() + old.text.len() + old.resume.len() * 8;
            }
            !extended
        });
        if inner.entries.len() != before {
            inner.bytes = inner.bytes.saturating_sub(dropped);
        }
        inner.entries.push_front(entry);
        inner.bytes += size;
        while inner.bytes > self.max_bytes || inner.entries.len() > MAX_CACHED_STRINGS {
            let Some(old) = inner.entries.pop_back() else {
                break;
            };
            inner.bytes = inner
                .bytes
                .saturating_sub(old.raw.len() + old.text.len() + old.resume.len() * 8);
        }
    }

    /// Strings held.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for LongStringCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("LongStringCache")
            .field("strings", &inner.entries.len())
            .field("bytes", &inner.bytes)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

/// Length of the common prefix of `a` and `b`, compared a chunk at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const CHUNK: usize = 1024;
    let n = a.len().min(b.len());
    let mut at = 0;
    while at < n {
        let end = (at + CHUNK).min(n);
        let (x, y) = (
            a.get(at..end).unwrap_or_default(),
            b.get(at..end).unwrap_or_default(),
        );
        if x != y {
            return at + x.iter().zip(y).take_while(|(p, q)| p == q).count();
        }
        at = end;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_restored_or_refused() {
        let long = "x\\n".repeat(50);
        let body = format!(r#"{{"a":"{long}","b":["{long}",1],"c":"short"}}"#);
        let text = "x\n".repeat(50);
        let strings: Vec<LongString> = body
            .match_indices(&format!("\"{long}\""))
            .map(|(i, m)| LongString {
                span: i..i + m.len(),
                text: Some(text.clone()),
            })
            .collect();
        assert_eq!(strings.len(), 2);
        let fast = parse_with_long_strings(&body, strings).unwrap();
        assert_eq!(fast, serde_json::from_str::<Value>(&body).unwrap());
        // A duplicate key drops a placeholder: refused, serde_json decides.
        let dup = format!(r#"{{"a":"{long}","a":1}}"#);
        let string = LongString {
            span: 5..5 + long.len() + 2,
            text: Some(text),
        };
        assert_eq!(parse_with_long_strings(&dup, vec![string]), None);
    }
}
