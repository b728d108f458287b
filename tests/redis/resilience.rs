//! When Redis is gone, slow, flushed or restarted: every request is answered within the time
//! budget, as the failure mode says, and the limiter returns to Redis by itself.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::load::{self, assert_within_budget, layer, store, Sample, BUDGET, MARGIN};
use crate::support::scenarios::{layered, request_from};
use crate::support::{evalsha_calls, RedisServer};
use fred::prelude::*;
use tower::ServiceExt;
use tower_redis_ratelimit::test_util::{events, redis_key};
use tower_redis_ratelimit::{
    FailureMode, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Store, StoreError,
};

/// When Redis was down, in time since the load started: from the moment the kill had
/// finished until the restart began, as the chaos task saw them (a busy machine can delay
/// either well past its schedule).
struct Outage {
    from: Duration,
    to: Duration,
}

impl Outage {
    /// Whether a request sent at `at` saw only Redis down: sent 100 ms after the kill finished
    /// (connections notice), and more than its time budget (and 50 ms) before the restart
    /// began. One sent later may still be waiting for its call when Redis is back, and be
    /// decided by it within the budget: two sent 191 ms before the restart were answered 200,
    /// 201 ms after they were sent.
    fn covers(&self, at: Duration) -> bool {
        at > self.from + Duration::from_millis(100)
            && at + BUDGET + Duration::from_millis(50) < self.to
    }
}

/// Kills Redis 1 s into a 5 s load and restarts it on the same port at 2 s.
async fn kill_and_restart(
    mode: FailureMode,
) -> (Vec<Sample>, RedisStore, Arc<Mutex<RedisServer>>, Outage) {
    let server = Arc::new(Mutex::new(RedisServer::start()));
    let url = server.lock().unwrap().url();
    let store = store(url).await;
    let service = layered(&layer(store.clone(), mode));
    let start = std::time::Instant::now();
    let chaos = {
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let s = Arc::clone(&server);
            tokio::task::spawn_blocking(move || s.lock().unwrap().kill())
                .await
                .unwrap();
            let from = start.elapsed();
            tokio::time::sleep(Duration::from_secs(1)).await;
            let to = start.elapsed();
            tokio::task::spawn_blocking(move || server.lock().unwrap().restart())
                .await
                .unwrap();
            Outage { from, to }
        })
    };
    let samples = load::run(service, 8, Duration::from_secs(5), Duration::from_millis(5)).await;
    let outage = chaos.await.unwrap();
    assert_within_budget(&samples);
    (samples, store, server, outage)
}

/// When decisions came from Redis again for good: the first request after the restart (at 2 s)
/// that `decided_by_redis` with none failing after it. It must be within a few seconds.
fn recovered_at(samples: &[Sample], decided_by_redis: impl Fn(&Sample) -> bool) -> Duration {
    let after_restart: Vec<_> = samples
        .iter()
        .filter(|s| s.at > Duration::from_secs(2))
        .collect();
    let last_failure = after_restart.iter().rposition(|s| !decided_by_redis(s));
    let recovered = after_restart
        .get(last_failure.map_or(0, |i| i + 1))
        .expect("Redis decides again after the restart");
    let late = recovered.at - Duration::from_secs(2);
    assert!(
        late < Duration::from_secs(3),
        "back to Redis only {late:?} after the restart"
    );
    let failed = after_restart
        .iter()
        .filter(|s| !decided_by_redis(s))
        .count();
    eprintln!(
        "back to Redis {late:?} after the restart; {failed} of {} requests after the restart \
         were not decided by Redis",
        after_restart.len()
    );
    late
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_open_mode_admits_then_recovers() {
    let (samples, store, _server, down) = kill_and_restart(FailureMode::Open).await;
    assert!(
        samples.iter().all(|s| s.status == 200),
        "Open admits everything"
    );
    let outage: Vec<_> = samples.iter().filter(|s| down.covers(s.at)).collect();
    assert!(
        !outage.is_empty() && outage.iter().all(|s| !s.decided),
        "no decisions while down"
    );
    recovered_at(&samples, |s| s.decided);
    assert!(store.is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_closed_mode_refuses_then_recovers() {
    let (samples, _store, _server, down) = kill_and_restart(FailureMode::Closed).await;
    let outage: Vec<_> = samples.iter().filter(|s| down.covers(s.at)).collect();
    let not_refused: Vec<_> = outage.iter().filter(|s| s.status != 503).collect();
    assert!(
        !outage.is_empty() && not_refused.is_empty(),
        "Redis down from {:?} to {:?}: {} requests sent then, answered otherwise than 503: \
         {not_refused:?}",
        down.from,
        down.to,
        outage.len()
    );
    assert!(samples.iter().all(|s| s.status == 200 || s.status == 503));
    recovered_at(&samples, |s| s.status == 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_fallback_mode_decides_locally_then_returns() {
    let local = MemoryStore::new();
    let (samples, store, server, _) = kill_and_restart(FailureMode::Fallback(local.clone())).await;
    assert!(
        samples.iter().all(|s| s.status == 200 && s.decided),
        "every request decided"
    );
    let policy: Policy = "1000000/1m".parse().unwrap();
    let key = Key::from("192.0.2.1".parse::<std::net::IpAddr>().unwrap());
    assert!(
        events(&local, &key, &policy) > 0,
        "the local store decided during the outage"
    );
    // Decisions come from Redis again: each request now adds one member there.
    assert!(store.is_healthy());
    let url = server.lock().unwrap().url();
    let client = crate::support::client(&url).await;
    let zset = redis_key(&store, &key, &policy);
    let before: u64 = client.zcard(&zset).await.unwrap();
    let service = layered(&layer(store.clone(), FailureMode::Fallback(local)));
    for _ in 0..20 {
        service
            .clone()
            .oneshot(request_from("192.0.2.1"))
            .await
            .unwrap();
    }
    let after: u64 = client.zcard(&zset).await.unwrap();
    assert_eq!(after - before, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_redis_is_answered_within_the_budget() {
    let server = RedisServer::start();
    let store = store(server.url()).await;
    let admin = server.client().await;
    let service = layered(&layer(store.clone(), FailureMode::Open));
    let pause = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _: () = admin
            .custom(fred::cmd!("CLIENT"), vec!["PAUSE", "1500", "ALL"])
            .await
            .unwrap();
    });
    let samples = load::run(service, 8, Duration::from_secs(3), Duration::from_millis(5)).await;
    pause.await.unwrap();
    assert_within_budget(&samples);
    assert!(samples.iter().all(|s| s.status == 200));
    let paused = samples
        .iter()
        .filter(|s| s.at > Duration::from_millis(700) && s.at < Duration::from_millis(1800));
    assert!(paused.clone().count() > 0 && paused.clone().all(|s| !s.decided));
    let last = samples.last().unwrap();
    assert!(last.decided, "decisions resume after the pause");
}

#[tokio::test]
async fn deny_cache_spares_redis_until_retry_after() {
    let server = RedisServer::start();
    let store = store(server.url()).await;
    let admin = server.client().await;
    let cached = RateLimitLayer::builder()
        .policy("1/2s")
        .store(store.clone())
        .build()
        .unwrap();
    let service = layered(&cached);
    let send = || async {
        service
            .clone()
            .oneshot(request_from("192.0.2.1"))
            .await
            .unwrap()
    };

    assert_eq!(send().await.status(), 200);
    assert_eq!(send().await.status(), 429);
    let asked = evalsha_calls(&admin).await;
    assert_eq!(asked, 2);
    let started = tokio::time::Instant::now();
    let mut last_retry = 0;
    for _ in 0..200 {
        let reply = send().await;
        assert_eq!(reply.status(), 429);
        last_retry = reply.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(last_retry >= 1);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        evalsha_calls(&admin).await,
        asked,
        "hammering cost no Redis command"
    );
    // Once the retry-after has passed, Redis is asked again and admits.
    tokio::time::sleep(Duration::from_millis(2100).saturating_sub(started.elapsed())).await;
    assert_eq!(send().await.status(), 200);
    assert_eq!(evalsha_calls(&admin).await, asked + 1);
    assert!(last_retry <= 2);

    // Without the cache, every refused request is a Redis command.
    let uncached = RateLimitLayer::builder()
        .policy(Policy::new("uncached", ["1/2s".parse().unwrap()]).unwrap())
        .store(store)
        .deny_cache(0)
        .build()
        .unwrap();
    let service = layered(&uncached);
    let before = evalsha_calls(&admin).await;
    for _ in 0..10 {
        service
            .clone()
            .oneshot(request_from("192.0.2.1"))
            .await
            .unwrap();
    }
    assert_eq!(evalsha_calls(&admin).await, before + 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_store_starts_without_redis_and_uses_it_once_it_is_up() {
    let mut server = RedisServer::start();
    server.kill();
    let store = RedisStore::builder(server.url())
        .timeout(BUDGET)
        .retry_interval(Duration::from_millis(200))
        .connect_lazy()
        .expect("no Redis is needed to build a lazy store");
    let policy: Policy = "1/1h".parse().unwrap();
    let key = Key::from("lazy");

    // Nothing listens: decisions fail within the budget, and the layer's failure mode applies.
    let started = tokio::time::Instant::now();
    assert!(store.check(&key, &policy, 1).await.is_err());
    assert!(
        started.elapsed() <= BUDGET + MARGIN,
        "{:?}",
        started.elapsed()
    );
    assert!(!store.is_healthy());
    let open = layer(store.clone(), FailureMode::Open);
    assert_eq!(
        layered(&open)
            .oneshot(request_from("192.0.2.7"))
            .await
            .unwrap()
            .status(),
        200
    );

    // Once Redis is up, the store reaches it by itself (the scripts load on first use): the
    // first request is admitted and the second refused, which only Redis's state can say.
    server.restart();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let first = loop {
        match store.check(&key, &policy, 1).await {
            Ok(decision) => break decision,
            Err(error) => assert!(
                tokio::time::Instant::now() < deadline,
                "Redis not reached within 10 s: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(first.is_allowed());
    assert!(!store.check(&key, &policy, 1).await.unwrap().is_allowed());
    assert!(store.is_healthy());
    let admin = server.client().await;
    let stored: i64 = admin
        .exists(redis_key(&store, &key, &policy))
        .await
        .unwrap();
    assert_eq!(stored, 1, "the admission is recorded in Redis");
}

#[test]
fn lazy_store_needs_a_runtime() {
    let built = RedisStore::builder("redis://127.0.0.1:1").connect_lazy();
    assert!(matches!(built, Err(StoreError::Config(_))));
}
