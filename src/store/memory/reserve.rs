//! The memory store's reservations ([`Reserve`]): made in the map as decisions are, the line
//! kept in the key's state.

use std::future::{ready, Ready};
use std::time::Duration;

use super::MemoryStore;
use crate::model::key_state::{Ask, Booking, KeyState};
use crate::model::{micros, Refund, Settle};
use crate::store::reserve::{self, named, reservable, InLine, Reserve, Ticket};
use crate::store::Store;
use crate::store::StoreError;
use crate::{Key, Policy};

/// Reserves in the map, as decisions are made: under the override or plan in force for the
/// key, blocked by a block; the key is kept until a window past its last turn, and its line
/// with it.
impl Reserve for MemoryStore {
    type LineFuture = Ready<Result<InLine, StoreError>>;
    type LinesFuture = Ready<Result<Vec<InLine>, StoreError>>;

    fn reserve(&self, key: &Key, policy: &Policy, ticket: Ticket) -> <Self as Store>::Future {
        let supported = crate::store::in_range(policy).and_then(|()| reservable(policy));
        if let Err(error) = supported.and_then(|()| reserve::in_range(policy, &ticket)) {
            return ready(Err(error));
        }
        let booking = Booking {
            id: ticket.id,
            max_wait: micros(ticket.max_wait),
            late: micros(ticket.late),
            notice: micros(ticket.notice),
        };
        let ask = Ask {
            reserve: Some(booking),
            ..self.ask(policy, ticket.cost, None, true)
        };
        ready(Ok(self.decide_overridden(key, policy, ask)))
    }

    fn look(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        if let Err(error) = named(&ticket) {
            return ready(Err(error));
        }
        let (late, cost) = (micros(ticket.late), u64::from(ticket.cost));
        ready(Ok(self.in_line(key, policy, |state, now| {
            state.line.look(now, (ticket.id, cost), late)
        })))
    }

    fn look_many(&self, key: &Key, policy: &Policy, tickets: Vec<Ticket>) -> Self::LinesFuture {
        if let Err(error) = tickets.iter().try_for_each(named) {
            return ready(Err(error));
        }
        ready(Ok(self.with_state(key, policy, |state, now| {
            let Some(state) = state else {
                return vec![InLine::at(now, None, 0); tickets.len()];
            };
            let (line, pause) = (&state.line, state.line.paused_until());
            let stand = |t: &Ticket| InLine::at(now, line.turn(t.id, t.cost.into()), pause);
            tickets.iter().map(stand).collect()
        })))
    }

    /// The place left at the end is refunded under the counts in force for the key, only
    /// where the key's state is the one the line was kept with (it is the same entry).
    fn leave(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        if let Err(error) = named(&ticket) {
            return ready(Err(error));
        }
        let (in_force, _) = self.in_force(key, policy);
        ready(Ok(self.in_line(key, policy, |state, now| {
            let (at, left) = state.line.leave(now, (ticket.id, ticket.cost.into()))?;
            if left.given_back(in_force.algorithm()) {
                let refund = Refund {
                    units: left.cost,
                    at: Some(left.at),
                    recorded: left.cost,
                };
                state.settle(now, &in_force, Settle::Refund(refund));
            }
            Some(at)
        })))
    }

    fn pause(&self, key: &Key, policy: &Policy, pause: Duration) -> Self::LineFuture {
        let now = self.now();
        let until = now.saturating_add(micros(pause));
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let paused = match shard.get(key, policy.state_id(), now) {
            Some(entry) if entry.is_live(now) => {
                entry.value.line.pause(until);
                entry.expires = entry.expires.max(until);
                entry.value.line.paused_until()
            }
            _ => {
                let mut state = self.shared.fresh(policy.algorithm());
                state.line.pause(until);
                shard.insert(key, policy.state_id(), now, until, state);
                until
            }
        };
        ready(Ok(InLine::at(now, None, paused)))
    }
}

impl MemoryStore {
    /// Runs `f` on the line of `key` under `policy`, with the time and the key's state, and
    /// answers where the reservation it names stands (the turn `f` returns) and the pause.
    fn in_line(
        &self,
        key: &Key,
        policy: &Policy,
        f: impl FnOnce(&mut KeyState, u64) -> Option<u64>,
    ) -> InLine {
        self.with_state(key, policy, |state, now| match state {
            Some(state) => {
                let turn = f(state, now);
                InLine::at(now, turn, state.line.paused_until())
            }
            None => InLine::at(now, None, 0),
        })
    }

    /// Runs `f` with the live state of `key` under `policy` (`None`: it has none) and the
    /// time, under the lock of its shard.
    fn with_state<T>(
        &self,
        key: &Key,
        policy: &Policy,
        f: impl FnOnce(Option<&mut KeyState>, u64) -> T,
    ) -> T {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let entry = shard
            .get(key, policy.state_id(), now)
            .filter(|e| e.is_live(now));
        f(entry.map(|e| &mut e.value), now)
    }
}
