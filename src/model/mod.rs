//! The math of each algorithm, free of I/O and clocks.
//!
//! [`MemoryStore`](crate::MemoryStore) runs these functions directly; the Redis store runs a Lua
//! port of each (`src/store/redis/scripts/`), written step for step after the Rust so that the
//! two can be read side by side. Times are whole microseconds since the UNIX epoch, on the
//! store's clock.
//!
//! Every algorithm keeps state per limit and answers three questions about limit `i`:
//! does a request of `cost` fit now (and if not, after how long would it), record it, and how
//! many units are left and when the limit resets. [`decide`] combines them the same way for
//! all algorithms, which is what makes a multi-limit policy atomic: every limit admits and
//! all record, or none records.

pub(crate) mod attempts;
pub(crate) mod fixed_window;
pub(crate) mod gcra;
pub(crate) mod key_state;
pub(crate) mod line;
pub(crate) mod sliding_log;
pub(crate) mod sliding_window;
pub(crate) mod slots;
pub(crate) mod turn;

/// How a [`Policy`](crate::Policy) is decided.
///
/// | algorithm | state per key and limit | exact? |
/// |---|---|---|
/// | [`SlidingLog`](Algorithm::SlidingLog) | one entry per admitted request | exact in every window |
/// | [`SlidingWindow`](Algorithm::SlidingWindow) | two counters | approximate: weights the previous window |
/// | [`FixedWindow`](Algorithm::FixedWindow) | one counter | exact per window, bursts at edges |
/// | [`Gcra`](Algorithm::Gcra) | one timestamp | exact leaky bucket |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// An exact sliding-window log: one entry per admitted request, carrying its cost, kept for
    /// twice the longest window (event times up to a window back read a window further). Exact for every window, at a memory cost that grows with the number
    /// of requests admitted in that window (not with their cost). The only
    /// algorithm that takes event times ([`Store::check_at`](crate::Store::check_at)).
    #[default]
    SlidingLog,
    /// The sliding window counter: the count of the current fixed window plus the previous
    /// window's count weighted by how much of it the sliding window still covers. O(1) memory.
    /// It never admits more than the limit in any fixed window, and fewer than twice the limit
    /// in any sliding window.
    SlidingWindow,
    /// Fixed windows aligned to the UNIX epoch, one counter each (`INCR` + expiry). O(1)
    /// memory; up to twice the limit can pass around a window boundary.
    FixedWindow,
    /// The generic cell rate algorithm: a leaky bucket (funnel) of capacity `count` that
    /// drains `count` units per window, kept as one timestamp (the theoretical arrival time).
    /// Allows a burst of `count`, then one unit every `window / count`; the answer carries what
    /// redis-cell's `CL.THROTTLE` returns.
    Gcra,
}

impl Algorithm {
    /// How long a key's state matters after its last request, for a policy whose longest
    /// window is `longest`: twice that for the sliding window counter, whose previous window
    /// still weighs during the next one, and for the sliding log, whose events count for event
    /// times up to a window back ([`Store::check_at`](crate::Store::check_at)), each in
    /// windows reaching a window further back.
    pub(crate) fn retention(self, longest: std::time::Duration) -> std::time::Duration {
        match self {
            Algorithm::SlidingWindow | Algorithm::SlidingLog => longest * 2,
            Algorithm::FixedWindow | Algorithm::Gcra => longest,
        }
    }

    /// Whether a request can be decided at its own event time
    /// ([`Store::check_at`](crate::Store::check_at)), in any order: only the sliding log keeps
    /// the time of each request it admitted; the others fold requests into their state as they
    /// come, and a request from the past has no place in it.
    pub(crate) fn takes_event_times(self) -> bool {
        match self {
            Algorithm::SlidingLog => true,
            Algorithm::SlidingWindow | Algorithm::FixedWindow | Algorithm::Gcra => false,
        }
    }

    /// A short name, used in policy identities and store keys.
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Algorithm::SlidingLog => "log",
            Algorithm::SlidingWindow => "sw",
            Algorithm::FixedWindow => "fw",
            Algorithm::Gcra => "gcra",
        }
    }
}

/// The most units any state holds: counts, a sliding log's running totals and GCRA's backlog
/// saturate here (2^52), so that every value stays exact in the doubles of Redis' Lua (2^53),
/// and a sum of two of them too. See `docs/operations.md`, "Range".
pub(crate) const MAX_UNITS: u64 = 1 << 52;

/// The largest bucket GCRA keeps, in its units (see [`gcra`]): `count * window / scale`. A
/// request's weight stays below it, and a backlog saturated at [`MAX_UNITS`] is still at least
/// three buckets, so that a charge far over the limit keeps a key refused for at least three
/// windows.
pub(crate) const MAX_GCRA_BUCKET: u128 = 1 << 50;

/// A limit in the units the algorithms use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub count: u64,
    pub micros: u64,
    /// `gcd(count, micros)`: GCRA divides its units by it (see [`gcra`]), which keeps a
    /// monthly budget of millions of units exact in 50 bits.
    pub scale: u64,
    /// GCRA's weight of one unit of cost, `micros / scale`, and its drain per µs,
    /// `count / scale`, computed once rather than per decision.
    pub gcra: (u64, u64),
}

impl Window {
    pub(crate) fn of(limit: &crate::Limit) -> Window {
        let count = limit.count();
        Window::new(count, micros(limit.window()))
    }

    pub(crate) fn new(count: u64, micros: u64) -> Window {
        let scale = gcd(count, micros).max(1);
        Window {
            count,
            micros,
            scale,
            gcra: (micros / scale, count / scale),
        }
    }

    /// GCRA's bucket for this limit, in its units: `count * micros / scale`.
    pub(crate) fn gcra_bucket(&self) -> u128 {
        u128::from(self.count) * u128::from(self.micros) / u128::from(self.scale)
    }
}

/// `d` in whole microseconds, saturating at `u64::MAX`: the algorithms' unit of time.
pub(crate) fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The greatest common divisor (`gcd(0, b) = b`).
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while a != 0 {
        (a, b) = (b % a, a);
    }
    b
}

/// What an algorithm decided, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub allowed: bool,
    /// The limit reported: the one that denied, or the tightest one after admitting.
    pub index: usize,
    pub remaining: u64,
    pub reset_after: u64,
    /// `Some` when denied with a known wait; `None` when admitted, or when no wait helps.
    pub retry_after: Option<u64>,
}

/// A limit's answer to "does it fit?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    Yes,
    /// No; it would after this many microseconds (`None`: waiting does not help).
    No(Option<u64>),
}

/// The per-limit state of one key under one algorithm.
pub(crate) trait AlgorithmState {
    /// Does a request of `cost` at `now` fit limit `i`?
    fn fits(&self, now: u64, i: usize, w: &Window, cost: u64) -> Fit;
    /// The wait after which a request refused at `now` fits every limit at once, given
    /// `retry`, the latest of the limits' own waits: that one, where each limit only admits
    /// more as time passes (every algorithm but the log, which holds events after `now` too).
    fn joint_retry(&self, now: u64, windows: &[Window], cost: u64, retry: u64) -> u64 {
        let _ = (now, windows, cost);
        retry
    }
    /// Records an admitted request of `cost` at `now` against every limit.
    fn record(&mut self, now: u64, windows: &[Window], cost: u64);
    /// Units left in limit `i` and microseconds until it resets.
    fn report(&self, now: u64, i: usize, w: &Window) -> (u64, u64);
    /// Takes back at `now` up to `units` of the `recorded` units a request recorded at `at`
    /// (`None`: not known), from every limit, as far as they still weigh: never below what
    /// the state would be without them.
    fn refund(&mut self, now: u64, windows: &[Window], back: Refund);
    /// The earliest time a reservation at `now` may take ([`reserve`]): after every
    /// reservation made before it. `now` where the state is a queue already (GCRA).
    fn earliest(&self, now: u64) -> u64 {
        now
    }
    /// Records a reservation of `cost` decided at `now` for time `at`: at `at` where the
    /// state keeps times (the log), else as an admission at `now` that holds its place (GCRA's
    /// backlog past its capacity).
    fn reserve_at(&mut self, now: u64, at: u64, windows: &[Window], cost: u64) {
        let _ = now;
        self.record(at, windows, cost);
    }
}

/// A [`Settlement`](crate::Settlement) in the algorithms' units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Records `n` more units now, whatever the limits say.
    Charge(u64),
    /// Takes units back from a request.
    Refund(Refund),
}

/// A refund in the algorithms' units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refund {
    /// The units to take back.
    pub units: u64,
    /// When the request was recorded (µs; `None`: not known).
    pub at: Option<u64>,
    /// The units it recorded then (its entry's weight, on the sliding log).
    pub recorded: u64,
}

impl Refund {
    /// The units and the admission time, when that is known: a counter takes the units from
    /// the window that held it, and does nothing without it.
    pub(crate) fn timed(&self) -> Option<(u64, u64)> {
        self.at.map(|at| (self.units, at))
    }
}

/// Records a settlement at `now` against every limit, deciding nothing: a charge is recorded
/// as an admitted request of that cost would be, even past the limits; a refund is the
/// algorithm's own [`AlgorithmState::refund`]. The scripts' record mode 3 is the same.
pub(crate) fn settle<L: AlgorithmState>(
    state: &mut L,
    now: u64,
    windows: &[Window],
    settle: Settle,
) {
    match settle {
        Settle::Charge(0) | Settle::Refund(Refund { units: 0, .. }) => {}
        Settle::Charge(units) => state.record(now, windows, units),
        Settle::Refund(back) => state.refund(now, windows, back),
    }
}

/// Decides a request against every limit, recording it (if `record`) only when all admit.
///
/// Reported limit: when denied, the one that denies with the latest retry (a retry that no wait
/// helps counts as latest); when admitted, the one with the fewest units left. Ties go to the
/// shorter window. `scripts/common.lua` (and, written out, `gcra.lua` and
/// `sliding_log.lua`) is the same procedure.
pub(crate) fn decide<L: AlgorithmState>(
    state: &mut L,
    now: u64,
    windows: &[Window],
    cost: u64,
    record: bool,
) -> Outcome {
    let mut denied: Option<(usize, Option<u64>)> = None;
    for (i, w) in windows.iter().enumerate() {
        if let Fit::No(retry) = state.fits(now, i, w, cost) {
            let later = match (denied, retry) {
                (None, _) | (Some((_, Some(_))), None) => true,
                (Some((_, None)), _) => false,
                (Some((_, Some(a))), Some(b)) => b > a,
            };
            if later {
                denied = Some((i, retry));
            }
        }
    }
    if let Some((index, retry_after)) = denied {
        let retry_after = retry_after.map(|retry| state.joint_retry(now, windows, cost, retry));
        let (remaining, reset_after) = state.report(now, index, &windows[index]);
        return Outcome {
            allowed: false,
            index,
            remaining,
            reset_after,
            retry_after,
        };
    }
    if record {
        state.record(now, windows, cost);
    }
    let (index, (remaining, reset_after)) = windows
        .iter()
        .enumerate()
        .map(|(i, w)| (i, state.report(now, i, w)))
        .min_by_key(|(_, (remaining, _))| *remaining)
        .unwrap_or((0, (0, 0)));
    Outcome {
        allowed: true,
        index,
        remaining,
        reset_after,
        retry_after: None,
    }
}

/// `ceil(a / b)` for `b > 0`.
pub(crate) fn div_ceil(a: u128, b: u128) -> u64 {
    a.div_ceil(b).min(u64::MAX as u128) as u64
}

/// The start of the fixed window of length `w` that holds `now` (windows aligned to the epoch).
pub(crate) fn window_start(now: u64, w: u64) -> u64 {
    now - now % w
}

#[cfg(test)]
mod tests {
    use super::fixed_window::FixedWindow;
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn every_limit_admits_and_records_or_none_does_and_the_tightest_is_reported() {
        // 2 a second and 3 a minute.
        let windows = [Window::new(2, S), Window::new(3, 60 * S)];
        let mut state = FixedWindow::default();
        let first = decide(&mut state, 0, &windows, 1, true);
        assert!(first.allowed);
        assert_eq!(
            (first.index, first.remaining),
            (0, 1),
            "the second leaves 1, the minute 2"
        );
        assert!(decide(&mut state, 0, &windows, 1, true).allowed);
        // The second refuses (retry 1 s); the minute would admit, and records nothing either.
        let refused = decide(&mut state, 0, &windows, 1, true);
        assert!(!refused.allowed);
        assert_eq!((refused.index, refused.retry_after), (0, Some(S)));
        let next = decide(&mut state, S, &windows, 1, true);
        assert!(next.allowed);
        assert_eq!(
            (next.index, next.remaining),
            (1, 0),
            "the minute now has the fewest"
        );
        // Both refuse: the later retry is reported (the minute's).
        let both = decide(&mut state, S, &windows, 2, true);
        assert_eq!((both.index, both.retry_after), (1, Some(59 * S)));
        // A cost over a limit, which no wait helps, is reported over any retry: 3 is over the
        // second's count, and the minute (3 used) would admit it after 58 s.
        let never = decide(&mut state, 2 * S, &windows, 3, true);
        assert_eq!((never.index, never.retry_after), (0, None));
    }
}
