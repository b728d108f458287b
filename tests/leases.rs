//! Leases against a real Redis: a fleet of leasing instances never admits more than the limit
//! and little less; idle keys and `drain()` give their units back; with Redis gone, leases
//! are served until they expire, then the failure mode applies within the time budget.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{evalsha_calls, RedisServer};
use fred::prelude::*;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::{
    Algorithm, BuildError, Key, Policy, RateLimitLayer, RedisStore, Store, StoreError,
};

async fn leasing(url: String) -> RedisStore {
    RedisStore::builder(url)
        .leases(Leases::new())
        .timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap()
}

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Asks as the layer does: from the lease if it can, else through Redis. Returns the decision,
/// whether the lease answered, and the window (its start, µs since the epoch) it was counted in: for a lease, the local
/// time it was spent; for Redis, the window whose end the decision reports (`reset_after` of
/// a fixed window is the time to its end, on Redis's clock).
async fn decide(
    store: &RedisStore,
    key: &Key,
    policy: &Policy,
    window: u64,
) -> (Result<bool, StoreError>, bool, u64) {
    let before = micros_now();
    if let Some(outcome) = store.check_now(key, policy, 1) {
        return (
            outcome.map(|d| d.is_allowed()),
            true,
            before - before % window,
        );
    }
    match store.check(key, policy, 1).await {
        Ok(d) => {
            let end = before + d.reset_after().as_micros() as u64;
            let end = (end + window / 2) / window * window;
            (Ok(d.is_allowed()), false, end - window)
        }
        Err(e) => (Err(e), false, 0),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_four_never_admits_more_than_the_limit_and_little_less() {
    let server = RedisServer::start();
    let policy = Policy::new("fleet", ["1000/10s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow);
    const WINDOW: u64 = 10_000_000;
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..4).map(|_| leasing(server.url()))).await;
    // Two clients, each sending three times its limit (3000 per 10 s), spread evenly over the
    // four instances: 75 requests per second per instance and client.
    let start = micros_now();
    let first_full = start - start % WINDOW + WINDOW;
    let end = first_full + 2 * WINDOW;
    let admitted = Arc::new(std::sync::Mutex::new(BTreeMap::<(usize, u64), u64>::new()));
    let from_leases = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for store in &stores {
        for client in 0..2usize {
            let (store, policy, admitted) = (store.clone(), policy.clone(), admitted.clone());
            let from_leases = from_leases.clone();
            tasks.push(tokio::spawn(async move {
                let key = Key::from(format!("client-{client}"));
                let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / 75));
                while micros_now() < end {
                    tick.tick().await;
                    let (allowed, leased, window) = decide(&store, &key, &policy, WINDOW).await;
                    if allowed.expect("Redis is up") {
                        *admitted
                            .lock()
                            .unwrap()
                            .entry((client, window))
                            .or_default() += 1;
                        if leased {
                            from_leases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let client = server.client().await;
    let calls = evalsha_calls(&client).await;
    let admitted = admitted.lock().unwrap().clone();
    let total: u64 = admitted.values().sum();
    let leased = from_leases.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "admitted per (client, window): {admitted:?}; {total} admitted, {leased} of them from \
         leases; {calls} EVALSHA in all (refusals included: the layer's deny cache is not used)"
    );
    for (&(client, window), &count) in &admitted {
        assert!(
            count <= 1000,
            "client {client}: {count} admitted in the window at {window}"
        );
    }
    for client in 0..2 {
        for window in [first_full, first_full + WINDOW] {
            let count = admitted.get(&(client, window)).copied().unwrap_or(0);
            assert!(
                count >= 950,
                "client {client}: only {count} of 1000 admitted in the full window at {window}"
            );
        }
    }
    assert!(
        leased as f64 >= 0.8 * total as f64,
        "only {leased} of {total} admitted requests were decided from leases"
    );
}

/// The count of the fixed window now in Redis for `key` (0 when none).
async fn counted(client: &Client, store: &RedisStore, key: &Key, policy: &Policy) -> i64 {
    let raw: Option<Vec<u8>> = client.get(store.redis_key(key, policy)).await.unwrap();
    raw.map_or(0, |raw| i64::from_le_bytes(raw[8..16].try_into().unwrap()))
}

/// Sends `n` requests at 200 per second, so that the key leases; returns those admitted.
async fn busy(store: &RedisStore, key: &Key, policy: &Policy, n: usize) -> i64 {
    let mut admitted = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for _ in 0..n {
        tick.tick().await;
        if decide(store, key, policy, 60_000_000).await.0.unwrap() {
            admitted += 1;
        }
    }
    admitted
}

fn fixed(limit: &str) -> Policy {
    Policy::new("idle", [limit.parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_key_gives_its_units_back_within_one_period() {
    let server = RedisServer::start();
    let client = server.client().await;
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("idle"), fixed("10000/1m"));
    let admitted = busy(&store, &key, &policy, 100).await;
    let held = counted(&client, &store, &key, &policy).await - admitted;
    assert!(held > 0, "the busy key holds a lease ({held} units)");
    let idle_since = tokio::time::Instant::now();
    loop {
        if counted(&client, &store, &key, &policy).await == admitted {
            break;
        }
        assert!(
            idle_since.elapsed() < Leases::DEFAULT_PERIOD + Duration::from_millis(300),
            "{held} leased units not back after {:?}",
            idle_since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "{held} units back {:?} after the last request",
        idle_since.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_gives_back_every_unit_and_takes_no_more() {
    let server = RedisServer::start();
    let client = server.client().await;
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("drain"), fixed("10000/1m"));
    let admitted = busy(&store, &key, &policy, 100).await;
    let held = counted(&client, &store, &key, &policy).await - admitted;
    assert!(held > 0, "the busy key holds a lease");
    assert_eq!(store.drain().await.unwrap(), held as u64);
    assert_eq!(counted(&client, &store, &key, &policy).await, admitted);
    // Afterwards every request is counted in Redis as it is decided.
    let more = busy(&store, &key, &policy, 20).await;
    assert_eq!(
        counted(&client, &store, &key, &policy).await,
        admitted + more
    );
    assert_eq!(store.drain().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_leases_are_served_until_they_expire_then_the_failure_mode() {
    let mut server = RedisServer::start();
    let store = leasing(server.url()).await;
    let policy = Policy::new("outage", ["100000/10s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let key = Key::from("outage");
    busy(&store, &key, &policy, 300).await;
    tokio::task::spawn_blocking(move || {
        server.kill();
        server
    });
    // Redis may take a moment to be gone: count from when the kill was asked.
    let killed = tokio::time::Instant::now();
    let (mut served, mut failed, mut served_late) = (0, 0, 0);
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    while killed.elapsed() < Duration::from_secs(3) {
        tick.tick().await;
        let asked = tokio::time::Instant::now();
        let (outcome, _, _) = decide(&store, &key, &policy, 1).await;
        let took = asked.elapsed();
        assert!(
            took <= Duration::from_millis(200 + 300),
            "a decision took {took:?}"
        );
        match outcome {
            Ok(true) => {
                served += 1;
                if asked - killed > Leases::DEFAULT_PERIOD + Duration::from_millis(100) {
                    served_late += 1;
                }
            }
            Ok(false) => panic!("refused far below the limit"),
            Err(_) => failed += 1,
        }
    }
    eprintln!("after the kill: {served} served from leases, {failed} failed");
    assert!(served > 50, "leased units are served while Redis is gone");
    assert_eq!(served_late, 0, "nothing is served once the leases expired");
    assert!(
        failed > 100,
        "then decisions fail and the failure mode applies"
    );
}

#[tokio::test]
async fn a_leasing_store_refuses_the_sliding_log_at_build_time() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let built = RateLimitLayer::builder()
        .policy("100/1m")
        .algorithm(Algorithm::SlidingLog)
        .store(store.clone())
        .build();
    match built {
        Err(BuildError::Unsupported { policy, why }) => {
            assert_eq!(policy, "default");
            assert!(why.contains("sliding log cannot be leased"), "{why}");
        }
        other => panic!("expected a build error, got {other:?}"),
    }
    let gcra = RateLimitLayer::builder()
        .policy("100/1m")
        .algorithm(Algorithm::Gcra)
        .store(store)
        .build();
    assert!(gcra.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_covers_every_limit_of_a_policy_and_costs() {
    let server = RedisServer::start();
    let client = server.client().await;
    let stores = [leasing(server.url()).await, leasing(server.url()).await];
    // Hour and day windows: no window ends during the test.
    let policy = Policy::new(
        "multi",
        ["40/1h".parse().unwrap(), "100/1d".parse().unwrap()],
    )
    .unwrap()
    .with_algorithm(Algorithm::FixedWindow);
    let key = Key::from("multi");
    let (mut admitted_units, mut from_leases) = (0, 0);
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for i in 0..200 {
        tick.tick().await;
        let store = &stores[i % 2];
        let (decision, leased) = match store.check_now(&key, &policy, 2) {
            Some(decision) => (decision, true),
            None => (store.check(&key, &policy, 2).await, false),
        };
        if decision.unwrap().is_allowed() {
            admitted_units += 2;
            from_leases += u64::from(leased);
        }
    }
    assert!(from_leases > 0, "no request was admitted from a lease");
    assert!(
        admitted_units <= 40,
        "{admitted_units} units admitted under 40/1h"
    );
    assert!(
        admitted_units >= 30,
        "only {admitted_units} of 40 units admitted"
    );
    for store in &stores {
        store.drain().await.unwrap();
    }
    // Both limits count exactly the units admitted, once the leases are back.
    let raw: Vec<u8> = client
        .get(stores[0].redis_key(&key, &policy))
        .await
        .unwrap();
    let field = |i: usize| i64::from_le_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    assert_eq!((field(1), field(3)), (admitted_units, admitted_units));
}
