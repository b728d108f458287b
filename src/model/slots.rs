//! Concurrency limits: at most `cap` requests of a key in flight at once, across every
//! instance that shares the store ([`Policy::concurrency`](crate::Policy::concurrency)).
//!
//! A request takes a *slot* when it is admitted, in the same atomic step as the policy's rate
//! limits, and gives it back when its response body ends, fails or is dropped. Each slot
//! carries an expiry that the instance holding it renews while the request lives
//! (`ledger/slots.rs`); an instance that dies stops renewing, and its slots count no more once
//! they expire. This file is the bookkeeping of one key's slots, free of I/O and clocks: the
//! memory store runs it, and `scripts/prelude.lua` (`slots_full`, `take_slot`, its slot
//! operations) is the same over a Redis sorted set scored by expiry. `ledger/queue.rs` keeps a
//! layer's requests waiting for a slot.

use std::time::Duration;

/// A request waiting for a concurrency slot of its key
/// ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)), as a store sees it: its id, unique
/// among the waiters of the stores it shares, and how long it waits. A store that keeps a queue
/// of waiters ([`Store::check_queued`](crate::Store::check_queued)) puts a waiter it refuses
/// in its queue at its deadline, and admits a request only where a slot is free for it after every
/// waiter ahead of it: so slots go to waiters across every instance in the order of their
/// deadlines, which is their order of arrival among layers with the same `max_wait`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    pub(crate) id: u64,
    pub(crate) wait: Duration,
    /// Whether a store has put it in its queue (it was refused for a slot before): once admitted,
    /// it leaves the queue.
    pub(crate) queued: bool,
}

impl Waiter {
    /// The waiter's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// How long it waits from its first refusal: its deadline in the store's queue is the
    /// store's time then plus this.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// Whether a store has put it in its queue already.
    pub fn is_queued(&self) -> bool {
        self.queued
    }

    pub(crate) fn wait_micros(&self) -> u64 {
        u64::try_from(self.wait.as_micros()).unwrap_or(u64::MAX)
    }
}

/// Why a key refuses a request a slot: how long (µs) until its first slot expires, the
/// request's place in the key's queue (its deadline, µs on the store's clock; 0 when it is not
/// queued), and the key's typical hold time (µs; 0 while none is known).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full {
    pub(crate) left: u64,
    pub(crate) place: u64,
    pub(crate) hold: u64,
}

/// The slots one key holds: each slot's id and expiry (µs on the store's clock); the queue of
/// requests waiting for one; and how long its slots are held, typically.
#[derive(Debug, Default, Clone)]
pub(crate) struct Slots {
    held: Vec<(u64, u64)>,
    /// The waiters queued, first first: each one's deadline and id.
    queue: Vec<(u64, u64)>,
    /// The typical time a slot is held (µs; 0: none known), [`hold_average`].
    hold: u64,
}

/// The running average of hold times a key keeps, from `old` (0: none yet) and a give-back
/// held `held` µs: each new one weighs an eighth, so that the average follows a change in the
/// requests within a few dozen give-backs. `prelude.lua` keeps the same.
pub(crate) fn hold_average(old: u64, held: u64) -> u64 {
    match old {
        0 => held,
        old => (old * 7 + held) / 8,
    }
    .max(1)
}

impl Slots {
    /// Drops the slots expired at `now`, and the waiters whose deadline has passed.
    fn prune(&mut self, now: u64) {
        self.held.retain(|&(_, until)| until > now);
        self.queue.retain(|&(deadline, _)| deadline > now);
    }

    /// Whether the key refuses a slot at `now` to a request under a limit of `cap` (the
    /// request `waiter`, if it waits): it does while its live slots and the waiters ahead of
    /// the request (every one, for a request not queued) leave no slot for it. A waiter it
    /// refuses joins the queue, at its deadline, unless there already.
    pub(crate) fn full(&mut self, now: u64, cap: u32, waiter: Option<&Waiter>) -> Option<Full> {
        self.prune(now);
        let own = waiter.and_then(|w| self.queue.iter().position(|&(_, id)| id == w.id));
        let ahead = own.unwrap_or(self.queue.len());
        if self.held.len() + ahead < cap as usize {
            return None;
        }
        let place = match (waiter, own) {
            (Some(_), Some(at)) => self.queue[at].0,
            (Some(w), None) => {
                let deadline = now.saturating_add(w.wait_micros()).max(now + 1);
                let at = self
                    .queue
                    .partition_point(|&(d, id)| (d, id) < (deadline, w.id));
                self.queue.insert(at, (deadline, w.id));
                deadline
            }
            (None, _) => 0,
        };
        let first = self.held.iter().map(|&(_, until)| until).min();
        Some(Full {
            left: first.map_or(1_000, |first| first.saturating_sub(now).max(1)),
            place,
            hold: self.hold,
        })
    }

    /// Takes slot `id` until `until`, for `waiter` if it waited: it leaves the queue.
    pub(crate) fn take(&mut self, id: u64, until: u64, waiter: Option<&Waiter>) {
        self.held.push((id, until));
        if let Some(waiter) = waiter.filter(|w| w.queued) {
            self.leave(waiter.id);
        }
    }

    /// Takes waiter `id` out of the queue; whether it was in it.
    pub(crate) fn leave(&mut self, id: u64) -> bool {
        let before = self.queue.len();
        self.queue.retain(|&(_, waiter)| waiter != id);
        self.queue.len() < before
    }

    /// Gives slot `id` back, held for `held` µs (0: not known); whether it was held.
    pub(crate) fn release(&mut self, id: u64, held: u64) -> bool {
        let before = self.held.len();
        self.held.retain(|&(slot, _)| slot != id);
        if held > 0 {
            self.hold = hold_average(self.hold, held);
        }
        self.held.len() < before
    }

    /// Renews slot `id` until `until`; whether it was held. A slot that has expired is not
    /// taken again: a give-back sent while the renewal was on its way to Redis may have run
    /// first there, and the two stores keep the same rule.
    pub(crate) fn renew(&mut self, now: u64, id: u64, until: u64) -> bool {
        self.prune(now);
        match self.held.iter_mut().find(|(held, _)| *held == id) {
            Some(slot) => {
                slot.1 = until;
                true
            }
            None => false,
        }
    }

    /// Until when the key's slots and queue matter: the last slot's expiry or waiter's
    /// deadline (0: none).
    pub(crate) fn last_expiry(&self) -> u64 {
        let slots = self.held.iter().map(|&(_, until)| until);
        let queue = self.queue.iter().map(|&(deadline, _)| deadline);
        slots.chain(queue).max().unwrap_or(0)
    }

    /// The slots held, expired ones included until the next look.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// The slots live at `now`.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn live(&self, now: u64) -> usize {
        self.held.iter().filter(|&&(_, until)| until > now).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn left(full: Option<Full>) -> Option<u64> {
        full.map(|full| full.left)
    }

    fn waiter(id: u64, queued: bool) -> Waiter {
        let wait = Duration::from_micros(1_000);
        Waiter { id, wait, queued }
    }

    #[test]
    fn a_full_key_refuses_until_a_slot_is_given_back_or_expires() {
        let mut slots = Slots::default();
        assert_eq!(slots.full(0, 2, None), None);
        slots.take(1, 100, None);
        assert_eq!(slots.full(10, 2, None), None);
        slots.take(2, 150, None);
        assert_eq!(left(slots.full(20, 2, None)), Some(80));
        assert!(slots.release(1, 0));
        assert!(!slots.release(1, 0));
        assert_eq!(slots.full(20, 2, None), None);
        slots.take(3, 200, None);
        // Slot 2 expires at 150: from then on one is free.
        assert_eq!(left(slots.full(149, 2, None)), Some(1));
        assert_eq!(slots.full(150, 2, None), None);
        assert_eq!(slots.len(), 1);
    }

    #[test]
    fn a_renewal_keeps_a_live_slot_and_never_takes_an_expired_one_again() {
        let mut slots = Slots::default();
        slots.take(1, 100, None);
        assert!(slots.renew(50, 1, 150));
        assert_eq!(left(slots.full(120, 1, None)), Some(30));
        assert!(!slots.renew(200, 1, 300));
        assert_eq!(slots.full(200, 1, None), None);
        slots.take(2, 400, None);
        assert_eq!(slots.last_expiry(), 400);
    }

    #[test]
    fn a_freed_slot_goes_to_the_first_waiter_in_line_not_to_a_newcomer() {
        let mut slots = Slots::default();
        slots.take(1, 10_000, None);
        // Two waiters are refused in turn and join the queue at their deadlines.
        let (a, b) = (waiter(7, false), waiter(3, false));
        assert_eq!(slots.full(10, 1, Some(&a)).unwrap().place, 1_010);
        assert_eq!(slots.full(20, 1, Some(&b)).unwrap().place, 1_020);
        assert!(slots.release(1, 500));
        // The slot is free, but held for the first in the queue: the second waiter and a
        // newcomer are refused.
        let (a, b) = (waiter(7, true), waiter(3, true));
        assert_eq!(slots.full(30, 1, Some(&b)).unwrap().place, 1_020);
        assert!(slots.full(30, 1, None).is_some());
        assert_eq!(slots.full(30, 1, Some(&a)), None);
        slots.take(2, 10_000, Some(&a));
        assert_eq!(slots.queue.len(), 1);
        // The first waiter's slot goes back: the second is first now.
        assert!(slots.release(2, 1_500));
        assert_eq!(slots.full(40, 1, Some(&b)), None);
        // The average of the hold times: 500, then 500 + (1 500 - 500) / 8.
        assert_eq!(slots.hold, 625);
    }

    #[test]
    fn a_waiter_past_its_deadline_or_gone_holds_no_place() {
        let mut slots = Slots::default();
        slots.take(1, 10_000, None);
        assert!(slots.full(0, 1, Some(&waiter(1, false))).is_some());
        assert!(slots.full(500, 1, Some(&waiter(2, false))).is_some());
        assert!(slots.release(1, 0));
        // The first leaves; the second is first.
        assert!(slots.leave(1));
        assert!(!slots.leave(1));
        assert!(slots.full(600, 1, None).is_some());
        assert_eq!(slots.full(600, 1, Some(&waiter(2, true))), None);
        // The key is kept until its deadline (1 500), and then free for anyone.
        assert_eq!(slots.last_expiry(), 1_500);
        assert_eq!(slots.full(1_500, 1, None), None);
    }
}
