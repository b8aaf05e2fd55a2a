//! A shared, bounded memo of short pre-tokens (raw UTF-8 bytes) → their BPE token ids.
//!
//! Once the fast encoder's scanner has found a pre-token, what it paid per word was the
//! tokenizers crate's `BPE::tokenize`: the byte-level mapped `String`, a vocab and a cache
//! lookup keyed by that `String`, and a `Vec<Token>` with one `String` per token. This memo is
//! keyed by the raw pre-token bytes and holds the ids inline, so a hit is a multiply-fold of a
//! few bytes and one probe of a two-slot set (one cache line each), without allocating or
//! writing anything shared. The probe is what a hit costs: the table (4 MiB) is read at
//! random, so a word's set is rarely in the CPU's caches. The encoder therefore locates a
//! batch of words ([`WordCache::locate`], which prefetches their sets) before it reads any
//! of them ([`WordCache::extend_located`]), and their waits on memory overlap.
//!
//! Exactness: a slot only ever holds what the crate returned for that very pre-token (BPE
//! without dropout is a pure function of its input), so a hit equals a miss.
//!
//! Memory: a fixed table of `capacity` slots (rounded up to a power of two) of 64 bytes,
//! allocated once: 4 MiB for the default capacity. Pre-tokens longer than [`MAX_WORD`] bytes
//! or of more than [`MAX_IDS`] tokens are not memoised. A word goes to one of the two slots of
//! its set (by its hash): an empty one, else it replaces the one its hash names.
//!
//! Concurrency: every slot is a sequence lock over atomic words, so a lookup is plain loads —
//! no lock, no read-modify-write. The `RwLock` shards this replaced spent about half of each
//! hit on the lock's two atomic operations (`perf annotate`, docs/benchmarks.md session 19).
//! A reader takes the slot's sequence number, reads the slot, and takes it again: if it was odd
//! (a write in progress) or changed, the read is a miss, never a torn entry. A writer makes
//! the number odd with a compare-and-swap (a slot another writer holds is skipped: memoising
//! is best-effort, no encode ever waits on another), writes, and makes it even again.

use std::sync::atomic::{AtomicU64, Ordering, fence};

/// Longest pre-token (in bytes) that is memoised.
pub const MAX_WORD: usize = 24;
/// Most token ids a memoised pre-token may encode to.
pub const MAX_IDS: usize = 4;
/// Default number of memoised pre-tokens per tokenizer (64 Ki slots of 64 bytes: 4 MiB).
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// Slots per set: a word may live in either.
const WAYS: usize = 2;

/// One memoised pre-token, behind its sequence number (module docs). `meta` holds the word's
/// length (0: empty) and its id count; `word` its bytes zero-padded, little-endian; `ids` two
/// ids per word.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    seq: AtomicU64,
    meta: AtomicU64,
    word: [AtomicU64; 3],
    ids: [AtomicU64; 2],
}

/// A word as the slots store it.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    len: u64,
    word: [u64; 3],
}

impl Key {
    // NOTE: inlined so that the key stays in registers: returned through the stack, its
    // 8-byte stores were read back as 16-byte loads, which stall on store forwarding.
    #[inline(always)]
    fn new(word: &[u8]) -> Option<Self> {
        if word.is_empty() || word.len() > MAX_WORD {
            return None;
        }
        // NOTE: loaded straight into registers: copying the word into a padded buffer first
        // (a variable-length memcpy, then 8-byte reads of it) stalled on store forwarding,
        // about half of every hit (`perf annotate`, docs/benchmarks.md session 27).
        let part = |i: usize| {
            let from = (i * 8).min(word.len());
            let to = (i * 8 + 8).min(word.len());
            word.get(from..to).map_or(0, le_u64)
        };
        Some(Self {
            len: word.len() as u64,
            word: [part(0), part(1), part(2)],
        })
    }

    /// Where the key lives: a multiply-fold of its words (they hold every byte and the
    /// length, so nothing is hashed twice).
    #[inline(always)]
    fn hash(&self) -> u64 {
        const SEEDS: [u64; 3] = [
            0x243f_6a88_85a3_08d3,
            0x1319_8a2e_0370_7344,
            0xa409_3822_299f_31d0,
        ];
        let first = fold_multiply(self.word[0] ^ SEEDS[0], self.word[1] ^ SEEDS[1]);
        fold_multiply(first ^ self.word[2], self.len ^ SEEDS[2])
    }
}

/// The 128-bit product of `a` and `b`, its halves xored: every input bit reaches every
/// output bit.
fn fold_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

/// Up to 8 bytes as a little-endian number, zero-padded, without a copy: overlapping reads
/// of the first and last bytes.
#[inline(always)]
fn le_u64(bytes: &[u8]) -> u64 {
    let n = bytes.len();
    let at = |i: usize| u64::from(bytes.get(i).copied().unwrap_or(0));
    let u32_at = |i: usize| {
        bytes
            .get(i..i + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, |b| u64::from(u32::from_le_bytes(b)))
    };
    match n {
        0 => 0,
        1..=3 => at(0) | (at(n / 2) << (8 * (n / 2))) | (at(n - 1) << (8 * (n - 1))),
        4..=7 => u32_at(0) | (u32_at(n - 4) << (8 * (n - 4))),
        _ => bytes
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes),
    }
}

impl Slot {
    /// The ids stored for `key`, read consistently; `None` on another word, an empty slot, or
    /// a write in progress.
    #[inline(always)]
    fn read(&self, key: &Key) -> Option<([u32; MAX_IDS], usize)> {
        let before = self.seq.load(Ordering::Acquire);
        if before & 1 == 1 {
            return None;
        }
        let meta = self.meta.load(Ordering::Relaxed);
        let word = [
            self.word[0].load(Ordering::Relaxed),
            self.word[1].load(Ordering::Relaxed),
            self.word[2].load(Ordering::Relaxed),
        ];
        let ids = [
            self.ids[0].load(Ordering::Relaxed),
            self.ids[1].load(Ordering::Relaxed),
        ];
        // NOTE: the acquire fence keeps the reads above before the second sequence load: a
        // reader that saw any byte of a later write sees that write's odd (or later) number.
        fence(Ordering::Acquire);
        if self.seq.load(Ordering::Relaxed) != before {
            return None;
        }
        // NOTE: compared word by word, not as arrays: an array compare goes through memory.
        if meta & 0xff != key.len
            || word[0] != key.word[0]
            || word[1] != key.word[1]
            || word[2] != key.word[2]
        {
            return None;
        }
        let count = ((meta >> 8) & 0xff) as usize;
        let unpacked = [
            ids[0] as u32,
            (ids[0] >> 32) as u32,
            ids[1] as u32,
            (ids[1] >> 32) as u32,
        ];
        (count <= MAX_IDS).then_some((unpacked, count))
    }

    /// Whether the slot holds `key` (or a write is in progress: then it is left alone).
    fn holds_or_busy(&self, key: &Key) -> bool {
        let seq = self.seq.load(Ordering::Acquire);
        seq & 1 == 1 || self.read(key).is_some()
    }

    fn is_empty(&self) -> bool {
        self.meta.load(Ordering::Relaxed) & 0xff == 0
    }

    /// Stores `key` → `ids` unless another writer holds the slot.
    fn write(&self, key: &Key, ids: &[u32]) {
        let seq = self.seq.load(Ordering::Relaxed);
        if seq & 1 == 1
            || self
                .seq
                .compare_exchange(seq, seq + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        // NOTE: the release fence keeps the odd number before the stores below, for a reader
        // that sees any of them (module docs).
        fence(Ordering::Release);
        let id = |i: usize| u64::from(ids.get(i).copied().unwrap_or(0));
        self.meta
            .store(key.len | ((ids.len() as u64) << 8), Ordering::Relaxed);
        for (slot, part) in self.word.iter().zip(key.word) {
            slot.store(part, Ordering::Relaxed);
        }
        self.ids[0].store(id(0) | (id(1) << 32), Ordering::Relaxed);
        self.ids[1].store(id(2) | (id(3) << 32), Ordering::Relaxed);
        self.seq.store(seq + 2, Ordering::Release);
    }
}

/// A word's key and the set it lives in, from [`WordCache::locate`].
#[derive(Clone, Copy)]
pub struct Probe {
    key: Key,
    first: usize,
}

/// Asks for `slot`'s cache line ahead of its read.
#[inline(always)]
fn prefetch(slot: &Slot) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64; a prefetch is a hint that reads nothing into the
    // program and cannot fault, and the pointer is to a slot the table owns.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (slot as *const Slot).cast::<i8>(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slot;
}

/// The memo (see the module docs).
pub struct WordCache {
    slots: Box<[Slot]>,
    /// Sets minus one (the slot count is a power of two); unused when there are no slots.
    set_mask: usize,
}

impl std::fmt::Debug for WordCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WordCache")
            .field("capacity", &self.slots.len())
            .field("len", &self.len())
            .finish()
    }
}

impl WordCache {
    /// A memo of about `capacity` pre-tokens (rounded up to a power of two, at least one set;
    /// 0 memoises nothing).
    pub fn new(capacity: usize) -> Self {
        let slots = if capacity == 0 {
            0
        } else {
            capacity.next_power_of_two().max(WAYS)
        };
        Self {
            slots: (0..slots).map(|_| Slot::default()).collect(),
            set_mask: (slots / WAYS).saturating_sub(1),
        }
    }

    /// The two slots `hash` may live in.
    fn set(&self, hash: u64) -> &[Slot] {
        self.set_at(self.set_start(hash))
    }

    fn set_start(&self, hash: u64) -> usize {
        (hash as usize & self.set_mask) * WAYS
    }

    fn set_at(&self, first: usize) -> &[Slot] {
        self.slots.get(first..first + WAYS).unwrap_or(&[])
    }

    /// Appends the memoised ids of `word` to `out`; false on a miss.
    #[cfg(test)]
    pub fn extend_ids(&self, word: &[u8], out: &mut Vec<u32>) -> bool {
        self.locate(word)
            .is_some_and(|probe| self.extend_located(&probe, out))
    }

    /// Where `word` would be, its set's cache line asked for now (`None` for a word the table
    /// never holds, empty or too long, and for a table of no slots). A lookup of a word not
    /// in the CPU's caches waits on memory (~100 ns, most of a hit); locating the next few
    /// words first lets those waits overlap (docs/benchmarks.md, session 37).
    #[inline(always)]
    pub fn locate(&self, word: &[u8]) -> Option<Probe> {
        if self.slots.is_empty() {
            return None;
        }
        let key = Key::new(word)?;
        let first = self.set_start(key.hash());
        // NOTE: the set's first line only: a set is two adjacent lines, which the CPU's
        // adjacent-line prefetch often brings in together, and prefetching both lines
        // measured the same (docs/benchmarks.md, session 37).
        if let Some(slot) = self.slots.get(first) {
            prefetch(slot);
        }
        Some(Probe { key, first })
    }

    /// Appends the memoised ids of the word `probe` located to `out`; false on a miss.
    #[inline(always)]
    pub fn extend_located(&self, probe: &Probe, out: &mut Vec<u32>) -> bool {
        for slot in self.set_at(probe.first) {
            if let Some((ids, count)) = slot.read(&probe.key) {
                out.extend_from_slice(ids.get(..count).unwrap_or(&[]));
                return true;
            }
        }
        false
    }

    /// Memoises `ids` for `word` when it fits and its slot is free.
    pub fn insert(&self, word: &[u8], ids: &[u32]) {
        if self.slots.is_empty() || ids.len() > MAX_IDS {
            return;
        }
        let Some(key) = Key::new(word) else {
            return;
        };
        let hash = key.hash();
        let set = self.set(hash);
        if set.iter().any(|slot| slot.holds_or_busy(&key)) {
            return;
        }
        // An empty slot of the set, else the one the hash's top bit names: a word's place
        // does not depend on which words came before it.
        let victim = set
            .iter()
            .find(|slot| slot.is_empty())
            .or_else(|| set.get((hash >> 63) as usize));
        if let Some(slot) = victim {
            slot.write(&key, ids);
        }
    }

    /// Memoised pre-tokens right now (a scan of the table).
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| !s.is_empty()).count()
    }

    /// Bytes the table has allocated.
    #[cfg(test)]
    pub fn allocated_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_hold_every_byte_zero_padded_for_every_length() {
        let bytes: Vec<u8> = (0..MAX_WORD as u8)
            .map(|i| 0xA0 ^ i.wrapping_mul(37))
            .collect();
        for len in 1..=MAX_WORD {
            let word = &bytes[..len];
            let mut padded = [0u8; MAX_WORD];
            padded[..len].copy_from_slice(word);
            let expected: Vec<u64> = padded
                .chunks(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            let key = Key::new(word).expect("short enough");
            assert_eq!(
                (key.len, key.word.to_vec()),
                (len as u64, expected),
                "{len}"
            );
            // A word and the same bytes with a trailing NUL are different keys.
            let mut longer = word.to_vec();
            longer.push(0);
            if let Some(other) = Key::new(&longer) {
                assert!(other != key && other.hash() != key.hash(), "{len}");
            }
        }
        assert!(Key::new(b"").is_none() && Key::new(&[b'a'; MAX_WORD + 1]).is_none());
    }

    #[test]
    fn hits_return_what_was_inserted_and_long_words_are_skipped() {
        let cache = WordCache::new(1024);
        let mut out = vec![7];
        assert!(!cache.extend_ids(b" hello", &mut out));
        cache.insert(b" hello", &[1, 2]);
        assert!(cache.extend_ids(b" hello", &mut out));
        assert_eq!(out, [7, 1, 2]);
        assert!(!cache.extend_ids(b" hell", &mut out));
        assert!(
            !cache.extend_ids(b" hello\0", &mut out),
            "padding is not a match"
        );
        let long = [b'a'; MAX_WORD + 1];
        cache.insert(&long, &[3]);
        assert!(!cache.extend_ids(&long, &mut out));
        let longest = [b'b'; MAX_WORD];
        cache.insert(&longest, &[u32::MAX, 0, 5, 1 << 31]);
        let mut ids = Vec::new();
        assert!(cache.extend_ids(&longest, &mut ids));
        assert_eq!(ids, [u32::MAX, 0, 5, 1 << 31], "every id bit kept");
        cache.insert(b"many", &[1, 2, 3, 4, 5]);
        assert!(!cache.extend_ids(b"many", &mut out));
        cache.insert(b"none", &[]);
        let mut empty = Vec::new();
        assert!(cache.extend_ids(b"none", &mut empty) && empty.is_empty());
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn a_word_located_ahead_reads_what_was_inserted_after() {
        let cache = WordCache::new(1024);
        // Located before its insert (a word earlier in the batch memoises it): the probe
        // names a place, not a result, so the read sees the insert.
        let probe = cache.locate(b" hello").expect("a short word is located");
        let mut out = Vec::new();
        assert!(!cache.extend_located(&probe, &mut out));
        cache.insert(b" hello", &[4, 2]);
        assert!(cache.extend_located(&probe, &mut out));
        assert_eq!(out, [4, 2]);
        let other = cache.locate(b" hell").expect("located");
        assert!(!cache.extend_located(&other, &mut out));
        assert!(cache.locate(b"").is_none());
        assert!(cache.locate(&[b'a'; MAX_WORD + 1]).is_none());
        assert!(WordCache::new(0).locate(b" hello").is_none());
    }

    #[test]
    fn a_full_table_replaces_words_and_stays_within_its_allocation() {
        let cache = WordCache::new(64);
        for i in 0..10_000u32 {
            cache.insert(format!("w{i}").as_bytes(), &[i]);
            assert!(cache.len() <= 64);
        }
        // The newest insert is always present, with its own ids; a word either answers its
        // own ids or misses.
        let mut out = Vec::new();
        assert!(cache.extend_ids(b"w9999", &mut out));
        assert_eq!(out, [9999]);
        for i in 0..10_000u32 {
            let mut out = Vec::new();
            if cache.extend_ids(format!("w{i}").as_bytes(), &mut out) {
                assert_eq!(out, [i]);
            }
        }
        let full = WordCache::new(DEFAULT_CAPACITY);
        assert_eq!(full.allocated_bytes(), 4 << 20, "64 Ki slots of 64 bytes");
        for i in 0..(4 * DEFAULT_CAPACITY as u32) {
            full.insert(format!("{i:x}").as_bytes(), &[i]);
        }
        assert!(full.len() > DEFAULT_CAPACITY / 2, "{}", full.len());
        let off = WordCache::new(0);
        off.insert(b"w", &[1]);
        assert_eq!(off.len(), 0);
        assert!(!off.extend_ids(b"w", &mut out));
    }

    /// Readers racing writers on the same few slots only ever see a word's own ids or a miss.
    #[test]
    fn concurrent_writes_never_show_a_torn_entry() {
        let cache = std::sync::Arc::new(WordCache::new(WAYS));
        // Every word's ids are derived from it, so a torn read would show a mismatch.
        let word = |i: u32| format!("word-{i:05}");
        let ids = |i: u32| [i, i ^ 0xdead_beef, i.wrapping_mul(7), !i];
        let writers: Vec<_> = (0..2)
            .map(|t| {
                let cache = std::sync::Arc::clone(&cache);
                std::thread::spawn(move || {
                    for round in 0..20_000u32 {
                        let i = (round * 2 + t) % 64;
                        // The set holds two words: inserts keep evicting each other.
                        cache.insert(word(i).as_bytes(), &ids(i));
                    }
                })
            })
            .collect();
        let mut hits = 0;
        for round in 0..200_000u32 {
            let i = round % 64;
            let mut out = Vec::new();
            if cache.extend_ids(word(i).as_bytes(), &mut out) {
                assert_eq!(out, ids(i), "word {i}");
                hits += 1;
            }
        }
        for w in writers {
            w.join().expect("writer");
        }
        // Whatever the interleaving, the set ends holding words the writers wrote.
        for i in 0..64 {
            let mut out = Vec::new();
            if cache.extend_ids(word(i).as_bytes(), &mut out) {
                assert_eq!(out, ids(i), "word {i}");
                hits += 1;
            }
        }
        assert!(hits > 0, "some reads hit");
    }
}
