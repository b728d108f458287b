//! Concurrency limits (`Policy::concurrency`): at most N requests of a key in flight across a
//! fleet of instances, slots given back when a response ends or is dropped, and the slots of
//! an instance that dies coming back within the slot lifetime.
//!
//! The memory store runs on tokio's paused clock; Redis tests use the test's own
//! `redis-server` and real time with short lifetimes and wide margins.

mod batched_releases;
mod outages;
mod slots;
mod waiting;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::proxy::Proxy;
use crate::support::RedisServer;
use bytes::Bytes;
use futures::future::join_all;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, StreamBody};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_redis_ratelimit::key::Header;
use tower_redis_ratelimit::{
    Decisions, FailureMode, Key, MemoryStore, Policy, RateLimit, RateLimitLayer, RedisStore, Rule,
    Settlement, Store, StoreError,
};

type Body = BoxBody<Bytes, Infallible>;
type Frame = Result<http_body::Frame<Bytes>, Infallible>;

fn api_key() -> Header {
    Header::new(http::HeaderName::from_static("x-api-key"))
}

fn request(key: &str) -> Request<()> {
    Request::builder()
        .header("x-api-key", key)
        .body(())
        .unwrap()
}

/// A layer keyed by `x-api-key` deciding `policy` with `store`.
fn limited<St: Store>(store: St, policy: Policy) -> RateLimitLayer<Header, St> {
    RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .policy(policy)
        .build()
        .unwrap()
}

/// The same, letting a request refused for a slot wait for one up to `max_wait`.
fn limited_waiting<St: Store>(
    store: St,
    policy: Policy,
    max_wait: Duration,
) -> RateLimitLayer<Header, St> {
    RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .policy(policy)
        .max_wait(max_wait)
        .build()
        .unwrap()
}

/// A generous rate limit (never the one that refuses here) and `slots` in flight.
fn streams(name: &str, slots: u32, expiry: Duration) -> Policy {
    rated_streams(name, "100000/1m", slots, expiry)
}

/// A rate of `rate` and `slots` in flight, each slot expiring `expiry` after it was taken or
/// last renewed.
fn rated_streams(name: &str, rate: &str, slots: u32, expiry: Duration) -> Policy {
    Policy::new(name, [rate.parse().unwrap()])
        .unwrap()
        .concurrency(slots)
        .unwrap()
        .slot_expiry(expiry)
        .unwrap()
}

/// What the handlers saw: how many of their responses are streaming now, and the most at once.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    max: AtomicUsize,
}

/// Counts one response in flight until dropped (its stream ended or was dropped).
struct Streaming(Arc<InFlight>);

impl Streaming {
    fn start(seen: &Arc<InFlight>) -> Streaming {
        let now = seen.now.fetch_add(1, Ordering::SeqCst) + 1;
        seen.max.fetch_max(now, Ordering::SeqCst);
        Streaming(Arc::clone(seen))
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A handler that streams three chunks `gap` apart; it counts itself in flight from its call
/// until its body ends or is dropped.
fn streaming(
    seen: Arc<InFlight>,
    gap: Duration,
) -> impl Service<Request<()>, Response = Response<Body>, Error = Infallible> + Clone {
    service_fn(move |_: Request<()>| {
        let guard = Streaming::start(&seen);
        async move {
            let chunks = futures::stream::unfold((0, guard), move |(n, guard)| async move {
                if n == 3 {
                    return None;
                }
                tokio::time::sleep(gap).await;
                let frame: Frame = Ok(http_body::Frame::data(Bytes::from_static(b"token ")));
                Some((frame, (n + 1, guard)))
            });
            Ok::<_, Infallible>(Response::new(BodyExt::boxed(StreamBody::new(chunks))))
        }
    })
}

/// A handler whose body streams until the test drops it (or its sender).
fn endless() -> impl Service<
    Request<()>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Body>, Infallible>> + Send,
> + Clone {
    service_fn(|_: Request<()>| async {
        let (frames, rx) = futures::channel::mpsc::unbounded::<Frame>();
        // The sender lives as long as the body: nothing ends the stream but a drop.
        let body = StreamBody::new(rx.map(move |frame| {
            let _keep = &frames;
            frame
        }));
        Ok::<_, Infallible>(Response::new(BodyExt::boxed(body)))
    })
}

/// Fires `count` requests of one key at once across `services`, reading every admitted body to
/// its end; returns the statuses.
async fn fire<S>(services: &[S], key: &str, count: usize) -> Vec<StatusCode>
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let calls = (0..count).map(|i| {
        let service = services[i % services.len()].clone();
        async move {
            let response = service.oneshot(request(key)).await.unwrap();
            let status = response.status();
            response.into_body().collect().await.unwrap();
            status
        }
    });
    join_all(calls).await
}

/// `clients` clients spread over `services`, each asking for `key` again (after `pause` when
/// refused) until `until` requests have been admitted in all, reading every admitted body to
/// its end; returns every status.
async fn keep_asking<S>(
    services: &[S],
    key: &str,
    clients: usize,
    until: usize,
    pause: Duration,
) -> Vec<StatusCode>
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let admitted = AtomicUsize::new(0);
    let clients = (0..clients).map(|i| {
        let service = services[i % services.len()].clone();
        let admitted = &admitted;
        async move {
            let mut statuses = Vec::new();
            while admitted.load(Ordering::SeqCst) < until {
                let response = service.clone().oneshot(request(key)).await.unwrap();
                let status = response.status();
                response.into_body().collect().await.unwrap();
                if status == StatusCode::OK {
                    admitted.fetch_add(1, Ordering::SeqCst);
                } else {
                    tokio::time::sleep(pause).await;
                }
                statuses.push(status);
            }
            statuses
        }
    });
    join_all(clients).await.concat()
}

/// How many slots of `key` under `policy` Redis holds now (`ZCARD` of its slots set).
async fn slots_held(server: &RedisServer, key: &str, policy: &Policy) -> u64 {
    let store = server.store().await;
    let state = tower_redis_ratelimit::test_util::redis_key(&store, &Key::from(key), policy);
    let client = server.client().await;
    fred::interfaces::SortedSetsInterface::zcard(&client, format!("{state}:slots"))
        .await
        .unwrap()
}

/// Asserts the fleet's outcome: every request answered 200 or 429, at least `cap` admitted,
/// and never more than `cap` streaming at once.
fn check_fleet(statuses: &[StatusCode], seen: &InFlight, cap: usize, label: &str) {
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    let max = seen.max.load(Ordering::SeqCst);
    println!(
        "{label}: {} requests, {ok} admitted, {refused} refused, at most {max} in flight",
        statuses.len()
    );
    assert_eq!(ok + refused, statuses.len(), "{label}: {statuses:?}");
    assert!(ok >= cap, "{label}: only {ok} admitted");
    assert!(max <= cap, "{label}: {max} in flight at once, limit {cap}");
    assert_eq!(
        seen.now.load(Ordering::SeqCst),
        0,
        "{label}: a body still runs"
    );
}

/// Sends three requests of one key under a limit of 2 in flight: two are admitted and held,
/// the third is refused.
async fn fill_two<S>(service: &S) -> [Response<tower_redis_ratelimit::body::ResponseBody<Body>>; 3]
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let mut responses = Vec::new();
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let response = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), expected);
        responses.push(response);
    }
    responses.try_into().unwrap()
}

/// Polls `check` every 20 ms until it admits; how long that took.
async fn until_admitted<S>(service: &S, key: &str, within: Duration) -> Duration
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let started = tokio::time::Instant::now();
    loop {
        let response = service.clone().oneshot(request(key)).await.unwrap();
        if response.status() == StatusCode::OK {
            return started.elapsed();
        }
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(started.elapsed() < within, "still refused after {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A layer keyed by `x-api-key` deciding `policy` on a Redis store at `url`, refusing (503)
/// while Redis is out of reach.
async fn closed(url: &str, policy: Policy) -> RateLimitLayer<Header, RedisStore> {
    RateLimitLayer::builder()
        .key(api_key())
        .store(RedisStore::connect(url).await.unwrap())
        .policy(policy)
        .failure_mode(FailureMode::Closed)
        .build()
        .unwrap()
}

/// Stops the Redis of `server` for `seconds`: `DEBUG SLEEP` (`how` "sleep") or `SIGSTOP` then
/// `SIGCONT` ("stop"); returns when it answers again.
async fn stop_redis(server: &RedisServer, how: &str, seconds: f64) {
    match how {
        "sleep" => {
            let port = server.port();
            let seconds = seconds.to_string();
            tokio::task::spawn_blocking(move || {
                crate::support::cluster::cli(port, &["DEBUG", "SLEEP", &seconds]);
            })
            .await
            .unwrap();
        }
        _ => {
            server.signal("-STOP");
            tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
            server.signal("-CONT");
        }
    }
}
