//! Limits that change at run time, on both stores and all four algorithms: other counts for
//! one policy's state (`Policy::with_limits`), and the store's overrides for a key or a whole
//! policy. Usage carries over, so a raise admits exactly the difference, a cut refuses with
//! the wait the algorithm's own state gives, and going back restores the policy's own
//! answers. A named policy keeps its state by name and windows; unnamed policies with other
//! limits never share one.

mod counts;
mod fleet;
mod overrides;

use std::time::{Duration, UNIX_EPOCH};

use crate::support::http::{api_key, instance, keyed, passes, served, LayerBody};
use crate::support::time::Time;
use crate::support::ALGORITHMS;
use crate::support::{command_calls, RedisServer};
use tower_redis_ratelimit::store::{ManualClock, Override, OverrideError, Overrides, Scope};
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, Limit, MemoryStore, Policy, PolicyError, RedisStore, Store,
};

const HOUR: Duration = Duration::from_secs(3600);

fn memory() -> (MemoryStore, Time) {
    // 14 minutes into an hour, so that the fixed windows' end is not the sliding log's.
    let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_040));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    (store, Time::Manual(clock))
}

fn hourly(count: u64) -> Limit {
    Limit::new(count, HOUR).unwrap()
}

async fn check<St: Store>(store: &St, key: &Key, policy: &Policy) -> Decision {
    store.check(key, policy, 1).await.unwrap()
}

async fn admitted<St: Store>(store: &St, key: &Key, policy: &Policy, tries: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..tries {
        admitted += usize::from(check(store, key, policy).await.is_allowed());
    }
    admitted
}

/// How long a key that holds `used` units, all taken `since` ago (`into` the current hour),
/// is refused one more under `count` per hour.
fn expected_wait(
    algorithm: Algorithm,
    count: u64,
    used: u64,
    since: Duration,
    into: Duration,
) -> Duration {
    let to_next_hour = HOUR - into;
    match algorithm {
        // Every entry is in the window until an hour after it.
        Algorithm::SlidingLog => HOUR - since,
        // This hour's counter is full until the hour ends.
        Algorithm::FixedWindow => to_next_hour,
        // Next hour, the `used` units weigh `used * (1 - e / 1h)` until that leaves room for one:
        // e = 1h * (1 - (count - 1) / used).
        Algorithm::SlidingWindow => {
            to_next_hour + HOUR.mul_f64(1.0 - (count - 1) as f64 / used as f64)
        }
        // `used` units drain `count` per hour until `count - 1` are left.
        _ => HOUR.mul_f64((used - (count - 1)) as f64 / count as f64) - since,
    }
}

type Body = LayerBody;

/// Checks that `decision` refuses with the wait `expected`, to the µs on the memory store and
/// to the second on Redis (real time passes between the requests and the reading).
fn assert_wait(time: &Time, decision: &Decision, expected: Duration, what: &str) {
    assert!(!decision.is_allowed(), "{what}: {decision:?}");
    let got = decision.retry_after().expect("a wait that helps");
    let slack = match time {
        Time::Manual(_) => Duration::from_micros(2),
        Time::Real => Duration::from_secs(1),
    };
    assert!(
        got.abs_diff(expected) <= slack,
        "{what}: retry after {got:?}, expected {expected:?}"
    );
}
