//! One looker per key and layer: the calls of a layer waiting on one key do not each look
//! where they stand every `recheck`; one task looks for all of them with one store call
//! ([`Reserve::look_many`](crate::store::reserve::Reserve::look_many)) per `recheck`, and at
//! once after a reservation of the layer left the line or the layer paused the key, and wakes
//! those whose turns moved earlier, that are no longer in line, or whose key was paused. Each
//! call still looks at its own turn, and leaves the line when its work goes (used) or is
//! dropped (given back), so a call costs its reservation, its look at the turn, its leave,
//! and its share of the looker's looks, whatever the backlog.
//!
//! Why a task per key and not Redis pub/sub on changes of the line: the store is built
//! without fred's pub/sub, a cluster needs sharded pub/sub, and a subscriber still learns of
//! other instances' moves only as fast as a message reaches it; a look per `recheck` for all
//! of a key's waiters bounds the cost as well, with nothing more to run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::reserve::{InLine, Ticket};
use crate::Key;

/// The lookers of one layer, by key.
#[derive(Debug, Default)]
pub(super) struct Lookers {
    pub(super) by_key: Mutex<HashMap<Key, Arc<Looker>>>,
}

/// The waiters of one key, and the switch that makes its task look at once.
#[derive(Debug, Default)]
pub(super) struct Looker {
    pub(super) waiters: Mutex<HashMap<u64, (Ticket, Arc<Slot>)>>,
    pub(super) now: Notify,
}

/// What the looker last saw of one waiter, and the wake-up it rings.
#[derive(Debug, Default)]
pub(super) struct Slot {
    pub(super) seen: Mutex<Option<Seen>>,
    pub(super) woken: Arc<Notify>,
}

/// Where a waiter stood at the looker's look, asked at `sent` and heard at `received` on the
/// instance's clock.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen {
    pub(super) stood: InLine,
    pub(super) sent: Instant,
    pub(super) received: Instant,
}

/// A waiter's place with its key's looker: dropped, it leaves it (the task ends with its
/// last waiter).
#[derive(Debug)]
pub(super) struct Watch {
    pub(super) looker: Arc<Looker>,
    pub(super) id: u64,
    pub(super) slot: Arc<Slot>,
}

impl Watch {
    /// What the looker saw since the waiter last took it.
    pub(super) fn take(&self) -> Option<Seen> {
        self.slot
            .seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut waiters = self
            .looker
            .waiters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        waiters.remove(&self.id);
    }
}

impl Lookers {
    /// Makes `key`'s looker of this layer look at once (a reservation of the layer left the
    /// line, or the layer paused the key).
    pub(super) fn look_now(&self, key: &Key) {
        let by_key = self.by_key.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(looker) = by_key.get(key) {
            looker.now.notify_one();
        }
    }
}

/// Whether a waiter should learn what the looker saw: it is no longer in line, its key is
/// paused past its turn, or its turn moved earlier than the looker saw it before (wholly
/// out of that look's bracket: the line moved it up).
pub(super) fn wakes(was: Option<&Seen>, seen: &Seen) -> bool {
    let stood = seen.stood;
    let Some(ahead) = stood.turn else {
        return true;
    };
    if !stood.paused.is_zero() && ahead < stood.paused {
        return true;
    }
    match was.and_then(|was| Some((was, was.stood.turn?))) {
        Some((was, before)) => seen.received + ahead < was.sent + before,
        // First seen: the line may have moved it up since its reservation answered.
        None => true,
    }
}

/// How long the store's clock ran between two looks at one turn (exactly the difference of
/// the two answers, where the turn did not move), and the instance's (between the two
/// brackets' near and far ends).
pub(super) fn ran(was: Option<&Seen>, seen: &Seen) -> Option<((Duration, Duration), Duration)> {
    let (before, now) = (was?.stood.turn?, seen.stood.turn?);
    let store = before.checked_sub(now).filter(|d| !d.is_zero())?;
    let was = was?;
    let local = (
        seen.sent.saturating_duration_since(was.received),
        seen.received.saturating_duration_since(was.sent),
    );
    Some((local, store))
}

/// The instance's seconds per store second that `ran` says, at its bracket's middle.
pub(super) fn rate(((near, far), store): ((Duration, Duration), Duration)) -> f64 {
    (near + far).as_secs_f64() / 2.0 / store.as_secs_f64()
}
