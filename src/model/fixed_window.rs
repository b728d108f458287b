//! Fixed windows.
//!
//! Windows of length `w` start at multiples of `w` since the UNIX epoch. For each limit the
//! state is the start of the window last written and its count. A request fits if
//! `used + cost <= count`, where `used` is the count if the stored window is the current one
//! and 0 otherwise; if not, it fits when the next window starts (unless `cost > count`).
//! `reset_after` is the time until the current window ends. `scripts/fixed_window.lua` is the
//! same procedure over a hash.

use super::{window_start, AlgorithmState, Fit, Refund, Window, MAX_UNITS};

/// Per limit: (start of the window counted, units counted in it).
#[derive(Debug, Default, Clone)]
pub(crate) struct FixedWindow {
    states: Vec<(u64, u64)>,
}

impl FixedWindow {
    fn used(&self, now: u64, i: usize, w: &Window) -> u64 {
        match self.states.get(i) {
            Some(&(start, count)) if start == window_start(now, w.micros) => count,
            _ => 0,
        }
    }
}

impl AlgorithmState for FixedWindow {
    fn fits(&self, now: u64, i: usize, w: &Window, cost: u64) -> Fit {
        if self.used(now, i, w).saturating_add(cost) <= w.count {
            Fit::Yes
        } else {
            let next = window_start(now, w.micros) + w.micros;
            Fit::No((cost <= w.count).then_some(next - now))
        }
    }

    fn record(&mut self, now: u64, windows: &[Window], cost: u64) {
        self.states.resize(windows.len(), (0, 0));
        for (i, w) in windows.iter().enumerate() {
            let used = self.used(now, i, w);
            let used = used.saturating_add(cost).min(MAX_UNITS);
            self.states[i] = (window_start(now, w.micros), used);
        }
    }

    fn report(&self, now: u64, i: usize, w: &Window) -> (u64, u64) {
        let remaining = w.count.saturating_sub(self.used(now, i, w));
        (remaining, window_start(now, w.micros) + w.micros - now)
    }

    /// The units leave the count of the window that holds `at`, if that is still the current
    /// window (an older one counts nothing any more); without `at`, nothing changes.
    fn refund(&mut self, now: u64, windows: &[Window], back: Refund) {
        let Some((units, at)) = back.timed() else {
            return;
        };
        for (state, w) in self.states.iter_mut().zip(windows) {
            let start = window_start(now, w.micros);
            if state.0 == start && window_start(at, w.micros) == start {
                state.1 = state.1.saturating_sub(units);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::decide;

    #[test]
    fn counts_per_aligned_window() {
        let w = [Window::new(2, 1_000_000)];
        let mut s = FixedWindow::default();
        assert!(decide(&mut s, 10_200_000, &w, 1, true).allowed);
        assert!(decide(&mut s, 10_900_000, &w, 1, true).allowed);
        let d = decide(&mut s, 10_950_000, &w, 1, true);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(50_000));
        // The boundary burst this algorithm is known for: two more right after it.
        assert!(decide(&mut s, 11_000_000, &w, 1, true).allowed);
        assert!(decide(&mut s, 11_000_001, &w, 1, true).allowed);
        assert_eq!(decide(&mut s, 11_000_002, &w, 3, true).retry_after, None);
    }

    #[test]
    fn settles_in_the_admission_window_only() {
        use crate::model::{settle, Refund, Settle};
        const M: u64 = 60_000_000;
        let w = [Window::new(1000, M)];
        let mut s = FixedWindow::default();
        assert!(decide(&mut s, M, &w, 100, true).allowed);
        settle(
            &mut s,
            M + 1,
            &w,
            Settle::Refund(Refund {
                units: 90,
                at: Some(M),
                recorded: u64::MAX,
            }),
        );
        assert_eq!(decide(&mut s, M + 2, &w, 1, true).remaining, 1000 - 10 - 1);
        // A charge goes past the limit; the next window starts afresh.
        settle(&mut s, M + 3, &w, Settle::Charge(5000));
        let d = decide(&mut s, M + 4, &w, 1, true);
        assert_eq!((d.allowed, d.retry_after), (false, Some(M - 4)));
        // A refund after its window has passed changes nothing.
        assert!(decide(&mut s, 2 * M, &w, 500, true).allowed);
        settle(
            &mut s,
            2 * M + 1,
            &w,
            Settle::Refund(Refund {
                units: 90,
                at: Some(M),
                recorded: u64::MAX,
            }),
        );
        assert_eq!(decide(&mut s, 2 * M + 2, &w, 1, true).remaining, 499);
        // Never below zero, and nothing without the admission time.
        settle(
            &mut s,
            2 * M + 3,
            &w,
            Settle::Refund(Refund {
                units: 9999,
                at: Some(2 * M),
                recorded: u64::MAX,
            }),
        );
        settle(
            &mut s,
            2 * M + 3,
            &w,
            Settle::Refund(Refund {
                units: 1,
                at: None,
                recorded: u64::MAX,
            }),
        );
        assert_eq!(decide(&mut s, 2 * M + 4, &w, 1, false).remaining, 1000);
    }
}
