//! The outbound layer against a real Redis and a local stand-in for a third-party API that
//! allows 10 requests per second (any second) and answers 429 beyond: workers, each with a
//! store of its own, share the API's limit through Redis.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::IntoResponse;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::client::{Outbound, OutboundLayer};
use tower_redis_ratelimit::key::Global;
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{Algorithm, Policy, RedisStore};

/// What the stand-in saw: when each request arrived, whether it was refused, and the number
/// its caller gave it (`?n=`; 0 without).
pub(crate) type Arrivals = Arc<Mutex<Vec<(Instant, bool, u64)>>>;

/// The stand-in: 10 per second over any second; beyond, 429 with `Retry-After: 1`. With
/// `refuse`, the request that arrives `refuse`-th (from 1) is refused with `Retry-After: 2`,
/// once, as an upstream that pushes back does.
async fn stand_in(refuse: Option<usize>) -> (SocketAddr, Arrivals) {
    stand_in_of(10, refuse).await
}

/// The stand-in, allowing `count` requests over any second.
pub(crate) async fn stand_in_of(count: usize, refuse: Option<usize>) -> (SocketAddr, Arrivals) {
    let arrivals: Arrivals = Arc::default();
    let seen = arrivals.clone();
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move |query: axum::extract::RawQuery| {
            let seen = seen.clone();
            async move {
                let now = Instant::now();
                let n = query.0.and_then(|q| q.strip_prefix("n=")?.parse().ok());
                let n = n.unwrap_or(0);
                let mut seen = seen.lock().unwrap();
                let served = seen.iter().filter(|&&(_, refused, _)| !refused);
                let last_second = served.filter(|&&(t, _, _)| t + Duration::from_secs(1) > now);
                if last_second.count() >= count {
                    seen.push((now, true, n));
                    return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]).into_response();
                }
                if refuse == Some(seen.len() + 1) {
                    seen.push((now, true, n));
                    return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2")]).into_response();
                }
                seen.push((now, false, n));
                StatusCode::OK.into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, arrivals)
}

/// 10 per second, and one per 50 ms (100 ms with the layer's 50 ms margin): turns spaced, so
/// that a worker served asks again behind the others (with 10 turns at one instant, whoever
/// answers first takes more of them).
fn policy() -> Policy {
    let limits = ["10/1s".parse().unwrap(), "1/50ms".parse().unwrap()];
    Policy::new("api", limits)
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

pub(crate) type Http = Client<HttpConnector, Empty<Bytes>>;

/// A worker's client: a hyper client behind an outbound layer with a store of its own.
async fn worker(server: &crate::support::RedisServer) -> Outbound<Http, Global, RedisStore> {
    let layer = OutboundLayer::builder()
        .policy(policy())
        .store(server.store().await)
        .max_wait(Duration::from_secs(30))
        .build()
        .unwrap();
    let http = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    ServiceBuilder::new().layer(layer).service(http)
}

/// One call to the stand-in: whether it was refused.
async fn call(client: Outbound<Http, Global, RedisStore>, addr: SocketAddr) -> bool {
    numbered(client, addr, 0).await
}

/// One call to the stand-in, numbered `n`: whether it was refused.
pub(crate) async fn numbered(
    mut client: Outbound<Http, Global, RedisStore>,
    addr: SocketAddr,
    n: u64,
) -> bool {
    let request = http::Request::get(format!("http://{addr}/?n={n}"))
        .body(Empty::new())
        .unwrap();
    let response = client.ready().await.unwrap().call(request).await;
    response.unwrap().status() == StatusCode::TOO_MANY_REQUESTS
}

/// The most requests the stand-in served in any second (checked at every arrival).
pub(crate) fn fullest(arrivals: &[(Instant, bool, u64)]) -> usize {
    let served: Vec<Instant> = arrivals.iter().filter(|a| !a.1).map(|a| a.0).collect();
    let in_second = |t: Instant| {
        served
            .iter()
            .filter(|&&s| s <= t && s + Duration::from_secs(1) > t)
            .count()
    };
    served.iter().map(|&t| in_second(t)).max().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_share_the_upstream_limit_through_redis() {
    let server = crate::support::RedisServer::start();
    let (addr, arrivals) = stand_in(None).await;
    let start = Instant::now();
    let mut workers = Vec::new();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(1));
    for _ in 0..4 {
        let (client, next) = (worker(&server).await, next.clone());
        workers.push(tokio::spawn(async move {
            let (mut refused, mut sent) = (0, Vec::new());
            for _ in 0..30 {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                sent.push((n, Instant::now()));
                refused += usize::from(numbered(client.clone(), addr, n).await);
            }
            (Instant::now(), refused, sent)
        }));
    }
    let (mut finished, mut refused, mut sent) = (Vec::new(), 0, Vec::new());
    for worker in workers {
        let (at, r, s) = worker.await.unwrap();
        finished.push(at);
        refused += r;
        sent.extend(s);
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let took = *finished.iter().max().unwrap() - start;
    let spread = *finished.iter().max().unwrap() - *finished.iter().min().unwrap();
    let fullest = fullest(&arrivals);
    eprintln!(
        "{} served, {refused} refused by the stand-in; the fullest second held {fullest}; the run \
         took {took:?}, the workers finished {spread:?} apart",
        arrivals.len()
    );
    assert_eq!(refused, 0, "the stand-in refused {refused}");
    assert_eq!(arrivals.len(), 120);
    assert!(fullest <= 10, "{fullest} in one second");
    // Ten at 0 s, 1 s, ..., 11 s: 12 s of the API's budget for 120 calls.
    assert!(took <= Duration::from_secs(12).mul_f64(1.15), "{took:?}");
    assert!(spread <= Duration::from_secs(1), "{spread:?}");
    // Arrival order follows reservation order: a call handed to its layer 50 ms (far more than
    // its reservation takes) before another has reserved first, so its turn is no later, and
    // it leaves within the margin (50 ms) of its turn: it arrives no later than the margin
    // after the other. (Calls whose turns share an instant, a window's burst, race within it.)
    let margin = Duration::from_millis(50);
    let arrived = |n: u64| arrivals.iter().find(|a| a.2 == n).map(|a| a.0).unwrap();
    let ordered: Vec<_> = sent
        .iter()
        .flat_map(|a| sent.iter().map(move |b| (a, b)))
        .filter(|(a, b)| a.1 + Duration::from_millis(50) < b.1)
        .collect();
    let behind = |(a, b): &&(&(u64, Instant), &(u64, Instant))| {
        arrived(a.0).saturating_duration_since(arrived(b.0))
    };
    let most_behind = ordered.iter().map(|p| behind(&p)).max().unwrap_or_default();
    let overtaken = ordered.iter().filter(|p| behind(p) > margin).count();
    eprintln!(
        "{overtaken} of {} ordered pairs overtaken by more than the margin; the most: {most_behind:?}",
        ordered.len()
    );
    assert_eq!(
        overtaken, 0,
        "calls that arrived before one reserved earlier"
    );
}

/// Four workers send 15 calls each at once; half of those still waiting are cancelled. The
/// rest go at the full rate (those behind a cancelled call move up), and nothing is left in
/// the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_half_of_the_waiting_calls_keeps_the_rest_at_the_full_rate_on_redis() {
    let server = crate::support::RedisServer::start();
    let (addr, arrivals) = stand_in(None).await;
    let mut calls = Vec::new();
    let mut stores = Vec::new();
    for _ in 0..4 {
        let client = worker(&server).await;
        stores.push(client.clone());
        for _ in 0..15 {
            calls.push(tokio::spawn(call(client.clone(), addr)));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cancelled_at = Instant::now();
    let mut kept = Vec::new();
    let mut cancelled = 0;
    for (n, call) in calls.into_iter().enumerate() {
        match n % 2 == 1 && !call.is_finished() {
            true => {
                call.abort();
                cancelled += 1;
            }
            false => kept.push(call),
        }
    }
    let mut refused = 0;
    for call in kept {
        refused += usize::from(call.await.unwrap());
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let after: Vec<Instant> = arrivals
        .iter()
        .map(|a| a.0)
        .filter(|&t| t > cancelled_at)
        .collect();
    let span = (*after.iter().max().unwrap() - cancelled_at).as_secs_f64();
    let rate = after.len() as f64 / span;
    let fullest = fullest(&arrivals);
    eprintln!(
        "{cancelled} cancelled; {} calls after, at {rate:.2} per second; {refused} refused; the \
         fullest second held {fullest}",
        after.len()
    );
    assert_eq!(refused, 0);
    assert!(fullest <= 10, "{fullest} in one second");
    // At the full rate the 27 or so calls left take the bursts of the next three windows (about
    // 10 per second); with the cancelled calls' turns kept, half of those turns would go unused
    // (about 5 per second).
    assert!(rate >= 8.0, "{rate:.2} per second after the cancellations");
    // Nothing is left in the line: every reservation went out or left (a change to the line
    // that fails is sent again every 100 ms).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let policy = policy();
    let key = tower_redis_ratelimit::Key::from("global");
    let turns = format!("{}:line", redis_key(&server.store().await, &key, &policy));
    let left =
        crate::support::cluster::cli(server.port(), &["ZRANGE", &turns, "0", "-1", "WITHSCORES"]);
    let time = crate::support::cluster::cli(server.port(), &["TIME"]);
    assert!(
        left.trim().is_empty(),
        "left in line: {left}; Redis TIME {time}"
    );
}

/// The stand-in answers its 15th request `429` with `Retry-After: 2`: no worker sends
/// anything for 2 s after it, then all resume and every call is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_429_pauses_every_worker_for_its_retry_after_on_redis() {
    let server = crate::support::RedisServer::start();
    let (addr, arrivals) = stand_in(Some(15)).await;
    let mut workers = Vec::new();
    for _ in 0..4 {
        let client = worker(&server).await;
        workers.push(tokio::spawn(async move {
            let mut refused = 0;
            for _ in 0..8 {
                refused += usize::from(call(client.clone(), addr).await);
            }
            refused
        }));
    }
    let mut refused = 0;
    for worker in workers {
        refused += worker.await.unwrap();
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let refusal = arrivals[14].0;
    let during: Vec<f64> = arrivals
        .iter()
        .filter(|a| a.0 > refusal && a.0 < refusal + Duration::from_secs(2))
        .map(|a| (a.0 - refusal).as_secs_f64())
        .collect();
    let resumed = arrivals.iter().map(|a| a.0).find(|&t| t > refusal);
    eprintln!(
        "{refused} refused; sent during the pause: {during:?}; resumed {:?} after the 429",
        resumed.map(|t| t - refusal)
    );
    assert_eq!(refused, 1, "only the one the stand-in pushed back with");
    assert!(during.is_empty(), "sent during the pause: {during:?}");
    assert_eq!(arrivals.len(), 32);
}

/// An upstream in the test's process for the tests of Redis failures and instances set up
/// apart: it records when each request arrives.
type Recorded = Arc<Mutex<Vec<Instant>>>;
type Upstream =
    tower::util::BoxCloneService<http::Request<()>, http::Response<()>, std::convert::Infallible>;

fn recorder(arrivals: Recorded) -> Upstream {
    tower::util::BoxCloneService::new(tower::service_fn(move |_: http::Request<()>| {
        let arrivals = arrivals.clone();
        async move {
            arrivals.lock().unwrap().push(Instant::now());
            Ok(http::Response::new(()))
        }
    }))
}

/// An instance of the fleet: a store of its own, looking every `recheck`.
async fn instance(
    server: &crate::support::RedisServer,
    policy: &Policy,
    upstream: Upstream,
    recheck: Duration,
) -> Outbound<Upstream, Global, RedisStore> {
    let layer = OutboundLayer::builder()
        .policy(policy.clone())
        .store(server.store().await)
        .max_wait(Duration::from_secs(60))
        .recheck(recheck)
        .build()
        .unwrap();
    ServiceBuilder::new().layer(layer).service(upstream)
}

/// The most arrivals in any window of `window` ending at an arrival.
fn most_within(arrivals: &[Instant], window: Duration) -> usize {
    let within = |t: Instant| {
        arrivals
            .iter()
            .filter(|&&s| s <= t && s + window > t)
            .count()
    };
    arrivals.iter().map(|&t| within(t)).max().unwrap_or(0)
}

/// Redis loses its data (`FLUSHALL`, as a restart without persistence) while calls wait:
/// they learn at their next look that their reservations are gone, and reserve again, rather
/// than going at turns nobody counts. The calls that went before the loss are forgotten with
/// it (as for decisions); from the loss on, every second holds at most the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_whose_reservations_redis_lost_reserve_again() {
    let server = crate::support::RedisServer::start();
    let arrivals: Recorded = Arc::default();
    let policy = Policy::new("api", ["5/1s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let mut clients = Vec::new();
    for _ in 0..3 {
        let upstream = recorder(arrivals.clone());
        clients.push(instance(&server, &policy, upstream, Duration::from_millis(100)).await);
    }
    let call = |client: Outbound<Upstream, Global, RedisStore>| {
        tokio::spawn(client.oneshot(http::Request::new(())))
    };
    let start = Instant::now();
    let mut calls: Vec<_> = (0..15).map(|i| call(clients[i % 3].clone())).collect();
    tokio::time::sleep_until(start + Duration::from_millis(1500)).await;
    crate::support::cluster::cli(server.port(), &["FLUSHALL"]);
    let lost = Instant::now();
    calls.extend((0..5).map(|i| call(clients[i % 3].clone())));
    for call in calls {
        call.await.unwrap().unwrap();
    }
    let after: Vec<Instant> = arrivals
        .lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|&t| t > lost)
        .collect();
    let most = most_within(&after, Duration::from_secs(1));
    eprintln!(
        "{} calls after the loss; at most {most} in any second",
        after.len()
    );
    assert!(most <= 5, "{most} in one second after the loss");
}

/// Redis stalls (`DEBUG SLEEP 0.6`) while turns come: a call whose look at its turn is
/// answered later than its margin reserves again rather than going late, and one that cannot
/// reserve fails with the store's error; no second and no 50 ms holds more than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_at_the_turn_sends_nothing_late() {
    let server = crate::support::RedisServer::start_with(&["--enable-debug-command", "local"]);
    let arrivals: Recorded = Arc::default();
    let mut clients = Vec::new();
    for _ in 0..3 {
        let upstream = recorder(arrivals.clone());
        clients.push(instance(&server, &policy(), upstream, Duration::from_millis(100)).await);
    }
    let start = Instant::now();
    let calls: Vec<_> = (0..30)
        .map(|i| tokio::spawn(clients[i % 3].clone().oneshot(http::Request::new(()))))
        .collect();
    tokio::time::sleep_until(start + Duration::from_millis(1200)).await;
    let port = server.port();
    tokio::task::spawn_blocking(move || {
        crate::support::cluster::cli(port, &["DEBUG", "SLEEP", "0.6"])
    })
    .await
    .unwrap();
    let mut failed = 0;
    for call in calls {
        failed += usize::from(call.await.unwrap().is_err());
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let most = most_within(&arrivals, Duration::from_secs(1));
    let close = most_within(&arrivals, Duration::from_millis(50));
    eprintln!(
        "{} sent, {failed} failed; at most {most} in a second, {close} in 50 ms",
        arrivals.len()
    );
    assert!(most <= 10, "{most} in one second");
    assert!(close <= 1, "{close} within 50 ms");
}

/// Instances set up apart: one looks only every 5 s. Calls of another leave the line: the
/// slow instance's calls are moved up only into places at least their own notice away (5 s
/// and the margin), so they never go at a place another call has taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_looks_seldom_is_not_moved_into_places_it_would_miss() {
    let server = crate::support::RedisServer::start();
    let arrivals: Recorded = Arc::default();
    let (fast, slow) = (Duration::from_millis(100), Duration::from_secs(5));
    let mut clients = Vec::new();
    for recheck in [fast, slow, fast] {
        let upstream = recorder(arrivals.clone());
        clients.push(instance(&server, &policy(), upstream, recheck).await);
    }
    let start = Instant::now();
    let mut calls = Vec::new();
    for i in 0..45 {
        let call = clients[i % 3].clone().oneshot(http::Request::new(()));
        calls.push((i, tokio::spawn(call)));
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    tokio::time::sleep_until(start + Duration::from_millis(600)).await;
    let mut kept = Vec::new();
    for (i, call) in calls {
        // Instance 0 cancels every other call of its own still waiting.
        match i % 3 == 0 && i % 2 == 0 && !call.is_finished() {
            true => call.abort(),
            false => kept.push(call),
        }
    }
    for call in kept {
        call.await.unwrap().unwrap();
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let close = most_within(&arrivals, Duration::from_millis(50));
    let most = most_within(&arrivals, Duration::from_secs(1));
    eprintln!("at most {most} in a second, {close} in 50 ms");
    assert!(close <= 1, "{close} within 50 ms");
    assert!(most <= 10, "{most} in one second");
}

/// A reservation whose answer is lost (Redis stalls past the reservation's own time budget,
/// its `max_wait` of 300 ms, then runs it): the call fails with the store's error, and the
/// reservation the store may have made leaves the line once Redis answers, rather than holding
/// its place and units for nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_whose_answer_is_lost_leaves_the_line() {
    let server = crate::support::RedisServer::start_with(&["--enable-debug-command", "local"]);
    let arrivals: Recorded = Arc::default();
    let layer = OutboundLayer::builder()
        .policy(policy())
        .store(server.store().await)
        .max_wait(Duration::from_millis(300))
        .recheck(Duration::from_millis(100))
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layer)
        .service(recorder(arrivals));
    let port = server.port();
    let stall = tokio::task::spawn_blocking(move || {
        crate::support::cluster::cli(port, &["DEBUG", "SLEEP", "0.6"]);
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let got = client.oneshot(http::Request::new(())).await;
    assert!(
        matches!(
            got,
            Err(tower_redis_ratelimit::client::OutboundError::Store(_))
        ),
        "{got:?}"
    );
    stall.await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let key = tower_redis_ratelimit::Key::from("global");
    let turns = format!("{}:line", redis_key(&server.store().await, &key, &policy()));
    let left = crate::support::cluster::cli(port, &["ZCARD", &turns]);
    assert_eq!(left.trim(), "0", "reservations left in line");
}
