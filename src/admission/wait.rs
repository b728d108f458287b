//! A request's wait for a concurrency slot
//! ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)): until its deadline, as a waiter in
//! the store's queue for its key (`Engine::check_queued`), behind those of this instance that
//! come before it there, asking the store again when it is first; leaving the store's queue
//! when it stops waiting without a slot.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::query::Query;
use crate::ledger::queue::{InQueue, Wait};
use crate::model::slots::Waiter;
use crate::{Decision, Key, Policy, Store, StoreError};

/// The store's queue of a key's waiters, as a waiting request asks it: again for a slot, or
/// to take it out.
pub(crate) trait SlotQueue<F>: Send + Sync {
    /// Decides the request (`Engine::check_queued`).
    fn ask(&self, key: &Key, policy: &Policy, cost: u32, waiter: &Waiter) -> F;
    /// Takes it out of the key's queue (`Engine::leave_queue`).
    fn leave(&self, key: &Key, policy: &Policy, waiter: &Waiter);
}

impl<St: Store> SlotQueue<St::Future> for St {
    fn ask(&self, key: &Key, policy: &Policy, cost: u32, waiter: &Waiter) -> St::Future {
        self.check_queued(key, policy, cost, waiter)
    }

    fn leave(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        self.leave_queue(key, policy, waiter);
    }
}

/// How often the first request in the queue asks the store again while it waits: a slot may free
/// on another instance, or expire, with no give-back here to wake it.
const RECHECK_EVERY: Duration = Duration::from_millis(50);

/// A request's wait for a slot: its deadline and its place in the queue, once refused.
pub(crate) struct Waiting<F> {
    store: Arc<dyn SlotQueue<F>>,
    waiter: Waiter,
    /// Set at the first refusal.
    deadline: Option<Instant>,
    place: Option<InQueue>,
    /// The latest refusal: the answer once the deadline has passed.
    refusal: Option<Decision>,
    /// The key and policy of the store's queue the request may be in: set when it asks, and
    /// taken when it leaves (or the store took it out, admitting it).
    queue_of: Option<(Key, Policy)>,
    /// Whether an ask is on its way, unanswered: the store may have put the request in the queue
    /// without its answer ever coming back (a timeout, its client gone).
    asking: bool,
}

/// What a waiting request does next.
pub(crate) enum Next<F> {
    /// Ask the store again.
    Recheck(F),
    /// Wait some more.
    Wait(Wait),
    /// The deadline passed: answer this refusal.
    GiveUp(Decision),
}

impl<F> Waiting<F> {
    /// A request that may wait for a slot as `waiter` ([`Queues::waiter`]).
    ///
    /// [`Queues::waiter`]: crate::ledger::queue::Queues::waiter
    pub(crate) fn new(store: Arc<dyn SlotQueue<F>>, waiter: Waiter) -> Self {
        Waiting {
            store,
            waiter,
            deadline: None,
            place: None,
            refusal: None,
            queue_of: None,
            asking: false,
        }
    }

    /// Asks the store for a slot as this waiter (the first decision, and each after a wait).
    pub(crate) fn ask(&mut self, query: &Query) -> F {
        let (key, policy) = (&query.key, &query.responder.policy);
        if self.queue_of.is_none() {
            self.queue_of = Some((key.clone(), policy.clone()));
        }
        self.asking = true;
        self.store.ask(key, policy, query.cost, &self.waiter)
    }

    /// Starts or goes on waiting when `outcome` refused the request for a concurrency slot,
    /// before its deadline; `None` otherwise (and the request leaves the queue). `unanswered`:
    /// the store's answer never came (`outcome` then stands in for it, as a refusal at this
    /// layer's cap under `FailureMode::Open` does), so the request may be in the store's queue
    /// and leaves it when it stops.
    pub(crate) fn wait_for_slot(
        &mut self,
        query: &Query,
        outcome: &Result<Decision, StoreError>,
        unanswered: bool,
    ) -> Option<Wait> {
        self.asking = unanswered || outcome.is_err();
        let refusal = match outcome {
            Ok(d) if !d.is_allowed() && d.is_concurrency_limit() => *d,
            Ok(d) => {
                // Admitted, the store took it out of its queue; refused by a rate limit, it
                // leaves.
                self.stop(d.is_allowed());
                return None;
            }
            Err(_) => {
                self.stop(false);
                return None;
            }
        };
        let now = Instant::now();
        let later = now.checked_add(self.waiter.wait).unwrap_or(now);
        let deadline = *self.deadline.get_or_insert(later);
        // A wait needs tokio's timer: called outside a runtime, the request is not kept.
        let timer = tokio::runtime::Handle::try_current().is_ok();
        let (Some(holds), true) = (query.holds(), now < deadline && timer) else {
            self.stop(false);
            return None;
        };
        self.refusal = Some(refusal);
        let (key, policy) = (&query.key, &query.responder.policy);
        let place = refusal.place;
        // In the store's queue where it has a place there; one that was and has none any more
        // (a restart lost the queue) asks next to join it again, at its end.
        self.waiter.queued = place > 0;
        if self.place.as_ref().is_some_and(|t| !t.is_at(place)) {
            // Its place in the store's queue changed (lost, or joined again): this layer's
            // queue follows, so that the first here is the store's first of those here.
            self.place = None;
        }
        let (id, queues) = (self.waiter.id, holds.queues());
        let in_queue = self
            .place
            .get_or_insert_with(|| queues.join(key, policy, id, place));
        let until = match in_queue.is_first() {
            true => deadline.min(now + RECHECK_EVERY),
            false => deadline,
        };
        Some(in_queue.wait(until))
    }

    /// What a waiting request does once woken.
    pub(crate) fn after_wait(&mut self, query: &Query) -> Next<F> {
        let now = Instant::now();
        let deadline = self.deadline.unwrap_or(now);
        if let (true, Some(refusal)) = (now >= deadline, self.refusal) {
            self.stop(false);
            return Next::GiveUp(refusal);
        }
        match &self.place {
            Some(in_queue) if !in_queue.is_first() => Next::Wait(in_queue.wait(deadline)),
            _ => Next::Recheck(self.ask(query)),
        }
    }

    /// The request waits no more: it leaves this layer's queue, and the store's where it is or
    /// may be in it (an answer that never came may have put it there), unless the store
    /// `admitted` it, which took it out.
    fn stop(&mut self, admitted: bool) {
        self.place = None;
        let may_be_in = self.waiter.queued || self.asking;
        if let Some((key, policy)) = self.queue_of.take().filter(|_| may_be_in && !admitted) {
            // Past its deadline the store counts it no more: what is left of its wait bounds
            // how long the leave is worth sending. An ask still unanswered may run later (a
            // stalled Redis runs it when it wakes) and start the store's deadline then: the
            // leave is worth sending for a whole wait.
            let now = Instant::now();
            let left = self.deadline.map(|d| d.saturating_duration_since(now));
            let wait = match self.asking {
                true => self.waiter.wait,
                false => left.unwrap_or(self.waiter.wait),
            };
            let waiter = Waiter {
                wait,
                ..self.waiter
            };
            self.store.leave(&key, &policy, &waiter);
        }
        self.waiter.queued = false;
        self.asking = false;
    }
}

/// A request dropped while it waits (its client went away) leaves the store's queue.
impl<F> Drop for Waiting<F> {
    fn drop(&mut self) {
        self.stop(false);
    }
}
