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
//! NOTE: two different prompts' keys colliding (64-bit chained hashes) can make a key be held
//! twice, in two runs (the block map counts a pod's references to a key, so the pod holds it
//! until both go; `held` counts both, so memory stays bounded by the capacity), and, as a
//! collision in the block map can, make a routing record continue the colliding block's span,
//! so a walk may credit blocks the pod was never sent: odds of 2⁻⁶⁴ per pair of keys, the same
//! as any keyed prefix match.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use super::key::{BlockKey, PrehashedState};

/// A stretch of one run's blocks `lo..=hi`, all last touched by `touch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    lo: u32,
    hi: u32,
    touch: u64,
}

/// The keys one touch added: blocks `base..base + keys.len()` of its prompt.
///
/// A run holds a prefix of its keys (its blocks are evicted tail first, and a touch that
/// re-ticks some of them re-ticks them from `base`), so `keys` is cut back to the held ones
/// and the run is held exactly while its first key is.
#[derive(Debug, Default)]
struct Run {
    base: u32,
    keys: Vec<BlockKey>,
    /// Disjoint, sorted by `lo`, contiguous from `base`; together they cover exactly the
    /// run's held blocks.
    segments: Vec<Segment>,
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

    /// Whether the run holds `key` at `block`.
    fn holds(&self, block: u32, key: BlockKey) -> bool {
        self.key(block) == Some(key) && self.segment_of(block).is_some()
    }
}

/// Eviction order key of a segment: oldest touch first, then its highest block first.
fn order_key(touch: u64, hi: u32) -> (u64, u32) {
    (touch, u32::MAX - hi)
}

/// A bounded LRU set of block keys.
///
/// # Why runs are found by their first key only
/// A touch walks its prompt from block 0. While it stays in one run, the run itself says
/// whether it holds the next block (its key at that index). Where it leaves the run (the
/// prompt forks, or the run ends), the next block can only be held as the *first* block of
/// another run: a run holding it further in would hold the block before it too, which the
/// walk's run already holds, and the set holds each key once. And where no run holds a
/// block, none holds a later one (a prompt's held blocks are a prefix of it). So the set
/// needs one hash entry per run, not per block, and a record's random memory accesses per
/// block added or evicted are the block map's alone.
#[derive(Default)]
pub(crate) struct LruBlocks {
    /// Each run's first key → the run.
    starts: HashMap<BlockKey, u32, PrehashedState>,
    /// Keys held (the runs' segments' blocks).
    held: usize,
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
    /// order (at most one: the prompt's new tail), so a caller knows each one's predecessor.
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
        // The run holding block `i - 1`.
        let mut current: Option<u32> = None;
        while i < n {
            let Some(key) = keys.get(i as usize).copied() else {
                break;
            };
            self.count(1);
            let runs = &self.runs;
            let run_of = |run: u32| runs.get(run as usize);
            let holder = current
                .filter(|run| run_of(*run).is_some_and(|r| r.holds(i, key)))
                .or_else(|| {
                    // A run found by a key colliding with its first one (see the module
                    // docs) starts elsewhere: it does not hold this block.
                    self.starts
                        .get(&key)
                        .copied()
                        .filter(|run| run_of(*run).is_some_and(|r| r.base == i))
                });
            match holder {
                Some(run) => {
                    i = self.retouch(keys, run, i, n, touch) + 1;
                    current = Some(run);
                }
                None => {
                    // Nothing holds block `i`, so nothing holds a later one: the rest of the
                    // prompt is one new run.
                    let stretch = keys.get(i as usize..n as usize).unwrap_or_default();
                    self.add_run(stretch, i, touch, &mut added);
                    break;
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
        let (Some(first), Some(last)) = (keys.first().copied(), keys.len().checked_sub(1)) else {
            return;
        };
        let hi = base + last as u32;
        let run = self.new_run(base);
        let Some(r) = self.runs.get_mut(run as usize) else {
            return;
        };
        r.keys.extend_from_slice(keys);
        r.segments.push(Segment {
            lo: base,
            hi,
            touch,
        });
        self.order.insert(order_key(touch, hi), run);
        // NOTE: a first key colliding with another run's keeps the older run findable; the
        // new one is then only evicted, never re-ticked (odds of 2⁻⁶⁴, module docs).
        self.starts.entry(first).or_insert(run);
        self.held += keys.len();
        added.push(base as usize..base as usize + keys.len());
        self.count(keys.len());
    }

    /// Evicts least recent keys until at most `capacity` are held.
    fn evict(&mut self, capacity: usize) -> Vec<BlockKey> {
        let mut evicted = Vec::new();
        while self.held > capacity {
            let excess = self.held - capacity;
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
            let from = (new_hi - r.base) as usize;
            let to = (segment.hi - r.base) as usize + 1;
            evicted.extend_from_slice(r.keys.get(from..to).unwrap_or_default());
            self.held = self.held.saturating_sub(take as usize);
            if new_hi == segment.lo {
                r.segments.remove(s);
            } else {
                r.segments[s].hi = new_hi - 1;
                self.order.insert(order_key(touch, new_hi - 1), run);
            }
            if r.segments.is_empty() {
                self.free_run(run, &mut evicted);
                continue;
            }
            // The run's top went (the usual case): its storage shrinks with it.
            let top = r.segments.last().map_or(r.base, |last| last.hi + 1);
            r.keys.truncate((top - r.base) as usize);
            if r.keys.capacity() > 2 * r.keys.len() + 64 {
                r.keys.shrink_to_fit();
            }
        }
        #[cfg(test)]
        {
            self.work += evicted.len();
        }
        evicted
    }

    /// Frees `run` (any block it still holds goes to `evicted`).
    fn free_run(&mut self, run: u32, evicted: &mut Vec<BlockKey>) {
        let Some(r) = self.runs.get_mut(run as usize) else {
            return;
        };
        for segment in r.segments.drain(..) {
            self.order.remove(&order_key(segment.touch, segment.hi));
            let from = (segment.lo - r.base) as usize;
            let to = (segment.hi - r.base) as usize + 1;
            let keys = r.keys.get(from..to).unwrap_or_default();
            self.held = self.held.saturating_sub(keys.len());
            evicted.extend_from_slice(keys);
        }
        if let Some(first) = r.keys.first()
            && self.starts.get(first) == Some(&run)
        {
            self.starts.remove(first);
        }
        *r = Run::default();
        self.free_runs.push(run);
    }

    /// Keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held
    }

    /// Empties the set, returning its keys.
    pub(crate) fn drain(&mut self) -> Vec<BlockKey> {
        let mut keys = Vec::with_capacity(self.held);
        for r in self.runs.drain(..) {
            for segment in &r.segments {
                let from = (segment.lo - r.base) as usize;
                let to = (segment.hi - r.base) as usize + 1;
                keys.extend_from_slice(r.keys.get(from..to).unwrap_or_default());
            }
        }
        self.order.clear();
        self.free_runs.clear();
        self.starts.clear();
        self.held = 0;
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvcache::test_rng::TestRng as Rng;
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

    #[test]
    fn segments_evict_exactly_like_a_tick_per_block() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let capacity = 5 + rng.below(120);
            let (mut segments, mut reference) = (LruBlocks::default(), PerBlock::default());
            // Prompts that share prefixes: new ones extend, cut or fork earlier ones.
            let mut prompts: Vec<Vec<u64>> = vec![vec![]];
            for step in 0..300 {
                let base = prompts[rng.below(prompts.len())].clone();
                let keep = rng.below(base.len() + 1);
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
                    prompts.remove(rng.below(12));
                }
            }
            let held: HashSet<BlockKey> = segments.drain().into_iter().collect();
            let expected: HashSet<BlockKey> = reference.tick_of.keys().copied().collect();
            assert_eq!(held, expected, "seed {seed}");
        }
    }

    #[test]
    fn colliding_keys_are_held_twice_and_still_bounded() {
        let k = |n: u64| BlockKey(n);
        let mut lru = LruBlocks::default();
        lru.touch(&[k(1), k(2), k(3)], 100);
        // Block 1 of this prompt collides with the first run's first key, and its first key
        // with the first run's block 2.
        let (added, evicted) = lru.touch(&[k(3), k(1), k(5)], 100);
        assert_eq!(added, vec![k(3), k(1), k(5)]);
        assert!(evicted.is_empty());
        assert_eq!(lru.len(), 6);
        // Both prompts are re-ticked, not added again.
        assert_eq!(lru.touch(&[k(1), k(2), k(3)], 100).0, vec![]);
        assert_eq!(lru.touch(&[k(3), k(1), k(5)], 100).0, vec![]);
        // A capacity cut evicts every copy, least recent first (the first prompt's tail).
        let (_, evicted) = lru.touch(&[], 2);
        assert_eq!(sorted(evicted), vec![k(1), k(2), k(3), k(5)]);
        let (_, evicted) = lru.touch(&[], 0);
        assert_eq!(sorted(evicted), vec![k(1), k(3)]);
        assert_eq!(lru.len(), 0);
        assert!(lru.drain().is_empty());
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
