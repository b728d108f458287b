//! The sliding-window log against real `redis-server` processes.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::scenarios::{self, check, MARGIN};
use crate::support::RedisServer;
use fred::prelude::*;
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{Key, Policy, Store};

#[tokio::test]
async fn multi_limit_policy() {
    let server = RedisServer::start();
    scenarios::multi_limit(server.store().await, MARGIN).await;
}

#[tokio::test]
async fn two_instances_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let instances = [server.store().await, server.store().await];
    scenarios::concurrent_exact(&instances, 200, 50).await;
}

#[tokio::test]
async fn retrying_client_is_not_locked_out() {
    let server = RedisServer::start();
    scenarios::retrying_client_is_not_locked_out(server.store().await, MARGIN).await;
}

#[tokio::test]
async fn cost_and_keys() {
    let server = RedisServer::start();
    scenarios::cost_and_keys(server.store().await).await;
}

#[tokio::test]
async fn one_member_per_admitted_request_and_none_per_denied() {
    let server = RedisServer::start();
    let store = server.store().await;
    let redis = server.client().await;
    let policy = Policy::new("burst", ["100/10s".parse().unwrap()]).unwrap();
    let zset = redis_key(&store, &Key::from("crowd"), &policy);

    // 150 at once: most land within the same millisecond, and still count one each.
    scenarios::concurrent_exact(std::slice::from_ref(&store), 150, 100).await;
    let members: u64 = redis.zcard(&zset).await.unwrap();
    assert_eq!(members, 100);
    for _ in 0..20 {
        assert!(!check(&store, "crowd", &policy).await.is_allowed());
    }
    let members: u64 = redis.zcard(&zset).await.unwrap();
    assert_eq!(members, 100, "denied requests add nothing");
}

#[tokio::test]
async fn key_expires_after_twice_the_longest_window() {
    let server = RedisServer::start();
    let store = server.store().await;
    let redis = server.client().await;
    let policy: Policy = "2/300ms + 5/1s".parse().unwrap();
    let zset = redis_key(&store, &Key::from("idle"), &policy);
    for _ in 0..3 {
        check(&store, "idle", &policy).await;
    }
    let ttl: i64 = redis.pttl(&zset).await.unwrap();
    // Twice the longest window: event times up to a window back read a window further; that
    // rounded up to an eighth of the longest window (125 ms), never down.
    assert!(
        (1900..=2126).contains(&ttl),
        "expiry set to twice the longest window, got {ttl} ms"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let exists: u32 = redis.exists(&zset).await.unwrap();
    assert_eq!(exists, 0, "key left behind after twice its longest window");
}

#[tokio::test]
async fn script_is_reloaded_after_script_flush() {
    let server = RedisServer::start();
    let store = server.store().await;
    let redis = server.client().await;
    let policy: Policy = "10/10s".parse().unwrap();
    assert!(check(&store, "flush", &policy).await.is_allowed());
    redis.script_flush(false).await.unwrap();
    let d = store
        .check(&Key::from("flush"), &policy, 1)
        .await
        .expect("decision after SCRIPT FLUSH");
    assert!(d.is_allowed());
    assert_eq!(d.remaining(), 8);
}

/// A request adds one member whatever its cost, and the log still counts every unit: after
/// 100 requests of cost 1 000 under 100 000 per minute nothing is left, and each retry is when
/// enough of the oldest requests' units have aged out. Event times half a minute ago make the
/// figures exact; they are decided as requests made then.
#[tokio::test]
async fn one_member_per_request_whatever_its_cost() {
    let server = RedisServer::start();
    let store = server.store().await;
    let redis = server.client().await;
    let policy: Policy = "100000/1m".parse().unwrap();
    let key = Key::from("usage");
    let zset = redis_key(&store, &key, &policy);
    let ms = Duration::from_millis;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let base = UNIX_EPOCH + ms(now.as_millis() as u64) - Duration::from_secs(30);

    let d = store.check_at(&key, &policy, 1_000, base).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.remaining(), 99_000);
    let members: u64 = redis.zcard(&zset).await.unwrap();
    assert_eq!(members, 1);
    for i in 2..=100u64 {
        let at = base + ms(10 * (i - 1));
        let d = store.check_at(&key, &policy, 1_000, at).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 100_000 - i * 1_000);
    }
    let members: u64 = redis.zcard(&zset).await.unwrap();
    assert_eq!(members, 100);

    // 1 s after the first request, which leaves at 60 s.
    let at = base + ms(1_000);
    let d = store.check_at(&key, &policy, 1, at).await.unwrap();
    assert!(!d.is_allowed());
    assert_eq!((d.remaining(), d.retry_after()), (0, Some(ms(59_000))));
    assert_eq!(d.reset_after(), ms(59_000));
    // 1 001 units: the second request must leave too (at 60.01 s); 2 500: the third.
    let d = store.check_at(&key, &policy, 1_001, at).await.unwrap();
    assert_eq!(d.retry_after(), Some(ms(59_010)));
    let d = store.check_at(&key, &policy, 2_500, at).await.unwrap();
    assert_eq!(d.retry_after(), Some(ms(59_020)));
    let members: u64 = redis.zcard(&zset).await.unwrap();
    assert_eq!(members, 100, "refusals add nothing");

    // Requests made now: the first request's 1 000 units are still in the window.
    let d = store.check(&key, &policy, 1).await.unwrap();
    assert!(!d.is_allowed());
    let retry = d.retry_after().unwrap();
    assert!(retry <= ms(30_000) && retry > ms(25_000), "{retry:?}");
}

/// Totals near the top of what Lua's doubles hold exactly are moved down to the oldest event,
/// and the counts stay exact.
#[tokio::test]
async fn running_totals_are_moved_down_before_they_grow_inexact() {
    let server = RedisServer::start();
    let store = server.store().await;
    let redis = server.client().await;
    let policy: Policy = "10000/1m".parse().unwrap();
    let key = Key::from("old");
    let zset = redis_key(&store, &key, &policy);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let base = now.as_micros() as u64 - 30_000_000;
    // Two events of 3 000 units, written as a long-lived key would hold them.
    let top = 4_503_599_627_370_000u64;
    for (at, total) in [(base, top - 3_000), (base + 1, top)] {
        let member = format!("{at}:{total:016}:3000");
        let _: () = redis
            .zadd(&zset, None, None, false, false, (at as f64, member))
            .await
            .unwrap();
    }
    let at = |micros: u64| UNIX_EPOCH + Duration::from_micros(micros);
    let d = store
        .check_at(&key, &policy, 1_000, at(base + 2))
        .await
        .unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.remaining(), 3_000);
    let members: Vec<String> = redis
        .zrange(&zset, 0, -1, None, false, None, false)
        .await
        .unwrap();
    assert_eq!(
        members,
        [
            format!("{base}:{:016}:3000", 3_000),
            format!("{}:{:016}:3000", base + 1, 6_000),
            format!("{}:{:016}:1000", base + 2, 7_000),
        ]
    );
    let d = store
        .check_at(&key, &policy, 3_001, at(base + 3))
        .await
        .unwrap();
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), Some(Duration::from_micros(60_000_000 - 3)));
}
