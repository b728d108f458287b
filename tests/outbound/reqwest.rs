//! Beyond hyper: reqwest calls through `OutboundMiddleware` against a real Redis and a local
//! stand-in that counts arrivals in a true sliding window, and `Turns`, the plain async wait
//! for a turn, on the memory store and tokio's paused clock.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::IntoResponse;
use http::StatusCode;
use tokio::time::Instant;
use tower_redis_ratelimit::client::{OutboundLayer, Turns};
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, RedisStore};

use crate::support::delay::Delay;
use crate::support::RedisServer;

/// When each request reached the stand-in, and whether it was refused.
type Arrivals = Arc<Mutex<Vec<(Instant, bool)>>>;

/// The stand-in for a third-party API: 10 requests in any second (a true sliding window over
/// the requests it served), `429` with `Retry-After: 1` beyond. With `refuse`, the request
/// that arrives `refuse`-th (from 1) is refused with `Retry-After: 1`, as an upstream that
/// pushes back does.
async fn stand_in(refuse: Option<usize>) -> (SocketAddr, Arrivals) {
    let arrivals: Arrivals = Arc::default();
    let seen = arrivals.clone();
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let seen = seen.clone();
            async move {
                let now = Instant::now();
                let mut seen = seen.lock().unwrap();
                let second = Duration::from_secs(1);
                let served = seen
                    .iter()
                    .filter(|&&(t, refused)| !refused && t + second > now);
                let refused = served.count() >= 10 || refuse == Some(seen.len() + 1);
                seen.push((now, refused));
                match refused {
                    true => (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]).into_response(),
                    false => StatusCode::OK.into_response(),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, arrivals)
}

/// The most requests the stand-in served in any second (checked at every arrival).
fn fullest(arrivals: &[(Instant, bool)]) -> usize {
    let served: Vec<Instant> = arrivals.iter().filter(|a| !a.1).map(|a| a.0).collect();
    let in_second = |t: Instant| {
        let window = |&&s: &&Instant| s <= t && s + Duration::from_secs(1) > t;
        served.iter().filter(window).count()
    };
    served.iter().map(|&t| in_second(t)).max().unwrap_or(0)
}

fn ten_per_second() -> Policy {
    "10/1s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

/// An instance's reqwest client: its own `RedisStore` at `url`, an outbound layer's turns as
/// the middleware (one key for every request), no proxy (the stand-in is on loopback).
async fn instance(url: &str) -> reqwest_middleware::ClientWithMiddleware {
    let layer = OutboundLayer::builder()
        .policy(ten_per_second())
        .store(RedisStore::connect(url).await.unwrap())
        .max_wait(Duration::from_secs(30))
        .build()
        .unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    reqwest_middleware::ClientBuilder::new(http)
        .with(layer.middleware())
        .build()
}

/// Sends `n` requests to `addr` at once on `client`; their statuses, or how each failed.
fn at_once(
    client: &reqwest_middleware::ClientWithMiddleware,
    addr: SocketAddr,
    n: usize,
) -> Vec<tokio::task::JoinHandle<Result<StatusCode, String>>> {
    (0..n)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                let sent = client.get(format!("http://{addr}/")).send().await;
                sent.map(|r| r.status()).map_err(|e| format!("{e:#}"))
            })
        })
        .collect()
}

/// Sends 15 requests at once on each of `a` and `b`, 30 for a stand-in of 10 per second, and
/// checks that every request waited for its turn rather than fail, that none was refused, and
/// that the stand-in never held more than 10 in a second; how long they took.
async fn thirty_at_once(
    (a, b): (
        reqwest_middleware::ClientWithMiddleware,
        reqwest_middleware::ClientWithMiddleware,
    ),
    (addr, arrivals): (SocketAddr, Arrivals),
) -> Duration {
    let start = Instant::now();
    let mut calls = at_once(&a, addr, 15);
    calls.extend(at_once(&b, addr, 15));
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap());
    }
    let took = start.elapsed();
    let arrivals = arrivals.lock().unwrap().clone();
    let refused = arrivals.iter().filter(|a| a.1).count();
    let fullest = fullest(&arrivals);
    eprintln!(
        "30 reqwest calls from 2 instances: {} arrived, {refused} refused, at most {fullest} in \
         a second, {took:?}",
        arrivals.len()
    );
    let failed: Vec<_> = statuses.iter().filter(|s| s.is_err()).collect();
    assert!(
        failed.is_empty(),
        "calls failed instead of waiting: {failed:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == Ok(StatusCode::OK)),
        "{statuses:?}"
    );
    assert_eq!((arrivals.len(), refused), (30, 0));
    assert!(fullest <= 10, "{fullest} in one second");
    took
}

/// Two instances, each with its own `RedisStore`, send 15 requests each at once, 30 for an API
/// of 10 per second: every request waits for its turn rather than fail, none is refused,
/// and the stand-in never holds more than 10 in a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqwest_calls_wait_for_their_turns_and_none_is_refused() {
    let server = RedisServer::start();
    let clients = (instance(&server.url()).await, instance(&server.url()).await);
    let took = thirty_at_once(clients, stand_in(None).await).await;
    // Ten at 0 s, ten a window and the margin later, ten two: about 2.1 s.
    assert!(took >= Duration::from_secs(2), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
}

/// The same with Redis's replies reaching one of the two instances 25 ms late (half the
/// default margin, `support::delay`): none refused, none failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqwest_calls_keep_the_window_when_redis_answers_one_instance_25ms_late() {
    let server = RedisServer::start();
    let late = Delay::start(server.port(), Duration::ZERO, Duration::from_millis(25)).await;
    let clients = (instance(&server.url()).await, instance(&late.url()).await);
    thirty_at_once(clients, stand_in(None).await).await;
}

/// The stand-in refuses the 3rd request with `429` and `Retry-After: 1`. The refusal comes back
/// to its caller as the stand-in sent it; the requests the other instance sends right after it
/// reach the stand-in only once the pause is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushback_pauses_reqwest_calls_on_every_instance() {
    let server = RedisServer::start();
    let (addr, arrivals) = stand_in(Some(3)).await;
    let (a, b) = (instance(&server.url()).await, instance(&server.url()).await);
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let response = a.get(format!("http://{addr}/")).send().await.unwrap();
        assert_eq!(response.status(), expected);
    }
    for call in at_once(&b, addr, 3) {
        assert_eq!(call.await.unwrap(), Ok(StatusCode::OK));
    }
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 6);
    let refused_at = arrivals[2].0;
    let after: Vec<Duration> = arrivals[3..].iter().map(|&(t, _)| t - refused_at).collect();
    eprintln!("after a Retry-After: 1, the other instance's calls arrived {after:?} later");
    let soonest = *after.iter().min().unwrap();
    assert!(soonest >= Duration::from_secs(1), "{after:?}");
    assert!(soonest < Duration::from_millis(1500), "{after:?}");
}

/// Turns of one unit per second for one key on the memory store.
fn one_per_second() -> Turns<MemoryStore> {
    let policy = "1/1s".parse::<Policy>().unwrap();
    let layer = OutboundLayer::builder()
        .policy(policy.with_algorithm(Algorithm::SlidingLog))
        .max_wait(Duration::from_secs(30))
        .build()
        .unwrap();
    layer.turns()
}

/// A turn used with `go()` is kept: the next wait comes a window (and the margin) later. One
/// dropped unused is given back: the next wait, right after, has its turn at once.
#[tokio::test(start_paused = true)]
async fn a_turn_dropped_unused_is_given_back_and_go_keeps_it() {
    let turns = one_per_second();
    let key = Key::from("mail");
    let start = Instant::now();
    turns.wait(key.clone(), 1).await.unwrap().go();
    let second = turns.wait(key.clone(), 1).await.unwrap();
    let kept = start.elapsed();
    assert!(kept >= Duration::from_secs(1), "{kept:?}");
    drop(second);
    // The place is given back on a task of its own.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let dropped_at = Instant::now();
    let third = turns.wait(key.clone(), 1).await.unwrap();
    let given_back = dropped_at.elapsed();
    third.go();
    eprintln!("after a turn used: {kept:?}; after one dropped unused: {given_back:?}");
    assert!(given_back < Duration::from_millis(100), "{given_back:?}");
}

/// Three waits at once: the first goes at once, the second's turn is a second later and the
/// third's two. The second is dropped while it waits (cancelled work): the third moves up
/// into its place, and has its turn a second after the first, not two.
#[tokio::test(start_paused = true)]
async fn a_wait_dropped_before_its_turn_moves_the_next_waiter_up() {
    let turns = one_per_second();
    let key = Key::from("mail");
    let start = Instant::now();
    turns.wait(key.clone(), 1).await.unwrap().go();
    let wait = |turns: &Turns<MemoryStore>| {
        let (turns, key) = (turns.clone(), key.clone());
        tokio::spawn(async move {
            turns.wait(key, 1).await.unwrap().go();
            start.elapsed()
        })
    };
    let second = wait(&turns);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let third = wait(&turns);
    tokio::time::sleep(Duration::from_millis(300)).await;
    second.abort();
    let third = third.await.unwrap();
    eprintln!("the third wait's turn came {third:?} after the first");
    assert!(third >= Duration::from_secs(1), "{third:?}");
    assert!(third < Duration::from_millis(1500), "{third:?}");
}

/// A key per request, here the account its query names: two accounts each have a turn at once
/// under `1/1s`, a second request of one account within the second fails at once (its turn is
/// past `max_wait`), and a request without a key fails with `OutboundError::Key`. Neither
/// failure reaches the stand-in; both are the middleware's error in reqwest-middleware's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_comes_from_the_request_and_failures_do_not_go_out() {
    use std::convert::Infallible;
    use tower_redis_ratelimit::client::OutboundError;
    use tower_redis_ratelimit::KeyError;

    let (addr, arrivals) = stand_in(None).await;
    let layer = OutboundLayer::builder()
        .policy("1/1s".parse::<Policy>().unwrap())
        .max_wait(Duration::from_millis(300))
        .build()
        .unwrap();
    let by_account = layer
        .middleware()
        .key(|request: &reqwest::Request| request.url().query().map(str::to_owned));
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let client = reqwest_middleware::ClientBuilder::new(http)
        .with(by_account)
        .build();
    let outbound = |error: reqwest_middleware::Error| match error {
        reqwest_middleware::Error::Middleware(error) => {
            format!(
                "{:?}",
                error.downcast::<OutboundError<Infallible>>().unwrap()
            )
        }
        other => panic!("not the middleware's: {other}"),
    };
    for account in ["a", "b"] {
        let url = format!("http://{addr}/?{account}");
        let response = client.get(url).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let again = client.get(format!("http://{addr}/?a")).send().await;
    let too_late = outbound(again.unwrap_err());
    assert!(too_late.starts_with("TooLate { turn: Some("), "{too_late}");
    let no_key = client.get(format!("http://{addr}/")).send().await;
    let expected = format!("{:?}", OutboundError::<Infallible>::Key(KeyError::NotFound));
    assert_eq!(outbound(no_key.unwrap_err()), expected);
    assert_eq!(arrivals.lock().unwrap().len(), 2);
}

/// The layer's `max_pause` caps what a reqwest answer's `Retry-After` pauses, as it does for
/// the layer's own requests: a `Retry-After: 1` under a `max_pause` of 300 ms holds the next
/// request 300 ms, not a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushback_pauses_reqwest_calls_at_most_max_pause() {
    let (addr, arrivals) = stand_in(Some(1)).await;
    let layer = OutboundLayer::builder()
        .policy(ten_per_second())
        .max_pause(Duration::from_millis(300))
        .build()
        .unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let client = reqwest_middleware::ClientBuilder::new(http)
        .with(layer.middleware())
        .build();
    for expected in [StatusCode::TOO_MANY_REQUESTS, StatusCode::OK] {
        let response = client.get(format!("http://{addr}/")).send().await.unwrap();
        assert_eq!(response.status(), expected);
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let held = arrivals[1].0 - arrivals[0].0;
    eprintln!("a Retry-After: 1 under a max_pause of 300 ms held the next request {held:?}");
    assert!(held >= Duration::from_millis(300), "{held:?}");
    assert!(held < Duration::from_millis(800), "{held:?}");
}
