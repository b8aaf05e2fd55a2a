//! The fast encoder's pre-tokenizer for text beyond ASCII: Latin-1, Latin Extended and
//! Vietnamese letters, Greek, Cyrillic, Hebrew, Arabic and Thai letters, punctuation, currency,
//! arrows, math operators, box drawing and dingbats, CJK ideographs, kana, Hangul syllables,
//! full-width forms, emoji with their variation selectors and joiner: the characters most
//! non-English prompts are made of.
//!
//! It runs the same leftmost-first alternation of [`super::QWEN2_PATTERN`] as the ASCII scanner,
//! over a character class per character. It may only be used on a run whose every character
//! is in the table below ([`class_of`] is `Some`), because for those characters:
//! - the class is the character's Unicode general category as the regex sees it (`\p{L}`,
//!   `\p{N}`, `\s`, or none of them; unassigned code points are none of them too);
//! - NFC is the identity: each has NFC_Quick_Check = Yes and canonical combining class 0, so
//!   a run of them is already NFC and nothing composes inside it (combining marks and
//!   singletons such as U+037E are left out; so is `ſ`, which case-folds to `s`, although this
//!   engine's `(?i:'s)` does not match it). The exception is Thai's reorderable marks
//!   (`REORDERABLE`), handled only where they are not next to one another.
//!
//! NOTE: `fast_bpe`'s ASCII scanner is the same logic over bytes. It stays separate because
//! this one, run on ASCII text, made the 400 KB English cold path 1.6× slower (4.0 → 6.5 ms,
//! `TOKENIZE_PROFILE_COLD=200`, A/B in one session). Both are tested against the crate.
//!
//! Everything else goes to the tokenizers crate. `tests/tok_fast_bpe.rs` checks every character
//! of the table, in 22 contexts each, against the crate.

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

use CharClass::{Letter as L, Number as N, Other as O, OtherSpace as W};

/// Non-ASCII characters the scanner handles: inclusive code point ranges, sorted, disjoint.
const RANGES: &[(u32, u32, CharClass)] = &[
    (0x00A0, 0x00A0, W),
    (0x00A1, 0x00A9, O),
    (0x00AA, 0x00AA, L),
    (0x00AB, 0x00B1, O),
    (0x00B2, 0x00B3, N),
    (0x00B4, 0x00B4, O),
    (0x00B5, 0x00B5, L),
    (0x00B6, 0x00B8, O),
    (0x00B9, 0x00B9, N),
    (0x00BA, 0x00BA, L),
    (0x00BB, 0x00BB, O),
    (0x00BC, 0x00BE, N),
    (0x00BF, 0x00BF, O),
    (0x00C0, 0x00D6, L),
    (0x00D7, 0x00D7, O),
    (0x00D8, 0x00F6, L),
    (0x00F7, 0x00F7, O),
    (0x00F8, 0x017E, L),
    (0x0180, 0x024F, L),
    (0x0386, 0x0386, L),
    (0x0388, 0x038A, L),
    (0x038C, 0x038C, L),
    (0x038E, 0x03A1, L),
    (0x03A3, 0x03CE, L),
    (0x0400, 0x0481, L),
    (0x048A, 0x04FF, L),
    (0x05D0, 0x05EA, L),
    (0x05F0, 0x05F2, L),
    (0x05F3, 0x05F4, O),
    (0x060C, 0x060C, O),
    (0x061B, 0x061B, O),
    (0x061F, 0x061F, O),
    (0x0621, 0x063A, L),
    (0x0640, 0x064A, L),
    (0x0660, 0x0669, N),
    (0x066A, 0x066D, O),
    (0x066E, 0x066F, L),
    (0x0671, 0x06D3, L),
    (0x06D4, 0x06D4, O),
    (0x06D5, 0x06D5, L),
    // Thai. Its vowel and tone marks are `Mn` (neither `\p{L}` nor `\p{N}`: Other). Those of
    // canonical combining class 0 are inert under NFC like the rest of the table; the
    // reorderable ones (U+0E38–U+0E3A, U+0E48–U+0E4B) are in it too, but [`handles`] takes
    // them only where no such mark is next to them (see `REORDERABLE`).
    (0x0E01, 0x0E30, L),
    (0x0E31, 0x0E31, O),
    (0x0E32, 0x0E33, L),
    (0x0E34, 0x0E3A, O),
    (0x0E3F, 0x0E3F, O),
    (0x0E40, 0x0E46, L),
    (0x0E47, 0x0E4F, O),
    (0x0E50, 0x0E59, N),
    (0x0E5A, 0x0E5B, O),
    (0x1E00, 0x1EFF, L),
    (0x200D, 0x200D, O),
    (0x2010, 0x2027, O),
    (0x2030, 0x205E, O),
    (0x20A0, 0x20BF, O),
    (0x2190, 0x22FF, O),
    (0x2500, 0x2775, O),
    (0x2776, 0x2793, N),
    (0x2794, 0x27BF, O),
    (0x2B00, 0x2BFF, O),
    (0x3000, 0x3000, W),
    (0x3001, 0x3004, O),
    (0x3005, 0x3006, L),
    (0x3007, 0x3007, N),
    (0x3008, 0x3020, O),
    (0x3021, 0x3029, N),
    (0x3030, 0x3030, O),
    (0x3031, 0x3035, L),
    (0x3036, 0x3037, O),
    (0x3038, 0x303A, N),
    (0x303B, 0x303C, L),
    (0x303D, 0x303F, O),
    (0x3041, 0x3096, L),
    (0x309B, 0x309C, O),
    (0x309D, 0x309F, L),
    (0x30A0, 0x30A0, O),
    (0x30A1, 0x30FA, L),
    (0x30FB, 0x30FB, O),
    (0x30FC, 0x30FF, L),
    (0x3400, 0x4DBF, L),
    (0x4E00, 0x9FFF, L),
    (0xAC00, 0xD7A3, L),
    (0xFE00, 0xFE0F, O),
    (0xFF01, 0xFF0F, O),
    (0xFF10, 0xFF19, N),
    (0xFF1A, 0xFF20, O),
    (0xFF21, 0xFF3A, L),
    (0xFF3B, 0xFF40, O),
    (0xFF41, 0xFF5A, L),
    (0xFF5B, 0xFF65, O),
    (0xFF66, 0xFF9F, L),
    // The replacement character (`So`), which a decoded token that ends inside a UTF-8
    // sequence leaves in the text.
    (0xFFFD, 0xFFFD, O),
    (0x1F1E6, 0x1F1FF, O),
    (0x1F300, 0x1F5FF, O),
    (0x1F600, 0x1F64F, O),
    (0x1F680, 0x1F6FF, O),
    (0x1F900, 0x1F9FF, O),
    (0x1FA70, 0x1FAFF, O),
];

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

/// Characters of the table with a non-zero canonical combining class (Thai's below-vowels,
/// phinthu and tone marks: 103, 103, 9, 107 × 4). NFC's canonical ordering swaps two adjacent
/// marks of non-zero classes that are out of order, so such a mark is inert only where its
/// neighbours are of class 0, which every other character of the table is. None of them
/// composes with anything (Thai has no precomposed characters).
const REORDERABLE: [(u32, u32); 2] = [(0x0E38, 0x0E3A), (0x0E48, 0x0E4B)];

fn is_reorderable(c: char) -> bool {
    let cp = u32::from(c);
    REORDERABLE
        .iter()
        .any(|&(start, end)| (start..=end).contains(&cp))
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
