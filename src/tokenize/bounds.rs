//! The bound on exact tokenization: no pre-token longer than [`MAX_PRETOKEN_BYTES`] is
//! tokenized.
//!
//! The tokenizers crate's BPE on one giant pre-token (a 16 MB word without spaces) builds
//! per-symbol structures and a `Vec` of `String` tokens: it peaked at 1.13 GB RSS and 9–10
//! CPU-seconds for one prompt. Exact ids of such a word are useless for routing (no model
//! serves a multi-million-token prompt, and no pod will announce those blocks), so exact
//! tokenization stops at the first pre-token longer than the bound: the prompt is keyed by
//! the ids before it, which do not depend on anything after a pre-token boundary, so those
//! blocks stay exact. Natural-language pre-tokens are words (tens of bytes); 64 KiB of
//! letters, symbols or whitespace without a break is not text a model is meant to read.

use super::error::TokenizeError;

/// Longest pre-token (or, for text the tokenizers crate pre-tokenizes itself, longest run
/// without whitespace) tokenized exactly.
pub const MAX_PRETOKEN_BYTES: usize = 64 * 1024;

/// For text the crate tokenizes whole, where pre-token boundaries are not known here: an
/// error when `text` has a run of more than `max` bytes without whitespace (the only way to
/// a pre-token that long), so the prompt is routed approximately instead.
pub fn check_unbroken_runs(text: &str, max: usize) -> Result<(), TokenizeError> {
    if text.len() <= max {
        return Ok(());
    }
    let mut run = 0usize;
    for c in text.chars() {
        if c.is_whitespace() {
            run = 0;
        } else {
            run += c.len_utf8();
            if run > max {
                return Err(TokenizeError::PretokenTooLong {
                    at: None,
                    limit: max,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_over_the_bound_fail() {
        assert!(check_unbroken_runs(&"ab ".repeat(100), 4).is_ok());
        assert!(check_unbroken_runs("abcd efgh", 4).is_ok());
        assert!(matches!(
            check_unbroken_runs("abcd efghi", 4),
            Err(TokenizeError::PretokenTooLong { at: None, limit: 4 })
        ));
        assert!(check_unbroken_runs("éé éé", 4).is_ok(), "bytes, not chars");
        assert!(check_unbroken_runs("ééé", 4).is_err());
    }
}
