//! Waiting for a turn, without HTTP: reserve, sleep until the turn (looking again when woken,
//! and at the turn), reserve again where the turn no longer holds, and give the place back
//! when dropped. [`WaitTurn`] is the future; [`Turn`](super::Turn) what it yields.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::sync::futures::OwnedNotified;
use tokio::time::{Instant, Sleep};

use super::shared::Shared;
use super::turns::Turn;
use super::OutboundError;
use crate::store::reserve::{InLine, Ticket};
use crate::{Key, Policy, Store, StoreError};

/// Waits for a turn ([`Turns::wait`](super::Turns::wait)): yields the [`Turn`] once it has
/// come. Cancel-safe: dropped before, it gives its place back (those behind it move up).
#[must_use = "a turn is waited for only while its future is polled"]
pub struct WaitTurn<St: Store> {
    state: State<St>,
}

impl<St: Store> std::fmt::Debug for WaitTurn<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitTurn").finish_non_exhaustive()
    }
}

/// Where a wait is.
enum State<St: Store> {
    /// Its reservation is on its way.
    Reserving(Asked<St>),
    /// Its turn has not come yet: it sleeps until its turn, or its next look, or until woken
    /// by a reservation of its layer that left the line or a pause.
    Waiting {
        sleep: Pin<Box<Sleep>>,
        woken: Pin<Box<OwnedNotified>>,
        placed: Placed<St>,
    },
    /// It looks where it stands in line.
    Looking {
        look: Pin<Box<St::LineFuture>>,
        placed: Placed<St>,
    },
    /// Its turn has come, or it failed (the error not yet taken).
    Done(Option<Result<Placed<St>, OutboundError<Infallible>>>),
}

impl<St: Store> WaitTurn<St> {
    /// Waits for a turn of `seat`'s reservation.
    pub(super) fn new(seat: Seat<St>) -> Self {
        WaitTurn {
            state: State::Reserving(Asked::new(seat)),
        }
    }

    /// A wait that fails at once with `error`.
    pub(super) fn failed(error: OutboundError<Infallible>) -> Self {
        WaitTurn {
            state: State::Done(Some(Err(error))),
        }
    }
}

impl<St: Store> Future for WaitTurn<St> {
    type Output = Result<Turn<St>, OutboundError<Infallible>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let state = &mut self.state;
        loop {
            // Each state either moves on (`Ok`), or parks until woken (`Err`, the state kept).
            let next = match std::mem::replace(state, State::Done(None)) {
                State::Reserving(mut asked) => match asked.poll(cx) {
                    Poll::Pending => Err(State::Reserving(asked)),
                    Poll::Ready(Ok(placed)) => Ok(placed.wait()),
                    Poll::Ready(Err(error)) => Ok(State::Done(Some(Err(error)))),
                },
                State::Waiting {
                    mut sleep,
                    mut woken,
                    placed,
                } => {
                    let slept = sleep.as_mut().poll(cx).is_ready();
                    match slept || woken.as_mut().poll(cx).is_ready() {
                        true => Ok(placed.look()),
                        false => Err(State::Waiting {
                            sleep,
                            woken,
                            placed,
                        }),
                    }
                }
                State::Looking { mut look, placed } => match look.as_mut().poll(cx) {
                    Poll::Pending => Err(State::Looking { look, placed }),
                    Poll::Ready(stood) => Ok(placed.after_look(stood)),
                },
                State::Done(Some(done)) => return Poll::Ready(done.map(Turn::new)),
                State::Done(None) => return Poll::Pending,
            };
            match next {
                Ok(next) => *state = next,
                Err(parked) => {
                    *state = parked;
                    return Poll::Pending;
                }
            }
        }
    }
}

/// Where a reservation is made: its layer's store, policy and wake-up, its key, and the ticket
/// of its latest reservation.
pub(super) struct Seat<St: Store> {
    pub(super) shared: Arc<Shared<St>>,
    pub(super) key: Key,
    ticket: Ticket,
    started: Instant,
}

impl<St: Store> Clone for Seat<St> {
    fn clone(&self) -> Self {
        Seat {
            shared: Arc::clone(&self.shared),
            key: self.key.clone(),
            ticket: self.ticket,
            started: self.started,
        }
    }
}

impl<St: Store> Seat<St> {
    /// A seat for `cost` units of `key`.
    pub(super) fn new(shared: Arc<Shared<St>>, key: Key, cost: u32) -> Self {
        let ticket = Ticket {
            cost,
            ..shared.ticket(shared.max_wait)
        };
        Seat {
            shared,
            key,
            ticket,
            started: Instant::now(),
        }
    }

    /// Takes the reservation out of the line, on a task of its own (the caller is going
    /// away), and then wakes this layer's waiting requests: those behind it moved up.
    fn leave(&self) {
        let leave =
            |store: &St, key: &Key, policy: &Policy, ticket| store.leave(key, policy, ticket);
        self.then_wake(leave, "failed to give back a reservation");
    }

    /// Takes the reservation out of the line as used, on a task of its own: its request goes
    /// though its look at its turn failed, which would have taken it out.
    fn used(&self) {
        let look = |store: &St, key: &Key, policy: &Policy, ticket| store.look(key, policy, ticket);
        self.then_wake(look, "failed to take a used reservation out of the line");
    }

    /// Makes a change to the line on a task of its own, then wakes this layer's waiting
    /// requests to look ([`Shared::then_wake`]).
    fn then_wake<F>(&self, change: F, failed: &'static str)
    where
        F: Fn(&St, &Key, &Policy, Ticket) -> St::LineFuture + Send + 'static,
    {
        let ticket = self.ticket;
        let change =
            move |store: &St, key: &Key, policy: &Policy| change(store, key, policy, ticket);
        Shared::then_wake(&self.shared, self.key.clone(), change, failed);
    }

    /// The same wait, reserving again with what is left of it; `None` when nothing is left.
    fn again(&self) -> Option<Seat<St>> {
        let left = self.shared.max_wait.checked_sub(self.started.elapsed())?;
        Some(Seat {
            ticket: Ticket {
                cost: self.ticket.cost,
                ..self.shared.ticket(left)
            },
            ..self.clone()
        })
    }
}

/// A reservation on its way: if its caller goes away before the store answers, the answer is
/// still awaited, on a task of its own, and a reservation it made leaves the line; so does one
/// the store may have made though its answer failed.
struct Asked<St: Store> {
    future: Option<Pin<Box<St::Future>>>,
    seat: Option<Seat<St>>,
}

impl<St: Store> Asked<St> {
    fn new(seat: Seat<St>) -> Self {
        let shared = &seat.shared;
        let reserve = shared.store.reserve(&seat.key, &shared.policy, seat.ticket);
        Asked {
            future: Some(Box::pin(reserve)),
            seat: Some(seat),
        }
    }

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Placed<St>, OutboundError<Infallible>>> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let decision = ready!(future.as_mut().poll(cx));
        self.future = None;
        let Some(seat) = self.seat.take() else {
            return Poll::Pending;
        };
        let decision = match decision {
            Ok(decision) => decision,
            Err(error) => {
                // The store may have run it all the same (a reply later than the time budget):
                // it leaves the line it may be in.
                seat.leave();
                return Poll::Ready(Err(OutboundError::Store(error)));
            }
        };
        if !decision.is_allowed() {
            let turn = decision.retry_after();
            return Poll::Ready(Err(OutboundError::TooLate { turn }));
        }
        Poll::Ready(Ok(Placed {
            turn_at: Instant::now() + decision.turn(),
            seat: Some(seat),
        }))
    }
}

impl<St: Store> Drop for Asked<St> {
    fn drop(&mut self) {
        let (Some(future), Some(seat)) = (self.future.take(), self.seat.take()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            // Reserved, or perhaps reserved (no answer in time): it leaves the line.
            if future.await.is_ok_and(|d| !d.is_allowed()) {
                return;
            }
            seat.leave();
        });
    }
}

/// A reservation in line: it leaves the line when dropped before its request went out.
pub(super) struct Placed<St: Store> {
    /// When its turn comes, as it last learned.
    turn_at: Instant,
    seat: Option<Seat<St>>,
}

impl<St: Store> Placed<St> {
    /// Sleeps until its turn, or its next look when that is sooner, or until woken.
    fn wait(self) -> State<St> {
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(Some(Ok(self)));
        };
        let shared = &seat.shared;
        let woken = Box::pin(Arc::clone(&shared.wake).notified_owned());
        let next = (Instant::now() + shared.recheck).min(self.turn_at);
        State::Waiting {
            sleep: Box::pin(tokio::time::sleep_until(next)),
            woken,
            placed: self,
        }
    }

    /// Looks where it stands in line.
    fn look(self) -> State<St> {
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(Some(Ok(self)));
        };
        let shared = &seat.shared;
        let look = shared.store.look(&seat.key, &shared.policy, seat.ticket);
        State::Looking {
            look: Box::pin(look),
            placed: self,
        }
    }

    /// What it does once it learned where it stands (`stood`): its turn, moved up or not;
    /// or it reserves again, when the key is paused past its turn, when the store lost its
    /// reservation (a restart, a reset, an eviction: its old turn no longer counts), or when
    /// the answer came later than its units may be used (a stalled store).
    fn after_look(mut self, stood: Result<InLine, StoreError>) -> State<St> {
        let now = Instant::now();
        let stood = match stood {
            Ok(stood) => stood,
            // The store could not say: the turn it had holds, while its units may be used.
            Err(_) if self.too_late(now) => return self.again(None),
            // It goes at its turn: the look that would have taken it out of the line is sent
            // again, on a task of its own.
            Err(_) if now >= self.turn_at => {
                if let Some(seat) = self.seat.as_ref() {
                    seat.used();
                }
                return State::Done(Some(Ok(self)));
            }
            Err(_) => return self.at_turn(now),
        };
        let paused = !stood.paused.is_zero() && stood.turn.is_none_or(|t| t < stood.paused);
        if paused {
            return self.again(Some(stood.paused));
        }
        match stood.turn {
            None => self.again(None),
            Some(turn) if turn.is_zero() && self.too_late(now) => self.again(None),
            // The store's turn holds: earlier where the line moved it up, and a little later
            // where this instance's clock runs ahead of the store's (it looks again then, and
            // the look that finds its turn come takes it out of the line).
            Some(turn) => {
                self.turn_at = now + turn;
                self.at_turn(now)
            }
        }
    }

    /// Whether its units, due at its turn, may no longer be used at `now`: later than its
    /// turn by more than its `late`.
    pub(super) fn too_late(&self, now: Instant) -> bool {
        let late = self.seat.as_ref().map_or(Duration::ZERO, |s| s.shared.late);
        now > self.turn_at + late
    }

    /// Leaves the line and reserves again, with what is left of its wait; past it, too late
    /// (`paused`: the key's pause, which its turn would have come after at the earliest).
    fn again(mut self, paused: Option<Duration>) -> State<St> {
        let Some(seat) = self.seat.take() else {
            return State::Done(None);
        };
        seat.leave();
        match seat.again() {
            Some(again) => State::Reserving(Asked::new(again)),
            None => State::Done(Some(Err(OutboundError::TooLate { turn: paused }))),
        }
    }

    /// Goes when its turn has come, else waits on.
    fn at_turn(self, now: Instant) -> State<St> {
        match now >= self.turn_at {
            true => State::Done(Some(Ok(self))),
            false => self.wait(),
        }
    }

    /// The seat, while the reservation is held.
    pub(super) fn seat(&self) -> Option<&Seat<St>> {
        self.seat.as_ref()
    }

    /// Its work went out: nothing to give back.
    pub(super) fn keep(&mut self) {
        self.seat = None;
    }
}

impl<St: Store> Drop for Placed<St> {
    fn drop(&mut self) {
        if let Some(seat) = self.seat.take() {
            seat.leave();
        }
    }
}

/// Waits again: the turn given back, a new reservation with what is left of the wait.
pub(super) fn again<St: Store>(placed: Placed<St>) -> WaitTurn<St> {
    WaitTurn {
        state: placed.again(None),
    }
}

/// An error of a wait as an error of a call whose inner service fails with `E`.
pub(super) fn widen<E>(error: OutboundError<Infallible>) -> OutboundError<E> {
    match error {
        OutboundError::TooLate { turn } => OutboundError::TooLate { turn },
        OutboundError::Key(error) => OutboundError::Key(error),
        OutboundError::Store(error) => OutboundError::Store(error),
        OutboundError::Inner(never) => match never {},
    }
}
