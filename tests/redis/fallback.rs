//! `FailureMode::Fallback` while the test's own `redis-server` is stopped (SIGSTOP): a key the
//! instance last saw refused or spent stays refused until the `Retry-After` (or the reset) it
//! was given, and a key it has not seen gets one budget of the local store.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::time::{sleep_until, Instant};
use tower::{service_fn, ServiceExt};
use tower_redis_ratelimit::{
    Algorithm, FailureMode, Key, MemoryStore, PeerIp, Policy, RateLimitLayer, RedisStore, Store,
};

use crate::support::load::store;
use crate::support::scenarios::{layered, request_from};
use crate::support::RedisServer;

/// Scheduling slack around the times a client is told, on a shared two-core machine.
const SLACK: Duration = Duration::from_millis(300);

/// The test's own `redis-server`, stopped until dropped.
struct Stopped<'a>(&'a RedisServer);

impl<'a> Stopped<'a> {
    fn new(server: &'a RedisServer) -> Self {
        server.signal("-STOP");
        Stopped(server)
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.signal("-CONT");
    }
}

/// A layer of `policy` over `store`, falling back to a memory store, with no deny cache, so
/// that only the fallback answers while Redis is stopped.
fn layer(store: RedisStore, policy: Policy) -> RateLimitLayer<PeerIp, RedisStore> {
    RateLimitLayer::builder()
        .policy(policy)
        .store(store)
        .deny_cache(0)
        .failure_mode(FailureMode::Fallback(MemoryStore::new()))
        .build()
        .unwrap()
}

/// Sends a request from `ip` through `layer`: its status and `Retry-After`, if any.
async fn send(layer: &RateLimitLayer<PeerIp, RedisStore>, ip: &str) -> (u16, Option<u64>) {
    let response = layered(layer).oneshot(request_from(ip)).await.unwrap();
    let retry = response.headers().get("retry-after");
    let retry = retry.map(|r| r.to_str().unwrap().parse().unwrap());
    (response.status().as_u16(), retry)
}

fn statuses(replies: &[(u16, Option<u64>)]) -> Vec<u16> {
    replies.iter().map(|(status, _)| *status).collect()
}

/// The case as a user meets it: one instance, `2/1h` with a 600 s box, Redis stopped; on each
/// algorithm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_keeps_a_boxed_and_a_spent_user_out_while_redis_is_stopped() {
    let server = RedisServer::start();
    let store = store(server.url()).await;
    let algorithms = [
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::Gcra,
    ];
    for (i, algorithm) in algorithms.into_iter().enumerate() {
        answering(&store).await;
        let policy = Policy::new("login", ["2/1h".parse().unwrap()]).unwrap();
        let policy = policy.with_algorithm(algorithm);
        let login = layer(
            store.clone(),
            policy.block_for(Duration::from_secs(600)).unwrap(),
        );
        let ip = |user: u8| format!("192.0.2.{}", 10 * i as u8 + user);
        let (boxed, spent, unseen) = (ip(1), ip(2), ip(3));
        let mut reset = None;
        for _ in 0..2 {
            assert_eq!(send(&login, &boxed).await.0, 200);
            let response = layered(&login).oneshot(request_from(&spent)).await.unwrap();
            assert_eq!(response.status(), 200);
            reset = Some(reset_of(&response));
        }
        // Boxed for 600 s, and refused until the limit admits again: up to the hour.
        let (status, told) = send(&login, &boxed).await;
        assert_eq!(status, 429);
        let (told, reset) = (told.unwrap(), reset.unwrap());

        let stopped = Stopped::new(&server);
        let mut replies = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            replies.0.push(send(&login, &boxed).await);
            replies.1.push(send(&login, &spent).await);
            replies.2.push(send(&login, &unseen).await);
        }
        drop(stopped);
        // Boxed a moment before: refused for what is left of its refusal. Spent 2 of 2: refused
        // until the reset it was told.
        let refused = |until: u64| {
            move |&(status, retry): &(u16, Option<u64>)| {
                status == 429 && retry.is_some_and(|r| r <= until && r + 2 >= until)
            }
        };
        let case = format!("{algorithm:?}: told {told} s boxed, {reset} s to the reset");
        assert!(
            replies.0.iter().all(refused(told)),
            "{case}: {:?}",
            replies.0
        );
        assert!(
            replies.1.iter().all(refused(reset)),
            "{case}: {:?}",
            replies.1
        );
        // Never seen: one budget of the local store.
        assert_eq!(statuses(&replies.2), [200, 200, 429], "{case}");
        eprintln!("{case}: refused through the outage");
    }
}

/// Waits until `store` decides again after Redis was stopped, so that the next requests are
/// decided by Redis, not by the fallback.
async fn answering(store: &RedisStore) {
    let probe: Policy = "1000000/1m".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.check(&Key::from("probe"), &probe, 1).await.is_err() {
        assert!(Instant::now() < deadline, "Redis answers again within 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `t` of a response's `RateLimit` field: seconds to the reset.
fn reset_of<B>(response: &Response<B>) -> u64 {
    let field = response.headers()["ratelimit"].to_str().unwrap();
    let t = field.rsplit_once("t=").unwrap().1;
    t.parse().unwrap()
}

/// Short windows, to see each refusal end: a boxed user is let in by the fallback once its
/// `Retry-After` has passed and not before, a spent user once its window's reset has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_refuses_until_the_retry_after_and_the_reset_it_was_given() {
    let server = RedisServer::start();
    let policy: Policy = "2/3s".parse().unwrap();
    let policy = policy.block_for(Duration::from_secs(5)).unwrap();
    let login = layer(store(server.url()).await, policy);
    let (boxed, spent, unseen) = ("192.0.2.11", "192.0.2.12", "192.0.2.13");

    let spent_from = Instant::now();
    assert_eq!(send(&login, spent).await.0, 200);
    assert_eq!(send(&login, spent).await.0, 200);
    for _ in 0..2 {
        assert_eq!(send(&login, boxed).await.0, 200);
    }
    assert_eq!(send(&login, boxed).await, (429, Some(5)));
    let boxed_until = Instant::now() + Duration::from_secs(5);
    let spent_until = spent_from + Duration::from_secs(3);

    let stopped = Stopped::new(&server);
    // Until each refusal ends, every retry is refused, and told a wait that ends no earlier.
    let mut unseen_replies = Vec::new();
    let mut refused = 0;
    while Instant::now() + SLACK < spent_until {
        for (ip, until) in [(boxed, boxed_until), (spent, spent_until)] {
            let (status, retry) = send(&login, ip).await;
            let told = Instant::now() + Duration::from_secs(retry.unwrap_or(0));
            assert_eq!(status, 429, "{ip} let in before its time");
            assert!(told + SLACK >= until, "{ip} told a wait that ends early");
            assert!(
                told <= until + Duration::from_secs(1) + SLACK,
                "{ip}: {retry:?}"
            );
            refused += 1;
        }
        if unseen_replies.len() < 3 {
            unseen_replies.push(send(&login, unseen).await);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    sleep_until(spent_until + SLACK).await;
    assert_eq!(
        send(&login, spent).await.0,
        200,
        "spent: let in after its reset"
    );
    while Instant::now() + SLACK < boxed_until {
        assert_eq!(send(&login, boxed).await.0, 429, "boxed: let in early");
        refused += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    sleep_until(boxed_until + SLACK).await;
    assert_eq!(
        send(&login, boxed).await.0,
        200,
        "boxed: let in after its box"
    );
    drop(stopped);
    eprintln!("{refused} retries refused; unseen: {unseen_replies:?}");
    assert!(refused >= 10);
    assert_eq!(statuses(&unseen_replies), [200, 200, 429]);
}

/// Counted by outcome, two right passwords at once hold the count while in flight, and give
/// their units back: the fallback does not take the user for spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_lets_in_a_user_whose_logins_gave_their_units_back() {
    let server = RedisServer::start();
    let policy: Policy = "2/1h".parse().unwrap();
    let login = RateLimitLayer::builder()
        .policy(policy.block_for(Duration::from_secs(600)).unwrap())
        .store(store(server.url()).await)
        .deny_cache(0)
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .failure_mode(FailureMode::Fallback(MemoryStore::new()))
        .build()
        .unwrap();
    let slow = tower::Layer::layer(
        &login,
        service_fn(|_: Request<()>| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"welcome"))))
        }),
    );
    let user = "192.0.2.21";
    // The second is decided while the first is in flight: the count spent, 0 remaining.
    let first = tokio::spawn(slow.clone().oneshot(request_from(user)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = slow.clone().oneshot(request_from(user)).await;
    let both = [first.await.unwrap().unwrap(), second.unwrap()];
    let remaining: Vec<_> = both
        .iter()
        .map(|r| r.headers()["ratelimit"].clone())
        .collect();
    assert!(both.iter().all(|r| r.status() == 200), "{remaining:?}");
    drop(both);
    assert_eq!(login.settled(Duration::from_secs(3)).await, 0);

    let _stopped = Stopped::new(&server);
    assert_eq!(send(&login, user).await.0, 200, "after {remaining:?}");
}

/// A key an override blocks stays refused through an outage: the fallback store has no
/// overrides, so the layer keeps the block's refusal it last saw (for the policy's window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_keeps_a_blocked_key_out() {
    use tower_redis_ratelimit::store::{Override, Scope};
    let server = RedisServer::start();
    let redis = store(server.url()).await;
    let policy = Policy::new("blk", ["5/1h".parse().unwrap()]).unwrap();
    let layer = layer(redis.clone(), policy.clone());
    let ip = "192.0.2.99";
    assert_eq!(send(&layer, ip).await.0, 200);
    let scope = Scope::Key(tower_redis_ratelimit::Key::from(ip));
    redis
        .overrides()
        .set(&policy, &scope, &Override::Block)
        .await
        .unwrap();
    assert_eq!(send(&layer, ip).await, (429, None), "blocked");
    let stopped = Stopped::new(&server);
    let mut during = Vec::new();
    for _ in 0..7 {
        during.push(send(&layer, ip).await);
    }
    drop(stopped);
    assert_eq!(statuses(&during), [429; 7], "{during:?}");
}
