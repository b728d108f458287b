//! A request's wait for a concurrency slot
//! ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)): until its deadline, in line behind
//! the requests of its key that came before it on this instance, asking the store again when
//! it is first in line.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::check::Check;
use crate::concurrency::lines::{InLine, Wait};
use crate::{Decision, Key, Policy, StoreError};

/// Asks the store again for a request waiting for a concurrency slot.
pub(crate) type Recheck<F> = Arc<dyn Fn(&Key, &Policy, u32) -> F + Send + Sync>;

/// How often the first request in line asks the store again while it waits: a slot may free
/// on another instance, or expire, with no give-back here to wake it.
const RECHECK_EVERY: Duration = Duration::from_millis(50);

/// A request's wait for a slot: its deadline and its place in line, once refused.
pub(crate) struct Waiting<F> {
    recheck: Recheck<F>,
    max_wait: Duration,
    /// Set at the first refusal.
    deadline: Option<Instant>,
    ticket: Option<InLine>,
    /// The latest refusal: the answer once the deadline has passed.
    refusal: Option<Decision>,
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
    pub(crate) fn new(recheck: Recheck<F>, max_wait: Duration) -> Self {
        Waiting {
            recheck,
            max_wait,
            deadline: None,
            ticket: None,
            refusal: None,
        }
    }

    /// Starts or goes on waiting when `outcome` refused the request for a concurrency slot,
    /// before its deadline; `None` otherwise (and the request leaves the line).
    pub(crate) fn wait_for_slot(
        &mut self,
        check: &Check,
        outcome: &Result<Decision, StoreError>,
    ) -> Option<Wait> {
        let refusal = match outcome {
            Ok(d) if d.is_concurrency_limit() => *d,
            _ => {
                self.ticket = None;
                return None;
            }
        };
        let now = Instant::now();
        let later = now.checked_add(self.max_wait).unwrap_or(now);
        let deadline = *self.deadline.get_or_insert(later);
        // A wait needs tokio's timer: called outside a runtime, the request is not kept.
        let timer = tokio::runtime::Handle::try_current().is_ok();
        let (Some(holds), true) = (check.holds(), now < deadline && timer) else {
            self.ticket = None;
            return None;
        };
        self.refusal = Some(refusal);
        let (key, policy) = (&check.key, &check.responder.policy);
        let ticket = self
            .ticket
            .get_or_insert_with(|| holds.lines().join(key, policy));
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
            self.ticket = None;
            return Next::GiveUp(refusal);
        }
        match &self.ticket {
            Some(ticket) if !ticket.is_first() => Next::Wait(ticket.wait(deadline)),
            _ => Next::Recheck((self.recheck)(
                &check.key,
                &check.responder.policy,
                check.cost,
            )),
        }
    }
}
