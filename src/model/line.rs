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

use crate::Algorithm;

/// How long past its turn a reservation stays in line (µs): its caller looks once more at its
/// turn, before its request goes out.
pub(crate) const KEPT: u64 = 10_000_000;

/// One key's reservations waiting for their turns, and its pause.
#[derive(Debug, Default, Clone)]
pub(crate) struct Line {
    /// By turn (µs), then id: the reservation's cost, and its notice (µs: it moves only into
    /// places at least that far from the time of the move).
    turns: BTreeMap<(u64, u64), (u64, u64)>,
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

    /// Puts reservation `id` of `cost` in line at its turn `at`, with its `notice`.
    pub(crate) fn join(&mut self, now: u64, at: u64, id: u64, (cost, notice): (u64, u64)) {
        self.turns
            .retain(|&(turn, _), _| turn.saturating_add(KEPT) > now);
        self.turns.insert((at, id), (cost, notice));
    }

    /// The turn of reservation `id`, while it is in line.
    pub(crate) fn turn(&self, id: u64) -> Option<u64> {
        self.turns
            .keys()
            .find(|&&(_, i)| i == id)
            .map(|&(at, _)| at)
    }

    /// The turn of reservation `id`, while it is in line; one whose turn is at most `late`
    /// ahead of `now` leaves the line, used (its caller sleeps the rest and goes).
    pub(crate) fn look(&mut self, now: u64, id: u64, late: u64) -> Option<u64> {
        let at = self.turn(id)?;
        if at <= now.saturating_add(late) {
            self.turns.remove(&(at, id));
        }
        Some(at)
    }

    /// The latest turn in line, if any.
    pub(crate) fn last(&self) -> Option<u64> {
        self.turns.keys().next_back().map(|&(at, _)| at)
    }

    /// Takes reservation `id` out: from its place on, each later reservation of its cost moves
    /// up into the place the one before it left, while that place is at least the mover's
    /// notice from `now` (its caller learns of it in time) and not before the pause. Returns
    /// its turn and the place left at the end ([`Left`]); `None` when `id` is not in line.
    pub(crate) fn leave(&mut self, now: u64, id: u64) -> Option<(u64, Left)> {
        let at = self.turn(id)?;
        let (cost, _) = self.turns.remove(&(at, id))?;
        let mut free = at;
        if free >= self.pause {
            let later: Vec<((u64, u64), u64)> = self
                .turns
                .range((at.saturating_add(1), 0)..)
                .take_while(|&(_, &(c, _))| c == cost)
                .map(|(&place, &(_, notice))| (place, notice))
                .collect();
            for ((turn, i), notice) in later {
                if free < now.saturating_add(notice) {
                    break;
                }
                self.turns.remove(&(turn, i));
                self.turns.insert((free, i), (cost, notice));
                free = turn;
            }
        }
        let last = self
            .turns
            .range((free.saturating_add(1), 0)..)
            .next()
            .is_none();
        Some((
            at,
            Left {
                at: free,
                cost,
                last,
            },
        ))
    }
}

/// The place a reservation that left the line leaves at its end: its time (µs), its units,
/// and whether no reservation in line comes after it. The store gives its units back on the
/// sliding log, and on GCRA only where it is the last: GCRA's backlog is a count, so giving
/// back a place that reservations come after would let the next reservation take the time of
/// one already made; such a place stays recorded, unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Left {
    pub(crate) at: u64,
    pub(crate) cost: u64,
    pub(crate) last: bool,
}

impl Left {
    /// Whether the store gives this place's units back under `algorithm`.
    pub(crate) fn given_back(&self, algorithm: Algorithm) -> bool {
        gives_back(algorithm, self.last)
    }
}

/// Whether a place left at the end of a line, `last` or not, has its units given back under
/// `algorithm` ([`Left`]): always on the sliding log, on GCRA only the last.
pub(crate) fn gives_back(algorithm: Algorithm, last: bool) -> bool {
    last || algorithm == Algorithm::SlidingLog
}

#[cfg(test)]
mod tests {
    use super::*;

    fn left(at: u64, last: bool) -> Left {
        Left { at, cost: 1, last }
    }

    fn line(turns: &[(u64, u64)]) -> Line {
        let mut line = Line::default();
        for &(at, id) in turns {
            line.join(0, at, id, (1, 0));
        }
        line
    }

    #[test]
    fn those_behind_move_up_in_order_and_the_last_place_is_given_back() {
        let mut line = line(&[(100, 1), (200, 2), (300, 3), (400, 4)]);
        assert_eq!(line.leave(50, 2), Some((200, left(400, true))));
        assert_eq!(line.turn(1), Some(100));
        assert_eq!(line.turn(3), Some(200));
        assert_eq!(line.turn(4), Some(300));
        assert_eq!(line.turn(2), None);
        // Left twice: nothing more.
        assert_eq!(line.leave(50, 2), None);
    }

    #[test]
    fn nobody_moves_into_a_place_too_soon_or_in_a_pause() {
        // A place left with reservations after it stays recorded: nothing is given back.
        let mut passed = line(&[(100, 1), (200, 2)]);
        assert_eq!(passed.leave(150, 1), Some((100, left(100, false))));
        assert_eq!(passed.turn(2), Some(200));
        // A reservation whose caller learns of a move 51 after it is not moved to 50 from now.
        let mut soon = Line::default();
        soon.join(0, 100, 1, (1, 0));
        soon.join(0, 200, 2, (1, 51));
        assert_eq!(soon.leave(50, 1), Some((100, left(100, false))));
        assert_eq!(soon.turn(2), Some(200));
        soon.join(0, 300, 3, (1, 50));
        assert_eq!(soon.leave(150, 2), Some((200, left(300, true))));
        assert_eq!(soon.turn(3), Some(200));
        let mut paused = line(&[(100, 1), (200, 2)]);
        paused.pause(150);
        assert_eq!(paused.leave(50, 1), Some((100, left(100, false))));
        assert_eq!(paused.turn(2), Some(200));
        assert_eq!(paused.floor(50), 150);
    }

    #[test]
    fn a_reservation_of_another_cost_stops_the_moving_up() {
        let mut line = line(&[(100, 1), (200, 2)]);
        line.join(0, 300, 3, (2, 0));
        line.join(0, 400, 4, (1, 0));
        assert_eq!(line.leave(0, 1), Some((100, left(200, false))));
        assert_eq!(line.turn(2), Some(100));
        assert_eq!((line.turn(3), line.turn(4)), (Some(300), Some(400)));
    }

    #[test]
    fn a_reservation_whose_turn_has_come_leaves_the_line_when_it_looks() {
        let mut line = line(&[(100, 1), (200, 2)]);
        assert_eq!(line.look(50, 1, 0), Some(100));
        assert_eq!(line.look(100, 1, 0), Some(100));
        assert_eq!(line.look(100, 1, 0), None);
        // Used, it moves nobody up when it leaves.
        assert_eq!(line.leave(100, 1), None);
        assert_eq!(line.turn(2), Some(200));
    }

    #[test]
    fn turns_of_the_same_instant_keep_theirs() {
        let mut line = line(&[(100, 1), (100, 2), (200, 3)]);
        assert_eq!(line.leave(0, 1), Some((100, left(200, true))));
        assert_eq!((line.turn(2), line.turn(3)), (Some(100), Some(100)));
        // Others at the same instant do not come after it: it is the last.
        let mut tied = super::tests::line(&[(100, 1), (100, 2)]);
        assert_eq!(tied.leave(0, 1), Some((100, left(100, true))));
    }
}
