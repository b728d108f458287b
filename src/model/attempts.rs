//! A key's attempts in flight, under a policy that counts requests by their outcome
//! (`count_when`): each admitted attempt holds its units from its admission until its outcome
//! is in, and the store keeps them apart until then, so that a refusal those units alone
//! cause is told from one the counted outcomes cause. The first is *busy*: the user's own
//! concurrent attempts (a double-clicked login form, an app's retries), no failure, so it
//! sets no penalty box and a soft policy does not mark it over. The Redis scripts keep the
//! same set, `<key>:tries` (`scripts/prelude.lua`, "Attempts").

/// How long (µs) an attempt counts as in flight without its outcome: an instance that stopped
/// before it settled never will, and its units then count as an outcome's. A minute: far
/// longer than a login takes, short enough that a lost settle delays a penalty box little.
pub(crate) const ATTEMPT_KEPT: u64 = 60_000_000;

/// The longest (µs) a busy refusal tells its client to wait: attempts in flight usually end
/// within it, giving their units back when they succeed. A second, the least `Retry-After`
/// says.
pub(crate) const BUSY_RETRY: u64 = 1_000_000;

/// A key's attempts in flight: id, units, and until when (µs) each counts as in flight.
#[derive(Default)]
pub(crate) struct Attempts(Vec<(u64, u64, u64)>);

impl Attempts {
    /// Attempt `id` of `units`, admitted at `now`, is in flight.
    pub(crate) fn start(&mut self, now: u64, id: u64, units: u64) {
        self.0.retain(|&(_, _, until)| until > now);
        self.0.push((id, units, now.saturating_add(ATTEMPT_KEPT)));
    }

    /// Attempt `id`'s outcome is in.
    pub(crate) fn end(&mut self, id: u64) {
        self.0.retain(|&(held, _, _)| held != id);
    }

    /// The units attempts in flight hold at `now`.
    pub(crate) fn units(&self, now: u64) -> u64 {
        let live = self.0.iter().filter(|&&(_, _, until)| until > now);
        live.fold(0, |sum, &(_, units, _)| sum.saturating_add(units))
    }

    /// Whether a request of `cost`, refused with `remaining` units left, is refused only
    /// because of attempts in flight: without their units it would fit.
    pub(crate) fn only_cause(&self, now: u64, cost: u64, remaining: u64) -> bool {
        let held = self.units(now);
        held > 0 && held >= cost.saturating_sub(remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_busy_only_while_attempts_in_flight_hold_what_it_needs() {
        let mut attempts = Attempts::default();
        assert!(
            !attempts.only_cause(0, 1, 0),
            "nothing in flight: the outcomes refuse"
        );
        attempts.start(0, 7, 1);
        assert!(attempts.only_cause(10, 1, 0));
        assert!(
            !attempts.only_cause(10, 3, 1),
            "one unit in flight; the request lacks two"
        );
        attempts.start(10, 8, 1);
        assert!(attempts.only_cause(20, 3, 1));
        attempts.end(7);
        attempts.end(8);
        assert!(attempts.units(30) == 0 && !attempts.only_cause(30, 1, 0));
    }

    #[test]
    fn an_attempt_never_settled_counts_as_an_outcome_after_a_minute() {
        let mut attempts = Attempts::default();
        attempts.start(0, 1, 1);
        assert!(attempts.only_cause(ATTEMPT_KEPT - 1, 1, 0));
        assert!(!attempts.only_cause(ATTEMPT_KEPT, 1, 0));
    }
}
