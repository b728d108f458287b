//! The concurrency slots of one layer's requests in flight: each is given back when its
//! response ends (the [`Slot`] guard, dropped by the response body), and renewed while it
//! runs, in batches, by one task per layer.
//!
//! A give-back and a renewal are posted to the store as a usage settle is
//! ([`Ledger`](super::post::Ledger)): on Redis as slot operations of the policy's script call,
//! batched with the decisions under way, so a request costs one script run to take its slot (with
//! its decision) and a share of one to give it back. The renewal task ticks at a quarter of the
//! shortest slot lifetime held and sends every slot due at once; it ends with the layer, and with
//! its runtime: an instance that dies renews nothing, and its slots count no more once they expire.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::post::{InFlight, Ledger, Posting};
use crate::ledger::queue::Queues;
use crate::response::Responder;
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
    /// The requests waiting for a slot (`RateLimitLayerBuilder::max_wait`), woken by a
    /// give-back here.
    queues: Arc<Queues>,
    /// How many slots are held alone ([`hold_alone`](Self::hold_alone)).
    alone: AtomicU64,
}

/// A map keyed by a serial or a hash already made, hashed cheaply.
type ByU64<V> = hashbrown::HashMap<u64, V, foldhash::fast::FixedState>;

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
    /// Held alone, no store keeping it ([`Holds::hold_alone`]).
    alone: bool,
}

/// The latest hold times of one policy, a ring.
#[derive(Default)]
struct HoldTimes {
    times: Vec<Duration>,
    next: usize,
    /// How many of `times` are a second or more.
    long: usize,
    /// Whether the store's typical hold time for a key of the policy, as its last refusal here
    /// said, was a second or more.
    store_long: bool,
}

/// The shortest `Retry-After`: a refusal never says less, so hold times shorter than this
/// matter to the store only among longer ones.
const SECOND: Duration = Duration::from_secs(1);

impl HoldTimes {
    fn add(&mut self, held: Duration) {
        if self.times.len() < HOLD_TIMES {
            self.times.push(held);
        } else {
            let old = std::mem::replace(&mut self.times[self.next], held);
            self.long -= usize::from(old >= SECOND);
        }
        self.long += usize::from(held >= SECOND);
        self.next = (self.next + 1) % HOLD_TIMES;
    }

    /// Whether the store should hear of the next hold time: where a `Retry-After` may say
    /// more than a second (never less), because a hold of a second or more was seen lately,
    /// here (the last 64) or by the store (its last refusal here), so that short holds bring
    /// the store's average back down.
    fn worth_telling(&self, held: Duration) -> bool {
        held >= SECOND || self.long > 0 || self.store_long
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
            queues: Arc::default(),
            alone: AtomicU64::new(0),
        }
    }

    /// The settles under way, slots' and usage's.
    pub(crate) fn in_flight(&self) -> &Arc<InFlight> {
        &self.in_flight
    }

    /// The requests waiting for a slot.
    pub(crate) fn queues(&self) -> &Arc<Queues> {
        &self.queues
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
            alone: false,
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

    /// Gives back what the store gave `decision` though the layer refuses its request (this
    /// instance holds the key's cap alone): its slot, and the units it recorded, since a
    /// refused request counts for nothing.
    pub(crate) fn release_unused(
        &self,
        key: &Key,
        responder: &Arc<Responder>,
        ledger: &Arc<dyn Ledger>,
        decision: &Decision,
    ) {
        let refund = Settlement::refund(decision, decision.recorded).filter(|r| r.units() > 0);
        for settlement in Settlement::release(decision).into_iter().chain(refund) {
            let posting = Posting::new(key.clone(), Arc::clone(responder), settlement, None);
            ledger.settle(posting, &self.in_flight);
        }
    }

    /// Whether this layer holds `key`'s cap of slots under `responder`'s policy, counting one
    /// the store just gave it, while it holds any slot alone: the store does not count
    /// those, so after an outage it may admit past the cap. Cheap while none is held alone.
    pub(crate) fn over_cap_with_alone(&self, key: &Key, responder: &Arc<Responder>) -> bool {
        self.alone.load(Ordering::Relaxed) != 0 && self.at_cap(key, responder)
    }

    /// Whether this layer holds the cap of `key`'s slots under `responder`'s policy's state
    /// (every rule of the layer that shares it), the store's and its own
    /// ([`hold_alone`](Self::hold_alone)).
    pub(crate) fn at_cap(&self, key: &Key, responder: &Arc<Responder>) -> bool {
        Self::full(&crate::shards::lock(&self.held), key, responder)
    }

    fn full(all: &Registry, key: &Key, responder: &Arc<Responder>) -> bool {
        let cap = responder.policy.concurrency_limit().unwrap_or(u32::MAX) as usize;
        let state = responder.policy.state_id();
        let shares =
            |slot: &&Held| slot.key == *key && state.is(slot.responder.policy.state_id().text);
        all.slots.values().filter(shares).count() >= cap
    }

    /// Holds a slot of `key` that no store keeps, while the store is out of reach under
    /// [`FailureMode::Open`](crate::FailureMode::Open): only while this layer holds fewer than
    /// the policy's cap of the key's slots, so that each instance keeps the cap on its own;
    /// `None` at the cap. It is neither renewed nor given back to a store: its decision took no
    /// slot, and `ledger` is never used.
    pub(crate) fn hold_alone(
        self: &Arc<Self>,
        key: &Key,
        responder: &Arc<Responder>,
        ledger: Arc<dyn Ledger>,
    ) -> Option<Slot> {
        responder.policy.concurrency_limit()?;
        let serial = self.next.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        {
            let mut all = crate::shards::lock(&self.held);
            if Self::full(&all, key, responder) {
                return None;
            }
            let held = Held {
                key: key.clone(),
                responder: Arc::clone(responder),
                ledger,
                decision: Decision::slots_full(&responder.policy, Duration::ZERO),
                renewed: now,
                gone: false,
                alone: true,
            };
            all.slots.insert(serial, held);
        }
        self.alone.fetch_add(1, Ordering::Relaxed);
        crate::metrics::Report::slots_in_use(&responder.policy, 1.0);
        Some(Slot {
            holds: Arc::clone(self),
            serial,
            since: now,
        })
    }

    /// How long a refused request should wait for a slot of `policy`: the key's typical hold
    /// time across the fleet, `known` by the store (zero: it keeps none), else the median of
    /// this layer's latest hold times; capped at the slot lifetime and never under 1 s
    /// (`Retry-After` counts whole seconds, and 0 would invite a retry storm); 1 s before any
    /// is known.
    pub(crate) fn retry_after(&self, policy: &Policy, known: Duration) -> Duration {
        let typical = {
            let mut times = crate::shards::lock(&self.hold_times);
            let own = times.entry(policy.state_id().hash).or_default();
            if !known.is_zero() {
                own.store_long = known >= SECOND;
            }
            match known.is_zero() {
                false => Some(known),
                true => own.median(),
            }
        };
        typical
            .unwrap_or(SECOND)
            .min(policy.slot_lifetime())
            .max(SECOND)
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
    fn gone(&self, serial: u64) {
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
    fn release(&self, serial: u64, held: Duration) {
        let Some(slot) = crate::shards::lock(&self.held).slots.remove(&serial) else {
            return;
        };
        if slot.alone {
            self.alone.fetch_sub(1, Ordering::Relaxed);
        }
        let policy = &slot.responder.policy;
        crate::metrics::Report::slots_in_use(policy, -1.0);
        let tell = {
            let mut times = crate::shards::lock(&self.hold_times);
            let own = times.entry(policy.state_id().hash).or_default();
            own.add(held);
            own.worth_telling(held)
        };
        // The store keeps the key's typical hold time for the `Retry-After` of refusals, never
        // under a second: a policy whose requests hold slots for less tells it nothing, and
        // saves it the writes (two commands per give-back on Redis).
        let told = if tell { held } else { Duration::ZERO };
        if let Some(release) = Settlement::release_after(&slot.decision, told) {
            let first = self.queues.first(&slot.key, policy);
            let mut entry = Posting::new(slot.key, slot.responder, release, None);
            // Once the store has the slot back (at once, on the memory store), the first
            // request queued for the key asks again; asked before, it would find the slot
            // still taken, and ask again only at its next look, 50 ms on. (Had the first left
            // meanwhile, its leaving woke the next.)
            if let Some(wake) = first {
                entry = entry.then(Box::new(move || wake.notify_one()));
            }
            slot.ledger.settle(entry, &self.in_flight);
        }
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
            let holds = Arc::downgrade(self);
            let on_gone = Box::new(move || {
                if let Some(holds) = holds.upgrade() {
                    holds.gone(serial);
                }
            });
            let entry = Posting::renewal(key, responder, renew, on_gone);
            ledger.settle(entry, &self.in_flight);
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

/// A concurrency slot held by a request in flight: dropping it gives the slot back. The
/// response body holds it until the body ends, fails or is dropped.
pub(crate) struct Slot {
    holds: Arc<Holds>,
    serial: u64,
    since: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.holds.release(self.serial, self.since.elapsed());
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("serial", &self.serial)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_hears_of_holds_while_a_long_one_was_seen_lately() {
        let mut times = HoldTimes::default();
        let ms = Duration::from_millis;
        times.add(ms(10));
        assert!(!times.worth_telling(ms(10)), "short holds only");
        assert!(times.worth_telling(ms(2_000)));
        times.add(ms(2_000));
        // The long one is among the last 64: short ones are told too, until it has left.
        assert!(times.worth_telling(ms(20)));
        for _ in 0..HOLD_TIMES {
            times.add(ms(5));
        }
        assert!(!times.worth_telling(ms(20)));
        assert_eq!(times.median(), Some(ms(5)));
        // The store said a key's slots are held a second or more: short holds are told.
        times.store_long = true;
        assert!(times.worth_telling(ms(20)));
    }
}
