//! One key's state as the memory store keeps it, free of I/O and clocks: its algorithm's
//! state, its penalty box, its concurrency slots and its line of reservations, and how a
//! decision, a reservation or a settlement changes them. The Redis scripts keep the same
//! state in Redis and change it the same way: `scripts/prelude.lua` (the box, the slots and
//! their queue of waiters, the modes), `scripts/line.lua` (the line of reservations) and each
//! algorithm's script (its `RESERVE` mode for a reservation's turn).

use super::attempts::{Attempts, BUSY_RETRY};
use super::line::Line;
use super::slots::{Full, Slots, Waiter};
use super::turn::{reserve, Reserved};
use super::{
    decide, fixed_window::FixedWindow, gcra::Gcra, micros, settle, sliding_log::SlidingLog,
    sliding_window::SlidingWindow, Algorithm, Outcome, Refund, Settle, Window,
};
use crate::Policy;

/// One key's state: which one it is, and its algorithm's state.
pub(crate) struct KeyState {
    /// This state's number, from the store's count of the states it has made (from 1). A
    /// refund applies only to the state that recorded its request (`Decision`'s `state`):
    /// one made afresh since (a reset, an expiry, an eviction) never held its units, even
    /// when made in the same microsecond, as on a clock that stands still.
    pub(crate) number: u64,
    pub(crate) of: Of,
    /// Until when (µs) the key is in its policy's penalty box (the box's own length); 0 when
    /// it never was. Requests are then refused whatever the limits say.
    pub(crate) boxed_until: u64,
    /// Until when (µs) the box holds once its length has passed, unless the key is admitted
    /// first (0: no box): the limits decide again, but a refusal of theirs is the box's, and
    /// sets no new one. Set with the box to the later of its end and the state's expiry.
    pub(crate) held_until: u64,
    /// Until when (µs) the key is refused, as the refusal that set its box said (the later of
    /// the box's end and the limits' own retry): the map keeps the key that long, so that a
    /// flood of other keys cannot evict a locked-out one and give it a fresh budget.
    pub(crate) locked_until: u64,
    /// The key's concurrency slots, when its policy has a concurrency limit.
    pub(crate) slots: Slots,
    /// The key's reservations waiting for their turns, and its pause (`store::Reserve`).
    pub(crate) line: Line,
    /// The key's attempts in flight, when its policy counts requests by their outcome.
    pub(crate) attempts: Attempts,
}

/// The state of one key under the algorithm of its policy.
#[derive(Clone)]
pub(crate) enum Of {
    Log(SlidingLog),
    Sliding(SlidingWindow),
    Fixed(FixedWindow),
    Gcra(Gcra),
}

impl Of {
    /// Decides at `t` (µs); `now` is the store's time, which may differ for event times.
    fn decide(&mut self, now: u64, t: u64, policy: &Policy, cost: u64, record: bool) -> Outcome {
        let windows = policy.windows();
        match self {
            Of::Log(log) => {
                trim(log, now, policy);
                decide(log, t, windows, cost, record)
            }
            Of::Sliding(s) => decide(s, t, windows, cost, record),
            Of::Fixed(s) => decide(s, t, windows, cost, record),
            Of::Gcra(s) => decide(s, t, windows, cost, record),
        }
    }

    /// Records a settlement at `now`; how long the state matters from now on, when that can
    /// be longer than the policy's retention (a GCRA bucket charged past its size).
    fn settle(&mut self, now: u64, policy: &Policy, change: Settle) -> u64 {
        let windows = policy.windows();
        match self {
            Of::Log(log) => {
                trim(log, now, policy);
                settle(log, now, windows, change);
                0
            }
            Of::Sliding(s) => {
                settle(s, now, windows, change);
                0
            }
            Of::Fixed(s) => {
                settle(s, now, windows, change);
                0
            }
            Of::Gcra(s) => {
                settle(s, now, windows, change);
                s.drained_in(now, windows)
            }
        }
    }
}

/// What one decision asks, in the store's units.
pub(crate) struct Ask {
    /// The store's time (µs).
    pub(crate) now: u64,
    /// The time (µs) decided at: `now`, or the request's event time.
    pub(crate) t: u64,
    pub(crate) cost: u64,
    /// Whether an admitted request is recorded (a check) or only looked at (a peek).
    pub(crate) record: bool,
    /// The concurrency slot an admitted request takes: only a recorded decision under a
    /// concurrency limit takes one.
    pub(crate) take: Option<Take>,
    /// The request's place in its key's queue for a slot, when it waits for one.
    pub(crate) waiter: Option<Waiter>,
    /// How much longer than its longest window the state must be kept ([`Stretch`]).
    pub(crate) stretch: Stretch,
    /// A reservation (`store::Reserve`).
    pub(crate) reserve: Option<Booking>,
    /// The attempt a recorded request is, when its policy counts requests by their outcome
    /// (`Policy::counting_attempts`): its id.
    pub(crate) attempt: Option<u64>,
}

/// A reservation's ticket (`store::reserve::Ticket`) in the store's units (µs).
#[derive(Clone, Copy)]
pub(crate) struct Booking {
    pub(crate) id: u64,
    pub(crate) max_wait: u64,
    pub(crate) late: u64,
    pub(crate) notice: u64,
}

/// How much longer a GCRA state decided under an override's counts must be kept than their
/// longest window: its backlog holds units of cost, which weigh `count / count'` times more
/// under the policy's own counts than under the override's (`gcra.rs`), so once
/// the override is removed it drains that much slower. The largest such ratio of the limits, as
/// a fraction; 1 for the other algorithms, whose state is kept by time alone.
#[derive(Clone, Copy)]
pub(crate) struct Stretch(u64, u64);

impl Stretch {
    pub(crate) const NONE: Stretch = Stretch(1, 1);

    /// The stretch of state decided under `used`, the counts in force for a key of `own`.
    pub(crate) fn of(own: &Policy, used: &Policy) -> Stretch {
        if used.algorithm() != Algorithm::Gcra {
            return Stretch::NONE;
        }
        let pairs = own.limits().iter().zip(used.limits());
        pairs.fold(Stretch::NONE, |most, (own, used)| {
            let (over, under) = (used.count(), own.count().max(1));
            match u128::from(over) * u128::from(most.1) > u128::from(most.0) * u128::from(under) {
                true => Stretch(over, under),
                false => most,
            }
        })
    }

    /// `micros` stretched, rounded up.
    pub(crate) fn apply(self, micros: u64) -> u64 {
        let stretched = (u128::from(micros) * u128::from(self.0)).div_ceil(u128::from(self.1));
        u64::try_from(stretched).unwrap_or(u64::MAX)
    }
}

/// The concurrency slot a request takes when admitted.
#[derive(Clone, Copy)]
pub(crate) struct Take {
    /// The policy's concurrency limit.
    pub(crate) cap: u32,
    pub(crate) id: u64,
    /// Until when (µs) the slot is held unless renewed.
    pub(crate) until: u64,
}

/// A refusal met before the limits decide a request ([`KeyState::refusal`]).
pub(crate) enum Refusal {
    /// The limits refuse it, and no wait helps (it is larger than a limit itself).
    Limits(Outcome),
    /// The key is in its penalty box, for this long (µs): the later of the box's end and the
    /// limits' own retry.
    Boxed(u64),
    /// The key holds every concurrency slot.
    SlotsFull(Full),
}

/// What a key's state answered, under its shard's lock.
pub(crate) struct StateAnswer {
    pub(crate) outcome: Outcome,
    /// Until when (µs) the key's state must be kept, when the decision recorded something:
    /// the request it admitted, or the penalty box its refusal earned.
    pub(crate) keep_until: Option<u64>,
    /// When the penalty box answers the refusal (it set the box, or the box holds): its
    /// retry (µs), the later of the box's end and the limits' own retry.
    pub(crate) boxed: Option<u64>,
    /// A reservation's turn (µs, the store's time), when it was reserved.
    pub(crate) turn: Option<u64>,
    /// Refused only because attempts in flight hold the units the request needs
    /// (`model::attempts`): no penalty box, and the outcome's retry is at most `BUSY_RETRY`.
    pub(crate) busy: bool,
}

impl KeyState {
    pub(crate) fn new(algorithm: Algorithm, number: u64) -> KeyState {
        let of = match algorithm {
            Algorithm::SlidingLog => Of::Log(SlidingLog::default()),
            Algorithm::SlidingWindow => Of::Sliding(SlidingWindow::default()),
            Algorithm::FixedWindow => Of::Fixed(FixedWindow::default()),
            Algorithm::Gcra => Of::Gcra(Gcra::default()),
        };
        KeyState {
            number,
            of,
            boxed_until: 0,
            held_until: 0,
            locked_until: 0,
            slots: Slots::default(),
            line: Line::default(),
            attempts: Attempts::default(),
        }
    }

    /// Puts the key in `policy`'s penalty box from `now`, if it has one and is not in one
    /// already (nothing extends a box), holding it at least until `kept` (the state's
    /// expiry); `retry` is the limits' own (µs). Until when the box lasts.
    pub(crate) fn penalize(
        &mut self,
        now: u64,
        policy: &Policy,
        kept: u64,
        retry: u64,
    ) -> Option<u64> {
        let block = policy.block_micros();
        if block == 0 || self.held_until > now {
            return None;
        }
        self.boxed_until = now.saturating_add(block);
        self.held_until = self.boxed_until.max(kept);
        self.locked_until = self.boxed_until.max(now.saturating_add(retry));
        Some(self.boxed_until)
    }

    /// Puts the key in `policy`'s penalty box, if it has one and is not in one already, when
    /// a charge has left it no unit (a look for one more would be refused); until when.
    pub(crate) fn penalize_if_full(&mut self, now: u64, policy: &Policy, kept: u64) -> Option<u64> {
        if policy.block_micros() == 0 || self.held_until > now {
            return None;
        }
        let looked = self.decide(now, now, policy, 1, false);
        if looked.allowed {
            return None;
        }
        self.penalize(now, policy, kept, looked.retry_after.unwrap_or(0))
    }

    pub(crate) fn algorithm(&self) -> Algorithm {
        match self.of {
            Of::Log(_) => Algorithm::SlidingLog,
            Of::Sliding(_) => Algorithm::SlidingWindow,
            Of::Fixed(_) => Algorithm::FixedWindow,
            Of::Gcra(_) => Algorithm::Gcra,
        }
    }

    /// Decides at `t` (µs); `now` is the store's time, which may differ for event times.
    pub(crate) fn decide(
        &mut self,
        now: u64,
        t: u64,
        policy: &Policy,
        cost: u64,
        record: bool,
    ) -> Outcome {
        self.of.decide(now, t, policy, cost, record)
    }

    /// Whether `ask`, refused, would be admitted were the key's attempts in flight given back
    /// as their refunds would give them back: then they alone refuse it, and the refusal is
    /// busy (`model::attempts`). Units that have left a window, or drained, or that charges
    /// past the count outweigh, keep the refusal one of the counted outcomes.
    fn fits_without_attempts(&self, policy: &Policy, ask: &Ask) -> bool {
        let mut live = self.attempts.live(ask.now).peekable();
        if live.peek().is_none() {
            return false;
        }
        let mut of = self.of.clone();
        for attempt in live {
            let refund = Refund {
                units: attempt.units,
                at: Some(attempt.at),
                recorded: attempt.units,
            };
            of.settle(ask.now, policy, Settle::Refund(refund));
        }
        of.decide(ask.now, ask.t, policy, ask.cost, false).allowed
    }

    /// The refusal a request meets before the limits decide it: the key is in its penalty
    /// box, or the request would take a concurrency slot and the key holds every one.
    ///
    /// In the box, the limits are looked at without recording, and the refusal's retry is the
    /// later of the box's end and theirs: the time until the same request is admitted. A
    /// request that no wait helps (larger than a limit itself) gets the limits' refusal.
    pub(crate) fn refusal(&mut self, policy: &Policy, ask: &Ask) -> Option<Refusal> {
        // The state is the policy's name's (`Policy::state_id`): a box another policy of the
        // name set answers only for policies with a box, as on Redis.
        let boxes = policy.block_micros() > 0;
        if boxes && self.boxed_until > ask.now {
            let looked = self.decide(ask.now, ask.t, policy, ask.cost, false);
            if !looked.allowed && looked.retry_after.is_none() {
                return Some(Refusal::Limits(looked));
            }
            let left = (self.boxed_until - ask.now).max(looked.retry_after.unwrap_or(0));
            return Some(Refusal::Boxed(left));
        }
        let full = self
            .slots
            .full(ask.now, ask.take?.cap, ask.waiter.as_ref())?;
        Some(Refusal::SlotsFull(full))
    }

    /// Decides `ask` against the limits, and keeps what a recorded decision leaves: the
    /// request it admits and the concurrency slot that takes, or the penalty box of a refusal.
    /// `kept` is until when the key's state is kept so far (0: new).
    pub(crate) fn answer(&mut self, policy: &Policy, ask: &Ask, kept: u64) -> StateAnswer {
        if let Some(booking) = ask.reserve {
            return self.reserve(policy, ask, booking);
        }
        let (now, t) = (ask.now, ask.t);
        let outcome = self.decide(now, t, policy, ask.cost, ask.record);
        if ask.record && outcome.allowed {
            // The key is admitted again: a box that held past its length ends.
            (self.held_until, self.locked_until) = (0, 0);
            let mut until = expiry(policy, now, t, ask.stretch);
            if let Some(take) = ask.take {
                self.slots.take(take.id, take.until, ask.waiter.as_ref());
                until = until.max(take.until);
            }
            if let Some(id) = ask.attempt {
                self.attempts.start(now, id, ask.cost);
            }
            return StateAnswer {
                outcome,
                keep_until: Some(until),
                boxed: None,
                turn: None,
                busy: false,
            };
        }
        // Refused by a limit that a wait satisfies (not a request larger than the limit
        // itself, which no wait helps and the key did not earn): the box answers, the one
        // that still holds, or a new one a recorded refusal sets.
        let Some(retry) = outcome.retry_after else {
            return StateAnswer {
                outcome,
                keep_until: None,
                boxed: None,
                turn: None,
                busy: false,
            };
        };
        if self.held_until > now && policy.block_micros() > 0 {
            return StateAnswer {
                outcome,
                keep_until: None,
                boxed: Some(retry),
                turn: None,
                busy: false,
            };
        }
        // Refused only because attempts in flight hold what it needs: busy, no failure.
        let busy = ask.attempt.is_some() && self.fits_without_attempts(policy, ask);
        if busy {
            let outcome = Outcome {
                retry_after: Some(retry.min(BUSY_RETRY)),
                ..outcome
            };
            return StateAnswer {
                outcome,
                keep_until: None,
                boxed: None,
                turn: None,
                busy: true,
            };
        }
        let until = match ask.record {
            true => self.penalize(now, policy, kept, retry),
            false => None,
        };
        StateAnswer {
            outcome,
            keep_until: until,
            boxed: until.map(|until| (until - now).max(retry)),
            turn: None,
            busy: false,
        }
    }

    /// Reserves `ask`'s cost for its turn, after the key's pause and within its most wait
    /// ([`reserve`]), and puts it in the key's line: the answer of a request admitted
    /// at its turn, and the key kept a window past it. Its units may be used `late` after
    /// their turn, and those of the key's other recent reservations their own late after
    /// theirs: the log reads its windows the longest of those longer, GCRA keeps that much
    /// drain free in every bucket (as Redis does, `gcra.lua`; [`Line::late`]).
    pub(crate) fn reserve(&mut self, policy: &Policy, ask: &Ask, booking: Booking) -> StateAnswer {
        let Booking {
            id,
            max_wait,
            late,
            notice,
        } = booking;
        let (now, windows) = (ask.now, policy.windows());
        // Read as late as the key's latest-used reservations may go, not only this one.
        let longest = windows.iter().map(|w| w.micros).max().unwrap_or(0);
        let late = self.line.late(now, late, max_wait.saturating_add(longest));
        // Reserved as if asked at the pause's end, so that GCRA's bucket drains from there.
        let from = self.line.floor(now);
        let shift = from - now;
        let reserved = match (&mut self.of, max_wait.checked_sub(shift)) {
            (_, None) => Reserved::TooLate(Some(0)),
            (Of::Log(log), Some(wait)) => {
                trim(log, now.saturating_sub(late), policy);
                let longer: Vec<Window> = windows
                    .iter()
                    .map(|w| Window::new(w.count, w.micros.saturating_add(late)))
                    .collect();
                reserve(log, from, &longer, ask.cost, wait)
            }
            (Of::Gcra(bucket), Some(wait)) => {
                let tighter: Vec<Window> = windows
                    .iter()
                    .map(|w| Window {
                        micros: w.micros.saturating_sub(late),
                        ..*w
                    })
                    .collect();
                reserve(bucket, from, &tighter, ask.cost, wait)
            }
            // `reservable` refuses them first.
            (Of::Sliding(_) | Of::Fixed(_), _) => Reserved::TooLate(None),
        };
        let reserved = match reserved {
            Reserved::TooLate(wait) => Reserved::TooLate(wait.map(|w| w + shift)),
            Reserved::At(turn) => Reserved::At(self.line.join(now, turn, id, (ask.cost, notice))),
        };
        let (turn, outcome) = match reserved {
            Reserved::At(turn) => (Some(turn), self.decide(now, turn, policy, 0, false)),
            Reserved::TooLate(wait) => {
                let looked = self.decide(now, now, policy, ask.cost, false);
                let refused = Outcome {
                    allowed: false,
                    retry_after: wait,
                    ..looked
                };
                (None, refused)
            }
        };
        StateAnswer {
            outcome,
            keep_until: turn.map(|turn| expiry(policy, now, turn, ask.stretch) + late),
            boxed: None,
            turn,
            busy: false,
        }
    }

    /// How long from `now` the state matters under `policy`'s counts, when that can be longer
    /// than the policy's retention from its last write (a GCRA backlog, read under other
    /// counts than it was written under, or overfilled by a charge); 0 otherwise.
    pub(crate) fn drained_in(&self, now: u64, policy: &Policy) -> u64 {
        match &self.of {
            Of::Gcra(s) => s.drained_in(now, policy.windows()),
            _ => 0,
        }
    }

    /// Records a settlement at `now`; returns how long the state matters from now on, when
    /// that can be longer than the policy's retention (a GCRA bucket charged past its size).
    pub(crate) fn settle(&mut self, now: u64, policy: &Policy, change: Settle) -> u64 {
        self.of.settle(now, policy, change)
    }
}

/// Drops the events no decision from `now` on can read: its time is at most the longest window
/// before `now` (`Store::check_at` refuses older ones), and its windows reach one further back.
pub(crate) fn trim(log: &mut SlidingLog, now: u64, policy: &Policy) {
    let kept = micros(policy.longest_window()).saturating_mul(2);
    if let Some(cutoff) = now.checked_sub(kept) {
        log.trim(cutoff);
    }
}

/// When the state left by an event at `t`, decided at `now`, stops mattering: a window after
/// the later of the two (a future event counts until its window has passed), `stretch`ed.
pub(crate) fn expiry(policy: &Policy, now: u64, t: u64, stretch: Stretch) -> u64 {
    let retention = micros(policy.algorithm().retention(policy.longest_window()));
    now.max(t).saturating_add(stretch.apply(retention))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::model::Settle;

    const S: u64 = 1_000_000;

    fn policy(text: &str, algorithm: Algorithm) -> Policy {
        text.parse::<Policy>().unwrap().with_algorithm(algorithm)
    }

    fn boxed(text: &str, algorithm: Algorithm, seconds: u64) -> Policy {
        let block = Duration::from_secs(seconds);
        policy(text, algorithm).block_for(block).unwrap()
    }

    /// A recorded request of `cost` at `now`.
    fn ask(now: u64, cost: u64) -> Ask {
        Ask {
            now,
            t: now,
            cost,
            record: true,
            take: None,
            waiter: None,
            stretch: Stretch::NONE,
            reserve: None,
            attempt: None,
        }
    }

    #[test]
    fn an_admission_is_kept_a_window_and_a_refusal_records_nothing() {
        // The log two: event times up to a window back read a window further back.
        for (algorithm, kept) in [(Algorithm::SlidingLog, 120 * S), (Algorithm::Gcra, 60 * S)] {
            let p = policy("2/1m", algorithm);
            let mut state = KeyState::new(algorithm, 1);
            let first = state.answer(&p, &ask(0, 1), 0);
            assert!(first.outcome.allowed);
            assert_eq!(first.keep_until, Some(kept));
            assert!(state.answer(&p, &ask(S, 1), 0).outcome.allowed);
            let refused = state.answer(&p, &ask(2 * S, 1), 0);
            assert!(!refused.outcome.allowed && refused.keep_until.is_none());
            assert_eq!(
                refused.boxed, None,
                "{algorithm:?}: no box without block_for"
            );
            // The refusals recorded nothing: the key admits again at its retry.
            let retry = refused.outcome.retry_after.unwrap();
            assert!(state.answer(&p, &ask(2 * S + retry, 1), 0).outcome.allowed);
        }
    }

    #[test]
    fn a_recorded_refusal_boxes_the_key_for_the_later_of_the_box_and_the_limits() {
        let p = boxed("1/1m", Algorithm::SlidingLog, 300);
        let mut state = KeyState::new(Algorithm::SlidingLog, 1);
        assert!(state.answer(&p, &ask(0, 1), 0).outcome.allowed);
        let refused = state.answer(&p, &ask(S, 1), 60 * S);
        assert_eq!(refused.boxed, Some(300 * S));
        assert_eq!(refused.keep_until, Some(301 * S));
        // In the box, a request meets the box's refusal, with the time left of it; the limits
        // (which admit again at 60 s) decide nothing.
        match state.refusal(&p, &ask(100 * S, 1)) {
            Some(Refusal::Boxed(left)) => assert_eq!(left, 201 * S),
            _ => panic!("the box refuses"),
        }
        // After its end the limits decide, and an admission ends the box.
        assert!(state.refusal(&p, &ask(302 * S, 1)).is_none());
        assert!(state.answer(&p, &ask(302 * S, 1), 0).outcome.allowed);
        assert_eq!((state.held_until, state.locked_until), (0, 0));
    }

    #[test]
    fn a_box_shorter_than_the_limits_answers_with_the_limits_retry() {
        let p = boxed("1/1h", Algorithm::Gcra, 60);
        let mut state = KeyState::new(Algorithm::Gcra, 1);
        assert!(state.answer(&p, &ask(0, 1), 0).outcome.allowed);
        let refused = state.answer(&p, &ask(S, 1), 3600 * S);
        assert_eq!(
            refused.boxed,
            Some(3599 * S),
            "the limits' retry, not the box's 60 s"
        );
        match state.refusal(&p, &ask(30 * S, 1)) {
            Some(Refusal::Boxed(left)) => assert_eq!(left, 3570 * S),
            _ => panic!("the box refuses"),
        }
    }

    #[test]
    fn a_peek_or_a_cost_over_the_limit_earns_no_box() {
        let p = boxed("2/1m", Algorithm::SlidingLog, 300);
        let mut state = KeyState::new(Algorithm::SlidingLog, 1);
        let too_large = state.answer(&p, &ask(0, 3), 0);
        assert!(!too_large.outcome.allowed && too_large.outcome.retry_after.is_none());
        assert_eq!((too_large.boxed, state.boxed_until), (None, 0));
        state.answer(&p, &ask(0, 2), 0);
        let peek = Ask {
            record: false,
            ..ask(S, 1)
        };
        let looked = state.answer(&p, &peek, 60 * S);
        assert!(!looked.outcome.allowed);
        assert_eq!((looked.boxed, state.boxed_until), (None, 0));
    }

    #[test]
    fn a_full_key_refuses_a_slot_before_the_limits_and_an_admission_takes_one() {
        let p = policy("100/1m", Algorithm::Gcra).concurrency(1).unwrap();
        let mut state = KeyState::new(Algorithm::Gcra, 1);
        let take = |id| Take {
            cap: 1,
            id,
            until: 10 * S,
        };
        let first = Ask {
            take: Some(take(1)),
            ..ask(0, 1)
        };
        assert!(state.refusal(&p, &first).is_none());
        let admitted = state.answer(&p, &first, 0);
        assert_eq!(admitted.keep_until, Some(60 * S));
        let second = Ask {
            take: Some(take(2)),
            ..ask(S, 1)
        };
        match state.refusal(&p, &second) {
            Some(Refusal::SlotsFull(full)) => assert_eq!(full.left, 9 * S),
            _ => panic!("the only slot is held"),
        }
        // The slot released, the next request takes it.
        assert!(state.slots.release(1, S));
        assert!(state.refusal(&p, &second).is_none());
    }

    #[test]
    fn a_charge_that_fills_the_key_boxes_it() {
        let p = boxed("10/1m", Algorithm::FixedWindow, 600);
        let mut state = KeyState::new(Algorithm::FixedWindow, 1);
        state.settle(0, &p, Settle::Charge(9));
        assert_eq!(
            state.penalize_if_full(0, &p, 60 * S),
            None,
            "one unit is left"
        );
        state.settle(0, &p, Settle::Charge(1));
        assert_eq!(state.penalize_if_full(0, &p, 60 * S), Some(600 * S));
        // A second charge does not extend the box.
        state.settle(S, &p, Settle::Charge(5));
        assert_eq!(state.penalize_if_full(S, &p, 60 * S), None);
        assert_eq!(state.boxed_until, 600 * S);
    }

    #[test]
    fn reservations_take_turns_in_order_and_refuse_past_their_wait() {
        let p = policy("1/1s", Algorithm::Gcra);
        let mut state = KeyState::new(Algorithm::Gcra, 1);
        let reserve = |id, max_wait| Ask {
            reserve: Some(Booking {
                id,
                max_wait,
                late: 0,
                notice: 0,
            }),
            ..ask(0, 1)
        };
        let turns: Vec<_> = (1..=3)
            .map(|id| state.answer(&p, &reserve(id, 10 * S), 0).turn)
            .collect();
        assert_eq!(turns, [Some(0), Some(S), Some(2 * S)]);
        assert_eq!(state.line.last(), Some(2 * S));
        // The fourth would go at 3 s: past a wait of 2 s, it is refused with that turn and
        // nothing is recorded.
        let late = state.answer(&p, &reserve(4, 2 * S), 0);
        assert_eq!((late.turn, late.outcome.retry_after), (None, Some(3 * S)));
        assert_eq!(state.line.last(), Some(2 * S));
    }

    #[test]
    fn a_reservation_reads_the_windows_as_late_as_the_keys_latest_used_reservation() {
        // One reservation whose units may be used 200 ms late, then one of 50 ms: the second
        // reads the key 200 ms late too (the log's window 1.2 s, GCRA's drain 200 ms free).
        let ms = |n: u64| n * S / 1_000;
        let reserve = |id, late| Ask {
            reserve: Some(Booking {
                id,
                max_wait: 10 * S,
                late,
                notice: 0,
            }),
            ..ask(0, 1)
        };
        for (algorithm, limit, second) in [
            (Algorithm::SlidingLog, "1/1s", ms(1_200)),
            (Algorithm::Gcra, "2/1s", ms(200)),
        ] {
            let p = policy(limit, algorithm);
            let mut state = KeyState::new(algorithm, 1);
            let first = state.answer(&p, &reserve(1, ms(200)), 0);
            assert_eq!(first.turn, Some(0), "{algorithm:?}");
            let near = state.answer(&p, &reserve(2, ms(50)), 0);
            assert_eq!(near.turn, Some(second), "{algorithm:?}");
        }
    }

    #[test]
    fn gcra_state_under_raised_counts_is_kept_longer_by_their_ratio() {
        let own = policy("5/1h", Algorithm::Gcra);
        let raised = own.with_limits(["8/1h".parse().unwrap()]).unwrap();
        let stretch = Stretch::of(&own, &raised);
        assert_eq!(stretch.apply(3600 * S), 5760 * S);
        assert_eq!(expiry(&raised, 0, 0, stretch), 5760 * S);
        // Lowered counts, and the other algorithms, keep the state a window.
        let lowered = own.with_limits(["2/1h".parse().unwrap()]).unwrap();
        assert_eq!(Stretch::of(&own, &lowered).apply(3600 * S), 3600 * S);
        let log = policy("5/1h", Algorithm::SlidingLog);
        let log_raised = log.with_limits(["8/1h".parse().unwrap()]).unwrap();
        assert_eq!(Stretch::of(&log, &log_raised).apply(3600 * S), 3600 * S);
    }
}
