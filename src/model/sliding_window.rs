//! Sliding window counter.
//!
//! Per limit `(count c, window w)` the state is the start of the current fixed window (aligned
//! to the epoch, as in [`fixed_window`](super::fixed_window)), its count `curr`, and the previous
//! window's count `prev`. With `e` the time elapsed in the current window, the sliding window
//! `(now - w, now]` is estimated to hold `prev * (w - e) / w + curr` units: the previous
//! window's count weighted by the share of it still covered. A request fits if
//!
//! ```text
//! prev * (w - e) + (curr + cost) * w <= c * w        (integers, no rounding)
//! ```
//!
//! If not, and `curr + cost <= c`, it fits once the weight of `prev` has dropped enough:
//! at `e' = w - floor((c - curr - cost) * w / prev)`. If `curr + cost > c`, it fits in the next
//! window, where `prev' = curr`: at `w - e` plus `max(0, w - floor((c - cost) * w / curr))`.
//!
//! Bounds: since the estimate is at least `curr`, no fixed window ever holds more than `c`.
//! A sliding window spans two fixed windows, and the last admission in it satisfied
//! `prev * (w - e) / w + curr <= c`, so it holds at most `prev + curr <= c + prev * e / w < 2c`.
//! On realistic traffic the difference from the exact log is far smaller (see the README).
//!
//! `remaining` is `floor(c - estimate)`; `reset_after` is the time until both counted windows
//! have passed, i.e. until the full quota is back. `scripts/sliding_window.lua` is the same
//! procedure over a hash.

use super::{window_start, AlgorithmState, Fit, Refund, Window, MAX_UNITS};

/// Per limit: (start of current window, curr, prev).
#[derive(Debug, Default, Clone)]
pub(crate) struct SlidingWindow {
    states: Vec<(u64, u64, u64)>,
}

impl SlidingWindow {
    /// `(elapsed, curr, prev)` of limit `i` at `now`, rolling the stored windows forward.
    fn counts(&self, now: u64, i: usize, w: &Window) -> (u64, u64, u64) {
        let start = window_start(now, w.micros);
        let (curr, prev) = match self.states.get(i) {
            Some(&(s, curr, prev)) if s == start => (curr, prev),
            Some(&(s, curr, _)) if s + w.micros == start => (0, curr),
            _ => (0, 0),
        };
        (now - start, curr, prev)
    }
}

impl AlgorithmState for SlidingWindow {
    fn fits(&self, now: u64, i: usize, w: &Window, cost: u64) -> Fit {
        let (e, curr, prev) = self.counts(now, i, w);
        let (c, wu) = (w.count as u128, w.micros as u128);
        let (e, curr, prev, cost) = (e as u128, curr as u128, prev as u128, cost as u128);
        if prev * (wu - e) + (curr + cost) * wu <= c * wu {
            return Fit::Yes;
        }
        if cost > c {
            return Fit::No(None);
        }
        let retry = if curr + cost <= c {
            // prev > 0 here, or the request would fit.
            let e_fit = wu - (c - curr - cost) * wu / prev;
            e_fit - e
        } else {
            let e_next = wu.saturating_sub((c - cost) * wu / curr);
            (wu - e) + e_next
        };
        Fit::No(Some(retry as u64))
    }

    fn record(&mut self, now: u64, windows: &[Window], cost: u64) {
        self.states.resize(windows.len(), (0, 0, 0));
        for (i, w) in windows.iter().enumerate() {
            let (_, curr, prev) = self.counts(now, i, w);
            let curr = curr.saturating_add(cost).min(MAX_UNITS);
            self.states[i] = (window_start(now, w.micros), curr, prev);
        }
    }

    fn report(&self, now: u64, i: usize, w: &Window) -> (u64, u64) {
        let (e, curr, prev) = self.counts(now, i, w);
        let (c, wu) = (w.count as u128, w.micros as u128);
        let weighted = prev as u128 * (wu - e as u128) + curr as u128 * wu;
        let remaining = (c * wu).saturating_sub(weighted) / wu;
        let reset = match (curr, prev) {
            (0, 0) => 0,
            (0, _) => w.micros - e,
            _ => 2 * w.micros - e,
        };
        (remaining as u64, reset)
    }

    /// The units leave the count of the window that holds `at` while it is stored: as the
    /// current window, or as the previous one after a rollover; an older window counts
    /// nothing any more. Without `at`, nothing changes.
    fn refund(&mut self, _: u64, windows: &[Window], back: Refund) {
        let Some((units, at)) = back.timed() else {
            return;
        };
        for (state, w) in self.states.iter_mut().zip(windows) {
            let start = window_start(at, w.micros);
            if state.0 == start {
                state.1 = state.1.saturating_sub(units);
            } else if state.0 == start + w.micros {
                state.2 = state.2.saturating_sub(units);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::decide;

    const S: u64 = 1_000_000;

    #[test]
    fn weighs_the_previous_window() {
        let w = [Window::new(10, 10 * S)];
        let mut s = SlidingWindow::default();
        // 10 in window [0, 10 s).
        for _ in 0..10 {
            assert!(decide(&mut s, 9 * S, &w, 1, true).allowed);
        }
        // At 12 s, 80 % of the previous window still counts: 8 units, so 2 fit.
        assert!(decide(&mut s, 12 * S, &w, 1, true).allowed);
        assert!(decide(&mut s, 12 * S, &w, 1, true).allowed);
        let d = decide(&mut s, 12 * S, &w, 1, true);
        assert!(!d.allowed);
        // 10 * (10 - e) + 3 * 10 <= 100 once e >= 3 s: retry 1 s.
        assert_eq!(d.retry_after, Some(S));
        assert!(decide(&mut s, 13 * S, &w, 1, true).allowed);
    }

    #[test]
    fn full_current_window_waits_for_the_next() {
        let w = [Window::new(4, 10 * S)];
        let mut s = SlidingWindow::default();
        for _ in 0..4 {
            assert!(decide(&mut s, 2 * S, &w, 1, true).allowed);
        }
        let d = decide(&mut s, 2 * S, &w, 1, true);
        // Next window starts in 8 s; there prev = 4 must weigh <= 3: e >= 2.5 s.
        assert_eq!(d.retry_after, Some(8 * S + 2_500_000));
        assert!(!decide(&mut s, 12_499_999, &w, 1, true).allowed);
        assert!(decide(&mut s, 12_500_000, &w, 1, true).allowed);
    }

    #[test]
    fn settles_in_the_current_or_previous_window() {
        use crate::model::{settle, Refund, Settle};
        let w = [Window::new(1000, 60 * S)];
        let mut s = SlidingWindow::default();
        assert!(decide(&mut s, 0, &w, 1, true).allowed);
        settle(&mut s, 0, &w, Settle::Charge(499));
        settle(&mut s, 0, &w, Settle::Charge(500));
        let d = decide(&mut s, 0, &w, 1, true);
        // Next window at 60 s, where the previous 1000 must weigh <= 999: 60 ms into it.
        assert_eq!((d.allowed, d.retry_after), (false, Some(60 * S + 60_000)));
        // Refunded from the previous window after the rollover.
        settle(
            &mut s,
            61 * S,
            &w,
            Settle::Refund(Refund {
                units: 400,
                at: Some(0),
                recorded: u64::MAX,
            }),
        );
        assert!(decide(&mut s, 61 * S, &w, 100, true).allowed);
        // Into the current one, never below zero.
        settle(
            &mut s,
            62 * S,
            &w,
            Settle::Refund(Refund {
                units: 500,
                at: Some(61 * S),
                recorded: u64::MAX,
            }),
        );
        let (_, curr, prev) = s.counts(62 * S, 0, &w[0]);
        assert_eq!((curr, prev), (0, 600));
        // Two windows later, the admission window is gone: nothing changes.
        assert!(decide(&mut s, 185 * S, &w, 7, true).allowed);
        settle(
            &mut s,
            185 * S,
            &w,
            Settle::Refund(Refund {
                units: 5,
                at: Some(62 * S),
                recorded: u64::MAX,
            }),
        );
        assert_eq!(s.counts(185 * S, 0, &w[0]).1, 7);
    }

    proptest::proptest! {
        /// The documented bounds: at most `c` in any fixed window, fewer than `2c` in any
        /// sliding window (the exact log's bound is `c`).
        #[test]
        fn stays_within_its_bounds(
            count in 1u64..10,
            window_ms in 1u64..20,
            steps in proptest::collection::vec((0u64..150_000, 1u64..3), 1..300),
        ) {
            let w = Window::new(count, window_ms * 100_000);
            let (mut state, mut admitted, mut now) = (SlidingWindow::default(), vec![], 0u64);
            for (gap, cost) in steps {
                now += gap;
                if decide(&mut state, now, &[w], cost, true).allowed {
                    admitted.push((now, cost));
                }
            }
            for &(t, _) in &admitted {
                let start = t - t % w.micros;
                let fixed: u64 = admitted
                    .iter()
                    .filter(|&&(e, _)| e >= start && e < start + w.micros)
                    .map(|&(_, k)| k)
                    .sum();
                proptest::prop_assert!(fixed <= count, "fixed window at {} holds {}", start, fixed);
                let sliding: u64 = admitted
                    .iter()
                    .filter(|&&(e, _)| e <= t && e + w.micros > t)
                    .map(|&(_, k)| k)
                    .sum();
                proptest::prop_assert!(sliding < 2 * count, "window ending {} holds {}", t, sliding);
            }
        }
    }
}
