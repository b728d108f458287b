//! Sliding-window log.
//!
//! The log holds one event per admitted request: its time and its weight (the request's
//! cost), sorted by time. Windows are half-open intervals `(a, a + w]`: an event at `t` counts
//! at time `now` while `now - w < t <= now`, and a window's count is the sum of the weights of
//! the events in it.
//!
//! A request at time `t` (now, or any event time: in the past, in the future, in any order)
//! fits limit `(c, w)` if every window of length `w` that contains `t` would hold at most `c`
//! units with it. Those windows are `(a, a + w]` for `a` in `[t - w, t)`; their count only grows
//! when `a + w` reaches an event, so the fullest is `a = t - w` or `a = e - w` for an event
//! `e` in `[t, t + w)`. Without events after `t` (the usual case) that is the single window
//! `(t - w, t]`.
//!
//! Each event carries the running total of the log's weight through it (wrapping), so that the
//! count of a window is the difference of two totals: the last event of the window against the
//! event before its first (`base` for the oldest). Counting takes two binary searches however
//! many units the events carry, and memory grows with events, not units.
//!
//! When it does not fit, the retry is the earliest time `t' > t` at which the request fits
//! every limit at once, given every event the log holds (before and after `t`). A limit's fit
//! only improves when an event leaves the windows around `t'`, at `e + w`; so for one limit
//! the earliest is at least `e + w` for the first event `e` after `t - w`, and, when the window
//! `(t - w, t]` itself is too full, at least when `used + cost - c` units have left it (walking
//! the window's events oldest first and summing their weights, `e + w` for the first event at
//! which that sum covers the excess: a binary search over the running totals). Without events
//! after `t` the latest of those is the answer. With some (scheduled events, or later ones
//! than a past event time), the request is decided afresh at that time, and at the latest of
//! the refusing limits' own answers there, and so on (`joint_retry`, at most `JOINT_STEPS`
//! times, then the time the newest event has left every window, where it always fits). The
//! retry is `None` only when `cost > c` for a limit.
//!
//! The log keeps its events twice the longest window `L` (trimmed at `now - 2L`): a decision
//! is at a time no more than `L` before now (`Store::check_at` refuses older ones), and its
//! windows reach `L` further back.
//!
//! An admitted request of positive cost adds one event at `t` of weight `cost`, once for all
//! limits, after any events at the same time. A denied request records nothing, so a client
//! that keeps retrying is admitted again as soon as its old events age out. `remaining` is `c`
//! minus the fullest window's count; `reset_after` is when the oldest event of `(t - w, t]`
//! leaves it. `scripts/sliding_log.lua` is the same procedure over a sorted set, whose members
//! carry the same running totals.

use std::collections::VecDeque;

use super::{AlgorithmState, Fit, Refund, Window, MAX_UNITS};

/// The most candidate times [`SlidingLog::joint_retry`] decides before it answers the time
/// every window is past the newest event (`scripts/sliding_log.lua`, `JOINT_STEPS`): each
/// reads every event after the candidate within a window, per limit, so that a refusal among
/// many booked events costs Redis a bounded number of reads. Past it, the retry is still true
/// (the request fits there), but may be later than the earliest.
pub(crate) const JOINT_STEPS: usize = 32;

/// The most events logged after the decided time for which [`SlidingLog::joint_retry`]
/// searches the earliest joint fit (`scripts/sliding_log.lua`, `JOINT_EVENTS`): each candidate
/// reads those events, so that with more of them a refusal would cost Redis reads in
/// proportion (250 ms a refusal with 3 000 bookings ahead). Past it, the retry is the time the
/// newest event has left every window: true, and maybe later than the earliest.
pub(crate) const JOINT_EVENTS: usize = 64;

/// One admitted request.
#[derive(Debug, Clone, Copy)]
struct Event {
    /// Event time, µs.
    time: u64,
    /// The weight of every event of the log up to and including this one (wrapping).
    total: u64,
}

/// The log of one key.
#[derive(Debug, Default, Clone)]
pub(crate) struct SlidingLog {
    events: VecDeque<Event>,
    /// The running total before the oldest event (wrapping).
    base: u64,
}

impl SlidingLog {
    /// Drops the events at or before `cutoff`: no window that matters can hold them.
    pub(crate) fn trim(&mut self, cutoff: u64) {
        while let Some(&Event { time, total }) = self.events.front() {
            if time > cutoff {
                break;
            }
            self.base = total;
            self.events.pop_front();
        }
        // Memory follows the events held, not the most ever held.
        if self.events.capacity() > 64 && self.events.len() * 4 < self.events.capacity() {
            self.events.shrink_to(self.events.len() * 2);
        }
    }

    /// The number of units (the sum of the weights) the log holds.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.mark(self.events.len()).wrapping_sub(self.base)
    }

    /// The number of events the log holds.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn events(&self) -> usize {
        self.events.len()
    }

    /// The running total before event `i` (`i == len`: after the last).
    fn mark(&self, i: usize) -> u64 {
        match i.checked_sub(1) {
            Some(j) => self.events.get(j).map_or(self.base, |e| e.total),
            None => self.base,
        }
    }

    /// Index of the first event after `a` (`None`: minus infinity).
    fn after(&self, a: Option<u64>) -> usize {
        a.map_or(0, |a| self.events.partition_point(|e| e.time <= a))
    }

    /// Units in `(end - w, end]`. Inlined: it runs for every window of every decision.
    #[inline]
    fn count(&self, end: u64, w: u64) -> u64 {
        let hi = self.events.partition_point(|e| e.time <= end);
        let lo = self.after(end.checked_sub(w)).min(hi);
        self.mark(hi).wrapping_sub(self.mark(lo))
    }

    /// The time of the newest event the log holds.
    pub(crate) fn newest(&self) -> Option<u64> {
        self.events.back().map(|e| e.time)
    }

    /// When the first event after `t - w` leaves the windows around `t`: `e + w`, after `t`.
    fn next_leave(&self, t: u64, w: u64) -> Option<u64> {
        let first = self.events.get(self.after(t.checked_sub(w)))?;
        Some(first.time.saturating_add(w))
    }

    /// When `(t - w, t]`, which holds `past` units, has room for `cost` (at most the count) as
    /// far as its own events go: `t` when it has; else once `past + cost - c` units have left
    /// it, at `e + w` for the first event `e`, oldest first, whose running total covers them.
    fn past_frees(&self, t: u64, w: &Window, past: u64, cost: u64) -> u64 {
        if past.saturating_add(cost) <= w.count {
            return t;
        }
        // Totals are taken relative to `base`, where they increase.
        let start = self.after(t.checked_sub(w.micros));
        let target = self
            .mark(start)
            .wrapping_sub(self.base)
            .wrapping_add(past + cost - w.count);
        let at = self
            .events
            .partition_point(|e| e.total.wrapping_sub(self.base) < target);
        self.events
            .get(at)
            .map_or(t, |e| e.time.saturating_add(w.micros))
    }

    /// `(units in (t - w, t], the fullest window containing t)`.
    fn used(&self, t: u64, w: u64) -> (u64, u64) {
        let past = self.count(t, w);
        let from = self.events.partition_point(|e| e.time <= t);
        let fullest = self
            .events
            .range(from..)
            .take_while(|e| e.time < t.saturating_add(w))
            .map(|e| self.count(e.time, w))
            .fold(past, u64::max);
        (past, fullest)
    }
}

impl AlgorithmState for SlidingLog {
    fn fits(&self, t: u64, _: usize, w: &Window, cost: u64) -> Fit {
        let (past, fullest) = self.used(t, w.micros);
        if fullest.saturating_add(cost) <= w.count {
            return Fit::Yes;
        }
        if cost > w.count {
            return Fit::No(None);
        }
        // The limit admits again only once an event has left a window around t: at `e + w`
        // for the first event `e` after `t - w`, at the earliest (the log holds one, or no
        // window would be full).
        let leaves = self
            .next_leave(t, w.micros)
            .unwrap_or(t.saturating_add(w.micros));
        Fit::No(Some(leaves.max(self.past_frees(t, w, past, cost)) - t))
    }

    /// After `retry`, the largest of the limits' own answers (each the earliest their window
    /// alone could admit), the earliest wait after which every limit admits at once: events
    /// logged after `t` (scheduled ones, or later than a past event time) may fill a window
    /// again as the request moves, so each candidate is decided afresh, and the next one is
    /// the latest of the refusing limits' own answers there. Without events after `t` the
    /// limits' answers already hold together. After [`JOINT_STEPS`] candidates, the time the
    /// newest event has left every window, at which the request always fits.
    fn joint_retry(&self, t: u64, windows: &[Window], cost: u64, retry: u64) -> u64 {
        let Some(newest) = self.newest().filter(|&newest| newest > t) else {
            return retry;
        };
        let longest = windows.iter().map(|w| w.micros).max().unwrap_or(0);
        let ahead = self.events.len() - self.events.partition_point(|e| e.time <= t);
        if ahead > JOINT_EVENTS {
            return newest.saturating_add(longest).saturating_sub(t).max(retry);
        }
        let mut at = t.saturating_add(retry);
        for _ in 0..JOINT_STEPS {
            let mut next = None;
            for w in windows {
                match self.fits(at, 0, w, cost) {
                    Fit::Yes => {}
                    Fit::No(Some(wait)) => next = next.max(Some(at.saturating_add(wait))),
                    Fit::No(None) => return retry,
                }
            }
            match next {
                None => return at - t,
                Some(next) => at = next,
            }
        }
        newest.saturating_add(longest).saturating_sub(t)
    }

    /// The event weighs `cost`, but at most one unit more than the largest count, which no
    /// decision tells from more (each window holding it is full for every request), and at
    /// most what keeps the log's units within [`MAX_UNITS`]: so a charge of any size refuses
    /// the key for exactly as long as the log holds it.
    fn record(&mut self, t: u64, windows: &[Window], cost: u64) {
        let largest = windows.iter().map(|w| w.count).max().unwrap_or(0);
        let held = self.mark(self.events.len()).wrapping_sub(self.base);
        let cost = cost
            .min(largest.saturating_add(1))
            .min(MAX_UNITS.saturating_sub(held));
        if cost == 0 {
            return;
        }
        let at = self.events.partition_point(|e| e.time <= t);
        let total = self.mark(at).wrapping_add(cost);
        self.events.insert(at, Event { time: t, total });
        // Events after t (scheduled ones, or later than a past event time) carry it too.
        for e in self.events.range_mut(at + 1..) {
            e.total = e.total.wrapping_add(cost);
        }
    }

    fn report(&self, t: u64, _: usize, w: &Window) -> (u64, u64) {
        let (_, fullest) = self.used(t, w.micros);
        let start = self.after(t.checked_sub(w.micros));
        let reset = match self.events.get(start) {
            Some(e) if e.time <= t => e.time + w.micros - t,
            _ => 0,
        };
        (w.count.saturating_sub(fullest), reset)
    }

    /// After the newest event the log holds: a reservation never goes before one made
    /// earlier (nor before a request logged at a later event time).
    fn earliest(&self, now: u64) -> u64 {
        self.events.back().map_or(now, |e| e.time.max(now))
    }

    /// Takes up to `units`, at most what the request recorded, off the events of its admission
    /// time `at`, the last added first: units of one microsecond weigh alike in every window,
    /// so which of its events gives them does not matter (on Redis a request admitted from a
    /// lease was logged in the lease's event). An event goes when it weighs nothing; the
    /// events after carry that much less in their totals. Nothing when no event has that time
    /// (aged out, reset) or `at` is not known. As `scripts/log_lighten.lua`'s `lighten`.
    fn refund(&mut self, _: u64, _: &[Window], back: Refund) {
        let Some(at) = back.at else { return };
        let end = self.events.partition_point(|e| e.time <= at);
        let start = self.events.partition_point(|e| e.time < at);
        let mut left = back.units.min(back.recorded);
        for i in (start..end).rev() {
            if left == 0 {
                break;
            }
            let weight = self.events[i].total.wrapping_sub(self.mark(i));
            let take = left.min(weight);
            for e in self.events.range_mut(i..) {
                e.total = e.total.wrapping_sub(take);
            }
            if take == weight {
                self.events.remove(i);
            }
            left -= take;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::decide;

    const S: u64 = 1_000_000;

    fn windows(spec: &[(u64, u64)]) -> Vec<Window> {
        spec.iter()
            .map(|&(count, secs)| Window::new(count, secs * S))
            .collect()
    }

    fn check(log: &mut SlidingLog, now: u64, w: &[Window], cost: u64) -> crate::model::Outcome {
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
    fn a_refusal_that_waiting_helps_tells_the_wait_past_later_events() {
        // 1/1m + 5/1h + 10/1d: an event booked 30 s ahead, then one now. The minute's window
        // (-30 s, 30 s] holds the booking; the request fits once it has left: at 90 s.
        let w = windows(&[(1, 60), (5, 3600), (10, 86_400)]);
        let mut log = SlidingLog::default();
        let now = 100_000 * S;
        assert!(check(&mut log, now + 30 * S, &w, 1).allowed);
        let d = check(&mut log, now, &w, 1);
        assert_eq!((d.allowed, d.retry_after), (false, Some(90 * S)));
        assert!(!check(&mut log, now + 89 * S, &w, 1).allowed);
        assert!(check(&mut log, now + 90 * S, &w, 1).allowed);

        // 1/4s, bookings at -1 s and +3 s: at 3 s the +3 s booking is there, and the first
        // time clear of both is +7 s.
        let w = windows(&[(1, 4)]);
        let mut log = SlidingLog::default();
        assert!(check(&mut log, now - S, &w, 1).allowed);
        assert!(check(&mut log, now + 3 * S, &w, 1).allowed);
        let d = check(&mut log, now, &w, 1);
        assert_eq!((d.allowed, d.retry_after), (false, Some(7 * S)));
        assert!(!check(&mut log, now + 6 * S, &w, 1).allowed);
        assert!(check(&mut log, now + 7 * S, &w, 1).allowed);
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

    #[test]
    fn settles_the_events_of_the_requests_time() {
        use crate::model::{settle, Refund, Settle};
        let w = windows(&[(1000, 60)]);
        let mut log = SlidingLog::default();
        assert!(check(&mut log, 0, &w, 1).allowed);
        settle(&mut log, 0, &w, Settle::Charge(499));
        assert_eq!(check(&mut log, S, &w, 1).remaining, 1000 - 500 - 1);
        settle(&mut log, S, &w, Settle::Charge(499));
        // Full: the oldest unit (the first check's) leaves at 60 s.
        let d = check(&mut log, 2 * S, &w, 1);
        assert_eq!((d.allowed, d.retry_after), (false, Some(58 * S)));
        assert_eq!(log.events(), 4);

        let mut log = SlidingLog::default();
        assert!(check(&mut log, 0, &w, 100).allowed);
        assert!(check(&mut log, S, &w, 100).allowed);
        let refund = |units, at, recorded| {
            Settle::Refund(Refund {
                units,
                at: Some(at),
                recorded,
            })
        };
        // The first request's event weighs 10; the later one's total follows.
        settle(&mut log, 2 * S, &w, refund(90, 0, 100));
        assert_eq!((log.len(), log.events()), (110, 2));
        assert_eq!(check(&mut log, 2 * S, &w, 1).remaining, 1000 - 110 - 1);
        // At most its own units: the event goes, the others stay.
        settle(&mut log, 2 * S, &w, refund(500, S, 100));
        assert_eq!((log.len(), log.events()), (11, 2));
        // No event of that time (aged out, reset, or never), or no time: nothing.
        settle(&mut log, 2 * S, &w, refund(5, 7, 100));
        let unknown = Refund {
            units: 5,
            at: None,
            recorded: 10,
        };
        settle(&mut log, 2 * S, &w, Settle::Refund(unknown));
        assert_eq!(log.len(), 11);
        // The retry follows the new weights: 10 of the 11 units leave at 60 s.
        let d = check(&mut log, 3 * S, &w, 999);
        assert_eq!(d.retry_after, Some(57 * S));
    }

    #[test]
    fn requests_of_one_microsecond_refund_what_they_recorded() {
        use crate::model::{settle, Refund, Settle};
        let w = windows(&[(1000, 60)]);
        let mut log = SlidingLog::default();
        assert!(check(&mut log, S, &w, 100).allowed);
        assert!(check(&mut log, S, &w, 100).allowed);
        for _ in 0..2 {
            let back = Refund {
                units: 90,
                at: Some(S),
                recorded: 100,
            };
            settle(&mut log, 2 * S, &w, Settle::Refund(back));
        }
        assert_eq!(log.len(), 20);
        assert_eq!(check(&mut log, 2 * S, &w, 0).remaining, 980);
        // At most what one recorded, however much is asked back.
        let back = Refund {
            units: 500,
            at: Some(S),
            recorded: 5,
        };
        settle(&mut log, 2 * S, &w, Settle::Refund(back));
        assert_eq!(log.len(), 15);
    }

    #[test]
    fn a_charge_of_any_size_weighs_as_a_full_window() {
        use crate::model::{settle, Settle, MAX_UNITS};
        let w = windows(&[(10, 1), (1000, 60)]);
        let mut log = SlidingLog::default();
        assert!(check(&mut log, 0, &w, 5).allowed);
        // u64::MAX and 2^52 weigh 1001: every window holding them refuses, until they leave.
        settle(&mut log, S, &w, Settle::Charge(u64::MAX));
        settle(&mut log, S, &w, Settle::Charge(MAX_UNITS));
        assert_eq!(log.len(), 5 + 2 * 1001);
        let d = check(&mut log, 2 * S, &w, 1);
        assert_eq!(
            (d.allowed, d.remaining, d.retry_after),
            (false, 0, Some(59 * S))
        );
        assert!(check(&mut log, 61 * S, &w, 1).allowed);
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
            .map(|&(count, w)| Window::new(count, w * 100_000))
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
        fn event_times_are_told_the_earliest_time_they_fit(
            limits in proptest::collection::vec((1u64..5, 1u64..20), 1..4),
            times in proptest::collection::vec((0u64..200, 1u64..3), 1..60),
        ) {
            let windows = policy_windows(&limits);
            let step = 50_000;
            let mut log = SlidingLog::default();
            let mut admitted: Vec<(u64, u64)> = vec![];
            for (tick, cost) in times {
                let t = 10 * 1_000_000 + tick * step;
                let got = check(&mut log, t, &windows, cost);
                if got.allowed {
                    admitted.push((t, cost));
                    continue;
                }
                if windows.iter().any(|w| cost > w.count) {
                    proptest::prop_assert_eq!(got.retry_after, None);
                    continue;
                }
                // Event times and windows are on the grid: so is the earliest time it fits.
                let fits = |at| fits_every_window(&admitted, at, &windows, cost, step);
                let earliest = (1..).map(|k| t + k * step).find(|&at| fits(at)).unwrap();
                proptest::prop_assert_eq!(got.retry_after, Some(earliest - t), "event at {}", t);
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
            for (tick, cost) in times {
                let t = 10 * 1_000_000 + tick * 50_000;
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
