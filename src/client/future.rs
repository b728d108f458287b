//! The response future: reserve, wait for the turn (looking again when woken, and at the
//! turn), take the inner service's readiness, call, and pause the key where the upstream
//! pushes back.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::sync::futures::OwnedNotified;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use super::pushback::pushback;
use super::shared::Shared;
use super::OutboundError;
use crate::store::reserve::{InLine, Ticket};
use crate::{Key, Policy, Store, StoreError};

pin_project! {
    /// The response future of [`Outbound`](super::Outbound).
    pub struct ResponseFuture<S, St, B>
    where
        S: Service<Request<B>>,
        St: Store,
    {
        #[pin]
        call: Option<S::Future>,
        state: State<St>,
        request: Option<Request<B>>,
        inner: Option<S>,
        failed: Option<OutboundError<S::Error>>,
        // Where the request reserves: kept to pause its key when the upstream pushes back.
        seat: Option<Seat<St>>,
    }
}

/// Where a request is on its way out.
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
    /// Its turn has come; the inner service is not ready yet.
    Turn(Placed<St>),
    /// Sent (or failed).
    Gone,
}

impl<S, St, B, RB> ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
    St: Store,
{
    pub(super) fn new(seat: Seat<St>, request: Request<B>, inner: S) -> Self {
        let asked = Asked::new(seat.clone());
        ResponseFuture {
            call: None,
            state: State::Reserving(asked),
            request: Some(request),
            inner: Some(inner),
            failed: None,
            seat: Some(seat),
        }
    }

    pub(super) fn failed(error: OutboundError<S::Error>) -> Self {
        ResponseFuture {
            call: None,
            state: State::Gone,
            request: None,
            inner: None,
            failed: Some(error),
            seat: None,
        }
    }
}

impl<S, St, B, RB> Future for ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    St: Store,
{
    type Output = Result<S::Response, OutboundError<S::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            // Each state either moves on (`Ok`), or parks until woken (`Err`, the state kept).
            let next = match std::mem::replace(this.state, State::Gone) {
                State::Reserving(mut asked) => match asked.poll(cx) {
                    Poll::Pending => Err(State::Reserving(asked)),
                    Poll::Ready(placed) => Ok(placed?.wait()),
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
                    Poll::Ready(stood) => Ok(placed.after_look(stood)?),
                },
                State::Turn(mut placed) => {
                    let Some(inner) = this.inner.as_mut() else {
                        return Poll::Pending;
                    };
                    match inner.poll_ready(cx) {
                        Poll::Pending => Err(State::Turn(placed)),
                        Poll::Ready(Err(error)) => {
                            return Poll::Ready(Err(OutboundError::Inner(error)))
                        }
                        // Ready later than its units may be used: it reserves again, and
                        // gives the readiness back (a clone of the service is not ready).
                        Poll::Ready(Ok(())) if placed.too_late(Instant::now()) => {
                            *inner = inner.clone();
                            Ok(placed.again(None)?)
                        }
                        Poll::Ready(Ok(())) => {
                            // The request goes out: its units are used, not given back.
                            placed.keep();
                            if let Some(request) = this.request.take() {
                                this.call.set(Some(inner.call(request)));
                            }
                            Ok(State::Gone)
                        }
                    }
                }
                State::Gone => {
                    if let Some(error) = this.failed.take() {
                        return Poll::Ready(Err(error));
                    }
                    let Some(call) = this.call.as_mut().as_pin_mut() else {
                        return Poll::Pending;
                    };
                    let response = ready!(call.poll(cx));
                    if let (Ok(response), Some(seat)) = (&response, this.seat.take()) {
                        if let Some(pause) = pushback(response) {
                            seat.pause(pause);
                        }
                    }
                    return Poll::Ready(response.map_err(OutboundError::Inner));
                }
            };
            match next {
                Ok(state) => *this.state = state,
                Err(state) => {
                    *this.state = state;
                    return Poll::Pending;
                }
            }
        }
    }
}

/// Where a request reserves: its layer's store, policy and wake-up, its key, and the ticket of
/// its latest reservation.
pub(super) struct Seat<St: Store> {
    shared: Arc<Shared<St>>,
    key: Key,
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
    pub(super) fn new(shared: Arc<Shared<St>>, key: Key) -> Self {
        let ticket = shared.ticket(shared.max_wait);
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

    /// Pauses the key for every caller that shares the store, on a task of its own, and then
    /// wakes this layer's waiting requests to learn it.
    fn pause(&self, pause: Duration) {
        let paused =
            move |store: &St, key: &Key, policy: &Policy, _| store.pause(key, policy, pause);
        self.then_wake(paused, "failed to pause a key the upstream pushed back on");
    }

    /// Makes a change to the line on a task of its own, then wakes this layer's waiting
    /// requests to look. Each change may run twice without harm (a leave or a look finds
    /// nothing the second time, a pause keeps the longer), so one that fails (the store too
    /// slow, or out of reach, its breaker open) is sent again every 100 ms for as long as the
    /// line keeps a reservation past its turn (`KEPT`, 10 s); then the failure is logged as
    /// `failed`.
    fn then_wake<F>(&self, change: F, failed: &'static str)
    where
        F: Fn(&St, &Key, &Policy, Ticket) -> St::LineFuture + Send + 'static,
    {
        /// How often a change to the line is sent: every 100 ms for 10 s.
        const TRIES: u32 = 100;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (shared, key, ticket) = (Arc::clone(&self.shared), self.key.clone(), self.ticket);
        runtime.spawn(async move {
            for tried in 1..=TRIES {
                match change(&shared.store, &key, &shared.policy, ticket).await {
                    Ok(_) => break,
                    Err(error) if tried == TRIES => {
                        tracing::warn!(target: "tower_redis_ratelimit", %error, "{failed}");
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            shared.wake.notify_waiters();
        });
    }

    /// The same request, reserving again with what is left of its wait; `None` when nothing
    /// is left.
    fn again(&self) -> Option<Seat<St>> {
        let left = self.shared.max_wait.checked_sub(self.started.elapsed())?;
        Some(Seat {
            ticket: self.shared.ticket(left),
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

    fn poll<E>(&mut self, cx: &mut Context<'_>) -> Poll<Result<Placed<St>, OutboundError<E>>> {
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
            taken: false,
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
struct Placed<St: Store> {
    /// When its turn comes, as it last learned.
    turn_at: Instant,
    /// Whether the store took it out of the line, used, at its last look (its turn was at
    /// most `late` ahead): it goes at its turn with no other look.
    taken: bool,
    seat: Option<Seat<St>>,
}

impl<St: Store> Placed<St> {
    /// Sleeps until its turn, or its next look when that is sooner, or until woken.
    fn wait(self) -> State<St> {
        let Some(seat) = self.seat.as_ref() else {
            return State::Turn(self);
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

    /// Looks where it stands in line; taken out already, it goes at its turn.
    fn look(self) -> State<St> {
        if self.taken {
            return self.at_turn(Instant::now());
        }
        let Some(seat) = self.seat.as_ref() else {
            return State::Turn(self);
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
    fn after_look<E>(
        mut self,
        stood: Result<InLine, StoreError>,
    ) -> Result<State<St>, OutboundError<E>> {
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
                return Ok(State::Turn(self));
            }
            Err(_) => return Ok(self.at_turn(now)),
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
                self.taken = self.seat.as_ref().is_some_and(|s| turn <= s.ticket.late);
                Ok(self.at_turn(now))
            }
        }
    }

    /// Whether its units, due at its turn, may no longer be used at `now`: later than its
    /// turn by more than its `late`.
    fn too_late(&self, now: Instant) -> bool {
        let late = self.seat.as_ref().map_or(Duration::ZERO, |s| s.shared.late);
        now > self.turn_at + late
    }

    /// Leaves the line and reserves again, with what is left of its wait; past it, too late
    /// (`paused`: the key's pause, which its turn would have come after at the earliest).
    fn again<E>(mut self, paused: Option<Duration>) -> Result<State<St>, OutboundError<E>> {
        let Some(seat) = self.seat.take() else {
            return Ok(State::Gone);
        };
        seat.leave();
        match seat.again() {
            Some(again) => Ok(State::Reserving(Asked::new(again))),
            None => Err(OutboundError::TooLate { turn: paused }),
        }
    }

    /// Goes when its turn has come, else waits on.
    fn at_turn(self, now: Instant) -> State<St> {
        match now >= self.turn_at {
            true => State::Turn(self),
            false => self.wait(),
        }
    }

    /// The request went out: nothing to give back.
    fn keep(&mut self) {
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
