//! The embedded store: state in this process, for one instance, development and tests.

use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::overrides::{Applied, Overrides, Table};
use super::{Store, StoreError};
use crate::algorithm::{
    decide, fixed_window::FixedWindow, gcra::Gcra, settle, sliding_log::SlidingLog,
    sliding_window::SlidingWindow, Algorithm, Outcome, Refund, Settle,
};
use crate::concurrency::Slots;
use crate::shards::Shards;
use crate::{Decision, Key, Policy, Settlement};

/// The time for [`MemoryStore`]: elapsed since the UNIX epoch.
///
/// Wall-clock based, so that event times ([`Store::check_at`]) and fixed windows (aligned to
/// the epoch) mean the same as in Redis. Must not go backwards. Inject one to test with virtual
/// time; see [`ManualClock`] and [`TokioClock`].
pub trait Clock: Send + Sync + 'static {
    /// The time elapsed since the UNIX epoch.
    fn now(&self) -> Duration;
}

/// The default clock: the system time when the clock is made, advanced by tokio's monotonic
/// `Instant`. It follows tokio's paused test clock (`#[tokio::test(start_paused = true)]`,
/// `tokio::time::advance`) when there is one, and never goes backwards.
#[derive(Debug, Clone)]
pub struct TokioClock {
    start: Duration,
    origin: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::starting_at(SystemTime::now())
    }
}

impl TokioClock {
    /// A clock that reads `start` now and advances with tokio's clock.
    pub fn starting_at(start: SystemTime) -> Self {
        TokioClock {
            start: since_epoch(start),
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.start + tokio::time::Instant::now().saturating_duration_since(self.origin)
    }
}

/// A clock that moves only when told to; clones share one time. Starts at the UNIX epoch.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::{Clock, ManualClock};
///
/// let clock = ManualClock::default();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now(), Duration::from_millis(1500));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start`.
    pub fn starting_at(start: SystemTime) -> Self {
        let clock = ManualClock::default();
        clock.advance(since_epoch(start));
        clock
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.micros.fetch_add(micros(by), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::SeqCst))
    }
}

fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default()
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u64::MAX as u128) as u64
}

/// Rate-limit state kept in this process.
///
/// Bounded: it holds at most [`max_keys`](MemoryStoreBuilder::max_keys) keys (client ×
/// policy), and forgets a key once its policy's longest window has passed without a request,
/// since its state would be empty by then. When the bound is reached, expired keys are dropped
/// first, then the least recently used ones (a refused request counts as use); an evicted key starts
/// again with a full budget, so size the bound above the number of clients you expect within
/// the longest window.
///
/// Keys are spread over independently locked shards, and a decision holds one shard's lock for
/// the few arithmetic steps it takes, so concurrent requests rarely wait on each other. Runs
/// the same algorithms as [`RedisStore`](crate::RedisStore). Clones share state.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    entries: Shards<State>,
    /// The id of the next concurrency slot taken.
    next_slot: AtomicU64,
    clock: Arc<dyn Clock>,
    overrides: Arc<Table>,
}

/// One key's state: when it was created, and its algorithm's state.
struct State {
    /// The store's time (µs) the state was created at. A refund applies only to state created
    /// no later than the request it refunds: state made afresh since (a reset, an expiry,
    /// an eviction) never held its units.
    born: u64,
    of: Of,
    /// Until when (µs) the key is in its policy's penalty box; 0 when it never was.
    boxed_until: u64,
    /// The key's concurrency slots, when its policy has a concurrency limit.
    slots: Slots,
}

/// The state of one key under the algorithm of its policy.
enum Of {
    Log(SlidingLog),
    Sliding(SlidingWindow),
    Fixed(FixedWindow),
    Gcra(Gcra),
}

impl State {
    fn new(algorithm: Algorithm, now: u64) -> State {
        let of = match algorithm {
            Algorithm::SlidingLog => Of::Log(SlidingLog::default()),
            Algorithm::SlidingWindow => Of::Sliding(SlidingWindow::default()),
            Algorithm::FixedWindow => Of::Fixed(FixedWindow::default()),
            Algorithm::Gcra => Of::Gcra(Gcra::default()),
        };
        State {
            born: now,
            of,
            boxed_until: 0,
            slots: Slots::default(),
        }
    }

    /// Puts the key in `policy`'s penalty box from `now`, if it has one; until when.
    fn penalize(&mut self, now: u64, policy: &Policy) -> Option<u64> {
        let block = policy.block_micros();
        (block > 0).then(|| {
            self.boxed_until = now.saturating_add(block);
            self.boxed_until
        })
    }

    /// Puts the key in `policy`'s penalty box, if it has one, when a charge has left it no
    /// unit (a look for one more would be refused); until when.
    fn penalize_if_full(&mut self, now: u64, policy: &Policy) -> Option<u64> {
        if policy.block_micros() == 0 || self.decide(now, now, policy, 1, false).allowed {
            return None;
        }
        self.penalize(now, policy)
    }

    fn algorithm(&self) -> Algorithm {
        match self.of {
            Of::Log(_) => Algorithm::SlidingLog,
            Of::Sliding(_) => Algorithm::SlidingWindow,
            Of::Fixed(_) => Algorithm::FixedWindow,
            Of::Gcra(_) => Algorithm::Gcra,
        }
    }

    /// Decides at `t` (µs); `now` is the store's time, which may differ for event times.
    fn decide(&mut self, now: u64, t: u64, policy: &Policy, cost: u64, record: bool) -> Outcome {
        let windows = policy.windows();
        match &mut self.of {
            Of::Log(log) => {
                trim(log, now.min(t), policy);
                decide(log, t, windows, cost, record)
            }
            Of::Sliding(s) => decide(s, t, windows, cost, record),
            Of::Fixed(s) => decide(s, t, windows, cost, record),
            Of::Gcra(s) => decide(s, t, windows, cost, record),
        }
    }

    /// Records a settlement at `now`; returns how long the state matters from now on, when
    /// that can be longer than the policy's retention (a GCRA bucket charged past its size).
    fn settle(&mut self, now: u64, policy: &Policy, change: Settle) -> u64 {
        let windows = policy.windows();
        if let Settle::Refund(Refund { at, .. }) = change {
            if at.is_none_or(|at| at < self.born) {
                return 0;
            }
        }
        match &mut self.of {
            Of::Log(log) => {
                trim(log, now, policy);
                settle(log, now, windows, change);
                0
            }
            Of::Sliding(s) => {
                settle(s, now, windows, change);
                0
            }
            Of::Fixed(s) => {
                settle(s, now, windows, change);
                0
            }
            Of::Gcra(s) => {
                settle(s, now, windows, change);
                s.drained_in(now, windows)
            }
        }
    }
}

/// Drops the events no window around `t` or later can hold.
fn trim(log: &mut SlidingLog, t: u64, policy: &Policy) {
    if let Some(cutoff) = t.checked_sub(micros(policy.longest_window())) {
        log.trim(cutoff);
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// The number of keys a store holds at most unless told otherwise.
    pub const DEFAULT_MAX_KEYS: u64 = 100_000;

    /// A store with the default bound and clock.
    pub fn new() -> Self {
        MemoryStore::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_keys: Self::DEFAULT_MAX_KEYS,
            clock: None,
        }
    }

    /// The number of events (admitted requests, one each whatever its cost) a sliding log
    /// holds for `key` under `policy` that are younger than its longest window.
    ///
    /// Meant for tests and diagnostics; 0 for other algorithms and expired keys.
    pub fn events(&self, key: &Key, policy: &Policy) -> usize {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(slot) if slot.is_live(now) => match &mut slot.value.of {
                Of::Log(log) => {
                    trim(log, now, policy);
                    log.events()
                }
                _ => 0,
            },
            _ => 0,
        }
    }

    /// The concurrency slots ([`Policy::concurrency`]) that `key` holds under `policy` now:
    /// its requests in flight, counted on every instance that shares this store.
    ///
    /// Meant for tests and diagnostics.
    pub fn slots_in_use(&self, key: &Key, policy: &Policy) -> usize {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(slot) if slot.is_live(now) => slot.value.slots.live(now),
            _ => 0,
        }
    }

    /// The store's overrides: limits changed at run time for a key or a whole policy,
    /// applied to every decision of this store and its clones from the next one on.
    pub fn overrides(&self) -> Overrides {
        Overrides::memory(Arc::clone(&self.shared.overrides))
    }

    /// The number of keys held, once expired ones are dropped.
    pub fn key_count(&self) -> u64 {
        self.shared.entries.len(self.now())
    }

    fn now(&self) -> u64 {
        micros(self.shared.clock.now())
    }

    /// Decides at event time `at` (`None`: now).
    fn decide(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        at: Option<SystemTime>,
        record: bool,
    ) -> Ready<Result<Decision, StoreError>> {
        let algorithm = policy.algorithm();
        if let Err(error) = super::in_range(policy) {
            return ready(Err(error));
        }
        if at.is_some() && algorithm != Algorithm::SlidingLog {
            return ready(Err(StoreError::Unsupported(
                "event times need the sliding log algorithm",
            )));
        }
        if at.is_some() && policy.concurrency_limit().is_some() {
            return ready(Err(StoreError::Unsupported(
                "event times take no concurrency slot",
            )));
        }
        let now = self.now();
        let t = at.map_or(now, |at| micros(since_epoch(at)));
        let cost = u64::from(cost);
        // The slot an admitted request takes, and until when: only a recorded decision takes one.
        let take = policy.concurrency_limit().filter(|_| record).map(|cap| {
            let id = self.shared.next_slot.fetch_add(1, Ordering::Relaxed);
            (cap, id, now.saturating_add(policy.slot_micros()))
        });
        let other;
        let policy = match self.shared.overrides.apply(key, policy) {
            Applied::Own(policy) => policy,
            Applied::Other(policy) => {
                other = policy;
                &other
            }
            Applied::Blocked => return ready(Ok(Decision::blocked(policy))),
        };
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        // Set when the key is in its penalty box: until when.
        let mut boxed = None;
        let outcome = match shard.get(key, policy.state_id(), now) {
            Some(slot) => {
                if !slot.is_live(now) || slot.value.algorithm() != algorithm {
                    slot.value = State::new(algorithm, now);
                }
                if slot.value.boxed_until > now {
                    let left = Duration::from_micros(slot.value.boxed_until - now);
                    return ready(Ok(Decision::boxed(policy, left)));
                }
                if let Some((cap, _, _)) = take {
                    if let Some(left) = slot.value.slots.full(now, cap) {
                        let left = Duration::from_micros(left);
                        return ready(Ok(Decision::slots_full(policy, left)));
                    }
                }
                let outcome = slot.value.decide(now, t, policy, cost, record);
                if outcome.allowed && record {
                    slot.expires = slot.expires.max(expiry(policy, now, t));
                    if let Some((_, id, until)) = take {
                        slot.value.slots.take(id, until);
                        slot.expires = slot.expires.max(until);
                    }
                } else if record && outcome.retry_after.is_some() {
                    // Refused by a limit that a wait satisfies: not a request larger than the
                    // limit itself, which no wait helps and the key did not earn.
                    boxed = slot.value.penalize(now, policy);
                    slot.expires = slot.expires.max(boxed.unwrap_or(0));
                }
                outcome
            }
            None => {
                let mut state = State::new(algorithm, now);
                let outcome = state.decide(now, t, policy, cost, record);
                if outcome.allowed && record {
                    let mut expires = expiry(policy, now, t);
                    if let Some((_, id, until)) = take {
                        state.slots.take(id, until);
                        expires = expires.max(until);
                    }
                    shard.insert(key, policy.state_id(), now, expires, state);
                } else if record && outcome.retry_after.is_some() {
                    boxed = state.penalize(now, policy);
                    if let Some(until) = boxed {
                        shard.insert(key, policy.state_id(), now, until, state);
                    }
                }
                outcome
            }
        };
        drop(shard);
        if let Some(until) = boxed {
            return ready(Ok(Decision::boxed(
                policy,
                Duration::from_micros(until - now),
            )));
        }
        let mut decision = Decision::from_outcome(outcome, policy);
        if let Some((_, id, _)) = take {
            decision = decision.with_slot(id);
        }
        let at = i64::try_from(t).ok();
        ready(Ok(match record {
            true => decision.recorded_at(at, cost),
            false => decision,
        }))
    }

    /// Gives back (`renew` false) or renews concurrency slot `id` of `key` under `policy`;
    /// whether a slot to renew was still held.
    fn keep_slot(&self, key: &Key, policy: &Policy, id: u64, renew: bool) -> bool {
        let now = self.now();
        let until = now.saturating_add(policy.slot_micros());
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let kept = match shard.get(key, policy.state_id(), now) {
            Some(slot) if !slot.is_live(now) => false,
            Some(slot) if !renew => return slot.value.slots.give_back(id),
            Some(slot) => {
                let kept = slot.value.slots.renew(now, id, until);
                slot.expires = slot.expires.max(slot.value.slots.last_expiry());
                kept
            }
            None => false,
        };
        kept
    }

    /// Records `settlement` for `key` under `policy`, now.
    fn settle_now(&self, key: &Key, policy: &Policy, settlement: Settlement) {
        let now = self.now();
        // Settled under the counts the key is decided by; a blocked key's under its own.
        let other;
        let policy = match self.shared.overrides.apply(key, policy) {
            Applied::Other(policy) => {
                other = policy;
                &other
            }
            _ => policy,
        };
        let algorithm = policy.algorithm();
        let change = match settlement {
            Settlement::Charge(units) => Settle::Charge(units.count()),
            Settlement::Refund(units) => Settle::Refund(Refund {
                units: units.count(),
                at: units.admitted_at().and_then(|at| u64::try_from(at).ok()),
                recorded: units.recorded(),
            }),
            // Slots are kept by `keep_slot`; they record no units.
            Settlement::Release(_) | Settlement::Renew(_) => Settle::Charge(0),
        };
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(slot) => {
                if !slot.is_live(now) || slot.value.algorithm() != algorithm {
                    slot.value = State::new(algorithm, now);
                }
                let drained = slot.value.settle(now, policy, change);
                if let Settle::Charge(_) = change {
                    slot.expires = slot.expires.max(expiry(policy, now, now));
                    // A charge that fills the key puts it in the penalty box.
                    let boxed = slot.value.penalize_if_full(now, policy);
                    slot.expires = slot.expires.max(boxed.unwrap_or(0));
                }
                slot.expires = slot.expires.max(now.saturating_add(drained));
            }
            // Nothing recorded is left to refund.
            None if matches!(change, Settle::Refund { .. }) => {}
            None => {
                let mut state = State::new(algorithm, now);
                let drained = state.settle(now, policy, change);
                let boxed = state.penalize_if_full(now, policy).unwrap_or(0);
                let expires = expiry(policy, now, now)
                    .max(now.saturating_add(drained))
                    .max(boxed);
                shard.insert(key, policy.state_id(), now, expires, state);
            }
        }
    }
}

/// When the state left by an event at `t`, decided at `now`, stops mattering: a window after
/// the later of the two (a future event counts until its window has passed).
fn expiry(policy: &Policy, now: u64, t: u64) -> u64 {
    let retention = micros(policy.algorithm().retention(policy.longest_window()));
    now.max(t).saturating_add(retention)
}

/// Configures a [`MemoryStore`].
pub struct MemoryStoreBuilder {
    max_keys: u64,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    /// The most keys (client × policy) held at once; default
    /// [`MemoryStore::DEFAULT_MAX_KEYS`]. At least one key per shard is always held.
    pub fn max_keys(mut self, max_keys: u64) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The clock decisions are made with; default [`TokioClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            shared: Arc::new(Shared {
                entries: Shards::new(self.max_keys),
                next_slot: AtomicU64::new(1),
                clock: self
                    .clock
                    .unwrap_or_else(|| Arc::new(TokioClock::default())),
                overrides: Arc::default(),
            }),
        }
    }
}

impl Store for MemoryStore {
    type Future = Ready<Result<Decision, StoreError>>;
    type ResetFuture = Ready<Result<(), StoreError>>;

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, true)
    }

    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future {
        self.decide(key, policy, cost, Some(at), true)
    }

    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, false)
    }

    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            // The requests in flight still are: their slots stay.
            Some(slot) if slot.value.slots.last_expiry() > now => {
                let slots = std::mem::take(&mut slot.value.slots);
                slot.value = State {
                    slots,
                    ..State::new(policy.algorithm(), now)
                };
            }
            _ => shard.remove(key, policy.state_id()),
        }
        ready(Ok(()))
    }

    fn settle(&self, key: &Key, policy: &Policy, settlement: Settlement) -> Self::ResetFuture {
        if let Err(error) = super::in_range(policy) {
            return ready(Err(error));
        }
        match settlement {
            Settlement::Release(id) => drop(self.keep_slot(key, policy, id.get(), false)),
            Settlement::Renew(id) if !self.keep_slot(key, policy, id.get(), true) => {
                return ready(Err(StoreError::SlotGone))
            }
            Settlement::Renew(_) => {}
            Settlement::Charge(_) | Settlement::Refund(_) => {
                self.settle_now(key, policy, settlement)
            }
        }
        ready(Ok(()))
    }

    fn check_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        Some(self.check(key, policy, cost).into_inner())
    }

    fn is_local(&self) -> bool {
        true
    }

    fn limits_version(&self) -> u64 {
        self.shared.overrides.version()
    }
}
