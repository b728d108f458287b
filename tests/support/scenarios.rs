//! Scenarios that must hold for every store. Each test file runs them against its store:
//! the memory store on tokio's paused clock, the Redis store on real time with short windows.
//! Times are measured from the scenario's start with tokio's clock, so the same code sleeps
//! virtually or for real.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use http::{Request, Response};
use http_body_util::Full;
use tokio::time::{sleep_until, Instant};
use tower::{service_fn, Service, ServiceExt};
use tower_redis_ratelimit::test_util::limit_index;
use tower_redis_ratelimit::{Decision, Key, Policy, RateLimitLayer, Store};

/// How far a Redis-timed value may drift from the exact one.
pub const MARGIN: Duration = Duration::from_millis(150);

pub async fn check<St: Store>(store: &St, key: &str, policy: &Policy) -> Decision {
    store
        .check(&Key::from(key), policy, 1)
        .await
        .expect("store decision")
}

pub fn assert_near(actual: Duration, expected: Duration, margin: Duration) {
    let diff = actual.abs_diff(expected);
    assert!(
        diff <= margin,
        "expected about {expected:?} (± {margin:?}), got {actual:?}"
    );
}

/// The multi-limit scenario: `2/2s + 3/10s`.
pub async fn multi_limit<St: Store>(store: St, margin: Duration) {
    let policy: Policy = "2/2s + 3/10s".parse().unwrap();
    let start = Instant::now();
    assert!(check(&store, "multi", &policy).await.is_allowed());
    assert!(check(&store, "multi", &policy).await.is_allowed());

    let third = check(&store, "multi", &policy).await;
    assert!(!third.is_allowed());
    assert_eq!(limit_index(&third), 0, "denied by the 2 s limit");
    assert_near(third.retry_after().unwrap(), Duration::from_secs(2), margin);

    sleep_until(start + Duration::from_millis(2100)).await;
    assert!(check(&store, "multi", &policy).await.is_allowed());

    sleep_until(start + Duration::from_millis(2200)).await;
    let fifth = check(&store, "multi", &policy).await;
    assert!(!fifth.is_allowed());
    assert_eq!(limit_index(&fifth), 1, "denied by the 10 s limit");
    assert_eq!((fifth.limit(), fifth.remaining()), (3, 0));
    assert_near(
        fifth.retry_after().unwrap(),
        Duration::from_millis(7800),
        margin,
    );

    // The same request through the layer: 429 with the fields a client reads.
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .store(store)
        .key(|_: &Request<()>| Some("multi"))
        .build()
        .unwrap();
    let response = layered(&layer).oneshot(Request::new(())).await.unwrap();
    assert_eq!(response.status(), 429);
    let h = response.headers();
    assert_eq!(h["retry-after"], "8");
    assert_eq!(
        h["ratelimit-policy"],
        "\"default-2s\";q=2;w=2, \"default-10s\";q=3;w=10"
    );
    assert_eq!(h["ratelimit"], "\"default-10s\";r=0;t=8");
}

/// Many concurrent requests through several store handles (several app instances) admit
/// exactly the limit.
pub async fn concurrent_exact<St: Store>(stores: &[St], requests: usize, limit: u64) -> usize {
    let policy = Policy::new("burst", [format!("{limit}/10s").parse().unwrap()]).unwrap();
    let decisions = join_all((0..requests).map(|i| {
        let store = stores[i % stores.len()].clone();
        let policy = policy.clone();
        async move { check(&store, "crowd", &policy).await }
    }))
    .await;
    let admitted = decisions.iter().filter(|d| d.is_allowed()).count();
    assert_eq!(admitted as u64, limit, "admitted exactly the limit");
    for d in decisions.iter().filter(|d| !d.is_allowed()) {
        assert!(d.retry_after().unwrap() > Duration::ZERO);
    }
    admitted
}

/// A client that keeps retrying while refused is admitted as soon as its retry-after has
/// passed: refused attempts are not recorded.
pub async fn retrying_client_is_not_locked_out<St: Store>(store: St, margin: Duration) {
    let policy: Policy = "1/1s".parse().unwrap();
    assert!(check(&store, "eager", &policy).await.is_allowed());
    let mut last = None;
    for _ in 0..10 {
        let d = check(&store, "eager", &policy).await;
        assert!(!d.is_allowed());
        last = d.retry_after();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(last.unwrap() + margin).await;
    assert!(check(&store, "eager", &policy).await.is_allowed());
}

/// Cost counts as that many requests, and a cost above the limit is refused with no retry.
pub async fn cost_and_keys<St: Store>(store: St) {
    let policy: Policy = "5/10s".parse().unwrap();
    let key = Key::from("heavy");
    let d = store.check(&key, &policy, 3).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.remaining(), 2);
    let d = store.check(&key, &policy, 3).await.unwrap();
    assert!(!d.is_allowed());
    let d = store.check(&key, &policy, 2).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.remaining(), 0);
    let d = store.check(&Key::from("light"), &policy, 6).await.unwrap();
    assert!(!d.is_allowed());
    assert_eq!(d.retry_after(), None);
    // Another key, and the same key under another policy, have budgets of their own.
    assert!(check(&store, "other", &policy).await.is_allowed());
    let other_policy = policy.clone().named("other").unwrap();
    assert!(store
        .check(&key, &other_policy, 5)
        .await
        .unwrap()
        .is_allowed());
}

pub type Reply = Response<tower_redis_ratelimit::body::ResponseBody<Full<Bytes>>>;

/// `layer` around a service that answers `ok`, for scenarios that look at HTTP.
pub fn layered<K, St>(
    layer: &RateLimitLayer<K, St>,
) -> impl Service<Request<()>, Response = Reply, Error = Infallible> + Clone
where
    K: tower_redis_ratelimit::KeyExtractor<()>,
    St: Store,
{
    tower::Layer::layer(
        layer,
        service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }),
    )
}

/// A request from `ip`, as a server that inserts the peer address would pass it on.
pub fn request_from(ip: &str) -> Request<()> {
    let mut request = Request::new(());
    request
        .extensions_mut()
        .insert(SocketAddr::new(ip.parse().unwrap(), 40000));
    request
}
