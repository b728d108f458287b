//! The requests of one layer waiting for a concurrency slot
//! ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)): a line per policy and key, in
//! arrival order. Only the first in line asks the store again, so that slots go in arrival
//! order among this instance's requests; a slot given back here, or the first leaving the
//! line, wakes the next.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::{Key, Policy};

/// The lines of a layer's requests waiting for a slot.
#[derive(Debug, Default)]
pub(crate) struct Lines {
    lines: Mutex<ByQueue>,
    /// Set once any request has waited, so that a layer that never waits does not look here
    /// at each give-back.
    used: AtomicBool,
    /// A serial per request in line.
    next: AtomicU64,
}

/// A line's name: the policy's identity and the key.
type Queue = (Arc<str>, Key);

/// The requests in a line, first in line first: each one's serial and what wakes it.
type Line = VecDeque<(u64, Arc<Notify>)>;

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
    let (_, wake) = lines.get(queue).and_then(VecDeque::front)?;
    Some(Arc::clone(wake))
}

impl Lines {
    /// Puts a request refused for a slot of `key` under `policy` in line, after those of this
    /// layer already waiting for one.
    pub(crate) fn join(self: &Arc<Self>, key: &Key, policy: &Policy) -> InLine {
        self.used.store(true, Ordering::Release);
        let queue = (Arc::clone(policy.state_id().text), key.clone());
        let serial = self.next.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(Notify::new());
        crate::shards::lock(&self.lines)
            .entry(queue.clone())
            .or_default()
            .push_back((serial, Arc::clone(&wake)));
        InLine {
            lines: Arc::clone(self),
            queue,
            serial,
            wake,
        }
    }

    /// Whether requests of `key` under `policy` wait for a slot here: a new one joins them
    /// at the back rather than asking the store before them.
    pub(crate) fn has_line(&self, key: &Key, policy: &Policy) -> bool {
        if !self.used.load(Ordering::Acquire) {
            return false;
        }
        let lines = crate::shards::lock(&self.lines);
        lines.contains_key(&QueueOf(policy.identity(), key))
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
/// asks the store again, so that slots go in arrival order. Dropping it (the request got a
/// slot, gave up, or its client went away) leaves the line and wakes the next.
pub(crate) struct InLine {
    lines: Arc<Lines>,
    queue: Queue,
    serial: u64,
    wake: Arc<Notify>,
}

impl InLine {
    /// Whether no request of the key came before this one.
    pub(crate) fn is_first(&self) -> bool {
        let lines = crate::shards::lock(&self.lines.lines);
        let first = lines.get(&self.queue).and_then(VecDeque::front);
        first.is_some_and(|&(serial, _)| serial == self.serial)
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
        let first = line
            .front()
            .is_some_and(|&(serial, _)| serial == self.serial);
        line.retain(|&(serial, _)| serial != self.serial);
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
        f.debug_struct("InLine")
            .field("serial", &self.serial)
            .finish()
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
