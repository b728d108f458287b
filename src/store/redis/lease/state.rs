//! What a leasing store keeps in this process: the book of the leases each key holds, the
//! give-backs waiting to be sent, and the state of a drain.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;

use super::book::KeyBook;
use super::plan::Leases;
use crate::model::micros;
use crate::shards::{Pinning, Shards};
use crate::{Key, Policy};

/// What a leasing store keeps.
pub(crate) struct Leasing {
    pub(crate) settings: Leases,
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

/// One key's leases, with the policy they are for.
pub(crate) struct KeyLeases {
    pub(crate) policy: Policy,
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

    /// Runs `f` on the entry of `key` under `policy`, made if missing.
    pub(crate) fn with<T>(
        &self,
        key: &Key,
        policy: &Policy,
        f: impl FnOnce(&mut KeyBook) -> T,
    ) -> T {
        let now = self.now();
        let mut locked = self.book.lock(key, policy.terms_id());
        if let Some(found) = locked.get(key, policy.terms_id(), now) {
            return f(&mut found.value.entry);
        }
        let mut held = KeyLeases {
            policy: policy.clone(),
            entry: KeyBook::default(),
        };
        let out = f(&mut held.entry);
        locked.insert(key, policy.terms_id(), now, u64::MAX, held);
        out
    }
}
