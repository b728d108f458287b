//! Where decisions are made and state is kept.
//!
//! A [`Store`] makes one atomic decision per request. [`MemoryStore`] keeps state in this
//! process; [`RedisStore`] (feature `redis`) keeps it in Redis so that every instance of a
//! service shares one limit.

use std::future::Future;
use std::task::{Context, Poll, Waker};
use std::time::SystemTime;

use tracing::Instrument;

use crate::{Decision, Key, Policy, Settlement};

/// What [`Store::limits_version`] answers while the store cannot vouch for its limits.
pub(crate) const UNCONFIRMED_LIMITS: u64 = u64::MAX;

pub(crate) mod line;
pub(crate) mod memory;
pub(crate) mod override_table;
pub(crate) mod overrides;
pub(crate) mod owner;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod reserve;

pub use crate::concurrency::Waiter;
pub use crate::decision::{SlotId, Units};
pub use memory::{Clock, ManualClock, MemoryStore, MemoryStoreBuilder, TokioClock};
pub use overrides::{Override, OverrideError, OverridePages, Overrides, Scope};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::{Leases, RedisStore, RedisStoreBuilder};
pub use reserve::{InLine, Reserve, Ticket, MAX_LATE};

/// Decides whether a request fits a policy, and records it if it does, in one atomic step.
///
/// Implementations take the time from their own clock, never from the caller, so that all
/// instances sharing a store agree on it. The policy's [`Algorithm`](crate::Algorithm)
/// chooses how the decision is made; every store implements every algorithm the same way.
pub trait Store: Clone + Send + Sync + 'static {
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
    /// would hold at most its count. Only [`Algorithm::SlidingLog`](crate::Algorithm) keeps
    /// event times; other algorithms answer [`StoreError::Unsupported`]. State older than the
    /// policy's longest window before now is not kept, so times further in the past are
    /// decided against what is left.
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

    /// Settles as [`settle`](Store::settle) does, for a caller that does not wait: `then` runs
    /// with the outcome once the store has answered. The layer settles a usage charge or
    /// refund, or gives back or renews a concurrency slot, this way after the response it
    /// follows has gone, unless [`settle_now`](Store::settle_now) settled it in place.
    ///
    /// By default the settle runs at once when its future is ready on the first poll, and
    /// otherwise in a task of its own on the current tokio runtime;
    /// with no runtime, a store that is not [local](Store::is_local) answers
    /// [`StoreError::Config`]. A store may do better: a [`RedisStore`] sends a slot's give-back
    /// or renewal with its next batched call, with no task of its own. A store that drops
    /// `then` without calling it (its task was dropped as its runtime shut down) leaves the
    /// outcome unknown, and the layer reports the settle as abandoned.
    fn settle_then(&self, key: &Key, policy: &Policy, settlement: Settlement, then: OnSettled) {
        settle_in_task(self, key, policy, settlement, then);
    }

    /// The outcome of [`settle`](Store::settle), when the store can settle without waiting;
    /// `None` (the default) when it must wait. The layer then settles right where the
    /// response ends, with nothing to keep for later.
    fn settle_now(
        &self,
        key: &Key,
        policy: &Policy,
        settlement: Settlement,
    ) -> Option<Result<(), StoreError>> {
        let _ = (key, policy, settlement);
        None
    }

    /// Decides as [`check`](Store::check) does, for a request that waits for a concurrency
    /// slot ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)) as `waiter`: the layer asks
    /// this way first and each time the request asks again. A store that keeps a line of
    /// waiters refuses the request while the key's live slots and the waiters ahead of it leave
    /// no slot for it, and puts it in line at its deadline when it refuses it first, so that
    /// slots go to the waiters of every instance in turn; the built-in stores do, in the
    /// key's set of slots. By default the store keeps no line and decides as `check`: waiters
    /// are then served in no set order across instances.
    fn check_in_line(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        waiter: &Waiter,
    ) -> Self::Future {
        let _ = waiter;
        self.check(key, policy, cost)
    }

    /// Takes `waiter` out of `key`'s line under `policy`: it stopped waiting without a slot
    /// (its wait ran out, its client went away, or a rate limit refused it). A waiter left in
    /// line would hold a slot free for itself until its deadline. Nothing by default.
    fn leave_line(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        let _ = (key, policy, waiter);
    }

    /// The decision of [`check`](Store::check), when the store can make it without waiting;
    /// `None` (the default) when it must wait, for I/O for example. The layer then calls the
    /// inner service at once rather than from its response future.
    fn check_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        let _ = (key, policy, cost);
        None
    }

    /// Whether this store can decide `policy`; the layer's builder asks for each policy and
    /// fails with [`BuildError::Unsupported`](crate::BuildError::Unsupported) if not. By
    /// default every policy that is in range ([`Policy::out_of_range`]); a [`RedisStore`]
    /// with leases also refuses a GCRA policy whose lease headroom would leave a bucket less
    /// than one unit.
    fn supports(&self, policy: &Policy) -> Result<(), StoreError> {
        in_range(policy)
    }

    /// A number that changes whenever the limits this store decides by may have changed: an
    /// override set or removed ([`Overrides`]), here or, for a store shared by a fleet, by
    /// another instance (which a [`RedisStore`] sees within a quarter of a second). The layer's
    /// deny cache neither keeps nor repeats a refusal decided under another number. `0` by
    /// default, for a store whose limits never change. `u64::MAX` says the store cannot vouch
    /// for its limits now (a [`RedisStore`] that could not read its version for half a
    /// second): the deny cache then neither keeps nor repeats any refusal.
    fn limits_version(&self) -> u64 {
        0
    }

    /// The store's overrides, if it keeps any ([`Overrides`]): a layer checks them against
    /// its rules when it is built and each time they are replaced, and logs at `WARN` those
    /// the rules leave without effect (counts set for other windows, see [`Scope`]). `None`
    /// by default.
    fn run_time_overrides(&self) -> Option<Overrides> {
        None
    }

    /// Whether decisions are made in this process, without I/O. The layer's deny cache is off
    /// by default for such a store, where it would only repeat what the store answers as
    /// quickly.
    fn is_local(&self) -> bool {
        false
    }
}

/// What runs with the outcome of a [`Store::settle_then`].
pub type OnSettled = Box<dyn FnOnce(Result<(), StoreError>) + Send + 'static>;

/// [`Store::settle_then`]'s default: the settle at once when its future is ready on the first
/// poll, else in a task of its own, so that the response it follows is never held up.
pub(crate) fn settle_in_task<St: Store>(
    store: &St,
    key: &Key,
    policy: &Policy,
    settlement: Settlement,
    then: OnSettled,
) {
    // A store that does I/O needs a runtime even for its first poll (timers, sockets).
    let runtime = tokio::runtime::Handle::try_current().ok();
    if runtime.is_none() && !store.is_local() {
        return then(Err(no_runtime()));
    }
    // Boxed, so that the future stays where it is when it moves into a task after this poll.
    let mut future = Box::pin(store.settle(key, policy, settlement));
    if let Poll::Ready(outcome) = future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        return then(outcome);
    }
    match runtime {
        Some(runtime) => {
            let settle = async move { then(future.await) };
            runtime.spawn(settle.in_current_span());
        }
        None => then(Err(no_runtime())),
    }
}

fn no_runtime() -> StoreError {
    StoreError::Config("no tokio runtime to settle in".into())
}

/// [`StoreError::Unsupported`] for a policy out of range ([`Policy::out_of_range`]).
pub(crate) fn in_range(policy: &Policy) -> Result<(), StoreError> {
    match policy.out_of_range() {
        Some(why) => Err(StoreError::Unsupported(why)),
        None => Ok(()),
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
    #[error("redis: {0}")]
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
    /// A concurrency slot to renew ([`Settlement::renew`]) is no longer held: it expired
    /// unrenewed, was given back, or the store lost it. Its request runs on uncounted.
    #[error("the concurrency slot is no longer held")]
    SlotGone,
}
