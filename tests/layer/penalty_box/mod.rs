//! The penalty box (`Policy::block_for`): once a key hits its limit, every request of it is
//! refused for at least the box's length, whatever the windows say, and until its limits admit
//! it again, with a `Retry-After` that is the later of the two (never early); a charge that
//! fills the key sets it too; nothing extends a running box; `reset` clears it; the memory
//! store keeps boxed keys under memory pressure. The memory store on a manual clock, every
//! algorithm; Redis with short durations.

mod memory_bound;
mod refusals;
mod until_admitted;

use std::time::{Duration, Instant, UNIX_EPOCH};

use crate::support::http::{api_key, keyed};
use crate::support::RedisServer;
use crate::support::ALGORITHMS;
use tower::ServiceExt;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, MemoryStore, Policy, RateLimitLayer, Settlement, Store,
};

const BOX: Duration = Duration::from_secs(15 * 60);

fn boxed(algorithm: Algorithm) -> Policy {
    Policy::new("login", ["3/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
        .block_for(BOX)
        .unwrap()
}

async fn check<St: Store>(store: &St, key: &Key, policy: &Policy) -> Decision {
    store.check(key, policy, 1).await.unwrap()
}

/// Puts `key` in the box by going over `policy`'s first limit, then resets it: free at once.
async fn reset_clears_the_box<St: Store>(store: &St, key: &Key, policy: &Policy) {
    for _ in 0..policy.limits()[0].count() {
        check(store, key, policy).await;
    }
    assert!(check(store, key, policy).await.in_penalty_box(), "{key:?}");
    store.reset(key, policy).await.unwrap();
    assert!(
        check(store, key, policy).await.is_allowed(),
        "{key:?}: reset"
    );
}

/// A whole hour since the epoch: windows of an hour start here, so that the figures below are
/// those worked out by hand.
const ON_THE_HOUR: u64 = 1_699_999_200;
const SECOND: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Charges `units` more to the request `admitted` let in, as its settle after the response.
async fn charge<St: Store>(
    store: &St,
    key: &Key,
    policy: &Policy,
    admitted: &Decision,
    units: u64,
) {
    let charge = Settlement::charge(admitted, units).unwrap();
    store.settle(key, policy, charge).await.unwrap();
}
