//! A small deterministic generator (xorshift) for the index's randomised tests: their
//! streams are reproducible from a seed.

/// Xorshift64 state; the seed must not be 0.
pub(super) struct TestRng(pub(super) u64);

impl TestRng {
    /// The next 64 random bits.
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n` (0 when `n` is 0).
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
