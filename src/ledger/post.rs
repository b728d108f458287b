//! Posting to the store what a request owes once its response is done: a usage charge or
//! refund, or a concurrency slot's give-back or renewal. Each is an [`Posting`], handed to the
//! layer's [`Ledger`] (its store, or the fallback store that admitted the request), which
//! settles it in place when the store needs no waiting ([`Store::settle_now`]), and otherwise
//! through [`Store::settle_then`] without holding up the response, counted in [`InFlight`]
//! until the store has answered (for `RateLimitLayer::settled`); a failure is logged and
//! counted.
//!
//! A metered body also decides through its [`Ledger`]: each step ([`Ledger::step`]), and at a
//! cut what the whole body would need ([`Ledger::peek`]), answered in place where the store
//! needs no waiting ([`Stepping::Now`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::deny_cache::DenyCache;
use crate::metrics::Report;
use crate::response::Responder;
use crate::settlement::Owed;
use crate::{Decision, Key, Policy, Settlement, Store, StoreError};

/// Settles with a store of a type the layer's response body does not name, and decides a
/// metered body's steps with it.
pub(crate) trait Ledger: Send + Sync {
    /// Starts `posting`, counted in `in_flight` until it has finished; reports its failure.
    fn settle(&self, posting: Posting, in_flight: &Arc<InFlight>);

    /// Decides and records a step of `units` of a metered body for `key` under `policy`
    /// (`Engine::step`): by the limits alone, no penalty box, no slot, no attempt.
    fn step(&self, key: &Key, policy: &Policy, units: u32) -> Stepping;

    /// What a decision of `units` would answer now, recording nothing (`Store::peek`): at a
    /// cut, whether and when the whole body would fit.
    fn peek(&self, key: &Key, policy: &Policy, units: u32) -> Stepping;
}

/// A decision a metered body asked its [`Ledger`] for: made in place, or to wait for.
pub(crate) enum Stepping {
    /// Made without waiting (the memory store, a Redis lease): no allocation.
    Now(Result<Decision, StoreError>),
    /// To be polled (from the body's `poll_frame`, with its caller's waker).
    Later(Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>),
}

/// A [`Ledger`] over a store.
pub(crate) struct StoreLedger<St>(pub(crate) St);

impl<St: Store> Ledger for StoreLedger<St> {
    fn settle(&self, posting: Posting, in_flight: &Arc<InFlight>) {
        // A store that settles without waiting (the memory store) does it here, with nothing
        // to keep or count.
        let (key, policy) = (&posting.key, &posting.responder.policy);
        if let Some(outcome) = self.0.settle_now(key, policy, posting.settlement) {
            return posting.finish(outcome);
        }
        let (key, responder, settlement) = (
            posting.key.clone(),
            Arc::clone(&posting.responder),
            posting.settlement,
        );
        let settling = Settling::start(posting, Arc::clone(in_flight));
        let then = Box::new(move |outcome| settling.finish(outcome));
        self.0
            .settle_then(&key, &responder.policy, settlement, then);
    }

    fn step(&self, key: &Key, policy: &Policy, units: u32) -> Stepping {
        match self.0.step_now(key, policy, units) {
            Some(decided) => Stepping::Now(decided),
            None => Stepping::Later(Box::pin(self.0.step(key, policy, units))),
        }
    }

    fn peek(&self, key: &Key, policy: &Policy, units: u32) -> Stepping {
        // No `peek_now` hook: a cut is rare, and one allocation there is nothing.
        Stepping::Later(Box::pin(self.0.peek(key, policy, units)))
    }
}

/// What a slot's holder does when a renewal finds the slot gone, or once a give-back has
/// landed.
pub(crate) type OnGone = Box<dyn FnOnce() + Send>;

/// One settle: what it is about, and the deny cache a refund makes stale.
pub(crate) struct Posting {
    key: Key,
    responder: Arc<Responder>,
    settlement: Settlement,
    /// A refund's deny cache, whose refusals of the key are forgotten when the refund is sent
    /// and again when it has landed: a refusal the store decided before the refund applied may
    /// have been cached in between.
    deny_cache: Option<DenyCache>,
    /// What hears that a concurrency slot to renew is gone from the store.
    on_gone: Option<OnGone>,
    /// What runs once the store has answered, however it did.
    then: Option<OnGone>,
}

impl Posting {
    /// A settle of `settlement` for `key` under the responder's policy; a refund's
    /// `deny_cache` forgets its refusals of the key when the refund is sent and again when it
    /// has landed.
    pub(crate) fn new(
        key: Key,
        responder: Arc<Responder>,
        settlement: Settlement,
        deny_cache: Option<DenyCache>,
    ) -> Posting {
        if let Some(cache) = &deny_cache {
            cache.forget(&key, &responder.policy);
        }
        Posting {
            key,
            responder,
            settlement,
            deny_cache,
            on_gone: None,
            then: None,
        }
    }

    /// The same settle, and `then` once the store has answered (at once where it settles in
    /// place): a slot's give-back wakes the first request waiting for one of the key then, so
    /// that its ask does not reach the store before the slot is free there.
    pub(crate) fn then(self, then: OnGone) -> Posting {
        Posting {
            then: Some(then),
            ..self
        }
    }

    /// A concurrency slot's renewal: `on_gone` runs, instead of a failure being reported,
    /// when the store no longer holds the slot.
    pub(crate) fn renewal(
        key: Key,
        responder: Arc<Responder>,
        settlement: Settlement,
        on_gone: OnGone,
    ) -> Posting {
        Posting {
            on_gone: Some(on_gone),
            ..Posting::new(key, responder, settlement, None)
        }
    }

    /// What follows a settle's outcome: the deny cache forgets the key after a refund (one
    /// that failed made no room, but forgetting costs only a store call), and a failure is
    /// logged and counted.
    fn finish(mut self, outcome: Result<(), StoreError>) {
        if let Some(then) = self.then.take() {
            then();
        }
        if let Some(cache) = &self.deny_cache {
            cache.forget(&self.key, &self.responder.policy);
        }
        if let (Err(StoreError::SlotGone), Some(on_gone)) = (&outcome, self.on_gone) {
            // Not a failure of the store: the holder tells a slot lost from one given back.
            return on_gone();
        }
        if let Err(error) = outcome {
            Report::settle_error(&self.responder.policy);
            let what = match self.settlement.owed {
                Owed::Release(..) => "give back a request's concurrency slot",
                Owed::Renew(_) => "renew a request's concurrency slot",
                Owed::Charge(_) | Owed::Refund(_) => "settle a request's usage",
            };
            tracing::warn!(
                target: "tower_redis_ratelimit",
                policy = self.responder.policy.name(),
                key = %self.key.loggable(),
                error = %crate::chain::Chain(&error),
                "rate-limit store failed to {what}"
            );
        }
    }
}

/// A settle under way in a task: counted in [`InFlight`] until it finishes, or until its task
/// is dropped without finishing (the runtime shut down), which is reported as a failure.
struct Settling {
    posting: Option<Posting>,
    in_flight: Arc<InFlight>,
}

impl Settling {
    fn start(posting: Posting, in_flight: Arc<InFlight>) -> Self {
        in_flight.count.fetch_add(1, Ordering::AcqRel);
        Settling {
            posting: Some(posting),
            in_flight,
        }
    }

    fn finish(mut self, outcome: Result<(), StoreError>) {
        if let Some(posting) = self.posting.take() {
            posting.finish(outcome);
        }
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        if let Some(posting) = self.posting.take() {
            // The task was dropped before the store answered: the settle may or may not have
            // reached it, and nobody will know which. Counted, so that it is not lost silently.
            Report::settle_error(&posting.responder.policy);
            tracing::warn!(
                target: "tower_redis_ratelimit",
                policy = posting.responder.policy.name(),
                key = %posting.key.loggable(),
                "a settle of a request's usage was abandoned (its runtime shut down) before \
                 the store answered; it may or may not have been recorded"
            );
        }
        // After the outcome is reported, so that a waiter sees its effects.
        if self.in_flight.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.in_flight.idle.notify_waiters();
        }
    }
}

/// The settles of a layer (and its clones) under way in tasks, for
/// [`RateLimitLayer::settled`](crate::RateLimitLayer::settled).
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    count: AtomicUsize,
    /// Notified when the count falls to zero.
    idle: Notify,
}

impl InFlight {
    /// Waits up to `timeout` until no settle is under way; the number still under way then.
    pub(crate) async fn settled(&self, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Registered before the count is read, so that a fall to zero in between wakes it.
            let idle = self.idle.notified();
            let mut idle = std::pin::pin!(idle);
            idle.as_mut().enable();
            let count = self.count.load(Ordering::Acquire);
            if count == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.count.load(Ordering::Acquire);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::engine::Engine;
    use crate::MemoryStore;

    #[tokio::test]
    async fn a_step_is_decided_in_place_on_a_local_store_and_a_peek_records_nothing() {
        let ledger = StoreLedger(MemoryStore::new());
        let (key, policy) = (Key::from("ann"), "100/1h".parse::<Policy>().unwrap());
        let Stepping::Now(Ok(step)) = ledger.step(&key, &policy, 60) else {
            panic!("a memory store's step waited or failed");
        };
        assert!(step.is_allowed());
        let Stepping::Later(peek) = ledger.peek(&key, &policy, 60) else {
            panic!("a peek is polled");
        };
        let peek = peek.await.unwrap();
        assert!(!peek.is_allowed(), "60 more do not fit in 40");
        let Stepping::Now(Ok(fits)) = ledger.step(&key, &policy, 40) else {
            panic!("a memory store's step waited or failed");
        };
        assert!(fits.is_allowed(), "the peek recorded something");
    }

    #[test]
    fn a_step_is_no_attempt_where_requests_count_by_outcome() {
        let ledger = StoreLedger(MemoryStore::new());
        let key = Key::from("ann");
        let policy = "10/1h".parse::<Policy>().unwrap().counting_attempts();
        let request = ledger.0.check_now(&key, &policy, 1).unwrap().unwrap();
        assert_ne!(request.attempt, 0, "a request is an attempt");
        let Stepping::Now(Ok(step)) = ledger.step(&key, &policy, 5) else {
            panic!("a memory store's step waited or failed");
        };
        assert!(step.is_allowed());
        assert_eq!(step.attempt, 0, "a step was counted as an attempt");
    }
}
