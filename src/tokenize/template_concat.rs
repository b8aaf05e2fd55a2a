//! Output expressions that concatenate strings, written without building the string first.
//!
//! Chat templates print each message as one expression: `{{ '<|im_start|>' + role + '\n' +
//! content + '<|im_end|>\n' }}`. minijinja evaluates `+` left to right, and each `+` of two
//! strings allocates their concatenation and copies it into a new value (two copies), so a
//! long message's text was copied twice per `+` after it before it was written out (a quarter
//! of a 200 KB system prompt's render; docs/benchmarks.md, session 25).
//!
//! [`lazy_concat_source`] rewrites each output tag whose expression is a chain of `+` (and
//! nothing looser at its top level) into a call of [`CONCAT_FUNCTION`] with the chain's
//! operands; [`lazy_concat`] returns a value that writes its operands one after the other
//! when printed, with no copy. It accepts only strings: for anything else (numbers, lists,
//! none, undefined) it fails, and so does any other error of the rewritten template, and the
//! caller then renders the original template instead ([`super::template`]). That makes the
//! rewrite exact: a render of the rewritten template that succeeds evaluated the same
//! operands in the same order, all of them strings, whose `+` chain is their concatenation.
//!
//! NOTE: the rewrite reads Jinja syntax only as far as it needs to: tags, comments, string
//! literals and brackets. It gives up on a whole template (no rewrite) with a `raw` block or
//! a name of its own already in use, and leaves an output tag alone when its top level holds
//! anything but `+`, filters, calls, attribute access and operands (`-`, `~`, `*`,
//! comparisons, `and`/`or`/`not`, `if … else`, `in`, `is`, tuples).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use minijinja::value::{Object, ObjectRepr, Rest, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The global function a rewritten output tag calls.
pub(super) const CONCAT_FUNCTION: &str = "__kvpick_concat__";

/// Operands that print one after the other (only ever printed: see the module docs).
#[derive(Debug)]
struct Concat(Vec<Value>);

impl Object for Concat {
    /// Plain: serialised (JSON autoescape) as the text it prints, as the string would be.
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Plain
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in &self.0 {
            f.write_str(part.as_str().unwrap_or_default())?;
        }
        Ok(())
    }
}

/// [`CONCAT_FUNCTION`]: its operands, printed in order, when all are strings; an error
/// otherwise (the caller falls back to the original template).
pub(super) fn lazy_concat(parts: Rest<Value>) -> Result<Value, Error> {
    // NOTE: the kind, not `as_str`, which also reads UTF-8 bytes (which `+` refuses).
    if parts.iter().all(|p| p.kind() == ValueKind::String) {
        Ok(Value::from_object(Concat(parts.0)))
    } else {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            "not all operands of + are strings",
        ))
    }
}

/// How a template's rewrite has fared: a template whose `+` chains add numbers or lists in
/// every render would otherwise render twice each time.
#[derive(Debug, Default)]
pub(super) struct LazyConcatRecord {
    /// Renders the rewrite gave.
    hits: AtomicU64,
    /// Renders where the rewrite failed and the template as written succeeded.
    misses: AtomicU64,
}

impl LazyConcatRecord {
    /// Whether the rewrite is still worth trying first: always at first, and for good
    /// unless it missed more than once in 16 renders (plus 16).
    pub(super) fn worth_trying(&self) -> bool {
        self.misses.load(Ordering::Relaxed) <= self.hits.load(Ordering::Relaxed) / 16 + 16
    }

    /// The rewrite rendered.
    pub(super) fn hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
    }

    /// The rewrite failed where the template as written rendered.
    pub(super) fn miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// Renders the rewrite gave so far.
    #[cfg(test)]
    pub(super) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

/// `source` with every output tag that is a `+` chain written as a [`CONCAT_FUNCTION`] call;
/// `None` when nothing was rewritten or the template is one this does not rewrite.
pub(super) fn lazy_concat_source(source: &str) -> Option<String> {
    if source.contains(CONCAT_FUNCTION) {
        return None;
    }
    let bytes = source.as_bytes();
    let mut out = String::with_capacity(source.len() + 256);
    let mut copied = 0;
    let mut rewritten = false;
    let mut i = 0;
    while let Some(at) = find(bytes, i, b"{") {
        let next = bytes.get(at + 1).copied();
        match next {
            Some(b'#') => {
                i = find(bytes, at + 2, b"#}")? + 2;
            }
            Some(b'%') => {
                let end = tag_end(bytes, at + 2, b"%}")?;
                let word = source
                    .get(at + 2..end)?
                    .trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
                if word == "raw" || word.starts_with("raw ") {
                    return None;
                }
                i = end + 2;
            }
            Some(b'{') => {
                let end = tag_end(bytes, at + 2, b"}}")?;
                let inner = source.get(at + 2..end)?;
                // Whitespace control stays where it was.
                let open = usize::from(inner.starts_with(['-', '+']));
                let close = usize::from(inner.len() > open && inner.ends_with(['-', '+']));
                let expression = inner.get(open..inner.len() - close)?;
                if let Some(operands) = plus_chain(expression) {
                    out.push_str(source.get(copied..at + 2 + open)?);
                    out.push(' ');
                    out.push_str(CONCAT_FUNCTION);
                    out.push('(');
                    out.push_str(&operands.join(", "));
                    out.push_str(") ");
                    copied = end - close;
                    rewritten = true;
                }
                i = end + 2;
            }
            _ => i = at + 1,
        }
    }
    if !rewritten {
        return None;
    }
    out.push_str(source.get(copied..)?);
    Some(out)
}

fn find(bytes: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    bytes
        .get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// Where the tag that started before `from` ends: `close` outside string literals and
/// brackets, as minijinja's lexer ends it (`{{ {'a': {'b': 1}} }}` ends at the last `}}`).
fn tag_end(bytes: &[u8], from: usize, close: &[u8]) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = from;
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => {
                i = string_end(bytes, i, quote)?;
                continue;
            }
            _ if depth == 0 && bytes.get(i..i + close.len()) == Some(close) => return Some(i),
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    None
}

/// The index after the string literal that starts at `start` with `quote`.
fn string_end(bytes: &[u8], start: usize, quote: u8) -> Option<usize> {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b if b == quote => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// Words that make an expression's top level more than a `+` chain.
const LOOSER_WORDS: [&str; 7] = ["if", "else", "and", "or", "not", "in", "is"];

/// The operands of `expression` when its top level is a chain of two or more `+` operands
/// and nothing binds looser (module docs).
fn plus_chain(expression: &str) -> Option<Vec<&str>> {
    let bytes = expression.as_bytes();
    let mut depth = 0usize;
    let mut operands = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'\'' | b'"' => {
                i = string_end(bytes, i, b)?;
                continue;
            }
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.checked_sub(1)?,
            _ if depth > 0 => {}
            b'+' => {
                operands.push(expression.get(start..i)?.trim());
                start = i + 1;
            }
            b'-' | b'~' | b'*' | b'/' | b'%' | b'=' | b'!' | b'<' | b'>' | b',' | b':' => {
                return None;
            }
            _ if b.is_ascii_alphabetic() || b == b'_' => {
                let word_end = bytes
                    .get(i..)?
                    .iter()
                    .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
                    .map_or(bytes.len(), |p| p + i);
                // An attribute (`x.if`) is not a keyword; `1. if` is a float and a keyword.
                let attribute = i > 0 && bytes.get(i - 1) == Some(&b'.');
                if !attribute && LOOSER_WORDS.contains(&expression.get(i..word_end)?) {
                    return None;
                }
                i = word_end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    if depth != 0 || operands.is_empty() {
        return None;
    }
    operands.push(expression.get(start..)?.trim());
    // A `+` with nothing on one side is unary (or not Jinja): not a chain.
    if operands.iter().any(|o| o.is_empty()) {
        return None;
    }
    Some(operands)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_tags_that_are_plus_chains_become_one_call() {
        assert_eq!(
            lazy_concat_source("a{{- '<|im_start|>' + m.role + '\\n' + c | trim -}}b").as_deref(),
            Some("a{{- __kvpick_concat__('<|im_start|>', m.role, '\\n', c | trim) -}}b")
        );
        assert_eq!(
            lazy_concat_source("{{ f(x, y + z) + '}}' }}{{ x }}").as_deref(),
            Some("{{ __kvpick_concat__(f(x, y + z), '}}') }}{{ x }}"),
            "commas and + inside calls, and }} inside a string, stay in their operand"
        );
        assert_eq!(
            lazy_concat_source("{{ a.if + b }}").as_deref(),
            Some("{{ __kvpick_concat__(a.if, b) }}")
        );
    }

    #[test]
    fn anything_looser_than_plus_at_the_top_level_is_left_alone() {
        for tag in [
            "{{ a }}",
            "{{ a - b + c }}",
            "{{ a + b ~ c }}",
            "{{ a + b if x else c }}",
            "{{ a + b == c }}",
            "{{ not a + b }}",
            "{{ a + b and c }}",
            "{{ a + b in c }}",
            "{{ a + b is string }}",
            "{{ a * b + c }}",
            "{{ a, b + c }}",
            "{{ +a }}",
            "{{ a + }}",
            "{{ (a + b) }}",
            "{{ 'unterminated + }}",
            // `1.` is a float: `if`, `and` after it are keywords, not attributes.
            "{{ 'x' + 1. if 0. else 'y' }}",
            "{{ 'x' + 1. and 'y' }}",
        ] {
            assert_eq!(lazy_concat_source(tag), None, "{tag}");
        }
    }

    #[test]
    fn statements_comments_and_raw_blocks() {
        // Statements are not output: `set x = a + b` keeps its `+`.
        assert_eq!(lazy_concat_source("{% set x = a + b %}{{ x }}"), None);
        // A tag-looking string inside a statement or comment is not a tag.
        assert_eq!(
            lazy_concat_source("{% set s = '{{ a + b }}' %}{# {{ a + b }} #}{{ s }}"),
            None
        );
        // `raw` blocks print tags as text: such templates are not rewritten at all.
        assert_eq!(
            lazy_concat_source("{% raw %}{{ a + b }}{% endraw %}{{ c + d }}"),
            None
        );
        // A `}}` that closes a dict literal does not end the tag (minijinja's lexer counts
        // brackets), so a tag-looking string later in it stays text.
        assert_eq!(
            lazy_concat_source("{{ {'a': {'b': 'c'}}['a']['b'] ~ '{{ x + y }}' }}"),
            None
        );
        assert_eq!(
            lazy_concat_source("{{ {'a': {'b': c}}['a']['b'] + '{{ x + y }}' }}").as_deref(),
            Some("{{ __kvpick_concat__({'a': {'b': c}}['a']['b'], '{{ x + y }}') }}")
        );
        // A template that already uses the function's name is not rewritten.
        assert_eq!(
            lazy_concat_source("{{ __kvpick_concat__ }}{{ a + b }}"),
            None
        );
    }

    #[test]
    fn a_rewrite_that_keeps_missing_is_no_longer_tried() {
        let record = LazyConcatRecord::default();
        for _ in 0..16 {
            record.miss();
        }
        assert!(record.worth_trying(), "16 misses are allowed");
        record.miss();
        assert!(!record.worth_trying());
        // Occasional misses among many hits (a request whose operands are not strings).
        let record = LazyConcatRecord::default();
        for i in 0..10_000 {
            if i % 50 == 0 {
                record.miss();
            } else {
                record.hit();
            }
            assert!(record.worth_trying(), "{i}");
        }
    }

    #[test]
    fn only_strings_are_concatenated() {
        let value = lazy_concat(Rest(vec![Value::from("a"), Value::from("b")])).expect("strings");
        assert_eq!(value.to_string(), "ab");
        assert!(lazy_concat(Rest(vec![Value::from("a"), Value::from(1)])).is_err());
        assert!(lazy_concat(Rest(vec![Value::from("a"), Value::from(())])).is_err());
        assert!(lazy_concat(Rest(vec![Value::UNDEFINED, Value::from("b")])).is_err());
        let bytes = Value::from_bytes(b"b".to_vec());
        assert!(lazy_concat(Rest(vec![Value::from("a"), bytes])).is_err());
    }
}
