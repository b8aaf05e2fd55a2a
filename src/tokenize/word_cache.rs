//! A shared, bounded memo of short pre-tokens (raw UTF-8 bytes) → their BPE token ids.
//!
//! Once the fast encoder's scanner has found a pre-token, what it paid per word was the
//! tokenizers crate's `BPE::tokenize`: the byte-level mapped `String`, a vocab and a cache
//! lookup keyed by that `String`, and a `Vec<Token>` with one `String` per token. This memo is
//! keyed by the raw pre-token bytes and holds the ids inline, so a hit is one xxh3 of a few
//! bytes, one shard read lock and one table probe, without allocating.
//!
//! Exactness: a slot only ever holds what the crate returned for that very pre-token (BPE
//! without dropout is a pure function of its input), so a hit equals a miss.
//!
//! Memory: at most `capacity` slots of 40 bytes, plus hashbrown's rounding of each shard up to
//! a power-of-two bucket count (the default capacity fills its buckets exactly: 2.7 MB).
//! Pre-tokens longer than [`MAX_WORD`] bytes or of more than [`MAX_IDS`] tokens are not memoised.
//! A full shard is cleared before the next insert.
//! NOTE: clearing instead of LRU keeps hits lock-light (no recency to update under the read
//! lock); natural text re-warms a cleared shard within a few KB.
//!
//! Concurrency: sharded `RwLock`s. Lookups take a shard's read lock; an insert only
//! `try_write`s and skips memoising when the shard is busy, so no encode ever waits on another.

use std::sync::RwLock;

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64;

/// Longest pre-token (in bytes) that is memoised.
pub const MAX_WORD: usize = 22;
/// Most token ids a memoised pre-token may encode to.
pub const MAX_IDS: usize = 4;
/// Default number of memoised pre-tokens per tokenizer: 1,792 per shard, which is exactly what
/// hashbrown holds in 2,048 buckets (7/8), so a full cache is 32 × 2,048 × 41 B ≈ 2.7 MB.
pub const DEFAULT_CAPACITY: usize = SHARDS * 1792;

const SHARDS: usize = 32;

/// One memoised pre-token: its bytes and ids, inline.
#[derive(Clone, Copy)]
struct Slot {
    word_len: u8,
    ids_len: u8,
    word: [u8; MAX_WORD],
    ids: [u32; MAX_IDS],
}

/// `word` zero-padded to the slot's width (callers check the length first).
fn padded(word: &[u8]) -> [u8; MAX_WORD] {
    let mut out = [0; MAX_WORD];
    if let Some(head) = out.get_mut(..word.len()) {
        head.copy_from_slice(word);
    }
    out
}

impl Slot {
    /// Equal to a word of `len` bytes padded to `padded` (fixed-width compare, no memcmp call).
    fn is(&self, len: usize, padded: &[u8; MAX_WORD]) -> bool {
        usize::from(self.word_len) == len && self.word == *padded
    }
    fn word(&self) -> &[u8] {
        self.word.get(..usize::from(self.word_len)).unwrap_or(&[])
    }
    fn ids(&self) -> &[u32] {
        self.ids.get(..usize::from(self.ids_len)).unwrap_or(&[])
    }
}

/// The memo (see the module docs).
pub struct WordCache {
    shards: Box<[RwLock<HashTable<Slot>>]>,
    per_shard: usize,
}

impl std::fmt::Debug for WordCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WordCache")
            .field("capacity", &(self.per_shard * SHARDS))
            .field("len", &self.len())
            .finish()
    }
}

impl WordCache {
    /// A memo of at most `capacity` pre-tokens (0 memoises nothing).
    pub fn new(capacity: usize) -> Self {
        let per_shard = capacity.div_ceil(SHARDS);
        Self {
            shards: (0..SHARDS).map(|_| RwLock::new(HashTable::new())).collect(),
            per_shard,
        }
    }

    fn shard(&self, hash: u64) -> Option<&RwLock<HashTable<Slot>>> {
        // The top bits pick the shard; hashbrown uses the low bits and the top 7 inside it.
        self.shards.get((hash >> 40) as usize % SHARDS)
    }

    /// Appends the memoised ids of `word` to `out`; false on a miss.
    pub fn extend_ids(&self, word: &[u8], out: &mut Vec<u32>) -> bool {
        if word.len() > MAX_WORD || self.per_shard == 0 {
            return false;
        }
        let hash = xxh3_64(word);
        let Some(shard) = self.shard(hash) else {
            return false;
        };
        let key = padded(word);
        // A poisoned lock only means a panic elsewhere while inserting plain data: still valid.
        let table = shard.read().unwrap_or_else(|p| p.into_inner());
        match table.find(hash, |s| s.is(word.len(), &key)) {
            Some(slot) => {
                out.extend_from_slice(slot.ids());
                true
            }
            None => false,
        }
    }

    /// Memoises `ids` for `word` when it fits and the shard is free.
    pub fn insert(&self, word: &[u8], ids: &[u32]) {
        if word.len() > MAX_WORD || ids.len() > MAX_IDS || self.per_shard == 0 {
            return;
        }
        let mut slot = Slot {
            word_len: word.len() as u8,
            ids_len: ids.len() as u8,
            word: padded(word),
            ids: [0; MAX_IDS],
        };
        if let Some(i) = slot.ids.get_mut(..ids.len()) {
            i.copy_from_slice(ids);
        }
        let hash = xxh3_64(word);
        let Some(shard) = self.shard(hash) else {
            return;
        };
        let Ok(mut table) = shard.try_write() else {
            return;
        };
        if table.find(hash, |s| s.is(word.len(), &slot.word)).is_some() {
            return;
        }
        if table.len() >= self.per_shard {
            table.clear();
        }
        table.insert_unique(hash, slot, |s| xxh3_64(s.word()));
    }

    /// Bytes the shards' tables have allocated.
    #[cfg(test)]
    pub fn allocated_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                s.read()
                    .unwrap_or_else(|p| p.into_inner())
                    .allocation_size()
            })
            .sum()
    }

    /// Memoised pre-tokens right now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_return_what_was_inserted_and_long_words_are_skipped() {
        let cache = WordCache::new(1024);
        let mut out = vec![7];
        assert!(!cache.extend_ids(b" hello", &mut out));
        cache.insert(b" hello", &[1, 2]);
        assert!(cache.extend_ids(b" hello", &mut out));
        assert_eq!(out, [7, 1, 2]);
        assert!(!cache.extend_ids(b" hell", &mut out));
        let long = [b'a'; MAX_WORD + 1];
        cache.insert(&long, &[3]);
        assert!(!cache.extend_ids(&long, &mut out));
        cache.insert(b"many", &[1, 2, 3, 4, 5]);
        assert!(!cache.extend_ids(b"many", &mut out));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_full_shard_is_cleared_and_the_total_stays_bounded() {
        let cache = WordCache::new(SHARDS * 4);
        for i in 0..10_000u32 {
            cache.insert(format!("w{i}").as_bytes(), &[i]);
            assert!(cache.len() <= SHARDS * 4);
        }
        // The newest insert is always present, with its own ids.
        let mut out = Vec::new();
        assert!(cache.extend_ids(b"w9999", &mut out));
        assert_eq!(out, [9999]);
        // The default cache, filled far past its capacity, stays within its documented size.
        let full = WordCache::new(DEFAULT_CAPACITY);
        for i in 0..(4 * DEFAULT_CAPACITY as u32) {
            full.insert(format!("{i:x}").as_bytes(), &[i]);
        }
        assert!(full.len() > DEFAULT_CAPACITY / 2, "{}", full.len());
        assert!(
            full.allocated_bytes() <= 2_750_000,
            "{}",
            full.allocated_bytes()
        );
        let off = WordCache::new(0);
        off.insert(b"w", &[1]);
        assert_eq!(off.len(), 0);
    }
}
