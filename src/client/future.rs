//! The response future: wait for a turn ([`WaitTurn`]), take the inner service's readiness,
//! call, and pause the key where the upstream pushes back.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::sync::oneshot;
use tower_service::Service;

use super::pushback::pushback_or_log;
use super::shared::Shared;
use super::wait::{Turn, WaitTurn};
use super::OutboundError;
use crate::{Key, Store};

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
        // Where the request went out: kept to pause its key when the upstream pushes back.
        pauser: Option<(Arc<Shared<St>>, Key)>,
        // A pushback's answer, handed back once the store has heard the pause: the caller's
        // next request does not reserve before it.
        pushed_back: Option<(S::Response, oneshot::Receiver<()>)>,
    }
}

/// Where a request is on its way out.
enum State<St: Store> {
    /// It waits for its turn.
    Waiting(WaitTurn<St>),
    /// Its turn has come; the inner service is not ready yet.
    Turn(Turn<St>),
    /// Sent (or failed).
    Gone,
}

impl<S, St, B, RB> ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
    St: Store,
{
    pub(super) fn new(wait: WaitTurn<St>, request: Request<B>, inner: S) -> Self {
        ResponseFuture {
            call: None,
            state: State::Waiting(wait),
            request: Some(request),
            inner: Some(inner),
            failed: None,
            pauser: None,
            pushed_back: None,
        }
    }

    pub(super) fn failed(error: OutboundError<S::Error>) -> Self {
        ResponseFuture {
            call: None,
            state: State::Gone,
            request: None,
            inner: None,
            failed: Some(error),
            pauser: None,
            pushed_back: None,
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
                State::Waiting(mut wait) => match Pin::new(&mut wait).poll(cx) {
                    Poll::Pending => Err(State::Waiting(wait)),
                    Poll::Ready(Ok(turn)) => Ok(State::Turn(turn)),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error.widen())),
                },
                State::Turn(turn) => {
                    let Some(inner) = this.inner.as_mut() else {
                        return Poll::Pending;
                    };
                    match inner.poll_ready(cx) {
                        Poll::Pending => Err(State::Turn(turn)),
                        Poll::Ready(Err(error)) => {
                            return Poll::Ready(Err(OutboundError::Inner(error)))
                        }
                        // Ready later than its units may be used: it gives the turn back and
                        // waits again, and gives the readiness back (a clone of the service
                        // is not ready).
                        Poll::Ready(Ok(())) if turn.too_late() => {
                            *inner = inner.clone();
                            Ok(State::Waiting(turn.again()))
                        }
                        Poll::Ready(Ok(())) => {
                            // The request goes out: its units are used, not given back.
                            *this.pauser = turn.pauser();
                            turn.go();
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
                    if let Some((response, mut heard)) = this.pushed_back.take() {
                        if Pin::new(&mut heard).poll(cx).is_pending() {
                            *this.pushed_back = Some((response, heard));
                            return Poll::Pending;
                        }
                        return Poll::Ready(Ok(response));
                    }
                    let Some(call) = this.call.as_mut().as_pin_mut() else {
                        return Poll::Pending;
                    };
                    let response = ready!(call.poll(cx));
                    this.call.set(None);
                    if let (Ok(answer), Some((shared, key))) = (&response, this.pauser.take()) {
                        let (status, headers) = (answer.status().as_u16(), answer.headers());
                        if let Some(pause) = pushback_or_log(status, headers, shared.max_pause) {
                            let heard = Shared::pause(&shared, key, pause);
                            if let Ok(answer) = response {
                                *this.pushed_back = Some((answer, heard));
                                continue;
                            }
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
