//! What every service and response future of one outbound layer shares: the store, the
//! policy and settings, the clock and what the layer measured of the store, the lookers of
//! its waiting requests, and the ids of its reservations; and the layer's tasks that act on
//! the store for them: changes to the line, and each key's looker (what a looker sees and
//! whom it wakes is `looker.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::{oneshot, OnceCell};

use super::clock::{Clock, Reach};
use super::looker::{ran, rate, wakes, Looker, Lookers, Seen, Slot, Watch};
use super::pace::Pace;
use crate::store::reserve::Ticket;
use crate::{Key, Policy, Store};

/// What every service and future of one layer reads.
#[derive(Debug)]
pub(super) struct Shared<St> {
    pub(super) store: St,
    pub(super) policy: Policy,
    pub(super) max_wait: Duration,
    /// The instance's clock.
    pub(super) clock: Clock,
    /// The round trip, the clocks' rate and the margin in use.
    pub(super) reach: Reach,
    /// How often a request further than this from its turn looks where it stands.
    pub(super) recheck: Duration,
    /// The lookers of the keys its requests wait on.
    pub(super) lookers: Lookers,
    /// Set once the round trip to the store was first measured (before the first
    /// reservation).
    pub(super) measured: OnceCell<()>,
    /// The id of the next reservation.
    next: AtomicU64,
    /// The longest pause an upstream's answer sets (the builder's `max_pause`).
    pub(super) max_pause: Duration,
    /// The rates this layer learned from the upstream's pushbacks, per key.
    pub(super) pace: Pace,
}

impl<St> Shared<St> {
    /// A layer's share: its store and policy, the most its requests wait, how late after a
    /// turn they may go (`margin`, widened up to `max_margin` where the round trip needs it),
    /// how often they look (`recheck`), and the instance's clock.
    pub(super) fn new(
        store: St,
        policy: Policy,
        max_wait: Duration,
        (margin, max_margin, recheck): (Duration, Duration, Duration),
        clock: Clock,
    ) -> Self {
        let reach = Reach::new(policy.name(), margin, max_margin);
        Shared {
            store,
            pace: Pace::new(&policy),
            max_pause: super::pushback::MAX_PAUSE,
            policy,
            max_wait,
            clock,
            reach,
            recheck,
            lookers: Lookers::default(),
            measured: OnceCell::new(),
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
        // Moved up in line, it learns of it at its next look (a round trip), and may go `late`
        // after that.
        let late = self.reach.margin();
        Ticket {
            late,
            notice: self.recheck + late + self.reach.round_trip(),
            ..Ticket::new(id, max_wait)
        }
    }
}

impl<St: Store> Shared<St> {
    /// Pauses `key` for every caller that shares the store for `pause` (at most the layer's
    /// `max_pause`), on a task of its own, and then wakes this layer's waiting requests to
    /// learn it; the receiver hears when the store answered the first try (a caller handed
    /// the upstream's refusal only then does not reserve its next turn before the pause).
    pub(super) fn pause(this: &Arc<Self>, key: Key, pause: Duration) -> oneshot::Receiver<()> {
        let pause = pause.min(this.max_pause);
        this.pace.pushed_back(&key, this.clock.now(), pause);
        let paused = move |store: &St, key: &Key, policy: &Policy| store.pause(key, policy, pause);
        let failed = "failed to pause a key the upstream pushed back on";
        Self::change(this, key, paused, failed, true)
    }

    /// Makes a change to the line of `key` on a task of its own, then, with `wake`, has the
    /// key's looker look at once for this layer's requests waiting on it (those behind a
    /// leave moved up; a pause stops them); the receiver it answers hears
    /// when the first try came back. Each change may run twice without harm (a leave or a
    /// look finds nothing the second time, a pause keeps the longer), so one that fails (the
    /// store too slow, or out of reach, its breaker open) is sent again every 100 ms for as
    /// long as the line keeps a reservation past its turn (`KEPT`, 10 s); then the failure is
    /// logged as `failed`.
    pub(super) fn change<F>(
        this: &Arc<Self>,
        key: Key,
        change: F,
        failed: &'static str,
        wake: bool,
    ) -> oneshot::Receiver<()>
    where
        F: Fn(&St, &Key, &Policy) -> St::LineFuture + Send + 'static,
    {
        /// How often a change to the line is sent: every 100 ms for 10 s.
        const TRIES: u32 = 100;
        let (tried_once, heard) = oneshot::channel();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return heard;
        };
        let shared = Arc::clone(this);
        runtime.spawn(async move {
            let mut tried_once = Some(tried_once);
            for tried in 1..=TRIES {
                let changed = change(&shared.store, &key, &shared.policy).await;
                if let Some(tried_once) = tried_once.take() {
                    let _ = tried_once.send(());
                }
                match changed {
                    Ok(_) => break,
                    Err(error) if tried == TRIES => {
                        tracing::warn!(target: "tower_redis_ratelimit", error = %crate::chain::Chain(&error), "{failed}");
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            if wake {
                shared.lookers.look_now(&key);
            }
        });
        heard
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

/// Measures the round trip to the store for a layer's first wait, once for all the calls that
/// come meanwhile (each waits at most `patience` for it): two looks at no reservation, the
/// first of which may also load the script, or connect.
pub(super) async fn measure<St: Store>(shared: Arc<Shared<St>>, key: Key, patience: Duration) {
    let measured = shared.measured.get_or_init(|| async {
        let nobody = Ticket::new(0, Duration::ZERO);
        let _ = shared.store.look(&key, &shared.policy, nobody).await;
        let sent = shared.clock.now();
        let looked = shared.store.look(&key, &shared.policy, nobody).await;
        let received = shared.clock.now();
        if looked.is_ok() {
            shared.reach.first_round_trip(received - sent, received);
        }
    });
    let _ = tokio::time::timeout(patience, measured).await;
}
