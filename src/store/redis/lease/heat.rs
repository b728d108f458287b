//! How busy each key is: a fixed table of one word per cell, read and updated on every request
//! of a leased policy, which says whether a lease would pay for itself, without an entry per
//! key in the book.
//!
//! A lease is one script call decided alone (not batched) plus, often, a give-back: it pays
//! only when it serves several requests. Most keys of a large key space see a request now and
//! then; for them the book's entry (a policy clone, a shard insert, an eviction later) would be
//! pure cost. So a key is counted here first, and only a key whose recent use says that a lease
//! would serve [`HOT`](super::plan::HOT) requests or more gets an entry and takes leases.
//!
//! Each cell is one `AtomicU64`: a leasing bit, a 15-bit fingerprint of the key, the period the
//! counts are for (mod 2^16), and two saturating 16-bit counts, this period's and the previous
//! one's, from which the use over the last period is estimated as the sliding window counter
//! does. A request costs one load and one compare-and-swap: no lock, no allocation. Keys whose
//! hashes meet in a cell contend for it, as a heavy-hitter sketch's counters do: a request of
//! another key takes one unit from the holder's counts, with a chance of `2^-n` where `n` is
//! what the holder counted over the last two periods, and takes the cell over (starting from
//! 0) once they are both 0. So a busy key keeps its cell against a churn of keys that pass
//! once (the churn of a large cold key space, where every cell sees many keys), and of two busy
//! keys the one that holds the cell keeps it, where taking the cell at every request would
//! leave both counting from 0 for ever. A cell whose leasing bit is set is never taken: it pins
//! the cell to the key that holds an entry in the book, so that
//! [`Store::check_now`](crate::Store::check_now) always finds the leases a key holds. An estimate
//! that is wrong (a key idle for exactly 2^16 periods reads its old count once, as the period's
//! index wraps) only changes who fetches units, never a bound: every decision of a leased
//! policy carries the policy's headroom, hot or cold (`docs/leases.md`, "Bounds").

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use foldhash::fast::RandomState;

use crate::policy::Id;
use crate::Key;

const LEASING: u64 = 1 << 63;
const FINGERPRINT: u64 = 0x7fff;
const COUNT: u64 = 0xffff;

/// The fewest and the most cells a table has.
const MIN_CELLS: u64 = 1 << 10;
const MAX_CELLS: u64 = 1 << 20;

/// The table.
pub(crate) struct Heat {
    cells: Box<[AtomicU64]>,
    /// Seeded per table, so that clients cannot choose keys that share a cell.
    hasher: RandomState,
}

/// Where a key's use is counted: its cell and its fingerprint there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spot {
    cell: usize,
    fingerprint: u64,
}

/// What a cell says of a key at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    /// Units used in the last period, estimated.
    pub(crate) estimate: u64,
    /// Whether the key may hold leases (its leasing bit is set): only then does its book
    /// entry exist.
    pub(crate) leasing: bool,
}

/// One cell's fields, unpacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cell {
    leasing: bool,
    fingerprint: u64,
    period: u64,
    current: u64,
    previous: u64,
}

impl Cell {
    fn unpack(word: u64) -> Cell {
        Cell {
            leasing: word & LEASING != 0,
            fingerprint: (word >> 48) & FINGERPRINT,
            period: (word >> 32) & COUNT,
            current: (word >> 16) & COUNT,
            previous: word & COUNT,
        }
    }

    fn pack(self) -> u64 {
        (u64::from(self.leasing) << 63)
            | (self.fingerprint << 48)
            | (self.period << 32)
            | (self.current << 16)
            | self.previous
    }

    /// The cell as seen in `period` (its index mod 2^16): the counts move back a period, or are
    /// forgotten when more than one has passed.
    fn rolled(mut self, period: u64) -> Cell {
        if self.period == period {
            return self;
        }
        self.previous = match (self.period + 1) & COUNT == period {
            true => self.current,
            false => 0,
        };
        self.current = 0;
        self.period = period;
        self
    }

    /// The use of the last `length` µs at `now`: this period's count plus the previous one's,
    /// weighted by the share of it still inside.
    fn estimate(&self, now: u64, length: u64) -> u64 {
        let inside = length - now % length;
        self.current + self.previous * inside / length
    }
}

impl Heat {
    /// A table for a book of `max_keys` keys: as many cells, rounded up to a power of two,
    /// between 2^10 and 2^20 (8 KiB to 8 MiB).
    pub(crate) fn new(max_keys: u64) -> Heat {
        let cells = max_keys.clamp(MIN_CELLS, MAX_CELLS).next_power_of_two();
        Heat {
            cells: (0..cells).map(|_| AtomicU64::new(0)).collect(),
            hasher: RandomState::default(),
        }
    }

    /// Where `key` under `policy` (its terms' id, as the book keys it) is counted.
    pub(crate) fn spot(&self, key: &Key, policy: Id<'_>) -> Spot {
        let hash = self.hasher.hash_one((policy.hash, key.as_str()));
        Spot {
            cell: (hash as usize) & (self.cells.len() - 1),
            fingerprint: hash >> 49,
        }
    }

    /// Counts `units` used at `now` (µs) in periods of `length` µs; returns the use of the
    /// last period, these units included. A cell held by another key is contended for (see
    /// the module): taken over once its counts are spent, unless it is pinned (leasing); till
    /// then nothing is counted and the key reads as cold.
    pub(crate) fn touch(&self, spot: Spot, now: u64, length: u64, units: u64) -> Reading {
        let count = |cell: &mut Cell| cell.current = (cell.current + units).min(COUNT);
        self.update(spot, now, length, Contend::Yes, count)
            .unwrap_or(NOT_HELD)
    }

    /// What the cell says of the key at `now`, counting nothing; a key whose cell is held by
    /// another reads as cold and not leasing.
    pub(crate) fn read(&self, spot: Spot, now: u64, length: u64) -> Reading {
        let cell = Cell::unpack(self.cells[spot.cell].load(Ordering::Acquire));
        if cell.fingerprint != spot.fingerprint {
            return NOT_HELD;
        }
        let cell = cell.rolled((now / length) & COUNT);
        Reading {
            estimate: cell.estimate(now, length),
            leasing: cell.leasing,
        }
    }

    /// Sets the key's leasing bit, pinning the cell to it; whether it is set. It is not when
    /// the cell is pinned by another key's leases.
    pub(crate) fn pin(&self, spot: Spot, now: u64, length: u64) -> bool {
        let pinned = self.update(spot, now, length, Contend::No, |cell| cell.leasing = true);
        pinned.is_some_and(|reading| reading.leasing)
    }

    /// Clears the key's leasing bit (its book entry is gone), if the cell is the key's.
    pub(crate) fn unpin(&self, spot: Spot) {
        let atomic = &self.cells[spot.cell];
        let _ = atomic.fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
            let ours = Cell::unpack(word).fingerprint == spot.fingerprint;
            (ours && word & LEASING != 0).then_some(word & !LEASING)
        });
    }

    /// Applies `change` to the key's cell, seen at `now`; where another key holds the cell,
    /// unpinned, takes it over if its counts are spent, else (with `contend`) may take a unit
    /// from them (see the module). The reading after, or `None` when the cell stays another's.
    fn update(
        &self,
        spot: Spot,
        now: u64,
        length: u64,
        contend: Contend,
        change: impl Fn(&mut Cell),
    ) -> Option<Reading> {
        let atomic = &self.cells[spot.cell];
        let period = (now / length) & COUNT;
        let mut word = atomic.load(Ordering::Acquire);
        loop {
            let old = Cell::unpack(word);
            let (mut cell, ours) = match old.fingerprint == spot.fingerprint {
                true => (old.rolled(period), true),
                false if old.leasing => return None,
                false => {
                    let held = old.rolled(period);
                    let (cell, ours) = self.contended(held, spot, now, contend);
                    // Nothing taken from the holder: nothing to write (a roll is every
                    // reader's own).
                    if !ours && cell == held {
                        return None;
                    }
                    (cell, ours)
                }
            };
            if ours {
                change(&mut cell);
            }
            let reading = Reading {
                estimate: cell.estimate(now, length),
                leasing: cell.leasing,
            };
            match atomic.compare_exchange_weak(
                word,
                cell.pack(),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return ours.then_some(reading),
                Err(now_there) => word = now_there,
            }
        }
    }

    /// A cell `held` by another key, unpinned and rolled to now, that the key at `spot` asks
    /// for: a fresh cell of its own where the holder's counts are spent, else the holder's,
    /// less a unit with a chance of `2^-n` (`n` its counts) where `contend` says so; whether
    /// the cell is now the asker's.
    fn contended(&self, mut held: Cell, spot: Spot, now: u64, contend: Contend) -> (Cell, bool) {
        let counts = held.current + held.previous;
        if counts == 0 {
            let fresh = Cell {
                fingerprint: spot.fingerprint,
                ..held
            };
            return (fresh, true);
        }
        // A draw of `counts` fair coins, all heads: the hash of the moment and the asker.
        let draw = self.hasher.hash_one((now, spot.fingerprint, held.pack()));
        if contend == Contend::Yes && u64::from(draw.trailing_zeros()) >= counts {
            match held.current > 0 {
                true => held.current -= 1,
                false => held.previous -= 1,
            }
        }
        (held, false)
    }
}

/// Whether a request of a key whose cell another holds contends for it (a use), or not (a pin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contend {
    Yes,
    No,
}

/// What a key reads whose cell another key holds: no use, not leasing.
const NOT_HELD: Reading = Reading {
    estimate: 0,
    leasing: false,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;

    const MS: u64 = 1_000;
    const PERIOD: u64 = 100 * MS;

    fn table() -> (Heat, Policy) {
        (Heat::new(1), "100/1s".parse().unwrap())
    }

    #[test]
    fn the_estimate_rises_with_use_and_decays_over_two_periods() {
        let (heat, policy) = table();
        let spot = heat.spot(&Key::from("k"), policy.terms_id());
        // 20 units spread over one period.
        let mut last = 0;
        for i in 0..20 {
            last = heat.touch(spot, i * 5 * MS, PERIOD, 1).estimate;
        }
        assert_eq!(last, 20);
        assert_eq!(heat.read(spot, PERIOD - 1, PERIOD).estimate, 20);
        // Half way through the next period, half of the last one's use still counts.
        assert_eq!(heat.read(spot, PERIOD + PERIOD / 2, PERIOD).estimate, 10);
        assert_eq!(heat.read(spot, 2 * PERIOD - MS, PERIOD).estimate, 0);
        // Two periods on, nothing is left.
        assert_eq!(heat.read(spot, 2 * PERIOD, PERIOD).estimate, 0);
        assert_eq!(heat.touch(spot, 3 * PERIOD, PERIOD, 1).estimate, 1);
    }

    #[test]
    fn a_period_long_past_is_forgotten() {
        let (heat, policy) = table();
        let spot = heat.spot(&Key::from("k"), policy.terms_id());
        heat.touch(spot, 0, PERIOD, 50);
        assert_eq!(heat.read(spot, 5 * PERIOD, PERIOD).estimate, 0);
        assert_eq!(heat.touch(spot, 5 * PERIOD + 1, PERIOD, 1).estimate, 1);
    }

    #[test]
    fn counts_saturate() {
        let (heat, policy) = table();
        let spot = heat.spot(&Key::from("k"), policy.terms_id());
        heat.touch(spot, 0, PERIOD, 60_000);
        assert_eq!(heat.touch(spot, 0, PERIOD, 60_000).estimate, COUNT);
        assert_eq!(heat.touch(spot, PERIOD, PERIOD, COUNT).estimate, 2 * COUNT);
    }

    /// Two keys in one cell: the second's fingerprint differs.
    fn collision(heat: &Heat, policy: &Policy) -> (Spot, Spot) {
        let first = heat.spot(&Key::from("k0"), policy.terms_id());
        let other = (1..100_000)
            .map(|i| heat.spot(&Key::from(format!("k{i}")), policy.terms_id()))
            .find(|p| p.cell == first.cell && p.fingerprint != first.fingerprint)
            .expect("1024 cells: a key among 100 000 shares the first one's");
        (first, other)
    }

    #[test]
    fn a_key_sharing_a_cell_takes_it_over_once_the_holders_counts_are_spent() {
        let (heat, policy) = table();
        let (first, other) = collision(&heat, &policy);
        assert_eq!(heat.touch(first, 0, PERIOD, 1).estimate, 1);
        // The holder's one unit goes at the first request with a chance of one half.
        let mut asked = 0;
        while heat.read(first, asked, PERIOD).estimate > 0 {
            assert_eq!(heat.touch(other, asked, PERIOD, 1), NOT_HELD, "held");
            asked += 1;
            assert!(asked < 64, "a unit in 64 draws");
        }
        assert_eq!(
            heat.touch(other, asked, PERIOD, 1).estimate,
            1,
            "starts at 0"
        );
        assert_eq!(
            heat.read(first, asked, PERIOD).estimate,
            0,
            "the first lost it"
        );
        // A cell idle for two periods is spent: taken at once.
        assert_eq!(heat.touch(first, 3 * PERIOD, PERIOD, 1).estimate, 1);
    }

    /// A busy key, 10 units a period, in a cell that 5 other keys a period pass through, each
    /// once (the churn of a cold key space: 1 000 000 keys at 0.05 a second over the default
    /// 131 072 cells is 0.4 a cell and second): from its second period on, the busy key reads
    /// at least `HOT`. Taking the cell at every request of another key, it read as little as 1.
    #[test]
    fn a_busy_key_keeps_its_cell_against_a_churn_of_keys_passing_once() {
        let (heat, policy) = table();
        let busy = heat.spot(&Key::from("busy"), policy.terms_id());
        let passing: Vec<Spot> = (0..1_000_000)
            .map(|i| heat.spot(&Key::from(format!("c{i}")), policy.terms_id()))
            .filter(|p| p.cell == busy.cell && p.fingerprint != busy.fingerprint)
            .take(50)
            .collect();
        assert_eq!(passing.len(), 50);
        let mut least = u64::MAX;
        for period in 0..10 {
            for i in 0..15 {
                let now = period * PERIOD + i * (PERIOD / 15);
                if i % 3 == 2 {
                    heat.touch(passing[(period * 5 + i / 3) as usize], now, PERIOD, 1);
                    continue;
                }
                let estimate = heat.touch(busy, now, PERIOD, 1).estimate;
                if period > 0 {
                    least = least.min(estimate);
                }
            }
        }
        assert!(least >= crate::store::redis::lease::plan::HOT, "{least}");
    }

    /// Two keys as busy as each other in one cell: the one that holds it keeps it, where
    /// taking the cell at every request would leave both at 1.
    #[test]
    fn of_two_busy_keys_in_a_cell_one_keeps_it() {
        let (heat, policy) = table();
        let (first, other) = collision(&heat, &policy);
        let mut seen = (0, 0);
        for i in 0..200 {
            let now = i * (PERIOD / 20);
            seen.0 = seen.0.max(heat.touch(first, now, PERIOD, 1).estimate);
            seen.1 = seen.1.max(heat.touch(other, now, PERIOD, 1).estimate);
        }
        assert!(seen.0.max(seen.1) >= 10, "{seen:?}");
    }

    #[test]
    fn a_leasing_cell_is_not_taken_over_until_its_bit_is_cleared() {
        let (heat, policy) = table();
        let (first, other) = collision(&heat, &policy);
        heat.touch(first, 0, PERIOD, 30);
        assert!(heat.pin(first, 0, PERIOD));
        let cold = Reading {
            estimate: 0,
            leasing: false,
        };
        assert_eq!(heat.touch(other, 0, PERIOD, 50), cold, "pinned");
        assert!(!heat.pin(other, 0, PERIOD), "pinned");
        heat.unpin(other);
        let first_reading = heat.read(first, 0, PERIOD);
        assert_eq!((first_reading.estimate, first_reading.leasing), (30, true));
        heat.unpin(first);
        assert!(!heat.read(first, 0, PERIOD).leasing);
        // Unpinned, the cell is contended for: the first's 30 units are spent two periods on.
        assert_eq!(heat.touch(other, 2 * PERIOD, PERIOD, 5).estimate, 5);
        assert!(heat.pin(other, 2 * PERIOD, PERIOD));
    }
}
