//! Sequence tracking per (pod, data-parallel rank): in order, gap, or restart.
//!
//! Why: a PUB socket silently drops messages (slow joiners, high-water marks) and an engine
//! restart silently resets its seq to 0 (DESIGN §3). The index is only true if every batch is
//! applied exactly once, in order, so every seq is classified before its batch is applied.

use std::collections::HashMap;

/// What a newly received seq means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The next expected seq.
    InOrder,
    /// Batches `from..seq` are missing (also the first seq seen when it is not 0, from 0).
    Gap {
        /// First missing seq.
        from: u64,
    },
    /// The seq went backwards (or repeated): the engine restarted and its cache is gone.
    Restart,
}

/// Last applied seq per data-parallel rank of one pod.
#[derive(Clone, Debug, Default)]
pub struct SeqTracker {
    last: HashMap<Option<i64>, u64>,
}

impl SeqTracker {
    /// Classifies `seq` for `rank` without recording it.
    pub fn classify(&self, rank: Option<i64>, seq: u64) -> SeqVerdict {
        match self.last.get(&rank) {
            None if seq == 0 => SeqVerdict::InOrder,
            None => SeqVerdict::Gap { from: 0 },
            Some(&last) if seq <= last => SeqVerdict::Restart,
            // `seq > last` here, so `last + 1` cannot overflow.
            Some(&last) if seq == last.saturating_add(1) => SeqVerdict::InOrder,
            Some(&last) => SeqVerdict::Gap {
                from: last.saturating_add(1),
            },
        }
    }

    /// Records `seq` as applied for `rank`.
    pub fn record(&mut self, rank: Option<i64>, seq: u64) {
        self.last.insert(rank, seq);
    }

    /// Marks `seq` as not applied (its batch was dropped): the next seq then shows a gap from
    /// it.
    pub fn unrecord(&mut self, rank: Option<i64>, seq: u64) {
        match seq.checked_sub(1) {
            Some(previous) => {
                self.last.insert(rank, previous);
            }
            None => {
                self.last.remove(&rank);
            }
        }
    }

    /// Forgets one rank (its publisher restarted).
    pub fn forget(&mut self, rank: Option<i64>) {
        self.last.remove(&rank);
    }

    /// Forgets every rank (after the pod's entries were cleared).
    pub fn reset(&mut self) {
        self.last.clear();
    }

    /// The last seq applied on one rank.
    pub fn last_for(&self, rank: Option<i64>) -> Option<u64> {
        self.last.get(&rank).copied()
    }

    /// The highest seq applied on any rank.
    pub fn last_seq(&self) -> Option<u64> {
        self.last.values().max().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let mut t = SeqTracker::default();
        assert_eq!(t.classify(Some(0), 5), SeqVerdict::Gap { from: 0 });
        assert_eq!(t.classify(Some(0), 0), SeqVerdict::InOrder);
        t.record(Some(0), 0);
        assert_eq!(t.classify(Some(0), 1), SeqVerdict::InOrder);
        assert_eq!(t.classify(Some(0), 4), SeqVerdict::Gap { from: 1 });
        assert_eq!(t.classify(Some(0), 0), SeqVerdict::Restart);
        // Ranks are independent.
        assert_eq!(t.classify(Some(1), 0), SeqVerdict::InOrder);
        t.record(Some(0), 7);
        t.unrecord(Some(0), 8);
        assert_eq!(t.classify(Some(0), 9), SeqVerdict::Gap { from: 8 });
        assert_eq!(t.last_seq(), Some(7));
        t.unrecord(Some(0), 0);
        assert_eq!(t.classify(Some(0), 1), SeqVerdict::Gap { from: 0 });
        // Hostile extremes do not overflow.
        t.record(None, u64::MAX);
        assert_eq!(t.classify(None, u64::MAX), SeqVerdict::Restart);
        t.record(None, u64::MAX - 1);
        assert_eq!(t.classify(None, u64::MAX), SeqVerdict::InOrder);
    }
}
