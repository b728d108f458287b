//! What the layer reports through the [`metrics`](https://docs.rs/metrics) crate (feature
//! `metrics`), labelled by policy name. Install any recorder, e.g. a Prometheus exporter, and
//! these appear:
//!
//! | name | kind | labels | counts |
//! |---|---|---|---|
//! | `ratelimit_allowed_total` | counter | `policy` | requests the store admitted |
//! | `ratelimit_denied_total` | counter | `policy`, `source` | requests refused: `source="store"` when the store said no to a rate limit (in shadow mode too), `"deny_cache"` when the deny cache repeated a refusal, `"concurrency"` when the key held every concurrency slot ([`Policy::concurrency`](crate::Policy::concurrency)) |
//! | `ratelimit_slots_in_use` | gauge | `policy` | concurrency slots this instance holds for requests in flight (sum over instances for the fleet) |
//! | `ratelimit_slots_lost_total` | counter | `policy` | concurrency slots gone at their renewal (the store out of reach longer than the slot lifetime, or its state lost): their requests ran on uncounted |
//! | `ratelimit_store_errors_total` | counter | `policy` | decisions the store could not make (the failure mode then applies) |
//! | `ratelimit_fallbacks_total` | counter | `policy` | of those, decisions made by the fallback store instead |
//! | `ratelimit_settle_errors_total` | counter | `policy` | usage settlements (and concurrency slots' give-backs and renewals) that did not run, got no reply within their patience (3 s on Redis), or were abandoned when their runtime shut down (see [`usage`](crate::usage)); a late settle that landed is not counted; the responses were not affected |
//! | `ratelimit_evicted_pinned_total` | counter | `policy` | memory-store keys evicted while pinned (in their penalty box, or holding concurrency slots) because every key of their shard was pinned: the key whose pin ended soonest went, and starts afresh (see [`MemoryStore`](crate::MemoryStore)) |
//! | `ratelimit_overrides_lost_total` | counter | | times a [`RedisStore`](crate::RedisStore) found the overrides in Redis lost (the epoch of the limits version gone or replaced: a restart without persistence, a flush); logged at ERROR too, see `docs/operations.md` |
//! | `ratelimit_decision_seconds` | histogram | `policy` | time from asking the store to its answer, failures included; for a request that waited for a concurrency slot (`max_wait`), to its last answer, the wait included |
//!
//! Without the feature these functions do nothing and cost nothing.

use std::time::Duration;

use crate::Policy;

/// Request counts and latencies by policy. The `policy` label is the policy's shared name, so
/// that an event does not copy it.
pub(crate) struct Report;

#[cfg(feature = "metrics")]
impl Report {
    pub(crate) fn allowed(policy: &Policy) {
        ::metrics::counter!("ratelimit_allowed_total", "policy" => policy.shared_name())
            .increment(1);
    }

    pub(crate) fn denied(policy: &Policy, cached: bool) {
        let source = if cached { "deny_cache" } else { "store" };
        ::metrics::counter!(
            "ratelimit_denied_total",
            "policy" => policy.shared_name(),
            "source" => source
        )
        .increment(1);
    }

    pub(crate) fn store_error(policy: &Policy) {
        ::metrics::counter!("ratelimit_store_errors_total", "policy" => policy.shared_name())
            .increment(1);
    }

    pub(crate) fn fallback(policy: &Policy) {
        ::metrics::counter!("ratelimit_fallbacks_total", "policy" => policy.shared_name())
            .increment(1);
    }

    pub(crate) fn settle_error(policy: &Policy) {
        ::metrics::counter!("ratelimit_settle_errors_total", "policy" => policy.shared_name())
            .increment(1);
    }

    /// Not by policy: the overrides of every policy went at once.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn overrides_lost() {
        ::metrics::counter!("ratelimit_overrides_lost_total").increment(1);
    }

    pub(crate) fn denied_concurrency(policy: &Policy) {
        ::metrics::counter!(
            "ratelimit_denied_total",
            "policy" => policy.shared_name(),
            "source" => "concurrency"
        )
        .increment(1);
    }

    pub(crate) fn slots_in_use(policy: &Policy, change: f64) {
        ::metrics::gauge!("ratelimit_slots_in_use", "policy" => policy.shared_name())
            .increment(change);
    }

    pub(crate) fn slot_lost(policy: &Policy) {
        ::metrics::counter!("ratelimit_slots_lost_total", "policy" => policy.shared_name())
            .increment(1);
    }

    /// A pinned entry of a shard map evicted to keep its bound; `identity` is its policy's
    /// identity (`Policy::identity`), labelled by the name before its first colon.
    pub(crate) fn evicted_pinned(identity: &str) {
        let name = identity.split(':').next().unwrap_or_default().to_owned();
        ::metrics::counter!("ratelimit_evicted_pinned_total", "policy" => name).increment(1);
    }

    pub(crate) fn latency(policy: &Policy, took: Duration) {
        ::metrics::histogram!("ratelimit_decision_seconds", "policy" => policy.shared_name())
            .record(took.as_secs_f64());
    }
}

#[cfg(not(feature = "metrics"))]
impl Report {
    pub(crate) fn allowed(_: &Policy) {}
    pub(crate) fn denied(_: &Policy, _: bool) {}
    pub(crate) fn store_error(_: &Policy) {}
    pub(crate) fn fallback(_: &Policy) {}
    pub(crate) fn settle_error(_: &Policy) {}
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn overrides_lost() {}
    pub(crate) fn latency(_: &Policy, _: Duration) {}
    pub(crate) fn denied_concurrency(_: &Policy) {}
    pub(crate) fn slots_in_use(_: &Policy, _: f64) {}
    pub(crate) fn slot_lost(_: &Policy) {}
    pub(crate) fn evicted_pinned(_: &str) {}
}

/// When a decision started, kept only when there is a histogram to feed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started(#[cfg(feature = "metrics")] std::time::Instant);

impl Started {
    pub(crate) fn now() -> Self {
        Started(
            #[cfg(feature = "metrics")]
            std::time::Instant::now(),
        )
    }

    /// Reports the decision's latency.
    pub(crate) fn finish(self, policy: &Policy) {
        #[cfg(feature = "metrics")]
        Report::latency(policy, self.0.elapsed());
        #[cfg(not(feature = "metrics"))]
        let _ = policy;
    }
}
