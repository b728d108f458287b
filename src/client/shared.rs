//! What every service and response future of one outbound layer shares: the store, the
//! policy and settings, the wake-up of its waiting requests, and the ids of its reservations.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::pace::Pace;
use crate::store::reserve::Ticket;
use crate::Policy;

/// What every service and future of one layer reads.
#[derive(Debug)]
pub(super) struct Shared<St> {
    pub(super) store: St,
    pub(super) policy: Policy,
    pub(super) max_wait: Duration,
    pub(super) late: Duration,
    /// How often a request further than this from its turn looks where it stands.
    pub(super) recheck: Duration,
    /// Wakes the layer's waiting requests: a reservation of the layer left the line (those
    /// behind it moved up), or the layer paused a key.
    pub(super) wake: Arc<Notify>,
    /// The id of the next reservation.
    next: AtomicU64,
    /// The longest pause an upstream's answer sets (the builder's `max_pause`).
    #[allow(dead_code)]
    pub(super) max_pause: Duration,
    /// The rates this layer learned from the upstream's pushbacks, per key.
    #[allow(dead_code)]
    pub(super) pace: Pace,
}

impl<St> Shared<St> {
    /// A layer's share: its store and policy, the most its requests wait, and how late after
    /// a turn they may go and how often they look (`margin` and `recheck`).
    pub(super) fn new(
        store: St,
        policy: Policy,
        max_wait: Duration,
        (late, recheck): (Duration, Duration),
    ) -> Self {
        Shared {
            store,
            pace: Pace::new(&policy),
            max_pause: super::pushback::MAX_PAUSE,
            policy,
            max_wait,
            late,
            recheck,
            wake: Arc::new(Notify::new()),
            next: AtomicU64::new(crate::ids::random_start()),
        }
    }

    /// The same, pausing a key for at most `max_pause` on an upstream's pushback.
    pub(super) fn with_max_pause(mut self, max_pause: Duration) -> Self {
        self.max_pause = max_pause;
        self
    }

    /// A ticket for a new reservation of one unit that waits up to `max_wait`. Its id has 16
    /// decimal digits, like every reservation's of this crate: the line on Redis orders turns
    /// of the same instant by their members' text, which is then their ids' order, as on the
    /// memory store.
    pub(super) fn ticket(&self, max_wait: Duration) -> Ticket {
        const FIRST: u64 = 1_000_000_000_000_000;
        const SPAN: u64 = 3_000_000_000_000_000;
        let id = FIRST + self.next.fetch_add(1, Ordering::Relaxed) % SPAN;
        // Moved up in line, it learns of it at its next look, and may go `late` after that.
        Ticket {
            late: self.late,
            notice: self.recheck + self.late,
            ..Ticket::new(id, max_wait)
        }
    }
}
