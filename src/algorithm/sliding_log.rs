//! Sliding-window log.
//!
//! The log holds one timestamp per admitted unit of cost, sorted. Windows are half-open
//! intervals `(a, a + w]`: an event at `t` counts at time `now` while `now - w < t <= now`.
//!
//! A request at time `t` (now, or any event time: in the past, in the future, in any order)
//! fits limit `(c, w)` if every window of length `w` that contains `t` would hold at most `c`
//! units with it. Those windows are `(a, a + w]` for `a` in `[t - w, t)`; their count only grows
//! when `a + w` reaches an event, so the fullest is `a = t - w` or `a = e - w` for an event
//! `e` in `[t, t + w)`. Without events after `t` (the usual case) that is the single window
//! `(t - w, t]`, found by one binary search.
//!
//! When it does not fit, and the window `(t - w, t]` itself is too full, it will fit once the
//! `(used + cost - c)`-th oldest event of that window has left it, at `e + w`: the retry. When
//! only events scheduled after `t` make it too full, no wait at `t` is known to help and the
//! retry is `None`; it is also `None` when `cost > c`.
//!
//! An admitted request adds `cost` copies of `t`, once for all limits. A denied request records
//! nothing, so a client that keeps retrying is admitted again as soon as its old events age
//! out. `remaining` is `c` minus the fullest window's count; `reset_after` is when the oldest
//! event of `(t - w, t]` leaves it. `scripts/sliding_log.lua` is the same procedure over a
//! sorted set.

use std::collections::VecDeque;

use super::{Fit, Limiter, Window};

/// The log of one key.
#[derive(Debug, Default, Clone)]
pub(crate) struct SlidingLog {
    events: VecDeque<u64>,
}

impl SlidingLog {
    /// Drops the events at or before `cutoff`: no window that matters can hold them.
    pub(crate) fn trim(&mut self, cutoff: u64) {
        while self.events.front().is_some_and(|&t| t <= cutoff) {
            self.events.pop_front();
        }
    }

    /// The number of events the log holds.
    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    /// Index of the first event after `a` (`None`: minus infinity).
    fn after(&self, a: Option<u64>) -> usize {
        a.map_or(0, |a| self.events.partition_point(|&t| t <= a))
    }

    /// Events in `(end - w, end]`.
    fn count(&self, end: u64, w: u64) -> u64 {
        let hi = self.events.partition_point(|&t| t <= end);
        hi.saturating_sub(self.after(end.checked_sub(w))) as u64
    }

    /// `(events in (t - w, t], the fullest window containing t)`.
    fn used(&self, t: u64, w: u64) -> (u64, u64) {
        let past = self.count(t, w);
        let from = self.events.partition_point(|&e| e <= t);
        let fullest = self
            .events
            .range(from..)
            .take_while(|&&e| e < t + w)
            .map(|&e| self.count(e, w))
            .fold(past, u64::max);
        (past, fullest)
    }
}

impl Limiter for SlidingLog {
    fn fits(&self, t: u64, _: usize, w: &Window, cost: u64) -> Fit {
        let (past, fullest) = self.used(t, w.micros);
        if fullest + cost <= w.count {
            return Fit::Yes;
        }
        if cost > w.count || past + cost <= w.count {
            return Fit::No(None);
        }
        let start = self.after(t.checked_sub(w.micros));
        let e = self.events[start + (past + cost - w.count - 1) as usize];
        Fit::No(Some(e + w.micros - t))
    }

    fn record(&mut self, t: u64, _: &[Window], cost: u64) {
        let at = self.events.partition_point(|&e| e <= t);
        for _ in 0..cost {
            self.events.insert(at, t);
        }
    }

    fn report(&self, t: u64, _: usize, w: &Window) -> (u64, u64) {
        let (_, fullest) = self.used(t, w.micros);
        let start = self.after(t.checked_sub(w.micros));
        let reset = match self.events.get(start) {
            Some(&e) if e <= t => e + w.micros - t,
            _ => 0,
        };
        (w.count.saturating_sub(fullest), reset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::decide;

    const S: u64 = 1_000_000;

    fn windows(spec: &[(u64, u64)]) -> Vec<Window> {
        spec.iter()
            .map(|&(count, secs)| Window {
                count,
                micros: secs * S,
            })
            .collect()
    }

    fn check(log: &mut SlidingLog, now: u64, w: &[Window], cost: u64) -> crate::algorithm::Outcome {
        decide(log, now, w, cost, true)
    }

    #[test]
    fn multi_limit_scenario_from_the_issue() {
        // 2 per 2 s and 3 per 10 s.
        let w = windows(&[(2, 2), (3, 10)]);
        let mut log = SlidingLog::default();
        assert!(check(&mut log, 0, &w, 1).allowed);
        assert!(check(&mut log, 0, &w, 1).allowed);

        let third = check(&mut log, 0, &w, 1);
        assert!(!third.allowed);
        assert_eq!((third.index, third.retry_after), (0, Some(2 * S)));

        assert!(check(&mut log, 2_100_000, &w, 1).allowed);

        let fifth = check(&mut log, 2_200_000, &w, 1);
        assert!(!fifth.allowed);
        assert_eq!(fifth.index, 1);
        assert_eq!(fifth.retry_after, Some(7_800_000));
        assert_eq!(fifth.remaining, 0);
        assert_eq!(log.len(), 3, "denied requests are not recorded");
    }

    #[test]
    fn window_is_half_open() {
        let w = windows(&[(1, 1)]);
        let mut log = SlidingLog::default();
        assert!(check(&mut log, 5 * S, &w, 1).allowed);
        assert!(!check(&mut log, 6 * S - 1, &w, 1).allowed);
        assert!(check(&mut log, 6 * S, &w, 1).allowed);
    }

    #[test]
    fn cost_counts_units_and_oversized_cost_never_fits() {
        let w = windows(&[(5, 10)]);
        let mut log = SlidingLog::default();
        let first = check(&mut log, 0, &w, 3);
        assert!(first.allowed);
        assert_eq!(first.remaining, 2);
        assert_eq!(first.reset_after, 10 * S);

        let second = check(&mut log, S, &w, 3);
        assert!(!second.allowed);
        assert_eq!(second.remaining, 2);
        // One of the three units at t=0 must leave: at t=10 s.
        assert_eq!(second.retry_after, Some(9 * S));

        let huge = check(&mut log, S, &w, 6);
        assert!(!huge.allowed);
        assert_eq!(huge.retry_after, None);
        assert_eq!(log.len(), 3);
    }

    #[test]
    fn admitted_reports_the_tightest_limit() {
        let w = windows(&[(10, 1), (3, 60)]);
        let mut log = SlidingLog::default();
        let d = check(&mut log, 0, &w, 1);
        assert_eq!((d.index, d.remaining, d.reset_after), (1, 2, 60 * S));
    }

    #[test]
    fn scheduled_times_in_any_order() {
        // 1 per minute: a send at 10:00 blocks 9:59:01 ..= 10:00:59, not 9:59:00 or 10:01:00.
        let w = windows(&[(1, 60)]);
        let mut log = SlidingLog::default();
        let ten = 36_000 * S;
        assert!(check(&mut log, ten, &w, 1).allowed);
        assert!(!check(&mut log, ten + 59 * S, &w, 1).allowed);
        assert!(!check(&mut log, ten - 59 * S, &w, 1).allowed);
        assert!(check(&mut log, ten + 60 * S, &w, 1).allowed);
        assert!(check(&mut log, ten - 60 * S, &w, 1).allowed);
        assert_eq!(log.len(), 3);
    }

    /// The definition, computed the slow way: every admitted event is kept with its cost.
    struct Reference {
        admitted: Vec<(u64, u64)>,
    }

    impl Reference {
        fn used(&self, at: u64, w: &Window) -> u64 {
            self.admitted
                .iter()
                .filter(|&&(t, _)| t <= at && at < t + w.micros)
                .map(|&(_, c)| c)
                .sum()
        }

        fn fits(&self, at: u64, windows: &[Window], cost: u64) -> bool {
            windows.iter().all(|w| self.used(at, w) + cost <= w.count)
        }

        /// Admits or not; when not, the least wait after which the request would fit.
        fn check(&mut self, now: u64, windows: &[Window], cost: u64) -> (bool, Option<u64>) {
            if self.fits(now, windows, cost) {
                self.admitted.push((now, cost));
                return (true, None);
            }
            // The count of a window only drops when an event leaves it.
            let mut waits: Vec<u64> = self
                .admitted
                .iter()
                .flat_map(|&(t, _)| windows.iter().map(move |w| t + w.micros))
                .filter(|&leave| leave > now)
                .map(|leave| leave - now)
                .collect();
            waits.sort_unstable();
            let retry = waits
                .into_iter()
                .find(|&d| self.fits(now + d, windows, cost));
            (false, retry)
        }
    }

    /// Event-time reference: every window `(a, a + w]` containing `t`, on a grid of `step`.
    /// With event times and windows multiples of `step`, a window's count is constant for `a`
    /// between grid points, so the grid covers every window.
    fn fits_every_window(
        events: &[(u64, u64)],
        t: u64,
        windows: &[Window],
        cost: u64,
        step: u64,
    ) -> bool {
        windows.iter().all(|w| {
            (0..w.micros / step).all(|j| {
                let a = t as i128 - w.micros as i128 + (j * step) as i128;
                let held: u64 = events
                    .iter()
                    .filter(|&&(e, _)| a < e as i128 && e as i128 <= a + w.micros as i128)
                    .map(|&(_, c)| c)
                    .sum();
                held + cost <= w.count
            })
        })
    }

    fn policy_windows(limits: &[(u64, u64)]) -> Vec<Window> {
        // Windows in units of 100 ms, distinct and sorted as a Policy keeps them.
        let mut windows: Vec<Window> = limits
            .iter()
            .map(|&(count, w)| Window {
                count,
                micros: w * 100_000,
            })
            .collect();
        windows.sort_by_key(|w| w.micros);
        windows.dedup_by_key(|w| w.micros);
        windows
    }

    proptest::proptest! {
        #[test]
        fn agrees_with_the_definition(
            limits in proptest::collection::vec((1u64..6, 1u64..20), 1..4),
            steps in proptest::collection::vec((0u64..4, 0u64..4), 1..120),
        ) {
            let windows = policy_windows(&limits);
            let (mut log, mut reference, mut now) =
                (SlidingLog::default(), Reference { admitted: vec![] }, 0u64);
            for (gap, cost) in steps {
                now += gap * 50_000;
                let got = check(&mut log, now, &windows, cost);
                let (allowed, retry) = reference.check(now, &windows, cost);
                proptest::prop_assert_eq!(got.allowed, allowed, "at {}", now);
                if !allowed {
                    proptest::prop_assert_eq!(got.retry_after, retry, "at {}", now);
                }
                let w = &windows[got.index];
                proptest::prop_assert_eq!(
                    got.remaining,
                    w.count.saturating_sub(reference.used(now, w))
                );
            }
        }

        #[test]
        fn event_times_in_any_order_agree_with_every_window(
            limits in proptest::collection::vec((1u64..5, 1u64..20), 1..4),
            times in proptest::collection::vec((0u64..200, 1u64..3), 1..60),
        ) {
            let windows = policy_windows(&limits);
            let mut log = SlidingLog::default();
            let mut admitted: Vec<(u64, u64)> = vec![];
            for (slot, cost) in times {
                let t = 10 * 1_000_000 + slot * 50_000;
                let expected = fits_every_window(&admitted, t, &windows, cost, 50_000);
                let got = check(&mut log, t, &windows, cost);
                proptest::prop_assert_eq!(got.allowed, expected, "event at {}", t);
                if expected {
                    admitted.push((t, cost));
                }
            }
        }
    }
}
