//! [`ResponseFuture`]: waits for the store's decision, then for the inner service.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::response::{FailureMode, Responder};
use crate::{Decision, StoreError};

pin_project! {
    /// Response future of [`RateLimit`](crate::RateLimit): `Checking` (the store decides) →
    /// `Calling` (the inner service answers) or an answer of the layer's own.
    pub struct ResponseFuture<S, B, F>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B, F>,
        responder: Arc<Responder>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, F>
    where
        S: Service<Request<B>>,
    {
        Checking {
            #[pin]
            check: F,
            call: Option<(S, Request<B>)>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<Decision>,
        },
        Answer {
            response: Option<Response<Full<Bytes>>>,
        },
    }
}

impl<S, B, F> ResponseFuture<S, B, F>
where
    S: Service<Request<B>>,
{
    pub(crate) fn checking(
        check: F,
        service: S,
        request: Request<B>,
        responder: Arc<Responder>,
    ) -> Self {
        let call = Some((service, request));
        ResponseFuture {
            state: State::Checking { check, call },
            responder,
        }
    }

    pub(crate) fn calling(
        future: S::Future,
        decision: Option<Decision>,
        responder: Arc<Responder>,
    ) -> Self {
        ResponseFuture {
            state: State::Calling { future, decision },
            responder,
        }
    }

    pub(crate) fn answer(response: Response<Full<Bytes>>, responder: Arc<Responder>) -> Self {
        ResponseFuture {
            state: State::Answer {
                response: Some(response),
            },
            responder,
        }
    }
}

impl<S, B, F, ResB> Future for ResponseFuture<S, B, F>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    F: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking { check, call } => {
                    let outcome = ready!(check.poll(cx));
                    let decision = match outcome {
                        Ok(d) if !d.is_allowed() => {
                            let response = this.responder.rejection(&d);
                            return Poll::Ready(Ok(response.map(ResponseBody::own)));
                        }
                        Ok(d) => Some(d),
                        Err(_) if this.responder.options.failure_mode == FailureMode::Closed => {
                            let response = this.responder.unavailable();
                            return Poll::Ready(Ok(response.map(ResponseBody::own)));
                        }
                        Err(_) => None,
                    };
                    let (mut service, request) =
                        call.take().expect("ResponseFuture polled after completion");
                    let future = service.call(request);
                    this.state.set(State::Calling { future, decision });
                }
                StateProj::Calling { future, decision } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(d) = decision {
                        if !this.responder.options.hide_allowed_headers {
                            this.responder.add_headers(response.headers_mut(), d);
                        }
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Answer { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::own)));
                }
            }
        }
    }
}

impl<S, B, F> std::fmt::Debug for ResponseFuture<S, B, F>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
