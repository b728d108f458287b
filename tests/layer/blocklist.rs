//! The Bloom-filter blocklist against a real Redis: 100 000 blocked keys and 100 000 others
//! through the layer; every blocked key refused, no other, and the "maybe" rate measured.

use std::time::Duration;

use crate::support::scenarios::Reply;
use crate::support::RedisServer;
use fred::prelude::ClientLike;
use futures::stream::{self, StreamExt};
use http::{HeaderName, Request};
use tower::{Layer, ServiceExt};
use tower_redis_ratelimit::blocklist::{Blocklist, BlocklistLayer};
use tower_redis_ratelimit::test_util::blocklist_stats;
use tower_redis_ratelimit::{Header, Key, StoreError};

const BLOCKED: usize = 100_000;
const OTHERS: usize = 100_000;
const RATE: f64 = 0.01;

fn request(key: &str) -> Request<()> {
    let mut request = Request::new(());
    request
        .headers_mut()
        .insert("x-api-key", key.parse().unwrap());
    request
}

/// Sends one request per key through `layer` around an `ok` service, 64 at a time; returns
/// the number answered 403 and the number answered 200.
async fn statuses(layer: &BlocklistLayer<Header>, keys: Vec<String>) -> (usize, usize) {
    let service = layer.layer(tower::service_fn(|_: Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
            bytes::Bytes::from_static(b"ok"),
        )))
    }));
    let replies: Vec<u16> = stream::iter(keys)
        .map(|key| {
            let service = service.clone();
            async move {
                let reply: Reply = service.oneshot(request(&key)).await.unwrap();
                reply.status().as_u16()
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let count = |status| replies.iter().filter(|&&s| s == status).count();
    (count(403), count(200))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_keys_refused_and_no_other() {
    let server = RedisServer::start();
    let store = server.store().await;
    let blocklist = Blocklist::builder(&store)
        .expected_items(BLOCKED as u64)
        .false_positive_rate(RATE)
        .build()
        .await
        .unwrap();
    let blocked: Vec<Key> = (0..BLOCKED)
        .map(|i| Key::from(format!("blocked-{i}")))
        .collect();
    blocklist.add(&blocked).await.unwrap();
    // Another instance, which only knows the filter from Redis.
    let other_instance = Blocklist::builder(&store)
        .expected_items(BLOCKED as u64)
        .false_positive_rate(RATE)
        .build()
        .await
        .unwrap();
    let layer = BlocklistLayer::new(
        other_instance.clone(),
        Header::new(HeaderName::from_static("x-api-key")),
    );

    let (refused, passed) = statuses(
        &layer,
        (0..BLOCKED).map(|i| format!("blocked-{i}")).collect(),
    )
    .await;
    assert_eq!(
        (refused, passed),
        (BLOCKED, 0),
        "every blocked key is refused"
    );
    let after_blocked = blocklist_stats(&other_instance);

    let (refused, passed) =
        statuses(&layer, (0..OTHERS).map(|i| format!("client-{i}")).collect()).await;
    assert_eq!((refused, passed), (0, OTHERS), "no other key is refused");
    let stats = blocklist_stats(&other_instance);
    let maybe = stats.maybe - after_blocked.maybe;
    let rate = maybe as f64 / OTHERS as f64;
    eprintln!(
        "unblocked keys: {maybe} of {OTHERS} were a \"maybe\" ({:.3} %, configured {:.1} %)",
        rate * 100.0,
        RATE * 100.0
    );
    assert!(rate <= RATE, "maybe rate {rate}");
    assert_eq!(stats.blocked, BLOCKED as u64);

    // Redis holds the bit array and the exact set.
    let admin = server.client().await;
    let bytes: u64 = fred::prelude::MemoryInterface::memory_usage(
        &admin,
        "ratelimit:{bl:default}:bits",
        Some(0),
    )
    .await
    .unwrap();
    eprintln!("filter: {bytes} bytes in Redis");
}

#[tokio::test]
async fn added_and_removed_at_run_time() {
    let server = RedisServer::start();
    let store = server.store().await;
    let build = || {
        Blocklist::builder(&store)
            .name("runtime")
            .expected_items(1_000)
            .refresh(Duration::from_millis(50))
            .build()
    };
    let (here, there) = (build().await.unwrap(), build().await.unwrap());
    let key = Key::from("203.0.113.9");
    assert!(!here.contains(&key).await.unwrap());
    here.add(std::slice::from_ref(&key)).await.unwrap();
    assert!(
        here.contains(&key).await.unwrap(),
        "at once where it was added"
    );
    // The other instance sees it once its copy of the filter is refreshed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !there.contains(&key).await.unwrap() {
        assert!(tokio::time::Instant::now() < deadline, "never refreshed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    here.remove(&key).await.unwrap();
    assert!(!here.contains(&key).await.unwrap());
    assert!(
        !there.contains(&key).await.unwrap(),
        "the exact set decides"
    );
}

#[tokio::test]
async fn a_differently_sized_filter_of_the_same_name_is_refused() {
    let server = RedisServer::start();
    let store = server.store().await;
    Blocklist::builder(&store)
        .expected_items(1_000)
        .build()
        .await
        .unwrap();
    let other = Blocklist::builder(&store)
        .expected_items(5_000)
        .build()
        .await;
    assert!(matches!(other, Err(StoreError::Config(_))), "{other:?}");
    let bad = Blocklist::builder(&store)
        .false_positive_rate(1.5)
        .build()
        .await;
    assert!(matches!(bad, Err(StoreError::Config(_))), "{bad:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmations_share_the_store_breaker() {
    let server = RedisServer::start();
    let store = tower_redis_ratelimit::RedisStore::builder(server.url())
        .timeout(Duration::from_millis(300))
        .retry_interval(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let blocklist = Blocklist::builder(&store)
        .name("breaker")
        .expected_items(1_000)
        .build()
        .await
        .unwrap();
    let key = Key::from("203.0.113.9");
    blocklist.add(std::slice::from_ref(&key)).await.unwrap();
    assert!(blocklist.contains(&key).await.unwrap());

    // Redis stops answering: the first confirmation waits out the store's timeout and trips
    // the breaker; the next one fails at once instead of waiting again.
    let admin = server.client().await;
    let _: () = admin
        .custom(fred::cmd!("CLIENT"), vec!["PAUSE", "5000", "ALL"])
        .await
        .unwrap();
    assert!(blocklist.contains(&key).await.is_err());
    assert!(!store.is_healthy());
    let started = tokio::time::Instant::now();
    let second = blocklist.contains(&key).await;
    assert!(matches!(second, Err(StoreError::Unavailable)), "{second:?}");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
}
