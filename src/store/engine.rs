//! What the layer, its ledger and the outbound client ask of a store beyond [`Store`]'s public
//! methods: decisions made without waiting, settlements that need no task, a queue of waiters
//! for concurrency slots, the version of the limits in force. Reservations of turns are
//! `reserve.rs`'s.
//!
//! [`Engine`] is a supertrait of `Store`, unnameable outside the crate (this module is
//! private), and [`Sealed`] makes sure only this crate implements it: the hooks change with
//! the engine, so they are no promise to code outside it. `docs/architecture.md` ("The store
//! seam") says why the seam is sealed rather than open.

use std::future::Future;
use std::task::{Context, Poll, Waker};

use tracing::Instrument;

use super::claims::Claims;
use super::{Overrides, Store, StoreError};
use crate::model::slots::Waiter;
use crate::{Decision, Key, Policy, Settlement};

/// Implemented by this crate's stores alone, so that no other type implements [`Engine`] (and
/// so [`Store`]).
pub trait Sealed {}

/// A store's hooks for the engine. Each has a default that does without (a store that keeps
/// no queue of waiters, no overrides and no local decisions), except the step decisions
/// ([`step`](Engine::step), [`step_now`](Engine::step_now)), which every store must make as
/// its own: a `check` in their place would box keys and take slots.
pub trait Engine: Sealed {
    /// Decides and records a step of a metered body: `units` more of a request already
    /// admitted, by the limits in force for `key` (overrides, plans) alone, now. No penalty
    /// box refuses a step or is set by its refusal, a step takes no concurrency slot and is no
    /// attempt: the request it belongs to met those at its admission. An admitted step is
    /// recorded as an admission of `units` is, so that its unused part can be refunded
    /// ([`Settlement::refund`]).
    fn step(&self, key: &Key, policy: &Policy, units: u32) -> <Self as Store>::Future
    where
        Self: Store;

    /// The decision of [`step`](Engine::step), when the store can make it without waiting;
    /// `None` when it must wait.
    fn step_now(
        &self,
        key: &Key,
        policy: &Policy,
        units: u32,
    ) -> Option<Result<Decision, StoreError>>;

    /// Settles as [`settle`](crate::Store::settle) does, for a caller that does not wait: `then` runs
    /// with the outcome once the store has answered. The layer settles a usage charge or
    /// refund, or gives back or renews a concurrency slot, this way after the response it
    /// follows has gone, unless [`settle_now`](Engine::settle_now) settled it in place.
    ///
    /// By default the settle runs at once when its future is ready on the first poll, and
    /// otherwise in a task of its own on the current tokio runtime;
    /// with no runtime, a store that is not [local](Engine::is_local) answers
    /// [`StoreError::Config`]. A store may do better: a [`RedisStore`](crate::RedisStore) sends a slot's give-back
    /// or renewal with its next batched call, with no task of its own. A store that drops
    /// `then` without calling it (its task was dropped as its runtime shut down) leaves the
    /// outcome unknown, and the layer reports the settle as abandoned.
    fn settle_then(&self, key: &Key, policy: &Policy, settlement: Settlement, then: OnSettled)
    where
        Self: Store,
    {
        settle_in_task(self, key, policy, settlement, then);
    }

    /// The outcome of [`settle`](crate::Store::settle), when the store can settle without waiting;
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

    /// Decides as [`check`](crate::Store::check) does, for a request that waits for a concurrency
    /// slot ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)) as `waiter`: the layer asks
    /// this way first and each time the request asks again. A store that keeps a queue of
    /// waiters refuses the request while the key's live slots and the waiters ahead of it leave
    /// no slot for it, and puts it in its queue at its deadline when it refuses it first, so that
    /// slots go to the waiters of every instance in turn; the built-in stores do, in the
    /// key's set of slots. By default the store keeps no queue and decides as `check`: waiters
    /// are then served in no set order across instances.
    fn check_queued(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        waiter: &Waiter,
    ) -> <Self as Store>::Future
    where
        Self: Store,
    {
        let _ = waiter;
        self.check(key, policy, cost)
    }

    /// Takes `waiter` out of `key`'s queue under `policy`: it stopped waiting without a slot
    /// (its wait ran out, its client went away, or a rate limit refused it). A waiter left in
    /// the queue would hold a slot free for itself until its deadline. Nothing by default.
    fn leave_queue(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        let _ = (key, policy, waiter);
    }

    /// The decision of [`check`](crate::Store::check), when the store can make it without waiting;
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
    /// default every policy that is in range (`Policy::out_of_range`); a [`RedisStore`](crate::RedisStore)
    /// with leases also refuses a GCRA policy whose lease headroom would leave a bucket less
    /// than one unit.
    fn supports(&self, policy: &Policy) -> Result<(), StoreError> {
        super::in_range(policy)
    }

    /// A number that changes whenever the limits this store decides by may have changed: an
    /// override set or removed ([`Overrides`]), here or, for a store shared by a fleet, by
    /// another instance (which a [`RedisStore`](crate::RedisStore) sees within a quarter of a second). The layer's
    /// deny cache neither keeps nor repeats a refusal decided under another number. `0` by
    /// default, for a store whose limits never change. `u64::MAX` says the store cannot vouch
    /// for its limits now (a [`RedisStore`](crate::RedisStore) that could not read its version for half a
    /// second): the deny cache then neither keeps nor repeats any refusal.
    fn limits_version(&self) -> u64 {
        0
    }

    /// The store's overrides, if it keeps any ([`Overrides`]): a layer checks them against
    /// its rules when it is built and each time they are replaced, and logs at `WARN` those
    /// the rules leave without effect (counts set for other windows, see [`Scope`](crate::store::Scope)). `None`
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

    /// The store's registry of the unnamed policies its live layers use (`claims.rs`): a
    /// layer whose unnamed policy another live layer on the store uses fails to build. `None`
    /// (the default) for a store without one.
    fn claims(&self) -> Option<Claims> {
        None
    }
}

/// What runs with the outcome of an [`Engine::settle_then`].
pub type OnSettled = Box<dyn FnOnce(Result<(), StoreError>) + Send + 'static>;

/// [`Engine::settle_then`]'s default: the settle at once when its future is ready on the first
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
