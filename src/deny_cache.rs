//! The local deny cache: refusals the layer can repeat without asking the store.
//!
//! After the store refuses a key with a retry-after `T`, any request for the same key and
//! policy that costs at least as much is refused locally until `T` has passed: a client that
//! hammers a refused key costs no Redis command, and is asked about again once it could be
//! admitted. Nothing is admitted locally, so the cache never loosens a limit. Entries expire
//! with their retry-after; the cache holds a bounded number of them, evicting the least
//! recently used.

use std::time::Duration;

use crate::shards::Shards;
use crate::{Decision, Key, Policy};

/// One remembered refusal; its slot expires when the retry-after has passed.
#[derive(Clone, Copy)]
struct Denial {
    decision: Decision,
    cost: u32,
}

/// Refusals by (policy, key). Clones share entries.
#[derive(Clone)]
pub(crate) struct DenyCache {
    entries: std::sync::Arc<Shards<Denial>>,
    /// Times are µs since this instant, on tokio's clock, so that they follow paused test time.
    origin: tokio::time::Instant,
}

impl DenyCache {
    pub(crate) fn new(capacity: u64) -> Self {
        DenyCache {
            entries: std::sync::Arc::new(Shards::new(capacity)),
            origin: tokio::time::Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    /// Remembers a refusal that says when to retry.
    pub(crate) fn remember(&self, key: &Key, policy: &Policy, cost: u32, decision: Decision) {
        let Some(retry) = decision.retry_after() else {
            return;
        };
        let now = self.now();
        let expires = now.saturating_add(micros(retry));
        let denial = Denial { decision, cost };
        let mut shard = self.entries.lock(key, policy);
        match shard.get(key, policy, now) {
            Some(slot) => {
                slot.expires = expires;
                slot.value = denial;
            }
            None => shard.insert(key, policy, now, expires, denial),
        }
    }

    /// Forgets the refusal of `key` under `policy`, if any: a refund of usage (see
    /// [`usage`](crate::usage)) may have made room before its retry-after.
    pub(crate) fn forget(&self, key: &Key, policy: &Policy) {
        self.entries.lock(key, policy).remove(key, policy);
    }

    /// The refusal still in force for a request of `cost`, with its times brought up to now.
    pub(crate) fn refusal(&self, key: &Key, policy: &Policy, cost: u32) -> Option<Decision> {
        let now = self.now();
        let mut shard = self.entries.lock(key, policy);
        let slot = shard.get(key, policy, now)?;
        if !slot.is_live(now) || cost < slot.value.cost {
            return None;
        }
        let left = Duration::from_micros(slot.expires - now);
        let mut decision = slot.value.decision;
        let elapsed = decision
            .retry_after
            .unwrap_or_default()
            .saturating_sub(left);
        decision.retry_after = Some(left);
        decision.reset_after = decision.reset_after.saturating_sub(elapsed);
        Some(decision)
    }
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u128::from(u64::MAX)) as u64
}
