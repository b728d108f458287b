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
use crate::deny_cache::DenyCache;
use crate::response::{FailureMode, Responder};
use crate::{Decision, Key, Store, StoreError};

/// What a pending decision is about.
pub(crate) struct Check {
    pub(crate) responder: Arc<Responder>,
    pub(crate) key: Key,
    pub(crate) cost: u32,
    /// The request's gRPC content type, for a gRPC request.
    pub(crate) grpc: Option<http::HeaderValue>,
    pub(crate) deny_cache: Option<DenyCache>,
}

pin_project! {
    /// Response future of [`RateLimit`](crate::RateLimit): `Checking` (the store decides) →
    /// `Calling` (the inner service answers) or an answer of the layer's own.
    pub struct ResponseFuture<S, B, F>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B, F>,
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
            decision: F,
            check: Check,
            call: Option<(S, Request<B>)>,
        },
        Calling {
            #[pin]
            future: S::Future,
            // Set when the response gets the rate-limit fields.
            fields: Option<(Decision, Arc<Responder>)>,
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
    pub(crate) fn checking(decision: F, check: Check, service: S, request: Request<B>) -> Self {
        let call = Some((service, request));
        ResponseFuture {
            state: State::Checking {
                decision,
                check,
                call,
            },
        }
    }

    /// Calls the inner service with no decision to report (not limited, or allow-listed).
    pub(crate) fn calling(future: S::Future) -> Self {
        ResponseFuture {
            state: State::Calling {
                future,
                fields: None,
            },
        }
    }

    pub(crate) fn answer(response: Response<Full<Bytes>>) -> Self {
        ResponseFuture {
            state: State::Answer {
                response: Some(response),
            },
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
                StateProj::Checking {
                    decision,
                    check,
                    call,
                } => {
                    let outcome = ready!(decision.poll(cx));
                    let policy = check.responder.policy.name();
                    let options = &check.responder.options;
                    let outcome = match (outcome, &options.failure_mode) {
                        (Err(error), FailureMode::Fallback(local)) => {
                            tracing::warn!(
                                target: "tower_redis_ratelimit",
                                policy,
                                %error,
                                "rate-limit store failed; deciding locally"
                            );
                            let policy = &check.responder.policy;
                            local.check(&check.key, policy, check.cost).into_inner()
                        }
                        (outcome, _) => outcome,
                    };
                    let fields = match outcome {
                        Ok(d) if d.is_allowed() => {
                            (!options.hide_allowed_headers).then(|| (d, check.responder.clone()))
                        }
                        Ok(d) if options.shadow => {
                            tracing::info!(
                                target: "tower_redis_ratelimit",
                                policy,
                                key = check.key.as_str(),
                                retry_after_ms = d.retry_after().map(|r| r.as_millis() as u64),
                                "rate limit exceeded; passed on (shadow mode)"
                            );
                            Some((d, check.responder.clone()))
                        }
                        Ok(d) => {
                            if let Some(cache) = &check.deny_cache {
                                cache.remember(&check.key, &check.responder.policy, check.cost, d);
                            }
                            let response = check.responder.rejection(&d, check.grpc.as_ref());
                            return Poll::Ready(Ok(response.map(ResponseBody::own)));
                        }
                        Err(error) => {
                            tracing::warn!(
                                target: "tower_redis_ratelimit",
                                policy,
                                %error,
                                mode = ?options.failure_mode,
                                "rate-limit store failed"
                            );
                            if let FailureMode::Closed = options.failure_mode {
                                let response = Responder::unavailable(check.grpc.as_ref());
                                return Poll::Ready(Ok(response.map(ResponseBody::own)));
                            }
                            None
                        }
                    };
                    let (mut service, request) =
                        call.take().expect("ResponseFuture polled after completion");
                    let future = service.call(request);
                    this.state.set(State::Calling { future, fields });
                }
                StateProj::Calling { future, fields } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some((decision, responder)) = fields.take() {
                        responder.add_headers(response.headers_mut(), &decision);
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
