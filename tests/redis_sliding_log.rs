//! The sliding-window log against real `redis-server` processes.

mod common;

use std::time::Duration;

use common::scenarios::{self, check, MARGIN};
use common::RedisServer;
use fred::prelude::*;
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
    let zset = store.redis_key(&Key::from("crowd"), &policy);

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
async fn key_expires_after_the_longest_window() {
    let server = RedisServer::start();
    let store = server.store().await;
    let redis = server.client().await;
    let policy: Policy = "2/300ms + 5/1s".parse().unwrap();
    let zset = store.redis_key(&Key::from("idle"), &policy);
    for _ in 0..3 {
        check(&store, "idle", &policy).await;
    }
    let ttl: i64 = redis.pttl(&zset).await.unwrap();
    // The expiry is rounded up to the next millisecond, never down.
    assert!(
        (900..=1001).contains(&ttl),
        "expiry set to the longest window, got {ttl} ms"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let exists: u32 = redis.exists(&zset).await.unwrap();
    assert_eq!(exists, 0, "key left behind after its longest window");
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
