//! kvpick's own block keys: a chained xxh3-64 over token ids.
//!
//! Why not the engine's hash: vLLM's hash depends on its algorithm (sha256 over pickle, CBOR,
//! xxhash with a per-process random seed) and version. Keying by our own hash of the tokens
//! makes the index independent of all that; the engine hash is only used to find which key a
//! `BlockRemoved` refers to (see [`super::index`]).
//!
//! `key_i = chain(key_{i-1}, xxh3(tokens_i))` with `key_{-1} = seed(model, lora, cache_salt)`:
//! equal keys mean equal model, adapter, salt and every token of the prefix up to that block.
//!
//! Why hash each block on its own and chain with a cheap mix (rather than seeding block i's
//! xxh3 with key i−1): the blocks' hashes do not depend on each other, so the CPU overlaps
//! them; only the mix (a multiply) is serial. Keys are hashed over the token ids' native
//! byte order without copying; they never leave the process, so no byte order is fixed.

use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// kvpick's key of one full block, chained over all blocks before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// What seeds a chain besides its tokens: the model, the LoRA adapter and the cache salt.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct KeyContext {
    /// Served model name (as in the event topic / the request's `model`).
    pub model: String,
    /// LoRA adapter name, when the request runs on one.
    pub lora_name: Option<String>,
    /// The request's `cache_salt`, when set.
    pub cache_salt: Option<String>,
}

impl KeyContext {
    /// A context for the base model, no adapter, no salt.
    pub fn model(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            lora_name: None,
            cache_salt: None,
        }
    }

    /// The seed of block 0's key.
    pub fn seed(&self) -> u64 {
        let mut bytes = Vec::with_capacity(self.model.len() + 32);
        for part in [
            Some(self.model.as_str()),
            self.lora_name.as_deref(),
            self.cache_salt.as_deref(),
        ] {
            match part {
                // Length-prefixed so that ("ab", "c") and ("a", "bc") differ; 0xff marks none.
                Some(text) => {
                    bytes.extend_from_slice(&(text.len() as u64).to_le_bytes());
                    bytes.extend_from_slice(text.as_bytes());
                }
                None => bytes.push(0xff),
            }
        }
        xxh3_64(&bytes)
    }
}

/// Seed of the hash of a block's extra keys (kept apart from token hashes).
const OPAQUE_SEED: u64 = 0x6f70_6171_7565_6b76;

/// Mixes one block's hash into the chain: a bijection in each argument (xor, multiply by an
/// odd constant, rotate), so distinct prefixes or distinct blocks give distinct keys unless
/// their 64-bit hashes collide.
#[inline]
fn chain(previous: u64, block_hash: u64) -> u64 {
    (previous ^ block_hash)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .rotate_left(29)
}

/// The key of one block given the previous key (or the context seed for block 0), and an
/// optional digest of extra keys that a plain token prefix cannot carry.
#[inline]
pub fn next_key(previous: u64, tokens: &[u32], opaque: Option<u64>) -> BlockKey {
    let key = chain(previous, xxh3_64(bytemuck::cast_slice(tokens)));
    BlockKey(match opaque {
        Some(extra) => chain(key, xxh3_64_with_seed(&extra.to_le_bytes(), OPAQUE_SEED)),
        None => key,
    })
}

/// The keys of every full block of `tokens` (a trailing partial block has no key).
pub fn block_keys(context: &KeyContext, tokens: &[u32], block_size: u32) -> Vec<BlockKey> {
    let mut chain = KeyChain::new(context.seed(), block_size);
    chain.extend_to(tokens, usize::MAX);
    chain.keys
}

/// The block keys of one prompt at one block size, computed on demand and kept, so that
/// matching (which stops at the first block no pod holds) and the routing record that follows
/// hash each block at most once.
///
/// A chain belongs to one token sequence: only [`super::PromptKeys`], which owns the tokens,
/// drives one (so every call passes the same tokens).
#[derive(Clone, Debug)]
pub(crate) struct KeyChain {
    seed: u64,
    block_size: u32,
    keys: Vec<BlockKey>,
}

impl KeyChain {
    /// An empty chain seeded by a [`KeyContext::seed`], at `block_size` (0 is treated as 1).
    pub(crate) fn new(seed: u64, block_size: u32) -> Self {
        Self {
            seed,
            block_size: block_size.max(1),
            keys: Vec::new(),
        }
    }

    /// The block size the keys are computed at.
    pub(crate) fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Full blocks in `tokens` at this chain's block size.
    pub(crate) fn total_blocks(&self, tokens: &[u32]) -> usize {
        tokens.len() / self.block_size as usize
    }

    /// The keys computed so far.
    pub(crate) fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// Computes keys until there are `blocks` of them (or every full block of `tokens` has
    /// one) and returns them all.
    pub(crate) fn extend_to(&mut self, tokens: &[u32], blocks: usize) -> &[BlockKey] {
        let size = self.block_size as usize;
        let total = self.total_blocks(tokens);
        let target = blocks.min(total);
        if target > self.keys.len() {
            let done = self.keys.len();
            let mut previous = self.keys.last().map_or(self.seed, |k| k.0);
            self.keys.reserve(target - done);
            let start = done * size;
            let rest = tokens.get(start..target * size).unwrap_or_default();
            for block in rest.chunks_exact(size) {
                let key = next_key(previous, block, None);
                previous = key.0;
                self.keys.push(key);
            }
        }
        &self.keys
    }
}

/// A fast hasher for keys that are already uniformly distributed 64-bit hashes (one multiply,
/// FxHash style); not for attacker-chosen keys of arbitrary shape.
#[derive(Clone, Copy, Default)]
pub struct PrehashedHasher(u64);

impl Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.write_u64(u64::from(*byte));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_isize(&mut self, n: isize) {
        self.write_u64(n as u64);
    }
}

/// `BuildHasher` for maps keyed by [`BlockKey`] / engine hashes.
pub type PrehashedState = BuildHasherDefault<PrehashedHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_depend_on_context() {
        let tokens: Vec<u32> = (0..70).collect();
        let base = block_keys(&KeyContext::model("m"), &tokens, 32);
        assert_eq!(base.len(), 2);
        // Same first block, different second block → only the second key differs.
        let mut other = tokens.clone();
        other[40] = 999;
        let changed = block_keys(&KeyContext::model("m"), &other, 32);
        assert_eq!(base[0], changed[0]);
        assert_ne!(base[1], changed[1]);
        // Model, LoRA and salt each change every key of the chain.
        let salted = KeyContext {
            cache_salt: Some("s".into()),
            ..KeyContext::model("m")
        };
        let lora = KeyContext {
            lora_name: Some("s".into()),
            ..KeyContext::model("m")
        };
        for context in [KeyContext::model("n"), salted, lora] {
            let keys = block_keys(&context, &tokens, 32);
            assert!(keys.iter().zip(&base).all(|(a, b)| a != b));
        }
        assert!(block_keys(&KeyContext::model("m"), &tokens[..31], 32).is_empty());
    }

    #[test]
    fn a_chain_extended_in_steps_equals_keying_at_once() {
        let tokens: Vec<u32> = (0..1000).map(|t| t * 7 + 3).collect();
        let context = KeyContext::model("m");
        let all = block_keys(&context, &tokens, 16);
        assert_eq!(all.len(), 62);
        let mut chain = KeyChain::new(context.seed(), 16);
        assert_eq!(chain.extend_to(&tokens, 5).len(), 5);
        assert_eq!(chain.extend_to(&tokens, 3).len(), 5, "never shrinks");
        assert_eq!(chain.extend_to(&tokens, 40).len(), 40);
        assert_eq!(chain.extend_to(&tokens, usize::MAX), all.as_slice());
        // Swapping two blocks changes the keys from the first swapped block on.
        let mut swapped = tokens.clone();
        swapped[16..32].copy_from_slice(&tokens[32..48]);
        swapped[32..48].copy_from_slice(&tokens[16..32]);
        let other = block_keys(&context, &swapped, 16);
        assert_eq!(other[0], all[0]);
        assert!(other[1..].iter().zip(&all[1..]).all(|(a, b)| a != b));
    }
}
