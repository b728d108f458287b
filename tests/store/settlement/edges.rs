//! Usage at the edges: a refusal by one layer charged to another, a refund racing the deny
//! cache, settles outlasting a paused Redis, and settles still under way at shutdown.
//!
//! Redis is paused with SIGSTOP/SIGCONT of the test's own `redis-server`, so that what is
//! under way while it is paused is known exactly. One metrics recorder serves the whole
//! binary (`support::metrics`), so each test uses its own policy name.

use std::convert::Infallible;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::support::{evalsha_calls, RedisServer};
use bytes::Bytes;
use futures::future::join_all;
use futures::StreamExt;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_redis_ratelimit::blocklist::{Blocklist, BlocklistLayer};
use tower_redis_ratelimit::key::Header;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::usage::{Usage, UsageReport};
use tower_redis_ratelimit::{Global, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, Store};

type Body = BoxBody<Bytes, Infallible>;
type Frames = futures::channel::mpsc::UnboundedSender<Result<http_body::Frame<Bytes>, Infallible>>;

fn policy(name: &str, text: &str) -> Policy {
    text.parse::<Policy>().unwrap().named(name).unwrap()
}

/// `1000/1d` in fixed windows: exact figures on Redis's real clock, unless a test runs across
/// midnight UTC. (Not the sliding log: requests batched into one script call share one
/// admission time, and a refund lightens only the last event at its admission time.)
fn daily(name: &str) -> Policy {
    policy(name, "1000/1d").with_algorithm(tower_redis_ratelimit::Algorithm::FixedWindow)
}

fn request(key: &str) -> Request<()> {
    Request::builder()
        .header("x-api-key", key)
        .body(())
        .unwrap()
}

fn api_key() -> Header {
    Header::new(HeaderName::from_static("x-api-key"))
}

fn memory() -> MemoryStore {
    let clock = ManualClock::from(SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 30));
    MemoryStore::builder().clock(clock).build()
}

/// A handler that answers at once with a short body and reports `usage` (if any).
fn handler(
    usage: Option<u64>,
) -> impl Service<Request<()>, Response = Response<Body>, Error = Infallible> + Clone {
    service_fn(move |_: Request<()>| async move {
        let mut response = Response::new(Full::new(Bytes::from_static(b"ok")).boxed());
        if let Some(units) = usage {
            response.extensions_mut().insert(Usage(units));
        }
        Ok::<_, Infallible>(response)
    })
}

/// A handler that reports `usage` in its head and streams a body the test ends (by dropping
/// the sender it is handed through `senders`).
fn streaming(
    usage: u64,
    senders: futures::channel::mpsc::UnboundedSender<Frames>,
) -> impl Service<Request<()>, Response = Response<Body>, Error = Infallible> + Clone {
    service_fn(move |_: Request<()>| {
        let senders = senders.clone();
        async move {
            let (frames, rx) = futures::channel::mpsc::unbounded();
            senders.unbounded_send(frames).unwrap();
            let mut response = Response::new(BodyExt::boxed(StreamBody::new(rx)));
            response.extensions_mut().insert(Usage(usage));
            Ok::<_, Infallible>(response)
        }
    })
}

/// The units left under `policy` for `key`.
async fn remaining<St: Store>(store: &St, key: &str, policy: &Policy) -> u64 {
    let decision = store.peek(&Key::from(key), policy, 0).await.unwrap();
    decision.remaining()
}

/// `ratelimit_settle_errors_total` of `policy`; `None` without the `metrics` feature.
fn settle_errors(policy: &str) -> Option<u64> {
    #[cfg(feature = "metrics")]
    {
        use crate::support::metrics::{prometheus, sample};
        let series = format!("ratelimit_settle_errors_total{{policy=\"{policy}\"}}");
        let value = sample(&prometheus().render(), &series).map_or(0, |value| value as u64);
        Some(value)
    }
    #[cfg(not(feature = "metrics"))]
    {
        let _ = policy;
        None
    }
}

/// The test's own `redis-server`, stopped (SIGSTOP) until [`Paused::resume`] or drop.
struct Paused(u32);

impl Paused {
    async fn pause(server: &RedisServer) -> Paused {
        use fred::prelude::*;
        let client = server.client().await;
        let info: String = client
            .info(Some(fred::types::InfoKind::Server))
            .await
            .unwrap();
        let pid = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|pid| pid.trim().parse().ok())
            .expect("redis-server's pid");
        signal(pid, "-STOP");
        Paused(pid)
    }

    fn resume(self) {}
}

impl Drop for Paused {
    fn drop(&mut self) {
        signal(self.0, "-CONT");
    }
}

fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {signal} {pid}");
}

/// Point 5: an outer `Global 10000/1m` layer reserving 100 around an inner per-key `1/1m`
/// layer (with a deny cache, so that refusals are repeated from it). One key sends 120
/// requests: the first is admitted by both and charged its reservation outside, the others
/// are refused inside and cost the outer layer nothing, so a fresh key is admitted.
#[tokio::test(start_paused = true)]
async fn a_refusal_inside_costs_the_outer_layer_nothing() {
    let outer_policy = policy("outer", "10000/1m");
    let (outer_store, inner_store) = (memory(), memory());
    let outer = RateLimitLayer::builder()
        .key(Global)
        .policy(outer_policy.clone())
        .store(outer_store.clone())
        .usage(UsageReport::new().reserve(100))
        .build()
        .unwrap();
    let inner = RateLimitLayer::builder()
        .key(api_key())
        .policy(policy("inner", "1/1m"))
        .store(inner_store)
        .deny_cache(1000)
        .build()
        .unwrap();
    let service = outer.layer(inner.layer(handler(None)));
    let mut statuses = Vec::new();
    for _ in 0..120 {
        let response = service.clone().oneshot(request("busy")).await.unwrap();
        statuses.push(response.status());
        drop(response.into_body().collect().await.unwrap());
    }
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((statuses[0], refused), (StatusCode::OK, 119));
    let left = remaining(&outer_store, "global", &outer_policy).await;
    println!("outer budget left after 120 requests of one key: {left}");
    assert_eq!(left, 10000 - 100, "only the admitted request is charged");
    let fresh = service.clone().oneshot(request("fresh")).await.unwrap();
    assert_eq!(fresh.status(), 200, "a fresh key is admitted");
}

/// Point 5, with the blocklist inside and Redis outside: a blocked client's 403 gives the
/// outer layer's reservation back in full.
#[tokio::test]
async fn a_blocked_request_costs_the_outer_layer_nothing() {
    let server = RedisServer::start();
    let store = server.store().await;
    let blocklist = Blocklist::builder(&store).build().await.unwrap();
    blocklist.add(&[Key::from("blocked")]).await.unwrap();
    let outer_policy = policy("outer-blocklist", "10000/1m");
    let outer = RateLimitLayer::builder()
        .key(Global)
        .policy(outer_policy.clone())
        .store(store.clone())
        .usage(UsageReport::new().reserve(100))
        .build()
        .unwrap();
    let service = outer
        .clone()
        .layer(BlocklistLayer::new(blocklist, api_key()).layer(handler(None)));
    for _ in 0..5 {
        let response = service.clone().oneshot(request("blocked")).await.unwrap();
        assert_eq!(response.status(), 403);
        drop(response.into_body().collect().await.unwrap());
    }
    assert_eq!(outer.settled(Duration::from_secs(5)).await, 0);
    let left = remaining(&store, "global", &outer_policy).await;
    println!("outer budget left after 5 blocked requests: {left}");
    assert_eq!(left, 10000);
}

/// Point 6: `150/1m`, reserving 100. A holds 100 with its body open; B is decided by Redis
/// (refused: 100 + 100 > 150) and its reply waits unread; A ends having used 10, and its
/// refund of 90 lands; then B's refusal comes in. It must not be cached: C, with 140 units
/// free, is admitted at once instead of being refused from the cache until B's retry-after.
#[tokio::test]
async fn a_refusal_decided_before_a_refund_is_not_cached_after_it() {
    let server = RedisServer::start();
    let store = server.store().await;
    let client = server.client().await;
    let policy = policy("refund-race", "150/1m");
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .policy(policy.clone())
        .store(store.clone())
        .usage(UsageReport::new().reserve(100))
        .build()
        .unwrap();
    let (senders, mut bodies) = futures::channel::mpsc::unbounded();
    let service = layer.clone().layer(streaming(10, senders));

    let a = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(a.status(), 200);
    let a_frames = bodies.next().await.unwrap();

    let calls = evalsha_calls(&client).await;
    let mut b = std::pin::pin!(service.clone().oneshot(request("k")));
    assert!(futures::poll!(b.as_mut()).is_pending(), "B waits for Redis");
    // B's decision has run in Redis once its call is counted; its reply is not read yet.
    while evalsha_calls(&client).await < calls + 1 {
        tokio::task::yield_now().await;
    }

    drop(a_frames);
    drop(a.into_body().collect().await.unwrap());
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    assert_eq!(remaining(&store, "k", &policy).await, 140);

    let b = b.await.unwrap();
    assert_eq!(b.status(), 429, "B was decided before the refund");
    let c = service.clone().oneshot(request("k")).await.unwrap();
    println!("C after the refund landed: {}", c.status());
    assert_eq!(c.status(), 200, "140 units are free");
}

/// Point 7, failures counted exactly: Redis is paused for 0.8 s (over three time budgets)
/// while 20 settles are under way. They wait for their replies, land when it resumes, and
/// none is reported lost; whatever is reported lost must be exactly what Redis lacks.
#[tokio::test]
async fn settles_outlast_a_paused_redis_and_only_losses_count() {
    const REQUESTS: u64 = 20;
    let server = RedisServer::start();
    let store = server.store().await;
    let name = "paused-settles";
    let before = settle_errors(name);
    let policy = daily(name);
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .policy(policy.clone())
        .store(store.clone())
        .usage(UsageReport::new().reserve(10))
        .build()
        .unwrap();
    let (senders, bodies) = futures::channel::mpsc::unbounded();
    let service = layer.clone().layer(streaming(2, senders));
    let responses = join_all((0..REQUESTS).map(|_| service.clone().oneshot(request("k")))).await;
    let frames: Vec<Frames> = bodies.take(REQUESTS as usize).collect().await;
    assert_eq!(remaining(&store, "k", &policy).await, 1000 - 10 * REQUESTS);

    let paused = Paused::pause(&server).await;
    let started = tokio::time::Instant::now();
    drop(frames);
    for response in responses {
        drop(response.unwrap().into_body().collect().await.unwrap());
    }
    let waiting = layer.settled(Duration::from_millis(500)).await;
    tokio::time::sleep_until(started + Duration::from_millis(800)).await;
    paused.resume();
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);

    let recorded = 1000 - remaining(&store, "k", &policy).await;
    let applied = (10 * REQUESTS - recorded) / 8;
    let lost = settle_errors(name)
        .zip(before)
        .map(|(now, before)| now - before);
    println!(
        "under way while paused: {waiting}; refunds applied: {applied}/{REQUESTS}; reported lost: {lost:?}"
    );
    assert_eq!(waiting, REQUESTS as usize, "settles wait for their replies");
    assert_eq!(applied, REQUESTS);
    if let Some(lost) = lost {
        assert_eq!(
            lost,
            REQUESTS - applied,
            "only settles that did not land count"
        );
    }
}

/// Sends `requests` concurrent streaming requests (reserving 10, using 2 each) through a
/// usage layer on `server`, pauses Redis, and ends every stream: their refunds are then under
/// way. Returns the layer (a clone went into the service) and the pause.
async fn end_streams_while_paused(
    server: &RedisServer,
    policy: Policy,
    requests: u64,
) -> (RateLimitLayer<Header, RedisStore>, Paused) {
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .policy(policy)
        .store(server.store().await)
        .usage(UsageReport::new().reserve(10))
        .build()
        .unwrap();
    let (senders, bodies) = futures::channel::mpsc::unbounded();
    let service = layer.clone().layer(streaming(2, senders));
    let responses = join_all((0..requests).map(|_| service.clone().oneshot(request("k")))).await;
    let frames: Vec<Frames> = bodies.take(requests as usize).collect().await;
    let paused = Paused::pause(server).await;
    drop(frames);
    join_all(responses.into_iter().map(|response| async move {
        response.unwrap().into_body().collect().await.unwrap();
    }))
    .await;
    (layer, paused)
}

/// Point 7, shutdown: 100 concurrent requests end while Redis is paused, so their settles
/// are under way; `settled` on the layer (a clone went into the service) reports them, then
/// waits for them once Redis resumes; the runtime is dropped after, and nothing is lost.
#[test]
fn settled_waits_for_the_settles_under_way_before_shutdown() {
    const REQUESTS: u64 = 100;
    let server = RedisServer::start();
    let name = "shutdown-settles";
    let before = settle_errors(name);
    let policy = daily(name);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (waiting, left) = runtime.block_on(async {
        let (layer, paused) = end_streams_while_paused(&server, policy.clone(), REQUESTS).await;
        let waiting = layer.settled(Duration::from_millis(200)).await;
        paused.resume();
        let left = layer.settled(Duration::from_secs(5)).await;
        (waiting, left)
    });
    drop(runtime);
    let recorded = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = server.store().await;
        1000 - remaining(&store, "k", &policy).await
    });
    println!(
        "under way at shutdown: {waiting}; left after settled(): {left}; recorded: {recorded}"
    );
    assert_eq!(waiting, REQUESTS as usize);
    assert_eq!(left, 0);
    assert_eq!(recorded, 2 * REQUESTS, "every refund landed");
    if let Some((now, before)) = settle_errors(name).zip(before) {
        assert_eq!(now - before, 0, "nothing lost");
    }
}

/// Point 7, no silent loss: settles still under way when the runtime is dropped are
/// reported (they may or may not reach Redis, which was paused then).
#[test]
fn settles_abandoned_at_shutdown_are_counted() {
    const REQUESTS: u64 = 10;
    let server = RedisServer::start();
    let name = "abandoned-settles";
    let before = settle_errors(name);
    let abandoned = Arc::new(AtomicU64::new(0));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let paused = runtime.block_on(async {
        let (layer, paused) = end_streams_while_paused(&server, daily(name), REQUESTS).await;
        abandoned.store(
            layer.settled(Duration::from_millis(100)).await as u64,
            Ordering::Relaxed,
        );
        paused
    });
    drop(runtime);
    paused.resume();
    let under_way = abandoned.load(Ordering::Relaxed);
    let counted = settle_errors(name)
        .zip(before)
        .map(|(now, before)| now - before);
    println!("under way when the runtime was dropped: {under_way}; counted: {counted:?}");
    assert_eq!(under_way, REQUESTS);
    if let Some(counted) = counted {
        assert_eq!(counted, REQUESTS, "each abandoned settle is counted");
    }
}
