//! Request bodies metered as they stream
//! ([`RateLimitLayerBuilder::request_bytes`](crate::RateLimitLayerBuilder::request_bytes)):
//! the layer's unit becomes bytes of request body, and the handler's body, a [`MeteredBody`],
//! passes on only the bytes the store admitted.
//!
//! A request is admitted for its declared length (`Content-Length`, else the body's exact
//! size hint), reserved whole; a body that declares none is admitted for one step, and asks
//! the store for another step (by the limits alone: it neither boxes the key nor takes a
//! concurrency slot) each time its frames have used what was admitted; a refused step is asked
//! again for what is left, so that a body near the quota gets all of it. Once nothing is left
//! the body is cut: it is read on, passing nothing more, to its end or until it has proved
//! larger than the count, so that the answer is about the whole body; the handler's next poll
//! gets a [`QuotaExceeded`](crate::usage::QuotaExceeded) error, and the response the handler
//! makes of it is replaced by the layer's answer: `413 Content Too Large` when the upload can
//! never fit, `429` with a `Retry-After` after which all of it is admitted when a wait helps,
//! `503` when the store failed and the layer fails closed. What was admitted and
//! not used (at most one step, or what a declared length reserved beyond the body) is refunded
//! when the body ends or is dropped.
//!
//! The module holds one role per file: the settings and the type state here; what one
//! request's metering shares with its response future, and its credit (`flow`); the body
//! (`body`).

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::Request;

mod body;
mod flow;

pub use body::MeteredBody;

/// A metered body's error: its inner body's, or a cut's ([`QuotaExceeded`](crate::usage::QuotaExceeded)).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub(crate) use flow::{Flow, Meter, Opening, Steps};

/// How a layer meters request bodies, given to
/// [`RateLimitLayerBuilder::request_bytes`](crate::RateLimitLayerBuilder::request_bytes).
///
/// ```
/// use tower_redis_ratelimit::{metered::RequestBytes, RateLimitLayer};
///
/// // 100 MB of uploads an hour per client address, decided 256 KiB at a time.
/// let layer = RateLimitLayer::builder()
///     .policy("100000000/1h")
///     .request_bytes(RequestBytes::new().step(256 * 1024))
///     .build();
/// assert!(layer.is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestBytes {
    pub(crate) step: u32,
}

impl RequestBytes {
    /// The bytes one store decision admits while a body streams, unless told otherwise.
    pub const DEFAULT_STEP: u32 = 64 * 1024;

    /// Steps of [`DEFAULT_STEP`](Self::DEFAULT_STEP) bytes.
    pub fn new() -> Self {
        RequestBytes {
            step: Self::DEFAULT_STEP,
        }
    }

    /// The bytes one store decision admits while a body streams. Larger steps ask the store
    /// less often; a cut body's handler may have been admitted up to one step that it did not
    /// get to read (refunded when the body ends or is dropped). It must be at least 1 and at
    /// most the smallest count of the layer's policies, or
    /// [`build`](crate::RateLimitLayerBuilder::build) says so.
    pub fn step(self, bytes: u32) -> Self {
        RequestBytes { step: bytes }
    }
}

impl Default for RequestBytes {
    fn default() -> Self {
        RequestBytes::new()
    }
}

mod sealed {
    /// Closes [`Bodies`](super::Bodies) to the crate's two type states.
    pub trait Sealed {}
    impl Sealed for super::Whole {}
    impl Sealed for super::Metered {}
}

/// The type state of a layer that passes request bodies on as they are (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct Whole;

/// The type state of a layer that meters request bodies
/// ([`RateLimitLayerBuilder::request_bytes`](crate::RateLimitLayerBuilder::request_bytes)):
/// the inner service gets a [`MeteredBody`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Metered;

/// What a layer passes to the inner service as the body of a request whose body is `B`:
/// `B` itself ([`Whole`]), or a [`MeteredBody<B>`] ([`Metered`]). Sealed.
pub trait Bodies<B>: sealed::Sealed {
    /// The body the inner service gets.
    type Body;

    /// The body's declared length: its `Content-Length`, else its exact size hint.
    #[doc(hidden)]
    fn declared(request: &Request<B>) -> Option<u64>;

    /// Wraps the body, metered by `meter` when the request was decided.
    #[doc(hidden)]
    fn wrap(body: B, meter: Option<Meter>) -> Self::Body;
}

impl<B> Bodies<B> for Whole {
    type Body = B;

    fn declared(_: &Request<B>) -> Option<u64> {
        None
    }

    fn wrap(body: B, _: Option<Meter>) -> B {
        body
    }
}

impl<B> Bodies<B> for Metered
where
    B: http_body::Body<Data = Bytes>,
{
    type Body = MeteredBody<B>;

    fn declared(request: &Request<B>) -> Option<u64> {
        let length = request.headers().get(CONTENT_LENGTH);
        let length = length.and_then(|v| v.to_str().ok()?.trim().parse().ok());
        length.or_else(|| request.body().size_hint().exact())
    }

    fn wrap(body: B, meter: Option<Meter>) -> MeteredBody<B> {
        MeteredBody::new(body, meter)
    }
}
