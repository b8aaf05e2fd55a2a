//! One linear pass over raw JSON bytes that enforces nesting and array bounds *before*
//! serde_json builds a tree (so a hostile body cannot make us allocate a huge tree or recurse
//! deeply), and that finds the byte span of the top-level `"model"` string value (so the model
//! can be rewritten without re-serialising the body). For [`super::parse`], the same pass also
//! unescapes the long string values it walks through ([`scan_collecting`]).
//!
//! NOTE: the scanner does not validate JSON syntax; serde_json does that afterwards. It only
//! has to be right on valid JSON and must never panic or loop on invalid input.

use std::ops::Range;

use super::error::RequestError;
use super::strings::{
    CHECKPOINT_EVERY, LongString, LongStringCache, MIN_CACHED_STRING, decode_escape, has_control,
};

/// Bounds applied to request bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    /// Maximum nesting depth of arrays/objects (the top-level object is depth 1).
    pub max_depth: usize,
    /// Maximum number of elements in any one array.
    pub max_array_len: usize,
}

impl Default for ParseLimits {
    fn default() -> Self {
        // 64 levels is far beyond any real tool schema; 2^21 elements allows token-id prompts of
        // 2M tokens, beyond every model's context.
        Self {
            max_depth: 64,
            max_array_len: 1 << 21,
        }
    }
}

/// What the scan learned about the body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyShape {
    /// Byte span of the top-level `model` value *including* its quotes, when it is a string.
    /// With duplicate keys the last one wins (as in serde_json and Python's json).
    pub model_span: Option<Range<usize>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Frame {
    Object,
    Array { len: usize, empty: bool },
}

/// Scans `body`, enforcing `limits`, and returns its [`BodyShape`].
pub fn scan(body: &[u8], limits: ParseLimits) -> Result<BodyShape, RequestError> {
    scan_impl(body, limits, None)
}

/// [`scan`] of a UTF-8 `body`, also collecting the string *values* (not keys) whose raw span
/// is at least `min_len` bytes, unescaped on the way ([`LongString`]).
pub(crate) fn scan_collecting(
    body: &str,
    limits: ParseLimits,
    min_len: usize,
    long_strings: &mut Vec<LongString>,
    cache: Option<&LongStringCache>,
) -> Result<BodyShape, RequestError> {
    let mut collect = Collect {
        source: body,
        min_len,
        scratch: String::new(),
        found: long_strings,
        cache,
    };
    scan_impl(body.as_bytes(), limits, Some(&mut collect))
}

/// Where [`scan_collecting`] puts what it finds.
struct Collect<'a> {
    source: &'a str,
    min_len: usize,
    scratch: String,
    found: &'a mut Vec<LongString>,
    /// Long strings seen in earlier bodies, to resume from ([`LongStringCache`]).
    cache: Option<&'a LongStringCache>,
}

fn scan_impl(
    body: &[u8],
    limits: ParseLimits,
    mut collect: Option<&mut Collect<'_>>,
) -> Result<BodyShape, RequestError> {
    let mut stack: Vec<Frame> = Vec::with_capacity(16);
    let mut shape = BodyShape::default();
    // At depth 1 inside the top-level object: whether the next string is a key, and whether the
    // last key read was `model`.
    let mut expect_key = false;
    let mut last_key_is_model = false;
    let mut i = 0usize;
    while let Some(&b) = body.get(i) {
        match b {
            b'"' => {
                let end = match collect.as_deref_mut() {
                    None => string_end(body, i)?,
                    Some(c) => c.string(body, i)?,
                };
                let depth = stack.len();
                if depth == 1 && matches!(stack.last(), Some(Frame::Object)) {
                    if expect_key {
                        last_key_is_model = key_is_model(body.get(i + 1..end - 1).unwrap_or(&[]));
                        expect_key = false;
                    } else if last_key_is_model {
                        shape.model_span = Some(i..end);
                        last_key_is_model = false;
                    }
                }
                note_value(&mut stack);
                i = end;
                continue;
            }
            b'{' | b'[' => {
                if stack.len() == 1 {
                    last_key_is_model = false;
                }
                note_value(&mut stack);
                if stack.len() >= limits.max_depth {
                    return Err(RequestError::TooDeep {
                        max_depth: limits.max_depth,
                    });
                }
                if b == b'{' {
                    stack.push(Frame::Object);
                    if stack.len() == 1 {
                        expect_key = true;
                    }
                } else {
                    stack.push(Frame::Array {
                        len: 0,
                        empty: true,
                    });
                }
            }
            b'}' | b']' => {
                stack.pop();
            }
            b',' => {
                let depth = stack.len();
                match stack.last_mut() {
                    Some(Frame::Array { len, .. }) => {
                        *len += 1;
                        if *len > limits.max_array_len {
                            return Err(RequestError::ArrayTooLong {
                                max_len: limits.max_array_len,
                            });
                        }
                    }
                    Some(Frame::Object) if depth == 1 => {
                        expect_key = true;
                        last_key_is_model = false;
                    }
                    _ => {}
                }
            }
            b' ' | b'\t' | b'\n' | b'\r' | b':' => {}
            _ => {
                // A scalar (number, true, false, null): a non-string model value is not a span.
                if stack.len() == 1 && !expect_key {
                    last_key_is_model = false;
                }
                note_value(&mut stack);
                while let Some(&c) = body.get(i + 1) {
                    if matches!(
                        c,
                        b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r' | b'"' | b'{' | b'['
                    ) {
                        break;
                    }
                    i += 1;
                }
            }
        }
        i += 1;
    }
    Ok(shape)
}

/// Marks that a value starts inside the current array (the first element counts as 1).
fn note_value(stack: &mut [Frame]) {
    if let Some(Frame::Array { len, empty }) = stack.last_mut()
        && *empty
    {
        *empty = false;
        *len = 1;
    }
}

impl Collect<'_> {
    /// [`string_end`], unescaping the string on the way into `scratch`, and keeping it when it
    /// is a long value. The end found is `string_end`'s: an escape is skipped whole only when
    /// it decodes (its hex digits hold no `"` nor `\\`), else by two bytes as there.
    fn string(&mut self, body: &[u8], start: usize) -> Result<usize, RequestError> {
        self.scratch.clear();
        let mut decodes = true;
        let content = start + 1;
        let mut i = content;
        // A string with no quote in its first bytes is long: resume from a cached string
        // sharing its beginning (exact, see `LongStringCache`), and note resume points.
        let cache = self
            .cache
            .filter(|_| is_long_string(body, content, MIN_CACHED_STRING));
        let mut points: Vec<(u32, u32)> = Vec::new();
        let mut reused = 0;
        if let Some(cache) = cache {
            points.push((0, 0));
            if let Some(resume) = cache.resume(body.get(content..).unwrap_or_default()) {
                self.scratch.push_str(resume.text());
                i = content + resume.raw;
                reused = resume.raw;
                points.push((resume.raw as u32, self.scratch.len() as u32));
            }
        }
        let mut run = i;
        let end = loop {
            let rest = body.get(i..).ok_or(RequestError::Truncated)?;
            let pos = memchr::memchr2(b'"', b'\\', rest).ok_or(RequestError::Truncated)?;
            i += pos;
            // Runs end before an ASCII byte, so they are whole characters.
            match self.source.get(run..i) {
                Some(text) if decodes => {
                    if cache.is_some() {
                        self.note_points(&mut points, content, run, i);
                    }
                    self.scratch.push_str(text)
                }
                _ => decodes = false,
            }
            if body.get(i) == Some(&b'"') {
                break i + 1;
            }
            match decode_escape(body, i).filter(|_| decodes) {
                Some((c, len)) => {
                    self.scratch.push(c);
                    i += len;
                }
                None => {
                    decodes = false;
                    i += 2;
                }
            }
            run = i;
        };
        if let Some(cache) = cache
            && decodes
            && !is_key(body, end)
            // Worth keeping when little of it came from the cache (a string mostly reused
            // leaves the entry it came from as the better base for the next one).
            && reused * 10 < (end - content) * 9
            && let Some(raw) = body.get(content..end - 1)
            && !has_control(raw)
        {
            cache.insert(raw, &self.scratch, points);
        }
        if end - start >= self.min_len && !is_key(body, end) {
            let raw = body.get(start..end).unwrap_or(&[]);
            let text = (decodes && !has_control(raw)).then(|| std::mem::take(&mut self.scratch));
            self.found.push(LongString {
                span: start..end,
                text,
            });
        }
        Ok(end)
    }
}

impl Collect<'_> {
    /// Resume points inside the run `run..end` about to be copied verbatim (raw and text
    /// advance together there), every [`CHECKPOINT_EVERY`] raw bytes, at character boundaries.
    fn note_points(&self, points: &mut Vec<(u32, u32)>, content: usize, run: usize, end: usize) {
        let text_at_run = self.scratch.len();
        let mut next = points
            .last()
            .map_or(content, |(raw, _)| {
                content + *raw as usize + CHECKPOINT_EVERY
            })
            .max(run);
        while next < end {
            let mut at = next;
            while at < end && !self.source.is_char_boundary(at) {
                at += 1;
            }
            if at >= end {
                break;
            }
            let (Ok(raw), Ok(text)) = (
                u32::try_from(at - content),
                u32::try_from(text_at_run + (at - run)),
            ) else {
                break;
            };
            points.push((raw, text));
            next = at + CHECKPOINT_EVERY;
        }
    }
}

/// Whether the string whose content starts at `content` holds no closing quote in its first
/// `min` bytes (a quote preceded by an odd run of backslashes is escaped). Cheap for short
/// strings: it stops at their closing quote.
fn is_long_string(body: &[u8], content: usize, min: usize) -> bool {
    let Some(head) = body.get(content..content + min) else {
        return false;
    };
    memchr::memchr_iter(b'"', head).all(|q| {
        let backslashes = head
            .get(..q)
            .unwrap_or_default()
            .iter()
            .rev()
            .take_while(|b| **b == b'\\')
            .count();
        backslashes % 2 == 1
    })
}

/// Index one past the closing quote of the string starting at `start` (which holds `"`).
fn string_end(body: &[u8], start: usize) -> Result<usize, RequestError> {
    let mut i = start + 1;
    loop {
        let rest = body.get(i..).ok_or(RequestError::Truncated)?;
        // NOTE: memchr2 (SIMD) instead of a byte loop: prompt strings are most of a large body.
        let pos = memchr::memchr2(b'"', b'\\', rest).ok_or(RequestError::Truncated)?;
        i += pos;
        match body.get(i) {
            Some(b'"') => return Ok(i + 1),
            _ => i += 2, // skip the escaped character
        }
    }
}

/// Whether the string ending before `end` is an object key (a `:` follows it).
fn is_key(body: &[u8], end: usize) -> bool {
    body.get(end..)
        .unwrap_or(&[])
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        == Some(&b':')
}

/// Whether a raw (still escaped) key spells `model`.
fn key_is_model(raw: &[u8]) -> bool {
    if raw == b"model" {
        return true;
    }
    if !raw.contains(&b'\\') {
        return false;
    }
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted).is_ok_and(|k| k == "model")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scanner's unescaping of one string.
    fn unescape(raw: &str) -> Option<String> {
        let body = format!("\"{raw}\"");
        let mut found = Vec::new();
        scan_collecting(&body, ParseLimits::default(), 0, &mut found, None).ok()?;
        assert_eq!(found.len(), 1);
        found.pop()?.text
    }

    fn serde_string(raw: &str) -> Option<String> {
        serde_json::from_str::<String>(&format!("\"{raw}\"")).ok()
    }

    #[test]
    fn unescape_agrees_with_serde_json() {
        let cases = [
            "plain text",
            "",
            r#"a\"b\\c\/d\b\f\n\r\t"#,
            r"\u00e9\u00E9 caf\u00e9 \u4e2d\u6587",
            r"\ud83d\ude00 emoji",
            r"\u0000 nul",
            "naïve ü 한국어 👩‍👩‍👧 raw",
            r"long run of text with an escape at the end\n",
        ];
        for raw in cases {
            assert!(unescape(raw).is_some(), "{raw:?}");
            assert_eq!(unescape(raw), serde_string(raw), "{raw:?}");
        }
        // What the fast path leaves to serde_json (which rejects all of these).
        for raw in [
            r"\ud83d alone",
            r"\ude00 alone",
            r"\ud83d\u0041",
            r"\x41",
            r"\u12",
            r"\u12g4",
            "tab\there",
            "new\nline",
            r"trailing\",
        ] {
            assert_eq!(unescape(raw), None, "{raw:?}");
            assert_eq!(serde_string(raw), None, "{raw:?}");
        }
    }

    fn span(body: &str) -> Option<String> {
        scan(body.as_bytes(), ParseLimits::default())
            .unwrap()
            .model_span
            .map(|r| body[r].to_string())
    }

    #[test]
    fn finds_top_level_model_only() {
        assert_eq!(
            span(r#"{"a":{"model":"x"},"model":"m"}"#).as_deref(),
            Some("\"m\"")
        );
        assert_eq!(span(r#"{"model" : "a\"b" }"#).as_deref(), Some(r#""a\"b""#));
        assert_eq!(span(r#"{"x":["model","y"],"z":1}"#), None);
        assert_eq!(span(r#"{"model":3}"#), None);
        assert_eq!(span(r#"{"mod\u0065l":"q"}"#).as_deref(), Some("\"q\""));
        assert_eq!(
            span(r#"{"model":"a","model":"b"}"#).as_deref(),
            Some("\"b\"")
        );
        assert_eq!(span(r#"{"k":"model","v":"no"}"#), None);
    }

    #[test]
    fn bounds_depth_and_arrays() {
        let limits = ParseLimits {
            max_depth: 4,
            max_array_len: 3,
        };
        assert!(scan(br#"{"a":[[[1]]]}"#, limits).is_ok());
        assert_eq!(
            scan(br#"{"a":[[[[1]]]]}"#, limits),
            Err(RequestError::TooDeep { max_depth: 4 })
        );
        assert!(scan(br#"{"a":[1,2,3]}"#, limits).is_ok());
        assert_eq!(
            scan(br#"{"a":[1,2,3,4]}"#, limits),
            Err(RequestError::ArrayTooLong { max_len: 3 })
        );
        assert_eq!(scan(br#"{"a":"abc"#, limits), Err(RequestError::Truncated));
    }
}
