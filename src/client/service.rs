//! The service.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tower_service::Service;

use super::future::{Giver, Keeper, ResponseFuture};
use super::layer::Shared;
use crate::store::Reserve;
use crate::KeyExtractor;

/// A service whose requests wait for their turn ([`OutboundLayer`](super::OutboundLayer)).
///
/// Always ready: a request's key, and so its turn, is known only once it comes, so it waits
/// in its response future, and takes the inner service's readiness only when its turn has
/// come (each call works on a clone of the inner service).
#[derive(Debug)]
pub struct Outbound<S, K, St> {
    inner: S,
    shared: Arc<Shared<K, St>>,
}

impl<S: Clone, K, St> Clone for Outbound<S, K, St> {
    fn clone(&self) -> Self {
        Outbound {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, K, St> Outbound<S, K, St> {
    pub(super) fn new(inner: S, shared: Arc<Shared<K, St>>) -> Self {
        Outbound { inner, shared }
    }
}

impl<S, K, St, B> Service<Request<B>> for Outbound<S, K, St>
where
    S: Service<Request<B>> + Clone,
    K: KeyExtractor<B>,
    St: Reserve + Keeper + Clone,
{
    type Response = S::Response;
    type Error = super::OutboundError<S::Error>;
    type Future = ResponseFuture<S, St, B>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let shared = &self.shared;
        let key = match shared.key.extract(&request) {
            Ok(key) => key,
            Err(error) => return ResponseFuture::failed(super::OutboundError::Key(error)),
        };
        let reserve = shared
            .store
            .reserve(&key, &shared.policy, 1, shared.max_wait, shared.late);
        let giver = Giver::new(shared.store.clone(), key, shared.policy.clone());
        ResponseFuture::new(reserve, giver, request, self.inner.clone())
    }
}
