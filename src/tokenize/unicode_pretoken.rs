//! The fast encoder's pre-tokenizer for text beyond ASCII: the scripts, symbols and emoji of
//! [`table`], which holds every NFC-inert character of the blocks the shipped
//! tokenizer's vocabulary uses (Latin, Greek, Cyrillic, Hebrew, Arabic, Devanagari, Bengali,
//! Thai, Ethiopic, CJK, kana, Hangul, …).
//!
//! It runs the same leftmost-first alternation of [`super::QWEN2_PATTERN`] as the ASCII scanner,
//! over a character class per character. It may only be used on a run whose every character
//! is in the table ([`class_of`] is `Some`), because for those characters:
//! - the class is the character's Unicode general category as the regex sees it (`\p{L}`,
//!   `\p{N}`, `\s`, or none of them; unassigned code points are none of them too);
//! - NFC is the identity: each has NFC_Quick_Check = Yes and canonical combining class 0, and
//!   none ends a primary composite, so a run of them is already NFC and nothing composes
//!   inside it (marks that compose, such as Devanagari's nukta or Bengali's au length mark, and
//!   singletons such as U+037E are left out; so is `ſ`, which case-folds to `s`, although this
//!   engine's `(?i:'s)` does not match it). The exception is the reorderable marks (Thai's,
//!   Devanagari's virama, Arabic's harakat, …: `REORDERABLE`, none of which composes with
//!   anything), handled only where they are not next to one another.
//!
//! NOTE: `fast_bpe`'s ASCII scanner is the same logic over bytes. It stays separate because
//! this one, run on ASCII text, made the 400 KB English cold path 1.6× slower (4.0 → 6.5 ms,
//! `TOKENIZE_PROFILE_COLD=200`, A/B in one session). Both are tested against the crate.
//!
//! Everything else goes to the tokenizers crate. `tests/it/tok_fast_bpe.rs` checks every
//! character of the table, in 22 contexts each, against the crate.

/// What the split pattern sees of one character.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CharClass {
    /// `\p{L}`.
    Letter,
    /// `\p{N}`.
    Number,
    /// `\r` or `\n`.
    Newline,
    /// U+0020, the pattern's literal space.
    Space,
    /// Any other `\s`.
    OtherSpace,
    /// Neither `\s`, `\p{L}` nor `\p{N}`.
    Other,
}

mod table;

use table::{RANGES, REORDERABLE};

/// The class of `c` if the scanner handles it.
pub fn class_of(c: char) -> Option<CharClass> {
    if c.is_ascii() {
        return Some(match c {
            'A'..='Z' | 'a'..='z' => CharClass::Letter,
            '0'..='9' => CharClass::Number,
            '\r' | '\n' => CharClass::Newline,
            ' ' => CharClass::Space,
            '\t' | '\u{0B}' | '\u{0C}' => CharClass::OtherSpace,
            _ => CharClass::Other,
        });
    }
    let cp = u32::from(c);
    let idx = RANGES.partition_point(|&(_, end, _)| end < cp);
    match RANGES.get(idx) {
        Some(&(start, _, class)) if start <= cp => Some(class),
        _ => None,
    }
}

/// Whether `c` is one of the table's marks of non-zero canonical combining class.
fn is_reorderable(c: char) -> bool {
    let cp = u32::from(c);
    let idx = REORDERABLE.partition_point(|&(_, end)| end < cp);
    REORDERABLE.get(idx).is_some_and(|&(start, _)| start <= cp)
}

/// True when the scanner handles every character of `text`: each is in the table, and no
/// two reorderable marks are adjacent. (`text` is a piece between split points, which are
/// spaces or tabs, or a whole segment between added tokens, so what is next to it is of
/// class 0 too.)
pub fn handles(text: &str) -> bool {
    let mut after_mark = false;
    text.chars().all(|c| {
        let mark = is_reorderable(c);
        let ok = class_of(c).is_some() && !(mark && after_mark);
        after_mark = mark;
        ok
    })
}

/// Every non-ASCII character the scanner handles (for tests against the crate).
pub fn handled_chars() -> impl Iterator<Item = char> {
    RANGES
        .iter()
        .flat_map(|&(start, end, _)| (start..=end).filter_map(char::from_u32))
}

/// The character at byte `k` of `text` and its class. An unhandled character reads as
/// [`CharClass::Other`]: callers only scan text that [`handles`] accepted.
fn at(text: &str, k: usize) -> Option<(char, CharClass)> {
    let c = text.get(k..)?.chars().next()?;
    Some((c, class_of(c).unwrap_or(CharClass::Other)))
}

fn class(text: &str, k: usize) -> Option<CharClass> {
    at(text, k).map(|(_, class)| class)
}

/// Byte offset of the character after the one at `k`.
fn next(text: &str, k: usize) -> usize {
    k + at(text, k).map_or(1, |(c, _)| c.len_utf8())
}

fn run_end(text: &str, mut k: usize, wanted: impl Fn(CharClass) -> bool) -> usize {
    while class(text, k).is_some_and(&wanted) {
        k = next(text, k);
    }
    k
}

fn is_space(c: CharClass) -> bool {
    matches!(
        c,
        CharClass::Newline | CharClass::Space | CharClass::OtherSpace
    )
}

/// End (a byte offset) of the pre-token starting at byte `i` of `text`, following the
/// alternatives of the pattern in order (the ASCII scanner's logic over classes). Streams over
/// the text: nothing is allocated per character, so memory stays flat however long the run.
/// Every character of `text` must be handled ([`handles`]).
pub fn pretoken_end(text: &str, i: usize) -> usize {
    let Some((first, c)) = at(text, i) else {
        return i;
    };
    let i1 = next(text, i);
    // 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if first == '\'' {
        let lower = |k: usize| at(text, k).map(|(c, _)| c.to_ascii_lowercase());
        let i2 = next(text, i1);
        match (lower(i1), lower(i2)) {
            (Some('s' | 't' | 'm' | 'd'), _) => return i2,
            (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => {
                return next(text, i2);
            }
            _ => {}
        }
    }
    // 2. [^\r\n\p{L}\p{N}]?\p{L}+
    let letter = |c: CharClass| c == CharClass::Letter;
    if !matches!(
        c,
        CharClass::Newline | CharClass::Letter | CharClass::Number
    ) && class(text, i1) == Some(CharClass::Letter)
    {
        return run_end(text, i1, letter);
    }
    if c == CharClass::Letter {
        return run_end(text, i, letter);
    }
    // 3. \p{N}
    if c == CharClass::Number {
        return i1;
    }
    // 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    let punct_start = if c == CharClass::Space && class(text, i1) == Some(CharClass::Other) {
        Some(i1)
    } else if c == CharClass::Other {
        Some(i)
    } else {
        None
    };
    if let Some(p) = punct_start {
        let e = run_end(text, p, |c| c == CharClass::Other);
        return run_end(text, e, |c| c == CharClass::Newline);
    }
    // Only whitespace remains: walk it, remembering its last newline and last character.
    let (mut k, mut last_newline, mut last_start) = (i, None, i);
    while let Some(c) = class(text, k).filter(|&c| is_space(c)) {
        if c == CharClass::Newline {
            last_newline = Some(k);
        }
        last_start = k;
        k = next(text, k);
    }
    // 5. \s*[\r\n]+ : up to and including the last newline of the whitespace run.
    if let Some(newline) = last_newline {
        return next(text, newline);
    }
    // 6. \s+(?!\S) : all of it at the end of the text, else all but its last character.
    if k == text.len() {
        return k;
    }
    if last_start > i {
        return last_start;
    }
    // 7. \s+
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_sorted_disjoint_and_non_ascii() {
        let mut last = 0x7F;
        for &(start, end, _) in RANGES {
            assert!(start > last && end >= start, "{start:#x}..={end:#x}");
            last = end;
        }
    }

    #[test]
    fn reorderable_marks_are_handled_only_apart() {
        // ก + mai ek (107): fine; + sara u (103) after it: NFC would swap the two.
        assert!(handles("ก\u{0E48}"));
        // Two adjacent, even in canonical order, go to the crate; apart, they are handled.
        assert!(!handles("ก\u{0E39}\u{0E48}"));
        assert!(handles("ก\u{0E39}า\u{0E48}"));
        assert!(!handles("ก\u{0E48}\u{0E38}"));
        assert!(!handles("\u{0E38}\u{0E48}"));
        assert!(handles("ที่สุด ข้าว \u{FFFD}"));
        assert_eq!(class_of('\u{0E48}'), Some(CharClass::Other));
        assert_eq!(class_of('ก'), Some(CharClass::Letter));
        assert_eq!(class_of('๕'), Some(CharClass::Number));
    }

    #[test]
    fn classes_and_pretokens_of_mixed_text() {
        assert_eq!(class_of('中'), Some(CharClass::Letter));
        assert_eq!(class_of('３'), Some(CharClass::Number));
        assert_eq!(class_of('\u{3000}'), Some(CharClass::OtherSpace));
        assert_eq!(class_of('\u{301}'), None);
        assert_eq!(class_of('ſ'), None);
        let text = "我们 有3个。\n\n  é's";
        assert!(handles(text));
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let end = pretoken_end(text, i).max(i + 1);
            pieces.push(&text[i..end]);
            i = end;
        }
        assert_eq!(
            pieces,
            ["我们", " 有", "3", "个", "。\n\n", " ", " é", "'s"]
        );
    }
}
