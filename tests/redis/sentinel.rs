//! The Redis store behind Redis Sentinel (`redis-sentinel://` URL): exact decisions, and a
//! primary killed under load: decisions fail within the budget while no primary is known,
//! then come from the promoted replica without restarting the store, exactly.

use std::time::Duration;

use crate::support::outage::{self, Load, RECOVERY};
use crate::support::sentinel::SentinelGroup;
use fred::interfaces::KeysInterface;
use futures::future::join_all;
use tokio::task::block_in_place;
use tokio::time::Instant;
use tower_redis_ratelimit::test_util::redis_key;
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
        .exists::<i64, _>(redis_key(&store, &key, &policy))
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
        let redis_key = redis_key(&store, key, &outage::exact_policy());
        let stored: i64 = promoted.exists(redis_key).await.unwrap();
        assert_eq!(stored, 1, "the state is on the promoted replica");
    }
}

/// Split brain: the primary is paused (SIGSTOP) until its replica is promoted, then resumes
/// and still takes itself for the primary until the sentinels demote it. An instance connected
/// before the pause would go on deciding on it while one connected after decides on the new
/// primary: one client, two budgets. With `min-replicas-to-write 1` and
/// `min-replicas-max-lag 2`, the resumed primary refuses writes (`NOREPLICAS`) once it sees
/// that its replica stopped acknowledging, and the store then reconnects through the
/// sentinels at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_primary_with_min_replicas_admits_no_second_budget() {
    let args = [
        "--min-replicas-to-write",
        "1",
        "--min-replicas-max-lag",
        "2",
    ];
    let group = block_in_place(|| SentinelGroup::start_with(&args));
    let policy: Policy = "10/1m".parse().unwrap();
    let before = RedisStore::connect(&group.url()).await.unwrap();
    assert!(before
        .check(&Key::from("warm"), &policy, 1)
        .await
        .unwrap()
        .is_allowed());

    group.primary.signal("-STOP");
    block_in_place(|| group.wait_for_promotion());
    group.primary.signal("-CONT");
    let resumed = Instant::now();
    // How long the resumed primary accepts writes, looked at for 200 ms: with the setting,
    // until it reads that its replica has gone (the promoted replica closed the link).
    let old = group.primary.port();
    let refused_after = block_in_place(|| loop {
        let reply = crate::support::cluster::cli(old, &["set", "probe", "1"]);
        if reply.trim() != "OK" {
            break Some((resumed.elapsed(), reply.trim().to_owned()));
        }
        if resumed.elapsed() > Duration::from_millis(200) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    });
    let after = RedisStore::connect(&group.url()).await.unwrap();

    // One client, ten requests through each instance, in turn.
    let key = Key::from("split");
    let (mut admitted, mut failed) = ([0; 2], [0; 2]);
    for _ in 0..10 {
        for (i, store) in [&before, &after].into_iter().enumerate() {
            match store.check(&key, &policy, 1).await {
                Ok(d) => admitted[i] += usize::from(d.is_allowed()),
                Err(_) => failed[i] += 1,
            }
        }
    }
    // The instance connected before decides again, on the new primary.
    let deadline = Instant::now() + Duration::from_secs(20);
    while before.check(&Key::from("later"), &policy, 1).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the old instance never decided again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "resumed primary refused writes after (time, reply) {refused_after:?} (None: still \
         accepting 200 ms after the resume); admitted (before, after): {admitted:?}, failed: \
         {failed:?}; the old instance decides again {:?} after the resume",
        resumed.elapsed()
    );
    assert!(
        admitted[0] + admitted[1] <= 10,
        "two budgets: {admitted:?} admitted at 10/1m"
    );
    // It reconnected when the old primary refused, rather than when the sentinels got round
    // to demoting it (about 10 s after the resume).
    let back = resumed.elapsed();
    assert!(
        back < Duration::from_secs(5),
        "decides again only {back:?} after the resume"
    );
}
