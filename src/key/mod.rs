//! Which client a request belongs to.
//!
//! A [`KeyExtractor`] turns a request into a [`Key`]; every key has its own budget under each
//! policy. Built in: [`PeerIp`] (the connecting address), [`Header`] (an API key or user id
//! header), [`Global`] (one budget for everybody), [`BodyKey`] (a form or JSON field, read by
//! [`BodyFieldLayer`]: see [`body`]), and any closure
//! `Fn(&http::Request<B>) -> Option<impl Into<Key>>`.

pub mod body;
mod client_ip;
mod forwarded;
mod header;
mod peer;

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use http::Request;

pub use body::{BodyField, BodyFieldLayer, BodyKey};
pub use client_ip::{ClientIp, ClientIpBuilder, ClientIpError};
pub use forwarded::ForwardedHeader;
pub use header::Header;
pub use peer::PeerIp;

/// The identity a request is counted under, e.g. `203.0.113.7` or an API key.
///
/// Keys become part of store keys, and many come from request headers that an attacker
/// controls, so a key is kept as given only if it is at most [`Key::MAX_LEN`] bytes of visible
/// ASCII other than `{` and `}` (which would disturb Redis Cluster hash tags). Anything else is
/// replaced by `#` and 32 hex digits of its BLAKE3 hash: fixed length, the same on every
/// instance, and distinct for distinct inputs in practice.
///
/// A key has two texts. Its `Display` is the key as stored, what an operator types to name
/// the client in an admin tool ([`Scope::Key`](crate::store::Scope::Key)). Its `Debug` is
/// for logs: a client address or network (from [`PeerIp`] or [`ClientIp`]) as is, anything
/// else, such as an API key or a user id, as `#` and 16 hex digits of its BLAKE3 hash, so that
/// an API key printed with `{:?}` in a log line or a panic message stays out of it, and one
/// client's lines can still be matched up, on every instance. The hash is not keyed: someone
/// with the logs can confirm a guess, so a user id or an e-mail address from a small set is
/// recoverable.
///
/// ```
/// use tower_redis_ratelimit::Key;
///
/// assert_eq!(Key::from("api-key-123").to_string(), "api-key-123");
/// let long = Key::from("x".repeat(8192));
/// assert_eq!(long.to_string().len(), 33);
/// assert!(long.to_string().starts_with('#'));
/// let raw: &[u8] = b"\xff\xfe";
/// assert_eq!(Key::from(raw), Key::from(raw));
///
/// let secret = format!("{:?}", Key::from("sk_live_123"));
/// assert!(secret.starts_with("Key(\"#") && !secret.contains("sk_live"));
/// ```
#[derive(Clone)]
pub struct Key(String, Option<IpNet>);

// Debug output ends up in logs and panic messages, so it shows what `loggable` shows: an API
// key printed with `{:?}` stays out of them.
impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Key").field(&self.loggable()).finish()
    }
}

// Keys are their text; where a key came from does not make it another key.
impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl Key {
    /// The longest key kept as given; longer ones are hashed.
    pub const MAX_LEN: usize = 128;

    /// A key from raw bytes, such as a header value that is not UTF-8.
    fn from_bytes(bytes: &[u8]) -> Key {
        let plain = bytes.len() <= Self::MAX_LEN
            && bytes
                .iter()
                .all(|&b| b.is_ascii_graphic() && b != b'{' && b != b'}' && b != b'#');
        match std::str::from_utf8(bytes) {
            Ok(text) if plain => Key(text.to_owned(), None),
            _ => {
                let hash = blake3::hash(bytes);
                let hex = hash.to_hex();
                Key(format!("#{}", &hex[..32]), None)
            }
        }
    }

    /// The key whose text ([`as_str`](Self::as_str)) is `text`, as a store kept it: a key
    /// that was hashed stays that hash, where [`Key::from`] would hash the hash again (its
    /// `#`), giving a key that names no client.
    #[cfg(feature = "redis")]
    pub(crate) fn from_stored(text: &str) -> Key {
        Key(text.to_owned(), None)
    }

    /// The key of a client network (an IPv6 prefix, or one address).
    pub(crate) fn from_network(net: IpNet) -> Key {
        let text = match net {
            IpNet::V4(n) if n.prefix_len() == 32 => n.addr().to_string(),
            IpNet::V6(n) if n.prefix_len() == 128 => n.addr().to_string(),
            net => net.to_string(),
        };
        Key(text, Some(net))
    }

    /// The client address or network, when an IP extractor ([`PeerIp`], [`ClientIp`]) made the
    /// key. Allow-listed networks match only these, never text that merely looks like one.
    pub(crate) fn network(&self) -> Option<IpNet> {
        self.1
    }

    /// The key as it appears in logs (its `Debug`; see [`Key`]).
    pub(crate) fn loggable(&self) -> std::borrow::Cow<'_, str> {
        if self.1.is_some() {
            return std::borrow::Cow::Borrowed(&self.0);
        }
        let hash = blake3::hash(self.0.as_bytes());
        std::borrow::Cow::Owned(format!("#{}", &hash.to_hex()[..16]))
    }

    /// The key as text.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// The key as stored: as given for a key of at most
/// [`Key::MAX_LEN`] bytes of visible ASCII, otherwise the `#` and 32 hex digits that stand
/// for it (never the raw bytes of a long or binary value). It is the text an admin listing
/// shows and an operator sends back to name the client
/// ([`Scope`](crate::store::Scope) displays a key's scope as `key:` and this), so it is
/// readable where the key was not hashed. A hashed key's text names its client in a listing,
/// but [`Key::from`] takes it for a new value and hashes it again: to name such a client, pass
/// the original value. The text is secret where the key is (an API key): logs take `Debug`,
/// never this.
///
/// ```
/// use tower_redis_ratelimit::Key;
///
/// let customer = Key::from("customer-42");
/// assert_eq!(customer.to_string(), "customer-42");
/// assert_eq!(Key::from(customer.to_string()), customer); // not hashed: it reads back
/// assert_ne!(format!("{customer:?}"), "Key(\"customer-42\")"); // logs get its hash
///
/// let long = Key::from("x".repeat(200));
/// assert!(long.to_string().starts_with('#') && long.to_string().len() == 33);
/// ```
impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A key from raw bytes, such as a header value that is not UTF-8.
impl From<&[u8]> for Key {
    fn from(bytes: &[u8]) -> Self {
        Key::from_bytes(bytes)
    }
}

impl From<String> for Key {
    fn from(s: String) -> Self {
        Key::from_bytes(s.as_bytes())
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        Key::from_bytes(s.as_bytes())
    }
}

impl From<IpAddr> for Key {
    fn from(ip: IpAddr) -> Self {
        Key::from_network(IpNet::from(ip.to_canonical()))
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
    /// The configured header is present but empty.
    #[error("header {0:?} is empty")]
    InvalidHeader(http::HeaderName),
    /// The request carries no [`BodyField`] of this name: no [`BodyFieldLayer`] reading it runs
    /// before the rate-limit layer, or the request was passed on unread
    /// ([`OtherContent::Pass`](body::OtherContent::Pass)).
    #[error(
        "no body field {0:?} on the request: a BodyFieldLayer reading it goes before the \
         rate-limit layer, and reads form and JSON bodies only"
    )]
    MissingBodyField(String),
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

/// Two extractors together, e.g. `(Header::new(..), ClientIp::new())`: the key is both keys,
/// the first prefixed by its length (hashed if that is too long). Fails if either fails.
impl<B, K1, K2> KeyExtractor<B> for (K1, K2)
where
    K1: KeyExtractor<B>,
    K2: KeyExtractor<B>,
{
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        let (a, b) = (self.0.extract(request)?, self.1.extract(request)?);
        // The length keeps ("x|y", "z") apart from ("x", "y|z").
        Ok(Key::from(format!("{}:{}|{}", a.0.len(), a.0, b.0)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Scope;

    /// An admin listing shows the key as stored; what logs and panics show never has it.
    #[test]
    fn listings_show_the_stored_key_and_logs_never_do() {
        for text in ["sk_live_123", "customer-42", &"y".repeat(Key::MAX_LEN)] {
            let key = Key::from(text);
            let scope = Scope::Key(key.clone());
            assert_eq!(key.to_string(), text);
            assert_eq!(scope.to_string(), format!("key:{text}"));
            for logged in [
                format!("{key:?}"),
                format!("{scope:?}"),
                key.loggable().into(),
            ] {
                assert!(!logged.contains(text), "{logged}");
            }
        }
        let hashed = Key::from_bytes(b"\xffsecret");
        assert_eq!(hashed.to_string(), hashed.as_str());
        assert!(!hashed.to_string().contains("secret"));
        let ip = Key::from(IpAddr::from([203, 0, 113, 7]));
        assert_eq!(
            (ip.to_string(), ip.loggable()),
            ("203.0.113.7".into(), "203.0.113.7".into())
        );
    }
}
