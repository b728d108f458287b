//! Usage-based limits through the layer: a reservation before the call, a settle after the
//! response, on the memory store (virtual clock: settles happen at once) and on Redis (settles
//! run in a task of their own, so the checks wait for them, within a deadline).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::support::ALGORITHMS;
use crate::support::{evalsha_calls, RedisServer};
use bytes::Bytes;
use fred::interfaces::SortedSetsInterface;
use futures::channel::mpsc;
use futures::future::join_all;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_redis_ratelimit::key::Header;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::test_util::{events, redis_key};
use tower_redis_ratelimit::usage::{Usage, UsageMeter, UsageReport};
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, RateLimitLayer, Store};

type Body = BoxBody<Bytes, Infallible>;
type Frames = mpsc::UnboundedSender<Result<Frame<Bytes>, Infallible>>;
/// Where the next streaming request hands the test its meter and its body's sender.
type Handoff = Arc<Mutex<Option<futures::channel::oneshot::Sender<(UsageMeter, Frames)>>>>;

const API_KEY: &str = "key-1";

fn full(text: &'static str) -> Body {
    Full::new(Bytes::from_static(text.as_bytes())).boxed()
}

/// A body the test writes frame by frame.
fn streamed() -> (Frames, Body) {
    let (frames, rx) = mpsc::unbounded();
    (frames, StreamBody::new(rx).boxed())
}

fn memory() -> MemoryStore {
    let clock = ManualClock::from(SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 30));
    MemoryStore::builder().clock(clock).build()
}

fn policy(text: &str, algorithm: Algorithm) -> Policy {
    text.parse::<Policy>().unwrap().with_algorithm(algorithm)
}

fn request() -> Request<()> {
    Request::builder()
        .header("x-api-key", API_KEY)
        .body(())
        .unwrap()
}

fn layer<St: Store>(store: St, policy: Policy, report: UsageReport) -> RateLimitLayer<Header, St> {
    RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-api-key")))
        .policy(policy)
        .store(store)
        .usage(report)
        .build()
        .unwrap()
}

/// Sends one request and reads its whole body: status, `Retry-After`, body.
async fn exchange<S, B>(service: &S) -> (StatusCode, Option<u64>, Bytes)
where
    S: Service<Request<()>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes, Error: std::fmt::Debug>,
{
    let response = service.clone().oneshot(request()).await.unwrap();
    let status = response.status();
    let retry = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, retry, body)
}

/// Units left for the test key under `policy`, once they equal `expected` (a settle on Redis
/// lands shortly after the body ends), or what they are after 5 s.
async fn remaining_becomes<St: Store>(store: &St, policy: &Policy, expected: u64) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left = store
            .peek(&Key::from(API_KEY), policy, 0)
            .await
            .unwrap()
            .remaining();
        if left == expected || tokio::time::Instant::now() > deadline {
            return left;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Reservation 1, usage 500 under 1000/1h: two admitted, the third refused until usage ages
/// out (the log: the first request's reservation, an hour after it) or drains (GCRA: one
/// unit, 3.6 s, which `Retry-After` rounds up to 4 s).
async fn reserve_one_use_five_hundred<St: Store>(store: St) {
    for (algorithm, retry) in [(Algorithm::SlidingLog, 3600), (Algorithm::Gcra, 4)] {
        let policy = policy("1000/1h", algorithm);
        let service = layer(store.clone(), policy.clone(), UsageReport::new()).layer(service_fn(
            |_: Request<()>| async {
                let mut response = Response::new(full("answer"));
                response.extensions_mut().insert(Usage(500));
                Ok::<_, Infallible>(response)
            },
        ));
        for left in [500, 0] {
            let (status, _, body) = exchange(&service).await;
            assert_eq!((status, &body[..]), (StatusCode::OK, &b"answer"[..]));
            assert_eq!(remaining_becomes(&store, &policy, left).await, left);
        }
        let (status, retry_after, _) = exchange(&service).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{algorithm:?}");
        assert_eq!(retry_after, Some(retry), "{algorithm:?}");
    }
}

#[tokio::test]
async fn memory_reservation_then_usage_refuses_the_third() {
    reserve_one_use_five_hundred(memory()).await;
}

#[tokio::test]
async fn redis_reservation_then_usage_refuses_the_third() {
    let server = RedisServer::start();
    reserve_one_use_five_hundred(server.store().await).await;
}

/// Reservation 0 refuses only a key that is over its limit: under 1000/1m, requests that use
/// 600 each are admitted while the key holds 0 and then 600, and refused once it holds 1 200,
/// until the first request's usage ages out.
async fn reserve_nothing<St: Store>(store: St) {
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let service = layer(store.clone(), policy.clone(), UsageReport::new().reserve(0)).layer(
        service_fn(|_: Request<()>| async {
            let mut response = Response::new(full("answer"));
            response.extensions_mut().insert(Usage(600));
            Ok::<_, Infallible>(response)
        }),
    );
    for left in [400, 0] {
        assert_eq!(exchange(&service).await.0, StatusCode::OK);
        assert_eq!(remaining_becomes(&store, &policy, left).await, left);
    }
    let (status, retry_after, _) = exchange(&service).await;
    assert_eq!(
        (status, retry_after),
        (StatusCode::TOO_MANY_REQUESTS, Some(60))
    );
}

#[tokio::test]
async fn memory_reservation_of_nothing_refuses_only_when_over() {
    reserve_nothing(memory()).await;
}

#[tokio::test]
async fn redis_reservation_of_nothing_refuses_only_when_over() {
    let server = RedisServer::start();
    reserve_nothing(server.store().await).await;
}

/// Reservation 100, usage 10 reported in a response header: 90 come back.
async fn reserve_hundred_use_ten<St: Store>(store: St) {
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let report = UsageReport::new()
        .reserve(100)
        .header(HeaderName::from_static("x-usage-rows"));
    let service =
        layer(store.clone(), policy.clone(), report).layer(service_fn(|_: Request<()>| async {
            let response = Response::builder()
                .header("x-usage-rows", "10")
                .body(full("rows"))
                .unwrap();
            Ok::<_, Infallible>(response)
        }));
    let (status, _, _) = exchange(&service).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(remaining_becomes(&store, &policy, 990).await, 990);
}

#[tokio::test]
async fn memory_reservation_is_refunded_what_was_not_used() {
    reserve_hundred_use_ten(memory()).await;
}

#[tokio::test]
async fn redis_reservation_is_refunded_what_was_not_used() {
    let server = RedisServer::start();
    reserve_hundred_use_ten(server.store().await).await;
}

/// A handler that streams what the test sends it, and hands the test the request's meter.
fn streaming_handler(
    handed: Handoff,
) -> impl Service<Request<()>, Response = Response<Body>, Error = Infallible, Future: Send> + Clone
{
    service_fn(move |request: Request<()>| {
        let handed = Arc::clone(&handed);
        async move {
            let meter = request.extensions().get::<UsageMeter>().unwrap().clone();
            let (frames, body) = streamed();
            let to_test = handed.lock().unwrap().take().unwrap();
            to_test.send((meter, frames)).ok().unwrap();
            Ok::<_, Infallible>(Response::new(body))
        }
    })
}

/// Streams three chunks, metering 20 per chunk; then, on a second request, the client drops the
/// body after two chunks (charged the 40 reported so far); then a third request reports
/// nothing and the client drops it (charged its reservation, 1, and nothing more).
async fn streamed_usage<St: Store>(store: St) {
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let handed = Arc::new(Mutex::new(None));
    let service = layer(store.clone(), policy.clone(), UsageReport::new())
        .layer(streaming_handler(Arc::clone(&handed)));

    // To the end: 60.
    let (tx, rx) = futures::channel::oneshot::channel();
    *handed.lock().unwrap() = Some(tx);
    let response = service.clone().oneshot(request()).await.unwrap();
    let (meter, frames) = rx.await.unwrap();
    let mut body = response.into_body();
    for _ in 0..3 {
        meter.add(20);
        frames
            .unbounded_send(Ok(Frame::data(Bytes::from_static(b"token "))))
            .unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), &b"token "[..]);
    }
    // Before the end, only the reservation counts.
    assert_eq!(remaining_becomes(&store, &policy, 999).await, 999);
    drop(frames);
    assert!(body.frame().await.is_none());
    assert_eq!(remaining_becomes(&store, &policy, 940).await, 940);

    // Dropped after two chunks: charged the 40 reported.
    let (tx, rx) = futures::channel::oneshot::channel();
    *handed.lock().unwrap() = Some(tx);
    let response = service.clone().oneshot(request()).await.unwrap();
    let (meter, frames) = rx.await.unwrap();
    let mut body = response.into_body();
    for _ in 0..2 {
        meter.add(20);
        frames
            .unbounded_send(Ok(Frame::data(Bytes::from_static(b"token "))))
            .unwrap();
        body.frame().await.unwrap().unwrap();
    }
    drop(body);
    assert_eq!(remaining_becomes(&store, &policy, 900).await, 900);

    // Dropped with nothing reported: the reservation stays.
    let (tx, rx) = futures::channel::oneshot::channel();
    *handed.lock().unwrap() = Some(tx);
    let response = service.clone().oneshot(request()).await.unwrap();
    let (_meter, _frames) = rx.await.unwrap();
    drop(response);
    assert_eq!(remaining_becomes(&store, &policy, 899).await, 899);
}

#[tokio::test]
async fn memory_streamed_usage_is_charged_at_the_end_or_on_drop() {
    streamed_usage(memory()).await;
}

#[tokio::test]
async fn redis_streamed_usage_is_charged_at_the_end_or_on_drop() {
    let server = RedisServer::start();
    streamed_usage(server.store().await).await;
}

/// 20 requests in flight at once, each reserving 1 and using 100, under 1000/1m: all fit
/// their reservation, so all are admitted and every unit is recorded: `recorded` reads what
/// the store holds once the settles have landed. The next request is refused.
async fn concurrent_usage<St: Store>(store: St) -> St {
    const REQUESTS: usize = 20;
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let barrier = Arc::new(tokio::sync::Barrier::new(REQUESTS));
    let service = layer(store.clone(), policy.clone(), UsageReport::new()).layer(service_fn(
        move |_: Request<()>| {
            let barrier = Arc::clone(&barrier);
            async move {
                // Every request is admitted before any reports its usage.
                barrier.wait().await;
                let mut response = Response::new(full("done"));
                response.extensions_mut().insert(Usage(100));
                Ok::<_, Infallible>(response)
            }
        },
    ));
    let answers = join_all((0..REQUESTS).map(|_| exchange(&service))).await;
    assert!(answers
        .iter()
        .all(|(status, _, _)| *status == StatusCode::OK));
    // On Redis each settle is a call of its own, sent as its body ends: the next request may
    // reach Redis before them (and would then be admitted, and wait at the barrier for good).
    assert_eq!(remaining_becomes(&store, &policy, 0).await, 0);
    let (status, retry_after, _) = exchange(&service).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after, Some(60));
    store
}

/// The memory store's log holds every admission and every charge: 20 of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_concurrent_usage_records_every_unit() {
    let store = concurrent_usage(memory()).await;
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    assert_eq!(events(&store, &Key::from(API_KEY), &policy), 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_concurrent_usage_records_every_unit() {
    let server = RedisServer::start();
    let store = concurrent_usage(server.store().await).await;
    // Every entry of the log carries its weight: exactly 2 000 units, 1 000 over the limit,
    // within the bound (the usage of the requests in flight, less their reservations: 20 × 99).
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let log = redis_key(&store, &Key::from(API_KEY), &policy);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let recorded = loop {
        let members: Vec<String> = server
            .client()
            .await
            .zrange(&log, 0, -1, None, false, None, false)
            .await
            .unwrap();
        let units: u64 = members
            .iter()
            .map(|m| m.rsplit(':').next().unwrap().parse::<u64>().unwrap())
            .sum();
        if units >= 2_000 || tokio::time::Instant::now() > deadline {
            break units;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(recorded, 2_000);
}

/// gRPC reports usage in metadata: initial metadata (response headers) or trailing metadata
/// (the trailers frame that ends the body, after `grpc-status`).
#[tokio::test]
async fn grpc_usage_from_initial_or_trailing_metadata() {
    let store = memory();
    let policy = policy("1000/1m", Algorithm::Gcra);
    let report = UsageReport::new().header(HeaderName::from_static("x-usage-tokens"));
    let service = layer(store.clone(), policy.clone(), report).layer(service_fn(
        |request: Request<()>| async move {
            let in_trailers = request.uri().path() == "/trailers";
            let mut response = Response::builder().header("content-type", "application/grpc");
            if !in_trailers {
                response = response.header("x-usage-tokens", "40");
            }
            let (frames, body) = streamed();
            frames
                .unbounded_send(Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0"))))
                .unwrap();
            if in_trailers {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", "0".parse().unwrap());
                trailers.insert("x-usage-tokens", "300".parse().unwrap());
                frames
                    .unbounded_send(Ok(Frame::trailers(trailers)))
                    .unwrap();
            }
            Ok::<_, Infallible>(response.body(body).unwrap())
        },
    ));
    let call = |path: &'static str| {
        let service = service.clone();
        async move {
            let request = Request::builder()
                .uri(path)
                .header("x-api-key", API_KEY)
                .header("content-type", "application/grpc")
                .body(())
                .unwrap();
            let response = service.oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            // The handler dropped its sender: the body ends after the frames it sent.
            response.into_body().collect().await.unwrap()
        }
    };
    call("/head").await;
    assert_eq!(remaining_becomes(&store, &policy, 960).await, 960);
    let trailers = call("/trailers").await.trailers().cloned().unwrap();
    assert_eq!(trailers["x-usage-tokens"], "300");
    assert_eq!(remaining_becomes(&store, &policy, 660).await, 660);
}

/// A request that reports no usage costs its reservation and no second script call.
#[tokio::test]
async fn redis_no_usage_reported_means_no_settle_call() {
    let server = RedisServer::start();
    let store = server.store().await;
    let admin = server.client().await;
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let service = layer(store.clone(), policy.clone(), UsageReport::new()).layer(service_fn(
        |_: Request<()>| async { Ok::<_, Infallible>(Response::new(full("x"))) },
    ));
    let before = evalsha_calls(&admin).await;
    for _ in 0..3 {
        assert_eq!(exchange(&service).await.0, StatusCode::OK);
    }
    // A settle would have been sent as its body ended; give it ample time to arrive.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(evalsha_calls(&admin).await - before, 3);
    assert_eq!(remaining_becomes(&store, &policy, 997).await, 997);
}

/// Usage 0 gives the whole reservation back: a key limited to 1 per minute never fills.
#[tokio::test]
async fn usage_of_zero_gives_the_reservation_back() {
    let store = memory();
    let policy = policy("1/1m", Algorithm::SlidingLog);
    let calls = Arc::new(Mutex::new(0));
    let counted = Arc::clone(&calls);
    let service = layer(store.clone(), policy.clone(), UsageReport::new()).layer(service_fn(
        move |_: Request<()>| {
            *counted.lock().unwrap() += 1;
            async {
                let mut response = Response::new(full("x"));
                response.extensions_mut().insert(Usage(0));
                Ok::<_, Infallible>(response)
            }
        },
    ));
    for _ in 0..5 {
        assert_eq!(exchange(&service).await.0, StatusCode::OK);
    }
    assert_eq!(*calls.lock().unwrap(), 5);
    assert_eq!(remaining_becomes(&store, &policy, 1).await, 1);
}

/// Two usage layers (per API key, then per client address) both charge what the handler
/// reported once.
#[tokio::test]
async fn stacked_usage_layers_share_the_meter() {
    let (by_key, by_ip) = (memory(), memory());
    let policy = policy("1000/1m", Algorithm::SlidingLog);
    let inner = layer(by_key.clone(), policy.clone(), UsageReport::new()).layer(service_fn(
        |request: Request<()>| async move {
            let meter = request.extensions().get::<UsageMeter>().unwrap();
            meter.set(300);
            Ok::<_, Infallible>(Response::new(full("x")))
        },
    ));
    let outer = RateLimitLayer::builder()
        .key(tower_redis_ratelimit::Global)
        .policy(policy.clone())
        .store(by_ip.clone())
        .usage(UsageReport::new())
        .build()
        .unwrap()
        .layer(inner);
    assert_eq!(exchange(&outer).await.0, StatusCode::OK);
    assert_eq!(remaining_becomes(&by_key, &policy, 700).await, 700);
    let global = by_ip
        .peek(&Key::from("global"), &policy, 0)
        .await
        .unwrap()
        .remaining();
    assert_eq!(global, 700);
}

/// A refund forgets the layer's cached refusal of the key: with reservations of 100 under
/// 150/1m, a second request is refused while the first is in flight, and a third is admitted
/// once the first has given back the 90 it did not use, though the refusal said to retry in a
/// minute. Redis: the deny cache is on by default for a store that is not local.
#[tokio::test]
async fn redis_refund_clears_the_deny_cache() {
    let server = RedisServer::start();
    let store = server.store().await;
    let policy = policy("150/1m", Algorithm::SlidingLog);
    let handed: Handoff = Arc::new(Mutex::new(None));
    let service = layer(
        store.clone(),
        policy.clone(),
        UsageReport::new().reserve(100),
    )
    .layer(streaming_handler(Arc::clone(&handed)));

    let (tx, rx) = futures::channel::oneshot::channel();
    *handed.lock().unwrap() = Some(tx);
    let first = service.clone().oneshot(request()).await.unwrap();
    let (meter, frames) = rx.await.unwrap();
    let (status, retry_after, _) = exchange(&service).await;
    assert_eq!(
        (status, retry_after),
        (StatusCode::TOO_MANY_REQUESTS, Some(60))
    );

    meter.set(10);
    drop(frames);
    first.into_body().collect().await.unwrap();
    assert_eq!(remaining_becomes(&store, &policy, 140).await, 140);

    let (tx, rx) = futures::channel::oneshot::channel();
    *handed.lock().unwrap() = Some(tx);
    let third = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    drop(rx);
}

/// A body dropped outside any tokio runtime (here, after its runtime is gone) neither panics
/// nor settles.
#[test]
fn redis_body_dropped_outside_a_runtime_does_not_panic() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (server, body) = runtime.block_on(async {
        let server = RedisServer::start();
        let store = server.store().await;
        let policy = policy("1000/1m", Algorithm::SlidingLog);
        let service =
            layer(store, policy, UsageReport::new()).layer(service_fn(|_: Request<()>| async {
                let mut response = Response::new(full("x"));
                response.extensions_mut().insert(Usage(50));
                Ok::<_, Infallible>(response)
            }));
        let response = service.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        (server, response.into_body())
    });
    drop(runtime);
    drop(body);
    drop(server);
}

/// Usage of `u64::MAX` (or 2^63) through the layer, on every algorithm: charged as the most a
/// state holds, and logged, so the next request is refused; nothing panics (a debug build
/// checks every addition) and the key is never wrapped to empty.
#[tokio::test]
async fn memory_usage_past_any_state_is_saturated() {
    let captured = crate::support::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    for algorithm in ALGORITHMS {
        for units in [1 << 63, u64::MAX] {
            let store = memory();
            let policy = policy("1000/1m", algorithm);
            let service = layer(store.clone(), policy.clone(), UsageReport::new()).layer(
                service_fn(move |_: Request<()>| async move {
                    let mut response = Response::new(full("answer"));
                    response.extensions_mut().insert(Usage(units));
                    Ok::<_, Infallible>(response)
                }),
            );
            let (status, _, _) = exchange(&service).await;
            assert_eq!(status, StatusCode::OK);
            let (status, retry_after, _) = exchange(&service).await;
            assert_eq!(
                status,
                StatusCode::TOO_MANY_REQUESTS,
                "{algorithm:?} {units}"
            );
            assert!(
                retry_after >= Some(1),
                "{algorithm:?} {units}: {retry_after:?}"
            );
        }
    }
    let logs = captured.text();
    let saturated = "a charge past the largest usage a store holds is recorded as that much";
    assert_eq!(logs.matches(saturated).count(), 8, "{logs}");
    assert!(
        logs.contains("units=18446744073709551614 recorded=4503599627370496"),
        "{logs}"
    );
}
