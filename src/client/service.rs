//! The service.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::shared::Shared;
use super::wait::{Seat, WaitTurn};
use crate::key::Global;
use crate::{KeyExtractor, MemoryStore, Store};

/// A service whose requests wait for their turn ([`OutboundLayer`](super::OutboundLayer)).
///
/// Always ready: a request's key, and so its turn, is known only once it comes, so it waits
/// in its response future, and takes the inner service's readiness only when its turn has
/// come (each call works on a clone of the inner service).
#[derive(Debug)]
pub struct Outbound<S, K = Global, St = MemoryStore> {
    inner: S,
    key: Arc<K>,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, K, St> Clone for Outbound<S, K, St> {
    fn clone(&self) -> Self {
        Outbound {
            inner: self.inner.clone(),
            key: Arc::clone(&self.key),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, K, St> Outbound<S, K, St> {
    pub(super) fn new(inner: S, key: Arc<K>, shared: Arc<Shared<St>>) -> Self {
        Outbound { inner, key, shared }
    }
}

impl<S, K, St, B, RB> Service<Request<B>> for Outbound<S, K, St>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    K: KeyExtractor<B>,
    St: Store,
{
    type Response = S::Response;
    type Error = super::OutboundError<S::Error>;
    type Future = ResponseFuture<S, St, B>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let key = match self.key.extract(&request) {
            Ok(key) => key,
            Err(error) => return ResponseFuture::failed(super::OutboundError::Key(error)),
        };
        let wait = WaitTurn::new(Seat::new(Arc::clone(&self.shared), key, 1));
        ResponseFuture::new(wait, request, self.inner.clone())
    }
}
