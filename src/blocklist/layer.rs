//! [`BlocklistLayer`]: refuses blocked keys with 403 (gRPC `PERMISSION_DENIED`) before the
//! inner service, a rate limiter included, sees the request.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::{Blocklist, Screen};
use crate::body::ResponseBody;
use crate::response::{grpc_content_type, Responder};
use crate::{KeyExtractor, StoreError};

/// Applies a [`Blocklist`] to requests, keyed by `K` (any [`KeyExtractor`], e.g.
/// [`PeerIp`](crate::PeerIp) or an API-key [`Header`](crate::Header)).
///
/// A request whose key the local filter clears goes straight on; a "maybe" waits for one
/// `SISMEMBER`. A request with no key goes on (the rate limiter decides what to do with it). If
/// Redis cannot confirm a "maybe", the request goes on and a `tracing` warning says so: the
/// blocklist fails open.
#[derive(Debug, Clone)]
pub struct BlocklistLayer<K> {
    blocklist: Blocklist,
    key: K,
}

impl<K> BlocklistLayer<K> {
    /// Refuses requests whose key `key` extracts is in `blocklist`.
    pub fn new(blocklist: Blocklist, key: K) -> Self {
        BlocklistLayer { blocklist, key }
    }
}

impl<S, K: Clone> Layer<S> for BlocklistLayer<K> {
    type Service = BlocklistService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        BlocklistService {
            inner,
            blocklist: self.blocklist.clone(),
            key: self.key.clone(),
        }
    }
}

/// The service [`BlocklistLayer`] makes.
#[derive(Debug, Clone)]
pub struct BlocklistService<S, K> {
    inner: S,
    blocklist: Blocklist,
    key: K,
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for BlocklistService<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = BlocklistFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(_) => return BlocklistFuture::calling(self.inner.call(request)),
        };
        if self.blocklist.screen(&key) == Screen::Clear {
            return BlocklistFuture::calling(self.inner.call(request));
        }
        let grpc = grpc_content_type(request.headers());
        let confirm = Box::pin(self.blocklist.confirm(key.as_str().to_owned()));
        // The readied service answers later; a clone takes its place here.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        BlocklistFuture {
            state: State::Confirming {
                confirm,
                grpc,
                call: Some((ready, request)),
            },
        }
    }
}

type Confirm = Pin<Box<dyn Future<Output = Result<bool, StoreError>> + Send>>;

pin_project! {
    /// Response future of [`BlocklistService`]: `Confirming` (the set is asked about a
    /// "maybe") → `Calling` (the inner service answers) or a 403 of the layer's own.
    pub struct BlocklistFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        Confirming {
            confirm: Confirm,
            grpc: Option<HeaderValue>,
            call: Option<(S, Request<B>)>,
        },
        Calling {
            #[pin]
            future: S::Future,
        },
        Answer {
            response: Option<Response<Full<Bytes>>>,
        },
    }
}

impl<S, B> BlocklistFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn calling(future: S::Future) -> Self {
        BlocklistFuture {
            state: State::Calling { future },
        }
    }
}

impl<S, B, ResB> Future for BlocklistFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Confirming {
                    confirm,
                    grpc,
                    call,
                } => {
                    let blocked = match ready!(confirm.as_mut().poll(cx)) {
                        Ok(blocked) => blocked,
                        Err(error) => {
                            tracing::warn!(
                                target: "tower_redis_ratelimit",
                                error = %crate::chain::Chain(&error),
                                "blocklist could not confirm a key; letting it through"
                            );
                            false
                        }
                    };
                    if blocked {
                        let response = Responder::forbidden(grpc.as_ref());
                        this.state.set(State::Answer {
                            response: Some(response),
                        });
                        continue;
                    }
                    let (mut service, request) = call
                        .take()
                        .expect("BlocklistFuture polled after completion");
                    let future = service.call(request);
                    this.state.set(State::Calling { future });
                }
                StateProj::Calling { future } => {
                    let response = ready!(future.poll(cx))?;
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Answer { response } => {
                    let response = response
                        .take()
                        .expect("BlocklistFuture polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::own)));
                }
            }
        }
    }
}

impl<S, B> std::fmt::Debug for BlocklistFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlocklistFuture").finish_non_exhaustive()
    }
}
