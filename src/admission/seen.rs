//! [`Seen`]: what a layer under [`FailureMode::Fallback`] last saw of the keys its store
//! refused or spent, so that an outage frees none of them.
//!
//! The fallback store has seen nothing when the layer's store fails: asked alone, it would
//! give a user boxed a moment before, or one who had spent the window's budget, a whole
//! budget again. So every decision of the layer's own store is noted:
//!
//! - a refusal that says when to retry (by the limits or by the penalty box): the key stays
//!   refused until that retry-after, for requests that cost at least as much (any request,
//!   while boxed);
//! - an admission that left nothing of the limit it describes: the key counts as spent until
//!   that limit's `reset_after`, for any request; except on a layer that settles usage or
//!   counts by outcome, where the units of the admission may come back when its response
//!   ends (a right password gives its attempt's unit back, and two logins at once must not
//!   leave a user out for the window);
//! - any other admission: the key is forgotten (a reset, an override or a refund let the
//!   store admit it again).
//!
//! While the store fails, a key noted is refused with what is left of its time, never 0 and
//! never early, before the fallback store is asked; a key not noted, or whose time has
//! passed, is decided by the fallback store: up to a budget per instance. Refusals for a
//! concurrency slot are not noted (a slot may free any moment), nor decisions of the fallback
//! store, which keeps its own.
//!
//! Unlike the deny cache (`deny_cache.rs`) it is read only while the store fails, so it does
//! not check the store's limits version (a failing store cannot vouch for it), and it holds a
//! penalty box for its whole length. It is bounded as the deny cache is: at most [`CAPACITY`]
//! (policy, key)s per layer in `shards.rs`, the least recently noted or read evicted first,
//! each dropped once its time has passed. It logs no key.
//!
//! [`FailureMode::Fallback`]: crate::FailureMode::Fallback

use std::time::Duration;

use crate::deny_cache::{aged, micros};
use crate::shards::{Pinning, Shards};
use crate::{Decision, Key, Policy};

/// The most (policy, key)s a layer remembers for its fallback, as many as the deny cache and
/// the memory store hold by default.
pub(crate) const CAPACITY: u64 = 100_000;

/// What is kept of a key: the refusal to repeat and the least cost it refuses.
struct Sighting {
    refusal: Decision,
    /// Requests cheaper than this are left to the fallback store: a refusal of a larger cost
    /// says nothing of them. 0 while boxed.
    least_cost: u32,
}

/// Nothing is pinned: an entry evicted leaves its key to the fallback store's budget.
impl Pinning for Sighting {}

/// The keys a layer's store last refused or spent, by (policy, key), until when.
pub(crate) struct Seen {
    entries: Shards<Sighting>,
    /// Times are µs since this instant, on tokio's clock, so that they follow paused test time.
    origin: tokio::time::Instant,
}

impl Seen {
    /// A memory of up to `capacity` keys.
    pub(crate) fn new(capacity: u64) -> Self {
        Seen {
            entries: Shards::new(capacity),
            origin: tokio::time::Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    /// Notes `d`, the layer's store's decision on a request for `key` under `policy` that
    /// cost `cost`; `settled` when an admission's units may come back after its response
    /// (usage, outcome counting), so that spending them is not taken as spent.
    pub(crate) fn note(&self, key: &Key, policy: &Policy, cost: u32, d: &Decision, settled: bool) {
        // A busy refusal ends with the attempts in flight, sooner than its retry may say.
        if d.is_concurrency_limit() || d.is_busy() {
            return;
        }
        let id = policy.terms_id();
        let now = self.now();
        let mut shard = self.entries.lock(key, id);
        let Some((sighting, left)) = sighting(d, cost, settled) else {
            if d.is_allowed() {
                shard.remove(key, id);
            }
            return;
        };
        let until = now.saturating_add(micros(left));
        match shard.get(key, id, now) {
            Some(entry) => {
                entry.expires = until;
                entry.value = sighting;
            }
            None => shard.insert(key, id, now, until, sighting),
        }
    }

    /// The refusal still in force for a request of `cost` for `key` under `policy`, with its
    /// times brought up to now.
    pub(crate) fn refusal(&self, key: &Key, policy: &Policy, cost: u32) -> Option<Decision> {
        let id = policy.terms_id();
        let now = self.now();
        let mut shard = self.entries.lock(key, id);
        let entry = shard.get(key, id, now)?;
        if !entry.is_live(now) || cost < entry.value.least_cost {
            return None;
        }
        let left = Duration::from_micros(entry.expires - now);
        match entry.value.refusal.retry_after {
            // A block: no wait helps, as the store said.
            None => Some(entry.value.refusal),
            Some(_) => Some(aged(entry.value.refusal, left)),
        }
    }
}

/// What `d`, for a request of `cost`, leaves to remember, and for how long: a refusal that
/// says when to retry, or an admission that spent the limit it describes (unless its units
/// may come back, `settled`), or a block by an override (for the policy's first window, as
/// the fallback store has no overrides); `None` for any other admission, and for a request
/// larger than a limit itself.
fn sighting(d: &Decision, cost: u32, settled: bool) -> Option<(Sighting, Duration)> {
    let blocked = d.limit() == 0 && d.retry_after().is_none() && !d.is_concurrency_limit();
    let (refusal, least_cost, left) = match d.is_allowed() {
        false if blocked => (*d, 0, d.window().max(Duration::from_secs(1))),
        false => {
            let left = d.retry_after().filter(|left| !left.is_zero())?;
            (*d, if d.in_penalty_box() { 0 } else { cost }, left)
        }
        true if d.remaining() == 0 && !d.reset_after().is_zero() && !settled => {
            let left = d.reset_after();
            // The refusal the store would give the next request: nothing left until the reset.
            let refusal = Decision {
                allowed: false,
                retry_after: Some(left),
                admitted_at: None,
                recorded: 0,
                slot: None,
                ..*d
            };
            (refusal, 1, left)
        }
        true => return None,
    };
    Some((
        Sighting {
            refusal,
            least_cost,
        },
        left,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use crate::Store;

    fn decide(store: &MemoryStore, key: &Key, policy: &Policy, cost: u32) -> Decision {
        store.check(key, policy, cost).into_inner().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_spent_key_is_refused_until_its_reset_and_forgotten_when_admitted_again() {
        let (store, seen) = (MemoryStore::new(), Seen::new(100));
        let policy: Policy = "2/10s".parse().unwrap();
        let key = Key::from("ann");
        for _ in 0..2 {
            let d = decide(&store, &key, &policy, 1);
            seen.note(&key, &policy, 1, &d, false);
        }
        tokio::time::advance(Duration::from_secs(4)).await;
        let refusal = seen
            .refusal(&key, &policy, 1)
            .expect("spent until the reset");
        assert!(!refusal.is_allowed() && refusal.remaining() == 0);
        assert_eq!(refusal.retry_after(), Some(Duration::from_secs(6)));
        assert_eq!(refusal.reset_after(), Duration::from_secs(6));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(seen.refusal(&key, &policy, 1).is_none(), "reset");

        // Spent again, then admitted by the store with units left (reset): forgotten.
        store.reset(&key, &policy).into_inner().unwrap();
        for _ in 0..2 {
            seen.note(&key, &policy, 1, &decide(&store, &key, &policy, 1), false);
        }
        assert!(seen.refusal(&key, &policy, 1).is_some());
        store.reset(&key, &policy).into_inner().unwrap();
        seen.note(&key, &policy, 1, &decide(&store, &key, &policy, 1), false);
        assert!(seen.refusal(&key, &policy, 1).is_none());

        // Where the units may come back after the response (usage, outcome counting),
        // spending them is not kept.
        let settled = Key::from("cal");
        for _ in 0..2 {
            let d = decide(&store, &settled, &policy, 1);
            seen.note(&settled, &policy, 1, &d, true);
        }
        assert!(seen.refusal(&settled, &policy, 1).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_boxed_key_is_refused_at_any_cost_a_refusal_at_its_cost_and_more() {
        let (store, seen) = (MemoryStore::new(), Seen::new(100));
        let boxed: Policy = "1/10s".parse::<Policy>().unwrap();
        let boxed = boxed.block_for(Duration::from_secs(60)).unwrap();
        let key = Key::from("ann");
        decide(&store, &key, &boxed, 1);
        let refused = decide(&store, &key, &boxed, 1);
        assert!(refused.in_penalty_box());
        seen.note(&key, &boxed, 1, &refused, false);
        tokio::time::advance(Duration::from_secs(59)).await;
        let left = seen.refusal(&key, &boxed, 0).unwrap().retry_after();
        assert_eq!(left, Some(Duration::from_secs(1)));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(seen.refusal(&key, &boxed, 1).is_none(), "the box is over");

        let policy: Policy = "5/10s".parse().unwrap();
        decide(&store, &key, &policy, 3);
        let refused = decide(&store, &key, &policy, 3);
        assert!(!refused.is_allowed());
        seen.note(&key, &policy, 3, &refused, true);
        assert!(seen.refusal(&key, &policy, 3).is_some());
        assert!(seen.refusal(&key, &policy, 2).is_none(), "2 may fit");
        // Another policy's key is its own.
        assert!(seen.refusal(&key, &boxed, 3).is_none());
        // A refusal no wait helps says nothing of when to retry: nothing is kept.
        let other = Key::from("bob");
        seen.note(
            &other,
            &policy,
            6,
            &decide(&store, &other, &policy, 6),
            false,
        );
        assert!(seen.refusal(&other, &policy, 6).is_none());
    }
}
