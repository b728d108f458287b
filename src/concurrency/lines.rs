//! The requests of one layer waiting for a concurrency slot
//! ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)): a line per policy and key, in the
//! order of their places in the store's line (their deadlines there), then of arrival. Only
//! the first in line asks the store again, so that this layer asks for a key's slot once at a
//! time, for the request the store serves first among its own; a slot given back here, or the
//! first leaving the line, wakes the next.

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

use super::Waiter;
use crate::{Key, Policy};

/// The lines of a layer's requests waiting for a slot.
#[derive(Debug)]
pub(crate) struct Lines {
    lines: Mutex<ByQueue>,
    /// Set once any request has waited, so that a layer that never waits does not look here
    /// at each give-back.
    used: AtomicBool,
    /// The id of the next waiter ([`waiter`](Self::waiter)).
    next: AtomicU64,
}

impl Default for Lines {
    fn default() -> Self {
        Lines {
            lines: Mutex::default(),
            used: AtomicBool::new(false),
            next: AtomicU64::new(super::random_start()),
        }
    }
}

/// A line's name: the policy's identity and the key.
type Queue = (Arc<str>, Key);

/// The requests in a line, first in line first: each one's place in the store's line (0: not
/// known, then last), its waiter id, and what wakes it.
type Line = VecDeque<(u64, u64, Arc<Notify>)>;

/// Keyed by what clients send, so hashed with a seed of its own.
type ByQueue = hashbrown::HashMap<Queue, Line, foldhash::fast::RandomState>;

/// A [`Queue`] by reference, to look one up without cloning its key: hashed and compared as
/// the tuple is.
#[derive(Hash)]
struct QueueOf<'a>(&'a str, &'a Key);

impl hashbrown::Equivalent<Queue> for QueueOf<'_> {
    fn equivalent(&self, queue: &Queue) -> bool {
        *self.0 == *queue.0 && *self.1 == queue.1
    }
}

/// What wakes the first request in line `queue`, if any.
fn first_in(lines: &ByQueue, queue: &QueueOf<'_>) -> Option<Arc<Notify>> {
    let (_, _, wake) = lines.get(queue).and_then(VecDeque::front)?;
    Some(Arc::clone(wake))
}

impl Lines {
    /// A new waiter, for a request of this layer that may wait `wait` for a slot. Its id has
    /// 16 decimal digits, like every waiter's: the line on Redis orders waiters of the same
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

    /// Puts waiter `id`, refused a slot of `key` under `policy`, in this layer's line at its
    /// `place` in the store's (0: not known, after every known one), in the store's order:
    /// by place, then by id (requests decided in one call to the store share a place).
    pub(crate) fn join(
        self: &Arc<Self>,
        key: &Key,
        policy: &Policy,
        id: u64,
        place: u64,
    ) -> InLine {
        self.used.store(true, Ordering::Release);
        let queue = (Arc::clone(policy.state_id().text), key.clone());
        let place = match place {
            0 => u64::MAX,
            place => place,
        };
        let wake = Arc::new(Notify::new());
        let mut lines = crate::shards::lock(&self.lines);
        let line = lines.entry(queue.clone()).or_default();
        let at = line.partition_point(|&(other, waiter, _)| (other, waiter) < (place, id));
        line.insert(at, (place, id, Arc::clone(&wake)));
        drop(lines);
        InLine {
            lines: Arc::clone(self),
            queue,
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
        let lines = crate::shards::lock(&self.lines);
        first_in(&lines, &QueueOf(policy.identity(), key))
    }
}

/// A request's place in line for a slot of its key on this instance: only the first in line
/// asks the store again. Dropping it (the request got a
/// slot, gave up, or its client went away) leaves the line and wakes the next.
pub(crate) struct InLine {
    lines: Arc<Lines>,
    queue: Queue,
    /// The waiter's id.
    id: u64,
    /// Its place, as in the line (`u64::MAX`: not known).
    place: u64,
    wake: Arc<Notify>,
}

impl InLine {
    /// Whether it stands at `place` in the store's line (0: not known).
    pub(crate) fn is_at(&self, place: u64) -> bool {
        self.place == if place == 0 { u64::MAX } else { place }
    }

    /// Whether it is first in this layer's line for the key.
    pub(crate) fn is_first(&self) -> bool {
        let lines = crate::shards::lock(&self.lines.lines);
        let first = lines.get(&self.queue).and_then(VecDeque::front);
        first.is_some_and(|&(_, id, _)| id == self.id)
    }

    /// Waits until woken (a slot of the key given back here, or the first in line left) or
    /// until `until`, whichever comes first.
    pub(crate) fn wait(&self, until: Instant) -> Wait {
        Wait {
            woken: Arc::clone(&self.wake).notified_owned(),
            sleep: tokio::time::sleep_until(until),
        }
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        let mut lines = crate::shards::lock(&self.lines.lines);
        let Some(line) = lines.get_mut(&self.queue) else {
            return;
        };
        let first = line.front().is_some_and(|&(_, id, _)| id == self.id);
        line.retain(|&(_, id, _)| id != self.id);
        if line.is_empty() {
            lines.remove(&self.queue);
        } else if first {
            // The next in line asks the store now: the slot this one got, or did not wait
            // for, may leave room for it too.
            let (identity, key) = &self.queue;
            if let Some(wake) = first_in(&lines, &QueueOf(identity, key)) {
                wake.notify_one();
            }
        }
    }
}

impl std::fmt::Debug for InLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InLine").field("id", &self.id).finish()
    }
}

pin_project! {
    /// Waits for an [`InLine`]'s wake-up or its deadline.
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
