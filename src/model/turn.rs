//! Reservations: the earliest time a request of `cost` fits every limit, after every
//! reservation made before it, recorded at once so that the next caller queues behind it
//! (`docs/outbound.md`). The scripts find the same turn in their `RESERVE` mode
//! (`scripts/gcra.lua`, `scripts/sliding_log.lua`).
//!
//! A reservation is a decision that waits instead of refusing: the request is decided at the
//! first `t ≥ earliest` at which each limit admits it, found by stepping to the latest retry of
//! the limits that refuse (each step passes at least one unit that leaves a window, or the drain
//! a bucket needs), and recorded there. [`AlgorithmState::earliest`] keeps reservations in order: the
//! log never places one before the newest event it holds, so that a small request does not
//! overtake a large one waiting for room; GCRA's backlog is already a queue.

use super::{AlgorithmState, Fit, Window};

/// What [`reserve`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reserved {
    /// Recorded: the request may go at this time (µs, on the store's clock; `now` or later).
    At(u64),
    /// Not recorded: its turn would come this much after `now` (µs), past the most it may
    /// wait; `None` when no wait helps (a cost over a count).
    TooLate(Option<u64>),
}

/// The most steps [`reserve`] takes before it gives up: each passes at least one event of the
/// log (or lands GCRA's turn at once), so only a log of more events than this ahead of the
/// request could need more; such a turn is answered as too late.
const STEPS: usize = 1024;

/// Reserves `cost` units of `state` for the earliest time at or after `now` (and after every
/// reservation before it) at which every limit of `windows` admits them, if that is at most
/// `max_wait` µs away; records nothing otherwise.
pub(crate) fn reserve<L: AlgorithmState>(
    state: &mut L,
    now: u64,
    windows: &[Window],
    cost: u64,
    max_wait: u64,
) -> Reserved {
    let mut t = state.earliest(now);
    for _ in 0..STEPS {
        if t - now > max_wait {
            return Reserved::TooLate(Some(t - now));
        }
        let mut step = 0;
        for (i, w) in windows.iter().enumerate() {
            match state.fits(t, i, w, cost) {
                Fit::Yes => {}
                Fit::No(None) => return Reserved::TooLate(None),
                Fit::No(Some(wait)) => step = step.max(wait.max(1)),
            }
        }
        if step == 0 {
            state.reserve_at(now, t, windows, cost);
            return Reserved::At(t);
        }
        t = t.saturating_add(step);
    }
    Reserved::TooLate(Some(t - now))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gcra::Gcra;
    use crate::model::sliding_log::SlidingLog;
    use crate::model::{decide, settle, Refund, Settle};

    const MS: u64 = 1_000;
    const S: u64 = 1_000_000;

    fn windows(spec: &[(u64, u64)]) -> Vec<Window> {
        spec.iter()
            .map(|&(count, micros)| Window::new(count, micros))
            .collect()
    }

    #[test]
    fn gcra_queues_reservations_one_drain_apart_and_refuses_past_the_wait() {
        let w = windows(&[(10, S)]);
        let mut bucket = Gcra::default();
        for _ in 0..10 {
            assert_eq!(reserve(&mut bucket, 0, &w, 1, 0), Reserved::At(0));
        }
        // One unit drains every 100 ms.
        assert_eq!(reserve(&mut bucket, 0, &w, 1, S), Reserved::At(100 * MS));
        assert_eq!(reserve(&mut bucket, 0, &w, 1, S), Reserved::At(200 * MS));
        // Past the wait: refused, and nothing recorded, so the next turn is the same.
        assert_eq!(
            reserve(&mut bucket, 0, &w, 1, 250 * MS),
            Reserved::TooLate(Some(300 * MS))
        );
        assert_eq!(
            reserve(&mut bucket, 0, &w, 1, 300 * MS),
            Reserved::At(300 * MS)
        );
        // A plain decision waits behind the queue.
        let now = decide(&mut bucket, 0, &w, 1, false);
        assert_eq!(now.retry_after, Some(400 * MS));
        // A cost over the count never gets a turn.
        assert_eq!(
            reserve(&mut bucket, 0, &w, 11, u64::MAX),
            Reserved::TooLate(None)
        );
    }

    #[test]
    fn gcra_waits_for_the_latest_of_its_limits() {
        // 10 per second and 12 per 10 s: 10 at 0, then at 1 s the first limit is empty and the
        // second holds 8.8 units (1.2 drained). 3 more fill it to 11.8; the next unit waits
        // for the second limit's drain of 0.8 units (667 ms at 1.2 per second), though the
        // first has room.
        let w = windows(&[(10, S), (12, 10 * S)]);
        let mut bucket = Gcra::default();
        for _ in 0..10 {
            assert_eq!(reserve(&mut bucket, 0, &w, 1, 0), Reserved::At(0));
        }
        assert_eq!(reserve(&mut bucket, S, &w, 3, 0), Reserved::At(S));
        assert_eq!(
            reserve(&mut bucket, S, &w, 1, 10 * S),
            Reserved::At(S + 666_667)
        );
    }

    #[test]
    fn the_log_places_a_reservation_where_its_windows_have_room_in_order() {
        let w = windows(&[(2, S)]);
        let mut log = SlidingLog::default();
        assert_eq!(reserve(&mut log, 0, &w, 1, 0), Reserved::At(0));
        assert_eq!(reserve(&mut log, 0, &w, 1, 0), Reserved::At(0));
        // Full until the first leaves at 1 s; the one after shares that window.
        assert_eq!(reserve(&mut log, 0, &w, 1, 5 * S), Reserved::At(S));
        assert_eq!(reserve(&mut log, 0, &w, 1, 5 * S), Reserved::At(S));
        // A request of 2 waits for both to leave; a request of 1 after it does not overtake
        // it, though one unit is free earlier.
        assert_eq!(
            reserve(&mut log, 10 * MS, &w, 2, 5 * S),
            Reserved::At(2 * S)
        );
        assert_eq!(
            reserve(&mut log, 20 * MS, &w, 1, 5 * S),
            Reserved::At(3 * S)
        );
        // Every window of the log holds at most its count, at the reserved times.
        let times = [0, 0, S, S, 2 * S, 2 * S, 3 * S];
        for &t in &times {
            let held = times.iter().filter(|&&s| s <= t && s + S > t).count();
            assert!(held <= 2, "{held} in the second ending at {t}");
        }
    }

    #[test]
    fn a_small_request_does_not_overtake_a_large_one_on_the_log() {
        // One unit at 0 and one at 500 ms; at 600 ms a request of 2 waits for both to leave
        // (1.5 s). A request of 1 just after would find room at 1 s, between them: it goes
        // after the request of 2 instead, when that leaves the window (2.5 s).
        let w = windows(&[(2, S)]);
        let mut log = SlidingLog::default();
        assert_eq!(reserve(&mut log, 0, &w, 1, 0), Reserved::At(0));
        assert_eq!(
            reserve(&mut log, 500 * MS, &w, 1, 0),
            Reserved::At(500 * MS)
        );
        assert_eq!(
            reserve(&mut log, 600 * MS, &w, 2, 5 * S),
            Reserved::At(1_500 * MS)
        );
        assert_eq!(
            reserve(&mut log, 610 * MS, &w, 1, 5 * S),
            Reserved::At(2_500 * MS)
        );
    }

    #[test]
    fn a_reservation_given_back_frees_its_units_and_no_more() {
        let w = windows(&[(2, S)]);
        let mut log = SlidingLog::default();
        reserve(&mut log, 0, &w, 2, 0);
        assert_eq!(reserve(&mut log, 0, &w, 2, 5 * S), Reserved::At(S));
        // Given back before its time (a caller that stopped waiting): the log holds the first
        // two only, and a refund past what was reserved takes nothing more.
        let back = Refund {
            units: 5,
            at: Some(S),
            recorded: 2,
        };
        settle(&mut log, 10 * MS, &w, Settle::Refund(back));
        assert_eq!(log.len(), 2);
        assert_eq!(reserve(&mut log, 20 * MS, &w, 1, 5 * S), Reserved::At(S));
    }
}
