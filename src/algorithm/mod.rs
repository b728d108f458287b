//! The math of each algorithm, free of I/O and clocks.
//!
//! [`MemoryStore`](crate::MemoryStore) runs these functions directly; the Redis store runs a Lua
//! port of each (`src/store/redis/scripts/`), written step for step after the Rust so that the
//! two can be read side by side. Times are whole microseconds on the store's clock.

pub(crate) mod sliding_log;

/// How a [`Policy`](crate::Policy) is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// An exact sliding-window log: one entry per admitted unit of cost, kept for the longest
    /// window. Exact for every window, at a memory cost that grows with the limit.
    #[default]
    SlidingLog,
}

/// A limit in the units the algorithms use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub count: u64,
    pub micros: u64,
}

impl Window {
    pub(crate) fn of(policy: &crate::Policy) -> impl Iterator<Item = Window> + '_ {
        policy.limits().iter().map(|l| Window {
            count: l.count(),
            micros: l.window().as_micros().min(u64::MAX as u128) as u64,
        })
    }
}

/// What an algorithm decided, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub allowed: bool,
    /// The limit reported: the one that denied, or the tightest one after admitting.
    pub index: usize,
    pub remaining: u64,
    pub reset_after: u64,
    /// `Some` when denied; `None` when denied because the cost exceeds the limit itself.
    pub retry_after: Option<u64>,
}
