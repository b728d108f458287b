//! Waiting for a turn, without HTTP: reserve, sleep until the turn (looking again when woken,
//! and at the turn), reserve again where the turn no longer holds, and give the place back
//! when dropped. [`WaitTurn`] is the future; [`Turn`] what it yields.
//!
//! **The bracket** (`docs/outbound.md`, "Bounds"). The store answers durations from its own
//! now; a call reads each answer between its own send and receive instants, so a turn `d`
//! ahead, asked at `sent` and heard at `received`, lies within `[sent + d, received + d]` on
//! the instance's clock (scaled by the rate between the clocks, learned from calls: never an
//! offset). It goes only if it can leave within `[turn, turn + margin]` for every point of
//! its look's bracket; else it gives its place back and reserves again. A turn stays in the
//! line until its work goes ([`Turn::go`]: used) or it is dropped unused (given back).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::sync::futures::OwnedNotified;
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

use super::clock::{ran, Heard, RATE_TOLERANCE};
use super::looker::Watch;
use super::shared::{self, Shared};
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
    /// The layer measures its round trip to the store before its first reservation.
    Measuring {
        measure: Pin<Box<dyn Future<Output = ()> + Send>>,
        seat: Option<Seat<St>>,
    },
    /// Its reservation is on its way.
    Reserving(Asked<St>),
    /// It gives its place back, to reserve again once the store answered.
    Leaving {
        left: oneshot::Receiver<()>,
        seat: Option<Seat<St>>,
    },
    /// Its key is paced (the upstream pushed back): it sleeps until the start its pace booked
    /// for its reservation (`booked`: when it booked it).
    Pacing {
        sleep: Pin<Box<Sleep>>,
        booked: Instant,
        seat: Seat<St>,
    },
    /// Its turn has not come yet: it sleeps until its look at the turn is due, or until its
    /// key's looker wakes it (its turn moved earlier, it is no longer in line, or the key
    /// was paused).
    Waiting {
        sleep: Pin<Box<Sleep>>,
        woken: Option<Pin<Box<OwnedNotified>>>,
        placed: Placed<St>,
    },
    /// It looks where it stands in line, asked at `sent`.
    Looking {
        look: Pin<Box<St::LinesFuture>>,
        sent: Instant,
        placed: Placed<St>,
    },
    /// Out of the line, it sleeps until it leaves.
    Going {
        sleep: Pin<Box<Sleep>>,
        turn: Option<Turn<St>>,
    },
    /// Its turn has come, or it failed (the error not yet taken).
    Done(Option<Result<Turn<St>, OutboundError<Infallible>>>),
}

impl<St: Store> WaitTurn<St> {
    /// Waits for a turn of `seat`'s reservation; fails at once where the store is known to
    /// be too far for the layer's widest margin.
    pub(super) fn new(seat: Seat<St>) -> Self {
        if let Some(too_far) = seat.shared.reach.too_far() {
            return WaitTurn::failed(too_far);
        }
        if seat.shared.measured.initialized() {
            return WaitTurn {
                state: seat.start(None),
            };
        }
        // The layer's first wait: its reservation carries the margin the round trip needs,
        // so the round trip is measured first, at most for half its wait (a stalled store
        // fails its reservation, not its measure).
        let patience = seat.ticket.max_wait / 2;
        let measure = shared::measure(Arc::clone(&seat.shared), seat.key.clone(), patience);
        WaitTurn {
            state: State::Measuring {
                measure: Box::pin(measure),
                seat: Some(seat),
            },
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
                State::Pacing {
                    mut sleep,
                    booked,
                    seat,
                } => match sleep.as_mut().poll(cx) {
                    Poll::Pending => Err(State::Pacing {
                        sleep,
                        booked,
                        seat,
                    }),
                    Poll::Ready(()) => Ok(seat.start(Some(booked))),
                },
                State::Reserving(mut asked) => match asked.poll(cx) {
                    Poll::Pending => Err(State::Reserving(asked)),
                    Poll::Ready(Ok(placed)) => Ok(placed.reserved()),
                    Poll::Ready(Err(error)) => Ok(State::Done(Some(Err(error)))),
                },
                State::Measuring { mut measure, seat } => match measure.as_mut().poll(cx) {
                    Poll::Pending => Err(State::Measuring { measure, seat }),
                    Poll::Ready(()) => Ok(measured(seat)),
                },
                State::Leaving { mut left, seat } => match Pin::new(&mut left).poll(cx) {
                    Poll::Pending => Err(State::Leaving { left, seat }),
                    Poll::Ready(_) => Ok(seat.map_or(State::Done(None), |seat| seat.start(None))),
                },
                State::Waiting {
                    mut sleep,
                    mut woken,
                    placed,
                } => {
                    let slept = sleep.as_mut().poll(cx).is_ready();
                    let rung = woken
                        .as_mut()
                        .is_some_and(|w| w.as_mut().poll(cx).is_ready());
                    match (slept, rung) {
                        // Woken (its sleep may have ended too): what the looker saw is taken.
                        (_, true) => Ok(placed.after_seen()),
                        (true, false) => Ok(placed.wait()),
                        (false, false) => Err(State::Waiting {
                            sleep,
                            woken,
                            placed,
                        }),
                    }
                }
                State::Looking {
                    mut look,
                    sent,
                    placed,
                } => match look.as_mut().poll(cx) {
                    Poll::Pending => Err(State::Looking { look, sent, placed }),
                    Poll::Ready(stood) => Ok(placed.after_look(only(stood), sent)),
                },
                State::Going { mut sleep, turn } => match sleep.as_mut().poll(cx) {
                    Poll::Pending => Err(State::Going { sleep, turn }),
                    Poll::Ready(()) => Ok(State::Done(turn.map(Ok))),
                },
                State::Done(Some(done)) => return Poll::Ready(done),
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

/// After the layer's first measure: it reserves, with what is left of its wait.
fn measured<St: Store>(seat: Option<Seat<St>>) -> State<St> {
    match seat.map(|seat| seat.again()) {
        None => State::Done(None),
        Some(Some(seat)) => seat.start(None),
        Some(None) => State::Done(Some(Err(OutboundError::TooLate { turn: None }))),
    }
}

/// The answer of a look at one reservation (`look_many` of one ticket answers one).
fn only(stood: Result<Vec<InLine>, StoreError>) -> Result<InLine, StoreError> {
    stood.and_then(|stood| stood.into_iter().next().ok_or(StoreError::Unavailable))
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
        let started = shared.clock.now();
        Seat {
            shared,
            key,
            ticket,
            started,
        }
    }

    /// Takes the reservation out of the line, on a task of its own (the caller may be going
    /// away), and then wakes this layer's waiting requests: those behind it moved up. The
    /// receiver hears when the store answered (the place given back).
    fn leave(&self) -> oneshot::Receiver<()> {
        let leave =
            |store: &St, key: &Key, policy: &Policy, ticket| store.leave(key, policy, ticket);
        self.then_wake(leave, "failed to give back a reservation")
    }

    /// Takes the reservation out of the line as used, on a task of its own: its work goes at
    /// its turn (the look then takes it out, its turn being at most its late ahead). Nobody
    /// behind moves, so the key's looker is not woken.
    fn used(&self) {
        let (shared, key, ticket) = (Arc::clone(&self.shared), self.key.clone(), self.ticket);
        let look = move |store: &St, key: &Key, policy: &Policy| store.look(key, policy, ticket);
        let failed = "failed to take a used reservation out of the line";
        drop(Shared::change(&shared, key, look, failed, false));
    }

    /// Makes a change to the line on a task of its own, then wakes this layer's waiting
    /// requests to look ([`Shared::change`]).
    fn then_wake<F>(&self, change: F, failed: &'static str) -> oneshot::Receiver<()>
    where
        F: Fn(&St, &Key, &Policy, Ticket) -> St::LineFuture + Send + 'static,
    {
        let ticket = self.ticket;
        let change =
            move |store: &St, key: &Key, policy: &Policy| change(store, key, policy, ticket);
        Shared::change(&self.shared, self.key.clone(), change, failed, true)
    }

    /// A pause of its key learned from the store (another instance's pushback, or its own):
    /// its key's pace slows down ([`Pace::pushed_back`](super::pace::Pace::pushed_back);
    /// repeats within one overload change nothing).
    fn learn_pause(&self, paused: Duration) {
        if !paused.is_zero() {
            let now = self.shared.clock.now();
            self.shared.pace.pushed_back(&self.key, now, paused);
        }
    }

    /// Reserves now, or once the start its key's pace books has come (`booked`: when it
    /// booked one; the upstream's pushbacks slow the key down, `pace.rs`); too late where that
    /// start comes past what is left of its wait.
    fn start(self, booked: Option<Instant>) -> State<St> {
        let shared = &self.shared;
        let now = shared.clock.now();
        let left = shared
            .max_wait
            .saturating_sub(now.saturating_duration_since(self.started));
        let wait = match booked {
            None => shared.pace.delay_within(&self.key, now, left),
            Some(booked) => shared.pace.rebook(&self.key, booked, now, left),
        };
        match wait {
            None => State::Done(Some(Err(OutboundError::TooLate { turn: None }))),
            Some(wait) if wait.is_zero() => State::Reserving(Asked::new(self)),
            Some(wait) => State::Pacing {
                sleep: Box::pin(shared.clock.sleep_until(now + wait)),
                booked: now,
                seat: self,
            },
        }
    }

    /// The same wait, reserving again with what is left of it, with the layer's margin now;
    /// `None` when nothing is left.
    fn again(&self) -> Option<Seat<St>> {
        let waited = self
            .shared
            .clock
            .now()
            .saturating_duration_since(self.started);
        let left = self.shared.max_wait.checked_sub(waited)?;
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
    sent: Instant,
}

impl<St: Store> Asked<St> {
    fn new(seat: Seat<St>) -> Self {
        let shared = &seat.shared;
        let sent = shared.clock.now();
        let reserve = shared.store.reserve(&seat.key, &shared.policy, seat.ticket);
        Asked {
            future: Some(Box::pin(reserve)),
            seat: Some(seat),
            sent,
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
                drop(seat.leave());
                return Poll::Ready(Err(OutboundError::Store(error)));
            }
        };
        if !decision.is_allowed() {
            let turn = decision.retry_after();
            return Poll::Ready(Err(OutboundError::TooLate { turn }));
        }
        let heard = Heard {
            sent: self.sent,
            received: seat.shared.clock.now(),
        };
        let d = decision.turn();
        Poll::Ready(Ok(Placed {
            answer: (heard, d),
            reserved: Some((heard, d)),
            in_line: true,
            watch: None,
            confirm: false,
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
            drop(seat.leave());
        });
    }
}

impl<St: Store> Seat<St> {
    /// Where a turn `ahead` of the store's now, as `heard`, lies on the instance's clock.
    fn bracket(&self, heard: Heard, ahead: Duration) -> (Instant, Instant) {
        let local = ahead.mul_f64(self.shared.reach.rate());
        (heard.sent + local, heard.received + local)
    }
}

/// A reservation in line: it leaves the line when dropped before its request went out.
pub(super) struct Placed<St: Store> {
    /// The latest answer about its turn: heard when, and how far ahead of the store's now
    /// (the bracket of its turn on the instance's clock is read from it with the rate the
    /// layer knows at the time, [`Placed::turn`]).
    answer: (Heard, Duration),
    /// Its reservation's answer and the turn it gave, while no look has seen the line move it
    /// (the rate between the clocks is read from it at the turn).
    reserved: Option<(Heard, Duration)>,
    /// Whether it is still in the store's line (it leaves when its work goes, used, or when
    /// it is dropped or reserves again, given back).
    in_line: bool,
    /// Whether it sleeps until its turn's latest and looks again before it goes: the rate
    /// between the clocks is not known yet, so a sleep of the instance's may be shorter or
    /// longer than the store's (only a look at a turn that has come bounds it).
    confirm: bool,
    /// Its place with its key's looker, while its look at the turn is further than a
    /// `recheck` away.
    watch: Option<Watch>,
    seat: Option<Seat<St>>,
}

impl<St: Store> Placed<St> {
    /// The earliest and the latest its turn may be on the instance's clock.
    fn turn(&self) -> (Instant, Instant) {
        let (heard, ahead) = self.answer;
        match self.seat.as_ref() {
            Some(seat) => seat.bracket(heard, ahead),
            None => (heard.sent + ahead, heard.received + ahead),
        }
    }

    /// What it does once reserved: a turn at most `late` ahead is as a look at the turn
    /// would find it, so it goes as after that look; a later one waits.
    fn reserved(self) -> State<St> {
        let (Some(seat), Some((heard, ahead))) = (self.seat.as_ref(), self.reserved) else {
            return self.wait();
        };
        // Its round trip counts as a look's: the first tells the layer how far the store is
        // before any look, and one whose answer is its look at the turn widens the margin, or
        // fails the call, where it cannot go (rather than reserve again and again).
        let reach = &seat.shared.reach;
        reach.round_trip_took(heard.round_trip(), heard.received);
        if ahead > seat.ticket.late {
            return self.wait();
        }
        let stood = InLine {
            turn: Some(ahead),
            past: Duration::ZERO,
            paused: Duration::ZERO,
        };
        self.at_turn(stood, heard)
    }

    /// Sleeps until its look at its turn is due (aimed to reach the store a little before the
    /// turn's earliest), or its next look when that is sooner, or until woken.
    fn wait(mut self) -> State<St> {
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(None);
        };
        if std::mem::take(&mut self.confirm) {
            return self.look();
        }
        let shared = &seat.shared;
        let now = shared.clock.now();
        // Aimed a round trip before the turn's earliest: it answers before the turn (ahead,
        // where only the round trip must fit the margin) wherever in its round trip the
        // store reads it; one that comes more than `late` early only narrows the bracket.
        let aim = self.turn().0.checked_sub(shared.reach.round_trip());
        let aim = aim.unwrap_or(now);
        if aim <= now {
            return self.look();
        }
        // Further than a `recheck` from its look: its key's looker looks for it.
        if self.watch.is_none() && aim - now > shared.recheck {
            self.watch = Some(shared::watch(shared, &seat.key, seat.ticket));
        }
        let woken = self
            .watch
            .as_ref()
            .map(|w| Box::pin(Arc::clone(&w.slot.woken).notified_owned()));
        // At most a `recheck` at a time: it aims again with the rate the layer knows then (no
        // store call), so that a rate learned meanwhile moves its look.
        State::Waiting {
            sleep: Box::pin(shared.clock.sleep_until(aim.min(now + shared.recheck))),
            woken,
            placed: self,
        }
    }

    /// What it does once its key's looker woke it: as after a look that took nothing out of
    /// the line.
    fn after_seen(mut self) -> State<St> {
        let Some(seen) = self.watch.as_ref().and_then(Watch::take) else {
            return self.wait();
        };
        let ahead = match self.standing(seen.stood) {
            Ok(ahead) => ahead,
            Err(paused) => return self.again(paused),
        };
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(None);
        };
        let heard = Heard {
            sent: seen.sent,
            received: seen.received,
        };
        if seat.bracket(heard, ahead).1 < self.turn().0 {
            self.reserved = None;
        }
        self.answer = (heard, ahead);
        self.wait()
    }

    /// How far ahead its turn is, by what the store answered (`stood`); or that it reserves
    /// again (`Err`, with the key's pause where that pause covers its turn): its key is paused
    /// past its turn, or the store no longer has its reservation.
    fn standing(&mut self, stood: InLine) -> Result<Duration, Option<Duration>> {
        if let Some(seat) = self.seat.as_ref() {
            seat.learn_pause(stood.paused);
        }
        if !stood.paused.is_zero() && stood.turn.is_none_or(|t| t < stood.paused) {
            return Err(Some(stood.paused));
        }
        let ahead = stood.turn.ok_or(None);
        self.in_line &= ahead.is_ok();
        ahead
    }

    /// Looks where it stands in line (near its turn: its key's looker no longer looks for
    /// it).
    fn look(mut self) -> State<St> {
        self.watch = None;
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(None);
        };
        let shared = &seat.shared;
        // Its margin is shorter than the round trip its look would take (the layer measured,
        // and widened its margin, after it reserved): it could not go after that look. It
        // gives its place back instead, while those behind can still move up into it, and
        // reserves again with the margin in use.
        let late = seat.ticket.late.mul_f64(1.0 - RATE_TOLERANCE);
        if shared.reach.round_trip() > late {
            return self.again(None);
        }
        let sent = shared.clock.now();
        // It stays in line until its work goes ([`Turn::go`]) or its turn is dropped unused
        // (given back): a look that takes nothing out.
        let look = shared
            .store
            .look_many(&seat.key, &shared.policy, vec![seat.ticket]);
        State::Looking {
            look: Box::pin(look),
            sent,
            placed: self,
        }
    }

    /// What it does once it learned where it stands (`stood`, asked at `sent`): wait on for
    /// its turn, moved up or not; go, where its turn is at most its `late` ahead and it can
    /// leave within its margin of the turn (still in line until its work goes); or reserve
    /// again, when the key is paused past its turn, when the store lost its reservation (a
    /// restart, a reset, an eviction: its old turn no longer counts), or when it cannot know that it would leave in time (a slow or
    /// stalled store, a round trip longer than the margin).
    fn after_look(mut self, stood: Result<InLine, StoreError>, sent: Instant) -> State<St> {
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(None);
        };
        let shared = Arc::clone(&seat.shared);
        let late = seat.ticket.late;
        let now = shared.clock.now();
        let heard = Heard {
            sent,
            received: now,
        };
        let rate = shared.reach.rate();
        // The latest it may leave, its turn being at the earliest `earliest`.
        let until = |earliest: Instant| earliest + late.mul_f64(rate * (1.0 - RATE_TOLERANCE));
        let stood = match stood {
            // Only an answer tells how far the store is (a failure may have waited out the
            // whole time budget).
            Ok(stood) => {
                shared.reach.round_trip_took(heard.round_trip(), now);
                stood
            }
            // The store could not say: the turn it had holds, while it may still leave.
            Err(_) if now > until(self.turn().0) => return self.again(None),
            // It goes at its turn (still in line: `Turn::go` takes it out).
            Err(_) if now >= self.turn().1 => {
                let until = until(self.turn().0);
                return State::Done(Some(Ok(Turn::new(self, until))));
            }
            Err(_) => return self.wait(),
        };
        let ahead = match self.standing(stood) {
            Ok(ahead) => ahead,
            Err(paused) => return self.again(paused),
        };
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(None);
        };
        let past = stood.past;
        if ahead > late {
            // Not its turn yet: it learned where its turn is (earlier, where the line moved it
            // up; then the reservation's answer no longer tells the rate).
            if seat.bracket(heard, ahead).1 < self.turn().0 {
                self.reserved = None;
            }
            if let Some((local, store)) = self.reserved.and_then(|r| ran(r, (heard, ahead, past))) {
                shared.reach.rate_seen(local, store);
            }
            self.answer = (heard, ahead);
            return self.wait();
        }
        if let Some((local, store)) = self.reserved.and_then(|r| ran(r, (heard, ahead, past))) {
            shared.reach.rate_seen(local, store);
        }
        self.at_turn(stood, heard)
    }

    /// At its turn (`stood`, as `heard`): it goes if it can leave within its margin of the
    /// turn, wherever in the round trip the store answered (its reservation's answer may be
    /// that look); else it reserves again, giving its place back where it is still in line (or fails,
    /// where the store is too far for any margin up to `max_margin`).
    fn at_turn(mut self, stood: InLine, heard: Heard) -> State<St> {
        let Some(seat) = self.seat.as_ref() else {
            return State::Done(None);
        };
        let shared = Arc::clone(&seat.shared);
        let late = seat.ticket.late;
        let (ahead, past) = (stood.turn.unwrap_or_default(), stood.past);
        let rate = shared.reach.rate();
        let (slow, fast) = (rate * (1.0 - RATE_TOLERANCE), rate * (1.0 + RATE_TOLERANCE));
        let now = shared.clock.now().max(heard.received);
        let (leave, earliest) = match ahead.is_zero() {
            false => (
                heard.received + ahead.mul_f64(fast),
                heard.sent + ahead.mul_f64(slow),
            ),
            true => (
                now,
                heard
                    .sent
                    .checked_sub(past.mul_f64(fast))
                    .unwrap_or(heard.sent),
            ),
        };
        let until = earliest + late.mul_f64(slow);
        if !ahead.is_zero() && !shared.reach.rate_known() && heard.round_trip() <= late / 4 {
            // Its turn still ahead, on a clock whose rate to the store's is not known: it
            // sleeps until the turn's latest, and looks (where a round trip costs little of
            // the margin; a far store's first calls take the clocks to run at one rate).
            self.confirm = true;
            self.answer = (heard, ahead);
            let sleep = Box::pin(shared.clock.sleep_until(leave));
            let (woken, placed) = (None, self);
            return State::Waiting {
                sleep,
                woken,
                placed,
            };
        }
        if leave <= until {
            let sleep = Box::pin(shared.clock.sleep_until(leave));
            let turn = Some(Turn::new(self, until));
            return State::Going { sleep, turn };
        }
        tracing::debug!(
            target: "tower_redis_ratelimit",
            round_trip = ?heard.round_trip(),
            ?ahead,
            ?past,
            ?late,
            rate,
            "an outbound call cannot know it would leave within its margin: it reserves again",
        );
        match shared.reach.too_far() {
            Some(too_far) => State::Done(Some(Err(too_far))),
            None => self.again(None),
        }
    }

    /// Leaves the line (where it is still in it) and reserves again, with what is left of its
    /// wait; past it, too late (`paused`: the key's pause, which its turn would have come
    /// after at the earliest).
    fn again(mut self, paused: Option<Duration>) -> State<St> {
        let Some(seat) = self.seat.take() else {
            return State::Done(None);
        };
        let left = self.in_line.then(|| seat.leave());
        match (seat.again(), left) {
            // Its new reservation waits for its old place to be given back: it may take it.
            (Some(again), Some(left)) => State::Leaving {
                left,
                seat: Some(again),
            },
            (Some(again), None) => again.start(None),
            (None, _) => State::Done(Some(Err(OutboundError::TooLate { turn: paused }))),
        }
    }

    /// The seat, while the reservation is held.
    pub(super) fn seat(&self) -> Option<&Seat<St>> {
        self.seat.as_ref()
    }

    /// Its work goes out: it leaves the line, used (on a task of its own), and nothing is
    /// given back.
    pub(super) fn go(&mut self) {
        let Some(seat) = self.seat.take() else {
            return;
        };
        seat.shared.pace.sent(&seat.key, seat.shared.clock.now());
        if self.in_line {
            seat.used();
        }
    }
}

impl<St: Store> Drop for Placed<St> {
    fn drop(&mut self) {
        if let Some(seat) = self.seat.take().filter(|_| self.in_line) {
            drop(seat.leave());
        }
    }
}

/// Waits again: the turn given back, a new reservation with what is left of the wait.
pub(super) fn again<St: Store>(placed: Placed<St>) -> WaitTurn<St> {
    WaitTurn {
        state: placed.again(None),
    }
}

/// A turn that has come ([`Turns::wait`](super::Turns::wait)): [`go`](Turn::go) uses it, right before the work
/// goes out. It holds for the layer's margin from the turn: use it at once. Dropped unused,
/// its place is given back (the reservation stays in the store's line until `go`), as a
/// dropped [`WaitTurn`]'s is.
#[must_use = "a turn is used by `go`"]
pub struct Turn<St: Store> {
    placed: Placed<St>,
    /// The latest it may leave on the instance's clock.
    until: tokio::time::Instant,
}

impl<St: Store> std::fmt::Debug for Turn<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn").finish_non_exhaustive()
    }
}

impl<St: Store> Turn<St> {
    pub(super) fn new(placed: Placed<St>, until: tokio::time::Instant) -> Self {
        Turn { placed, until }
    }

    /// Uses the turn: call it right before the work goes out, at once (the upstream may see
    /// the work up to the layer's margin after the turn, and no later).
    pub fn go(mut self) {
        self.placed.go();
    }

    /// Whether the turn may no longer be used: later than its margin after it.
    pub(super) fn too_late(&self) -> bool {
        let seat = self.placed.seat();
        seat.is_some_and(|seat| seat.shared.clock.now() > self.until)
    }

    /// Gives the turn back and waits for another, with what is left of the wait.
    pub(super) fn again(self) -> WaitTurn<St> {
        again(self.placed)
    }

    /// Where its upstream's pushback pauses: its layer and key.
    pub(super) fn pauser(&self) -> Option<(Arc<Shared<St>>, Key)> {
        let seat = self.placed.seat()?;
        Some((Arc::clone(&seat.shared), seat.key.clone()))
    }
}
