//! The local deny cache: refusals the layer can repeat without asking the store.
//!
//! After the store refuses a key with a retry-after `T`, any request for the same key and
//! policy that costs at least as much is refused locally until `T` has passed: a client that
//! hammers a refused key costs no Redis command, and is asked about again once it could be
//! admitted. Nothing is admitted locally, so the cache never loosens a limit. Entries expire
//! with their retry-after; the cache holds a bounded number of them (moka's eviction).

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::sync::Cache;

use crate::{Decision, Key, Policy};

/// One remembered refusal.
#[derive(Clone, Copy)]
struct Denial {
    decision: Decision,
    cost: u32,
    /// When it was made, on tokio's clock, so that it follows paused test time.
    at: tokio::time::Instant,
    retry: Duration,
}

/// Refusals by (policy, key). Clones share entries.
#[derive(Clone)]
pub(crate) struct DenyCache {
    entries: Cache<(Arc<str>, Key), Denial>,
}

impl DenyCache {
    pub(crate) fn new(capacity: u64) -> Self {
        DenyCache {
            entries: Cache::builder()
                .max_capacity(capacity)
                .expire_after(UntilRetry)
                .build(),
        }
    }

    /// Remembers a refusal that says when to retry.
    pub(crate) fn remember(&self, key: &Key, policy: &Policy, cost: u32, decision: Decision) {
        if let Some(retry) = decision.retry_after() {
            let denial = Denial {
                decision,
                cost,
                at: tokio::time::Instant::now(),
                retry,
            };
            self.entries
                .insert((policy.shared_name(), key.clone()), denial);
        }
    }

    /// The refusal still in force for a request of `cost`, with its times brought up to now.
    pub(crate) fn refusal(&self, key: &Key, policy: &Policy, cost: u32) -> Option<Decision> {
        let denial = self.entries.get(&(policy.shared_name(), key.clone()))?;
        let elapsed = denial.at.elapsed();
        if cost < denial.cost || elapsed >= denial.retry {
            return None;
        }
        let mut decision = denial.decision;
        decision.retry_after = Some(denial.retry - elapsed);
        decision.reset_after = decision.reset_after.saturating_sub(elapsed);
        Some(decision)
    }
}

struct UntilRetry;

impl moka::Expiry<(Arc<str>, Key), Denial> for UntilRetry {
    fn expire_after_create(&self, _: &(Arc<str>, Key), d: &Denial, _: Instant) -> Option<Duration> {
        Some(d.retry)
    }

    fn expire_after_update(
        &self,
        _: &(Arc<str>, Key),
        d: &Denial,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(d.retry)
    }
}
