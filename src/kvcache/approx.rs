//! Approximate holdings of a pod without KV events, learned from kvpick's own routing: every
//! request routed there is assumed cached, least recently used blocks first out when the pod's
//! capacity (in blocks) is exceeded.
//!
//! Why LRU and tail-first: vLLM evicts free blocks in LRU order and frees a request's blocks
//! tail first; touching a request's blocks from last to first makes its first blocks the most
//! recent, so the model forgets prefixes from the tail like the engine does. The order is
//! therefore (touch, block index descending): every block of a later touch is more recent
//! than every block of an earlier one, and within one touch a lower block is more recent.
//!
//! # Why segments, not a tick per block
//! A warm request repeats most of an earlier request's blocks (a shared system prompt, a
//! growing conversation); re-ticking each of them cost ~0.5 µs a block, 3 ms for a 400 KB
//! prompt. Instead the set keeps *runs* (the keys one touch added, consecutive blocks of one
//! prompt, stored once) cut into *segments* (a stretch of one run's blocks last touched by the
//! same touch), and a touch re-ticks whole segments: its cost is O(log) per segment it
//! crosses plus O(1) per block it adds or evicts.
//!
//! Why that is exact: keys are chained (block `i`'s key depends on every token before it), so
//! a key sits at the same block index in every prompt that has it, and two prompts sharing
//! block `i`'s key share every block before it. A touch covers a prompt from block 0, so the
//! blocks of one prompt the set holds are always a prefix of it, and the blocks a touch
//! shares with a run are a prefix of the run's segment it enters: one comparison at the end
//! of a stretch (our key against the run's key at that block) proves the whole stretch.
//!
//! NOTE: two different prompts' keys colliding (64-bit chained hashes) can make a block be
//! skipped or a run keep an evicted key's slot until the run empties (memory stays bounded by
//! the keys the runs were created with), and, as a collision in the block map can, make a
//! routing record continue the colliding block's span, so a walk may credit blocks the pod
//! was never sent: odds of 2⁻⁶⁴ per pair of keys, the same as any keyed prefix match.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use super::key::{BlockKey, PrehashedState};

/// Where a key is held: its run and its block index in the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    run: u32,
    block: u32,
}

/// A stretch of one run's blocks `lo..=hi`, all last touched by `touch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    lo: u32,
    hi: u32,
    touch: u64,
}

/// The keys one touch added: blocks `base..base + keys.len()` of its prompt.
#[derive(Debug, Default)]
struct Run {
    base: u32,
    keys: Vec<BlockKey>,
    /// Disjoint, sorted by `lo`; together they cover exactly the run's held blocks.
    segments: Vec<Segment>,
    /// Keys of this run still held.
    live: u32,
}

impl Run {
    fn key(&self, block: u32) -> Option<BlockKey> {
        self.keys
            .get(block.checked_sub(self.base)? as usize)
            .copied()
    }

    /// Index in `segments` of the segment holding `block`.
    fn segment_of(&self, block: u32) -> Option<usize> {
        let at = self.segments.partition_point(|s| s.lo <= block);
        let i = at.checked_sub(1)?;
        (self.segments.get(i)?.hi >= block).then_some(i)
    }
}

/// Eviction order key of a segment: oldest touch first, then its highest block first.
fn order_key(touch: u64, hi: u32) -> (u64, u32) {
    (touch, u32::MAX - hi)
}

/// A bounded LRU set of block keys.
#[derive(Default)]
pub(crate) struct LruBlocks {
    at: HashMap<BlockKey, Place, PrehashedState>,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    /// Every segment, in eviction order → its run.
    order: BTreeMap<(u64, u32), u32>,
    next_touch: u64,
    /// Keys compared, probed, added or evicted by touches (what a touch costs; for tests).
    #[cfg(test)]
    pub(crate) work: usize,
}

impl LruBlocks {
    /// Touches `keys`, a prompt's keys from block 0 (last to first); returns the keys newly
    /// added and those evicted to stay within `capacity`.
    #[cfg(test)]
    pub(crate) fn touch(
        &mut self,
        keys: &[BlockKey],
        capacity: usize,
    ) -> (Vec<BlockKey>, Vec<BlockKey>) {
        let (added, evicted) = self.touch_stretches(keys, capacity);
        let added = added
            .into_iter()
            .flat_map(|stretch| keys.get(stretch).unwrap_or_default())
            .copied()
            .collect();
        (added, evicted)
    }

    /// [`Self::touch`], returning the added keys as the stretches of `keys` they fill, in
    /// order (normally one: the prompt's new tail), so a caller knows each one's predecessor.
    pub(crate) fn touch_stretches(
        &mut self,
        keys: &[BlockKey],
        capacity: usize,
    ) -> (Vec<Range<usize>>, Vec<BlockKey>) {
        self.next_touch += 1;
        let touch = self.next_touch;
        let mut added = Vec::new();
        let n = keys.len().min(u32::MAX as usize) as u32;
        let mut i = 0u32;
        while i < n {
            let Some(key) = keys.get(i as usize).copied() else {
                break;
            };
            self.count(1);
            match self.at.get(&key).copied() {
                Some(place) if place.block == i => {
                    i = self.retouch(keys, place.run, i, n, touch) + 1;
                }
                // A collision (see the module docs): the key stays where it is.
                Some(_) => i += 1,
                None => {
                    // A stretch of new keys (the rest of the prompt, normally): one new run.
                    let mut end = i + 1;
                    while end < n
                        && let Some(next) = keys.get(end as usize)
                        && !self.at.contains_key(next)
                    {
                        end += 1;
                    }
                    let stretch = keys.get(i as usize..end as usize).unwrap_or_default();
                    self.add_run(stretch, i, touch, &mut added);
                    i = end;
                }
            }
        }
        let evicted = self.evict(capacity);
        (added, evicted)
    }

    #[cfg(test)]
    fn count(&mut self, n: usize) {
        self.work += n;
    }

    #[cfg(not(test))]
    fn count(&mut self, _: usize) {}

    /// Re-ticks the stretch from block `i` (held by `run`) that `keys` share with the run's
    /// segment; returns the last block of the stretch.
    fn retouch(&mut self, keys: &[BlockKey], run: u32, i: u32, n: u32, touch: u64) -> u32 {
        let Some(r) = self.runs.get(run as usize) else {
            return i;
        };
        let Some(s) = r.segment_of(i) else {
            return i;
        };
        let segment = r.segments[s];
        // The largest j in i..=limit with keys[j] == the run's key at j (true at i; once
        // false, false after: chained keys).
        let limit = segment.hi.min(n - 1);
        let same = |j: u32| keys.get(j as usize).copied() == r.key(j);
        let mut comparisons = 1;
        let j = if same(limit) {
            limit
        } else {
            let (mut yes, mut no) = (i, limit);
            while no - yes > 1 {
                let mid = yes + (no - yes) / 2;
                comparisons += 1;
                if same(mid) {
                    yes = mid;
                } else {
                    no = mid;
                }
            }
            yes
        };
        self.count(comparisons);
        if segment.touch == touch {
            return j;
        }
        self.split(run, s, i, j, touch);
        j
    }

    /// Moves blocks `i..=j` of segment `s` of `run` into `touch`.
    fn split(&mut self, run: u32, s: usize, i: u32, j: u32, touch: u64) {
        let Some(r) = self.runs.get_mut(run as usize) else {
            return;
        };
        let old = r.segments[s];
        self.order.remove(&order_key(old.touch, old.hi));
        let mut pieces = Vec::with_capacity(3);
        if old.lo < i {
            pieces.push(Segment {
                lo: old.lo,
                hi: i - 1,
                touch: old.touch,
            });
        }
        // Joined to the segment before it when that one is this touch's too (a run crossed
        // by one touch over several of its segments stays one segment).
        let mut moved = Segment {
            lo: i,
            hi: j,
            touch,
        };
        let mut first = s;
        if pieces.is_empty()
            && let Some(before) = s.checked_sub(1)
            && let Some(prev) = r.segments.get(before).copied()
            && prev.touch == touch
            && prev.hi + 1 == i
        {
            self.order.remove(&order_key(prev.touch, prev.hi));
            moved.lo = prev.lo;
            first = before;
        }
        pieces.push(moved);
        if j < old.hi {
            pieces.push(Segment {
                lo: j + 1,
                hi: old.hi,
                touch: old.touch,
            });
        }
        for piece in &pieces {
            self.order.insert(order_key(piece.touch, piece.hi), run);
        }
        r.segments.splice(first..=s, pieces);
    }

    fn new_run(&mut self, base: u32) -> u32 {
        let run = Run {
            base,
            ..Run::default()
        };
        match self.free_runs.pop() {
            Some(id) => {
                if let Some(slot) = self.runs.get_mut(id as usize) {
                    *slot = run;
                }
                id
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Adds `keys` (blocks `base..`, none of them held) as a new run of `touch`.
    fn add_run(&mut self, keys: &[BlockKey], base: u32, touch: u64, added: &mut Vec<Range<usize>>) {
        let Some(last) = keys.len().checked_sub(1) else {
            return;
        };
        let hi = base + last as u32;
        let run = self.new_run(base);
        let Some(r) = self.runs.get_mut(run as usize) else {
            return;
        };
        r.keys.extend_from_slice(keys);
        r.live = keys.len() as u32;
        r.segments.push(Segment {
            lo: base,
            hi,
            touch,
        });
        self.order.insert(order_key(touch, hi), run);
        for (block, key) in (base..).zip(keys) {
            self.at.insert(*key, Place { run, block });
        }
        added.push(base as usize..base as usize + keys.len());
        self.count(keys.len());
    }

    /// Evicts least recent keys until at most `capacity` are held.
    fn evict(&mut self, capacity: usize) -> Vec<BlockKey> {
        let mut evicted = Vec::new();
        while self.at.len() > capacity {
            let excess = self.at.len() - capacity;
            let Some(((touch, rev), run)) = self.order.pop_first() else {
                break;
            };
            let hi = u32::MAX - rev;
            let Some(r) = self.runs.get_mut(run as usize) else {
                continue;
            };
            let Some(s) = r.segment_of(hi) else {
                continue;
            };
            let segment = r.segments[s];
            // The segment's top blocks, at most the excess.
            let take = (segment.hi - segment.lo + 1).min(excess.min(u32::MAX as usize) as u32);
            let new_hi = segment.hi + 1 - take;
            for block in new_hi..=segment.hi {
                if let Some(key) = r.key(block)
                    && self.at.get(&key) == Some(&Place { run, block })
                {
                    self.at.remove(&key);
                    evicted.push(key);
                    r.live = r.live.saturating_sub(1);
                }
            }
            if new_hi == segment.lo {
                r.segments.remove(s);
            } else {
                r.segments[s].hi = new_hi - 1;
                self.order.insert(order_key(touch, new_hi - 1), run);
            }
            // The run's top went (the usual case): its storage shrinks with it.
            let top = r.segments.last().map_or(r.base, |last| last.hi + 1);
            r.keys.truncate((top - r.base) as usize);
            if r.keys.capacity() > 2 * r.keys.len() + 64 {
                r.keys.shrink_to_fit();
            }
            if r.live == 0 || r.segments.is_empty() {
                self.free_run(run, &mut evicted);
            }
        }
        #[cfg(test)]
        {
            self.work += evicted.len();
        }
        evicted
    }

    /// Frees an emptied run (any key still placed in it goes to `evicted`).
    fn free_run(&mut self, run: u32, evicted: &mut Vec<BlockKey>) {
        if let Some(r) = self.runs.get_mut(run as usize) {
            for segment in r.segments.drain(..) {
                self.order.remove(&order_key(segment.touch, segment.hi));
            }
            for block in r.base..r.base + r.keys.len() as u32 {
                if let Some(key) = r.key(block)
                    && self.at.get(&key) == Some(&Place { run, block })
                {
                    self.at.remove(&key);
                    evicted.push(key);
                }
            }
            *r = Run::default();
            self.free_runs.push(run);
        }
    }

    /// Keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.at.len()
    }

    /// Empties the set, returning its keys.
    pub(crate) fn drain(&mut self) -> Vec<BlockKey> {
        self.order.clear();
        self.runs.clear();
        self.free_runs.clear();
        self.at.drain().map(|(key, _)| key).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The LRU as it was before segments: one tick per block (the reference).
    #[derive(Default)]
    struct PerBlock {
        tick_of: HashMap<BlockKey, u64>,
        by_tick: BTreeMap<u64, BlockKey>,
        next_tick: u64,
    }

    impl PerBlock {
        fn touch(&mut self, keys: &[BlockKey], capacity: usize) -> (Vec<BlockKey>, Vec<BlockKey>) {
            let mut added = Vec::new();
            for key in keys.iter().rev() {
                self.next_tick += 1;
                match self.tick_of.insert(*key, self.next_tick) {
                    Some(old) => {
                        self.by_tick.remove(&old);
                    }
                    None => added.push(*key),
                }
                self.by_tick.insert(self.next_tick, *key);
            }
            let mut evicted = Vec::new();
            while self.tick_of.len() > capacity {
                let Some((_, key)) = self.by_tick.pop_first() else {
                    break;
                };
                self.tick_of.remove(&key);
                evicted.push(key);
            }
            (added, evicted)
        }
    }

    /// Chained keys of a prompt given as its blocks' "tokens" (one u64 a block).
    fn chain(blocks: &[u64]) -> Vec<BlockKey> {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        blocks
            .iter()
            .map(|b| {
                h = (h ^ b).wrapping_mul(0x1000_0000_01b3).rotate_left(29) ^ 0x9e37_79b9;
                BlockKey(h)
            })
            .collect()
    }

    fn sorted(mut keys: Vec<BlockKey>) -> Vec<BlockKey> {
        keys.sort_by_key(|k| k.0);
        keys
    }

    /// A small deterministic generator (xorshift).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    #[test]
    fn segments_evict_exactly_like_a_tick_per_block() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let capacity = 5 + rng.below(120) as usize;
            let (mut segments, mut reference) = (LruBlocks::default(), PerBlock::default());
            // Prompts that share prefixes: new ones extend, cut or fork earlier ones.
            let mut prompts: Vec<Vec<u64>> = vec![vec![]];
            for step in 0..300 {
                let base = prompts[rng.below(prompts.len() as u64) as usize].clone();
                let keep = rng.below(base.len() as u64 + 1) as usize;
                let mut prompt = base[..keep].to_vec();
                for _ in 0..rng.below(40) {
                    prompt.push(rng.next());
                }
                if rng.below(3) == 0 {
                    prompt = base.clone(); // the same prompt again
                }
                let capacity = if step % 97 == 96 {
                    capacity / 2
                } else {
                    capacity
                };
                let keys = chain(&prompt);
                let (a, e) = segments.touch(&keys, capacity);
                let (ra, re) = reference.touch(&keys, capacity);
                assert_eq!(sorted(a), sorted(ra), "seed {seed} step {step}: added");
                assert_eq!(sorted(e), sorted(re), "seed {seed} step {step}: evicted");
                assert_eq!(segments.len(), reference.tick_of.len());
                prompts.push(prompt);
                if prompts.len() > 12 {
                    prompts.remove(rng.below(12) as usize);
                }
            }
            let held: HashSet<BlockKey> = segments.drain().into_iter().collect();
            let expected: HashSet<BlockKey> = reference.tick_of.keys().copied().collect();
            assert_eq!(held, expected, "seed {seed}");
        }
    }

    #[test]
    fn a_warm_touch_costs_the_new_tail_not_the_prompt() {
        // 6,250 blocks (a 400 KB prompt), 95% shared with the previous request.
        let mut rng = Rng(7);
        let bundle: Vec<u64> = (0..5_937).map(|_| rng.next()).collect();
        let mut lru = LruBlocks::default();
        let capacity = 16_384;
        let prompt = |rng: &mut Rng| {
            let mut p = bundle.clone();
            p.extend((0..313).map(|_| rng.next()));
            chain(&p)
        };
        let first = prompt(&mut rng);
        let (added, _) = lru.touch(&first, capacity);
        assert_eq!(added.len(), 6_250);
        for _ in 0..20 {
            let keys = prompt(&mut rng);
            lru.work = 0;
            let (added, evicted) = lru.touch(&keys, capacity);
            assert_eq!(added.len(), 313);
            // The new tail, what it evicts, and a few comparisons per segment crossed.
            assert!(
                lru.work <= 3 * (added.len() + evicted.len()) + 64,
                "work {} for {} added, {} evicted",
                lru.work,
                added.len(),
                evicted.len()
            );
        }
        // The bundle stayed the most recent part: a capacity cut keeps it and drops tails.
        let (_, evicted) = lru.touch(&[], 5_937);
        let evicted: HashSet<BlockKey> = evicted.into_iter().collect();
        assert!(chain(&bundle).iter().all(|k| !evicted.contains(k)));
        assert_eq!(lru.len(), 5_937);
    }
}
