//! The Redis store against a real three-primary Redis Cluster.

mod common;

use std::time::Duration;

use common::cluster::RedisCluster;
use common::conformance::{self, SCENARIOS};
use common::scenarios::{self, MARGIN};
use fred::prelude::*;
use futures::future::join_all;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_exact_for_keys_on_every_primary() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    let policy: Policy = "5/10s".parse().unwrap();
    let keys: Vec<Key> = (0..60).map(|i| Key::from(format!("client-{i}"))).collect();
    let admitted = join_all(keys.iter().map(|key| {
        let (store, policy) = (store.clone(), policy.clone());
        async move {
            let decisions = join_all((0..15).map(|_| store.check(key, &policy, 1))).await;
            decisions
                .into_iter()
                .filter(|d| d.as_ref().unwrap().is_allowed())
                .count()
        }
    }))
    .await;
    assert!(admitted.iter().all(|&n| n == 5), "{admitted:?}");

    // The keys really are spread over all three primaries.
    for node in &cluster.nodes {
        let keys: u64 = node.client().await.dbsize().await.unwrap();
        assert!(keys > 0, "node {} holds no key", node.port());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_and_the_multi_limit_work_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::Gcra,
    ] {
        conformance::peek_and_reset(&store, algorithm).await;
    }
    let table = join_all(
        SCENARIOS
            .iter()
            .map(|scenario| conformance::run(&store, scenario, Duration::from_millis(60))),
    );
    let multi = scenarios::multi_limit(store.clone(), MARGIN);
    tokio::join!(table, multi);
}

#[tokio::test]
async fn scripts_are_reloaded_on_every_primary() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    for node in &cluster.nodes {
        let _: () = node.client().await.script_flush(false).await.unwrap();
    }
    let policy: Policy = "3/10s".parse().unwrap();
    for i in 0..30 {
        let key = Key::from(format!("after-flush-{i}"));
        assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
    }
}
