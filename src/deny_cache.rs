//! The local deny cache: refusals the layer can repeat without asking the store.
//!
//! After the store refuses a key with a retry-after `T`, any request for the same key and
//! policy that costs at least as much is refused locally until `T` has passed: a client that
//! hammers a refused key costs no Redis command, and is asked about again once it could be
//! admitted. Nothing is admitted locally, so the cache never loosens a limit. Entries expire
//! with their retry-after; the cache holds a bounded number of them, evicting the least
//! recently used.
//!
//! A refund of usage (see [`usage`](crate::usage)) may make room before a refusal's
//! retry-after, so it forgets the key's refusal when it is sent and again when it lands. A
//! refusal the store decided while a refund was on its way would still be cached after both,
//! when its reply comes last: so each decision takes a [`Stamp`] before it asks the store,
//! and its refusal is cached only if no refund of its (policy, key) was sent or landed since.
//! Refunds are counted per stripe of (policy, key)s in atomics, not per key, so that taking a
//! stamp costs a hash and a load; a refund of another key of the stripe only makes a refusal
//! go uncached, which costs one more store call, never a wrong answer.
//!
//! Limits that change at run time (the store's overrides, `store/overrides.rs`) may make room
//! too: the store's limits version ([`Store::limits_version`](crate::Store::limits_version))
//! changes with them, and a refusal decided under another version is neither cached nor
//! repeated. A store that cannot vouch for its limits now (a [`RedisStore`](crate::RedisStore)
//! that could not read the version for half a second) answers
//! [`UNCONFIRMED_LIMITS`]: then nothing is cached or repeated, so that a change the store
//! has not seen yet is not outlived by refusals from before it.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use foldhash::fast::RandomState;

use crate::shards::{Pinning, Shards};
use crate::store::UNCONFIRMED_LIMITS;
use crate::{Decision, Key, Policy};

/// Stripes of the refund counts: enough that concurrent refunds of other keys rarely keep a
/// refusal out of the cache.
const STRIPES: usize = 64;

/// One remembered refusal; its entry expires when the retry-after has passed.
#[derive(Clone, Copy)]
struct Denial {
    decision: Decision,
    /// When (µs) the refusal's own retry-after ends; the entry may expire before (a penalty
    /// box is held a second at a time).
    until: u64,
    cost: u32,
    /// The store's limits version the refusal was decided under.
    version: u64,
}

/// A refusal is never pinned: the cache may always forget one, and the store asks again.
impl Pinning for Denial {}

/// The refunds of a stripe counted when a decision started; see [`DenyCache::remember`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    stripe: usize,
    refunds: u64,
    version: u64,
}

/// The store's limits version, read by the cache (`Store::limits_version`).
pub(crate) type Version = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Refusals by (policy, key). Clones share entries.
/// The longest the cache repeats a penalty box's refusal before asking the store again.
const PENALTY_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Clone)]
pub(crate) struct DenyCache {
    entries: Arc<Shards<Denial>>,
    /// Refunds sent or landed, per stripe of (policy, key)s.
    refunds: Arc<[AtomicU64; STRIPES]>,
    /// Seeded per cache, so that clients cannot choose keys that share a stripe.
    hasher: RandomState,
    /// Times are µs since this instant, on tokio's clock, so that they follow paused test time.
    origin: tokio::time::Instant,
    version: Version,
}

impl DenyCache {
    /// A cache of up to `capacity` refusals, for a store whose limits version `version` reads.
    pub(crate) fn new(capacity: u64, version: Version) -> Self {
        DenyCache {
            entries: Arc::new(Shards::new(capacity)),
            refunds: Arc::new(std::array::from_fn(|_| AtomicU64::new(0))),
            hasher: RandomState::default(),
            origin: tokio::time::Instant::now(),
            version,
        }
    }

    fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    fn stripe(&self, key: &Key, policy: &Policy) -> usize {
        let hash = self.hasher.hash_one((policy.terms_id().hash, key.as_str()));
        (hash >> 32) as usize % STRIPES
    }

    /// Taken before the store is asked about `key` under `policy`, and given back with its
    /// refusal to [`remember`](Self::remember).
    pub(crate) fn stamp(&self, key: &Key, policy: &Policy) -> Stamp {
        let stripe = self.stripe(key, policy);
        let refunds = self.refunds[stripe].load(Ordering::Acquire);
        let version = (self.version)();
        Stamp {
            stripe,
            refunds,
            version,
        }
    }

    /// Remembers a refusal that says when to retry, unless a refund of the key was sent or
    /// landed since `stamp` was taken, or the limits changed: the store may have decided
    /// before the refund or the change made room.
    pub(crate) fn remember(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        decision: Decision,
        stamp: Stamp,
    ) {
        let Some(retry) = decision.retry_after() else {
            return;
        };
        // A penalty box is held for a second at a time, not its whole length, so that a reset
        // (or a box removed from the policy) frees the key on every instance within a second,
        // at one store call per second and key while it is boxed.
        let hold = match decision.in_penalty_box() {
            true => retry.min(PENALTY_RECHECK),
            false => retry,
        };
        let now = self.now();
        let expires = now.saturating_add(micros(hold));
        let denial = Denial {
            decision,
            until: now.saturating_add(micros(retry)),
            cost,
            version: stamp.version,
        };
        let mut shard = self.entries.lock(key, policy.terms_id());
        // Read under the lock that `forget` takes after counting its refund: either this
        // sees the count, or `forget` comes after the insert and removes it.
        if self.refunds[stamp.stripe].load(Ordering::Acquire) != stamp.refunds
            || (self.version)() != stamp.version
            || stamp.version == UNCONFIRMED_LIMITS
        {
            return;
        }
        match shard.get(key, policy.terms_id(), now) {
            Some(entry) => {
                entry.expires = expires;
                entry.value = denial;
            }
            // A refusal pins nothing: the store keeps what a refusal must not forget.
            None => shard.insert(key, policy.terms_id(), now, expires, denial),
        }
    }

    /// Forgets the refusal of `key` under `policy`, if any, and keeps refusals decided before
    /// now out of the cache: a refund of usage (see [`usage`](crate::usage)), sent or landed,
    /// may have made room before their retry-after.
    pub(crate) fn forget(&self, key: &Key, policy: &Policy) {
        let stripe = self.stripe(key, policy);
        self.refunds[stripe].fetch_add(1, Ordering::AcqRel);
        self.entries
            .lock(key, policy.terms_id())
            .remove(key, policy.terms_id());
    }

    /// The refusal still in force for a request of `cost`, with its times brought up to now.
    pub(crate) fn refusal(&self, key: &Key, policy: &Policy, cost: u32) -> Option<Decision> {
        let now = self.now();
        let mut shard = self.entries.lock(key, policy.terms_id());
        let entry = shard.get(key, policy.terms_id(), now)?;
        let denial = &entry.value;
        // Never kept under UNCONFIRMED_LIMITS (`remember`), so never repeated under it.
        if !entry.is_live(now) || cost < denial.cost || denial.version != (self.version)() {
            return None;
        }
        let left = Duration::from_micros(denial.until.saturating_sub(now));
        Some(aged(denial.decision, left))
    }
}

/// A remembered `refusal` with its times brought up to a moment `left` before its
/// retry-after ends: what a layer repeats without asking the store (here, and in the
/// fallback's memory, `admission/seen.rs`).
pub(crate) fn aged(mut refusal: Decision, left: Duration) -> Decision {
    let elapsed = refusal.retry_after.unwrap_or_default().saturating_sub(left);
    refusal.retry_after = Some(left);
    refusal.reset_after = refusal.reset_after.saturating_sub(elapsed);
    refusal
}

/// `d` in whole microseconds, saturating.
pub(crate) fn micros(d: Duration) -> u64 {
    d.as_micros().min(u128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Outcome;

    fn refusal(policy: &Policy) -> Decision {
        let outcome = Outcome {
            allowed: false,
            index: 0,
            remaining: 0,
            reset_after: 30_000_000,
            retry_after: Some(30_000_000),
        };
        Decision::from_outcome(outcome, policy)
    }

    #[test]
    fn a_refund_keeps_refusals_decided_before_it_out() {
        let cache = DenyCache::new(1000, Arc::new(|| 0));
        let policy: Policy = "150/1m".parse().unwrap();
        let (key, other) = (Key::from("k"), Key::from("other"));

        // Decided, then a refund was sent before the refusal came in: not cached.
        let before = cache.stamp(&key, &policy);
        cache.forget(&key, &policy);
        cache.remember(&key, &policy, 100, refusal(&policy), before);
        assert!(cache.refusal(&key, &policy, 100).is_none());

        // Decided after the refund: cached, for requests that cost as much or more.
        let after = cache.stamp(&key, &policy);
        cache.remember(&key, &policy, 100, refusal(&policy), after);
        assert!(cache.refusal(&key, &policy, 100).is_some());
        assert!(cache.refusal(&key, &policy, 99).is_none());

        // Another key's refund leaves this key's entry alone.
        cache.forget(&other, &policy);
        assert!(cache.refusal(&key, &policy, 100).is_some());

        // A refund that lands after the refusal was cached forgets it.
        cache.forget(&key, &policy);
        assert!(cache.refusal(&key, &policy, 100).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_kept_or_repeated_while_the_store_cannot_vouch_for_its_limits() {
        let version = Arc::new(AtomicU64::new(7));
        let read = Arc::clone(&version);
        let cache = DenyCache::new(1000, Arc::new(move || read.load(Ordering::Acquire)));
        let policy: Policy = "150/1m".parse().unwrap();
        let key = Key::from("k");

        let stamp = cache.stamp(&key, &policy);
        cache.remember(&key, &policy, 1, refusal(&policy), stamp);
        assert!(cache.refusal(&key, &policy, 1).is_some());
        // Unconfirmed: the refusal is not repeated, and none decided meanwhile is kept.
        version.store(UNCONFIRMED_LIMITS, Ordering::Release);
        assert!(cache.refusal(&key, &policy, 1).is_none());
        let stamp = cache.stamp(&key, &policy);
        cache.remember(&key, &policy, 1, refusal(&policy), stamp);
        assert!(cache.refusal(&key, &policy, 1).is_none());
        // Confirmed again, and unchanged: the refusal from before holds again.
        version.store(7, Ordering::Release);
        assert!(cache.refusal(&key, &policy, 1).is_some());
    }
}
