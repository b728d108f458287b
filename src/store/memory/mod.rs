//! The embedded store: state in this process, for one instance, development and tests.
//!
//! `mod.rs` holds the store and its [`Store`] methods; `decide.rs` how it decides under the
//! overrides in force, holding one shard's lock while the key's state
//! ([`model::key_state`](crate::model::key_state)) answers; `reserve.rs` its reservations;
//! `clock.rs` its clocks; `builder.rs` its builder.

use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

mod builder;
mod clock;
mod decide;
mod reserve;

pub use builder::MemoryStoreBuilder;
pub use clock::{Clock, ManualClock, TokioClock};

use self::decide::SlotOp;
use super::claims::Claims;
use super::engine::{Engine, Sealed};
use super::override_table::OverrideTable;
use super::overrides::Overrides;
use super::{Store, StoreError};
#[cfg(any(test, feature = "test-util"))]
use crate::model::key_state::trim;
use crate::model::key_state::{KeyState, Of};
use crate::model::slots::Waiter;
use crate::model::Algorithm;
use crate::settlement::Owed;
use crate::shards::{Pinning, Shards};
use crate::{Decision, Key, Policy, Settlement};

/// Rate-limit state kept in this process.
///
/// Bounded: it holds at most [`max_keys`](MemoryStoreBuilder::max_keys) keys (client ×
/// policy), and forgets a key once its state has aged out without a request: its policy's
/// longest window (twice that for the sliding window counter and the sliding log, whose event
/// times up to a window back read a window further). When the bound is reached, expired keys are dropped
/// first, then the least recently used of the keys that are not pinned (a refused request
/// counts as use); an evicted key starts again with a full budget, so size the bound above the
/// number of clients you expect within the longest window.
///
/// **Pinned keys.** A key in its penalty box ([`Policy::block_for`]) is pinned until the
/// lockout its box's first refusal announced has passed (the later of the box's end and its
/// limits' own `Retry-After` then), a key that holds concurrency slots ([`Policy::concurrency`])
/// until its last slot expires, a key with attempts in flight (counted by outcome,
/// `count_when`) until the last counts as in flight no more, and a key holding events in the future
/// ([`Store::check_at`]: a scheduler's bookings) until the newest of them: every other key is
/// evicted first, so that a flood of new clients cannot free a boxed one, nor make a booked
/// time bookable twice. The bound is per shard: the keys are split over
/// `max_keys / 256` shards, rounded up to a power of two, from 1 to 64 (4 shards of 250 keys
/// for `max_keys(1_000)`, 64 of 1 562 for the default 100 000), and each holds at most
/// `max_keys / shards` keys, pinned or not. A store therefore keeps every boxed key while no
/// shard holds `max_keys / shards` pinned keys; keys fall into shards at random, so keep the
/// keys boxed or with requests in flight at once well under `max_keys` (under half keeps every
/// shard far from full). A shard whose keys are all pinned evicts the one whose pin ends
/// soonest (it starts afresh, out of its box), counted in `ratelimit_evicted_pinned_total`
/// (feature `metrics`): the bound holds whatever clients do.
///
/// Keys are spread over independently locked shards, and a decision holds one shard's lock for
/// the few arithmetic steps it takes, so concurrent requests rarely wait on each other. Runs
/// the same algorithms as [`RedisStore`](crate::RedisStore). Clones share state.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) entries: Shards<KeyState>,
    /// The id of the next concurrency slot taken.
    pub(crate) next_slot: AtomicU64,
    /// The number of the next key state made (`KeyState::number`).
    pub(crate) next_state: AtomicU64,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) overrides: Arc<OverrideTable>,
    /// The unnamed policies the live layers on this store use (`store/claims.rs`).
    pub(crate) claims: Claims,
}

impl Shared {
    /// A new, empty state for `algorithm`, numbered.
    pub(crate) fn fresh(&self, algorithm: Algorithm) -> KeyState {
        KeyState::new(algorithm, self.next_state.fetch_add(1, Ordering::Relaxed))
    }
}

/// The map keeps a key while it is locked out by its penalty box, holds concurrency slots or
/// attempts in flight, has
/// reservations waiting for their turns or a pause, or holds events in the future (a
/// scheduler's bookings, `Store::check_at`): evicted, the key would forget them, and the same
/// times would be booked again.
impl Pinning for KeyState {
    fn pinned_until(&self) -> u64 {
        let line = self.line.last().unwrap_or(0).max(self.line.paused_until());
        let booked = match &self.of {
            Of::Log(log) => log.newest().unwrap_or(0),
            Of::Sliding(_) | Of::Fixed(_) | Of::Gcra(_) => 0,
        };
        let held = self.locked_until.max(self.slots.last_expiry());
        // Attempts in flight hold units that no more attempts may take (`model::attempts`).
        let held = held.max(self.attempts.last_expiry());
        held.max(line).max(booked)
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
        MemoryStoreBuilder::new()
    }

    /// The number of events (admitted requests, one each whatever its cost) a sliding log
    /// holds for `key` under `policy` that are younger than twice its longest window (what
    /// decisions at event times up to a window back read).
    ///
    /// Meant for tests and diagnostics; 0 for other algorithms and expired keys.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn events(&self, key: &Key, policy: &Policy) -> usize {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(entry) if entry.is_live(now) => match &mut entry.value.of {
                Of::Log(log) => {
                    trim(log, now, policy);
                    log.events()
                }
                Of::Sliding(_) | Of::Fixed(_) | Of::Gcra(_) => 0,
            },
            _ => 0,
        }
    }

    /// The concurrency slots ([`Policy::concurrency`]) that `key` holds under `policy` now:
    /// its requests in flight, counted on every instance that shares this store.
    ///
    /// Meant for tests and diagnostics.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn slots_in_use(&self, key: &Key, policy: &Policy) -> usize {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(entry) if entry.is_live(now) => entry.value.slots.live(now),
            _ => 0,
        }
    }

    /// The store's overrides: limits changed at run time for a key or a whole policy,
    /// applied to every decision of this store and its clones from the next one on.
    pub fn overrides(&self) -> Overrides {
        super::override_table::overrides(&self.shared.overrides)
    }

    /// The number of keys held, once expired ones are dropped.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn key_count(&self) -> u64 {
        self.shared.entries.len(self.now())
    }
}

impl Store for MemoryStore {
    type Future = Ready<Result<Decision, StoreError>>;

    type ResetFuture = Ready<Result<(), StoreError>>;

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, true, None)
    }

    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future {
        self.decide(key, policy, cost, Some(at), true, None)
    }

    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, false, None)
    }

    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            // The requests in flight still are: their slots stay.
            Some(entry) if entry.value.slots.last_expiry() > now => {
                let slots = std::mem::take(&mut entry.value.slots);
                entry.value = KeyState {
                    slots,
                    ..self.shared.fresh(policy.algorithm())
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
        match settlement.owed {
            Owed::Release(id, held) => {
                let release = SlotOp::Release { id: id.get(), held };
                self.keep_slot(key, policy, release);
            }
            Owed::Renew(id) if !self.keep_slot(key, policy, SlotOp::Renew(id.get())) => {
                return ready(Err(StoreError::SlotGone))
            }
            Owed::Renew(_) => {}
            Owed::Charge(_) | Owed::Refund(_) => self.settle_units(key, policy, settlement),
        }
        ready(Ok(()))
    }
}

impl Sealed for MemoryStore {}

impl Engine for MemoryStore {
    fn step(&self, key: &Key, policy: &Policy, units: u32) -> <Self as Store>::Future {
        self.step_units(key, policy, units)
    }

    fn step_now(
        &self,
        key: &Key,
        policy: &Policy,
        units: u32,
    ) -> Option<Result<Decision, StoreError>> {
        Some(self.step_units(key, policy, units).into_inner())
    }

    fn settle_now(
        &self,
        key: &Key,
        policy: &Policy,
        settlement: Settlement,
    ) -> Option<Result<(), StoreError>> {
        Some(self.settle(key, policy, settlement).into_inner())
    }

    fn check_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        Some(self.check(key, policy, cost).into_inner())
    }

    fn check_queued(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        waiter: &Waiter,
    ) -> <Self as Store>::Future {
        self.decide(key, policy, cost, None, true, Some(waiter))
    }

    fn leave_queue(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        self.keep_slot(key, policy, SlotOp::Leave(waiter.id()));
    }

    fn is_local(&self) -> bool {
        true
    }

    fn limits_version(&self) -> u64 {
        self.shared.overrides.version()
    }

    fn run_time_overrides(&self) -> Option<Overrides> {
        Some(self.overrides())
    }

    fn claims(&self) -> Option<Claims> {
        Some(self.shared.claims.clone())
    }
}
