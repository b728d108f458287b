//! The concurrency slots of one layer's requests in flight: each is given back when its
//! response ends (the [`Slot`] guard, dropped by the response body), and renewed while it
//! runs, in batches, by one task per layer.
//!
//! A give-back and a renewal go to the store the way a usage settle does (`usage::Ledger`):
//! on Redis as requests of the policy's script, batched with the decisions under way, so a
//! request costs one script run to take its slot (with its decision) and a share of one to
//! give it back. The renewal task ticks at a quarter of the shortest slot lifetime held and
//! sends every slot due at once; it ends with the layer, and with its runtime: an instance that
//! dies renews nothing, and its slots count no more once they expire.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::response::Responder;
use crate::usage::{Entry, InFlight, Ledger};
use crate::{Decision, Key, Policy, Settlement};

/// How many hold times per policy the median of a refusal's `Retry-After` is taken over.
const HOLD_TIMES: usize = 64;

/// The slots a layer holds, and what it knows of how long they are held.
pub(crate) struct Holds {
    held: Mutex<Registry>,
    /// A serial per slot held, the key of `held`.
    next: AtomicU64,
    /// The settles under way (shared with usage), for `RateLimitLayer::settled`.
    in_flight: Arc<InFlight>,
    /// The renewal task, once started: started again on the runtime at hand if the one it
    /// ran on has shut down (a layer used first from a short-lived runtime, say).
    renewer: Mutex<Option<JoinHandle<()>>>,
    /// Wakes the renewal task when a slot is taken.
    wake: Arc<Notify>,
    /// The latest hold times of each policy, for the `Retry-After` of its refusals.
    hold_times: Mutex<ByU64<HoldTimes>>,
    /// The requests waiting for a slot (`RateLimitLayerBuilder::max_wait`), per policy
    /// identity and key, in arrival order; set `queued` once any has waited, so that a layer
    /// that never waits does not look here at each give-back.
    queues: Mutex<Lines>,
    queued: AtomicBool,
}

/// A map keyed by a serial or a hash already made, hashed cheaply.
type ByU64<V> = hashbrown::HashMap<u64, V, foldhash::fast::FixedState>;

/// A queue of requests waiting for a slot: the policy's identity and the key.
type Queue = (Arc<str>, Key);

/// The requests in a queue, first in line first: each one's serial and what wakes it.
type Line = VecDeque<(u64, Arc<Notify>)>;

/// The lines of a layer. Keyed by what clients send, so hashed with a seed of its own.
type Lines = hashbrown::HashMap<Queue, Line, foldhash::fast::RandomState>;

/// What wakes the first request in line of `queue`, if any.
fn first_in(queues: &Lines, queue: &QueueOf<'_>) -> Option<Arc<Notify>> {
    let (_, wake) = queues.get(queue).and_then(VecDeque::front)?;
    Some(Arc::clone(wake))
}

/// A [`Queue`] by reference, to look one up without cloning its key: hashed and compared as
/// the tuple is.
#[derive(Hash)]
struct QueueOf<'a>(&'a str, &'a Key);

impl hashbrown::Equivalent<Queue> for QueueOf<'_> {
    fn equivalent(&self, queue: &Queue) -> bool {
        *self.0 == *queue.0 && *self.1 == queue.1
    }
}

/// The slots in use, by serial, and the renewal task's tick in µs (`u64::MAX` while it is
/// idle): read and written under one lock, so that a slot taken sees the tick the task sleeps
/// on.
struct Registry {
    slots: ByU64<Held>,
    tick: u64,
    /// The task's ticks in a row that found nothing held.
    empty: u32,
}

/// How many ticks in a row that find nothing held the renewal task keeps its pace before it
/// goes idle. Short requests leave the registry empty between them again and again; an idle
/// task would be woken by the next slot taken each time, and a task that keeps its pace is
/// not.
const EMPTY_TICKS: u32 = 4;

/// One slot in use.
struct Held {
    key: Key,
    responder: Arc<Responder>,
    ledger: Arc<dyn Ledger>,
    decision: Decision,
    /// When it was taken or last renewed.
    renewed: Instant,
    /// Found gone at a renewal: no longer renewed, nor reported again.
    gone: bool,
}

/// The latest hold times of one policy, a ring.
#[derive(Default)]
struct HoldTimes {
    times: Vec<Duration>,
    next: usize,
}

impl HoldTimes {
    fn add(&mut self, held: Duration) {
        if self.times.len() < HOLD_TIMES {
            self.times.push(held);
        } else {
            self.times[self.next] = held;
        }
        self.next = (self.next + 1) % HOLD_TIMES;
    }

    fn median(&self) -> Option<Duration> {
        let mut times = self.times.clone();
        times.sort_unstable();
        times.get(times.len() / 2).copied()
    }
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds").finish_non_exhaustive()
    }
}

impl Holds {
    pub(crate) fn new(in_flight: Arc<InFlight>) -> Holds {
        Holds {
            held: Mutex::new(Registry {
                slots: ByU64::default(),
                tick: u64::MAX,
                empty: 0,
            }),
            next: AtomicU64::new(0),
            in_flight,
            renewer: Mutex::new(None),
            wake: Arc::new(Notify::new()),
            hold_times: Mutex::default(),
            queues: Mutex::default(),
            queued: AtomicBool::new(false),
        }
    }

    /// The settles under way, slots' and usage's.
    pub(crate) fn in_flight(&self) -> &Arc<InFlight> {
        &self.in_flight
    }

    /// Holds the slot `decision` took for `key`, given back through `ledger` when the returned
    /// guard drops; `None` when it took none.
    pub(crate) fn hold(
        self: &Arc<Self>,
        key: &Key,
        responder: &Arc<Responder>,
        ledger: Arc<dyn Ledger>,
        decision: Decision,
    ) -> Option<Slot> {
        decision.slot?;
        let serial = self.next.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let held = Held {
            key: key.clone(),
            responder: Arc::clone(responder),
            ledger,
            decision,
            renewed: now,
            gone: false,
        };
        let quarter = micros(responder.policy.slot_lifetime() / 4);
        // The task sleeps until woken while idle, and otherwise ticks at a quarter of the
        // shortest lifetime it knows: wake it only when that is too slow for this one, and
        // set the pace now, so that the slots taken before it looks do not wake it again.
        let wake = {
            let mut all = crate::shards::lock(&self.held);
            all.slots.insert(serial, held);
            let wake = quarter < all.tick;
            if wake {
                (all.tick, all.empty) = (quarter, 0);
            }
            wake
        };
        crate::metrics::Report::slots_in_use(&responder.policy, 1.0);
        self.start_renewing(wake);
        Some(Slot {
            holds: Arc::clone(self),
            serial,
            since: now,
        })
    }

    /// How long a refused request should wait for a slot of `policy`: the median of the
    /// latest hold times, capped at the slot lifetime and never under 1 s (`Retry-After` counts
    /// whole seconds, and 0 would invite a retry storm); 1 s before any is known.
    pub(crate) fn retry_after(&self, policy: &Policy) -> Duration {
        let times = crate::shards::lock(&self.hold_times);
        let median = times
            .get(&policy.state_id().hash)
            .and_then(HoldTimes::median);
        let second = Duration::from_secs(1);
        median
            .unwrap_or(second)
            .min(policy.slot_lifetime())
            .max(second)
    }

    /// Starts the renewal task on the current runtime unless it runs; wakes it (`wake`)
    /// otherwise.
    fn start_renewing(self: &Arc<Self>, wake: bool) {
        let mut renewer = crate::shards::lock(&self.renewer);
        if renewer.as_ref().is_some_and(|task| !task.is_finished()) {
            if wake {
                self.wake.notify_one();
            }
            return;
        }
        // No runtime (a memory store called from plain code): nothing to renew with; the
        // next slot taken within a runtime starts the task.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let task = renew(Arc::downgrade(self), Arc::clone(&self.wake));
            *renewer = Some(runtime.spawn(task));
        }
    }

    /// A renewal found slot `serial` gone from the store. Unless it was given back meanwhile
    /// (a renewal sent just before its body ended may land after the give-back), it was lost:
    /// it expired unrenewed (the store out of reach longer than its lifetime) or the store
    /// lost its state. Its request runs on, no longer counted against the limit, so the key
    /// may have one more request in flight than its limit until it ends. Logged and counted
    /// once; the slot is renewed no more.
    pub(crate) fn gone(&self, serial: u64) {
        let mut all = crate::shards::lock(&self.held);
        let Some(slot) = all.slots.get_mut(&serial).filter(|slot| !slot.gone) else {
            return;
        };
        slot.gone = true;
        let (key, policy) = (slot.key.clone(), slot.responder.policy.clone());
        drop(all);
        crate::metrics::Report::slot_lost(&policy);
        tracing::warn!(
            target: "tower_redis_ratelimit",
            policy = policy.name(),
            key = %key.loggable(),
            "a concurrency slot was gone at its renewal (the store was out of reach longer \
             than the slot lifetime, or lost its state): the request runs on uncounted"
        );
    }

    /// Gives back slot `serial`, held for `held`.
    fn give_back(&self, serial: u64, held: Duration) {
        let Some(slot) = crate::shards::lock(&self.held).slots.remove(&serial) else {
            return;
        };
        let policy = &slot.responder.policy;
        crate::metrics::Report::slots_in_use(policy, -1.0);
        crate::shards::lock(&self.hold_times)
            .entry(policy.state_id().hash)
            .or_default()
            .add(held);
        if let Some(release) = Settlement::release(&slot.decision) {
            let first = self.queued.load(Ordering::Acquire).then(|| {
                let queues = crate::shards::lock(&self.queues);
                first_in(&queues, &QueueOf(policy.identity(), &slot.key))
            });
            let entry = Entry::slot(slot.key, slot.responder, release, None);
            slot.ledger.settle(entry, &self.in_flight);
            // Once the give-back is on its way (done, on the memory store): the first request
            // in line for the key asks again. On Redis its ask may land before the give-back,
            // and it then asks again 50 ms later. (Had the first left meanwhile, its leaving
            // woke the next.)
            if let Some(wake) = first.flatten() {
                wake.notify_one();
            }
        }
    }

    /// Puts a request refused for a slot of `key` under `policy` in line, after those of this
    /// layer already waiting for one.
    pub(crate) fn queue(self: &Arc<Self>, key: &Key, policy: &Policy) -> InLine {
        self.queued.store(true, Ordering::Release);
        let queue = (Arc::clone(policy.state_id().text), key.clone());
        let serial = self.next.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(Notify::new());
        crate::shards::lock(&self.queues)
            .entry(queue.clone())
            .or_default()
            .push_back((serial, Arc::clone(&wake)));
        InLine {
            holds: Arc::clone(self),
            queue,
            serial,
            wake,
        }
    }

    /// Whether requests of `key` under `policy` wait for a slot here: a new one joins them
    /// at the back rather than asking the store before them.
    pub(crate) fn has_line(&self, key: &Key, policy: &Policy) -> bool {
        if !self.queued.load(Ordering::Acquire) {
            return false;
        }
        let queues = crate::shards::lock(&self.queues);
        queues.contains_key(&QueueOf(policy.identity(), key))
    }

    /// Sends a renewal of every slot held for a quarter of its lifetime or more since it was
    /// taken or last renewed, all at once; returns the tick until the next look, a quarter of
    /// the shortest lifetime held, or while nothing is held the last tick for
    /// [`EMPTY_TICKS`] looks (`None`: idle until a slot is taken). Ticking at that pace, a slot is
    /// renewed before half its lifetime has passed, and each tick's renewals leave together
    /// (batched into a few script calls on Redis) rather than one call per slot as each
    /// comes due.
    fn renew_due(self: &Arc<Self>, now: Instant) -> Option<Duration> {
        let mut due = Vec::new();
        let mut tick: Option<Duration> = None;
        {
            let mut all = crate::shards::lock(&self.held);
            for (&serial, slot) in all.slots.iter_mut().filter(|(_, slot)| !slot.gone) {
                let quarter = slot.responder.policy.slot_lifetime() / 4;
                tick = Some(tick.map_or(quarter, |t| t.min(quarter)));
                if now.saturating_duration_since(slot.renewed) >= quarter {
                    slot.renewed = now;
                    let renew = Settlement::renew(&slot.decision);
                    let about = (slot.key.clone(), Arc::clone(&slot.responder), serial);
                    due.extend(renew.map(|r| (about, r, Arc::clone(&slot.ledger))));
                }
            }
            match tick {
                Some(tick) => (all.tick, all.empty) = (micros(tick), 0),
                None if all.tick != u64::MAX && all.empty < EMPTY_TICKS => {
                    all.empty += 1;
                    tick = Some(Duration::from_micros(all.tick));
                }
                None => all.tick = u64::MAX,
            }
        }
        for ((key, responder, serial), renew, ledger) in due {
            let holder = Some((Arc::downgrade(self), serial));
            ledger.settle(Entry::slot(key, responder, renew, holder), &self.in_flight);
        }
        tick
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The renewal task of `holds`, until the layer is dropped.
async fn renew(holds: Weak<Holds>, wake: Arc<Notify>) {
    /// How long the task sleeps with nothing held before it looks whether the layer is gone.
    const IDLE: Duration = Duration::from_secs(60);
    loop {
        let woken = wake.notified();
        let tick = match holds.upgrade() {
            Some(holds) => holds.renew_due(Instant::now()),
            None => return,
        };
        // Woken early by a first slot, or one whose lifetime is shorter than the others'.
        let _ = tokio::time::timeout(tick.unwrap_or(IDLE), woken).await;
    }
}

/// A request's place in line for a slot of its key on this instance: only the first in line
/// asks the store again, so that slots go in arrival order. Dropping it (the request got a
/// slot, gave up, or its client went away) leaves the line and wakes the next.
pub(crate) struct InLine {
    holds: Arc<Holds>,
    queue: Queue,
    serial: u64,
    wake: Arc<Notify>,
}

impl InLine {
    /// Whether no request of the key came before this one.
    pub(crate) fn is_first(&self) -> bool {
        let queues = crate::shards::lock(&self.holds.queues);
        let first = queues.get(&self.queue).and_then(VecDeque::front);
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
        let mut queues = crate::shards::lock(&self.holds.queues);
        let Some(line) = queues.get_mut(&self.queue) else {
            return;
        };
        let first = line
            .front()
            .is_some_and(|&(serial, _)| serial == self.serial);
        line.retain(|&(serial, _)| serial != self.serial);
        if line.is_empty() {
            queues.remove(&self.queue);
        } else if first {
            // The next in line asks the store now: the slot this one got, or did not wait
            // for, may leave room for it too.
            let (identity, key) = &self.queue;
            if let Some(wake) = first_in(&queues, &QueueOf(identity, key)) {
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
    /// Waits for a [`InLine`]'s wake-up or its deadline.
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

/// A concurrency slot held by a request in flight: dropping it gives the slot back. The
/// response body holds it until the body ends, fails or is dropped.
pub(crate) struct Slot {
    holds: Arc<Holds>,
    serial: u64,
    since: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.holds.give_back(self.serial, self.since.elapsed());
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("serial", &self.serial)
            .finish()
    }
}
