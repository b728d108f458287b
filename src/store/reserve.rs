//! Reservations: a request that waits for its turn instead of being refused, for calls a
//! service makes to an API that limits it (`docs/outbound.md`).
//!
//! A reservation is recorded at once, so the next caller queues behind it, in reservation
//! order, on every instance that shares the store. A caller that stops waiting leaves the
//! line: the reservations behind it move up a place each, and the units of the last place
//! are given back, never more than were reserved. A caller asleep until its turn looks to learn
//! that it moved up, or that the key was paused (an upstream answered "too many requests").

use std::future::Future;
use std::time::Duration;

use super::Store;
use crate::{Algorithm, Key, Policy, StoreError};

/// A store that reserves: it answers when a request's units may be used rather than only
/// whether they may be used now, and keeps the reservations of each key in a line. Like
/// [`Engine`](super::engine::Engine), a supertrait of [`Store`] that only this crate names.
pub trait Reserve {
    /// What [`look`](Reserve::look), [`leave`](Reserve::leave) and [`pause`](Reserve::pause)
    /// answer.
    type LineFuture: Future<Output = Result<InLine, StoreError>> + Send + 'static;

    /// What [`look_many`](Reserve::look_many) answers.
    type LinesFuture: Future<Output = Result<Vec<InLine>, StoreError>> + Send + 'static;

    /// Reserves `ticket.cost` units of `key` under `policy` for the earliest time they fit
    /// every limit after every reservation made before, and after the key's pause, if that is
    /// at most `ticket.max_wait` away: an admitted decision whose
    /// turn (`Decision::turn`) says how long to wait before using them, and the
    /// reservation joins the key's line as `ticket.id`. Past `max_wait` nothing is recorded,
    /// and the refusal's [`retry_after`](crate::Decision::retry_after) says when the turn
    /// would have come (`None`: never, a cost over a count).
    ///
    /// `ticket.late`: how long after its turn the caller may use the units, as the limit that
    /// counts them sees it (an upstream API counts requests as they arrive, a network's delay
    /// after they left). Turns keep every window `late` longer within its count (the sliding
    /// log reads it that much longer, GCRA keeps that much drain free on Redis), so that units
    /// used up to `late` after their turns stay within the limit (`docs/leases.md` has the
    /// argument, for leases).
    ///
    /// GCRA and the sliding log reserve; the counters keep no place for a later turn, and a
    /// penalty box or a concurrency limit has no meaning for a turn:
    /// [`StoreError::Unsupported`].
    fn reserve(&self, key: &Key, policy: &Policy, ticket: Ticket) -> <Self as Store>::Future
    where
        Self: Store;

    /// Where reservation `ticket.id` stands: its turn, moved up where reservations ahead of
    /// it left the line, how far past it the store's now is, and the key's pause. A
    /// reservation whose turn is at most [`ticket.late`](Ticket::late) ahead of the store's
    /// now leaves the line, used: its caller sleeps the rest and goes, with no second look
    /// (nobody moves into its place, and it moves no more).
    fn look(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture;

    /// Where each of `tickets` stands, in their order, in one store call (one script call on
    /// Redis), with the key's pause: a looker's periodic look for many waiters of one key.
    /// Takes nothing out of the line: each caller still looks at its turn
    /// ([`look`](Reserve::look)).
    fn look_many(&self, key: &Key, policy: &Policy, tickets: Vec<Ticket>) -> Self::LinesFuture;

    /// Takes reservation `ticket.id` of `ticket.cost` out of the line, and one place with it
    /// (`src/model/line.rs`): the last, so that every reservation behind it moves up one place,
    /// where its own place is at least the line's notice (the longest
    /// [`notice`](Ticket::notice) of the reservations left in line) from now, not before the
    /// key's pause, and the line holds its cost alone; else its own place, and nobody moves.
    /// Its caller learns of a move when it next looks, and must still be in time for its new
    /// turn. The units of the place that went are given back where no place in line is after
    /// it (one with places after it stays recorded, unused, on GCRA: giving it back would let
    /// the next reservation take the time of one made after it; the sliding log gives it back
    /// always). A constant number of operations whatever the line's length (on Redis, commands
    /// of O(log n) each). Nothing where `ticket.id` is not in line (it was never made, was
    /// taken out used, or a reset or restart lost it). Answers where it stood before.
    fn leave(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture;

    /// Pauses `key` for `pause` from now (or keeps a longer pause it has): reservations made
    /// meanwhile get turns after it, and those in line with turns before its end learn it
    /// when they look, and reserve again. Answers the pause in force, with no turn.
    fn pause(&self, key: &Key, policy: &Policy, pause: Duration) -> Self::LineFuture;
}

/// One reservation: its id in the key's line, chosen by the caller (unique among the callers
/// that share the store, below [`MAX_ID`], 2^52), its cost (at least one unit), the most it may wait, how late after its turn
/// its units may be used ([`Reserve::reserve`]), and how soon its caller learns of a move.
/// `late` and `notice` are at most an hour ([`MAX_LATE`]); past it the store refuses the
/// reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// The reservation's id in its key's line.
    pub id: u64,
    /// Its units.
    pub cost: u32,
    /// The most it may wait for its turn.
    pub max_wait: Duration,
    /// How late after its turn its units may be used. The key remembers the longest of its
    /// recent reservations' (their `max_wait` plus the longest window past them), and each
    /// reservation reads the windows by the longest of its own and that one: units of
    /// reservations with another `late` (an instance with another margin) share the windows.
    pub late: Duration,
    /// How soon after the line moves it up its caller learns of it (when it next looks), and
    /// may use its units `late` after that: it is moved only into places at least this far
    /// from the time of the move ([`Reserve::leave`]). A caller that looks every `r` needs
    /// `r + late`.
    pub notice: Duration,
}

/// The most [`Ticket::late`] and [`Ticket::notice`] may be.
pub const MAX_LATE: Duration = Duration::from_secs(3600);

impl Ticket {
    /// A ticket of one unit, `id`, that waits up to `max_wait`, used at its turn, whose
    /// caller learns of a move at once.
    pub fn new(id: u64, max_wait: Duration) -> Ticket {
        Ticket {
            id,
            cost: 1,
            max_wait,
            late: Duration::ZERO,
            notice: Duration::ZERO,
        }
    }
}

/// Where a reservation stands in its key's line ([`Reserve::look`]), as durations from the
/// store's now (so that a caller brackets them by its own send and receive instants, without
/// reading the store's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InLine {
    /// How long from the store's now its turn is still ahead (zero once it has come); `None`
    /// when it is not in line (it left, was taken out used, was never made, or a reset or
    /// restart lost it).
    pub turn: Option<Duration>,
    /// How far past its turn the store's now is (zero while the turn is ahead, and when it is
    /// not in line).
    pub past: Duration,
    /// How long from the store's now the key's pause lasts (zero: none).
    pub paused: Duration,
}

impl InLine {
    /// Where a reservation whose turn is at `at` stands at `now` (µs on the store's clock),
    /// under a pause until `pause`; `at` `None`: not in line.
    pub(crate) fn at(now: u64, at: Option<u64>, pause: u64) -> InLine {
        InLine {
            turn: at.map(|at| Duration::from_micros(at.saturating_sub(now))),
            past: Duration::from_micros(at.map_or(0, |at| now.saturating_sub(at))),
            paused: Duration::from_micros(pause.saturating_sub(now)),
        }
    }
}

/// Ticket ids are below this (2^52): Redis's scripts hold numbers as doubles, exact below
/// 2^53, and the line names a reservation by its id's decimal text.
pub const MAX_ID: u64 = 1 << 52;

/// Whether `ticket` names a reservation the stores can keep: an id below [`MAX_ID`], and a
/// cost of at least one unit (a reservation of nothing has no turn to wait for).
pub(crate) fn named(ticket: &Ticket) -> Result<(), StoreError> {
    if ticket.id >= MAX_ID {
        return Err(StoreError::Unsupported(
            "a reservation's ticket id must be below 2^52",
        ));
    }
    if ticket.cost == 0 {
        return Err(StoreError::Unsupported(
            "a reservation's cost must be at least one unit",
        ));
    }
    Ok(())
}

/// Whether `ticket` is in the stores' range for `policy`: its id and cost ([`named`]), its
/// `late` and `notice` at most [`MAX_LATE`], and on GCRA its `late` short enough that every
/// bucket, keeping that much drain free, still holds its cost (`(window − late) × count ≥
/// cost × window`) where it would without. A cost above a count is not out of range: it is
/// refused with no turn, as a decision is.
pub(crate) fn in_range(policy: &Policy, ticket: &Ticket) -> Result<(), StoreError> {
    named(ticket)?;
    if ticket.late.max(ticket.notice) > MAX_LATE {
        return Err(StoreError::Unsupported(
            "a reservation's late and notice are at most an hour",
        ));
    }
    // Starved by `late` alone: a cost over a count is refused as for a decision (no wait
    // helps).
    let late = ticket.late.as_micros();
    let starved = policy.limits().iter().any(|l| {
        let (window, count, cost) = (l.window().as_micros(), l.count(), ticket.cost);
        let room = window.saturating_sub(late) * u128::from(count);
        cost <= u32::try_from(count).unwrap_or(u32::MAX) && room < u128::from(cost) * window
    });
    if policy.algorithm() == Algorithm::Gcra && starved {
        return Err(StoreError::Unsupported(
            "on GCRA a reservation's late leaves a bucket no room for its cost: every bucket \
             keeps that much drain free",
        ));
    }
    Ok(())
}

/// Whether `policy` can be reserved ([`Reserve::reserve`]).
pub(crate) fn reservable(policy: &Policy) -> Result<(), StoreError> {
    match policy.algorithm() {
        Algorithm::Gcra | Algorithm::SlidingLog => {}
        Algorithm::FixedWindow | Algorithm::SlidingWindow => {
            return Err(StoreError::Unsupported(
                "reservations need GCRA or the sliding log: a counter keeps no place for a \
                 later turn",
            ))
        }
    }
    if policy.block().is_some() || policy.concurrency_limit().is_some() {
        return Err(StoreError::Unsupported(
            "reservations take no penalty box and no concurrency limit",
        ));
    }
    Ok(())
}
