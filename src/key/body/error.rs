//! [`InnerError`]: the error of a body field service, its inner service's passed on.

use std::convert::Infallible;
use std::fmt;

/// The error of a [`BodyFieldService`](super::BodyFieldService): its inner service's error, passed on unchanged.
///
/// The layer answers every problem of its own (a body too large, a field missing) with a
/// response, so its only errors are the inner service's. They come wrapped for axum's sake.
/// `MethodRouter::layer` asks of a layer's service only that its error converts into the
/// route's next error type, `NewError`, which rustc infers. In
/// `post(login).layer(limit).layer(read)` the type between the two layers is known by two
/// conversions alone: `limit`'s error (`Infallible`) converts into it, and `read`'s error
/// converts into `Infallible`, which `Router::route` asks for. Were `read`'s error that type
/// itself, every type with a `From<Infallible>` would do, and rustc stops with E0283, "cannot
/// infer type of the type parameter `NewError`". `InnerError<E>` converts into `Infallible`
/// only where `E` is `Infallible` (and then no `InnerError` can exist), so the type in between
/// is `Infallible` and the line compiles.
///
/// Everywhere else it is an error as any other: it displays as the inner error does, is a
/// [`std::error::Error`], and so converts into a `Box<dyn Error + Send + Sync>` (hyper, tower's
/// `BoxError`).
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_redis_ratelimit::{BodyFieldLayer, RateLimitLayer};
///
/// async fn login() -> &'static str {
///     "welcome"
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let read = BodyFieldLayer::builder("username").build()?;
/// let limit = RateLimitLayer::builder()
///     .policy("3/1m")
///     .key(read.key())
///     .build()?;
/// let app: Router = Router::new().route("/login", post(login).layer(limit).layer(read));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InnerError<E>(pub(super) E);

impl<E: fmt::Display> fmt::Display for InnerError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for InnerError<E> {}

/// An infallible inner service fails with nothing: what axum's routes and `Router::layer`
/// ask of a layer's error.
impl From<InnerError<Infallible>> for Infallible {
    fn from(error: InnerError<Infallible>) -> Self {
        match error.0 {}
    }
}
