//! The responses and header fields the layer writes.
//!
//! Header syntax follows draft-ietf-httpapi-ratelimit-headers-10:
//!
//! ```text
//! RateLimit-Policy: "default";q=5;w=10
//! RateLimit: "default";r=0;t=7
//! Retry-After: 7
//! ```
//!
//! Each layer adds its own members after those of layers further in, so that stacked layers
//! (per route and site-wide, per API key and per IP) each show their policy; a refusal by a
//! layer further in keeps its member, with `r=0`.
//!
//! `RateLimit-Policy` lists every limit of the policy (a multi-limit policy names each limit
//! `<policy>-<window>`, e.g. `"api-1h"`; a concurrency limit comes last, as
//! `"api-concurrency";q=2;qu="concurrent-requests"`; the limits of a layer that meters
//! request bodies carry `qu="content-bytes"`), with the counts of the request's plan, or only the
//! limit of the decision, at the count it was decided by, when an override in the store
//! changed it (see [`store::Overrides`](crate::store::Overrides)); `RateLimit` describes the limit of the
//! [`Decision`](crate::Decision): the one that refused, or the tightest after admitting.
//! Seconds are rounded up, so `Retry-After` is never 0 while a client is refused, and a
//! refusal's `t` is never less than its `Retry-After`.
//!
//! gRPC requests (`content-type: application/grpc*`, any case) are answered the gRPC way, in
//! their own content type: HTTP 200 with no body and the status in `grpc-status` (8 `RESOURCE_EXHAUSTED` for a refusal, 14
//! `UNAVAILABLE`, 13 `INTERNAL`, 3 `INVALID_ARGUMENT` for the other answers), a `grpc-message`,
//! and the delay in `retry-after` (seconds) and `grpc-retry-pushback-ms` (milliseconds, or
//! `-1` when no wait helps), the metadata gRPC clients read for retry throttling.
//!
//! The module holds one role per file: the layer's choices and the state its responses share
//! (`responder`), the rate-limit header fields (`fields`), and the layer's own answers, HTTP
//! and gRPC, with the [`Refused`] marker and [`answer`], which gives a handler that decides
//! with a store itself the same answer (`refusal`). Each file uses only those before it in
//! that order.

mod fields;
mod refusal;
mod responder;

pub use fields::{RATELIMIT, RATELIMIT_POLICY};
pub use refusal::{answer, Refused};

pub(crate) use refusal::grpc_content_type;
pub(crate) use responder::{Options, Responder, Tally, Unit};

/// What the layer does when a request yields no key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer at once, without calling the service: `500 Internal Server Error` when the peer
    /// address is missing (a server set-up fault; the body says how to fix it), `400 Bad
    /// Request` when the request itself lacks the key (e.g. an absent API-key header).
    #[default]
    Reject,
    /// Call the service without limiting the request.
    Allow,
    /// Count the request under this one shared key.
    Use(crate::Key),
}

/// What the layer does when the store cannot decide (Redis unreachable or too slow).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum FailureMode {
    /// Admit the request: the limiter never becomes the outage. A concurrency limit
    /// ([`Policy::concurrency`](crate::Policy::concurrency)) still holds on each instance
    /// alone: a request is admitted while the layer holds fewer than the cap of the key's
    /// slots, and otherwise refused for a slot (or left waiting, with
    /// [`max_wait`](crate::RateLimitLayerBuilder::max_wait)).
    #[default]
    Open,
    /// Refuse with `503 Service Unavailable` and `Retry-After: 1`.
    Closed,
    /// Decide with this local store while the main one is unavailable: every instance then
    /// limits on its own, within two bounds.
    ///
    /// - A key this instance last saw refused, by its limits or its penalty box
    ///   ([`Policy::block_for`](crate::Policy::block_for)), stays refused here until the
    ///   `Retry-After` it was given (for requests that cost at least as much; any request
    ///   while boxed), and a key it last saw admitted with nothing left of a limit stays
    ///   refused until that limit's [`reset_after`](crate::Decision::reset_after), the `t` of
    ///   the `RateLimit` field it was given (for GCRA, when its bucket has drained, up to a
    ///   window; for the sliding window counter, when both counted windows have, up to two:
    ///   later than Redis would let one more in; not on a layer that settles usage, counts
    ///   by outcome or meters request bodies, where an admission's units may come back): the local store is not asked,
    ///   and the refusal tells what is left of that time, never 0 and never early.
    /// - Any other key (one this instance has not seen refused or spent, or whose time has
    ///   passed) is decided by the local store, which has seen nothing of it: a client may get
    ///   up to one budget per instance until Redis is back, on top of what Redis recorded.
    ///
    /// The layer remembers the last 100 000 (policy, key)s its store refused or spent, the
    /// least recently seen forgotten first, each until its time has passed; a key the store
    /// admits again with units left is forgotten at once. Nothing of it is shared between
    /// instances.
    Fallback(crate::MemoryStore),
}
