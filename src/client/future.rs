//! The response future: reserve, wait for the turn, take the inner service's readiness, call.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Request;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::OutboundError;
use crate::{Decision, Key, Policy, Settlement, Store};

/// A store a response future can give a reservation back to from `Drop`, on a task of its
/// own: the bounds of [`Outbound`](super::Outbound)'s service, in one place.
pub trait Keeper:
    Store<Future: Send + 'static, ResetFuture: Send + 'static> + Send + Sync + 'static
{
}

impl<St> Keeper for St where
    St: Store<Future: Send + 'static, ResetFuture: Send + 'static> + Send + Sync + 'static
{
}

pin_project! {
    /// The response future of [`Outbound`](super::Outbound).
    pub struct ResponseFuture<S, St, B>
    where
        S: Service<Request<B>>,
        St: Keeper,
    {
        #[pin]
        call: Option<S::Future>,
        step: Step<St>,
        request: Option<Request<B>>,
        inner: Option<S>,
        failed: Option<OutboundError<S::Error>>,
    }
}

/// Where a request is on its way out.
enum Step<St: Keeper> {
    /// Its reservation is on its way.
    Reserving(Pending<St>),
    /// Its turn has not come yet.
    Waiting(Pin<Box<Sleep>>, Held<St>),
    /// Its turn has come; the inner service is not ready yet.
    Turn(Held<St>),
    /// Sent (or failed).
    Gone,
}

impl<S, St, B> ResponseFuture<S, St, B>
where
    S: Service<Request<B>>,
    St: Keeper,
{
    pub(super) fn new(
        reserve: St::Future,
        giver: Giver<St>,
        request: Request<B>,
        inner: S,
    ) -> Self {
        ResponseFuture {
            call: None,
            step: Step::Reserving(Pending {
                future: Some(Box::pin(reserve)),
                giver: Some(giver),
            }),
            request: Some(request),
            inner: Some(inner),
            failed: None,
        }
    }

    pub(super) fn failed(error: OutboundError<S::Error>) -> Self {
        ResponseFuture {
            call: None,
            step: Step::Gone,
            request: None,
            inner: None,
            failed: Some(error),
        }
    }
}

impl<S, St, B> Future for ResponseFuture<S, St, B>
where
    S: Service<Request<B>>,
    St: Keeper,
{
    type Output = Result<S::Response, OutboundError<S::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match std::mem::replace(this.step, Step::Gone) {
                Step::Reserving(mut pending) => match pending.poll(cx) {
                    Poll::Pending => {
                        *this.step = Step::Reserving(pending);
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(error)) => {
                        return Poll::Ready(Err(OutboundError::Store(error)))
                    }
                    Poll::Ready(Ok(held)) => {
                        let Some(turn) = held.turn() else {
                            let turn = held.refused_turn();
                            return Poll::Ready(Err(OutboundError::TooLate { turn }));
                        };
                        let sleep = Box::pin(tokio::time::sleep(turn));
                        *this.step = Step::Waiting(sleep, held);
                    }
                },
                Step::Waiting(mut sleep, held) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        *this.step = Step::Waiting(sleep, held);
                        return Poll::Pending;
                    }
                    *this.step = Step::Turn(held);
                }
                Step::Turn(mut held) => {
                    let Some(inner) = this.inner.as_mut() else {
                        return Poll::Pending;
                    };
                    match inner.poll_ready(cx) {
                        Poll::Pending => {
                            *this.step = Step::Turn(held);
                            return Poll::Pending;
                        }
                        Poll::Ready(Err(error)) => {
                            return Poll::Ready(Err(OutboundError::Inner(error)))
                        }
                        Poll::Ready(Ok(())) => {}
                    }
                    // The request goes out: its units are used, not given back.
                    held.keep();
                    if let Some(request) = this.request.take() {
                        this.call.set(Some(inner.call(request)));
                    }
                }
                Step::Gone => {
                    if let Some(error) = this.failed.take() {
                        return Poll::Ready(Err(error));
                    }
                    let Some(call) = this.call.as_mut().as_pin_mut() else {
                        return Poll::Pending;
                    };
                    let response = ready!(call.poll(cx));
                    return Poll::Ready(response.map_err(OutboundError::Inner));
                }
            }
        }
    }
}

/// How a reservation is given back: its store, key and policy.
pub(super) struct Giver<St> {
    store: St,
    key: Key,
    policy: Policy,
}

impl<St: Keeper> Giver<St> {
    pub(super) fn new(store: St, key: Key, policy: Policy) -> Self {
        Giver { store, key, policy }
    }

    /// Gives `decision`'s unit back, on a task of its own (the caller is going away).
    fn give_back(self, decision: Decision) {
        let Some(refund) = Settlement::refund(&decision, 1) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let settle = self.store.settle(&self.key, &self.policy, refund);
        runtime.spawn(async move {
            if let Err(error) = settle.await {
                tracing::warn!(
                    target: "tower_redis_ratelimit",
                    %error,
                    "failed to give back a reservation"
                );
            }
        });
    }
}

/// A reservation on its way: if its caller goes away before the store answers, the answer is
/// still awaited, on a task of its own, and a reservation it made is given back.
struct Pending<St: Keeper> {
    future: Option<Pin<Box<St::Future>>>,
    giver: Option<Giver<St>>,
}

impl<St: Keeper> Pending<St> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Held<St>, crate::StoreError>> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let decision = ready!(future.as_mut().poll(cx));
        self.future = None;
        let giver = self.giver.take();
        Poll::Ready(decision.map(|decision| Held {
            decision: Some(decision),
            giver,
        }))
    }
}

impl<St: Keeper> Drop for Pending<St> {
    fn drop(&mut self) {
        let (Some(future), Some(giver)) = (self.future.take(), self.giver.take()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            if let Ok(decision) = future.await {
                if decision.is_allowed() {
                    giver.give_back(decision);
                }
            }
        });
    }
}

/// A reservation answered: given back when dropped before the request went out.
struct Held<St: Keeper> {
    decision: Option<Decision>,
    giver: Option<Giver<St>>,
}

impl<St: Keeper> Held<St> {
    /// The wait for its turn, when it was reserved.
    fn turn(&self) -> Option<std::time::Duration> {
        self.decision
            .filter(Decision::is_allowed)
            .map(|decision| decision.turn())
    }

    /// When the refused reservation's turn would have come.
    fn refused_turn(&self) -> Option<std::time::Duration> {
        self.decision.and_then(|decision| decision.retry_after())
    }

    /// The request went out: nothing to give back.
    fn keep(&mut self) {
        self.decision = None;
    }
}

impl<St: Keeper> Drop for Held<St> {
    fn drop(&mut self) {
        if let (Some(decision), Some(giver)) = (self.decision.take(), self.giver.take()) {
            if decision.is_allowed() {
                giver.give_back(decision);
            }
        }
    }
}
