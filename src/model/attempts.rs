//! A key's attempts in flight, under a policy that counts requests by their outcome
//! (`count_when`): each admitted attempt holds its units from its admission until its outcome
//! is in, and the store keeps them apart until then, so that a refusal those units alone
//! cause is told from one the counted outcomes cause. The first is *busy*: the user's own
//! concurrent attempts (a double-clicked login form, an app's retries), no failure, so it
//! sets no penalty box and a soft policy does not mark it over. It is busy when the request
//! would be admitted with the attempts in flight given back, as their refunds would give
//! them back (`KeyState::fits_without_attempts`): units that have left the window, drained,
//! or that charges past the count outweigh make no refusal busy. The Redis scripts keep the
//! same set, `<key>:tries` (`scripts/prelude.lua`, "Attempts").

/// How long (µs) an attempt counts as in flight without its outcome: an instance that stopped
/// before it settled never will, and its units then count as an outcome's. A minute: far
/// longer than a login takes, short enough that a lost settle delays a penalty box little.
pub(crate) const ATTEMPT_KEPT: u64 = 60_000_000;

/// The longest (µs) a busy refusal tells its client to wait: attempts in flight usually end
/// within it, giving their units back when they succeed. A second, the least `Retry-After`
/// says.
pub(crate) const BUSY_RETRY: u64 = 1_000_000;

/// One attempt in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Attempt {
    pub(crate) id: u64,
    pub(crate) units: u64,
    /// When it was admitted (µs, the store's time).
    pub(crate) at: u64,
}

/// A key's attempts in flight.
#[derive(Default)]
pub(crate) struct Attempts(Vec<Attempt>);

impl Attempts {
    /// Attempt `id` of `units`, admitted at `now`, is in flight.
    pub(crate) fn start(&mut self, now: u64, id: u64, units: u64) {
        self.0.retain(|a| a.at.saturating_add(ATTEMPT_KEPT) > now);
        self.0.push(Attempt { id, units, at: now });
    }

    /// Attempt `id`'s outcome is in.
    pub(crate) fn end(&mut self, id: u64) {
        self.0.retain(|a| a.id != id);
    }

    /// The attempts in flight at `now`.
    pub(crate) fn live(&self, now: u64) -> impl Iterator<Item = &Attempt> {
        self.0
            .iter()
            .filter(move |a| a.at.saturating_add(ATTEMPT_KEPT) > now)
    }

    /// Until when (µs) the last attempt counts as in flight; 0 for none.
    pub(crate) fn last_expiry(&self) -> u64 {
        let ends = self.0.iter().map(|a| a.at.saturating_add(ATTEMPT_KEPT));
        ends.max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_is_in_flight_until_its_outcome_or_for_a_minute() {
        let mut attempts = Attempts::default();
        attempts.start(0, 7, 1);
        attempts.start(10, 8, 2);
        assert_eq!(attempts.live(20).count(), 2);
        attempts.end(7);
        let live: Vec<_> = attempts.live(20).copied().collect();
        assert_eq!(
            live,
            [Attempt {
                id: 8,
                units: 2,
                at: 10
            }]
        );
        assert_eq!(attempts.live(10 + ATTEMPT_KEPT).count(), 0);
        assert_eq!(attempts.last_expiry(), 10 + ATTEMPT_KEPT);
    }
}
