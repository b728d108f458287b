//! The line of reservations of one key ([`Reserve`](super::Reserve)), free of I/O and clocks:
//! the memory store runs it, and `scripts/line.lua` (with `join_line` in `prelude.lua`) is the
//! same over a Redis sorted set scored by turn.
//!
//! Why a line beside the algorithm's state: a reservation's units are recorded at once, at
//! its turn, so that the next one queues behind it; a caller that stops waiting leaves a place
//! whose units nobody will use. Giving them back alone would let a newcomer take them while
//! the callers behind keep their later turns (a gap in the schedule, and an order broken).
//! Instead the callers behind move up, each into the place the one before it left, and only
//! the place left at the end is given back: the turns in use are always a subset of the turns
//! recorded, so that no limit holds more than it did, and their order is the order they were
//! reserved in.

use std::collections::BTreeMap;

/// How long past its turn a reservation stays in line (µs): its caller looks once more at its
/// turn, before its request goes out.
pub(crate) const KEPT: u64 = 10_000_000;

/// One key's reservations waiting for their turns, and its pause.
#[derive(Debug, Default, Clone)]
pub(crate) struct Line {
    /// By turn (µs), then id: the reservation's cost.
    turns: BTreeMap<(u64, u64), u64>,
    /// Until when (µs) the key is paused (0: never).
    pause: u64,
}

impl Line {
    /// The earliest a reservation made `now` may have its turn: after the key's pause.
    pub(crate) fn floor(&self, now: u64) -> u64 {
        self.pause.max(now)
    }

    /// Until when the key is paused (0: never).
    pub(crate) fn paused_until(&self) -> u64 {
        self.pause
    }

    /// Pauses the key until `until`, or keeps a longer pause.
    pub(crate) fn pause(&mut self, until: u64) {
        self.pause = self.pause.max(until);
    }

    /// Puts reservation `id` of `cost` in line at its turn `at`.
    pub(crate) fn join(&mut self, now: u64, at: u64, id: u64, cost: u64) {
        self.turns
            .retain(|&(turn, _), _| turn.saturating_add(KEPT) > now);
        self.turns.insert((at, id), cost);
    }

    /// The turn of reservation `id`, while it is in line.
    pub(crate) fn turn(&self, id: u64) -> Option<u64> {
        self.turns
            .keys()
            .find(|&&(_, i)| i == id)
            .map(|&(at, _)| at)
    }

    /// The turn of reservation `id`, while it is in line; one whose turn has come leaves the
    /// line, used (its caller goes now).
    pub(crate) fn look(&mut self, now: u64, id: u64) -> Option<u64> {
        let at = self.turn(id)?;
        if at <= now {
            self.turns.remove(&(at, id));
        }
        Some(at)
    }

    /// The latest turn in line, if any.
    pub(crate) fn last(&self) -> Option<u64> {
        self.turns.keys().next_back().map(|&(at, _)| at)
    }

    /// Takes reservation `id` out: from its place on, each later reservation of its cost moves
    /// up into the place the one before it left, where that place is at least `notice` from
    /// `now` (its caller learns it in time) and not before the pause. Returns its turn and,
    /// where the place left at the end is the last in line, that place `(turn, cost)`, whose
    /// units the store gives back; a place left with reservations after it stays recorded,
    /// unused (giving it back would let GCRA place the next reservation at the time of one
    /// already made after it). `None` when `id` is not in line.
    pub(crate) fn leave(
        &mut self,
        now: u64,
        id: u64,
        notice: u64,
    ) -> Option<(u64, Option<(u64, u64)>)> {
        let at = self.turn(id)?;
        let cost = self.turns.remove(&(at, id))?;
        let mut free = at;
        if free >= now.saturating_add(notice) && free >= self.pause {
            let later: Vec<(u64, u64)> = self
                .turns
                .range((at.saturating_add(1), 0)..)
                .take_while(|&(_, &c)| c == cost)
                .map(|(&place, _)| place)
                .collect();
            for (turn, i) in later {
                self.turns.remove(&(turn, i));
                self.turns.insert((free, i), cost);
                free = turn;
            }
        }
        let last = self.turns.range((free, 0)..).next().is_none();
        Some((at, last.then_some((free, cost))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(turns: &[(u64, u64)]) -> Line {
        let mut line = Line::default();
        for &(at, id) in turns {
            line.join(0, at, id, 1);
        }
        line
    }

    #[test]
    fn those_behind_move_up_in_order_and_the_last_place_is_given_back() {
        let mut line = line(&[(100, 1), (200, 2), (300, 3), (400, 4)]);
        assert_eq!(line.leave(50, 2, 0), Some((200, Some((400, 1)))));
        assert_eq!(line.turn(1), Some(100));
        assert_eq!(line.turn(3), Some(200));
        assert_eq!(line.turn(4), Some(300));
        assert_eq!(line.turn(2), None);
        // Left twice: nothing more.
        assert_eq!(line.leave(50, 2, 0), None);
    }

    #[test]
    fn nobody_moves_into_a_place_too_soon_or_in_a_pause() {
        let mut passed = line(&[(100, 1), (200, 2)]);
        // A place left with reservations after it stays recorded: nothing is given back.
        assert_eq!(passed.leave(150, 1, 0), Some((100, None)));
        assert_eq!(passed.turn(2), Some(200));
        let mut soon = line(&[(100, 1), (200, 2)]);
        assert_eq!(soon.leave(50, 1, 51), Some((100, None)));
        assert_eq!(soon.turn(2), Some(200));
        assert_eq!(soon.leave(50, 2, 50), Some((200, Some((200, 1)))));
        let mut paused = line(&[(100, 1), (200, 2)]);
        paused.pause(150);
        assert_eq!(paused.leave(50, 1, 0), Some((100, None)));
        assert_eq!(paused.turn(2), Some(200));
        assert_eq!(paused.floor(50), 150);
    }

    #[test]
    fn a_reservation_of_another_cost_stops_the_moving_up() {
        let mut line = line(&[(100, 1), (200, 2)]);
        line.join(0, 300, 3, 2);
        line.join(0, 400, 4, 1);
        assert_eq!(line.leave(0, 1, 0), Some((100, None)));
        assert_eq!(line.turn(2), Some(100));
        assert_eq!((line.turn(3), line.turn(4)), (Some(300), Some(400)));
    }

    #[test]
    fn a_reservation_whose_turn_has_come_leaves_the_line_when_it_looks() {
        let mut line = line(&[(100, 1), (200, 2)]);
        assert_eq!(line.look(50, 1), Some(100));
        assert_eq!(line.look(100, 1), Some(100));
        assert_eq!(line.look(100, 1), None);
        // Used, it moves nobody up when it leaves.
        assert_eq!(line.leave(100, 1, 0), None);
        assert_eq!(line.turn(2), Some(200));
    }

    #[test]
    fn turns_of_the_same_instant_keep_theirs() {
        let mut line = line(&[(100, 1), (100, 2), (200, 3)]);
        assert_eq!(line.leave(0, 1, 0), Some((100, Some((200, 1)))));
        assert_eq!((line.turn(2), line.turn(3)), (Some(100), Some(100)));
    }
}
