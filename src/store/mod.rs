//! Where decisions are made and state is kept.
//!
//! A [`Store`] makes one atomic decision per request. [`MemoryStore`] keeps state in this
//! process; [`RedisStore`] (feature `redis`) keeps it in Redis so that every instance of a
//! service shares one limit.

use std::future::Future;
use std::time::SystemTime;

use crate::{Decision, Key, Policy, Settlement};

/// What [`Store::limits_version`] answers while the store cannot vouch for its limits.
pub(crate) const UNCONFIRMED_LIMITS: u64 = u64::MAX;

pub(crate) mod claims;
pub(crate) mod engine;
pub(crate) mod memory;
pub(crate) mod override_table;
pub(crate) mod overrides;
pub(crate) mod owner;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod reserve;

pub use memory::{Clock, ManualClock, MemoryStore, MemoryStoreBuilder, TokioClock};
pub use overrides::{Override, OverrideError, Overrides, Scope};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::{Leases, RedisStore, RedisStoreBuilder};

/// Decides whether a request fits a policy, and records it if it does, in one atomic step.
///
/// Implementations take the time from their own clock, never from the caller, so that all
/// instances sharing a store agree on it. The policy's [`Algorithm`](crate::Algorithm)
/// chooses how the decision is made; every store implements every algorithm the same way.
///
/// **Sealed.** The two stores of this crate, [`MemoryStore`] and [`RedisStore`], are its only
/// implementations: beside these methods, the layer asks a store things that are not part of
/// the API (a decision without waiting, a line of waiters for concurrency slots, settlements
/// that need no task, reservations for outbound calls, the version of its limits), and those
/// change as the crate does. Tests that need a store that fails on demand, or that answers
/// like a remote one, have `test_util::FaultyStore` (feature `test-util`).
pub trait Store: Clone + Send + Sync + 'static + engine::Engine + reserve::Reserve {
    /// The future of one decision.
    type Future: Future<Output = Result<Decision, StoreError>> + Send + 'static;
    /// The future of a [`reset`](Store::reset) or a [`settle`](Store::settle).
    type ResetFuture: Future<Output = Result<(), StoreError>> + Send + 'static;

    /// Decides a request of `cost` units (usually 1) for `key` under `policy`, now.
    ///
    /// Admitted requests are recorded against every limit of the policy; denied ones are not
    /// recorded at all.
    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future;

    /// Decides an event at time `at` (past or future, in any order), for scheduled work such
    /// as "send this push at 11:11:11, at most 1 per minute, 5 per hour and 10 per day".
    ///
    /// The event is admitted, and recorded, if every window of every limit that contains `at`
    /// would hold at most its count, counting every event the key holds, before and after
    /// `at`. Only [`Algorithm::SlidingLog`](crate::Algorithm) keeps event times; other
    /// algorithms answer [`StoreError::Unsupported`]. A time up to the policy's longest window
    /// before now is decided against the log as it was (the log keeps events twice that
    /// long); one further back answers [`StoreError::EventTooOld`]. On a
    /// [`RedisStore`] with leases, whose decisions read each window longer by its headroom
    /// `h` (`docs/leases.md`), the bound is that window less `h`, so that the longer windows
    /// around the time read only events a store without leases sharing the key keeps too
    /// (none at all in the past where `h` is the whole window).
    ///
    /// A refusal's [`retry_after`](Decision::retry_after) counts from `at`, not from now: the
    /// event moved that much later fits ([`Decision::retry_at`] is that instant). An event
    /// time is decided by the limits alone: a key in the policy's penalty box
    /// ([`Policy::block_for`]) is not refused for it, and a refused event sets no box, which
    /// is the requests' of now.
    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future;

    /// The decision a request of `cost` would get now, without recording anything.
    ///
    /// `remaining` then counts the units left before this request.
    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future;

    /// Forgets everything recorded for `key` under `policy`, its penalty box included. A
    /// layer's deny cache repeats a penalty box's refusal for a second at most before asking
    /// the store again, so a reset frees a boxed key on every instance within a second; other
    /// refusals it repeats until their own retry-after. The concurrency slots of requests in
    /// flight stay: those requests still are.
    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture;

    /// Records what an admitted request actually used, without deciding anything: a
    /// [`Settlement`] made from its [`Decision`] adds units (a charge) or takes some of its
    /// own back (a refund), against every limit of `policy`, in one atomic step (one script
    /// call on Redis).
    ///
    /// A charge of `n` is recorded now even when it takes the key over its limits: settling
    /// never refuses, and later requests are refused until enough usage has aged out (or
    /// drained), which their `retry_after` tells. Per algorithm:
    ///
    /// | algorithm | charge `n` | refund `n` of a request admitted at `a` |
    /// |---|---|---|
    /// | [`Gcra`](crate::Algorithm::Gcra) | `TAT = max(TAT, now) + n·T` | `TAT = max(TAT − max(n·T − (now − a), 0), now)`: what has drained since `a` is not taken twice |
    /// | [`FixedWindow`](crate::Algorithm::FixedWindow) | `n` more in the current window | `n` less (not below 0) in the admission's window, if it is still the current one |
    /// | [`SlidingWindow`](crate::Algorithm::SlidingWindow) | `n` more in the current window | `n` less (not below 0) in the admission's window, if it is the current or the previous one |
    /// | [`SlidingLog`](crate::Algorithm::SlidingLog) | one event of weight `n` now | the request's own event (of its admission time and weight) weighs up to `n` less, and goes when it weighs nothing; nothing once it has aged out |
    ///
    /// A refund never takes back more than the request recorded
    /// ([`Settlement::refund`] caps it at the decision's cost), so the state afterwards is at
    /// least what it would be had the request cost less from the start. It applies only to
    /// the state the request was recorded in: state created after the admission (a
    /// [`reset`](Store::reset), an expiry, a Redis restart) never held its units, and is left
    /// alone. Where the admission time is not known, a refund changes nothing. A charge past
    /// what a state holds saturates (`docs/operations.md`, "Range"). A settle that cannot
    /// reach the store fails as a decision would; it never panics.
    fn settle(&self, key: &Key, policy: &Policy, settlement: Settlement) -> Self::ResetFuture;
}

/// [`StoreError::Unsupported`] for a policy out of range ([`Policy::out_of_range`]).
pub(crate) fn in_range(policy: &Policy) -> Result<(), StoreError> {
    match policy.out_of_range() {
        Some(why) => Err(StoreError::Unsupported(why)),
        None => Ok(()),
    }
}

/// Whether event time `at` is in the range every store decides exactly: before 2^53 µs after
/// the epoch (the year 2255), where the scripts' doubles hold every microsecond
/// (`docs/operations.md`, "Range").
pub(crate) fn event_in_range(at: std::time::SystemTime) -> Result<(), StoreError> {
    let micros = at
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_micros());
    match micros < 1 << 53 {
        true => Ok(()),
        false => Err(StoreError::Unsupported("event times after the year 2255")),
    }
}

/// A store could not decide.
///
/// The layer then follows its [`FailureMode`](crate::FailureMode).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Redis answered with an error, timed out, or could not be reached.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error("redis failed")]
    Redis(#[from] fred::error::Error),
    /// The decision took longer than the store's time budget.
    #[error("no decision within {0:?}")]
    Timeout(std::time::Duration),
    /// The store was found unreachable moments ago; decisions fail at once until it is tried
    /// again.
    #[error("store unavailable")]
    Unavailable,
    /// The store answered something this crate does not understand.
    #[error("unexpected store reply: {0}")]
    Reply(String),
    /// The store was configured wrongly (e.g. a bad URL or key prefix).
    #[error("store configuration: {0}")]
    Config(String),
    /// The operation does not apply to the policy's algorithm.
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    /// An event time ([`Store::check_at`]) further back than the policy's longest window
    /// before the store's now (less a leasing store's headroom): the sliding log keeps what
    /// the windows around times up to that far back need, and no more, so an older time could
    /// not be decided exactly.
    #[error("event time further back than the policy's longest window")]
    EventTooOld,
    /// A concurrency slot to renew is no longer held: it expired
    /// unrenewed, was given back, or the store lost it. Its request runs on uncounted.
    #[error("the concurrency slot is no longer held")]
    SlotGone,
}
