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
//! hashes meet in a cell share it: the newcomer takes it over (starting from 0), unless the
//! cell's leasing bit is set, which pins it to the key that holds an entry in the book, so that
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
    /// last period, these units included. A cell held by another key is taken over, unless it
    /// is pinned (leasing): then nothing is counted and the key reads as cold.
    pub(crate) fn touch(&self, spot: Spot, now: u64, length: u64, units: u64) -> Reading {
        self.update(spot, now, length, |cell| {
            cell.current = (cell.current + units).min(COUNT);
        })
        .unwrap_or(Reading {
            estimate: 0,
            leasing: false,
        })
    }

    /// What the cell says of the key at `now`, counting nothing; a key whose cell is held by
    /// another reads as cold and not leasing.
    pub(crate) fn read(&self, spot: Spot, now: u64, length: u64) -> Reading {
        let cell = Cell::unpack(self.cells[spot.cell].load(Ordering::Acquire));
        if cell.fingerprint != spot.fingerprint {
            return Reading {
                estimate: 0,
                leasing: false,
            };
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
        let pinned = self.update(spot, now, length, |cell| cell.leasing = true);
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

    /// Applies `change` to the key's cell, seen at `now`, taking the cell over if another
    /// key's is not pinned; the reading after, or `None` when the cell is pinned by another.
    fn update(
        &self,
        spot: Spot,
        now: u64,
        length: u64,
        change: impl Fn(&mut Cell),
    ) -> Option<Reading> {
        let atomic = &self.cells[spot.cell];
        let period = (now / length) & COUNT;
        let mut word = atomic.load(Ordering::Acquire);
        loop {
            let old = Cell::unpack(word);
            let mut cell = match old.fingerprint == spot.fingerprint {
                true => old.rolled(period),
                false if old.leasing => return None,
                false => Cell {
                    leasing: false,
                    fingerprint: spot.fingerprint,
                    period,
                    current: 0,
                    previous: 0,
                },
            };
            change(&mut cell);
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
                Ok(_) => return Some(reading),
                Err(now_there) => word = now_there,
            }
        }
    }
}

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
    fn a_key_sharing_a_cell_takes_it_over() {
        let (heat, policy) = table();
        let (first, other) = collision(&heat, &policy);
        assert_eq!(heat.touch(first, 0, PERIOD, 30).estimate, 30);
        assert_eq!(heat.touch(other, 0, PERIOD, 1).estimate, 1, "starts at 0");
        assert_eq!(heat.read(first, 0, PERIOD).estimate, 0, "the first lost it");
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
        assert_eq!(heat.touch(other, 0, PERIOD, 5).estimate, 5);
        assert!(heat.pin(other, 0, PERIOD));
    }
}
