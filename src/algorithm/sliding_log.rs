//! Sliding-window log.
//!
//! The log holds one timestamp per admitted unit of cost, oldest first. An event at time `t`
//! counts against a limit of `count` per `w` while `now - w < t`, i.e. the window is the
//! half-open interval `(now - w, now]`. For each limit `i`:
//!
//! - `used_i` = events in `(now - w_i, now]`;
//! - the request fits if `used_i + cost <= count_i`;
//! - if it does not, it will fit once the `(used_i + cost - count_i)`-th oldest event of that
//!   window has left it, at `t + w_i`: `retry_i = t + w_i - now`. A cost above `count_i` never
//!   fits, and `retry_i` is `None`.
//!
//! The request is admitted only if every limit admits it; then `cost` copies of `now` are
//! appended once (one log serves all limits). A denied request records nothing, so a client
//! that keeps retrying is admitted again as soon as its old events age out.
//!
//! The reported limit is, when denied, the one with the latest retry (a `None` retry is latest);
//! when admitted, the one with the fewest remaining units. Ties go to the shorter window.
//! `reset_after` is when the oldest event of the reported window leaves it, i.e. when its
//! remaining count next grows. `scripts/sliding_log.lua` is the same procedure over a sorted
//! set.

use std::collections::VecDeque;

use super::{Outcome, Window};

/// The log of one key.
#[derive(Debug, Default, Clone)]
pub(crate) struct SlidingLog {
    events: VecDeque<u64>,
}

impl SlidingLog {
    /// Decides a request of `cost` units at `now` against `windows` (shortest window first),
    /// recording it if admitted.
    pub(crate) fn check(&mut self, now: u64, windows: &[Window], cost: u64) -> Outcome {
        let longest = windows.last().map_or(0, |w| w.micros);
        if let Some(cutoff) = now.checked_sub(longest) {
            while self.events.front().is_some_and(|&t| t <= cutoff) {
                self.events.pop_front();
            }
        }

        // The first index inside each window, and the verdict of each limit.
        let starts: Vec<usize> = windows.iter().map(|w| self.start_of(now, w)).collect();
        let mut denied: Option<(usize, Option<u64>)> = None;
        for (i, (w, &start)) in windows.iter().zip(&starts).enumerate() {
            let used = (self.events.len() - start) as u64;
            if used + cost <= w.count {
                continue;
            }
            let retry = (cost <= w.count).then(|| {
                let t = self.events[start + (used + cost - w.count - 1) as usize];
                t + w.micros - now
            });
            let later = match (denied, retry) {
                (None, _) => true,
                (Some((_, None)), _) => false,
                (Some((_, Some(_))), None) => true,
                (Some((_, Some(a))), Some(b)) => b > a,
            };
            if later {
                denied = Some((i, retry));
            }
        }

        if let Some((index, retry_after)) = denied {
            let (remaining, reset_after) = self.report(now, &windows[index], starts[index]);
            return Outcome {
                allowed: false,
                index,
                remaining,
                reset_after,
                retry_after,
            };
        }

        // Admit: record `cost` events at `now` (never before the newest, so the log stays
        // sorted even if the clock steps back).
        let at = self.events.back().map_or(now, |&last| last.max(now));
        self.events.extend(std::iter::repeat_n(at, cost as usize));
        let (index, (remaining, reset_after)) = windows
            .iter()
            .zip(&starts)
            .map(|(w, &start)| self.report(now, w, start))
            .enumerate()
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

    /// The number of events the log holds.
    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    fn start_of(&self, now: u64, w: &Window) -> usize {
        match now.checked_sub(w.micros) {
            Some(cutoff) => self.events.partition_point(|&t| t <= cutoff),
            None => 0,
        }
    }

    /// Remaining units and reset time of window `w` whose first event is at `start`.
    fn report(&self, now: u64, w: &Window, start: usize) -> (u64, u64) {
        let used = (self.events.len() - start) as u64;
        let reset = self
            .events
            .get(start)
            .map_or(0, |&t| (t + w.micros).saturating_sub(now));
        (w.count.saturating_sub(used), reset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    fn windows(spec: &[(u64, u64)]) -> Vec<Window> {
        spec.iter()
            .map(|&(count, secs)| Window {
                count,
                micros: secs * S,
            })
            .collect()
    }

    #[test]
    fn multi_limit_scenario_from_the_issue() {
        // 2 per 2 s and 3 per 10 s.
        let w = windows(&[(2, 2), (3, 10)]);
        let mut log = SlidingLog::default();
        assert!(log.check(0, &w, 1).allowed);
        assert!(log.check(0, &w, 1).allowed);

        let third = log.check(0, &w, 1);
        assert!(!third.allowed);
        assert_eq!((third.index, third.retry_after), (0, Some(2 * S)));

        assert!(log.check(2_100_000, &w, 1).allowed);

        let fifth = log.check(2_200_000, &w, 1);
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
        assert!(log.check(5 * S, &w, 1).allowed);
        assert!(!log.check(6 * S - 1, &w, 1).allowed);
        assert!(log.check(6 * S, &w, 1).allowed);
    }

    #[test]
    fn cost_counts_units_and_oversized_cost_never_fits() {
        let w = windows(&[(5, 10)]);
        let mut log = SlidingLog::default();
        let first = log.check(0, &w, 3);
        assert!(first.allowed);
        assert_eq!(first.remaining, 2);
        assert_eq!(first.reset_after, 10 * S);

        let second = log.check(S, &w, 3);
        assert!(!second.allowed);
        assert_eq!(second.remaining, 2);
        // One of the three units at t=0 must leave: at t=10 s.
        assert_eq!(second.retry_after, Some(9 * S));

        let huge = log.check(S, &w, 6);
        assert!(!huge.allowed);
        assert_eq!(huge.retry_after, None);
        assert_eq!(log.len(), 3);
    }

    #[test]
    fn admitted_reports_the_tightest_limit() {
        let w = windows(&[(10, 1), (3, 60)]);
        let mut log = SlidingLog::default();
        let d = log.check(0, &w, 1);
        assert_eq!((d.index, d.remaining, d.reset_after), (1, 2, 60 * S));
    }

    #[test]
    fn old_events_are_trimmed() {
        let w = windows(&[(100, 1)]);
        let mut log = SlidingLog::default();
        for t in 0..50 {
            log.check(t * 1000, &w, 1);
        }
        log.check(10 * S, &w, 1);
        assert_eq!(log.len(), 1);
    }

    /// The definition, computed the slow way: every admitted event is kept with its cost.
    struct Reference {
        admitted: Vec<(u64, u64)>,
    }

    impl Reference {
        fn used(&self, at: u64, w: &Window) -> u64 {
            self.admitted
                .iter()
                .filter(|&&(t, _)| at < t + w.micros)
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

    proptest::proptest! {
        #[test]
        fn agrees_with_the_definition(
            limits in proptest::collection::vec((1u64..6, 1u64..20), 1..4),
            steps in proptest::collection::vec((0u64..4, 0u64..4), 1..120),
        ) {
            // Windows in units of 100 ms, distinct and sorted as a Policy keeps them.
            let mut windows: Vec<Window> = limits
                .iter()
                .map(|&(count, w)| Window { count, micros: w * 100_000 })
                .collect();
            windows.sort_by_key(|w| w.micros);
            windows.dedup_by_key(|w| w.micros);

            let (mut log, mut reference, mut now) =
                (SlidingLog::default(), Reference { admitted: vec![] }, 0u64);
            for (gap, cost) in steps {
                now += gap * 50_000;
                let got = log.check(now, &windows, cost);
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
    }
}
