//! A seeded generator for tests that draw random steps: the same sequence in every run, so that
//! a failure is found again by running the test again.

/// A linear congruential generator (Knuth's MMIX constants), seeded by its field.
pub struct Lcg(pub u64);

impl Lcg {
    /// A number below `below` (0 when `below` is 0).
    pub fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below.max(1)
    }

    /// One of `from`, which must not be empty.
    pub fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.next(from.len() as u64) as usize]
    }
}
