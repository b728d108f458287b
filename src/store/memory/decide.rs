//! How the memory store decides: under the limits in force for the key (an override's, or
//! the policy's own), with the key's shard locked only while its state answers.

use std::future::{ready, Ready};
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use super::clock::since_epoch;
use super::{MemoryStore, Shared};
use crate::model::key_state::{expiry, Ask, KeyState, Refusal, StateAnswer, Stretch, Take};
use crate::model::slots::Waiter;
use crate::model::{micros, Refund, Settle};
use crate::settlement::Owed;
use crate::shards::Entry;
use crate::store::overrides::Applied;
use crate::store::StoreError;
use crate::{Decision, Key, Policy, Settlement};

/// What a settle or a waiter leaving does to a key's concurrency slots.
pub(crate) enum SlotOp {
    Release { id: u64, held: Duration },
    Renew(u64),
    Leave(u64),
}

impl MemoryStore {
    pub(super) fn now(&self) -> u64 {
        micros(self.shared.clock.now())
    }

    /// Decides at event time `at` (`None`: now), recording an admitted request if `record`.
    pub(super) fn decide(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        at: Option<SystemTime>,
        record: bool,
        waiter: Option<&Waiter>,
    ) -> Ready<Result<Decision, StoreError>> {
        if let Err(error) = decidable(policy, at) {
            return ready(Err(error));
        }
        // The concurrency limit is the request's policy's, whatever counts an override sets.
        let ask = Ask {
            waiter: waiter.copied(),
            ..self.ask(policy, cost, at, record)
        };
        if at.is_some() {
            return ready(self.decide_event(key, policy, ask));
        }
        ready(Ok(self.decide_overridden(key, policy, ask)))
    }

    /// Decides a step of a metered body (`Engine::step`) now, by the limits alone, as an
    /// event time is: the penalty box neither refuses it nor is set by it, and it takes no
    /// concurrency slot and is no attempt, whatever the policy says of those.
    pub(super) fn step_units(
        &self,
        key: &Key,
        policy: &Policy,
        units: u32,
    ) -> Ready<Result<Decision, StoreError>> {
        if let Err(error) = decidable(policy, None) {
            return ready(Err(error));
        }
        // Asked as a peek is (no slot drawn, no attempt), then recorded.
        let ask = Ask {
            record: true,
            ..self.ask(policy, units, None, false)
        };
        ready(Ok(self.under_overrides(
            key,
            policy,
            ask,
            MemoryStore::event_under,
        )))
    }

    /// Decides an event at its own time (`Store::check_at`), by the limits alone: the penalty
    /// box is the requests' of now, and an event neither meets it nor sets or ends it. A time
    /// further back than the longest window is refused: the log keeps what the windows around
    /// times up to that far back need ([`trim`](crate::model::key_state::trim)).
    fn decide_event(&self, key: &Key, policy: &Policy, ask: Ask) -> Result<Decision, StoreError> {
        let longest = micros(policy.longest_window());
        if ask.t < ask.now.saturating_sub(longest) {
            return Err(StoreError::EventTooOld);
        }
        Ok(self.under_overrides(key, policy, ask, MemoryStore::event_under))
    }

    /// Decides the event `ask` for `key` under `policy`, the limits in force for it; an
    /// admitted event keeps the key a retention past the later of its time and now.
    fn event_under(&self, key: &Key, policy: &Policy, ask: &Ask) -> Decision {
        let (now, t, algorithm) = (ask.now, ask.t, policy.algorithm());
        let keep = expiry(policy, now, t, ask.stretch);
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let answer = match shard.get(key, policy.state_id(), now) {
            Some(entry) => {
                if !entry.is_live(now) || entry.value.algorithm() != algorithm {
                    entry.value = self.shared.fresh(algorithm);
                }
                let outcome = entry.value.decide(now, t, policy, ask.cost, ask.record);
                if outcome.allowed && ask.record {
                    entry.expires = entry.expires.max(keep);
                }
                (outcome, entry.value.number)
            }
            None => {
                let mut state = self.shared.fresh(algorithm);
                let outcome = state.decide(now, t, policy, ask.cost, ask.record);
                let number = state.number;
                if outcome.allowed && ask.record {
                    shard.insert(key, policy.state_id(), now, keep, state);
                }
                (outcome, number)
            }
        };
        drop(shard);
        let (outcome, number) = answer;
        let answer = StateAnswer {
            outcome,
            keep_until: None,
            boxed: None,
            turn: None,
            busy: false,
        };
        decision((answer, number), policy, ask)
    }

    /// Decides `ask` under the limits in force for `key` (an override's, or `policy`'s own).
    pub(super) fn decide_overridden(&self, key: &Key, policy: &Policy, ask: Ask) -> Decision {
        self.under_overrides(key, policy, ask, MemoryStore::decide_under)
    }

    /// `decide`s `ask` under the limits in force for `key`: an override's (its state kept
    /// longer by the [`Stretch`] of its counts), or `policy`'s own; a blocked key is refused.
    fn under_overrides(
        &self,
        key: &Key,
        policy: &Policy,
        ask: Ask,
        decide: fn(&MemoryStore, &Key, &Policy, &Ask) -> Decision,
    ) -> Decision {
        match self.shared.overrides.apply(key, policy) {
            Applied::Own(policy) => decide(self, key, policy, &ask),
            Applied::Other(used) => {
                let stretch = Stretch::of(policy, &used);
                decide(self, key, &used, &Ask { stretch, ..ask })
            }
            Applied::Blocked => Decision::blocked(policy),
        }
    }

    /// What a decision of `cost` at event time `at` (`None`: now) asks; a recorded one under a
    /// concurrency limit draws the id of the slot it takes if admitted.
    pub(super) fn ask(
        &self,
        policy: &Policy,
        cost: u32,
        at: Option<SystemTime>,
        record: bool,
    ) -> Ask {
        let now = self.now();
        let take = policy
            .concurrency_limit()
            .filter(|_| record)
            .map(|cap| Take {
                cap,
                id: self.shared.next_slot.fetch_add(1, Ordering::Relaxed),
                until: now.saturating_add(policy.slot_micros()),
            });
        Ask {
            now,
            t: at.map_or(now, |at| micros(since_epoch(at))),
            cost: u64::from(cost),
            record,
            take,
            waiter: None,
            stretch: Stretch::NONE,
            reserve: None,
            // Event times are no attempts: a scheduler's bookings have no outcome to wait for.
            attempt: (record && at.is_none() && policy.attempts())
                .then(|| self.shared.next_slot.fetch_add(1, Ordering::Relaxed)),
        }
    }

    /// Decides `ask` for `key` under `policy`, the limits in force for it, holding the key's
    /// shard locked only while its state answers.
    pub(super) fn decide_under(&self, key: &Key, policy: &Policy, ask: &Ask) -> Decision {
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let answer = match shard.get(key, policy.state_id(), ask.now) {
            Some(entry) => match answer_held(entry, policy, ask, &self.shared) {
                Ok(answer) => (answer, entry.value.number),
                Err(refusal) => return refusal.decided_at(i64::try_from(ask.t).unwrap_or(0)),
            },
            None => {
                let mut state = self.shared.fresh(policy.algorithm());
                let answer = state.answer(policy, ask, 0);
                let number = state.number;
                // The map holds a key once a decision has recorded something for it.
                if let Some(until) = answer.keep_until {
                    shard.insert(key, policy.state_id(), ask.now, until, state);
                }
                (answer, number)
            }
        };
        drop(shard);
        decision(answer, policy, ask)
    }

    /// Does `op` to the concurrency slots of `key` under `policy`; whether the slot (or the
    /// waiter) was there.
    pub(super) fn keep_slot(&self, key: &Key, policy: &Policy, op: SlotOp) -> bool {
        let now = self.now();
        let until = now.saturating_add(policy.slot_micros());
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let Some(entry) = shard.get(key, policy.state_id(), now) else {
            return false;
        };
        if !entry.is_live(now) {
            return false;
        }
        let slots = &mut entry.value.slots;
        match op {
            SlotOp::Release { id, held } => slots.release(id, micros(held)),
            SlotOp::Leave(id) => slots.leave(id),
            SlotOp::Renew(id) => {
                let kept = slots.renew(now, id, until);
                entry.expires = entry.expires.max(slots.last_expiry());
                kept
            }
        }
    }

    /// The policy whose counts `key` is decided by under `policy` (an override's, or its
    /// own, a blocked key's too), and how much longer its state is kept for it ([`Stretch`]).
    pub(super) fn in_force(&self, key: &Key, policy: &Policy) -> (Policy, Stretch) {
        match self.shared.overrides.apply(key, policy) {
            Applied::Other(used) => {
                let stretch = Stretch::of(policy, &used);
                (used, stretch)
            }
            _ => (policy.clone(), Stretch::NONE),
        }
    }

    /// Records `settlement` for `key` under `policy`, now.
    pub(super) fn settle_units(&self, key: &Key, policy: &Policy, settlement: Settlement) {
        let now = self.now();
        // Settled under the counts the key is decided by; a blocked key's under its own.
        let (in_force, stretch) = self.in_force(key, policy);
        let policy = &in_force;
        let algorithm = policy.algorithm();
        // The state a refund's units were recorded in, the only one it applies to.
        let recorded_in = match &settlement.owed {
            Owed::Refund(units) => Some(units.state()),
            _ => None,
        };
        let change = match settlement.owed {
            Owed::Charge(units) => Settle::Charge(units.count()),
            Owed::Refund(units) => Settle::Refund(Refund {
                units: units.count(),
                at: refund_from(policy, &units),
                recorded: units.recorded(),
            }),
            // Slots are kept by `keep_slot`; they record no units.
            Owed::Release(..) | Owed::Renew(_) => Settle::Charge(0),
        };
        let attempt = settlement.attempt();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(entry) => {
                let stale = !entry.is_live(now) || entry.value.algorithm() != algorithm;
                if recorded_in.is_some_and(|n| stale || n != entry.value.number) {
                    return;
                }
                if stale {
                    entry.value = self.shared.fresh(algorithm);
                }
                if attempt != 0 {
                    entry.value.attempts.end(attempt);
                }
                let drained = stretch.apply(entry.value.settle(now, policy, change));
                entry.expires = entry.expires.max(now.saturating_add(drained));
                if let Settle::Charge(_) = change {
                    entry.expires = entry.expires.max(expiry(policy, now, now, stretch));
                    // A charge that fills the key puts it in the penalty box, unless it is in
                    // one already.
                    let kept = entry.expires;
                    let boxed = entry.value.penalize_if_full(now, policy, kept);
                    entry.expires = entry.expires.max(boxed.unwrap_or(0));
                }
            }
            // Nothing recorded is left to refund.
            None if matches!(change, Settle::Refund { .. }) => {}
            None => {
                let mut state = self.shared.fresh(algorithm);
                let drained = stretch.apply(state.settle(now, policy, change));
                let kept = expiry(policy, now, now, stretch).max(now.saturating_add(drained));
                let boxed = state.penalize_if_full(now, policy, kept).unwrap_or(0);
                shard.insert(key, policy.state_id(), now, kept.max(boxed), state);
            }
        }
    }
}

/// From when a refund's units have drained (`Refund::at`): their admission, or, for an attempt
/// under a single-limit GCRA policy, when the units ahead of them had drained (`Units`'
/// `drains_from`), as `gcra.lua` reads it.
fn refund_from(policy: &Policy, units: &crate::settlement::Units) -> Option<u64> {
    let admitted = units.admitted_at()?;
    let single_gcra = policy.algorithm() == crate::Algorithm::Gcra && policy.limits().len() == 1;
    let from = match units.drains_from() {
        Some(drains) if single_gcra && drains > admitted => drains,
        _ => admitted,
    };
    u64::try_from(from).ok()
}

/// Whether this store decides `policy` at event time `at` (`None`: now): its limits must be in
/// the algorithms' range, and an event time needs an algorithm that takes one and a policy
/// without a concurrency limit.
fn decidable(policy: &Policy, at: Option<SystemTime>) -> Result<(), StoreError> {
    crate::store::in_range(policy)?;
    if at.is_none() {
        return Ok(());
    }
    if !policy.algorithm().takes_event_times() {
        return Err(StoreError::Unsupported(
            "event times need the sliding log algorithm",
        ));
    }
    if policy.concurrency_limit().is_some() {
        return Err(StoreError::Unsupported(
            "event times take no concurrency slot",
        ));
    }
    at.map_or(Ok(()), crate::store::event_in_range)
}

/// Answers `ask` for a key the map holds in `entry`, afresh when its state has expired or was
/// kept under another algorithm; `Err` with the refusal it meets before the limits are asked
/// (boxed: a penalty box or a full key is the rare answer, and a decision is large).
fn answer_held(
    entry: &mut Entry<KeyState>,
    policy: &Policy,
    ask: &Ask,
    shared: &Shared,
) -> Result<StateAnswer, Box<Decision>> {
    let algorithm = policy.algorithm();
    if !entry.is_live(ask.now) || entry.value.algorithm() != algorithm {
        entry.value = shared.fresh(algorithm);
    }
    if let Some(refusal) = entry.value.refusal(policy, ask) {
        let refusal = refused(refusal, policy);
        // A waiter refused a slot may have joined the key's line: the key is kept as long.
        entry.expires = entry.expires.max(entry.value.slots.last_expiry());
        return Err(Box::new(refusal));
    }
    // Under counts lower than those it was written under (an override's cut, a plan's), a
    // GCRA backlog drains later than the expiry its write set: the key is kept until it has,
    // so that a refusal's retry holds, and a penalty box set now holds as long.
    let drained = entry.value.drained_in(ask.now, policy);
    entry.expires = entry.expires.max(ask.now.saturating_add(drained));
    let answer = entry.value.answer(policy, ask, entry.expires);
    if let Some(until) = answer.keep_until {
        entry.expires = entry.expires.max(until);
    }
    Ok(answer)
}

/// The decision of a refusal met before the limits decide.
fn refused(refusal: Refusal, policy: &Policy) -> Decision {
    match refusal {
        Refusal::Limits(outcome) => Decision::from_outcome(outcome, policy),
        Refusal::Boxed(left) => Decision::boxed(policy, Duration::from_micros(left)),
        Refusal::SlotsFull(full) => Decision::refused_slot(policy, full),
    }
}

/// The decision `answer` makes: the penalty box's refusal, or the limits' outcome, with the
/// concurrency slot an admitted request took and what a recorded one recorded.
fn decision((answer, state): (StateAnswer, u64), policy: &Policy, ask: &Ask) -> Decision {
    let at = i64::try_from(ask.t).unwrap_or(0);
    if let Some(left) = answer.boxed {
        return Decision::boxed(policy, Duration::from_micros(left)).decided_at(at);
    }
    let mut decision = Decision::from_outcome(answer.outcome, policy).decided_at(at);
    if answer.busy {
        let retry = answer.outcome.retry_after.unwrap_or(0);
        return decision.made_busy(Duration::from_micros(retry));
    }
    if let Some(take) = ask.take {
        decision = decision.with_slot(take.id);
    }
    if let Some(turn) = answer.turn {
        let wait = Duration::from_micros(turn - ask.now);
        let recorded = decision.recorded_at(i64::try_from(turn).ok(), ask.cost);
        return recorded.in_state(state).with_turn(wait);
    }
    match ask.record {
        true => decision
            .recorded_at(i64::try_from(ask.t).ok(), ask.cost)
            .in_state(state)
            .as_attempt(ask.attempt.unwrap_or(0)),
        false => decision,
    }
}
