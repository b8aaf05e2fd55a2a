//! Prompts of random vocab tokens decoded to text, like inference-perf's `random` data (the
//! no-sharing workload's): pre-tokens no natural text has, most of them new to any cache.
//! Shared by the tokenizer tests and `benches/tokenize.rs` (which include this file by path;
//! it needs only the `tokenizers` crate).

/// The text of `tokens` pseudo-random ids below the base vocab's 151,643 (xorshift, seeded).
pub fn random_token_text(tokenizer: &tokenizers::Tokenizer, seed: u64, tokens: usize) -> String {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let ids: Vec<u32> = (0..tokens)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 151_643) as u32
        })
        .collect();
    tokenizer.decode(&ids, true).expect("decode random ids")
}
