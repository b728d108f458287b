//! Arithmetic and refunds at the edges, on both stores: big budgets, big usage, refunds that
//! land late or after the state they were taken from is gone, and requests that share a
//! microsecond.

use std::time::{Duration, UNIX_EPOCH};

use crate::support::time::Time;
use crate::support::RedisServer;
use crate::support::ALGORITHMS;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::{
    Algorithm, BuildError, Decision, Key, Limit, LimitError, MemoryStore, Policy, RateLimitLayer,
    Settlement, Store, StoreError,
};

const MINUTE: Duration = Duration::from_secs(60);

fn policy(spec: &str, algorithm: Algorithm) -> Policy {
    spec.parse::<Policy>().unwrap().with_algorithm(algorithm)
}

fn memory() -> (MemoryStore, Time) {
    // On a minute boundary.
    let clock = ManualClock::from(UNIX_EPOCH + 28_333_334 * MINUTE);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    (store, Time::Manual(clock))
}

async fn check<St: Store>(store: &St, key: &Key, policy: &Policy, cost: u32) -> Decision {
    store.check(key, policy, cost).await.unwrap()
}

async fn settle<St: Store>(store: &St, key: &Key, policy: &Policy, settlement: Settlement) {
    store.settle(key, policy, settlement).await.unwrap();
}

/// A monthly token budget spent a million at a time: five of seven pass. Its bucket in µs
/// times units is past 2^63; GCRA's units divided by gcd(count, window) keep it at 2.6 * 10^12.
async fn monthly_budget<St: Store>(store: &St) -> usize {
    let (key, policy) = (Key::from("month"), policy("5000000/30d", Algorithm::Gcra));
    let mut admitted = 0;
    for _ in 0..7 {
        let d = check(store, &key, &policy, 1_000_000).await;
        if d.is_allowed() {
            admitted += 1;
        } else {
            assert_eq!(d.remaining(), 0, "{d:?}");
            assert!(
                d.retry_after().unwrap() >= Duration::from_millis(518),
                "{d:?}"
            );
        }
    }
    admitted
}

#[tokio::test]
async fn a_monthly_gcra_budget_admits_five_of_seven_on_memory() {
    assert_eq!(monthly_budget(&memory().0).await, 5);
}

#[tokio::test]
async fn a_monthly_gcra_budget_admits_five_of_seven_on_redis() {
    let server = RedisServer::start();
    assert_eq!(monthly_budget(&server.store().await).await, 5);
}

/// A reserves 100 of `spec`'s bucket of 100 per 2 s; once that has drained, B uses 100; then
/// A's refund lands. It frees nothing (what it would free has drained already): C is refused.
async fn late_gcra_refund<St: Store>(store: &St, time: &Time, spec: &str) -> Decision {
    let (key, policy) = (
        Key::from(format!("late {spec}")),
        policy(spec, Algorithm::Gcra),
    );
    let a = check(store, &key, &policy, 100).await;
    assert!(a.is_allowed());
    time.pass(Duration::from_millis(2_500)).await;
    let b = check(store, &key, &policy, 100).await;
    assert!(b.is_allowed(), "{b:?}");
    settle(store, &key, &policy, Settlement::refund(&a, 100).unwrap()).await;
    check(store, &key, &policy, 100).await
}

#[tokio::test]
async fn a_late_gcra_refund_frees_only_what_still_weighs_on_memory() {
    let (store, time) = memory();
    for spec in ["100/2s", "100/2s + 1000/1h"] {
        let c = late_gcra_refund(&store, &time, spec).await;
        assert!(!c.is_allowed(), "{spec}: {c:?}");
    }
}

#[tokio::test]
async fn a_late_gcra_refund_frees_only_what_still_weighs_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    for spec in ["100/2s", "100/2s + 1000/1h"] {
        let c = late_gcra_refund(&store, &Time::Real, spec).await;
        assert!(!c.is_allowed(), "{spec}: {c:?}");
    }
}

/// A reserves 100 of `100/1m`; the key is reset; B uses 100; A's refund lands. The state it
/// was taken from is gone, so it frees nothing: C is refused.
async fn refund_after(store: &impl Store, time: &Time, replace: impl AsyncFn(&Key, &Policy)) {
    time.away_from_minute_edge().await;
    for algorithm in ALGORITHMS {
        let (key, policy) = (Key::from("reset"), policy("100/1m", algorithm));
        let a = check(store, &key, &policy, 100).await;
        replace(&key, &policy).await;
        let b = check(store, &key, &policy, 100).await;
        assert!(b.is_allowed(), "{algorithm:?}: {b:?}");
        settle(store, &key, &policy, Settlement::refund(&a, 100).unwrap()).await;
        // Nothing freed, not even part of it.
        let left = store.peek(&key, &policy, 1).await.unwrap().remaining();
        assert_eq!(left, 0, "{algorithm:?}");
        let c = check(store, &key, &policy, 100).await;
        assert!(!c.is_allowed(), "{algorithm:?}: 200 in one window: {c:?}");
    }
}

#[tokio::test]
async fn a_refund_after_a_reset_frees_nothing_on_memory() {
    let (store, time) = memory();
    // The reset is a microsecond later than the admission, as on any real clock.
    let reset = async |key: &Key, policy: &Policy| {
        time.pass(Duration::from_micros(1)).await;
        store.reset(key, policy).await.unwrap();
    };
    refund_after(&store, &time, reset).await;
}

#[tokio::test]
async fn a_refund_after_a_reset_frees_nothing_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let reset = async |key: &Key, policy: &Policy| store.reset(key, policy).await.unwrap();
    refund_after(&store, &Time::Real, reset).await;
}

#[tokio::test]
async fn a_refund_after_a_restart_frees_nothing_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let server = std::sync::Mutex::new(server);
    let restart = async |key: &Key, policy: &Policy| {
        // Without persistence: the state is lost.
        server.lock().unwrap().restart();
        for _ in 0..100 {
            if store.peek(key, policy, 1).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the store did not reconnect");
    };
    refund_after(&store, &Time::Real, restart).await;
}

/// Usage past anything a state holds, for every algorithm: charged without error, the key is
/// then refused (not failed, not wrapped to empty), and later settlements still work.
async fn huge_usage<St: Store>(store: &St) {
    let values = [
        (1 << 53) - 1,
        1 << 53,
        (1 << 53) + 1,
        200_000_000_000,
        1 << 63,
        u64::MAX,
    ];
    for algorithm in ALGORITHMS {
        for (i, units) in values.into_iter().enumerate() {
            let (key, policy) = (Key::from(format!("huge {i}")), policy("1000/1m", algorithm));
            let d = check(store, &key, &policy, 1).await;
            settle(store, &key, &policy, Settlement::charge(&d, units).unwrap()).await;
            let after = store.check(&key, &policy, 1).await;
            let after = after.unwrap_or_else(|e| panic!("{algorithm:?} {units}: {e}"));
            assert!(!after.is_allowed(), "{algorithm:?} {units}: {after:?}");
            assert_eq!(after.remaining(), 0, "{algorithm:?} {units}");
            // Charged again, and a refund of the first request: still refused, still sound.
            settle(store, &key, &policy, Settlement::charge(&d, units).unwrap()).await;
            settle(store, &key, &policy, Settlement::refund(&d, 1).unwrap()).await;
            let again = check(store, &key, &policy, 1).await;
            assert!(!again.is_allowed(), "{algorithm:?} {units}: {again:?}");
        }
    }
}

#[tokio::test]
async fn usage_past_any_state_saturates_on_memory() {
    huge_usage(&memory().0).await;
}

#[tokio::test]
async fn usage_past_any_state_saturates_on_redis() {
    let server = RedisServer::start();
    huge_usage(&server.store().await).await;
}

/// Two requests of one microsecond, each reserving 100 and using 10, on the sliding log:
/// each refund lands on its own entry.
#[tokio::test]
async fn requests_of_one_microsecond_refund_their_own_entries_on_memory() {
    let (store, _) = memory();
    let (key, policy) = (Key::from("same"), policy("1000/1m", Algorithm::SlidingLog));
    let a = check(&store, &key, &policy, 100).await;
    let b = check(&store, &key, &policy, 100).await;
    for d in [a, b] {
        settle(&store, &key, &policy, Settlement::refund(&d, 90).unwrap()).await;
    }
    assert_eq!(store.peek(&key, &policy, 0).await.unwrap().remaining(), 980);
}

/// Sixteen concurrent requests are decided in one script call, at one Redis time.
#[tokio::test]
async fn requests_of_one_microsecond_refund_their_own_entries_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let (key, policy) = (Key::from("same"), policy("10000/1m", Algorithm::SlidingLog));
    let checks = (0..16).map(|_| check(&store, &key, &policy, 100));
    let decisions = futures::future::join_all(checks).await;
    let refunds = decisions
        .iter()
        .map(|d| settle(&store, &key, &policy, Settlement::refund(d, 90).unwrap()));
    futures::future::join_all(refunds).await;
    let left = store.peek(&key, &policy, 0).await.unwrap().remaining();
    assert_eq!(left, 10_000 - 16 * 10);
}

#[tokio::test]
async fn limits_out_of_range_are_refused_when_built() {
    assert_eq!(
        "2000000000000000/1m".parse::<Limit>(),
        Err(LimitError::CountTooLarge {
            count: 2_000_000_000_000_000
        })
    );
    assert!(matches!(
        "1/3651d".parse::<Limit>(),
        Err(LimitError::WindowTooLong { .. })
    ));
    assert!("1125899906842624/3650d".parse::<Limit>().is_ok());

    // GCRA's bucket: 1 000 003 per 30 days shares no factor with the window.
    let local = MemoryStore::new();
    let key = Key::from("range");
    let fine = policy("1000003/30d", Algorithm::Gcra);
    let refused = local.check(&key, &fine, 1).await;
    assert!(
        matches!(refused, Err(StoreError::Unsupported(_))),
        "{refused:?}"
    );
    let fixed = policy("1000003/30d", Algorithm::FixedWindow);
    assert!(local.check(&key, &fixed, 1).await.unwrap().is_allowed());
    let built = RateLimitLayer::builder()
        .policy(
            "1000003/30d"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(Algorithm::Gcra),
        )
        .build();
    assert!(
        matches!(built, Err(BuildError::Unsupported { .. })),
        "{built:?}"
    );
    let (store, _) = memory();
    let decided = store.check(&Key::from("k"), &fine, 1).await;
    assert!(
        matches!(decided, Err(StoreError::Unsupported(_))),
        "{decided:?}"
    );
    let server = RedisServer::start();
    let decided = server.store().await.check(&Key::from("k"), &fine, 1).await;
    assert!(
        matches!(decided, Err(StoreError::Unsupported(_))),
        "{decided:?}"
    );
}
