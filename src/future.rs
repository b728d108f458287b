//! [`ResponseFuture`]: waits for the store's decision, then for the inner service.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::admission::{Admitted, Deciding, Later, Verdict};
use crate::body::ResponseBody;
use crate::metered::{Bodies, Whole};
use crate::Store;

pin_project! {
    /// Response future of [`RateLimit`](crate::RateLimit): `Deciding` (the store decides, or
    /// the request waits for a concurrency slot) → `Calling` (the inner service answers), or
    /// an answer of the layer's own. `St` is the layer's store, whose future it waits for;
    /// `M` whether the request body is metered ([`Metered`](crate::metered::Metered)), in which
    /// case a response to a cut body is replaced by the layer's answer.
    pub struct ResponseFuture<S, B, St, M = Whole>
    where
        M: Bodies<B>,
        S: Service<Request<<M as Bodies<B>>::Body>>,
        St: Store,
    {
        #[pin]
        state: State<S, B, St, M>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, St, M>
    where
        M: Bodies<B>,
        S: Service<Request<<M as Bodies<B>>::Body>>,
        St: Store,
    {
        Deciding {
            // The service made ready, and the request, for the call once admitted.
            #[pin]
            deciding: Deciding<St::Future, (S, Request<B>)>,
        },
        Calling {
            #[pin]
            future: S::Future,
            admitted: Admitted,
        },
        Answer {
            response: Option<Response<Full<Bytes>>>,
        },
    }
}

impl<S, B, St, M> State<S, B, St, M>
where
    M: Bodies<B>,
    S: Service<Request<M::Body>>,
    St: Store,
{
    /// Calls `service` with the admitted request, its decision added to the request's
    /// [`Decisions`](crate::Decisions), its body metered when the layer meters them.
    fn calling(service: &mut S, mut request: Request<B>, mut admitted: Admitted) -> Self {
        admitted.mark(&mut request);
        let meter = admitted.meter.take();
        let request = request.map(|body| M::wrap(body, meter));
        State::Calling {
            future: service.call(request),
            admitted,
        }
    }
}

impl<S, B, St, M> ResponseFuture<S, B, St, M>
where
    M: Bodies<B>,
    S: Service<Request<M::Body>>,
    St: Store,
{
    /// Calls `service` (made ready) at once: the request is admitted, or not limited.
    pub(crate) fn calling(service: &mut S, request: Request<B>, admitted: Admitted) -> Self {
        ResponseFuture {
            state: State::calling(service, request, admitted),
        }
    }

    /// Waits for the decision, then calls `service` (made ready) if it admits.
    pub(crate) fn deciding(later: Later<St::Future>, service: S, request: Request<B>) -> Self {
        ResponseFuture {
            state: State::Deciding {
                deciding: Deciding::new(later, (service, request)),
            },
        }
    }

    /// Answers without the inner service.
    pub(crate) fn answer(response: Response<Full<Bytes>>) -> Self {
        ResponseFuture {
            state: State::Answer {
                response: Some(response),
            },
        }
    }
}

impl<S, B, St, M, ResB> Future for ResponseFuture<S, B, St, M>
where
    M: Bodies<B>,
    S: Service<Request<M::Body>, Response = Response<ResB>>,
    St: Store,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Deciding { deciding } => {
                    let decided = ready!(deciding.poll_verdict(cx));
                    let (verdict, (mut service, request)) =
                        decided.expect("ResponseFuture polled after completion");
                    match verdict {
                        Verdict::Call(admitted) => {
                            let calling = State::calling(&mut service, request, admitted);
                            this.state.set(calling);
                        }
                        Verdict::Answer(response) => {
                            return Poll::Ready(Ok(response.map(ResponseBody::own)))
                        }
                    }
                }
                StateProj::Calling { future, admitted } => {
                    let mut response = ready!(future.poll(cx))?;
                    // A cut body's handler answered its error (axum: 400); the layer answers
                    // instead, as it would have at admission. The slot is given back as usual.
                    let cut = admitted.flow.take().and_then(|flow| flow.answer());
                    if let Some(answer) = cut {
                        drop(response);
                        drop(std::mem::take(&mut admitted.receipt));
                        return Poll::Ready(Ok(answer.map(ResponseBody::own)));
                    }
                    if let Some((decision, responder)) = admitted.fields.take() {
                        responder.add_headers(response.headers_mut(), &decision);
                    }
                    let mut receipt = std::mem::take(&mut admitted.receipt);
                    receipt.read_head(&response);
                    return Poll::Ready(
                        Ok(response.map(|body| ResponseBody::owing(body, receipt))),
                    );
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

impl<S, B, St, M> std::fmt::Debug for ResponseFuture<S, B, St, M>
where
    M: Bodies<B>,
    S: Service<Request<M::Body>>,
    St: Store,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::future::{ready, Ready};
    use std::sync::Arc;

    use http::StatusCode;

    use super::*;
    use crate::decisions::Mark;
    use crate::response::{Options, Responder};
    use crate::{Decisions, Key, MemoryStore, Policy, Store};

    /// Answers with the units left that the request's decisions say.
    #[derive(Clone)]
    struct Echo;

    impl Service<Request<()>> for Echo {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = Ready<Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: Request<()>) -> Self::Future {
            let decisions = request.extensions().get::<Decisions>();
            let left = decisions
                .and_then(|d| d.get("default"))
                .map(|d| d.remaining());
            ready(Ok(Response::new(Full::new(Bytes::from(format!(
                "{left:?}"
            ))))))
        }
    }

    #[tokio::test]
    async fn an_admitted_request_carries_its_decision_in_and_its_fields_out() {
        let policy: Policy = "5/1m".parse().unwrap();
        let responder = Arc::new(Responder::new(policy.clone(), Options::default()));
        let decision = MemoryStore::new()
            .check(&Key::from("ann"), &policy, 1)
            .await
            .unwrap();
        let admitted = Admitted {
            fields: Some((decision, Arc::clone(&responder))),
            entry: Some((Arc::clone(&responder), Mark::Decided(decision))),
            ..Admitted::default()
        };
        let future: ResponseFuture<Echo, (), MemoryStore> =
            ResponseFuture::calling(&mut Echo, Request::new(()), admitted);
        let response = future.await.unwrap();
        assert_eq!(response.headers()["ratelimit"], "\"default\";r=4;t=60");
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap();
        assert_eq!(body.to_bytes(), "Some(4)");
    }

    #[tokio::test]
    async fn an_answer_of_the_layer_is_the_response() {
        let answer = Response::builder()
            .status(StatusCode::TOO_MANY_REQUESTS)
            .body(Full::new(Bytes::new()))
            .unwrap();
        let future: ResponseFuture<Echo, (), MemoryStore> = ResponseFuture::answer(answer);
        assert_eq!(
            future.await.unwrap().status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}
