//! `Store::settle`: the same scenarios on the memory store (virtual clock, exact figures) and
//! on Redis (real time, figures within a margin), for every algorithm.

use std::time::{Duration, UNIX_EPOCH};

use crate::support::time::Time;
use crate::support::RedisServer;
use crate::support::ALGORITHMS;
use tower_redis_ratelimit::store::{Leases, ManualClock};
use tower_redis_ratelimit::test_util::limit_index;
use tower_redis_ratelimit::test_util::units as units_of;
use tower_redis_ratelimit::{
    Algorithm, Key, MemoryStore, Policy, RedisStore, Settlement, Store, StoreError,
};

const MS: Duration = Duration::from_millis(1);
const MINUTE: Duration = Duration::from_secs(60);

fn policy(spec: &str, algorithm: Algorithm) -> Policy {
    spec.parse::<Policy>().unwrap().with_algorithm(algorithm)
}

fn key(scenario: &str, algorithm: Algorithm) -> Key {
    Key::from(format!("{scenario}-{algorithm:?}"))
}

async fn charge<St: Store>(store: &St, key: &Key, policy: &Policy, cost: u32, units: u64) {
    let d = store.check(key, policy, cost).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    let settlement = Settlement::charge(&d, units).expect("admitted");
    assert!(!units_of(&settlement).1);
    store.settle(key, policy, settlement).await.unwrap();
}

async fn refund<St: Store>(store: &St, key: &Key, policy: &Policy, cost: u32, units: u64) {
    let d = store.check(key, policy, cost).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    let settlement = Settlement::refund(&d, units).expect("admitted");
    assert_eq!(
        units_of(&settlement).0,
        units.min(cost.into()),
        "capped at the cost"
    );
    store.settle(key, policy, settlement).await.unwrap();
}

/// Check of 1, charge of 499: the next check of 1 sees 1000 - 500 - 1 left.
async fn charge_counts<St: Store>(store: &St, time: &Time, algorithm: Algorithm) {
    time.away_from_minute_edge().await;
    let (key, policy) = (key("charge", algorithm), policy("1000/1m", algorithm));
    charge(store, &key, &policy, 1, 499).await;
    let d = store.check(&key, &policy, 1).await.unwrap();
    assert_eq!(d.remaining(), 1000 - 500 - 1, "{algorithm:?}: {d:?}");
}

/// Two requests of 1 + 499: full, and a third is refused until enough usage ages out or
/// drains.
async fn charge_goes_over<St: Store>(store: &St, time: &Time, algorithm: Algorithm) {
    time.away_from_minute_edge().await;
    let (key, policy) = (key("over", algorithm), policy("1000/1m", algorithm));
    let first = time.now();
    charge(store, &key, &policy, 1, 499).await;
    charge(store, &key, &policy, 1, 499).await;
    let e = time.elapsed_in_window(MINUTE);
    let d = store.check(&key, &policy, 1).await.unwrap();
    assert!(!d.is_allowed(), "{algorithm:?}: {d:?}");
    let want = match algorithm {
        // The first unit leaves the log a minute after it came.
        Algorithm::SlidingLog => MINUTE - (time.now() - first),
        Algorithm::FixedWindow => MINUTE - e,
        // Next window, where the previous 1000 weigh 999 once 60 ms in.
        Algorithm::SlidingWindow => MINUTE - e + 60 * MS,
        // One unit drains every 60 ms.
        _ => 60 * MS,
    };
    let got = d.retry_after().expect("a wait helps");
    assert!(
        got.abs_diff(want) <= time.margin(),
        "{algorithm:?}: retry {got:?}, want {want:?}"
    );
    // Settling never refuses, even over the limit.
    let settled = Settlement::charge(&d, 5);
    assert_eq!(settled, None, "nothing to settle for a refused request");
}

/// Check of 100, refund of 90: as if 10 were used. Refund of 500 of 100: only the 100.
async fn refund_gives_back<St: Store>(store: &St, time: &Time, algorithm: Algorithm) {
    time.away_from_minute_edge().await;
    let policy = policy("1000/1m", algorithm);
    let key90 = key("refund", algorithm);
    refund(store, &key90, &policy, 100, 90).await;
    let d = store.check(&key90, &policy, 1).await.unwrap();
    assert_eq!(d.remaining(), 1000 - 10 - 1, "{algorithm:?}: {d:?}");

    let key500 = key("refund-capped", algorithm);
    refund(store, &key500, &policy, 100, 500).await;
    let d = store.check(&key500, &policy, 1).await.unwrap();
    assert_eq!(d.remaining(), 1000 - 1, "{algorithm:?}: {d:?}");
    // Refunding twice takes back no more than the request recorded, and never goes below zero.
    let settlement = Settlement::refund(&d, 500).unwrap();
    assert_eq!(units_of(&settlement).0, 1);
    store.settle(&key500, &policy, settlement).await.unwrap();
    store.settle(&key500, &policy, settlement).await.unwrap();
    let d = store.peek(&key500, &policy, 1).await.unwrap();
    assert_eq!(d.remaining(), 1000, "{algorithm:?}: {d:?}");
}

/// Fixed window: a refund after the request's window has passed changes nothing.
async fn late_refund_changes_nothing<St: Store>(store: &St, time: &Time) {
    let (key, policy) = (Key::from("late"), policy("1000/1s", Algorithm::FixedWindow));
    time.align(Duration::from_secs(1), 100 * MS).await;
    let first = store.check(&key, &policy, 100).await.unwrap();
    time.align(Duration::from_secs(1), 100 * MS).await;
    assert_eq!(
        store.check(&key, &policy, 500).await.unwrap().remaining(),
        500
    );
    let late = Settlement::refund(&first, 90).unwrap();
    store.settle(&key, &policy, late).await.unwrap();
    let d = store.check(&key, &policy, 1).await.unwrap();
    assert_eq!(d.remaining(), 499, "{d:?}");
}

/// `10/1s + 1000/1m`: a charge counts against both limits.
async fn charge_counts_in_every_limit<St: Store>(store: &St, time: &Time, algorithm: Algorithm) {
    time.away_from_minute_edge().await;
    // Within one second's window too.
    time.align(Duration::from_secs(1), 100 * MS).await;
    let both = policy("10/1s + 1000/1m", algorithm);
    let short = key("multi-short", algorithm);
    charge(store, &short, &both, 1, 9).await;
    let d = store.check(&short, &both, 1).await.unwrap();
    assert!(!d.is_allowed(), "{algorithm:?}: {d:?}");
    assert_eq!(limit_index(&d), 0, "{algorithm:?}: {d:?}");

    // GCRA's 10/1s drains slower than 1000/1m, so it is always the later of the two; a long
    // limit of a slower rate shows the charge there.
    let (policy, units) = match algorithm {
        Algorithm::Gcra => (policy("10/1s + 20/1m", algorithm), 19),
        _ => (both, 999),
    };
    let long = key("multi-long", algorithm);
    charge(store, &long, &policy, 1, units).await;
    let d = store.check(&long, &policy, 1).await.unwrap();
    assert!(!d.is_allowed(), "{algorithm:?}: {d:?}");
    assert_eq!(limit_index(&d), 1, "{algorithm:?}: {d:?}");
    assert_eq!(d.remaining(), 0, "{algorithm:?}: {d:?}");
}

async fn every_scenario<St: Store>(store: &St, time: &Time) {
    for algorithm in ALGORITHMS {
        charge_counts(store, time, algorithm).await;
        charge_goes_over(store, time, algorithm).await;
        refund_gives_back(store, time, algorithm).await;
        charge_counts_in_every_limit(store, time, algorithm).await;
    }
    late_refund_changes_nothing(store, time).await;
}

fn memory() -> (MemoryStore, Time) {
    // On a minute boundary.
    let clock = ManualClock::from(UNIX_EPOCH + 28_333_334 * MINUTE);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    (store, Time::Manual(clock))
}

#[tokio::test]
async fn memory_store_settles() {
    let (store, time) = memory();
    every_scenario(&store, &time).await;
}

#[tokio::test]
async fn memory_store_refund_of_a_peek_gives_back_nothing() {
    let (store, _) = memory();
    // A peek records nothing: no units to give back, whatever is asked.
    for algorithm in ALGORITHMS {
        let policy = policy("1000/1m", algorithm);
        let key = key("peek", algorithm);
        store.check(&key, &policy, 100).await.unwrap();
        let peeked = store.peek(&key, &policy, 1).await.unwrap();
        let settlement = Settlement::refund(&peeked, 50).unwrap();
        assert_eq!(units_of(&settlement).0, 0);
        store.settle(&key, &policy, settlement).await.unwrap();
        assert_eq!(store.peek(&key, &policy, 1).await.unwrap().remaining(), 900);
    }
}

#[tokio::test]
async fn redis_store_settles() {
    let server = RedisServer::start();
    let store = server.store().await;
    every_scenario(&store, &Time::Real).await;
}

#[tokio::test]
async fn redis_settle_is_one_evalsha() {
    let server = RedisServer::start();
    let store = server.store().await;
    let client = server.client().await;
    for algorithm in ALGORITHMS {
        let (key, policy) = (
            key("count", algorithm),
            policy("10/1s + 1000/1m", algorithm),
        );
        // The first call loads the script.
        let d = store.check(&key, &policy, 5).await.unwrap();
        for settlement in [
            Settlement::charge(&d, 3).unwrap(),
            Settlement::refund(&d, 4).unwrap(),
        ] {
            let before = crate::support::evalsha_calls(&client).await;
            store.settle(&key, &policy, settlement).await.unwrap();
            let after = crate::support::evalsha_calls(&client).await;
            assert_eq!(after - before, 1, "{algorithm:?}: {settlement:?}");
        }
    }
}

#[tokio::test]
async fn redis_settle_with_leases_goes_to_redis() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .leases(Leases::new())
        .connect()
        .await
        .unwrap();
    let (key, policy) = (Key::from("leased"), policy("1000/1m", Algorithm::Gcra));
    let d = store.check(&key, &policy, 1).await.unwrap();
    store
        .settle(&key, &policy, Settlement::charge(&d, 499).unwrap())
        .await
        .unwrap();
    let d = store.peek(&key, &policy, 1).await.unwrap();
    // A leasing store keeps h = 1 s (the lease period) of drain free in the 1000/1m bucket, so
    // its burst, and what a peek reports, is floor(1000 * 59 / 60) = 983 units.
    assert_eq!(d.remaining(), 983 - 500, "{d:?}");
}

#[tokio::test]
async fn redis_settle_fails_without_redis() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let key = Key::from("gone");
    let d = store.check(&key, &policy, 10).await.unwrap();
    server.kill();
    for settlement in [
        Settlement::charge(&d, 5).unwrap(),
        Settlement::refund(&d, 5).unwrap(),
    ] {
        let result: Result<(), StoreError> = store.settle(&key, &policy, settlement).await;
        assert!(result.is_err(), "{result:?}");
    }
}
