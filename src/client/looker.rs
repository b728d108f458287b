//! One looker per key and layer: the calls of a layer waiting on one key do not each look
//! where they stand every `recheck`; one task looks for all of them with one store call
//! ([`Reserve::look_many`](crate::store::reserve::Reserve::look_many)) per `recheck`, and at
//! once after a reservation of the layer left the line or the layer paused the key, and wakes
//! those whose turns moved earlier, that are no longer in line, or whose key was paused. Each
//! call still looks at its own turn (that look takes it out of the line), so a call costs its
//! reservation, its look at the turn, and its share of the looker's looks, whatever the
//! backlog.
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

use super::shared::Shared;
use crate::store::reserve::{InLine, Ticket};
use crate::{Key, Store};

/// The lookers of one layer, by key.
#[derive(Debug, Default)]
pub(super) struct Lookers {
    by_key: Mutex<HashMap<Key, Arc<Looker>>>,
}

/// The waiters of one key, and the switch that makes its task look at once.
#[derive(Debug, Default)]
struct Looker {
    waiters: Mutex<HashMap<u64, (Ticket, Arc<Slot>)>>,
    now: Notify,
}

/// What the looker last saw of one waiter, and the wake-up it rings.
#[derive(Debug, Default)]
pub(super) struct Slot {
    seen: Mutex<Option<Seen>>,
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
    looker: Arc<Looker>,
    id: u64,
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

/// Puts reservation `ticket` of `key` in the care of the key's looker of `shared`'s layer,
/// starting the looker's task where it has none.
pub(super) fn watch<St: Store>(shared: &Arc<Shared<St>>, key: &Key, ticket: Ticket) -> Watch {
    let slot = Arc::new(Slot::default());
    let mut by_key = shared
        .lookers
        .by_key
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let looker = match by_key.get(key) {
        Some(looker) => Arc::clone(looker),
        None => {
            let looker = Arc::new(Looker::default());
            by_key.insert(key.clone(), Arc::clone(&looker));
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let task = run(Arc::clone(shared), key.clone(), Arc::clone(&looker));
                runtime.spawn(task);
            }
            looker
        }
    };
    looker
        .waiters
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(ticket.id, (ticket, Arc::clone(&slot)));
    drop(by_key);
    Watch {
        looker,
        id: ticket.id,
        slot,
    }
}

/// The looker's task: every `recheck` (or at once when asked), one look at all its waiters;
/// it ends, leaving the layer's map, once none is left.
async fn run<St: Store>(shared: Arc<Shared<St>>, key: Key, looker: Arc<Looker>) {
    // The previous look at each waiter: the rate between the clocks is read from two looks at
    // a turn that did not move.
    let mut previous: HashMap<u64, Seen> = HashMap::new();
    loop {
        let _ = tokio::time::timeout(shared.recheck, looker.now.notified()).await;
        let waiting: Vec<(Ticket, Arc<Slot>)> = {
            let waiters = looker
                .waiters
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            waiters.values().map(|(t, s)| (*t, Arc::clone(s))).collect()
        };
        if waiting.is_empty() {
            let mut by_key = shared
                .lookers
                .by_key
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let idle = looker
                .waiters
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty();
            if idle {
                by_key.remove(&key);
                return;
            }
            continue;
        }
        let tickets = waiting.iter().map(|(t, _)| *t).collect();
        let sent = shared.clock.now();
        let Ok(lines) = shared.store.look_many(&key, &shared.policy, tickets).await else {
            continue;
        };
        let received = shared.clock.now();
        // The rate between the clocks, from the waiter whose two looks say the instance's
        // clock ran fastest: a waiter moved up in between would say it ran slower.
        let mut fastest: Option<((Duration, Duration), Duration)> = None;
        let mut seen_now = HashMap::with_capacity(waiting.len());
        for ((ticket, slot), stood) in waiting.iter().zip(lines) {
            let seen = Seen {
                stood,
                sent,
                received,
            };
            let was = previous.get(&ticket.id);
            if let Some(ran) = ran(was, &seen) {
                fastest = Some(fastest.map_or(ran, |f| if rate(ran) > rate(f) { ran } else { f }));
            }
            if wakes(was, &seen) {
                *slot.seen.lock().unwrap_or_else(PoisonError::into_inner) = Some(seen);
                slot.woken.notify_one();
            }
            seen_now.insert(ticket.id, seen);
        }
        previous = seen_now;
        if let Some((local, store)) = fastest {
            shared.reach.rate_seen(local, store);
        }
    }
}

/// Whether a waiter should learn what the looker saw: it is no longer in line, its key is
/// paused past its turn, or its turn moved earlier than the looker saw it before (wholly
/// out of that look's bracket: the line moved it up).
fn wakes(was: Option<&Seen>, seen: &Seen) -> bool {
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
fn ran(was: Option<&Seen>, seen: &Seen) -> Option<((Duration, Duration), Duration)> {
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
fn rate(((near, far), store): ((Duration, Duration), Duration)) -> f64 {
    (near + far).as_secs_f64() / 2.0 / store.as_secs_f64()
}
