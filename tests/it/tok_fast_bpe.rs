//! The fast byte-level BPE path is exactly the tokenizers crate: same ids and the same
//! pre-token (word) boundaries, on the shared test vectors, the 400 KB corpus, and random text
//! biased towards the regex's corner cases (contractions, whitespace runs before letters,
//! symbols and newlines, CR/LF mixes, digits, control characters, special tokens).

use crate::support::paths;

use std::path::PathBuf;
use std::sync::LazyLock;

use kvpick::tokenize::{FastEncoder, MergeTable, ModelTokenizer, WordEncoder, unicode_pretoken};
use proptest::prelude::*;

static MODEL: LazyLock<ModelTokenizer> = LazyLock::new(|| {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer");
    ModelTokenizer::load(&dir, 0, None).expect("load assets/tokenizer")
});

fn fixtures() -> PathBuf {
    paths::fixtures().join("tokenizer")
}

fn assert_same(text: &str) {
    let slow = WordEncoder::new(MODEL.tokenizer(), None)
        .encode(text)
        .unwrap();
    let fast = MODEL.word_encoder().encode(text).unwrap();
    assert_eq!(fast.0, slow.0, "ids differ for {text:?}");
    assert_eq!(fast.1, slow.1, "word starts differ for {text:?}");
}

#[test]
fn fast_path_is_active_for_the_shared_tokenizer() {
    assert!(MODEL.has_fast_path());
}

/// A loaded model leaves its first misses to the crate and merges them itself once the
/// crate has merged `LAZY_AFTER_MISSES` (the table is built on a thread of its own).
#[test]
fn a_loaded_model_builds_its_merge_table_once_misses_add_up() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer");
    let model = ModelTokenizer::load(&dir, 0, None).expect("load");
    assert!(model.has_fast_path());
    assert!(!model.has_merge_table(), "built at load");
    let mut seed = 1;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !model.has_merge_table() {
        assert!(
            std::time::Instant::now() < deadline,
            "no merge table after 60 s of misses"
        );
        let text = random_token_text(seed, 2_000);
        assert_eq!(
            model.word_encoder().encode(&text).unwrap(),
            crate_encode(&text)
        );
        seed += 1;
    }
    // Misses after the build, merged by the table: still the crate's ids.
    let text = random_token_text(seed, 5_000);
    assert_eq!(
        model.word_encoder().encode(&text).unwrap(),
        crate_encode(&text)
    );
}

/// The fast encoder merging every pre-token itself: the shared tokenizer's own merge table,
/// no word cache (so nothing is answered from an earlier merge).
static MERGING: LazyLock<FastEncoder> = LazyLock::new(|| {
    let fast = FastEncoder::new(MODEL.tokenizer())
        .unwrap()
        .with_word_cache_capacity(0);
    let json = std::fs::read(MODEL.dir().join("tokenizer.json")).unwrap();
    let table = MergeTable::from_tokenizer_json(&json, fast.byte_chars()).unwrap();
    assert_eq!(table.len(), 294_166);
    fast.with_merge_table(table)
});

/// Random-token text (`support/random_text.rs`) with the shared tokenizer.
fn random_token_text(seed: u64, tokens: usize) -> String {
    crate::random_text::random_token_text(MODEL.tokenizer(), seed, tokens)
}

/// kvpick's own merges equal the crate's BPE on every pre-token: the fixtures, the corpus and
/// 30,000 random tokens' text, with no cache in between.
#[test]
fn the_merge_table_merges_every_word_like_the_crate() {
    let mut texts: Vec<String> = std::fs::read_to_string(fixtures().join("test_vectors.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let rec: serde_json::Value = serde_json::from_str(line).unwrap();
            rec["text"].as_str().unwrap().to_owned()
        })
        .collect();
    texts.push(std::fs::read_to_string(fixtures().join("corpus.txt")).unwrap());
    texts.extend((0..3).map(|seed| random_token_text(seed, 10_000)));
    for text in &texts {
        let got = MERGING.encode(MODEL.tokenizer(), text).unwrap();
        let want = crate_encode(text);
        assert_eq!(got.0.len(), want.0.len(), "token count of {:.60}", text);
        assert_eq!(got, want, "ids of {:.60}", text);
    }
    // Long pre-tokens are left to the crate, and still equal.
    let long = format!(
        "{} {}",
        "x".repeat(kvpick::tokenize::MAX_MERGE_BYTES + 7),
        "é".repeat(90)
    );
    assert_eq!(
        MERGING.encode(MODEL.tokenizer(), &long).unwrap(),
        crate_encode(&long)
    );
}

/// The crate alone: the word encoder without the fast path.
fn crate_encode(text: &str) -> kvpick::tokenize::WordEncoding {
    WordEncoder::new(MODEL.tokenizer(), None)
        .encode(text)
        .unwrap()
}

/// The word encoder (word cache) and the merge-table encoder both give `text` the crate's ids
/// and word starts.
fn both_encoders_match_the_crate(text: &str) -> Result<(), TestCaseError> {
    let slow = crate_encode(text);
    prop_assert_eq!(&MODEL.word_encoder().encode(text).unwrap(), &slow);
    prop_assert_eq!(MERGING.encode(MODEL.tokenizer(), text).unwrap(), slow);
    Ok(())
}

/// The word cache memoises, hits and evicts without changing a single id: the corpus twice
/// through a cache far too small for it (shards clear all the time), through no cache, and
/// through the default one (which then holds its words).
#[test]
fn the_word_cache_never_changes_ids() {
    let corpus = std::fs::read_to_string(fixtures().join("corpus.txt")).unwrap();
    let expected = crate_encode(&corpus);
    let tiny = FastEncoder::new(MODEL.tokenizer())
        .unwrap()
        .with_word_cache_capacity(64);
    let none = FastEncoder::new(MODEL.tokenizer())
        .unwrap()
        .with_word_cache_capacity(0);
    let default = FastEncoder::new(MODEL.tokenizer()).unwrap();
    for round in 0..2 {
        for (name, enc) in [("tiny", &tiny), ("none", &none), ("default", &default)] {
            let got = enc.encode(MODEL.tokenizer(), &corpus).unwrap();
            assert_eq!(got, expected, "{name} cache, round {round}");
        }
    }
    assert_eq!(none.cached_words(), 0);
    assert!(tiny.cached_words() <= 64, "{}", tiny.cached_words());
    assert!(default.cached_words() > 1000, "{}", default.cached_words());
}

#[test]
fn test_vectors_and_corpus_match_the_crate() {
    for line in std::fs::read_to_string(fixtures().join("test_vectors.jsonl"))
        .unwrap()
        .lines()
    {
        let rec: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_same(rec["text"].as_str().unwrap());
    }
    let corpus = std::fs::read_to_string(fixtures().join("corpus.txt")).unwrap();
    assert_same(&corpus);
}

const ASCII_PIECES: &[&str] = &[
    "a",
    "Zq",
    "hello",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\n\n",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x7f",
    "\0",
    "'",
    "'s",
    "'S",
    "'t",
    "'re",
    "'VE",
    "'m",
    "'ll",
    "'Ll",
    "'d",
    "'x",
    "0",
    "42",
    ".",
    "!",
    "?!",
    "...",
    "(",
    "_",
    "-",
    "=",
    "\"",
    "{",
    "}",
    "#",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "<|",
    "|>",
];

const UNICODE_PIECES: &[&str] = &[
    "한국어",
    " 텍스트",
    "é",
    "e\u{301}",
    "\u{301}",
    " \u{301}",
    "\t\u{301}",
    "\u{3000}",
    "\u{a0}",
    "\u{85}",
    "\u{180e}",
    "\u{200b}",
    "\u{2028}",
    "ﬁ",
    "Å",
    "A\u{30a}",
    "👩\u{200d}👩\u{200d}👧",
    "🇰🇷",
    "٣",
    "Ⅻ",
    "ǅ",
    "'ſ",
    "'K",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_ascii_matches_the_crate(pieces in prop::collection::vec(prop::sample::select(ASCII_PIECES), 0..80)) {
        let text = pieces.concat();
        let slow = WordEncoder::new(MODEL.tokenizer(), None).encode(&text).unwrap();
        let fast = MODEL.word_encoder().encode(&text).unwrap();
        prop_assert_eq!(fast, slow);
    }

    #[test]
    fn random_mixed_text_matches_the_crate(
        pieces in prop::collection::vec(
            prop_oneof![
                prop::sample::select(ASCII_PIECES).prop_map(str::to_owned),
                prop::sample::select(UNICODE_PIECES).prop_map(str::to_owned),
                any::<char>().prop_map(String::from)
            ],
            0..60)
    ) {
        let text = pieces.concat();
        let slow = WordEncoder::new(MODEL.tokenizer(), None).encode(&text).unwrap();
        let fast = MODEL.word_encoder().encode(&text).unwrap();
        prop_assert_eq!(&fast, &slow);
        prop_assert_eq!(MERGING.encode(MODEL.tokenizer(), &text).unwrap(), slow);
    }
}

/// The shared tokenizer with extra added tokens whose first bytes are `[`, `{`, `#`, `@` and
/// `<` (more than memchr3 covers), overlapping each other and the built-in ones.
static MANY_ADDED: LazyLock<tokenizers::Tokenizer> = LazyLock::new(|| {
    let mut tok = MODEL.tokenizer().clone();
    let extra = ["[A]", "[A]]", "{B}", "#C", "@@", "@@@", "<|x|>", "<|im"];
    let added: Vec<_> = extra
        .iter()
        .map(|t| tokenizers::AddedToken::from(*t, true))
        .collect();
    tok.add_special_tokens(&added);
    tok
});

const ADDED_PIECES: &[&str] = &[
    "[A]",
    "[A]]",
    "[A",
    "{B}",
    "{B",
    "#C",
    "#",
    "@",
    "@@",
    "@@@@",
    "<|x|>",
    "<|im",
    "<|im_end|>",
    "<|",
    "<",
    " ",
    "text",
    "\n",
    "é",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Leftmost-longest added-token matching equals the crate's for any set of first bytes.
    #[test]
    fn added_tokens_with_many_first_bytes_match_the_crate(
        pieces in prop::collection::vec(prop::sample::select(ADDED_PIECES), 0..40)
    ) {
        let text = pieces.concat();
        let fast = FastEncoder::new(&MANY_ADDED).expect("fast layout");
        let (ids, _) = fast.encode(&MANY_ADDED, &text).unwrap();
        let slow = MANY_ADDED.encode(text.as_str(), false).unwrap();
        prop_assert_eq!(ids, slow.get_ids().to_vec());
    }
}

/// Every non-ASCII character the fast scanner handles, in contexts that reach each alternative
/// of the split pattern (letter runs, digits, symbol runs, contractions, whitespace before and
/// after, newlines, CJK and Latin neighbours), equals the crate: ids and word starts. A wrong
/// class, a character NFC would change, or one the pattern's case folding treats specially
/// fails here.
#[test]
fn every_handled_character_matches_the_crate_in_context() {
    let chars: Vec<char> = unicode_pretoken::handled_chars().collect();
    assert!(chars.len() > 40_000, "{}", chars.len());
    let contexts = [
        "{c}",
        "a{c}",
        "{c}a",
        " {c}",
        "{c} ",
        "1{c}",
        "{c}1",
        "'{c}",
        "{c}'s",
        "{c}{c}",
        ".{c}",
        "{c}.",
        "\n{c}",
        "{c}\n",
        "中{c}",
        "{c}中",
        "  {c}",
        "{c}  x",
        "é{c}",
        "\u{3000}{c}",
    ];
    for chunk in chars.chunks(2048) {
        for ctx in contexts {
            let text: Vec<String> = chunk
                .iter()
                .map(|c| ctx.replace("{c}", &c.to_string()))
                .collect();
            assert_same(&text.join("|"));
        }
        // Neighbours of every kind: the characters back to back, and space-separated.
        let run: String = chunk.iter().collect();
        assert_same(&run);
        let spaced: Vec<String> = chunk.iter().map(char::to_string).collect();
        assert_same(&spaced.join(" "));
    }
}

/// Handled characters, ASCII and unhandled ones (combining marks, `ſ`) mixed: the fast runs
/// and the crate's runs meet at the right places.
fn handled_piece() -> impl Strategy<Value = String> {
    let handled: Vec<char> = unicode_pretoken::handled_chars().collect();
    prop_oneof![
        prop::sample::select(handled).prop_map(String::from),
        prop::sample::select(ASCII_PIECES).prop_map(str::to_owned),
        prop::sample::select(
            &[
                "\u{301}", "\u{3099}", "ſ", "\u{37e}", "\u{fe0f}", "\u{200d}", "\u{2028}"
            ][..]
        )
        .prop_map(str::to_owned),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_handled_unicode_matches_the_crate(pieces in prop::collection::vec(handled_piece(), 0..60)) {
        let text = pieces.concat();
        both_encoders_match_the_crate(&text)?;
    }
}

/// Thai (letters, digits, its marks of every combining class, the unassigned gaps), the
/// replacement character, a space and a Latin letter.
fn thai_char() -> impl Strategy<Value = char> {
    prop_oneof![
        8 => (0x0E01u32..=0x0E5B).prop_map(|cp| char::from_u32(cp).unwrap_or('?')),
        3 => prop::sample::select(&['\u{0E38}', '\u{0E39}', '\u{0E3A}', '\u{0E48}', '\u{0E49}', '\u{0E4B}'][..]),
        1 => prop::sample::select(&[' ', 'a', '\u{FFFD}', '\n'][..]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Thai's reorderable marks next to each other in any order (which NFC reorders) go to
    /// the crate; apart, the scanner takes them: either way, the crate's ids and words.
    #[test]
    fn random_thai_with_its_marks_in_any_order_matches_the_crate(chars in prop::collection::vec(thai_char(), 0..80)) {
        let text: String = chars.into_iter().collect();
        both_encoders_match_the_crate(&text)?;
    }
}

/// Scripts written with combining marks: Devanagari (its nukta, which composes with three
/// letters, and the precomposed letters NFC takes apart), Bengali (vowel signs that compose),
/// Arabic (harakat of several combining classes) and Hebrew (points): any code point of each
/// block, marks of non-zero class, the pairs NFC composes, a space, ZWNJ/ZWJ and a Latin
/// letter.
fn marked_script_piece() -> impl Strategy<Value = String> {
    let marks: Vec<String> = [
        0x093C, 0x094D, 0x0951, 0x0952, 0x09BC, 0x09CD, 0x09BE, 0x09D7, 0x064B, 0x064C, 0x064E,
        0x0650, 0x0651, 0x0652, 0x0670, 0x05B0, 0x05B4, 0x05BC, 0x05C1, 0x05C2,
    ]
    .into_iter()
    .filter_map(char::from_u32)
    .map(String::from)
    .collect();
    const COMPOSING: &[&str] = &[
        "\u{928}\u{93C}",
        "\u{930}\u{93C}",
        "\u{933}\u{93C}",
        "\u{9C7}\u{9BE}",
        "\u{9C7}\u{9D7}",
        "\u{915}\u{93C}",
    ];
    let code_point = |cp: u32| char::from_u32(cp).map_or_else(|| "?".to_owned(), String::from);
    prop_oneof![
        6 => (0x0900u32..=0x09FF).prop_map(code_point),
        4 => (0x0590u32..=0x06FF).prop_map(code_point),
        4 => prop::sample::select(marks),
        2 => prop::sample::select(COMPOSING).prop_map(str::to_owned),
        1 => prop::sample::select(&[" ", "a", "\u{200C}", "\u{200D}", "\n"][..]).prop_map(str::to_owned),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Marks next to each other in any order (which NFC reorders), marks after the letters
    /// they compose with (which NFC composes), letters NFC decomposes: whatever the scanner
    /// takes and whatever it leaves to the crate, the crate's ids and words.
    #[test]
    fn random_marked_scripts_in_any_order_match_the_crate(pieces in prop::collection::vec(marked_script_piece(), 0..60)) {
        let text = pieces.concat();
        both_encoders_match_the_crate(&text)?;
    }
}

/// `at` starts a pre-token of the whole text: the encoder may stop there, and the whole text's
/// ids before it are final.
fn assert_word_start(text: &str, at: usize) {
    if at == 0 || at >= text.len() {
        return;
    }
    let (_, full_words) = crate_encode(text);
    assert!(
        full_words.iter().any(|(start, _)| *start == at),
        "{at} is not a word start of {text:?}"
    );
}

/// With a small pre-token bound, the fast encoder either encodes like the crate or stops at
/// a pre-token over the bound, at a place where the ids before it are exact; and the model
/// tokenizer keys such a text by exactly those ids.
fn check_bounded(text: &str, bound: usize) {
    let fast = FastEncoder::new(MODEL.tokenizer())
        .unwrap()
        .with_max_pretoken_bytes(bound);
    match fast.encode(MODEL.tokenizer(), text) {
        Ok(got) => assert_eq!(got, crate_encode(text), "{text:?}"),
        Err(kvpick::tokenize::TokenizeError::PretokenTooLong {
            at: Some(at),
            limit,
        }) => {
            assert_eq!(limit, bound);
            assert_word_start(text, at);
        }
        Err(e) => panic!("{text:?}: {e}"),
    }
}

const LONG_PIECES: &[&str] = &[
    "a",
    "hello",
    " ",
    "  ",
    "\n",
    "\t",
    "'s",
    "0",
    "42",
    "!",
    "...",
    "é",
    "한국어",
    " 텍스트",
    "e\u{301}",
    "\u{301}",
    "\u{a0}",
    "<|im_end|>",
    "xxxxxxxxxxxx",
    "!!!!!!!!!!!!",
    "            ",
    "\n\n\n\n\n\n\n\n\n",
    "\u{301}\u{301}\u{301}\u{301}\u{301}",
    "ééééééé",
    "한국어한국어한국어",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn a_bounded_encode_stops_only_where_the_ids_before_are_exact(
        pieces in prop::collection::vec(prop::sample::select(LONG_PIECES), 0..60),
        bound in 4usize..24,
    ) {
        check_bounded(&pieces.concat(), bound);
    }
}

/// The ids kvpick keeps before a cut are the whole text's, also where the text before the
/// cut ends in whitespace (which a text of its own would split differently at its end).
#[test]
fn the_ids_before_a_cut_are_the_whole_texts_after_trailing_whitespace() {
    let giant = "!".repeat(kvpick::tokenize::MAX_PRETOKEN_BYTES + 10);
    for head in [
        "0 's \u{a0}",
        "tail  \u{a0}",
        "words\t \u{3000}",
        "end \u{a0}\u{a0}",
    ] {
        let text = format!("{head}{giant} more");
        let got = MODEL.encode(&text, false).expect("encode");
        let at = got.cut_at.expect("cut");
        // The crate itself, unbounded: the tokens before `at`, and a new word at `at`.
        let whole = MODEL.tokenizer().encode(text.as_str(), false).unwrap();
        let kept = whole.get_offsets().iter().take_while(|o| o.0 < at).count();
        assert_eq!(
            whole.get_offsets()[kept].0,
            at,
            "{head:?}: no token starts at {at}"
        );
        assert_ne!(
            whole.get_word_ids()[kept],
            whole.get_word_ids()[kept - 1],
            "{head:?}: {at} is inside a word"
        );
        assert_eq!(got.ids, whole.get_ids()[..kept], "{head:?}");
        assert!(at >= head.len() - 3, "{head:?}: cut at {at}");
        // Owned text (a rendered chat prompt): the same.
        let owned = MODEL.encode_owned(text.clone(), false).expect("encode");
        assert_eq!((owned.ids, owned.cut_at), (got.ids, Some(at)), "{head:?}");
    }
}

#[test]
fn a_giant_word_is_cut_before_it_and_the_tokens_before_it_are_kept() {
    let head = "Summarise this, please: ";
    let text = format!("{head}{} and more words after it", "q".repeat(200_000));
    let got = MODEL.encode(&text, false).expect("encode");
    // The giant pre-token is " qqq…" (the space attaches to the letters).
    let at = head.len() - 1;
    assert_eq!(got.cut_at, Some(at));
    assert_eq!(got.ids, crate_encode(&text[..at]).0);
    // The crate itself, unbounded, agrees on those ids.
    let whole = MODEL.tokenizer().encode(text.as_str(), false).unwrap();
    assert_eq!(&whole.get_ids()[..got.ids.len()], &got.ids[..]);
    // Owned text (a rendered chat prompt): the same cut.
    let owned = MODEL.encode_owned(text.clone(), false).expect("encode");
    assert_eq!((owned.ids, owned.cut_at), (got.ids, Some(at)));
}
