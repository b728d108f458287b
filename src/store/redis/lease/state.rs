//! What a leasing store keeps in this process: how busy each key is (the heat table), the book
//! of the leases each hot key holds, the give-backs waiting to be sent, and the state of a
//! drain.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;

use super::book::KeyBook;
use super::heat::{Heat, Spot};
use super::plan::Leases;
use crate::model::micros;
use crate::shards::{Pinning, Shards};
use crate::{Key, Policy};

/// What a leasing store keeps.
pub(crate) struct Leasing {
    pub(crate) settings: Leases,
    /// Every key's recent use, and whether it has an entry in `book` (its leasing bit).
    pub(crate) heat: Heat,
    /// The keys that lease: only those [`heat`](Self::heat) found hot have an entry.
    pub(crate) book: Shards<KeyLeases>,
    pub(crate) origin: tokio::time::Instant,
    /// Set by [`RedisStore::drain`]: no new leases, and nothing spent from leases.
    pub(crate) drained: AtomicBool,
    /// Set once `drain` stopped waiting for the lease calls under way: a lease that lands
    /// later is given back by the call that took it (earlier ones, by `drain`).
    pub(crate) drain_waited: AtomicBool,
    /// Lease calls whose reply has not been booked yet; `landed` is notified as each is.
    pub(crate) taking: AtomicUsize,
    pub(crate) landed: Notify,
    /// Give-backs that were not run (the breaker was open, Redis refused the script), sent
    /// again with the next ones.
    pub(crate) pending: Mutex<Vec<Due>>,
}

/// A give-back to send: where, its arguments for `scripts/return.lua`, its units, and the
/// local time after which it no longer matters (every window that counted it has ended).
pub(crate) struct Due {
    pub(crate) key: String,
    pub(crate) args: Vec<u8>,
    pub(crate) units: u64,
    pub(crate) until: u64,
}

/// One key's leases, with the policy they are for and the key's cell in the heat table.
pub(crate) struct KeyLeases {
    pub(crate) policy: Policy,
    pub(crate) spot: Spot,
    pub(crate) entry: KeyBook,
}

/// A lease is never pinned: one evicted gives its units back when it ends, as any.
impl Pinning for KeyLeases {}

impl std::fmt::Debug for Leasing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Leasing {
    pub(crate) fn new(settings: Leases) -> Leasing {
        Leasing {
            settings,
            heat: Heat::new(settings.max_keys),
            book: Shards::new(settings.max_keys),
            origin: tokio::time::Instant::now(),
            drained: AtomicBool::new(false),
            drain_waited: AtomicBool::new(false),
            taking: AtomicUsize::new(0),
            landed: Notify::new(),
            pending: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn is_drained(&self) -> bool {
        self.drained.load(Ordering::Acquire)
    }

    /// Local µs since the store was made.
    pub(crate) fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    /// Where the heat table counts `key` under `policy`.
    pub(crate) fn spot(&self, key: &Key, policy: &Policy) -> Spot {
        self.heat.spot(key, policy.terms_id())
    }

    /// Runs `f` on the entry of `key` under `policy`, made if missing, for a key that leases:
    /// a new entry sets the key's leasing bit in the heat table (`length`: the plan's period),
    /// so that [`Store::check_now`](crate::Store::check_now) looks for it.
    pub(crate) fn with<T>(
        &self,
        key: &Key,
        policy: &Policy,
        length: u64,
        f: impl FnOnce(&mut KeyBook) -> T,
    ) -> T {
        let now = self.now();
        let mut locked = self.book.lock(key, policy.terms_id());
        if let Some(found) = locked.get(key, policy.terms_id(), now) {
            return f(&mut found.value.entry);
        }
        let spot = self.spot(key, policy);
        let mut held = KeyLeases {
            policy: policy.clone(),
            spot,
            entry: KeyBook::default(),
        };
        let out = f(&mut held.entry);
        locked.insert(key, policy.terms_id(), now, u64::MAX, held);
        // Under the shard's lock, as the bit is cleared when the entry goes (`returns`). A
        // cell pinned by another key's leases (a race: this key read as hot just before) leaves
        // it unset: this key then reads as cold, spends none of its grants, and the sweeper
        // gives them back when they expire (fewer admitted, never more).
        self.heat.pin(spot, now, length);
        out
    }

    /// Runs `f` on the entry of `key` under `policy` if there is one; a key without leases
    /// gets none.
    pub(crate) fn existing<T>(
        &self,
        key: &Key,
        policy: &Policy,
        f: impl FnOnce(&mut KeyBook) -> T,
    ) -> Option<T> {
        let now = self.now();
        let mut locked = self.book.lock(key, policy.terms_id());
        let found = locked.get(key, policy.terms_id(), now)?;
        Some(f(&mut found.value.entry))
    }

    /// Runs `f` on the entry of `key` under `policy`, whose leasing bit at `spot` is set; when
    /// the entry is gone (the book evicted it to make room), clears the bit instead, under the
    /// shard's lock, so that the key reads as cold again.
    pub(crate) fn leased<T>(
        &self,
        key: &Key,
        policy: &Policy,
        spot: Spot,
        f: impl FnOnce(&mut KeyBook) -> T,
    ) -> Option<T> {
        let now = self.now();
        let mut locked = self.book.lock(key, policy.terms_id());
        let Some(found) = locked.get(key, policy.terms_id(), now) else {
            self.heat.unpin(spot);
            return None;
        };
        Some(f(&mut found.value.entry))
    }

    /// The keys holding an entry in the book.
    #[cfg(feature = "test-util")]
    pub(crate) fn keys(&self) -> u64 {
        self.book.len(self.now())
    }
}
