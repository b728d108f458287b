//! The Redis store behind Redis Sentinel (`redis-sentinel://` URL): exact decisions, and a
//! primary killed under load: decisions fail within the budget while no primary is known,
//! then come from the promoted replica without restarting the store, exactly.

mod common;

use std::time::Duration;

use common::outage::{self, Load, RECOVERY};
use common::sentinel::SentinelGroup;
use fred::interfaces::KeysInterface;
use futures::future::join_all;
use tokio::task::block_in_place;
use tokio::time::Instant;
use tower_redis_ratelimit::{Key, Policy, RedisStore, Store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_url_store_decides_exactly() {
    let group = block_in_place(SentinelGroup::start);
    let store = RedisStore::connect(&group.url()).await.unwrap();
    let policy: Policy = "5/10s".parse().unwrap();
    let key = Key::from("sentinel-client");
    let decisions = join_all((0..15).map(|_| store.check(&key, &policy, 1))).await;
    let admitted = decisions
        .into_iter()
        .filter(|d| d.as_ref().unwrap().is_allowed())
        .count();
    assert_eq!(admitted, 5, "5 of 15 admitted at 5/10s");
    // The state is on the primary the sentinels name.
    let stored = group
        .primary
        .client()
        .await
        .exists::<i64, _>(store.redis_key(&key, &policy))
        .await
        .unwrap();
    assert_eq!(stored, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_primary_fails_fast_then_the_promoted_replica_decides_exactly() {
    let mut group = block_in_place(SentinelGroup::start);
    let store = outage::store(group.url()).await;
    let policy: Policy = "1000000/1m".parse().unwrap();
    let keys: Vec<(Key, usize)> = (0..30)
        .map(|i| (Key::from(format!("client-{i}")), 0))
        .collect();
    let pairs: Vec<[Key; 2]> = (0..5)
        .map(|i| [format!("fresh-{i}-a"), format!("fresh-{i}-b")].map(Key::from))
        .collect();

    let load = Load::start(&store, &policy, &keys, 16, Duration::from_millis(5));
    let deadline = Instant::now() + Duration::from_secs(10);
    assert!(
        load.wait_ok_after(0, Duration::ZERO, deadline)
            .await
            .is_some(),
        "no decision before the kill"
    );
    load.wait_for_requests(500).await;

    let kill_at = load.elapsed();
    let killed = Instant::now();
    group.kill_primary();
    block_in_place(|| group.wait_for_promotion());
    let promotion = killed.elapsed();
    let first_ok = load.wait_ok_after(0, kill_at, killed + RECOVERY).await;
    let recovered = killed.elapsed();
    let samples = load.stop_after_failover(first_ok.is_some()).await;

    eprintln!(
        "kill to promotion of port {} named by every sentinel: {promotion:?}",
        group.replica.port()
    );
    let Some(first_ok) = first_ok else {
        outage::report_failover(&samples, kill_at, samples.last().unwrap().at, 0);
        panic!("no decision within {RECOVERY:?} of the kill");
    };
    eprintln!(
        "kill to first successful decision: {:?} (seen after {recovered:?})",
        first_ok - kill_at
    );
    let seen = outage::report_failover(&samples, kill_at, first_ok, 0);
    outage::assert_within_budget(&samples);
    assert!(seen.victim_failed > 0, "decisions never failed");
    // Once back, decisions hold.
    outage::assert_holds_after(&samples, first_ok, 1000);

    // Fresh clients, from the same store: exact limits, on the promoted replica.
    let (exact, failed_bursts) = outage::exact_again(&store, &pairs, killed).await;
    eprintln!(
        "kill to exact limits on the promoted replica (2 clients x 200 concurrent at 50/10s, \
         50 admitted each): {exact:?}, after {failed_bursts} bursts with errors"
    );
    let promoted = group.replica.client().await;
    for key in &pairs[failed_bursts] {
        let redis_key = store.redis_key(key, &outage::exact_policy());
        let stored: i64 = promoted.exists(redis_key).await.unwrap();
        assert_eq!(stored, 1, "the state is on the promoted replica");
    }
}
