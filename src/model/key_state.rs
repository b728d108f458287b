//! One key's state as the memory store keeps it, free of I/O and clocks: its algorithm's
//! state, its penalty box, its concurrency slots and its line of reservations, and how a
//! decision, a reservation or a settlement changes them. The Redis scripts keep the same
//! state in Redis and change it the same way: `scripts/prelude.lua` (the box, the slots and
//! their line of waiters, the modes), `scripts/line.lua` (the reservations) and each
//! algorithm's script.

use super::line::Line;
use super::slots::{Full, Slots, Waiter};
use super::turn::{reserve, Reserved};
use super::{
    decide, fixed_window::FixedWindow, gcra::Gcra, micros, settle, sliding_log::SlidingLog,
    sliding_window::SlidingWindow, Algorithm, Outcome, Settle, Window,
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
    /// The key's reservations waiting for their turns, and its pause ([`Reserve`]).
    pub(crate) line: Line,
}

/// The state of one key under the algorithm of its policy.
pub(crate) enum Of {
    Log(SlidingLog),
    Sliding(SlidingWindow),
    Fixed(FixedWindow),
    Gcra(Gcra),
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
    /// The request's place in its key's line for a slot, when it waits for one.
    pub(crate) waiter: Option<Waiter>,
    /// How much longer than its longest window the state must be kept ([`Stretch`]).
    pub(crate) stretch: Stretch,
    /// A reservation ([`Reserve`]).
    pub(crate) reserve: Option<Booking>,
}

/// A reservation's [`Ticket`] in the store's units (µs).
#[derive(Clone, Copy)]
pub(crate) struct Booking {
    pub(crate) id: u64,
    pub(crate) max_wait: u64,
    pub(crate) late: u64,
    pub(crate) notice: u64,
}

/// How much longer a GCRA state decided under an override's counts must be kept than their
/// longest window: its backlog holds units of cost, which weigh `count / count'` times more
/// under the policy's own counts than under the override's (`src/algorithm/gcra.rs`), so once
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
        let windows = policy.windows();
        match &mut self.of {
            Of::Log(log) => {
                trim(log, now.min(t), policy);
                decide(log, t, windows, cost, record)
            }
            Of::Sliding(s) => decide(s, t, windows, cost, record),
            Of::Fixed(s) => decide(s, t, windows, cost, record),
            Of::Gcra(s) => decide(s, t, windows, cost, record),
        }
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
            return StateAnswer {
                outcome,
                keep_until: Some(until),
                boxed: None,
                turn: None,
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
            };
        };
        if self.held_until > now && policy.block_micros() > 0 {
            return StateAnswer {
                outcome,
                keep_until: None,
                boxed: Some(retry),
                turn: None,
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
        }
    }

    /// Reserves `ask`'s cost for its turn, after the key's pause and within its most wait
    /// (`algorithm::reserve`), and puts it in the key's line: the answer of a request admitted
    /// at its turn, and the key kept a window past it. Its units may be used `late` after
    /// their turn: the log reads its windows that much longer, GCRA keeps that much drain free
    /// in every bucket (as Redis does, `gcra.lua`).
    pub(crate) fn reserve(&mut self, policy: &Policy, ask: &Ask, booking: Booking) -> StateAnswer {
        let Booking {
            id,
            max_wait,
            late,
            notice,
        } = booking;
        let (now, windows) = (ask.now, policy.windows());
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
            Reserved::At(turn) => {
                self.line.join(now, turn, id, (ask.cost, notice));
                Reserved::At(turn)
            }
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
        let windows = policy.windows();
        match &mut self.of {
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

/// Drops the events no window around `t` or later can hold.
pub(crate) fn trim(log: &mut SlidingLog, t: u64, policy: &Policy) {
    if let Some(cutoff) = t.checked_sub(micros(policy.longest_window())) {
        log.trim(cutoff);
    }
}

/// When the state left by an event at `t`, decided at `now`, stops mattering: a window after
/// the later of the two (a future event counts until its window has passed), `stretch`ed.
pub(crate) fn expiry(policy: &Policy, now: u64, t: u64, stretch: Stretch) -> u64 {
    let retention = micros(policy.algorithm().retention(policy.longest_window()));
    now.max(t).saturating_add(stretch.apply(retention))
}
