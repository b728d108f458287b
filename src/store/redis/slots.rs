//! Concurrency slots' give-backs and renewals, which must reach Redis.
//!
//! A slot lives in Redis for its stored lifetime ([`stored_micros`]) after it was taken or last
//! renewed. A give-back or a renewal that finds the breaker open, or whose call fails for want
//! of Redis (a timeout, a lost connection), is not dropped: it waits here and is sent again
//! every [`RETRY`], past the breaker (each round is a probe), until Redis answers or the slot
//! has expired there anyway. So a blip costs a key its slots for the blip and one round, not
//! for a lifetime, and an instance cut off for less than the slot lifetime keeps its slots.
//! Sending either twice is harmless: a give-back removes what is there, a renewal sets an
//! expiry from Redis's clock and never takes back an expired slot (`prelude.lua`, "Slot
//! operations").
//!
//! A decision that takes a slot and whose answer nobody reads (its call timed out or failed,
//! or its caller left: a client that disconnects) may still have taken it in Redis: the slot id
//! is the instance's, so the decision gives it back all the same ([`Unheld`]). Its call may
//! still be on its way, held up on one stalled connection of the pool while the others answer:
//! while the give-back finds nothing it is sent again, [`RETRY`] apart and twice as long each
//! time up to [`UNFOUND_PACE`], until the slot's stored lifetime has passed, so that a slot
//! that call takes late is gone within [`UNFOUND_PACE`] of its taking.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::transport::health::is_outage;
use super::Inner;
use crate::store::engine::OnSettled;
use crate::store::redis::wire::{Answered, SlotOp};
use crate::store::StoreError;
use crate::{Key, Policy};

/// How often the operations that wait are sent again.
pub(super) const RETRY: Duration = Duration::from_millis(100);

/// How long a slot lives in Redis after it was taken or renewed (µs): the policy's slot
/// lifetime `L`, plus half of it, plus twice the time budget `B`. Renewals leave every quarter
/// lifetime, and one may skip a tick, so the last one before an instance is cut off landed at
/// most `L / 2 + B` before; the slot then lives `L` past the cut, plus `B` for the first
/// renewal after it. An instance that dies keeps its slots this long at most.
pub(super) fn stored_micros(policy: &Policy, budget: Duration) -> u64 {
    let lifetime = policy.slot_micros();
    let budget = u64::try_from(budget.as_micros()).unwrap_or(u64::MAX);
    lifetime
        .saturating_add(lifetime / 2)
        .saturating_add(budget.saturating_mul(2))
        .max(1)
}

/// The longest a decision's own give-back ([`Unheld`]) waits before it is sent again, while
/// it finds no slot.
pub(super) const UNFOUND_PACE: Duration = Duration::from_millis(800);

/// A give-back or renewal on its way, and what hears how it went.
pub(super) struct SlotWork {
    pub(super) key: Key,
    pub(super) policy: Policy,
    pub(super) op: SlotOp,
    /// When the slot has expired in Redis whatever happens: a renewal still waiting then
    /// found its slot gone, a give-back has nothing left to give back.
    pub(super) until: Instant,
    pub(super) done: OnSettled,
    /// Whether a give-back that finds no slot is sent again (a decision's own, [`Unheld`]),
    /// and how many times it found none.
    until_found: bool,
    unfound: u32,
    /// Not sent again before this.
    next: Instant,
}

impl SlotWork {
    /// Slot operation `op` of `key` under `policy`, for a slot stored `lifetime` µs.
    pub(super) fn new(
        key: Key,
        policy: Policy,
        op: SlotOp,
        lifetime: u64,
        done: OnSettled,
    ) -> Self {
        let now = Instant::now();
        SlotWork {
            key,
            policy,
            op,
            until: now + Duration::from_micros(lifetime),
            done,
            until_found: false,
            unfound: 0,
            next: now,
        }
    }

    /// The same operation, sent again while it finds nothing (a give-back no slot, a waiter's
    /// leave no waiter), until its time is up: a call held up on its way may still take them.
    pub(super) fn until_found(self) -> SlotWork {
        SlotWork {
            until_found: true,
            ..self
        }
    }

    /// The same operation, sent again later: it found nothing.
    fn again(self) -> SlotWork {
        let unfound = self.unfound + 1;
        let wait = RETRY.saturating_mul(1 << unfound.min(8)).min(UNFOUND_PACE);
        SlotWork {
            unfound,
            next: Instant::now() + wait,
            ..self
        }
    }
}

/// The operations waiting for Redis, and the task that sends them again.
#[derive(Default)]
pub(super) struct Unsent {
    work: Mutex<Vec<SlotWork>>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Unsent {
    fn push(&self, work: SlotWork, inner: &Arc<Inner>) {
        crate::shards::lock(&self.work).push(work);
        let mut task = crate::shards::lock(&self.task);
        if task.as_ref().is_none_or(JoinHandle::is_finished) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                *task = Some(runtime.spawn(retry(Arc::downgrade(inner))));
            }
        }
    }
}

/// Whether a slot operation that failed with `error` may succeed if sent again: Redis was out
/// of reach or too slow, not an answer that was an error.
fn worth_again(error: &StoreError) -> bool {
    match error {
        StoreError::Unavailable | StoreError::Timeout(_) => true,
        StoreError::Redis(error) => is_outage(error),
        _ => false,
    }
}

impl Inner {
    /// Sends `work` with the next batched call of its key's lane, behind the breaker unless
    /// `probe`; it waits for Redis instead (see the module) where the breaker is open or the
    /// call fails for want of Redis.
    pub(super) fn send_slot_op(self: &Arc<Self>, work: SlotWork, probe: bool) {
        let place = self.place(&work.key, &work.policy);
        let lane = place.lane;
        if !probe && self.breaker(lane).is_open() {
            return self.waiting.push(work, self);
        }
        let started = self.breaker(lane).now();
        let (inner, algorithm, op) = (Arc::clone(self), work.policy.algorithm(), work.op);
        let then = Box::new(move |reply: Answered| {
            let kept = reply.as_ref().is_ok_and(|answer| answer.ints[0] == 1);
            match inner.slot_kept(lane, started, work.op, reply) {
                Err(error) if worth_again(&error) => inner.waiting.push(work, &inner),
                Ok(()) if !kept && work.until_found => inner.waiting.push(work.again(), &inner),
                outcome => (work.done)(outcome),
            }
        });
        self.batcher.keep_then(place, algorithm, op, then);
    }
}

/// Sends the operations that wait again every [`RETRY`], until none is left or the store is
/// dropped; those whose slot has expired meanwhile are answered without Redis.
async fn retry(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(RETRY).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let due = std::mem::take(&mut *crate::shards::lock(&inner.waiting.work));
        if due.is_empty() {
            let mut task = crate::shards::lock(&inner.waiting.task);
            // A push after the take above found this task running: look once more.
            if crate::shards::lock(&inner.waiting.work).is_empty() {
                *task = None;
                return;
            }
            continue;
        }
        let now = Instant::now();
        for work in due {
            if now < work.until && now < work.next {
                inner.waiting.push(work, &inner);
            } else if now < work.until {
                inner.send_slot_op(work, true);
            } else if work.op.is_renewal() {
                (work.done)(Err(StoreError::SlotGone));
            } else {
                (work.done)(Ok(()));
            }
        }
    }
}

/// The slot a decision asks to take (slot id `id` of `key` under `policy`), given back when
/// the guard drops armed: when nobody holds the slot, because the decision failed after its
/// call may have been sent, or its future was dropped (see the module). Disarmed once the
/// decision's answer is read: admitted, the caller holds the slot; refused, none was taken.
pub(super) struct Unheld {
    inner: Arc<Inner>,
    key: Key,
    policy: Policy,
    id: u64,
    armed: bool,
}

impl Unheld {
    pub(super) fn new(inner: &Arc<Inner>, key: &Key, policy: &Policy, id: u64) -> Unheld {
        Unheld {
            inner: Arc::clone(inner),
            key: key.clone(),
            policy: policy.clone(),
            id,
            armed: true,
        }
    }

    /// The decision's answer was read, or its call never left (the breaker was open).
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Unheld {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let op = SlotOp::Release {
            id: self.id,
            held: 0,
        };
        let lifetime = stored_micros(&self.policy, self.inner.timeout);
        let (key, policy) = (self.key.clone(), self.policy.clone());
        let work = SlotWork::new(key, policy, op, lifetime, Box::new(drop));
        self.inner.send_slot_op(work.until_found(), false);
    }
}
