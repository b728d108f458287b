//! The requests of one layer waiting for a concurrency slot
//! ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)): a queue per policy and key, in the
//! order of their places in the store's queue (their deadlines there), then of arrival. Only
//! the first in the queue asks the store again, so that this layer asks for a key's slot once at a
//! time, for the request the store serves first among its own; a slot given back here, or the
//! first leaving the queue, wakes the next.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::model::slots::Waiter;
use crate::{Key, Policy};

/// The queues of a layer's requests waiting for a slot.
#[derive(Debug)]
pub(crate) struct Queues {
    queues: Mutex<ByName>,
    /// Set once any request has waited, so that a layer that never waits does not look here
    /// at each give-back.
    used: AtomicBool,
    /// The id of the next waiter ([`waiter`](Self::waiter)).
    next: AtomicU64,
}

impl Default for Queues {
    fn default() -> Self {
        Queues {
            queues: Mutex::default(),
            used: AtomicBool::new(false),
            next: AtomicU64::new(crate::ids::random_start()),
        }
    }
}

/// A queue's name: the policy's identity and the key.
type QueueName = (Arc<str>, Key);

/// The requests in a queue, first first: each one's place in the store's queue (0: not
/// known, then last), its waiter id, and what wakes it.
type Queue = VecDeque<(u64, u64, Arc<Notify>)>;

/// Keyed by what clients send, so hashed with a seed of its own.
type ByName = hashbrown::HashMap<QueueName, Queue, foldhash::fast::RandomState>;

/// A [`Queue`] by reference, to look one up without cloning its key: hashed and compared as
/// the tuple is.
#[derive(Hash)]
struct NameOf<'a>(&'a str, &'a Key);

impl hashbrown::Equivalent<QueueName> for NameOf<'_> {
    fn equivalent(&self, name: &QueueName) -> bool {
        *self.0 == *name.0 && *self.1 == name.1
    }
}

/// What wakes the first request in queue `name`, if any.
fn first_in(queues: &ByName, name: &NameOf<'_>) -> Option<Arc<Notify>> {
    let (_, _, wake) = queues.get(name).and_then(VecDeque::front)?;
    Some(Arc::clone(wake))
}

impl Queues {
    /// A new waiter, for a request of this layer that may wait `wait` for a slot. Its id has
    /// 16 decimal digits, like every waiter's: the queue on Redis orders waiters of the same
    /// deadline by their members' text, which is then their ids' order, as here and on the
    /// memory store.
    pub(crate) fn waiter(&self, wait: Duration) -> Waiter {
        const FIRST: u64 = 1_000_000_000_000_000;
        const SPAN: u64 = 3_000_000_000_000_000;
        let id = FIRST + self.next.fetch_add(1, Ordering::Relaxed) % SPAN;
        Waiter {
            id,
            wait,
            queued: false,
        }
    }

    /// Puts waiter `id`, refused a slot of `key` under `policy`, in this layer's queue at its
    /// `place` in the store's (0: not known, after every known one), in the store's order:
    /// by place, then by id (requests decided in one call to the store share a place).
    pub(crate) fn join(
        self: &Arc<Self>,
        key: &Key,
        policy: &Policy,
        id: u64,
        place: u64,
    ) -> InQueue {
        self.used.store(true, Ordering::Release);
        let name = (Arc::clone(policy.state_id().text), key.clone());
        let place = match place {
            0 => u64::MAX,
            place => place,
        };
        let wake = Arc::new(Notify::new());
        let mut queues = crate::shards::lock(&self.queues);
        let queue = queues.entry(name.clone()).or_default();
        let at = queue.partition_point(|&(other, waiter, _)| (other, waiter) < (place, id));
        queue.insert(at, (place, id, Arc::clone(&wake)));
        drop(queues);
        InQueue {
            queues: Arc::clone(self),
            name,
            id,
            place,
            wake,
        }
    }

    /// What wakes the first request waiting for a slot of `key` under `policy`, if any.
    pub(crate) fn first(&self, key: &Key, policy: &Policy) -> Option<Arc<Notify>> {
        if !self.used.load(Ordering::Acquire) {
            return None;
        }
        let queues = crate::shards::lock(&self.queues);
        first_in(&queues, &NameOf(policy.identity(), key))
    }
}

/// A request's place in the queue for a slot of its key on this instance: only the first
/// asks the store again. Dropping it (the request got a
/// slot, gave up, or its client went away) leaves the queue and wakes the next.
pub(crate) struct InQueue {
    queues: Arc<Queues>,
    name: QueueName,
    /// The waiter's id.
    id: u64,
    /// Its place, as in the queue (`u64::MAX`: not known).
    place: u64,
    wake: Arc<Notify>,
}

impl InQueue {
    /// Whether it stands at `place` in the store's queue (0: not known).
    pub(crate) fn is_at(&self, place: u64) -> bool {
        self.place == if place == 0 { u64::MAX } else { place }
    }

    /// Whether it is first in this layer's queue for the key.
    pub(crate) fn is_first(&self) -> bool {
        let queues = crate::shards::lock(&self.queues.queues);
        let first = queues.get(&self.name).and_then(VecDeque::front);
        first.is_some_and(|&(_, id, _)| id == self.id)
    }

    /// Waits until woken (a slot of the key given back here, or the first in the queue left) or
    /// until `until`, whichever comes first.
    pub(crate) fn wait(&self, until: Instant) -> Wait {
        Wait {
            woken: Arc::clone(&self.wake).notified_owned(),
            sleep: tokio::time::sleep_until(until),
        }
    }
}

impl Drop for InQueue {
    fn drop(&mut self) {
        let mut queues = crate::shards::lock(&self.queues.queues);
        let Some(queue) = queues.get_mut(&self.name) else {
            return;
        };
        let first = queue.front().is_some_and(|&(_, id, _)| id == self.id);
        queue.retain(|&(_, id, _)| id != self.id);
        if queue.is_empty() {
            queues.remove(&self.name);
        } else if first {
            // The next in the queue asks the store now: the slot this one got, or did not wait
            // for, may leave room for it too.
            let (identity, key) = &self.name;
            if let Some(wake) = first_in(&queues, &NameOf(identity, key)) {
                wake.notify_one();
            }
        }
    }
}

impl std::fmt::Debug for InQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InQueue").field("id", &self.id).finish()
    }
}

pin_project! {
    /// Waits for an [`InQueue`]'s wake-up or its deadline.
    pub(crate) struct Wait {
        #[pin]
        woken: OwnedNotified,
        #[pin]
        sleep: tokio::time::Sleep,
    }
}

impl Future for Wait {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.woken.poll(cx).is_ready() || this.sleep.poll(cx).is_ready() {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}
