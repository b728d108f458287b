//! Concurrent decisions leave for Redis together, and decide exactly as one call each would.

use crate::support::{evalsha_calls, RedisServer};
use futures::future::join_all;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

const KEYS: usize = 100;
const PER_KEY: usize = 5;

/// Sends `PER_KEY` concurrent requests for each of `KEYS` keys at 3 per 10 s; returns the
/// script calls it took. Every key must get exactly 3 admissions, whatever the batching.
async fn crowd(server: &RedisServer, store: &RedisStore, algorithm: Algorithm) -> u64 {
    let admin = server.client().await;
    let policy: Policy = "3/10s".parse::<Policy>().unwrap().with_algorithm(algorithm);
    let keys: Vec<Key> = (0..KEYS)
        .map(|i| Key::from(format!("client-{i}")))
        .collect();
    let before = evalsha_calls(&admin).await;
    let decisions = join_all((0..PER_KEY).flat_map(|_| keys.iter()).map(|key| {
        let policy = &policy;
        async move { (key, store.check(key, policy, 1).await.unwrap()) }
    }))
    .await;
    let calls = evalsha_calls(&admin).await - before;
    for key in &keys {
        let admitted = decisions
            .iter()
            .filter(|(k, d)| *k == key && d.is_allowed())
            .count();
        assert_eq!(admitted, 3, "{algorithm:?}, {key}");
    }
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_share_script_calls() {
    let server = RedisServer::start();
    let store = server.store().await;
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::Gcra,
    ] {
        let calls = crowd(&server, &store, algorithm).await;
        assert!(
            calls < (KEYS * PER_KEY / 4) as u64,
            "{algorithm:?}: {calls} calls for {} requests",
            KEYS * PER_KEY
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_one_take_a_call_each() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .max_batch(1)
        .connect()
        .await
        .unwrap();
    let calls = crowd(&server, &store, Algorithm::Gcra).await;
    assert_eq!(calls, (KEYS * PER_KEY) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_under_way_makes_the_fewest_calls() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .max_in_flight(1)
        .connect()
        .await
        .unwrap();
    let one = crowd(&server, &store, Algorithm::Gcra).await;
    // 500 requests, at most 32 per call.
    assert!((16..100).contains(&one), "{one} calls");
}

#[tokio::test]
async fn settings_that_cannot_work_are_refused_before_connecting() {
    // Nothing listens there: each refusal must come from the settings alone.
    let builder = || RedisStore::builder("redis://127.0.0.1:1");
    for (what, result) in [
        ("pool_size", builder().pool_size(0).connect().await),
        ("max_batch", builder().max_batch(0).connect().await),
        ("max_in_flight", builder().max_in_flight(0).connect().await),
        ("cluster_tags 0", builder().cluster_tags(0).connect().await),
        (
            "cluster_tags",
            builder().cluster_tags(16_385).connect().await,
        ),
    ] {
        assert!(
            matches!(result, Err(tower_redis_ratelimit::StoreError::Config(_))),
            "{what}: {result:?}"
        );
    }
}
