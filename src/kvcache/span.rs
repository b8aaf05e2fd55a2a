//! Spans: runs of one pod's blocks stored as one chain, so a walk can jump over them.
//!
//! # Why
//! A walk that checks every block of a 2,000-block prompt pays a table probe per block even
//! when the candidates plainly hold the whole prefix. vLLM stores a prompt's blocks as chains
//! (one `BlockStored` per scheduler step, each continuing the previous one) and evicts a
//! chain's leaves before its parents. So the index numbers each (pod, tier) holder with a
//! span and an offset in it: a span is a chain of blocks the pod stored one after the other,
//! and its *intact length* is how many of its leading blocks are all still held. If a pod
//! holds key `k_t` of a request at offset `o` of a span whose intact length is above `o`, it
//! holds the `o` blocks before `k_t` too, and they are the request's blocks `t − o .. t`
//! (keys are chained: equal keys mean equal prefixes). A walk can thus verify a jump of many
//! blocks with one probe (`matching::gallop`), exactly.
//!
//! A pod without events gets spans the same way from kvpick's own routing records (`record`):
//! each record adds the prompt's new tail after the prefix the pod's approximate LRU set
//! already holds, as a chain, and that set evicts a touch's blocks tail first.
//!
//! # Rules (kept by the index under the pod's mutex)
//! - A newly held (block, pod, tier) continues the span of its chain predecessor when that
//!   predecessor is the span's last block and the span is intact to its end; otherwise it
//!   starts a new span. A block already held keeps its span, so a span has only its own
//!   members.
//! - When a member leaves (its last reference is removed), the span's intact length drops to
//!   at most its offset; when its last member leaves, the span id is freed for reuse.
//! - Running out of span ids (or of offsets) is not an error: the block gets no span
//!   ([`SpanRef::NONE`]) and walks step over it block by block, as without spans.
//!
//! # Concurrency rules
//! Only the pod's writer (holding the pod mutex) changes its spans. Walks read intact lengths
//! without a lock from [`SpanIntact`]: chunks are allocated once and never move or shrink.
//! A walk may see an intact length that is a step behind a concurrent removal, exactly as it
//! may see a block map shard before or after that removal.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU16, Ordering};

/// Bits of a span id (see [`SpanRef`]).
pub(crate) const SPAN_BITS: u32 = 17;
/// Intact lengths live in chunks of growing size (64, 128, 256, … ids), so a pod with few
/// spans costs a few hundred bytes, and ids up to 2^17 fit in 11 chunks.
const FIRST_CHUNK: usize = 64;
const CHUNKS: usize = 11;
/// Span ids a pod can use (what the chunks hold; below [`SpanRef::NONE`]).
const MAX_SPANS: usize = FIRST_CHUNK * ((1 << CHUNKS) - 1);
const _: () = assert!(MAX_SPANS < (1 << SPAN_BITS) - 1);

/// The longest span (offsets are below it, so they fit a `u16`).
const MAX_LEN: u16 = u16::MAX;

/// A (span id, offset) pair as stored with a holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SpanRef {
    pub(crate) id: u32,
    pub(crate) offset: u16,
}

impl SpanRef {
    /// No span: walks step over such a block one by one.
    pub(crate) const NONE: SpanRef = SpanRef {
        id: (1 << SPAN_BITS) - 1,
        offset: 0,
    };

    /// Whether this names a span.
    pub(crate) fn is_some(self) -> bool {
        self.id != Self::NONE.id
    }

    /// The place `k` blocks further along the same span (saturating at the longest span).
    pub(crate) fn advanced(self, k: usize) -> SpanRef {
        SpanRef {
            id: self.id,
            offset: self
                .offset
                .saturating_add(u16::try_from(k).unwrap_or(u16::MAX)),
        }
    }
}

/// Per pod, span id → intact length, readable without locks.
pub(crate) struct SpanIntact {
    chunks: [OnceLock<Box<[AtomicU16]>>; CHUNKS],
}

impl Default for SpanIntact {
    fn default() -> Self {
        Self {
            chunks: std::array::from_fn(|_| OnceLock::new()),
        }
    }
}

/// The chunk of span `id` and its index there: chunk `k` holds ids
/// `64·(2^k − 1) .. 64·(2^(k+1) − 1)`.
#[inline]
fn chunk_of(id: u32) -> (usize, usize) {
    let scaled = id as usize / FIRST_CHUNK + 1;
    let chunk = (usize::BITS - 1 - scaled.leading_zeros()) as usize;
    let start = FIRST_CHUNK * ((1 << chunk) - 1);
    (chunk, id as usize - start)
}

impl SpanIntact {
    /// Leading blocks of span `id` all still held (0 for an unknown span).
    #[inline]
    pub(crate) fn intact(&self, id: u32) -> u32 {
        let (chunk, at) = chunk_of(id);
        self.chunks
            .get(chunk)
            .and_then(|c| c.get())
            .and_then(|c| c.get(at))
            .map_or(0, |cell| u32::from(cell.load(Ordering::Acquire)))
    }

    /// Bytes of the chunks allocated so far (and the directory).
    pub(crate) fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self
                .chunks
                .iter()
                .filter_map(|c| c.get())
                .map(|c| c.len() * std::mem::size_of::<AtomicU16>())
                .sum::<usize>()
    }

    fn cell(&self, id: u32) -> Option<&AtomicU16> {
        let (chunk, at) = chunk_of(id);
        self.chunks
            .get(chunk)?
            .get_or_init(|| {
                (0..FIRST_CHUNK << chunk)
                    .map(|_| AtomicU16::new(0))
                    .collect()
            })
            .get(at)
    }

    fn set(&self, id: u32, intact: u16) {
        if let Some(cell) = self.cell(id) {
            cell.store(intact, Ordering::Release);
        }
    }
}

/// The writer's view of one span (its intact length lives in [`SpanIntact`] only).
#[derive(Clone, Copy, Default)]
struct SpanMeta {
    /// Blocks appended so far.
    len: u16,
    /// Members still held.
    live: u16,
}

/// Per pod, the writer's bookkeeping of its spans (guarded by the pod mutex).
#[derive(Default)]
pub(crate) struct SpanBook {
    meta: Vec<SpanMeta>,
    free: Vec<u32>,
}

impl SpanBook {
    /// The span a newly held block gets, after `previous` (its chain predecessor's span, when
    /// the pod holds the predecessor in the same tier). Not yet committed: see [`Self::commit`].
    pub(crate) fn next_after(&self, previous: Option<SpanRef>, intact: &SpanIntact) -> SpanRef {
        if let Some(previous) = previous.filter(|p| p.is_some())
            && let Some(meta) = self.meta.get(previous.id as usize)
            && u32::from(meta.len) == u32::from(previous.offset) + 1
            && intact.intact(previous.id) == u32::from(meta.len)
            && meta.len < MAX_LEN
        {
            return SpanRef {
                id: previous.id,
                offset: meta.len,
            };
        }
        match self.free.last() {
            Some(id) => SpanRef { id: *id, offset: 0 },
            None if self.meta.len() < MAX_SPANS => SpanRef {
                id: self.meta.len() as u32,
                offset: 0,
            },
            None => SpanRef::NONE,
        }
    }

    /// Commits `span` (from [`Self::next_after`]) as taken by a newly held block.
    pub(crate) fn commit(&mut self, span: SpanRef, intact: &SpanIntact) {
        if !span.is_some() {
            return;
        }
        if span.offset == 0 {
            if self.free.last() == Some(&span.id) {
                self.free.pop();
            } else if span.id as usize == self.meta.len() {
                self.meta.push(SpanMeta::default());
            } else {
                return;
            }
            if let Some(meta) = self.meta.get_mut(span.id as usize) {
                *meta = SpanMeta::default();
            }
        }
        if let Some(meta) = self.meta.get_mut(span.id as usize) {
            meta.len = meta.len.saturating_add(1);
            meta.live = meta.live.saturating_add(1);
            // Only an intact span is extended (or a new one started): intact = len.
            intact.set(span.id, meta.len);
        }
    }

    /// A member at `span` left the index.
    pub(crate) fn left(&mut self, span: SpanRef, intact: &SpanIntact) {
        if !span.is_some() {
            return;
        }
        let Some(meta) = self.meta.get_mut(span.id as usize) else {
            return;
        };
        meta.live = meta.live.saturating_sub(1);
        if meta.live == 0 {
            *meta = SpanMeta::default();
            self.free.push(span.id);
            intact.set(span.id, 0);
            return;
        }
        let was_intact = intact.intact(span.id);
        if was_intact > u32::from(span.offset) {
            intact.set(span.id, span.offset);
        }
        // The tail left a span intact up to it (vLLM evicts leaves first): the span ends
        // there and stays intact, so a re-stored tail continues it.
        if span.offset + 1 == meta.len && was_intact >= u32::from(span.offset) {
            meta.len = span.offset;
        }
        // Whatever order a tail left in (an approximate pod's LRU evicts a segment's blocks
        // lowest first): once the members still held are exactly the intact head, the span
        // ends there, and a re-stored tail continues it.
        let now_intact = intact.intact(span.id);
        if u32::from(meta.live) == now_intact && now_intact < u32::from(meta.len) {
            meta.len = meta.live;
        }
    }

    /// Forgets every span (the pod's blocks were all dropped).
    pub(crate) fn clear(&mut self, intact: &SpanIntact) {
        for id in 0..self.meta.len() {
            intact.set(id as u32, 0);
        }
        self.meta.clear();
        self.free.clear();
    }

    /// Bytes used (for the index's memory figure).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.meta.capacity() * std::mem::size_of::<SpanMeta>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `span` is intact through its own offset.
    fn covers(intact: &SpanIntact, span: SpanRef) -> bool {
        span.is_some() && intact.intact(span.id) > u32::from(span.offset)
    }

    #[test]
    fn chunks_cover_every_id_once() {
        let mut expected = (0, 0);
        for id in 0..MAX_SPANS as u32 {
            let (chunk, at) = chunk_of(id);
            if chunk != expected.0 {
                assert_eq!(
                    (chunk, at, expected.1),
                    (expected.0 + 1, 0, FIRST_CHUNK << expected.0)
                );
                expected = (chunk, 0);
            }
            assert_eq!(at, expected.1);
            expected.1 += 1;
        }
        assert_eq!(chunk_of(MAX_SPANS as u32).0, CHUNKS);
        let intact = SpanIntact::default();
        intact.set(MAX_SPANS as u32 - 1, 3);
        assert_eq!(intact.intact(MAX_SPANS as u32 - 1), 3);
        assert_eq!(intact.intact(SpanRef::NONE.id), 0);
    }

    #[test]
    fn spans_extend_from_their_tail_and_break_on_removal() {
        let intact = SpanIntact::default();
        let mut book = SpanBook::default();
        let a0 = book.next_after(None, &intact);
        book.commit(a0, &intact);
        let a1 = book.next_after(Some(a0), &intact);
        book.commit(a1, &intact);
        let a2 = book.next_after(Some(a1), &intact);
        book.commit(a2, &intact);
        assert_eq!((a0.id, a1.id, a2.id), (0, 0, 0));
        assert_eq!((a0.offset, a1.offset, a2.offset), (0, 1, 2));
        assert_eq!(intact.intact(0), 3);
        assert!(covers(&intact, a2));
        // A branch from a1 (not the tail) starts a new span.
        let b = book.next_after(Some(a1), &intact);
        assert_eq!((b.id, b.offset), (1, 0));
        book.commit(b, &intact);
        // The tail leaving shortens an intact span, which a re-stored tail continues.
        book.left(a2, &intact);
        assert_eq!(intact.intact(0), 2);
        let again = book.next_after(Some(a1), &intact);
        assert_eq!(again, a2);
        book.commit(again, &intact);
        assert_eq!(intact.intact(0), 3);
        // Removing the middle block breaks the span after it, not before.
        book.left(a1, &intact);
        assert_eq!(intact.intact(0), 1);
        assert!(covers(&intact, a0));
        assert!(!covers(&intact, a2));
        // A broken span is not extended.
        assert_ne!(book.next_after(Some(a2), &intact).id, 0);
        // The span's id is reused once its last member leaves.
        book.left(a0, &intact);
        book.left(a2, &intact);
        assert_eq!(intact.intact(0), 0);
        assert_eq!(book.next_after(None, &intact), SpanRef { id: 0, offset: 0 });
        book.clear(&intact);
        assert_eq!(intact.intact(1), 0);
        assert!(!covers(&intact, SpanRef::NONE));
    }

    #[test]
    fn a_tail_that_left_lowest_first_can_be_restored_as_the_continuation() {
        let intact = SpanIntact::default();
        let mut book = SpanBook::default();
        let mut members = Vec::new();
        let mut previous = None;
        for _ in 0..10 {
            let span = book.next_after(previous, &intact);
            book.commit(span, &intact);
            members.push(span);
            previous = Some(span);
        }
        // An approximate pod's LRU evicts a segment's blocks lowest first: 5, 6, …, 9.
        for span in &members[5..] {
            book.left(*span, &intact);
        }
        assert_eq!(intact.intact(0), 5);
        // The span now ends at the held head: block 4's successor continues it.
        assert_eq!(book.next_after(Some(members[4]), &intact), members[5]);
        // Not while a member past a hole is still held.
        book.left(members[2], &intact);
        book.commit(book.next_after(Some(members[4]), &intact), &intact);
        assert_eq!(intact.intact(0), 2);
        assert_ne!(book.next_after(Some(members[5]), &intact).id, 0);
    }
}
