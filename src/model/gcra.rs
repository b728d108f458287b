//! GCRA: the generic cell rate algorithm, i.e. a leaky bucket (funnel).
//!
//! A limit of `c` per `w` is a bucket of capacity `c` that drains one unit every
//! `T = w / c`. GCRA keeps, instead of a level, the bucket's backlog as a time: how long until
//! it is empty. To keep `T` exact, the backlog is counted in GCRA units of `g / c` µs, where
//! `g = gcd(c, w)`: a unit of cost then weighs exactly `u = w / g` of them and the bucket
//! drains `d = c / g` of them per µs, both whole numbers. Per limit the state is the time `at`
//! of the last write and the backlog `b` it left. At `now`:
//!
//! ```text
//! backlog = max(0, b - (now - at) * d)          what is still queued
//! new     = backlog + cost * u                  the backlog if admitted
//! fits   <=> new <= w * d                        the bucket holds at most c units
//! retry   = ceil((new - w * d) / d)             until enough has drained
//! remaining = floor((w * d - backlog) / u)      whole units that fit now
//! reset   = ceil(backlog / d)                   until the bucket is empty
//! ```
//!
//! So `c` requests pass at once, then one per `T`. This is what redis-cell's `CL.THROTTLE`
//! computes (limited, limit, remaining, retry-after, reset-after), with `c` as the capacity.
//!
//! Range: the bucket `w * d = c * w / g` must stay within [`MAX_GCRA_BUCKET`] (2^50), which
//! the policy checks when it is built; a monthly budget of 5 000 000 units is 2.6 * 10^12.
//! A backlog saturates at [`MAX_UNITS`] (2^52, at least three buckets), so that a charge far
//! past the limit keeps the key refused for at least three windows instead of wrapping.
//! `scripts/gcra.lua` is the same procedure; every value it computes stays below 2^53, where
//! Lua's doubles are exact.
//!
//! Other counts for the same windows ([`Policy::with_limits`](crate::Policy::with_limits)):
//! each limit's state keeps the `u` it was written under. A backlog `b` of another `u` holds
//! `b / u` units of cost, and is read as as many units under the counts at hand, rounded up
//! (`ceil(b * u' / u)`, saturating at [`MAX_UNITS`]); it then drains at their rate from the
//! last write on. A change of counts so never forgets usage, nor invents it.
//!
//! [`MAX_GCRA_BUCKET`]: super::MAX_GCRA_BUCKET
//! [`MAX_UNITS`]: super::MAX_UNITS

use super::{div_ceil, AlgorithmState, Fit, Refund, Window, MAX_UNITS};

/// Per limit: time of the last write, backlog in GCRA units, and the weight of one unit of
/// cost (`u`) of the counts it was written under.
#[derive(Debug, Default, Clone)]
pub(crate) struct Gcra {
    states: Vec<(u64, u128, u64)>,
}

/// A limit's weight of one unit of cost (`u`) and drain per µs (`d`), in GCRA units.
fn units(w: &Window) -> (u128, u128) {
    (u128::from(w.gcra.0), u128::from(w.gcra.1))
}

impl Gcra {
    fn backlog(&self, now: u64, i: usize, w: &Window) -> u128 {
        match self.states.get(i) {
            Some(&(at, b, from)) => {
                let (u, d) = units(w);
                let drained = u128::from(now.saturating_sub(at)) * d;
                reweigh(b, from, u).saturating_sub(drained)
            }
            None => 0,
        }
    }
}

/// `b` GCRA units of weight `from` per unit of cost as units of weight `to`:
/// `ceil(b * to / from)`, saturating at [`MAX_UNITS`] (`reweigh` in `scripts/exact.lua`).
fn reweigh(b: u128, from: u64, to: u128) -> u128 {
    if from == 0 || u128::from(from) == to {
        return b;
    }
    (b * to)
        .div_ceil(u128::from(from))
        .min(u128::from(MAX_UNITS))
}

impl AlgorithmState for Gcra {
    fn fits(&self, now: u64, i: usize, w: &Window, cost: u64) -> Fit {
        let (u, d) = units(w);
        let capacity = u128::from(w.micros) * d;
        let new = self.backlog(now, i, w) + u128::from(cost) * u;
        if new <= capacity {
            Fit::Yes
        } else if cost > w.count {
            Fit::No(None)
        } else {
            Fit::No(Some(div_ceil(new - capacity, d)))
        }
    }

    fn record(&mut self, now: u64, windows: &[Window], cost: u64) {
        self.states.resize(windows.len(), (0, 0, 0));
        for (i, w) in windows.iter().enumerate() {
            let new = self.backlog(now, i, w) + u128::from(cost) * units(w).0;
            self.states[i] = (self.stamp(now, i), new.min(u128::from(MAX_UNITS)), w.gcra.0);
        }
    }

    fn report(&self, now: u64, i: usize, w: &Window) -> (u64, u64) {
        let (u, d) = units(w);
        let capacity = u128::from(w.micros) * d;
        let backlog = self.backlog(now, i, w);
        let remaining = capacity.saturating_sub(backlog) / u;
        (remaining as u64, div_ceil(backlog, d))
    }

    /// Recorded now, past the capacity if need be: the backlog is the queue, and a unit
    /// recorded now that goes when the backlog has drained to fit it goes at its turn.
    fn reserve_at(&mut self, now: u64, _: u64, windows: &[Window], cost: u64) {
        self.record(now, windows, cost);
    }

    /// The units leave the backlog as far as they still weigh in it: units taken at `at` have
    /// drained for `now - at` since, so at most `units * u - (now - at) * d` of the backlog is
    /// theirs (the lease give-back, `scripts/return.lua`, takes the same). Without `at`,
    /// nothing changes: what still weighs cannot be known.
    fn refund(&mut self, now: u64, windows: &[Window], back: Refund) {
        let Some(at) = back.at else { return };
        if self.states.len() != windows.len() {
            return;
        }
        for (i, w) in windows.iter().enumerate() {
            let (u, d) = units(w);
            let weight =
                (u128::from(back.units) * u).saturating_sub(u128::from(now.saturating_sub(at)) * d);
            let left = self.backlog(now, i, w);
            self.states[i] = (self.stamp(now, i), left.saturating_sub(weight), w.gcra.0);
        }
    }
}

impl Gcra {
    /// The time limit `i`'s backlog is written at, when it is written `now`: a backlog stamped
    /// later (a reservation made for the end of a pause) has not drained at all by `now`, and
    /// keeps its time, so that it drains from there and not from `now`.
    fn stamp(&self, now: u64, i: usize) -> u64 {
        self.states.get(i).map_or(now, |&(at, _, _)| at.max(now))
    }

    /// Microseconds from `now` until every bucket is empty: how long the state matters, which
    /// a charge can make longer than the longest window.
    pub(crate) fn drained_in(&self, now: u64, windows: &[Window]) -> u64 {
        windows
            .iter()
            .enumerate()
            .map(|(i, w)| div_ceil(self.backlog(now, i, w), units(w).1))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::decide;

    #[test]
    fn burst_then_steady_rate() {
        // 3 per second: a burst of 3, then one every 333 333.3 µs.
        let w = [Window::new(3, 1_000_000)];
        let mut s = Gcra::default();
        for left in [2, 1, 0] {
            let d = decide(&mut s, 0, &w, 1, true);
            assert!(d.allowed);
            assert_eq!(d.remaining, left);
        }
        let d = decide(&mut s, 0, &w, 1, true);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(333_334));
        assert_eq!(d.reset_after, 1_000_000);
        assert!(!decide(&mut s, 333_333, &w, 1, true).allowed);
        assert!(decide(&mut s, 333_334, &w, 1, true).allowed);
        assert_eq!(decide(&mut s, 333_334, &w, 4, true).retry_after, None);
    }

    #[test]
    fn settles_by_moving_the_theoretical_arrival_time() {
        use crate::model::{settle, Refund, Settle};
        // 1000 per minute: T = 60 ms.
        let w = [Window::new(1000, 60_000_000)];
        let mut s = Gcra::default();
        assert!(decide(&mut s, 0, &w, 1, true).allowed);
        settle(&mut s, 0, &w, Settle::Charge(499));
        assert_eq!(decide(&mut s, 0, &w, 1, true).remaining, 1000 - 500 - 1);
        settle(&mut s, 0, &w, Settle::Charge(499));
        // Full: the next unit fits once one has drained.
        let d = decide(&mut s, 0, &w, 1, true);
        assert_eq!((d.allowed, d.retry_after), (false, Some(60_000)));
        // A charge past the bucket's capacity: TAT = max(TAT, now) + n * T, drained in time.
        settle(&mut s, 0, &w, Settle::Charge(1000));
        assert_eq!(s.drained_in(0, &w), 120_000_000);
        let d = decide(&mut s, 0, &w, 1, true);
        assert_eq!(d.retry_after, Some(60_000_000 + 60_000));
        // A refund of units taken now: TAT = max(TAT - n * T, now).
        settle(
            &mut s,
            0,
            &w,
            Settle::Refund(Refund {
                units: 1500,
                at: Some(0),
                recorded: u64::MAX,
            }),
        );
        assert_eq!(decide(&mut s, 0, &w, 1, false).remaining, 500);
        settle(
            &mut s,
            60_000,
            &w,
            Settle::Refund(Refund {
                units: 10_000,
                at: Some(0),
                recorded: u64::MAX,
            }),
        );
        assert_eq!(s.drained_in(60_000, &w), 0);
        assert_eq!(decide(&mut s, 60_000, &w, 1, false).remaining, 1000);
    }

    #[test]
    fn a_late_refund_frees_only_what_still_weighs() {
        use crate::model::{settle, Refund, Settle};
        const S: u64 = 1_000_000;
        let w = [Window::new(100, 10 * S)];
        let mut s = Gcra::default();
        // A reserves 100 at 0; by 20 s they have drained; B uses 100 at 20 s.
        assert!(decide(&mut s, 0, &w, 100, true).allowed);
        assert!(decide(&mut s, 20 * S, &w, 100, true).allowed);
        let late = Settle::Refund(Refund {
            units: 100,
            at: Some(0),
            recorded: u64::MAX,
        });
        settle(&mut s, 20 * S, &w, late);
        assert!(!decide(&mut s, 20 * S, &w, 100, false).allowed);
        // Half drained: half of A's units still weigh, and only those leave.
        let mut s = Gcra::default();
        assert!(decide(&mut s, 0, &w, 100, true).allowed);
        settle(&mut s, 5 * S, &w, late);
        assert_eq!(decide(&mut s, 5 * S, &w, 1, false).remaining, 100);
        let mut s = Gcra::default();
        assert!(decide(&mut s, 0, &w, 60, true).allowed);
        assert!(decide(&mut s, 2 * S, &w, 40, true).allowed);
        let back = |at| {
            Settle::Refund(Refund {
                units: 60,
                at,
                recorded: 60,
            })
        };
        settle(&mut s, 5 * S, &w, back(Some(0)));
        // Backlog at 5 s: 100 - 50 drained = 50 units; A's 60 weigh 10 of them at most.
        assert_eq!(decide(&mut s, 5 * S, &w, 1, false).remaining, 60);
        // Without the admission time, nothing.
        settle(&mut s, 5 * S, &w, back(None));
        assert_eq!(decide(&mut s, 5 * S, &w, 1, false).remaining, 60);
    }

    #[test]
    fn a_monthly_budget_neither_wraps_nor_leaks() {
        use crate::model::{settle, Settle, MAX_GCRA_BUCKET};
        // 5 000 000 per 30 days, spent 1 000 000 at a time: five pass.
        let month = 30 * 86_400 * 1_000_000;
        let w = [Window::new(5_000_000, month)];
        assert!(w[0].gcra_bucket() <= MAX_GCRA_BUCKET);
        let mut s = Gcra::default();
        let admitted = (0..7)
            .filter(|_| decide(&mut s, 1_000, &w, 1_000_000, true).allowed)
            .count();
        assert_eq!(admitted, 5);
        let d = decide(&mut s, 1_000, &w, 1, false);
        assert_eq!((d.remaining, d.retry_after), (0, Some(518_400)));
        // The largest charge saturates: refused for at least three windows, never wrapped.
        settle(&mut s, 1_000, &w, Settle::Charge(u64::MAX));
        assert!(!decide(&mut s, 1_000 + 3 * month, &w, 1, false).allowed);
        assert!(decide(&mut s, 1_000 + 4000 * month, &w, 1, false).allowed);
    }

    /// A leaky bucket of capacity `c` draining one unit per `w / c` admits a request at `t`
    /// iff, for every earlier admission time `s` (and `s = t`), the units admitted in `[s, t]`
    /// with this one drain within `(t - s) + w`: `units * w <= c * (t - s + w)`. This checks
    /// that condition over the whole history, independently of the algorithm's state.
    fn reference(history: &[(u64, u64)], t: u64, w: &Window, cost: u64) -> (bool, Option<u64>) {
        let (c, wu) = (u128::from(w.count), u128::from(w.micros));
        let mut wait: u128 = 0;
        let starts = history.iter().map(|&(s, _)| s).chain([t]);
        for s in starts {
            let units: u128 = history
                .iter()
                .filter(|&&(e, _)| e >= s)
                .map(|&(_, k)| u128::from(k))
                .sum::<u128>()
                + u128::from(cost);
            // Smallest d with units * w <= c * (t + d - s + w).
            let need = (units * wu).div_ceil(c);
            let have = u128::from(t - s) + wu;
            wait = wait.max(need.saturating_sub(have));
        }
        if cost > w.count {
            return (false, None);
        }
        (wait == 0, (wait > 0).then_some(wait as u64))
    }

    proptest::proptest! {
        #[test]
        fn agrees_with_the_leaky_bucket_definition(
            count in 1u64..8,
            window_ms in 1u64..30,
            steps in proptest::collection::vec((0u64..400_000, 0u64..4), 1..80),
        ) {
            let w = Window::new(count, window_ms * 100_000);
            let (mut state, mut history, mut now) = (Gcra::default(), vec![], 0u64);
            for (gap, cost) in steps {
                now += gap;
                let got = decide(&mut state, now, &[w], cost, true);
                let (allowed, retry) = reference(&history, now, &w, cost);
                proptest::prop_assert_eq!(got.allowed, allowed, "at {}", now);
                if allowed {
                    history.push((now, cost));
                } else {
                    proptest::prop_assert_eq!(got.retry_after, retry, "at {}", now);
                }
            }
        }
    }
}
