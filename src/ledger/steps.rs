//! The credit of a metered body: what its store decisions admitted (its admission's, then
//! its steps', `Engine::step`) and its frames have not used yet. No I/O: a body asks
//! [`Credit`] how much of a frame may pass, what step to ask for when it falls short, and,
//! when it ends or is dropped, what to refund.
//!
//! The credit is kept at most one step (or a declared length reserved whole at admission): a
//! step is asked only when a frame needs more than is left, so at most the decision before the
//! last still holds credit, never an older one. The unused part is therefore refunded from
//! those two decisions alone, the last first, each within what it recorded.

use crate::response::FailureMode;
use crate::{Decision, Settlement};

/// The unused units of a body's admitted decisions.
#[derive(Debug, Clone)]
pub(crate) struct Credit {
    /// The units a step asks for (the request side's step size, at least 1).
    step: u32,
    /// Units admitted and not used yet.
    left: u64,
    /// Of `left`, units passed without a decision (a store failure under
    /// [`FailureMode::Open`]): used first, never refunded.
    uncounted: u64,
    /// The last admitted decision: the admission's until a step is admitted.
    last: Decision,
    /// The admitted decision before `last`, which may still hold part of `left`.
    before: Option<Decision>,
    /// The units used so far (passed to the handler or sent to the client).
    passed: u64,
    /// Of `passed`, the units that passed uncounted, not charged yet.
    unrecorded: u64,
}

/// What a body does when a step's decision failed (the store could not answer), by the
/// layer's [`FailureMode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnFailure {
    /// The step passes uncounted ([`FailureMode::Open`]): the credit grew by it.
    Pass,
    /// The body is cut, answered `503` ([`FailureMode::Closed`]).
    Cut,
    /// The step is asked of the fallback's local store, whose ledger then settles its refund
    /// ([`FailureMode::Fallback`]).
    Fallback,
}

impl Credit {
    /// A body's credit, starting with what its admission (`first`) recorded; steps ask for
    /// `step` units (0 taken as 1).
    pub(crate) fn new(step: u32, first: Decision) -> Credit {
        Credit {
            step: step.max(1),
            left: if first.is_allowed() {
                first.recorded
            } else {
                0
            },
            uncounted: 0,
            last: first,
            before: None,
            passed: 0,
            unrecorded: 0,
        }
    }

    /// How many of `units` may pass now (at most what is left), counted as used.
    pub(crate) fn cover(&mut self, units: u64) -> u64 {
        let covered = units.min(self.left);
        self.left -= covered;
        let uncounted = covered.min(self.uncounted);
        self.uncounted -= uncounted;
        self.unrecorded = self.unrecorded.saturating_add(uncounted);
        self.passed = self.passed.saturating_add(covered);
        covered
    }

    /// The units to ask a step for, when a frame is `short` units short of the credit: the
    /// step on the request side (a frame passes in parts there); on the response side, where a
    /// frame passes whole, enough for the frame if it outweighs a step.
    pub(crate) fn ask(&self, short: u64, whole_frames: bool) -> u32 {
        match whole_frames {
            true => u32::try_from(short.max(self.step.into())).unwrap_or(u32::MAX),
            false => self.step,
        }
    }

    /// Adds what an admitted step recorded to the credit; a refused one changes nothing.
    pub(crate) fn granted(&mut self, decision: Decision) {
        if !decision.is_allowed() {
            return;
        }
        self.left = self.left.saturating_add(decision.recorded);
        self.before = Some(std::mem::replace(&mut self.last, decision));
    }

    /// What a body does when its step of `units` could not be decided, under `mode`; under
    /// [`FailureMode::Open`] the units are added to the credit, uncounted.
    pub(crate) fn failed(&mut self, units: u32, mode: &FailureMode) -> OnFailure {
        match mode {
            FailureMode::Open => {
                self.uncounted(units);
                OnFailure::Pass
            }
            FailureMode::Closed => OnFailure::Cut,
            FailureMode::Fallback(_) => OnFailure::Fallback,
        }
    }

    /// Adds `units` that pass without a decision recording them (a refused step under a soft
    /// or shadow limit, a step the store could not decide under [`FailureMode::Open`]): used
    /// first, never refunded, charged by [`unrecorded`](Self::unrecorded) once used.
    pub(crate) fn uncounted(&mut self, units: u32) {
        self.left = self.left.saturating_add(units.into());
        self.uncounted = self.uncounted.saturating_add(units.into());
    }

    /// The units admitted and not used yet: what a frame may use without a step.
    pub(crate) fn left(&self) -> u64 {
        self.left
    }

    /// The units used so far.
    pub(crate) fn passed(&self) -> u64 {
        self.passed
    }

    /// The charge of the units that passed uncounted (on the last admitted decision; none
    /// where no decision admitted anything), once: taking it resets it.
    pub(crate) fn unrecorded(&mut self) -> Option<Settlement> {
        match std::mem::take(&mut self.unrecorded) {
            0 => None,
            units => Settlement::charge(&self.last, units),
        }
    }

    /// The refunds of the unused credit: from the last decision, within what it recorded,
    /// then the rest from the one before it. Empty once nothing is left; using the credit
    /// after this refunds it twice, so a body calls it once, when it ends or is dropped.
    pub(crate) fn unused(&mut self) -> [Option<Settlement>; 2] {
        let counted = self.left - self.uncounted.min(self.left);
        self.left = 0;
        self.uncounted = 0;
        let from_last = counted.min(self.last.recorded);
        let rest = counted - from_last;
        let refund = |decision: &Decision, units: u64| match units {
            0 => None,
            units => Settlement::refund(decision, units),
        };
        let before = self.before.as_ref().and_then(|d| refund(d, rest));
        [refund(&self.last, from_last), before]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::engine::Engine;
    use crate::{Key, MemoryStore, Policy};

    fn admitted(store: &MemoryStore, units: u32) -> Decision {
        let (key, policy) = (Key::from("ann"), "1000/1h".parse::<Policy>().unwrap());
        let decision = store.step_now(&key, &policy, units).unwrap().unwrap();
        assert!(decision.is_allowed());
        decision
    }

    fn refunded(refunds: &[Option<Settlement>; 2]) -> Vec<u64> {
        refunds
            .iter()
            .map(|r| r.as_ref().map_or(0, Settlement::units))
            .collect()
    }

    #[test]
    fn a_frame_passes_within_the_credit_and_the_rest_is_refunded() {
        let store = MemoryStore::new();
        let mut credit = Credit::new(100, admitted(&store, 100));
        assert_eq!(credit.cover(30), 30);
        assert_eq!(credit.cover(100), 70, "only what is left passes");
        assert_eq!(credit.passed(), 100);
        assert_eq!(refunded(&credit.unused()), [0, 0]);
    }

    #[test]
    fn the_unused_part_is_refunded_from_the_last_step_then_the_one_before() {
        let store = MemoryStore::new();
        let mut credit = Credit::new(100, admitted(&store, 100));
        assert_eq!(credit.cover(90), 90);
        // A whole frame of 150 is 140 short: the response side asks for all of it.
        assert_eq!(credit.ask(140, true), 140);
        assert_eq!(credit.ask(140, false), 100);
        credit.granted(admitted(&store, 140));
        // Nothing used since: 10 of the admission's and 140 of the step's are left.
        assert_eq!(refunded(&credit.unused()), [140, 10]);
        assert_eq!(refunded(&credit.unused()), [0, 0], "refunded once");
    }

    #[test]
    fn units_passed_uncounted_are_never_refunded() {
        let store = MemoryStore::new();
        let mut credit = Credit::new(100, admitted(&store, 100));
        assert_eq!(credit.cover(100), 100);
        assert_eq!(credit.failed(100, &FailureMode::Open), OnFailure::Pass);
        assert_eq!(credit.cover(40), 40);
        assert_eq!(refunded(&credit.unused()), [0, 0]);
        assert_eq!(credit.failed(100, &FailureMode::Closed), OnFailure::Cut);
    }

    #[test]
    fn a_refused_step_adds_nothing() {
        let store = MemoryStore::new();
        let mut credit = Credit::new(600, admitted(&store, 600));
        let (key, policy) = (Key::from("ann"), "1000/1h".parse::<Policy>().unwrap());
        let refused = store.step_now(&key, &policy, 600).unwrap().unwrap();
        assert!(!refused.is_allowed());
        credit.granted(refused);
        assert_eq!(credit.cover(700), 600);
        assert_eq!(refunded(&credit.unused()), [0, 0]);
    }
}
