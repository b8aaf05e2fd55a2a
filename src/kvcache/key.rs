//! kvpick's own block keys: a chained xxh3-64 over token ids.
//!
//! Why not the engine's hash: vLLM's hash depends on its algorithm (sha256 over pickle, CBOR,
//! xxhash with a per-process random seed) and version. Keying by our own hash of the tokens
//! makes the index independent of all that; the engine hash is only used to find which key a
//! `BlockRemoved` refers to (see [`super::index`]).
//!
//! `key_0 = xxh3(tokens_0, seed(model, lora, cache_salt))`, `key_i = xxh3(tokens_i, key_{i-1})`:
//! equal keys mean equal model, adapter, salt and every token of the prefix up to that block.

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

/// Reusable scratch space for hashing token ids without allocating per block.
#[derive(Default)]
pub struct KeyHasherScratch {
    bytes: Vec<u8>,
}

impl KeyHasherScratch {
    /// The key of one block given the previous key (or the context seed for block 0), and
    /// an optional digest of extra keys that a plain text prefix cannot carry.
    pub fn next_key(&mut self, previous: u64, tokens: &[u32], opaque: Option<u64>) -> BlockKey {
        self.bytes.resize(tokens.len() * 4, 0);
        for (bytes, token) in self.bytes.chunks_exact_mut(4).zip(tokens) {
            bytes.copy_from_slice(&token.to_le_bytes());
        }
        let key = xxh3_64_with_seed(&self.bytes, previous);
        BlockKey(match opaque {
            Some(extra) => xxh3_64_with_seed(&extra.to_le_bytes(), key),
            None => key,
        })
    }
}

/// The keys of every full block of `tokens` (a trailing partial block has no key).
pub fn block_keys(context: &KeyContext, tokens: &[u32], block_size: u32) -> Vec<BlockKey> {
    BlockKeys::new(context, tokens, block_size).collect()
}

/// The chain of block keys of a token sequence, computed one block at a time (so matching
/// only hashes as far as it walks).
pub struct BlockKeys<'a> {
    blocks: std::slice::ChunksExact<'a, u32>,
    previous: u64,
    scratch: KeyHasherScratch,
}

impl<'a> BlockKeys<'a> {
    /// The keys of `tokens` in `context` at `block_size` (0 is treated as 1).
    pub fn new(context: &KeyContext, tokens: &'a [u32], block_size: u32) -> Self {
        Self {
            blocks: tokens.chunks_exact(block_size.max(1) as usize),
            previous: context.seed(),
            scratch: KeyHasherScratch::default(),
        }
    }
}

impl Iterator for BlockKeys<'_> {
    type Item = BlockKey;

    fn next(&mut self) -> Option<BlockKey> {
        let block = self.blocks.next()?;
        let key = self.scratch.next_key(self.previous, block, None);
        self.previous = key.0;
        Some(key)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for BlockKeys<'_> {}

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
}
