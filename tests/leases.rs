//! Leases against a real Redis: a fleet of leasing instances never admits more than the limit
//! and little less; idle keys and `drain()` give their units back; with Redis gone, leases
//! are served until they expire, then the failure mode applies within the time budget.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::http::{api_key, passes, served, LayerBody};
use common::{evalsha_calls, RedisServer};
use fred::prelude::*;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::{
    Algorithm, BuildError, Key, Policy, RateLimitLayer, RedisStore, Settlement, Store, StoreError,
};

async fn leasing(url: String) -> RedisStore {
    leasing_with(url, Leases::new(), Duration::from_millis(200)).await
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
    named("idle", limit, Algorithm::FixedWindow)
}

fn named(name: &str, limit: &str, algorithm: Algorithm) -> Policy {
    Policy::new(name, [limit.parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
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

/// The sliding log is leased (its windows read longer, `docs/leases.md`); a GCRA policy whose
/// headroom would starve the bucket is still refused (`impossible_lease_settings_fail_to_build`).
#[tokio::test]
async fn a_leasing_store_takes_the_sliding_log() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let built = RateLimitLayer::builder()
        .policy("100/1m")
        .algorithm(Algorithm::SlidingLog)
        .store(store.clone())
        .build();
    assert!(built.is_ok(), "{:?}", built.err());
    let key = Key::from("log");
    assert_eq!(
        paced(&store, &key, &log("100/1m"), 40, Duration::from_millis(5)).await,
        40
    );
    assert!(
        store.check_now(&key, &log("100/1m"), 1).is_some(),
        "a busy key of the log holds a lease"
    );
}

/// A policy with a penalty box (or a concurrency limit) is never leased, so a leasing store
/// takes it whatever its algorithm, the sliding log included, and decides each request in
/// Redis, the box with it.
#[tokio::test]
async fn a_leasing_store_takes_a_boxed_sliding_log() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let sliding_log = |limit: &str| {
        Policy::new("login", [limit.parse().unwrap()])
            .unwrap()
            .with_algorithm(Algorithm::SlidingLog)
    };
    let boxed = sliding_log("2/300ms")
        .block_for(Duration::from_secs(1))
        .unwrap();
    let streams = sliding_log("100/1m").named("streams").unwrap();
    let streams = streams.concurrency(2).unwrap();
    assert!(store.supports(&boxed).is_ok() && store.supports(&streams).is_ok());
    let layer = RateLimitLayer::builder()
        .policy(boxed.clone())
        .key(api_key())
        .store(store.clone())
        .build();
    let layer = layer.expect("a boxed sliding log builds on a leasing store");
    let service = served(layer);
    let admin = server.client().await;
    let before = evalsha_calls(&admin).await;
    assert!(passes(&service, "mallory").await);
    assert!(passes(&service, "mallory").await);
    assert!(!passes(&service, "mallory").await);
    assert_eq!(
        evalsha_calls(&admin).await - before,
        3,
        "each decided in Redis"
    );
    let key = Key::from("mallory");
    let boxed_now = store.peek(&key, &boxed, 1).await.unwrap();
    assert!(boxed_now.in_penalty_box(), "{boxed_now:?}");
    let left = boxed_now.retry_after().unwrap();
    assert!(left <= Duration::from_secs(1), "{left:?}");
    tokio::time::sleep(left + Duration::from_millis(100)).await;
    assert!(passes(&service, "mallory").await, "free after the box");
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

// ---------------------------------------------------------------------------------------------
// Leases at their edges: policies that share a name, a reset or a restart under held leases, a
// drain during a fetch, stalls, settings that leave no burst, and what GCRA's headroom
// promises.
// ---------------------------------------------------------------------------------------------

const MINUTE: u64 = 60_000_000;

/// The body of the requests and responses of the layered test service.
type Body = LayerBody;

/// Sleeps, if needed, until at least `need` is left in the current fixed 1-minute window
/// (windows start at multiples of a minute since the Unix epoch), so that a test that must stay
/// within one window does.
async fn within_one_minute(need: Duration) {
    let now = micros_now();
    let left = MINUTE - now % MINUTE;
    if left < need.as_micros() as u64 {
        tokio::time::sleep(Duration::from_micros(left + 50_000)).await;
    }
}

/// Asks as the layer does (`check_now`, else `check`); whether the request was admitted.
async fn admit(store: &RedisStore, key: &Key, policy: &Policy, cost: u32) -> bool {
    let outcome = match store.check_now(key, policy, cost) {
        Some(outcome) => outcome,
        None => store.check(key, policy, cost).await,
    };
    matches!(outcome, Ok(d) if d.is_allowed())
}

/// A leasing store with these settings and time budget.
async fn leasing_with(url: String, leases: Leases, timeout: Duration) -> RedisStore {
    RedisStore::builder(url)
        .leases(leases)
        .timeout(timeout)
        .connect()
        .await
        .unwrap()
}

/// Blocks the Redis behind `client` for `seconds` (`DEBUG SLEEP`, which needs a server started
/// with `--enable-debug-command local`); returns when it answers again.
async fn stall(client: &Client, seconds: f64) {
    let debug = fred::types::CustomCommand::new_static("DEBUG", None, false);
    let _: fred::types::Value = client
        .custom(debug, vec!["SLEEP".to_owned(), seconds.to_string()])
        .await
        .expect("DEBUG SLEEP (is the debug command enabled?)");
}

/// Sends `n` requests with an `x-api-key` header of `key` through `service`; returns how many
/// were answered 200.
async fn through_layer<S, B>(service: &S, key: &'static str, n: usize) -> usize
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    let mut admitted = 0;
    for _ in 0..n {
        admitted += usize::from(passes(service, key).await);
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_named_policies_never_spend_each_others_leases() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    // Both cases need the 20/1m fixed window to stay within one window.
    within_one_minute(Duration::from_secs(20)).await;

    // Case A: two policies parsed from text, so both named "default", of different algorithms.
    let wide = RateLimitLayer::builder()
        .policy("1000/1m")
        .algorithm(Algorithm::Gcra)
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let narrow = RateLimitLayer::builder()
        .policy("20/1m")
        .algorithm(Algorithm::FixedWindow)
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let (wide, narrow) = (served(wide), served(narrow));
    let first = through_layer(&wide, "key-a", 300).await;
    let second = through_layer(&narrow, "key-a", 60).await;
    eprintln!(
        "case A (\"default\", GCRA 1000/1m then fixed 20/1m): {first} of 300, then {second} of 60"
    );
    let case_a = (first, second);

    // Case B: both named "api", same algorithm and window, different counts: one state (a
    // named policy's counts may change, `Policy::identity`), but leases apart.
    let api = |limit: &str| {
        Policy::new("api", [limit.parse().unwrap()])
            .unwrap()
            .with_algorithm(Algorithm::FixedWindow)
    };
    let wide = RateLimitLayer::builder()
        .policy(api("1000/1m"))
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let narrow = RateLimitLayer::builder()
        .policy(api("20/1m"))
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let (wide, narrow) = (served(wide), served(narrow));
    let first = through_layer(&wide, "key-b", 300).await;
    let second = through_layer(&narrow, "key-b", 60).await;
    let case_b = (first, second);
    eprintln!(
        "case B (\"api\", fixed 1000/1m then fixed 20/1m): {first} of 300, then {second} of 60"
    );
    // Both cases are measured before either is judged, so that a failure shows both.
    let (first, second) = case_a;
    assert_eq!(first, 300, "GCRA 1000/1m admits 300 of 300");
    assert_eq!(
        second, 20,
        "the fixed-window 20/1m policy admitted {second} of 60 after 300 requests under the \
         GCRA 1000/1m policy of the same name on the same key (leases of one were spent by the \
         other)"
    );
    let (first, second) = case_b;
    assert_eq!(first, 300, "1000/1m admits 300 of 300");
    assert_eq!(
        second, 0,
        "the 20/1m policy named \"api\" admitted {second} of 60 after the 300 requests that \
         the 1000/1m policy of the same name recorded in their shared state (leases of one \
         were spent by the other)"
    );
}

/// Sends `n` requests through `store`, one every `every`; returns those admitted.
async fn paced(store: &RedisStore, key: &Key, policy: &Policy, n: usize, every: Duration) -> u64 {
    let mut admitted = 0;
    let mut tick = tokio::time::interval(every);
    for _ in 0..n {
        tick.tick().await;
        admitted += u64::from(admit(store, key, policy, 1).await);
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_does_not_let_old_give_backs_free_new_units() {
    a_reset_does_not_let_old_give_backs_free(fixed("100/1m")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_does_not_let_old_give_backs_free_new_units_on_the_log() {
    a_reset_does_not_let_old_give_backs_free(log("100/1m")).await;
}

/// The units `key` holds in Redis under `policy`: a fixed window's count, or the log's.
async fn units_held(client: &Client, store: &RedisStore, key: &Key, policy: &Policy) -> i64 {
    match policy.algorithm() {
        Algorithm::SlidingLog => logged(client, store, key, policy, None).await as i64,
        _ => counted(client, store, key, policy).await,
    }
}

async fn a_reset_does_not_let_old_give_backs_free(policy: Policy) {
    let server = RedisServer::start();
    let client = server.client().await;
    let (a, b) = (leasing(server.url()).await, leasing(server.url()).await);
    let key = Key::from("reset");
    within_one_minute(Duration::from_secs(20)).await;
    // A serves the key until it holds a lease.
    let warm = paced(&a, &key, &policy, 30, Duration::from_millis(5)).await;
    let leased = a.check_now(&key, &policy, 1);
    assert!(
        matches!(leased, Some(Ok(ref d)) if d.is_allowed()),
        "A holds a lease after {warm} admitted: {leased:?}"
    );
    let held = units_held(&client, &a, &key, &policy).await - warm as i64 - 1;
    a.reset(&key, &policy).await.unwrap();
    // Only B serves now, 200 requests over 2 s: A's sweeper gives its idle key's units back
    // (after a quarter period, 250 ms) in between.
    let after = paced(&b, &key, &policy, 200, Duration::from_millis(10)).await;
    eprintln!(
        "A: {warm} + 1 admitted, {held} units held at the reset; after the reset B admitted \
         {after} of 200 under 100/1m"
    );
    assert!(
        after <= 100,
        "B admitted {after} under 100/1m after the reset (A held {held} units when it reset)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_does_not_let_old_give_backs_free_new_units() {
    a_restart_does_not_let_old_give_backs_free(fixed("100/1m")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_does_not_let_old_give_backs_free_new_units_on_the_log() {
    a_restart_does_not_let_old_give_backs_free(log("100/1m")).await;
}

async fn a_restart_does_not_let_old_give_backs_free(policy: Policy) {
    let mut server = RedisServer::start();
    // A 2 s period: an idle key gives its units back after 500 ms, well after the restart
    // is over (which leaves old give-backs to land on the new state, the case at hand).
    let leases = Leases::new().period(Duration::from_secs(2));
    let timeout = Duration::from_millis(200);
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..3).map(|_| leasing_with(server.url(), leases, timeout)))
            .await;
    let key = Key::from("restart");
    within_one_minute(Duration::from_secs(20)).await;
    // The first two serve the key until each holds a lease.
    let warm = futures::future::join_all(
        stores[..2]
            .iter()
            .map(|s| paced(s, &key, &policy, 30, Duration::from_millis(5))),
    )
    .await;
    let client = server.client().await;
    let held =
        units_held(&client, &stores[0], &key, &policy).await - warm.iter().sum::<u64>() as i64;
    drop(client);
    let asked = tokio::time::Instant::now();
    let mut server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    // Until every connection of every store answers again (without a decision, which would
    // trip a store's breaker).
    for store in &stores {
        for connection in store.pool().clients() {
            loop {
                let ping = connection.ping::<String>(None);
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(100), ping).await {
                    break;
                }
                assert!(asked.elapsed() < Duration::from_secs(10), "no reconnection");
            }
        }
    }
    let back = asked.elapsed();
    // Only the third serves: 200 requests over 2 s.
    let after = paced(&stores[2], &key, &policy, 200, Duration::from_millis(10)).await;
    eprintln!(
        "warm: {warm:?} admitted, {held} units held; restarted and reconnected in {back:?}; \
         then the third store admitted {after} of 200 under 100/1m"
    );
    assert!(
        after <= 100,
        "the third store admitted {after} under 100/1m after the restart ({held} units were \
         held in leases when Redis restarted)"
    );
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_a_fetch_in_flight() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let client = server.client().await;
    // A budget well over the stall, so that the fetch is answered rather than timed out.
    let store = leasing_with(server.url(), Leases::new(), Duration::from_secs(1)).await;
    let (key, policy) = (Key::from("drain-in-flight"), fixed("1000/1m"));
    within_one_minute(Duration::from_secs(20)).await;
    let mut admitted = paced(&store, &key, &policy, 100, Duration::from_millis(5)).await;
    let held = counted(&client, &store, &key, &policy).await - admitted as i64;
    assert!(held > 0, "the busy key holds a lease");
    // Redis sleeps for 150 ms; meanwhile the lease is spent, which fetches the next one, and a
    // request that the lease cannot answer goes to Redis.
    let sleeper = server.client().await;
    let stalled = tokio::spawn(async move { stall(&sleeper, 0.15).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut from_lease = 0;
    while let Some(outcome) = store.check_now(&key, &policy, 1) {
        from_lease += 1;
        admitted += u64::from(outcome.unwrap().is_allowed());
        assert!(from_lease <= 1000, "the lease never ran out");
    }
    let asking = {
        let (store, key, policy) = (store.clone(), key.clone(), policy.clone());
        tokio::spawn(async move { store.check(&key, &policy, 1).await })
    };
    tokio::task::yield_now().await;
    let drained = store.drain().await;
    let asked = asking.await.unwrap();
    stalled.await.unwrap();
    admitted += u64::from(matches!(asked, Ok(ref d) if d.is_allowed()));
    // Whatever fetch the spending started in the background has landed by now (Redis answers
    // at once after the stall); the sweeper would give an idle key's units back only 250 ms
    // after its last request, well after this.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let count = counted(&client, &store, &key, &policy).await;
    let after = store.check_now(&key, &policy, 1);
    eprintln!(
        "{held} units held before the stall, {from_lease} spent from leases during it; drain \
         answered {drained:?}; the request sent during the stall: {asked:?}; {admitted} \
         admitted, {count} counted in Redis; check_now after the drain: {after:?}"
    );
    assert_eq!(
        count,
        admitted as i64,
        "after drain() and every request answered, Redis counts {count} units for {admitted} \
         admitted ({} units leased and never given back; drain answered {drained:?})",
        count - admitted as i64
    );
    assert!(
        after.is_none(),
        "after drain(), check_now still decides from a lease: {after:?}"
    );
    // The lease ran out before the drain, so every unit it gives back is the fetch's: drain()
    // waited for it rather than leave it to land on its own.
    assert!(
        matches!(drained, Ok(units) if units > 0),
        "drain() answered {drained:?} while a lease was on its way"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_stranded_by_stalls_come_back() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let client = server.client().await;
    let stores: Vec<RedisStore> = futures::future::join_all(
        (0..4).map(|_| leasing_with(server.url(), Leases::new(), Duration::from_millis(200))),
    )
    .await;
    let (key, policy) = (Key::from("stalls"), fixed("6000/1m"));
    // About 12 s from the first request to the count: all of it within one fixed window.
    within_one_minute(Duration::from_secs(20)).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for store in &stores {
        let (store, key, policy, stop) = (store.clone(), key.clone(), policy.clone(), stop.clone());
        // 100 requests per second per instance.
        load.push(tokio::spawn(async move {
            let (mut sent, mut admitted) = (0u64, 0u64);
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                sent += 1;
                admitted += u64::from(admit(&store, &key, &policy, 1).await);
            }
            (sent, admitted)
        }));
    }
    // Four stalls of 1.2 s, a second apart.
    let sleeper = server.client().await;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        stall(&sleeper, 1.2).await;
    }
    let last_stall_ended = tokio::time::Instant::now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut per_store = Vec::new();
    for task in load {
        per_store.push(task.await.unwrap());
    }
    // One lease period and a margin after the last stall and the last request: every lease
    // has expired or gone idle, and its unspent units are back.
    tokio::time::sleep_until(
        last_stall_ended + Leases::DEFAULT_PERIOD + Duration::from_millis(700),
    )
    .await;
    let admitted: u64 = per_store.iter().map(|&(_, a)| a).sum();
    let count = counted(&client, &stores[0], &key, &policy).await;
    let stranded = count - admitted as i64;
    eprintln!(
        "(sent, admitted) per instance: {per_store:?}; {admitted} admitted, {count} counted in \
         Redis: {stranded} units counted and never admitted"
    );
    // Never the other way: a give-back applied twice (one whose reply was lost, sent again)
    // would leave Redis counting less than the fleet admitted.
    assert!(
        stranded >= 0,
        "Redis counts {count} units for {admitted} admitted: {} admitted units are not counted",
        -stranded
    );
    assert!(
        stranded <= 60,
        "{stranded} units counted in Redis and never admitted ({count} counted, {admitted} \
         admitted) 1.7 s after four 1.2 s stalls; at most 60 (1 % of 6000/1m) may stay"
    );
}

fn gcra(limit: &str) -> Policy {
    named("gcra", limit, Algorithm::Gcra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impossible_lease_settings_fail_to_build() {
    let server = RedisServer::start();
    // GCRA's headroom would be the whole window: a burst of 10 * (1 - 1 s / 1 s) = 0.
    let leases = Leases::new().max_share(1.0);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let policy = gcra("10/1s");
    let supported = store.supports(&policy);
    let built = RateLimitLayer::builder()
        .policy(policy.clone())
        .key(api_key())
        .store(store.clone())
        .build();
    let mut what_it_admits = String::new();
    if built.is_ok() || supported.is_ok() {
        let key = Key::from("impossible");
        let mut admitted = 0;
        for _ in 0..20 {
            admitted += u32::from(admit(&store, &key, &policy, 1).await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        what_it_admits = format!("; the store admits {admitted} of 20 requests over 200 ms");
    }
    eprintln!(
        "supports: {supported:?}; build: {:?}{what_it_admits}",
        built.as_ref().map(|_| "Ok")
    );
    match &built {
        Err(BuildError::Unsupported { policy, why }) => {
            assert_eq!(policy, "gcra");
            assert!(
                why.contains("max_share"),
                "the error names the setting: {why}"
            );
        }
        Err(other) => panic!("expected BuildError::Unsupported, got {other:?}"),
        Ok(_) => {
            panic!("a layer with GCRA 10/1s over leases of max_share 1.0 built{what_it_admits}")
        }
    }
    assert!(
        supported.is_err(),
        "supports(GCRA 10/1s) with max_share 1.0: {supported:?}{what_it_admits}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_over_the_leasing_burst_says_it_never_passes() {
    let server = RedisServer::start();
    // The headroom is 0.5 s of 1 s: the burst is 50.
    let leases = Leases::new().max_share(0.5);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let (key, policy) = (Key::from("heavy"), gcra("100/1s"));
    let decision = store.check(&key, &policy, 60).await.unwrap();
    eprintln!("a request of cost 60 on a fresh key: {decision:?}");
    assert!(
        !decision.is_allowed(),
        "a cost of 60 admitted where the burst is 50: {decision:?}"
    );
    assert_eq!(
        decision.retry_after(),
        None,
        "a cost of 60 can never pass under a burst of 50, yet retry_after says when: \
         {decision:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_and_remaining_agree_with_check_under_the_headroom() {
    let server = RedisServer::start();
    // The headroom is 0.25 s of 1 s: the burst is 75.
    let leases = Leases::new().max_share(0.25);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let (key, policy) = (Key::from("agree"), gcra("100/1s"));
    // A burst as the layer sends it, as fast as it goes: 200 requests (a unit drips back every
    // 10 ms). After each of the first refusals, a peek.
    let mut decisions = Vec::new();
    let mut peeks = Vec::new();
    let started = tokio::time::Instant::now();
    for _ in 0..200 {
        let sent = tokio::time::Instant::now();
        let decision = match store.check_now(&key, &policy, 1) {
            Some(outcome) => outcome.unwrap(),
            None => store.check(&key, &policy, 1).await.unwrap(),
        };
        if !decision.is_allowed() && peeks.len() < 5 {
            let peeked = store.peek(&key, &policy, 1).await.unwrap();
            // Redis ran the refusal after `sent` and the peek before now: if less than the
            // refusal's retry-after lies between, nothing has dripped back that could admit.
            let between = sent.elapsed();
            peeks.push((decisions.len(), decision.retry_after(), between, peeked));
        }
        decisions.push((decision.is_allowed(), decision.remaining()));
    }
    let took = started.elapsed();
    let admitted = decisions.iter().filter(|d| d.0).count();
    let first_refusal = decisions.iter().position(|d| !d.0);
    eprintln!(
        "{admitted} of 200 admitted in {took:?}, the first refusal at request {first_refusal:?}; \
         (allowed, remaining) per request: {decisions:?}"
    );
    for (at, retry_after, between, peeked) in &peeks {
        eprintln!(
            "refusal at request {}: retry_after {retry_after:?}; a peek {between:?} after it was \
             sent: allowed {} remaining {}",
            at + 1,
            peeked.is_allowed(),
            peeked.remaining()
        );
    }
    assert!(
        first_refusal.is_some(),
        "200 requests against a burst of 75"
    );
    for (i, &(allowed, remaining)) in decisions.iter().enumerate() {
        assert!(
            allowed || remaining == 0,
            "request {} was refused while reporting remaining {remaining}",
            i + 1
        );
    }
    let mut judged = 0;
    for (at, retry_after, between, peeked) in &peeks {
        if retry_after.is_some_and(|r| *between < r) {
            judged += 1;
            assert!(
                !peeked.is_allowed(),
                "request {} was refused (retry after {retry_after:?}), but a peek {between:?} \
                 later says allowed with remaining {}",
                at + 1,
                peeked.remaining()
            );
        }
    }
    assert!(
        judged > 0,
        "no peek came within a refusal's retry-after: {peeks:?}"
    );
    // A remaining of r promises r more admissions at that instant; the later requests of the
    // burst (within a few ms, which only drips more in) were admitted at least that often.
    for (i, &(allowed, remaining)) in decisions.iter().enumerate() {
        let later = decisions[i + 1..].iter().filter(|d| d.0).count() as u64;
        assert!(
            !allowed || remaining <= later,
            "request {} was admitted reporting remaining {remaining}, but only {later} of the \
             {} requests after it were admitted",
            i + 1,
            decisions.len() - i - 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_four_keeps_gcra_within_its_bucket() {
    let server = RedisServer::start();
    let policy = gcra("200/2s");
    let (count, window) = (200.0, 2_000_000.0);
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..4).map(|_| leasing(server.url()))).await;
    // Two clients, each sending three times its rate (300 per second), for 6 s.
    let admitted = three_times_the_limit(&stores, &policy, Duration::from_secs(6)).await;
    for (client, times) in admitted.iter().enumerate() {
        // The bucket admits at most c * (t - s + w) / w units in any span [s, t]: a full
        // bucket, then the rate. The times are where units were spent (`spent_at`); 2 units of
        // margin for the lease's units, timed when the call began.
        let mut worst = (f64::NEG_INFINITY, 0, 0);
        for (i, &s) in times.iter().enumerate() {
            for (j, &t) in times.iter().enumerate().skip(i) {
                let units = (j - i + 1) as f64;
                let bound = count * ((t - s) as f64 + window) / window;
                if units - bound > worst.0 {
                    worst = (units - bound, i, j);
                }
            }
        }
        let (excess, i, j) = worst;
        eprintln!(
            "client {client}: {} admitted in 6 s (at most about {} by the rate and a bucket); \
             the closest to the bound: {excess:.1} units over it (under, if negative) in the {} \
             admissions over {} µs",
            times.len(),
            200 + 600,
            j - i + 1,
            times[j] - times[i]
        );
        assert!(
            excess <= 2.0,
            "client {client}: {} admissions within {} µs, {excess:.1} units over \
             c * (t - s + w) / w",
            j - i + 1,
            times[j] - times[i]
        );
    }
}

/// A request of the usage-based layer: a reservation of 1 decided as the layer decides it
/// (`check_now`, else `check`); if admitted, its `usage` beyond the reservation charged with
/// `Store::settle`, as the layer does when the body ends, awaited here so that its reply is
/// read before the next request. Whether it was admitted.
async fn used(store: &RedisStore, key: &Key, policy: &Policy, usage: u64) -> bool {
    let decision = match store.check_now(key, policy, 1) {
        Some(outcome) => outcome,
        None => store.check(key, policy, 1).await,
    };
    let Ok(decision) = decision else {
        return false;
    };
    if !decision.is_allowed() {
        return false;
    }
    if let Some(charge) = Settlement::charge(&decision, usage.saturating_sub(1)) {
        store.settle(key, policy, charge).await.expect("settled");
    }
    true
}

/// Warms `key` on `store` until a lease answers for it, then admits one request from the lease
/// and charges it `usage` in all; returns how many requests the warming admitted.
async fn warm_then_charge(store: &RedisStore, key: &Key, policy: &Policy, usage: u64) -> u64 {
    let warmed = paced(store, key, policy, 100, Duration::from_millis(5)).await;
    let decision = store
        .check_now(key, policy, 1)
        .expect("the busy key holds a lease")
        .expect("the lease answers");
    assert!(decision.is_allowed());
    let charge = Settlement::charge(&decision, usage - 1).unwrap();
    store.settle(key, policy, charge).await.expect("settled");
    warmed + 1
}

/// The case: `1000/1m`, a warm key holding a lease, one request charged 100 000 (the
/// key's remaining drops to 0), then requests of usage 500. Without leases none of them is
/// admitted; the leases must not admit any either, once the charge's reply is read.
async fn a_charge_that_fills_the_key_ends_the_lease(algorithm: Algorithm) {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let policy = named("filled", "1000/1m", algorithm);
    let key = Key::from(format!("filled-{algorithm:?}"));
    // About 1 s from the first request to the last: all of it within one fixed window.
    within_one_minute(Duration::from_secs(10)).await;
    let warmed = warm_then_charge(&store, &key, &policy, 100_000).await;
    let mut admitted = 0;
    for _ in 0..200 {
        admitted += u64::from(used(&store, &key, &policy, 500).await);
    }
    eprintln!(
        "{algorithm:?}: {warmed} admitted warming, the last charged 100 000; then {admitted} \
         of 200 requests of usage 500 admitted ({} units over)",
        admitted * 500
    );
    assert_eq!(
        admitted,
        0,
        "{algorithm:?}: {admitted} requests of usage 500 admitted after a charge filled the key \
         ({} units past the limit)",
        admitted * 500
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_gcra_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::Gcra).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_fixed_window_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::FixedWindow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_sliding_window_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::SlidingWindow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_sliding_log_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::SlidingLog).await;
}

/// Two instances hold leases of one key; a charge on the first fills it. The first admits
/// nothing more. The second did not see the charge: it admits from its lease until the reply
/// to its own first charge after the fill comes back, so with four clients each waiting for
/// its request's settlement before the next, at most four requests (one per client). Without
/// the settlement's reply ending its lease, it would spend the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_stops_at_its_own_first_charge_after_the_fill() {
    let server = RedisServer::start();
    let (first, second) = (leasing(server.url()).await, leasing(server.url()).await);
    let policy = gcra("1000/1m");
    let key = Key::from("filled-by-another");
    // Both instances busy (an idle key's lease is given back after a quarter period).
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for _ in 0..100 {
        tick.tick().await;
        admit(&first, &key, &policy, 1).await;
        admit(&second, &key, &policy, 1).await;
    }
    let decision = first
        .check_now(&key, &policy, 1)
        .expect("the first holds a lease");
    assert!(
        second.check_now(&key, &policy, 1).is_some(),
        "the second instance holds a lease"
    );
    let charge = Settlement::charge(&decision.unwrap(), 99_999).unwrap();
    first.settle(&key, &policy, charge).await.expect("settled");
    const CLIENTS: u64 = 4;
    let clients = (0..CLIENTS).map(|_| {
        let (store, key, policy) = (second.clone(), key.clone(), policy.clone());
        tokio::spawn(async move {
            let mut admitted = 0u64;
            for _ in 0..50 {
                admitted += u64::from(used(&store, &key, &policy, 500).await);
            }
            admitted
        })
    });
    let per_client: Vec<u64> = futures::future::join_all(clients)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let admitted_second: u64 = per_client.iter().sum();
    let mut admitted_first = 0;
    for _ in 0..50 {
        admitted_first += u64::from(used(&first, &key, &policy, 500).await);
    }
    eprintln!(
        "after the first instance's charge filled the key: {admitted_first} of 50 admitted by \
         it, {admitted_second} of 200 by the second instance ({per_client:?} per client)"
    );
    assert_eq!(admitted_first, 0, "the instance that saw the fill admitted");
    assert!(
        admitted_second <= CLIENTS,
        "the second instance admitted {admitted_second} requests of usage 500 after the fill; \
         at most {CLIENTS}, one per client waiting for its settlement"
    );
}

/// The charge lands while a lease fetch is on its way: Redis is stalled, each key's lease is
/// spent, which sends its next fetch, and the charge is sent behind it. Whichever reply is read
/// first, no unit granted before the charge is spent after its reply: a fetch that ran before
/// the charge and lands after its reply lands into a key already marked full, and one that ran
/// after it found no room. Thirty keys, to meet both orders of the replies. (The order that
/// needs `Entry::granted` to check the fill is met in some runs only; `book.rs` pins it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_landing_during_a_lease_fetch_ends_that_lease_too() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    // A budget well over the stall, so that nothing times out.
    let store = leasing_with(server.url(), Leases::new(), Duration::from_secs(1)).await;
    let policy = gcra("1000/1m");
    let keys: Vec<Key> = (0..30)
        .map(|i| Key::from(format!("fetch-in-flight-{i}")))
        .collect();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for _ in 0..100 {
        tick.tick().await;
        for key in &keys {
            admit(&store, key, &policy, 1).await;
        }
    }
    let sleeper = server.client().await;
    let stalled = tokio::spawn(async move { stall(&sleeper, 0.1).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut charges = Vec::new();
    for key in &keys {
        let last = store
            .check_now(key, &policy, 1)
            .expect("the busy key holds a lease")
            .unwrap();
        // Spending the lease sends the next fetch, which waits behind the stall.
        while store.check_now(key, &policy, 1).is_some() {}
        charges.push(Settlement::charge(&last, 99_999).unwrap());
    }
    // The fetches go first; the charges queue behind them.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let settled = keys.iter().zip(charges).map(|(key, charge)| {
        let (store, key, policy) = (store.clone(), key.clone(), policy.clone());
        async move { store.settle(&key, &policy, charge).await }
    });
    for result in futures::future::join_all(settled).await {
        result.expect("settled");
    }
    stalled.await.unwrap();
    let mut after = Vec::new();
    for key in &keys {
        let mut admitted = 0;
        for _ in 0..20 {
            admitted += u64::from(used(&store, key, &policy, 500).await);
        }
        after.push(admitted);
    }
    eprintln!("admitted after the charge's reply, per key: {after:?}");
    assert!(
        after.iter().all(|&n| n == 0),
        "requests admitted from leases after a charge filled the key, per key: {after:?}"
    );
}

fn log(limit: &str) -> Policy {
    named("log", limit, Algorithm::SlidingLog)
}

/// The units the sliding log of `key` holds in Redis in events of time `at` (all events for
/// `None`): the sum of their weights (members "<time>:<total>:<weight>").
async fn logged(
    client: &Client,
    store: &RedisStore,
    key: &Key,
    policy: &Policy,
    at: Option<i64>,
) -> u64 {
    let members: Vec<String> = client
        .zrange(
            store.redis_key(key, policy),
            0,
            -1,
            None,
            false,
            None,
            false,
        )
        .await
        .unwrap();
    let field = |m: &String, i: usize| m.split(':').nth(i).unwrap().parse::<i64>().unwrap();
    let at_time = |m: &&String| at.is_none_or(|t| field(m, 0) == t);
    members
        .iter()
        .filter(at_time)
        .map(|m| field(m, 2) as u64)
        .sum()
}

/// A request of 1 decided as the layer decides it; when admitted, when its unit was spent:
/// the local time for a unit of a lease (logged earlier, at the lease's grant), the Redis
/// time Redis logged it at for one that Redis decided (one host, one clock).
async fn spent_at(store: &RedisStore, key: &Key, policy: &Policy) -> Option<u64> {
    let before = micros_now();
    let decision = match store.check_now(key, policy, 1) {
        Some(outcome) => outcome,
        None => store.check(key, policy, 1).await,
    };
    let decision = decision.ok().filter(|d| d.is_allowed())?;
    let Some(Settlement::Charge(units)) = Settlement::charge(&decision, 1) else {
        return None;
    };
    let logged = u64::try_from(units.admitted_at()?).ok()?;
    // Logged before this call began: a lease's unit, spent now.
    Some(if logged < before { before } else { logged })
}

/// Two clients, each sending 75 requests per second to each of `stores` for `run` (with four
/// stores, 300 per second each); returns, per client, when each admitted unit was spent
/// ([`spent_at`]), in order.
async fn three_times_the_limit(
    stores: &[RedisStore],
    policy: &Policy,
    run: Duration,
) -> [Vec<u64>; 2] {
    let end = micros_now() + run.as_micros() as u64;
    let admitted = Arc::new(std::sync::Mutex::new([Vec::new(), Vec::new()]));
    let mut tasks = Vec::new();
    for store in stores {
        for client in 0..2usize {
            let (store, policy, admitted) = (store.clone(), policy.clone(), admitted.clone());
            tasks.push(tokio::spawn(async move {
                let key = Key::from(format!("client-{client}"));
                let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / 75));
                while micros_now() < end {
                    tick.tick().await;
                    if let Some(at) = spent_at(&store, &key, &policy).await {
                        admitted.lock().unwrap()[client].push(at);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut admitted = admitted.lock().unwrap().clone();
    admitted.iter_mut().for_each(|times| times.sort_unstable());
    admitted
}

/// The fleet: four leasing instances, a sliding log of `1000/10s` with a 150 ms lease
/// period (as 1 s is to a minute), two clients each at three times the limit for 22 s. Every
/// admission is timed where its unit was spent; no window of 10 s ending at any admission
/// holds more than 1000, and in steady state (once the first window plus the headroom has
/// passed) every window holds at least 900.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_four_keeps_the_sliding_log_within_every_window() {
    let server = RedisServer::start();
    let policy = log("1000/10s");
    const WINDOW: u64 = 10_000_000;
    let leases = Leases::new().period(Duration::from_millis(150));
    let timeout = Duration::from_millis(200);
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..4).map(|_| leasing_with(server.url(), leases, timeout)))
            .await;
    let start = micros_now();
    let end = start + 22_000_000;
    let admitted = three_times_the_limit(&stores, &policy, Duration::from_secs(22)).await;
    let calls = evalsha_calls(&server.client().await).await;
    for (client, times) in admitted.iter().enumerate() {
        // The fullest window ends at an admission: (t - w, t] for each admission t.
        let (mut fullest, mut at) = (0, 0);
        for (i, &t) in times.iter().enumerate() {
            let held = i + 1 - times.partition_point(|&s| s + WINDOW <= t);
            if held > fullest {
                (fullest, at) = (held, t - start);
            }
        }
        // Steady state: windows ending every 10 ms from 10.65 s on.
        let in_window = |t: u64| {
            times.partition_point(|&s| s <= t) - times.partition_point(|&s| s + WINDOW <= t)
        };
        let ends = (start + WINDOW + 650_000..end - 50_000).step_by(10_000);
        let (emptiest, when) = ends.map(|t| (in_window(t), t - start)).min().unwrap();
        eprintln!(
            "client {client}: {} admitted in 22 s; the fullest window of 10 s holds {fullest} \
             (ending {at} us in), the emptiest in steady state {emptiest} (ending {when} us in); \
             {calls} EVALSHA in all (refusals included)",
            times.len()
        );
        assert!(
            fullest <= 1000,
            "client {client}: {fullest} admitted in the 10 s ending {at} us in"
        );
        assert!(
            emptiest >= 900,
            "client {client}: only {emptiest} admitted in the 10 s ending {when} us in"
        );
    }
}

/// Event times on a leasing store read the same longer window as its decisions: an event of
/// the whole limit at `t0` refuses one at `t0 + w + h / 2`, which a window of `w` alone would
/// admit, with the wait to `t0 + w + h`; at `t0 + w + h` it is admitted.
#[tokio::test]
async fn a_leasing_store_reads_event_times_in_the_longer_window() {
    let server = RedisServer::start();
    // A share of 0.5 (5 units of 10, leased), h = min(period, 0.5 * 2 s) = 200 ms.
    let leases = Leases::new()
        .period(Duration::from_millis(200))
        .max_share(0.5);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let (key, policy) = (Key::from("events"), log("10/2s"));
    let h = Duration::from_millis(200);
    let t0 = SystemTime::now();
    let first = store.check_at(&key, &policy, 10, t0).await.unwrap();
    assert!(first.is_allowed(), "{first:?}");
    let w = Duration::from_secs(2);
    let inside = store
        .check_at(&key, &policy, 1, t0 + w + h / 2)
        .await
        .unwrap();
    assert!(
        !inside.is_allowed(),
        "admitted within w + h of t0: {inside:?}"
    );
    assert_eq!(inside.retry_after(), Some(h / 2), "{inside:?}");
    let after = store.check_at(&key, &policy, 1, t0 + w + h).await.unwrap();
    assert!(after.is_allowed(), "{after:?}");
}

/// A refund of a request admitted from a lease (the layer's outcome counting, a usage
/// reservation not used) takes its unit off the lease's event: the log holds one unit less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_of_a_leased_request_frees_its_unit_on_the_log() {
    let server = RedisServer::start();
    let client = server.client().await;
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("refund"), log("1000/1m"));
    paced(&store, &key, &policy, 100, Duration::from_millis(5)).await;
    let decision = store
        .check_now(&key, &policy, 1)
        .expect("the busy key holds a lease")
        .unwrap();
    assert!(decision.is_allowed());
    let refund = Settlement::refund(&decision, 1).unwrap();
    let Settlement::Refund(units) = &refund else {
        unreachable!()
    };
    // The lease's event: the time the decision says it was recorded at.
    let at = units.admitted_at();
    assert!(at.is_some(), "{decision:?}");
    let before = logged(&client, &store, &key, &policy, at).await;
    store.settle(&key, &policy, refund).await.unwrap();
    let after = logged(&client, &store, &key, &policy, at).await;
    assert_eq!(
        after + 1,
        before,
        "the lease's event weighed {before} units, {after} after the refund"
    );
}

/// A policy that is never leased (here a count whose share is under two units) shares the log
/// of a leased policy of its name and windows: it reads the same longer window, so that the
/// leased policy's units, spent up to `h` after they were logged, count in every window it
/// decides. `api` `1000/1s` is busy for 300 ms from leases (`h` = 100 ms), then `api`
/// `10/1s` asks every 2 ms from 0.9 s after the last unit spent: no window of 1 s ending at
/// one of its admissions holds more than its 10 (18 to 25 when it read windows of 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_not_leased_reads_the_longer_window_of_a_leased_one_of_its_name() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let big = named("api", "1000/1s", Algorithm::SlidingLog);
    let small = named("api", "10/1s", Algorithm::SlidingLog);
    let key = Key::from("shared");
    let mut spent = Vec::new();
    let stop = micros_now() + 300_000;
    while micros_now() < stop {
        spent.extend(spent_at(&store, &key, &big).await);
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let last = *spent.iter().max().expect("the big policy admitted");
    let from = last + 900_000;
    tokio::time::sleep(Duration::from_micros(from.saturating_sub(micros_now()))).await;
    let mut small_spent = Vec::new();
    while micros_now() < from + 400_000 {
        small_spent.extend(spent_at(&store, &key, &small).await);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    spent.extend(&small_spent);
    let in_window = |t: u64| {
        spent
            .iter()
            .filter(|&&s| s <= t && s + 1_000_000 > t)
            .count()
    };
    let fullest = small_spent.iter().map(|&t| in_window(t)).max().unwrap_or(0);
    eprintln!(
        "the small policy admitted {}; the fullest second ending at one of them holds {fullest}",
        small_spent.len()
    );
    assert!(
        fullest <= 10,
        "{fullest} units in a second of a 10/1s policy"
    );
}

/// A settlement's reply reads the log's longer window too, so that a charge that fills the key
/// in the window decisions read ends the lease, even while the shorter window still has room.
/// An event of 500 units logged 10.3 s ago (in `(now − w − h, now]` for `1000/10s` and `h` =
/// 1 s, not in `(now − w, now]`), a key warmed until it holds a lease, then a charge of what
/// a peek says is left: the lease is spent no more (with the reply read in windows of `w`,
/// 500 units still looked free and the lease went on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_the_longer_window_ends_the_lease() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("longer"), log("1000/10s"));
    let old = SystemTime::now() - Duration::from_millis(10_300);
    assert!(store
        .check_at(&key, &policy, 500, old)
        .await
        .unwrap()
        .is_allowed());
    paced(&store, &key, &policy, 30, Duration::from_millis(5)).await;
    let decision = store
        .check_now(&key, &policy, 1)
        .expect("the busy key holds a lease")
        .unwrap();
    let left = store.peek(&key, &policy, 1).await.unwrap().remaining();
    let charge = Settlement::charge(&decision, left + 1).unwrap();
    store.settle(&key, &policy, charge).await.unwrap();
    let after = store.check_now(&key, &policy, 1);
    assert!(
        after.is_none(),
        "charged one unit past the {left} left, and the lease still answers: {after:?}"
    );
}
