//! Which client a request belongs to.
//!
//! A [`KeyExtractor`] turns a request into a [`Key`]; every key has its own budget under each
//! policy. Built in: [`PeerIp`] (the connecting address), [`Header`] (an API key or user id
//! header), [`Global`] (one budget for everybody), and any closure
//! `Fn(&http::Request<B>) -> Option<impl Into<Key>>`.

mod header;
mod peer;

use std::fmt;
use std::net::IpAddr;

use http::Request;

pub use header::Header;
pub use peer::PeerIp;

/// The identity a request is counted under, e.g. `203.0.113.7` or an API key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

impl Key {
    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for Key {
    fn from(s: String) -> Self {
        Key(s)
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        Key(s.to_owned())
    }
}

impl From<IpAddr> for Key {
    fn from(ip: IpAddr) -> Self {
        Key(ip.to_canonical().to_string())
    }
}

/// Why no key could be taken from a request.
///
/// What the layer then does is set by
/// [`RateLimitLayerBuilder::on_missing_key`](crate::RateLimitLayerBuilder::on_missing_key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request carries no peer address.
    #[error(
        "no peer address on the request: serve an axum app with \
         `into_make_service_with_connect_info::<SocketAddr>()`, or insert the \
         connection's `SocketAddr` into the request extensions (hyper, tower)"
    )]
    MissingPeerAddr,
    /// The configured header is absent.
    #[error("header {0:?} is missing")]
    MissingHeader(http::HeaderName),
    /// The configured header is present but empty or not visible ASCII.
    #[error("header {0:?} is empty or not visible ASCII")]
    InvalidHeader(http::HeaderName),
    /// A closure extractor returned `None`, or an empty key.
    #[error("the key extractor found no key")]
    NotFound,
}

/// Takes the rate-limit key from a request.
///
/// Implemented by the built-in extractors and by closures:
///
/// ```
/// use http::Request;
/// use tower_redis_ratelimit::{Key, KeyExtractor};
///
/// // Limit per user id header, falling back to "anonymous".
/// let by_user = |req: &Request<()>| {
///     Some(
///         req.headers()
///             .get("x-user-id")
///             .and_then(|v| v.to_str().ok())
///             .unwrap_or("anonymous")
///             .to_owned(),
///     )
/// };
/// let req = Request::builder().header("x-user-id", "42").body(()).unwrap();
/// assert_eq!(by_user.extract(&req).unwrap(), Key::from("42"));
/// ```
pub trait KeyExtractor<B> {
    /// The key of `request`, or why it has none.
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError>;
}

impl<B, F, K> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> Option<K>,
    K: Into<Key>,
{
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        match self(request).map(Into::into) {
            Some(key) if !key.0.is_empty() => Ok(key),
            _ => Err(KeyError::NotFound),
        }
    }
}

/// One key for every request: a limit on the whole service rather than per client.
#[derive(Debug, Clone, Copy, Default)]
pub struct Global;

impl<B> KeyExtractor<B> for Global {
    fn extract(&self, _: &Request<B>) -> Result<Key, KeyError> {
        Ok(Key::from("global"))
    }
}
