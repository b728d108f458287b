//! The line of reservations of one key ([`Reserve`](super::Reserve)), free of I/O and clocks:
//! the memory store runs it, and `scripts/line.lua` (with `join_line` in `prelude.lua`) is the
//! same over Redis sorted sets.
//!
//! Why a line beside the algorithm's state: a reservation's units are recorded at once, at
//! its turn, so that the next one queues behind it; a caller that stops waiting leaves a place
//! whose units nobody will use. Giving them back alone would let a newcomer take them while
//! the callers behind keep their later turns (a gap in the schedule, and an order broken).
//! Instead the callers behind move up, each into the place the one before it had, and only
//! the last place is given back: the turns in use are always a subset of the turns recorded,
//! so that no limit holds more than it did, and their order is the order they were reserved
//! in.
//!
//! **Places and reservations kept apart.** The line holds the places (the turns recorded, in
//! time order) and the reservations (in the order they joined), and a reservation's turn is
//! the place of its rank: the `r`-th reservation has the `r`-th place. So moving everyone
//! behind a leaver up one place is one removal, of the last place, not a write per
//! reservation: a leave costs a constant number of operations (O(log n) each on Redis's
//! sorted sets), and a storm of cancellations costs linearly. A newcomer's turn is never
//! before the last place ([`Line::join`]), so a newcomer's place is the last, as its rank is.
//!
//! **The rule of a leave.** The leaver's reservation goes, and either
//! - the last place goes (those behind it move up one place each), where its own place is
//!   at least the line's notice from now (the longest [`notice`](super::Ticket::notice) of the
//!   reservations still in line: each caller learns of the move at its next look, and must be
//!   in time for its new turn), not before the key's pause, and every reservation in line has
//!   the leaver's cost (a place holds its own cost's units);
//! - or else its own place goes, and nobody moves.
//!
//! The place that went is answered ([`Left`]), for the store to give its units back.

use crate::Algorithm;

/// How long past its turn a reservation stays in line (µs): its caller looks once more at its
/// turn, before its request goes out.
pub(crate) const KEPT: u64 = 10_000_000;

/// One reservation in line: its id and cost (what names it), and its notice (µs: it moves
/// only into places at least that far from the time of the move).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Waiting {
    id: u64,
    cost: u64,
    notice: u64,
}

/// One key's reservations waiting for their turns, their places, and the key's pause.
#[derive(Debug, Default, Clone)]
pub(crate) struct Line {
    /// The reservations, in the order they joined.
    waiting: Vec<Waiting>,
    /// The places (µs), in time order (one instant's in the order they were made): the
    /// reservation of rank `r` in `waiting` has place `r`.
    places: Vec<u64>,
    /// Until when (µs) the key is paused (0: never).
    pause: u64,
    /// The longest `late` (µs) of the key's recent reservations, and until when (µs) it is
    /// remembered ([`Line::late`]).
    late: (u64, u64),
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

    /// How late (µs) a reservation made `now` with its own `late` must read the key's
    /// windows: the longest `late` of the reservations that may still be used within one of
    /// them, its own included. Instances whose margins differ (a far one's widened by its
    /// round trip) share the key's events, which may be used that late: a reservation that read
    /// only its own shorter late would count a far one's unit in the wrong window. Its own
    /// `late` is remembered when it is at least the remembered one, `kept` (µs: its most wait
    /// plus the longest window) plus its late from now, rounded up to the millisecond, or
    /// longer where the remembered one was kept longer (Redis: `<key>:late`, `prelude.lua`).
    pub(crate) fn late(&mut self, now: u64, late: u64, kept: u64) -> u64 {
        let (longest, until) = self.late;
        let longest = if until > now { longest } else { 0 };
        if late >= longest && late > 0 {
            let ms = kept
                .saturating_add(late)
                .div_ceil(1000)
                .saturating_mul(1000);
            self.late = (late, until.max(now.saturating_add(ms)));
        }
        late.max(longest)
    }

    /// Puts reservation `id` of `cost` in line at its turn `at`, with its `notice`: its place
    /// joins the places, and it joins the end of the line. Reservations whose places are
    /// [`KEPT`] past go first; one of the same id and cost already in line goes with its own
    /// place (an id is unique among the callers in line). Returns its turn: `at`, or the last
    /// place in line where `at` is before it, so that its place is the last, as its rank is.
    /// The algorithms give later reservations later turns, but for counts raised by an
    /// override or a reservation with another `late` (GCRA) or a state lost while its line
    /// was not (Redis): units recorded at `at` and used later keep every limit on GCRA, whose
    /// bucket drains the same; on the sliding log the turn is never before the log's newest
    /// event, which the last place is not after while the log is kept.
    pub(crate) fn join(&mut self, now: u64, at: u64, id: u64, (cost, notice): (u64, u64)) -> u64 {
        let stale = self
            .places
            .partition_point(|&place| place.saturating_add(KEPT) <= now);
        self.waiting.drain(..stale);
        self.places.drain(..stale);
        if let Some(rank) = self.rank(id, cost) {
            self.take_out(rank);
        }
        let at = at.max(self.last().unwrap_or(0));
        self.places.push(at);
        self.waiting.push(Waiting { id, cost, notice });
        at
    }

    /// The rank of reservation `id` of `cost` in line, if it is in line.
    fn rank(&self, id: u64, cost: u64) -> Option<usize> {
        self.waiting
            .iter()
            .position(|w| w.id == id && w.cost == cost)
    }

    /// Takes the reservation of rank `rank` out with its own place: nobody moves. Its place.
    fn take_out(&mut self, rank: usize) -> u64 {
        self.waiting.remove(rank);
        self.places.remove(rank)
    }

    /// The turn of reservation `id` of `cost`, while it is in line.
    pub(crate) fn turn(&self, id: u64, cost: u64) -> Option<u64> {
        self.rank(id, cost).map(|rank| self.places[rank])
    }

    /// The turn of reservation `id` of `cost`, while it is in line; one whose turn is at most
    /// `late` ahead of `now`, and not before the pause's end, leaves the line, used, with its
    /// own place (its caller sleeps the rest and goes). One whose turn the pause covers stays:
    /// its caller reserves again, and leaves.
    pub(crate) fn look(&mut self, now: u64, (id, cost): (u64, u64), late: u64) -> Option<u64> {
        let rank = self.rank(id, cost)?;
        let at = self.places[rank];
        if at <= now.saturating_add(late) && at >= self.pause {
            self.take_out(rank);
        }
        Some(at)
    }

    /// The latest turn in line, if any.
    pub(crate) fn last(&self) -> Option<u64> {
        self.places.last().copied()
    }

    /// Takes reservation `id` of `cost` out (see the rule in the module's doc): those behind it
    /// move up one place each, the last place going, where its own place is at least the
    /// line's notice from `now`, not before the pause, and every reservation left in line is of
    /// its cost; else its own place goes. Returns its turn and the place that went ([`Left`]);
    /// `None` when it is not in line.
    pub(crate) fn leave(&mut self, now: u64, (id, cost): (u64, u64)) -> Option<(u64, Left)> {
        let rank = self.rank(id, cost)?;
        self.waiting.remove(rank);
        let at = self.places[rank];
        let notice = self.waiting.iter().map(|w| w.notice).max().unwrap_or(0);
        let one_cost = self.waiting.iter().all(|w| w.cost == cost);
        let moves = at >= self.pause && at >= now.saturating_add(notice) && one_cost;
        let free = match moves {
            true => self.places.pop().unwrap_or(at),
            false => self.places.remove(rank),
        };
        let last = self.last().is_none_or(|place| place <= free);
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

    fn turns(line: &Line, ids: &[u64]) -> Vec<Option<u64>> {
        ids.iter().map(|&id| line.turn(id, 1)).collect()
    }

    #[test]
    fn those_behind_move_up_in_order_and_the_last_place_is_given_back() {
        let mut line = line(&[(100, 1), (200, 2), (300, 3), (400, 4)]);
        assert_eq!(line.leave(50, (2, 1)), Some((200, left(400, true))));
        assert_eq!(
            turns(&line, &[1, 2, 3, 4]),
            [Some(100), None, Some(200), Some(300)]
        );
        // Left twice: nothing more.
        assert_eq!(line.leave(50, (2, 1)), None);
        // The last in line leaves its own place, which is the last.
        assert_eq!(line.leave(50, (4, 1)), Some((300, left(300, true))));
        assert_eq!(turns(&line, &[1, 3]), [Some(100), Some(200)]);
    }

    #[test]
    fn nobody_moves_where_the_place_left_is_too_soon_or_in_a_pause() {
        // A place left with reservations after it stays recorded: nothing is given back.
        let mut passed = line(&[(100, 1), (200, 2)]);
        assert_eq!(passed.leave(150, (1, 1)), Some((100, left(100, false))));
        assert_eq!(passed.turn(2, 1), Some(200));
        // The line's notice is the longest of those in line: 51 from 50 is past the place
        // left at 100, so nobody moves, though the one right behind would learn in time.
        let mut soon = Line::default();
        soon.join(0, 100, 1, (1, 0));
        soon.join(0, 200, 2, (1, 0));
        soon.join(0, 300, 3, (1, 51));
        assert_eq!(soon.leave(50, (1, 1)), Some((100, left(100, false))));
        assert_eq!(turns(&soon, &[2, 3]), [Some(200), Some(300)]);
        // With 50 of notice, the place left at 200 is in time: both behind move up.
        soon.join(0, 400, 4, (1, 50));
        soon.leave(0, (3, 1));
        assert_eq!(soon.leave(150, (2, 1)), Some((200, left(300, true))));
        assert_eq!(soon.turn(4, 1), Some(200));
        let mut paused = line(&[(100, 1), (200, 2)]);
        paused.pause(150);
        assert_eq!(paused.leave(50, (1, 1)), Some((100, left(100, false))));
        assert_eq!(paused.turn(2, 1), Some(200));
        assert_eq!(paused.floor(50), 150);
    }

    #[test]
    fn in_a_line_of_several_costs_nobody_moves() {
        let mut line = line(&[(100, 1), (200, 2)]);
        line.join(0, 300, 3, (2, 0));
        line.join(0, 400, 4, (1, 0));
        assert_eq!(line.leave(0, (1, 1)), Some((100, left(100, false))));
        assert_eq!(turns(&line, &[2, 4]), [Some(200), Some(400)]);
        assert_eq!(line.turn(3, 2), Some(300));
        // A reservation is named by its id and its cost.
        assert_eq!(line.turn(3, 1), None);
        // Once the other cost left, the line moves up again.
        assert_eq!(
            line.leave(0, (3, 2)).map(|(at, l)| (at, l.at)),
            Some((300, 300))
        );
        assert_eq!(line.leave(0, (2, 1)), Some((200, left(400, true))));
        assert_eq!(line.turn(4, 1), Some(200));
    }

    #[test]
    fn the_longest_late_is_remembered_its_wait_and_window_past_it() {
        let mut line = Line::default();
        // 200 µs late, kept 1 000 µs: remembered until 2 000 (1 200 rounded up to the ms).
        assert_eq!(line.late(0, 200, 1_000), 200);
        assert_eq!(line.late(500, 50, 1_000), 200);
        // Met again later, kept from then (until 3 000); a longer one replaces it, kept at
        // least as long as the one it replaces.
        assert_eq!(line.late(1_000, 200, 1_000), 200);
        assert_eq!(line.late(1_500, 300, 0), 300);
        assert_eq!(line.late(2_500, 50, 1_000), 300);
        assert_eq!(line.late(2_999, 0, 0), 300);
        // Forgotten once past: each reads its own again.
        assert_eq!(line.late(3_000, 50, 1_000), 50);
        assert_eq!(line.late(3_000, 0, 1_000), 50);
    }

    #[test]
    fn a_look_takes_out_a_reservation_whose_turn_is_within_its_late() {
        let mut line = line(&[(100, 1), (200, 2), (300, 3)]);
        // 50 ahead, more than a late of 49: it stays; within a late of 50, it goes, used.
        assert_eq!(line.look(50, (1, 1), 49), Some(100));
        assert_eq!(line.look(50, (1, 1), 50), Some(100));
        assert_eq!(line.look(50, (1, 1), 50), None);
        // Used, it moves nobody up when it leaves, and the others keep their places.
        assert_eq!(line.leave(100, (1, 1)), None);
        assert_eq!(turns(&line, &[2, 3]), [Some(200), Some(300)]);
        // Past its turn, it goes too.
        assert_eq!(line.look(250, (2, 1), 0), Some(200));
        assert_eq!(line.turn(2, 1), None);
        // A turn the pause covers stays: its caller reserves again and leaves.
        line.pause(400);
        assert_eq!(line.look(300, (3, 1), 0), Some(300));
        assert_eq!(line.turn(3, 1), Some(300));
    }

    #[test]
    fn turns_of_the_same_instant_keep_theirs() {
        let mut line = line(&[(100, 1), (100, 2), (200, 3)]);
        assert_eq!(line.leave(0, (1, 1)), Some((100, left(200, true))));
        assert_eq!(turns(&line, &[2, 3]), [Some(100), Some(100)]);
        // Others at the same instant do not come after it: it is the last.
        let mut tied = super::tests::line(&[(100, 1), (100, 2)]);
        assert_eq!(tied.leave(0, (1, 1)), Some((100, left(100, true))));
    }

    #[test]
    fn places_kept_past_their_turns_go_with_their_reservations_and_an_id_joins_once() {
        let mut line = line(&[(100, 1), (200, 2)]);
        line.join(100 + KEPT, 300 + KEPT, 3, (1, 0));
        assert_eq!(
            turns(&line, &[1, 2, 3]),
            [None, Some(200), Some(300 + KEPT)]
        );
        // The same id again: the first goes with its own place.
        line.join(0, 400 + KEPT, 2, (1, 0));
        assert_eq!(turns(&line, &[2, 3]), [Some(400 + KEPT), Some(300 + KEPT)]);
        // A turn before the last place is put off to it.
        assert_eq!(line.join(0, 350 + KEPT, 4, (1, 0)), 400 + KEPT);
        assert_eq!(line.turn(4, 1), Some(400 + KEPT));
    }

    #[test]
    fn a_thousand_leaving_from_the_front_each_give_back_the_last_place() {
        // A thousand in line, each leaving in turn from the front: those behind move up one
        // place at each leave, and the last place is given back each time.
        let mut line = Line::default();
        for id in 0..1000 {
            line.join(0, 1000 + id * 10, id, (1, 0));
        }
        for id in 0..999 {
            let (_, left) = line.leave(0, (id, 1)).unwrap();
            assert_eq!(left.at, 1000 + (999 - id) * 10);
        }
        assert_eq!(line.turn(999, 1), Some(1000));
    }
}
