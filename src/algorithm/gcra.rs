//! GCRA: the generic cell rate algorithm, i.e. a leaky bucket (funnel).
//!
//! A limit of `c` per `w` is a bucket of capacity `c` that drains one unit every
//! `T = w / c`. GCRA keeps, instead of a level, the bucket's backlog as a time: how long until
//! it is empty. To keep `T` exact, time inside this module is scaled by `c` (one scaled unit is
//! `1/c` µs), so a unit of cost adds exactly `w` scaled units. Per limit the state is the time
//! `at` of the last admission and the backlog `b` it left (scaled). At `now`:
//!
//! ```text
//! backlog = max(0, b - (now - at) * c)          what is still queued
//! new     = backlog + cost * w                  the backlog if admitted
//! fits   <=> new <= w * c                        the bucket holds at most w (c units)
//! retry   = ceil((new - w * c) / c)             until enough has drained
//! remaining = floor((w * c - backlog) / w)      whole units that fit now
//! reset   = ceil(backlog / c)                   until the bucket is empty
//! ```
//!
//! So `c` requests pass at once, then one per `T`. This is what redis-cell's `CL.THROTTLE`
//! computes (limited, limit, remaining, retry-after, reset-after), with `c` as the capacity.
//! `scripts/gcra.lua` is the same procedure; it stores `at` and `b` in a hash, which keeps its
//! floating-point arithmetic exact while `w * c` (in µs) stays below 2^53.

use super::{div_ceil, Fit, Limiter, Window};

/// Per limit: (time of last admission, backlog scaled by count).
#[derive(Debug, Default, Clone)]
pub(crate) struct Gcra {
    slots: Vec<(u64, u128)>,
}

impl Gcra {
    fn backlog(&self, now: u64, i: usize, w: &Window) -> u128 {
        match self.slots.get(i) {
            Some(&(at, b)) => {
                let drained = u128::from(now.saturating_sub(at)) * u128::from(w.count);
                b.saturating_sub(drained)
            }
            None => 0,
        }
    }
}

impl Limiter for Gcra {
    fn fits(&self, now: u64, i: usize, w: &Window, cost: u64) -> Fit {
        let capacity = u128::from(w.micros) * u128::from(w.count);
        let new = self.backlog(now, i, w) + u128::from(cost) * u128::from(w.micros);
        if new <= capacity {
            Fit::Yes
        } else if cost > w.count {
            Fit::No(None)
        } else {
            Fit::No(Some(div_ceil(new - capacity, u128::from(w.count))))
        }
    }

    fn record(&mut self, now: u64, windows: &[Window], cost: u64) {
        self.slots.resize(windows.len(), (0, 0));
        for (i, w) in windows.iter().enumerate() {
            let new = self.backlog(now, i, w) + u128::from(cost) * u128::from(w.micros);
            self.slots[i] = (now, new);
        }
    }

    fn report(&self, now: u64, i: usize, w: &Window) -> (u64, u64) {
        let capacity = u128::from(w.micros) * u128::from(w.count);
        let backlog = self.backlog(now, i, w);
        let remaining = capacity.saturating_sub(backlog) / u128::from(w.micros);
        (remaining as u64, div_ceil(backlog, u128::from(w.count)))
    }

    /// `TAT = max(TAT - units * T, now)`: the backlog shrinks by the units, not below empty.
    /// Units that have drained already are not taken twice, so no admission time is needed.
    fn refund(&mut self, now: u64, windows: &[Window], units: u64, _: Option<u64>) {
        if self.slots.len() != windows.len() {
            return;
        }
        for (i, w) in windows.iter().enumerate() {
            let left = self.backlog(now, i, w);
            let new = left.saturating_sub(u128::from(units) * u128::from(w.micros));
            self.slots[i] = (now, new);
        }
    }
}

impl Gcra {
    /// Microseconds from `now` until every bucket is empty: how long the state matters, which
    /// a charge can make longer than the longest window.
    pub(crate) fn drained_in(&self, now: u64, windows: &[Window]) -> u64 {
        windows
            .iter()
            .enumerate()
            .map(|(i, w)| div_ceil(self.backlog(now, i, w), u128::from(w.count)))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::decide;

    #[test]
    fn burst_then_steady_rate() {
        // 3 per second: a burst of 3, then one every 333 333.3 µs.
        let w = [Window {
            count: 3,
            micros: 1_000_000,
        }];
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
        use crate::algorithm::{settle, Settle};
        // 1000 per minute: T = 60 ms.
        let w = [Window {
            count: 1000,
            micros: 60_000_000,
        }];
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
        // A refund: TAT = max(TAT - n * T, now).
        settle(
            &mut s,
            0,
            &w,
            Settle::Refund {
                units: 1500,
                at: None,
            },
        );
        assert_eq!(decide(&mut s, 0, &w, 1, false).remaining, 500);
        settle(
            &mut s,
            60_000,
            &w,
            Settle::Refund {
                units: 10_000,
                at: None,
            },
        );
        assert_eq!(s.drained_in(60_000, &w), 0);
        assert_eq!(decide(&mut s, 60_000, &w, 1, false).remaining, 1000);
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
            let w = Window { count, micros: window_ms * 100_000 };
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
