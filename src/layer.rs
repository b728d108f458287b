//! [`RateLimitLayer`] and its builder.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use crate::response::{Options, Responder};
use crate::{
    Algorithm, Decision, FailureMode, MemoryStore, MissingKey, PeerIp, Policy, PolicyError,
    RateLimit, Store,
};

/// Applies a rate-limit [`Policy`] to every request of the wrapped service.
///
/// Build one with [`RateLimitLayer::builder`]; clones share the store.
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_redis_ratelimit::RateLimitLayer;
///
/// # fn main() -> Result<(), tower_redis_ratelimit::BuildError> {
/// // 5 requests per 10 seconds per client IP, in this process.
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(RateLimitLayer::builder().policy("5/10s").build()?);
/// # Ok(()) }
/// ```
pub struct RateLimitLayer<K = PeerIp, St = MemoryStore> {
    config: Arc<Config<K, St>>,
}

pub(crate) struct Config<K, St> {
    pub(crate) key: K,
    pub(crate) store: St,
    pub(crate) responder: Arc<Responder>,
}

impl<K, St> Clone for RateLimitLayer<K, St> {
    fn clone(&self) -> Self {
        RateLimitLayer {
            config: Arc::clone(&self.config),
        }
    }
}

impl<K, St> std::fmt::Debug for RateLimitLayer<K, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.config.responder.policy)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Starts a builder keyed by [`PeerIp`] over a new [`MemoryStore`].
    pub fn builder() -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            key: PeerIp,
            store: MemoryStore::new(),
            policy: None,
            algorithm: None,
            options: Options::default(),
        }
    }
}

impl<K, St> RateLimitLayer<K, St> {
    /// The policy this layer applies.
    pub fn policy(&self) -> &Policy {
        &self.config.responder.policy
    }
}

impl<S, K, St> Layer<S> for RateLimitLayer<K, St> {
    type Service = RateLimit<S, K, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.config))
    }
}

/// Why a [`RateLimitLayer`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No policy was given.
    #[error("no policy: call .policy(\"100/1m\") or .policy(Policy::new(..))")]
    NoPolicy,
    /// The policy is invalid.
    #[error("invalid policy: {0}")]
    Policy(#[from] PolicyError),
}

impl From<Infallible> for BuildError {
    fn from(never: Infallible) -> Self {
        match never {}
    }
}

/// Configures a [`RateLimitLayer`]; checks everything in [`build`](Self::build).
pub struct RateLimitLayerBuilder<K = PeerIp, St = MemoryStore> {
    key: K,
    store: St,
    policy: Option<Result<Policy, BuildError>>,
    algorithm: Option<Algorithm>,
    options: Options,
}

impl<K, St> std::fmt::Debug for RateLimitLayerBuilder<K, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<K, St> RateLimitLayerBuilder<K, St> {
    /// The policy to apply: a [`Policy`], or text such as `"5/10s"` or `"1/1m + 5/1h"`.
    /// Invalid text is reported by [`build`](Self::build).
    pub fn policy<P>(mut self, policy: P) -> Self
    where
        P: TryInto<Policy>,
        P::Error: Into<BuildError>,
    {
        self.policy = Some(policy.try_into().map_err(Into::into));
        self
    }

    /// The algorithm that decides the policy, overriding the policy's own (whose default is
    /// [`Algorithm::SlidingLog`]).
    ///
    /// ```
    /// use tower_redis_ratelimit::{Algorithm, RateLimitLayer};
    ///
    /// // A million per minute is out of the log's reach; GCRA keeps one timestamp per key.
    /// let layer = RateLimitLayer::builder()
    ///     .policy("1000000/1m")
    ///     .algorithm(Algorithm::Gcra)
    ///     .build()?;
    /// assert_eq!(layer.policy().algorithm(), Algorithm::Gcra);
    /// # Ok::<(), tower_redis_ratelimit::BuildError>(())
    /// ```
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = Some(algorithm);
        self
    }

    /// How requests are told apart (default [`PeerIp`]).
    pub fn key<K2>(self, key: K2) -> RateLimitLayerBuilder<K2, St> {
        RateLimitLayerBuilder {
            key,
            store: self.store,
            policy: self.policy,
            algorithm: self.algorithm,
            options: self.options,
        }
    }

    /// Where state is kept (default a new [`MemoryStore`]).
    pub fn store<St2: Store>(self, store: St2) -> RateLimitLayerBuilder<K, St2> {
        RateLimitLayerBuilder {
            key: self.key,
            store,
            policy: self.policy,
            algorithm: self.algorithm,
            options: self.options,
        }
    }

    /// Whether admitted responses carry the `RateLimit-Policy` and `RateLimit` fields
    /// (default `true`). Rejections always carry them.
    pub fn headers_on_allowed(mut self, enabled: bool) -> Self {
        self.options.hide_allowed_headers = !enabled;
        self
    }

    /// Builds the response to a refused request instead of the default plain-text 429.
    ///
    /// The layer adds `Retry-After`, `RateLimit-Policy` and `RateLimit` unless the response
    /// already has them.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use tower_redis_ratelimit::RateLimitLayer;
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .policy("100/1m")
    ///     .on_rejection(|_| {
    ///         let mut r = Response::new(Bytes::from_static(br#"{"error":"slow down"}"#));
    ///         *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    ///         r
    ///     })
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn on_rejection<F>(mut self, rejection: F) -> Self
    where
        F: Fn(&Decision) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.options.on_rejection = Some(Arc::new(rejection));
        self
    }

    /// What to do with a request that yields no key (default [`MissingKey::Reject`]).
    pub fn on_missing_key(mut self, missing_key: MissingKey) -> Self {
        self.options.missing_key = missing_key;
        self
    }

    /// What to do when the store cannot decide (default [`FailureMode::Open`]).
    pub fn failure_mode(mut self, mode: FailureMode) -> Self {
        self.options.failure_mode = mode;
        self
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer<K, St>, BuildError> {
        let mut policy = self.policy.ok_or(BuildError::NoPolicy)??;
        if let Some(algorithm) = self.algorithm {
            policy = policy.with_algorithm(algorithm);
        }
        let responder = Responder::new(policy, self.options);
        Ok(RateLimitLayer {
            config: Arc::new(Config {
                key: self.key,
                store: self.store,
                responder: Arc::new(responder),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_reports_bad_and_missing_policies() {
        assert_eq!(
            RateLimitLayer::builder().build().unwrap_err(),
            BuildError::NoPolicy
        );
        let err = RateLimitLayer::builder()
            .policy("5/10parsecs")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("10parsecs"), "{err}");
        let layer = RateLimitLayer::builder().policy("5/10s").build().unwrap();
        assert_eq!(layer.policy().limits()[0].count(), 5);
    }

    #[test]
    fn layer_is_clone_send_sync() {
        fn check<T: Clone + Send + Sync + 'static>() {}
        check::<RateLimitLayer>();
        #[cfg(feature = "redis")]
        check::<RateLimitLayer<crate::key::Header, crate::RedisStore>>();
    }
}
