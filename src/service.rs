//! [`RateLimit`]: the service the layer wraps around yours.

use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use crate::admission::{Admission, Admitted, Limiter};
use crate::body::ResponseBody;
use crate::future::ResponseFuture;
use crate::metered::{Bodies, Whole};
use crate::{KeyExtractor, Store};

/// Rate-limits requests to the inner service `S`; made by
/// [`RateLimitLayer`](crate::RateLimitLayer).
///
/// For each request it extracts a key, asks the store, and then calls `S` or answers itself
/// (`429` with `Retry-After`). Readiness is `S`'s: `poll_ready` asks `S`, and `call` moves the
/// service that was made ready into the response future, leaving a clone in its place, so the
/// readiness is not lost while the store decides.
///
/// `M` says what `S` gets as a request's body: the client's own (`Whole`, the default), or a
/// [`MeteredBody`](crate::metered::MeteredBody) of it, for a layer built with
/// [`request_bytes`](crate::RateLimitLayerBuilder::request_bytes).
pub struct RateLimit<S, K, St, M = Whole> {
    inner: S,
    limiter: Arc<Limiter<K, St>>,
    bodies: PhantomData<fn() -> M>,
}

impl<S, K, St, M> RateLimit<S, K, St, M> {
    pub(crate) fn new(inner: S, limiter: Arc<Limiter<K, St>>) -> Self {
        RateLimit {
            inner,
            limiter,
            bodies: PhantomData,
        }
    }
}

impl<S: Clone, K, St, M> Clone for RateLimit<S, K, St, M> {
    fn clone(&self) -> Self {
        RateLimit::new(self.inner.clone(), Arc::clone(&self.limiter))
    }
}

impl<S: std::fmt::Debug, K, St, M> std::fmt::Debug for RateLimit<S, K, St, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("rules", &self.limiter.table)
            .finish_non_exhaustive()
    }
}

impl<S, K, St, M, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, St, M>
where
    M: Bodies<ReqB>,
    S: Service<Request<M::Body>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    St: Store,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, St, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqB>) -> Self::Future {
        let declared = M::declared(&request);
        match self.limiter.admit(&mut request, declared) {
            Admission::Pass => {
                ResponseFuture::calling(&mut self.inner, request, Admitted::default())
            }
            Admission::Call(admitted) => {
                ResponseFuture::calling(&mut self.inner, request, admitted)
            }
            Admission::Answer(response) => ResponseFuture::answer(response),
            Admission::Later(later) => ResponseFuture::deciding(later, self.take_ready(), request),
        }
    }
}

impl<S: Clone, K, St, M> RateLimit<S, K, St, M> {
    /// The inner service that `poll_ready` made ready, for a response future to call later,
    /// leaving a clone in its place.
    fn take_ready(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::future::{ready, Ready};

    use bytes::Bytes;
    use http::StatusCode;
    use http_body_util::Full;
    use tower::ServiceExt;
    use tower_layer::Layer;

    use super::*;
    use crate::{Decisions, Global, RateLimitLayer};

    /// A service that answers 200 when called after its own `poll_ready`, and 500 when called
    /// unready; its clones start unready, as those of a buffer or a concurrency limit do. The
    /// answer carries the units left that the layer's decision says.
    struct Inner {
        ready: bool,
    }

    impl Clone for Inner {
        fn clone(&self) -> Self {
            Inner { ready: false }
        }
    }

    impl Service<Request<()>> for Inner {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = Ready<Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            self.ready = true;
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: Request<()>) -> Self::Future {
            let status = match std::mem::take(&mut self.ready) {
                true => StatusCode::OK,
                false => StatusCode::INTERNAL_SERVER_ERROR,
            };
            let decisions = request.extensions().get::<Decisions>();
            let left = decisions
                .and_then(|d| d.get("default"))
                .map(|d| d.remaining());
            let body = Full::new(Bytes::from(format!("{left:?}")));
            let mut response = Response::new(body);
            *response.status_mut() = status;
            ready(Ok(response))
        }
    }

    async fn send<S>(service: &mut S) -> (StatusCode, Option<String>)
    where
        S: Service<Request<()>, Response = Response<ResponseBody<Full<Bytes>>>, Error = Infallible>,
    {
        let response = service
            .ready()
            .await
            .unwrap()
            .call(Request::new(()))
            .await
            .unwrap();
        let remaining = response.headers().get("ratelimit");
        let fields = remaining.map(|v| v.to_str().unwrap().to_owned());
        (response.status(), fields)
    }

    #[tokio::test]
    async fn decided_at_once_or_later_the_call_uses_the_service_made_ready() {
        let at_once = RateLimitLayer::builder().key(Global).policy("2/1m");
        let mut service = at_once.build().unwrap().layer(Inner { ready: false });
        let (status, fields) = send(&mut service).await;
        assert_eq!(status, StatusCode::OK);
        assert!(fields.is_some_and(|f| f.starts_with("\"default\";r=")));

        // Waiting for a concurrency slot, the decision comes through a future: decided later.
        let one_slot = crate::Policy::new("default", ["2/1m".parse().unwrap()])
            .and_then(|policy| policy.concurrency(1))
            .unwrap();
        let later = RateLimitLayer::builder()
            .key(Global)
            .policy(one_slot)
            .max_wait(std::time::Duration::from_secs(5))
            .build()
            .unwrap();
        let mut service = later.layer(Inner { ready: false });
        let first = service.ready().await.unwrap().call(Request::new(()));
        let holding = first.await.unwrap();
        let waiting = tokio::spawn(async move { send(&mut service).await });
        tokio::task::yield_now().await;
        drop(holding);
        let (status, fields) = waiting.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert!(fields.is_some_and(|f| f.starts_with("\"default\";r=")));
    }

    #[tokio::test]
    async fn a_refused_request_is_answered_without_the_inner_service() {
        let layer = RateLimitLayer::builder()
            .key(Global)
            .policy("1/1m")
            .build()
            .unwrap();
        let mut service = layer.layer(Inner { ready: false });
        assert_eq!(send(&mut service).await.0, StatusCode::OK);
        let (status, fields) = send(&mut service).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(fields.as_deref(), Some("\"default\";r=0;t=60"));
    }
}
