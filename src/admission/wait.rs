//! A request's wait for a concurrency slot
//! ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)): until its deadline, as a waiter in
//! the store's line for its key (`Store::check_in_line`), behind those of this instance that
//! come before it there, asking the store again when it is first; leaving the store's line
//! when it stops waiting without a slot.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::check::Check;
use crate::concurrency::lines::{InLine, Wait};
use crate::concurrency::Waiter;
use crate::{Decision, Key, Policy, Store, StoreError};

/// The store, as a waiting request asks it: again for a slot, or to take it out of line.
pub(crate) trait Line<F>: Send + Sync {
    /// Decides the request (`Store::check_in_line`).
    fn ask(&self, key: &Key, policy: &Policy, cost: u32, waiter: &Waiter) -> F;
    /// Takes it out of the key's line (`Store::leave_line`).
    fn leave(&self, key: &Key, policy: &Policy, waiter: &Waiter);
}

impl<St: Store> Line<St::Future> for St {
    fn ask(&self, key: &Key, policy: &Policy, cost: u32, waiter: &Waiter) -> St::Future {
        self.check_in_line(key, policy, cost, waiter)
    }

    fn leave(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        self.leave_line(key, policy, waiter);
    }
}

/// How often the first request in line asks the store again while it waits: a slot may free
/// on another instance, or expire, with no give-back here to wake it.
const RECHECK_EVERY: Duration = Duration::from_millis(50);

/// A request's wait for a slot: its deadline and its place in line, once refused.
pub(crate) struct Waiting<F> {
    line: Arc<dyn Line<F>>,
    waiter: Waiter,
    /// Set at the first refusal.
    deadline: Option<Instant>,
    ticket: Option<InLine>,
    /// The latest refusal: the answer once the deadline has passed.
    refusal: Option<Decision>,
    /// The key and policy of the store's line the request may be in: set when it asks, and
    /// taken when it leaves (or the store took it out, admitting it).
    line_of: Option<(Key, Policy)>,
    /// Whether an ask is on its way, unanswered: the store may have put the request in line
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
    /// A request that may wait for a slot as `waiter` ([`Lines::waiter`]).
    ///
    /// [`Lines::waiter`]: crate::concurrency::lines::Lines::waiter
    pub(crate) fn new(line: Arc<dyn Line<F>>, waiter: Waiter) -> Self {
        Waiting {
            line,
            waiter,
            deadline: None,
            ticket: None,
            refusal: None,
            line_of: None,
            asking: false,
        }
    }

    /// Asks the store for a slot as this waiter (the first decision, and each after a wait).
    pub(crate) fn ask(&mut self, check: &Check) -> F {
        let (key, policy) = (&check.key, &check.responder.policy);
        if self.line_of.is_none() {
            self.line_of = Some((key.clone(), policy.clone()));
        }
        self.asking = true;
        self.line.ask(key, policy, check.cost, &self.waiter)
    }

    /// Starts or goes on waiting when `outcome` refused the request for a concurrency slot,
    /// before its deadline; `None` otherwise (and the request leaves the line). `unanswered`:
    /// the store's answer never came (`outcome` then stands in for it, as a refusal at this
    /// layer's cap under `FailureMode::Open` does), so the request may be in the store's line
    /// and leaves it when it stops.
    pub(crate) fn wait_for_slot(
        &mut self,
        check: &Check,
        outcome: &Result<Decision, StoreError>,
        unanswered: bool,
    ) -> Option<Wait> {
        self.asking = unanswered || outcome.is_err();
        let refusal = match outcome {
            Ok(d) if d.is_concurrency_limit() => *d,
            Ok(d) => {
                // Admitted, the store took it out of its line; refused by a rate limit, it
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
        let (Some(holds), true) = (check.holds(), now < deadline && timer) else {
            self.stop(false);
            return None;
        };
        self.refusal = Some(refusal);
        let (key, policy) = (&check.key, &check.responder.policy);
        let place = refusal.place;
        // In the store's line where it has a place there; one that was and has none any more
        // (a restart lost the line) asks next to join it again, at its end.
        self.waiter.queued = place > 0;
        if self.ticket.as_ref().is_some_and(|t| !t.is_at(place)) {
            // Its place in the store's line changed (lost, or joined again): this layer's
            // line follows, so that the first here is the store's first of those here.
            self.ticket = None;
        }
        let (id, lines) = (self.waiter.id, holds.lines());
        let ticket = self
            .ticket
            .get_or_insert_with(|| lines.join(key, policy, id, place));
        let until = match ticket.is_first() {
            true => deadline.min(now + RECHECK_EVERY),
            false => deadline,
        };
        Some(ticket.wait(until))
    }

    /// What a waiting request does once woken.
    pub(crate) fn after_wait(&mut self, check: &Check) -> Next<F> {
        let now = Instant::now();
        let deadline = self.deadline.unwrap_or(now);
        if let (true, Some(refusal)) = (now >= deadline, self.refusal) {
            self.stop(false);
            return Next::GiveUp(refusal);
        }
        match &self.ticket {
            Some(ticket) if !ticket.is_first() => Next::Wait(ticket.wait(deadline)),
            _ => Next::Recheck(self.ask(check)),
        }
    }

    /// The request waits no more: it leaves this layer's line, and the store's where it is or
    /// may be in it (an answer that never came may have put it there), unless the store
    /// `admitted` it, which took it out.
    fn stop(&mut self, admitted: bool) {
        self.ticket = None;
        let may_be_in = self.waiter.queued || self.asking;
        if let Some((key, policy)) = self.line_of.take().filter(|_| may_be_in && !admitted) {
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
            self.line.leave(&key, &policy, &waiter);
        }
        self.waiter.queued = false;
        self.asking = false;
    }
}

/// A request dropped while it waits (its client went away) leaves the store's line.
impl<F> Drop for Waiting<F> {
    fn drop(&mut self) {
        self.stop(false);
    }
}
