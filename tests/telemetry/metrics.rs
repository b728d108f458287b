//! The counters and histogram an operator scrapes, rendered as Prometheus text after real
//! allowed, denied and failed decisions. One recorder serves the whole test binary, so each
//! test uses its own policy name, and runs alone: other tests of the binary log.

use std::time::Duration;

use crate::support::metrics::{prometheus, sample};
use crate::support::scenarios::{layered, request_from};
use crate::support::RedisServer;
use tower::{Service, ServiceExt};
use tower_redis_ratelimit::test_util::key_count;
use tower_redis_ratelimit::{FailureMode, MemoryStore, Policy, RateLimitLayer, RedisStore};

fn policy(name: &str, limit: &str) -> Policy {
    limit.parse::<Policy>().unwrap().named(name).unwrap()
}

async fn send<S>(service: &mut S, ip: &str) -> u16
where
    S: Service<http::Request<()>, Response = crate::support::scenarios::Reply>,
    S::Error: std::fmt::Debug,
{
    let reply = service.ready().await.unwrap().call(request_from(ip)).await;
    reply.unwrap().status().as_u16()
}

#[tokio::test]
async fn allowed_and_denied_by_policy() {
    let _alone = crate::support::one_at_a_time();
    let handle = prometheus();
    let login = RateLimitLayer::builder()
        .policy(policy("login", "2/1m"))
        .build()
        .unwrap();
    let search = RateLimitLayer::builder()
        .policy(policy("search", "5/1m"))
        .build()
        .unwrap();
    let (mut login, mut search) = (layered(&login), layered(&search));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(send(&mut login, "192.0.2.1").await);
    }
    statuses.push(send(&mut search, "192.0.2.1").await);
    assert_eq!(statuses, [200, 200, 429, 200]);

    let text = handle.render();
    let get = |series: &str| sample(&text, series);
    assert_eq!(
        get("ratelimit_allowed_total{policy=\"login\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        get("ratelimit_denied_total{policy=\"login\",source=\"store\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        get("ratelimit_allowed_total{policy=\"search\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        get("ratelimit_denied_total{policy=\"search\",source=\"store\"}"),
        None
    );
    assert_eq!(
        get("ratelimit_decision_seconds_count{policy=\"login\"}"),
        Some(3.0),
        "{text}"
    );
}

#[tokio::test]
async fn deny_cache_refusals_are_counted_apart() {
    let _alone = crate::support::one_at_a_time();
    let handle = prometheus();
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder()
        .policy(policy("cached", "1/1m"))
        .store(server.store().await)
        .build()
        .unwrap();
    let mut service = layered(&layer);
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(send(&mut service, "192.0.2.2").await);
    }
    assert_eq!(statuses, [200, 429, 429, 429]);

    let text = handle.render();
    let get = |series: &str| sample(&text, series);
    assert_eq!(
        get("ratelimit_allowed_total{policy=\"cached\"}"),
        Some(1.0),
        "{text}"
    );
    let denied = |source: &str| {
        get(&format!(
            "ratelimit_denied_total{{policy=\"cached\",source=\"{source}\"}}"
        ))
    };
    assert_eq!(denied("store"), Some(1.0), "{text}");
    assert_eq!(denied("deny_cache"), Some(2.0), "{text}");
    // Only the two answers from Redis were timed.
    assert_eq!(
        get("ratelimit_decision_seconds_count{policy=\"cached\"}"),
        Some(2.0),
        "{text}"
    );
}

#[tokio::test]
async fn store_errors_and_fallbacks() {
    let _alone = crate::support::one_at_a_time();
    let captured = crate::support::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let handle = prometheus();
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    server.kill();
    let layer = RateLimitLayer::builder()
        .policy(policy("fallback", "1/1m"))
        .store(store)
        .failure_mode(FailureMode::Fallback(MemoryStore::new()))
        .build()
        .unwrap();
    let mut service = layered(&layer);
    let statuses = [
        send(&mut service, "192.0.2.3").await,
        send(&mut service, "192.0.2.3").await,
    ];
    assert_eq!(statuses, [200, 429], "the fallback store keeps the limit");

    let text = handle.render();
    let get = |series: &str| sample(&text, series);
    assert_eq!(
        get("ratelimit_store_errors_total{policy=\"fallback\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        get("ratelimit_fallbacks_total{policy=\"fallback\"}"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        get("ratelimit_allowed_total{policy=\"fallback\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        get("ratelimit_denied_total{policy=\"fallback\",source=\"store\"}"),
        Some(1.0),
        "{text}"
    );
    // What the operator reads: the policy, the client, and that it was decided locally.
    let log = captured.text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("rate-limit store failed; deciding locally"))
        .collect();
    assert_eq!(warnings.len(), 2, "{log}");
    assert!(
        warnings.iter().all(|l| l.contains("WARN")
            && (l.contains("policy=\"fallback\"") || l.contains("policy=fallback"))
            && l.contains("key=192.0.2.3")),
        "{log}"
    );
}

/// Redis dies after a response's head was sent and before its body ended: the client still
/// reads the whole body, and the settle of its usage that fails is logged and counted.
#[tokio::test]
async fn settle_failures_are_counted_and_leave_the_response_untouched() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use tower::{service_fn, Layer};
    use tower_redis_ratelimit::usage::{Usage, UsageReport};

    let _alone = crate::support::one_at_a_time();

    let captured = crate::support::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let handle = prometheus();
    let mut server = RedisServer::start();
    let layer = RateLimitLayer::builder()
        .policy(policy("tokens", "1000/1m"))
        .store(server.store().await)
        .usage(UsageReport::new())
        .build()
        .unwrap();
    let service = layer.layer(service_fn(|_: http::Request<()>| async {
        let mut response = http::Response::new(Full::new(Bytes::from_static(b"all of it")));
        response.extensions_mut().insert(Usage(250));
        Ok::<_, std::convert::Infallible>(response)
    }));
    let response = service.oneshot(request_from("192.0.2.9")).await.unwrap();
    assert_eq!(response.status(), 200);
    server.kill();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"all of it");

    // The settle runs in a task of its own: wait for its failure to be counted.
    let series = "ratelimit_settle_errors_total{policy=\"tokens\"}";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sample(&handle.render(), series).is_none() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sample(&handle.render(), series), Some(1.0));
    let log = captured.text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("failed to settle a request's usage")
            && l.contains("key=192.0.2.9")),
        "{log}"
    );
}

/// A memory store whose one shard holds only boxed keys makes room for a new key by evicting
/// the box that ends soonest, and counts it.
#[tokio::test]
async fn pinned_evictions_are_counted() {
    use tower_redis_ratelimit::{Key, Store};

    let _alone = crate::support::one_at_a_time();

    let handle = prometheus();
    let store = MemoryStore::builder().max_keys(2).build();
    let policy = policy("evict-boxed", "1/1h")
        .block_for(Duration::from_secs(900))
        .unwrap();
    for name in ["a", "b", "c"] {
        let key = Key::from(name);
        assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
        let refused = store.check(&key, &policy, 1).await.unwrap();
        assert!(refused.in_penalty_box(), "{name}: {refused:?}");
    }
    assert_eq!(key_count(&store), 2);
    let text = handle.render();
    let series = "ratelimit_evicted_pinned_total{policy=\"evict-boxed\"}";
    assert_eq!(sample(&text, series), Some(1.0), "{text}");
}
