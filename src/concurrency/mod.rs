//! Concurrency limits: at most `cap` requests of a key in flight at once, across every
//! instance that shares the store ([`Policy::concurrency`](crate::Policy::concurrency)).
//!
//! A request takes a *slot* when it is admitted, in the same atomic step as the policy's rate
//! limits, and gives it back when its response body ends, fails or is dropped. Each slot
//! carries an expiry that the instance holding it renews while the request lives
//! (`ledger/slots.rs`); an instance that dies stops renewing, and its slots count no more once
//! they expire. This file is the bookkeeping of one key's slots, free of I/O and clocks: the
//! memory store runs it, and `scripts/prelude.lua` (`slots_full`, `take_slot`, its slot
//! operations) is the same over a Redis sorted set scored by expiry. [`lines`] keeps the
//! requests waiting for a slot.

pub(crate) mod lines;

/// The slots one key holds: each slot's id and expiry (µs on the store's clock).
#[derive(Debug, Default, Clone)]
pub(crate) struct Slots {
    held: Vec<(u64, u64)>,
}

impl Slots {
    /// Drops the slots expired at `now`.
    fn prune(&mut self, now: u64) {
        self.held.retain(|&(_, until)| until > now);
    }

    /// Whether the key holds `cap` live slots at `now`: then the µs until the first expires.
    pub(crate) fn full(&mut self, now: u64, cap: u32) -> Option<u64> {
        self.prune(now);
        if self.held.len() < cap as usize {
            return None;
        }
        let first = self
            .held
            .iter()
            .map(|&(_, until)| until)
            .min()
            .unwrap_or(now);
        Some(first.saturating_sub(now).max(1))
    }

    /// Takes slot `id` until `until`.
    pub(crate) fn take(&mut self, id: u64, until: u64) {
        self.held.push((id, until));
    }

    /// Gives slot `id` back; whether it was held.
    pub(crate) fn give_back(&mut self, id: u64) -> bool {
        let before = self.held.len();
        self.held.retain(|&(held, _)| held != id);
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

    /// When the last slot expires (0: none held).
    pub(crate) fn last_expiry(&self) -> u64 {
        self.held.iter().map(|&(_, until)| until).max().unwrap_or(0)
    }

    /// The slots held, expired ones included until the next look.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// The slots live at `now`.
    pub(crate) fn live(&self, now: u64) -> usize {
        self.held.iter().filter(|&&(_, until)| until > now).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_key_refuses_until_a_slot_is_given_back_or_expires() {
        let mut slots = Slots::default();
        assert_eq!(slots.full(0, 2), None);
        slots.take(1, 100);
        assert_eq!(slots.full(10, 2), None);
        slots.take(2, 150);
        assert_eq!(slots.full(20, 2), Some(80));
        assert!(slots.give_back(1));
        assert!(!slots.give_back(1));
        assert_eq!(slots.full(20, 2), None);
        slots.take(3, 200);
        // Slot 2 expires at 150: from then on one is free.
        assert_eq!(slots.full(149, 2), Some(1));
        assert_eq!(slots.full(150, 2), None);
        assert_eq!(slots.len(), 1);
    }

    #[test]
    fn a_renewal_keeps_a_live_slot_and_never_takes_an_expired_one_again() {
        let mut slots = Slots::default();
        slots.take(1, 100);
        assert!(slots.renew(50, 1, 150));
        assert_eq!(slots.full(120, 1), Some(30));
        assert!(!slots.renew(200, 1, 300));
        assert_eq!(slots.full(200, 1), None);
        slots.take(2, 400);
        assert_eq!(slots.last_expiry(), 400);
    }
}
