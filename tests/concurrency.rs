//! Concurrency limits (`Policy::concurrency`): at most N requests of a key in flight across a
//! fleet of instances, slots given back when a response ends or is dropped, and the slots of
//! an instance that dies coming back within the slot lifetime.
//!
//! The memory store runs on tokio's paused clock; Redis tests use the test's own
//! `redis-server` and real time with short lifetimes and wide margins.

mod common;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::proxy::Proxy;
use common::RedisServer;
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
    Policy::new(name, ["100000/1m".parse().unwrap()])
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

#[tokio::test(start_paused = true)]
async fn a_fleet_on_one_memory_store_never_streams_more_than_the_limit() {
    let store = MemoryStore::new();
    let policy = streams("fleet-memory", 2, Duration::from_secs(10));
    let seen = Arc::new(InFlight::default());
    let layers: Vec<_> = (0..4)
        .map(|_| limited(store.clone(), policy.clone()))
        .collect();
    let services: Vec<_> = layers
        .iter()
        .map(|l| l.layer(streaming(Arc::clone(&seen), Duration::from_millis(50))))
        .collect();
    // Twice: the slots of the first round all came back.
    for round in 0..2 {
        let statuses = fire(&services, "k", 200).await;
        check_fleet(&statuses, &seen, 2, &format!("memory, round {round}"));
        assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 0);
    }
}

#[tokio::test(start_paused = true)]
async fn a_dropped_body_frees_its_slot_at_once_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("drop-memory", 2, Duration::from_secs(10));
    let layer = limited(store.clone(), policy.clone());
    let service = layer.layer(endless());
    let [first, second, refused] = fill_two(&service).await;
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 2);
    // Another key has its own slots.
    let other = service.clone().oneshot(request("other")).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    // The client goes away mid-stream: its body is dropped, and its slot is free at once.
    drop(first);
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 1);
    let third = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    // A body read to its end gives its slot back then, though it is not dropped yet.
    let seen = Arc::new(InFlight::default());
    let short = layer.layer(streaming(seen, Duration::from_millis(10)));
    let mut ended = short.oneshot(request("ended")).await.unwrap();
    assert_eq!(store.slots_in_use(&Key::from("ended"), &policy), 1);
    while let Some(frame) = ended.body_mut().frame().await {
        frame.unwrap();
    }
    assert_eq!(store.slots_in_use(&Key::from("ended"), &policy), 0);
    drop(ended);
    drop((second, third, other));
    assert_eq!(layer.settled(Duration::from_secs(1)).await, 0);
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_longer_than_the_slot_lifetime_keeps_its_slot_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("long-memory", 1, Duration::from_secs(3));
    let layer = limited(store.clone(), policy);
    let service = layer.layer(endless());
    let long = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    // Ten lifetimes later, renewed all along, it still holds the only slot.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    drop(long);
    let next = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
}

/// A layer's renewal task goes idle once it has held no slot for a few ticks; the next slot
/// taken must wake it, or a long request begun after a quiet spell would lose its slot.
#[tokio::test(start_paused = true)]
async fn a_slot_taken_after_a_quiet_spell_is_renewed_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("quiet-memory", 1, Duration::from_secs(3));
    let layer = limited(store.clone(), policy.clone());
    let service = layer.layer(endless());
    let short = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(short.status(), StatusCode::OK);
    drop(short);
    // Ten lifetimes with nothing held.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let long = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    for second in 1..=30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        let status = refused.status();
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "after {second} s");
    }
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 1);
    drop(long);
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slot_nobody_renews_expires_after_its_lifetime_on_memory() {
    // An instance that died: it took two slots, then neither gave them back nor renewed them.
    let store = MemoryStore::new();
    let policy = streams("crash-memory", 2, Duration::from_secs(5));
    for _ in 0..2 {
        let taken = store.check(&Key::from("k"), &policy, 1).await.unwrap();
        assert!(taken.holds_slot());
    }
    let refused = store.check(&Key::from("k"), &policy, 1).await.unwrap();
    assert!(refused.is_concurrency_limit() && !refused.is_allowed());
    assert_eq!(refused.limit(), 2);
    assert_eq!(refused.limit_index(), 1);
    assert_eq!(refused.retry_after(), Some(Duration::from_secs(5)));
    tokio::time::advance(Duration::from_millis(4_999)).await;
    assert!(!store
        .check(&Key::from("k"), &policy, 1)
        .await
        .unwrap()
        .is_allowed());
    tokio::time::advance(Duration::from_millis(1)).await;
    let back = store.check(&Key::from("k"), &policy, 1).await.unwrap();
    assert!(back.is_allowed() && back.holds_slot());
    // A release gives it back; a renewal of it afterwards does not take it again.
    let release = Settlement::release(&back).unwrap();
    store
        .settle(&Key::from("k"), &policy, release)
        .await
        .unwrap();
    let renew = Settlement::renew(&back).unwrap();
    let gone = store.settle(&Key::from("k"), &policy, renew).await;
    assert!(matches!(gone, Err(StoreError::SlotGone)), "{gone:?}");
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 0);
}

#[tokio::test(start_paused = true)]
async fn a_rate_refusal_takes_no_slot_and_a_slot_refusal_records_no_rate() {
    let store = MemoryStore::new();
    let policy = Policy::new("both", ["3/1m".parse().unwrap()])
        .unwrap()
        .concurrency(1)
        .unwrap();
    let key = Key::from("k");
    let first = store.check(&key, &policy, 1).await.unwrap();
    assert!(first.is_allowed() && first.holds_slot());
    // Refused for the slot: the rate limit records nothing.
    let refused = store.check(&key, &policy, 1).await.unwrap();
    assert!(refused.is_concurrency_limit());
    assert_eq!(store.peek(&key, &policy, 1).await.unwrap().remaining(), 2);
    store
        .settle(&key, &policy, Settlement::release(&first).unwrap())
        .await
        .unwrap();
    for _ in 0..2 {
        let d = store.check(&key, &policy, 1).await.unwrap();
        assert!(d.is_allowed());
        store
            .settle(&key, &policy, Settlement::release(&d).unwrap())
            .await
            .unwrap();
    }
    // Refused by the rate limit: no slot taken, and the decision says which limit.
    let rate = store.check(&key, &policy, 1).await.unwrap();
    assert!(!rate.is_allowed() && !rate.is_concurrency_limit() && !rate.holds_slot());
    assert_eq!(store.slots_in_use(&key, &policy), 0);
}

#[tokio::test]
async fn a_fleet_of_four_redis_stores_never_streams_more_than_the_limit() {
    let server = RedisServer::start();
    let policy = streams("fleet-redis", 2, Duration::from_secs(10));
    let seen = Arc::new(InFlight::default());
    let mut layers = Vec::new();
    for _ in 0..4 {
        let layer = limited(server.store().await, policy.clone());
        layers.push(layer);
    }
    let services: Vec<_> = layers
        .iter()
        .map(|l| l.layer(streaming(Arc::clone(&seen), Duration::from_millis(20))))
        .collect();
    let statuses = fire(&services, "k", 200).await;
    for layer in &layers {
        assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    }
    check_fleet(&statuses, &seen, 2, "redis, at once");
    // Then 40 clients that keep asking until 60 streams have run: slots given back on one
    // instance are taken on another, and the limit holds throughout.
    let admitted = Arc::new(AtomicUsize::new(0));
    let clients = (0..40).map(|i| {
        let service = services[i % services.len()].clone();
        let admitted = Arc::clone(&admitted);
        async move {
            let mut statuses = Vec::new();
            while admitted.load(Ordering::SeqCst) < 60 {
                let response = service.clone().oneshot(request("k")).await.unwrap();
                let status = response.status();
                response.into_body().collect().await.unwrap();
                if status == StatusCode::OK {
                    admitted.fetch_add(1, Ordering::SeqCst);
                } else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                statuses.push(status);
            }
            statuses
        }
    });
    let statuses: Vec<StatusCode> = join_all(clients).await.concat();
    for layer in &layers {
        assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    }
    check_fleet(&statuses, &seen, 2, "redis, clients that keep asking");
    let store = server.store().await;
    let slots = format!("{}:slots", store.redis_key(&Key::from("k"), &policy));
    let client = server.client().await;
    let held: u64 = fred::interfaces::SortedSetsInterface::zcard(&client, &slots)
        .await
        .unwrap();
    assert_eq!(held, 0, "slots left in {slots}");
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

#[tokio::test]
async fn a_client_that_drops_mid_stream_frees_its_slot_within_a_second_on_redis() {
    let server = RedisServer::start();
    let policy = streams("drop-redis", 2, Duration::from_secs(10));
    let layer = limited(server.store().await, policy);
    let service = layer.layer(endless());
    let [first, second, refused] = fill_two(&service).await;
    let fields = refused.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(
        fields.starts_with("\"drop-redis-concurrency\";r=0;t="),
        "{fields}"
    );
    drop(first);
    let took = until_admitted(&service, "k", Duration::from_secs(1)).await;
    println!("a dropped stream's slot was taken again after {took:?}");
    drop(second);
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_body_that_fails_gives_its_slot_back_at_the_error_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("fails-memory", 1, Duration::from_secs(10));
    let layer = limited(store.clone(), policy.clone());
    let failing = service_fn(|_: Request<()>| async {
        let frames = futures::stream::iter([
            Ok(http_body::Frame::data(Bytes::from_static(b"partial"))),
            Err(std::io::Error::other("the model crashed")),
        ]);
        Ok::<_, Infallible>(Response::new(StreamBody::new(frames)))
    });
    let mut response = layer.layer(failing).oneshot(request("k")).await.unwrap();
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 1);
    assert!(response.body_mut().frame().await.unwrap().is_ok());
    assert!(response.body_mut().frame().await.unwrap().is_err());
    // Freed at the error, while the body is still held.
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 0);
    drop(response);
}

#[tokio::test]
async fn a_request_longer_than_the_slot_lifetime_keeps_its_slot_on_redis() {
    let server = RedisServer::start();
    let policy = streams("long-redis", 1, Duration::from_millis(600));
    let layer = limited(server.store().await, policy);
    let service = layer.layer(endless());
    let long = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    // Four lifetimes, renewed every 150 to 300 ms: every other request is refused all along.
    let until = tokio::time::Instant::now() + Duration::from_millis(2_400);
    let mut probes = 0;
    while tokio::time::Instant::now() < until {
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        probes += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(probes > 10);
    drop(long);
    until_admitted(&service, "k", Duration::from_secs(1)).await;
}

/// An instance killed while it holds two slots: they come back within their stored lifetime,
/// `1.5 L + 2 B` after their last renewal (3.5 s at `L` = 2 s and the default 250 ms budget),
/// while the live instance's slot is kept.
#[test]
fn a_killed_instances_slots_come_back_within_the_stored_lifetime_on_redis() {
    let server = RedisServer::start();
    let url = server.url();
    let expiry = Duration::from_secs(2);
    let stored = expiry + expiry / 2 + Duration::from_millis(500);
    let policy = streams("crash-redis", 3, expiry);
    let layer = |url: String, policy: Policy| async move {
        let layer = limited(RedisStore::connect(&url).await.unwrap(), policy);
        layer.layer(endless())
    };
    // The instance that lives holds one stream all along, renewing its slot: the key's set of
    // slots never expires as a whole, so only the dead instance's own slots can expire.
    let survivor = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (service, held) = survivor.block_on(async {
        let service = layer(url.clone(), policy.clone()).await;
        let held = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(held.status(), StatusCode::OK);
        (service, held)
    });
    // The instance that dies runs on a runtime of its own: its connections, its renewal task
    // and its requests end with it. Its bodies are forgotten, as a killed process runs no
    // destructors: nothing is given back.
    let doomed = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let taken_at = doomed.block_on(async {
        let service = layer(url.clone(), policy.clone()).await;
        for _ in 0..2 {
            let response = service.clone().oneshot(request("k")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            std::mem::forget(response);
        }
        let taken_at = tokio::time::Instant::now();
        // Renewed at least twice before the crash: held past their first expiry.
        tokio::time::sleep(expiry + expiry / 2).await;
        std::mem::forget(service);
        taken_at
    });
    doomed.shutdown_background();
    let crashed = tokio::time::Instant::now();
    survivor.block_on(async move {
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let took = until_admitted(&service, "k", stored + Duration::from_secs(1)).await;
        let since_crash = crashed.elapsed();
        println!(
            "slot lifetime {expiry:?}: admitted again {since_crash:?} after the crash \
             ({took:?} of polling; slots taken {:?} before the crash)",
            crashed - taken_at
        );
        assert!(since_crash <= stored + Duration::from_secs(1));
        // The live instance's slot was renewed all along: it still counts, two more fit.
        let two: Vec<_> = join_all([(); 2].map(|_| service.clone().oneshot(request("k"))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert!(two.iter().all(|r| r.status() == StatusCode::OK));
        let over = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
        drop((two, held));
    });
}

#[tokio::test]
async fn the_handler_sees_which_limit_decided_and_the_fields_list_the_concurrency_limit() {
    let store = MemoryStore::new();
    let policy = streams("seen", 1, Duration::from_secs(10));
    let layer = limited(store, policy);
    let service = layer.layer(service_fn(|request: Request<()>| async move {
        let decisions = request.extensions().get::<Decisions>().cloned().unwrap();
        let decision = *decisions.get("seen").unwrap();
        assert!(decision.is_allowed() && decision.holds_slot());
        assert!(!decision.is_concurrency_limit());
        Ok::<_, Infallible>(Response::new(BodyExt::boxed(http_body_util::Full::new(
            Bytes::from_static(b"ok"),
        ))))
    }));
    let response = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let policy_field = response.headers()["ratelimit-policy"].to_str().unwrap();
    assert_eq!(
        policy_field,
        "\"seen\";q=100000;w=60, \"seen-concurrency\";q=1;qu=\"concurrent-requests\""
    );
}

/// A layer that counts by outcome takes slots as well: an attempt holds its slot until its
/// body ends and its unit from its admission, kept when its head matches.
#[tokio::test]
async fn a_layer_that_counts_by_outcome_takes_slots_as_well() {
    let store = MemoryStore::new();
    let policy = Policy::new("outcomes", ["2/1m".parse().unwrap()])
        .unwrap()
        .concurrency(1)
        .unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store.clone())
        .policy(policy.clone())
        .count_when(|response| response.status == StatusCode::OK)
        .build()
        .unwrap();
    let service = layer.layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 1);
    let second = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(
        second.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the slot is taken"
    );
    drop(first);
    assert_eq!(store.slots_in_use(&Key::from("k"), &policy), 0);
    let third = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    drop(third);
    let fourth = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(fourth.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(fourth.headers()["ratelimit"], "\"outcomes\";r=0;t=60");
}

/// A layer first used from a runtime that then shut down (a warm-up, a health check at start)
/// still renews the slots it takes later on another runtime.
#[test]
fn slots_are_renewed_after_the_first_runtime_is_gone() {
    let store = MemoryStore::new();
    let policy = streams("runtimes", 1, Duration::from_millis(400));
    let layer = limited(store.clone(), policy);
    let service = layer.layer(endless());
    let warm_up = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    warm_up.block_on(async {
        let response = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    });
    drop(warm_up);
    let serving = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    serving.block_on(async {
        let long = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(long.status(), StatusCode::OK);
        // Three lifetimes: renewed every 100 to 200 ms, the slot never expires.
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let refused = service.clone().oneshot(request("k")).await.unwrap();
            assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        }
        drop(long);
    });
}

/// A slot the store loses (here Redis flushed) is reported once, and renewed no more; slots
/// given back as a renewal of theirs is on its way are not reported.
#[tokio::test]
async fn a_lost_slot_is_reported_once_and_a_returned_one_never() {
    let captured = common::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let server = RedisServer::start();
    let policy = streams("lost", 50, Duration::from_millis(400));
    let layer = limited(server.store().await, policy);
    let seen = Arc::new(InFlight::default());
    let short = layer.layer(streaming(Arc::clone(&seen), Duration::from_millis(40)));
    // Streams of 120 ms, one starting every 10 ms, over a 100 ms renewal tick: many end
    // while their renewal is on its way.
    let streams = (0..60).map(|i| {
        let short = short.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(10 * i)).await;
            let response = short.oneshot(request("k")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            response.into_body().collect().await.unwrap();
        }
    });
    join_all(streams).await;
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    let lost = "was gone at its renewal";
    assert_eq!(
        captured.text().matches(lost).count(),
        0,
        "{}",
        captured.text()
    );
    let long = layer.layer(endless()).oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    common::cluster::cli(server.port(), &["FLUSHALL"]);
    // Several ticks later: reported once.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        captured.text().matches(lost).count(),
        1,
        "{}",
        captured.text()
    );
    drop(long);
}

/// `max_wait`: a request refused only for a slot waits for one, and requests of a key get
/// slots in the order they came; past the wait, the refusal.
#[tokio::test(start_paused = true)]
async fn waiting_requests_get_slots_in_arrival_order_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("queue-memory", 1, Duration::from_secs(10));
    let layer = limited_waiting(store.clone(), policy.clone(), Duration::from_secs(5));
    let service = layer.layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // Three wait, in this order; each records when it got its answer.
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for name in ["second", "third", "fourth"] {
        let (service, order) = (service.clone(), Arc::clone(&order));
        waiting.push(tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            order.lock().unwrap().push(name);
            (response.status(), response)
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(order.lock().unwrap().is_empty(), "none got a slot yet");
    drop(first);
    // Woken by the give-back itself, not by its next look 50 ms on.
    let given_back = tokio::time::Instant::now();
    let (status, second) = waiting.remove(0).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(given_back.elapsed(), Duration::ZERO);
    assert_eq!(*order.lock().unwrap(), ["second"]);
    drop(second);
    let (status, third) = waiting.remove(0).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(*order.lock().unwrap(), ["second", "third"]);
    // The fourth waits its 5 s out, then is refused.
    let started = tokio::time::Instant::now();
    let (status, refused) = waiting.remove(0).await.unwrap();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key("retry-after"));
    let waited = started.elapsed();
    assert!(waited > Duration::from_secs(2), "{waited:?}");
    drop(third);
    // A key refused by its rate limit does not wait.
    let tight = Policy::new("tight-memory", ["1/1h".parse().unwrap()])
        .unwrap()
        .concurrency(5)
        .unwrap();
    let rate = limited_waiting(store, tight, Duration::from_secs(5)).layer(endless());
    let _one = rate.clone().oneshot(request("k")).await.unwrap();
    let started = tokio::time::Instant::now();
    let refused = rate.oneshot(request("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(started.elapsed(), Duration::ZERO);
}

#[tokio::test]
async fn a_waiting_request_gets_the_slot_given_back_on_redis() {
    let server = RedisServer::start();
    let policy = streams("queue-redis", 1, Duration::from_secs(10));
    let layer = limited_waiting(server.store().await, policy, Duration::from_secs(3));
    let service = layer.layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let waiter = tokio::spawn({
        let service = service.clone();
        async move {
            let started = tokio::time::Instant::now();
            let response = service.oneshot(request("k")).await.unwrap();
            (response.status(), started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    drop(first);
    let (status, waited) = waiter.await.unwrap();
    println!("waited {waited:?} for a slot given back after 300 ms");
    assert_eq!(status, StatusCode::OK);
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_millis(1_300));
}

/// Slots freed on another instance: only the first in line asks again, so the later request,
/// whose next look comes first, does not overtake it.
#[tokio::test(start_paused = true)]
async fn a_slot_freed_elsewhere_goes_to_the_first_in_line() {
    let store = MemoryStore::new();
    let policy = streams("line-memory", 1, Duration::from_secs(10));
    let instance =
        || limited_waiting(store.clone(), policy.clone(), Duration::from_secs(5)).layer(endless());
    let (elsewhere, here) = (instance(), instance());
    let held = elsewhere.oneshot(request("k")).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for name in ["earlier", "later"] {
        let (service, order) = (here.clone(), Arc::clone(&order));
        waiting.push(tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            order.lock().unwrap().push(name);
            response
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The earlier request looks every 50 ms from its arrival, the later 10 ms after it; the
    // slot frees 5 ms after the earlier one's look (1005 ms after its arrival; 20 ms have
    // passed), so the later one would look first.
    tokio::time::sleep(Duration::from_millis(985)).await;
    drop(held);
    let first = waiting.remove(0).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(*order.lock().unwrap(), ["earlier"]);
    drop(first);
    assert_eq!(waiting.remove(0).await.unwrap().status(), StatusCode::OK);
}

/// A request that arrives while others of its key wait for a slot joins the back of their line
/// rather than taking the slot freed for the first of them.
#[tokio::test(start_paused = true)]
async fn a_new_request_does_not_overtake_the_line() {
    let store = MemoryStore::new();
    let policy = streams("overtake-memory", 1, Duration::from_secs(10));
    let service = limited_waiting(store, policy, Duration::from_secs(5)).layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    let waiting = tokio::spawn(service.clone().oneshot(request("k")));
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(first);
    // Arrives at the very instant the slot is free, before the waiting request has run.
    let mut late = Box::pin(service.clone().oneshot(request("k")));
    assert!(
        futures::poll!(&mut late).is_pending(),
        "the late request took the slot"
    );
    let served = waiting.await.unwrap().unwrap();
    assert_eq!(served.status(), StatusCode::OK);
    drop(served);
    assert_eq!(late.await.unwrap().status(), StatusCode::OK);
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
                common::cluster::cli(port, &["DEBUG", "SLEEP", &seconds]);
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

/// How many of the requests sent every 50 ms for `period` were admitted (the others were
/// refused, 429, or failed closed, 503).
async fn admitted_during<S>(service: &S, key: &str, period: Duration) -> usize
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let (started, mut admitted) = (tokio::time::Instant::now(), 0);
    while started.elapsed() < period {
        let response = service.clone().oneshot(request(key)).await.unwrap();
        admitted += usize::from(response.status() == StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    admitted
}

/// Two streams hold both slots of a key (`slot_expiry` 2 s, `FailureMode::Closed`) while Redis
/// answers nothing for 1.9 s, by `DEBUG SLEEP` and by `SIGSTOP`: no slot is lost, so nothing
/// else is admitted during the stall nor in the 3 s after it, past the lifetime, until a
/// stream ends. A slot lives in Redis for 1.5 lifetimes and twice the time budget after its
/// last renewal (with the lifetime alone, both were lost to either stall and a third stream
/// was admitted: 4 in flight at cap 2 with two instances, in the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_shorter_than_the_slot_lifetime_loses_no_slot_on_redis() {
    for how in ["sleep", "stop"] {
        let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let policy = streams("stall", 2, Duration::from_secs(2));
        let service = closed(&server.url(), policy).await.layer(endless());
        let [first, second, _] = fill_two(&service).await;
        // Past a renewal, so that the stall starts with a slot renewed some time before.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let stalled = async { admitted_during(&service, "k", Duration::from_millis(1900)).await };
        let (during, ()) = futures::join!(stalled, stop_redis(&server, how, 1.9));
        let after = admitted_during(&service, "k", Duration::from_secs(3)).await;
        assert_eq!((during, after), (0, 0), "{how}: admitted past the cap");
        drop((first, second));
        let freed = both_slots_free(&service, "k", Duration::from_secs(1)).await;
        assert!(
            freed.is_some(),
            "{how}: the slots given back were not free within a second"
        );
    }
}

/// Two streams end while Redis sleeps 0.4 s, past the time budget, with the breaker open:
/// their give-backs wait and are sent as soon as Redis answers, so the key admits again
/// within a second of that (before, they were dropped as "store unavailable" and the key was
/// refused for the slots' lifetime: 8.3 s in the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn give_backs_during_a_blip_are_sent_once_redis_answers_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("blip", 2, Duration::from_secs(10));
    let service = closed(&server.url(), policy).await.layer(endless());
    let [first, second, _] = fill_two(&service).await;
    let blip = stop_redis(&server, "sleep", 0.4);
    let ends = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        // A decision that outlasts the budget opens the breaker.
        let tripped = service.clone().oneshot(request("other")).await.unwrap();
        assert_eq!(tripped.status(), StatusCode::SERVICE_UNAVAILABLE);
        drop((first, second));
    };
    futures::join!(blip, ends);
    let woke = tokio::time::Instant::now();
    loop {
        let response = service.clone().oneshot(request("k")).await.unwrap();
        if response.status() == StatusCode::OK {
            break;
        }
        let late = woke.elapsed();
        assert!(
            late < Duration::from_secs(1),
            "still refused {late:?} after Redis woke"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends requests of `key` every 20 ms until two are admitted and held at once; how long that
/// took, or `None` past `within`.
async fn both_slots_free<S>(service: &S, key: &str, within: Duration) -> Option<Duration>
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let started = tokio::time::Instant::now();
    let mut held = Vec::new();
    while started.elapsed() < within {
        let response = service.clone().oneshot(request(key)).await.unwrap();
        if response.status() == StatusCode::OK {
            held.push(response);
            if held.len() == 2 {
                return Some(started.elapsed());
            }
        } else {
            held.clear();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    None
}

/// Twelve clients that leave 20 to 23 ms after sending, while their decisions wait on a Redis
/// that sleeps 0.2 s: Redis runs the decisions when it wakes and the first two take the key's
/// slots, which nobody holds; the instance chose their ids and gives them back, so both slots
/// are free again within a second (before, the key was refused for the slots' lifetime with
/// nothing in flight: 9.6 s in the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_leave_during_their_decision_leave_no_slot_taken_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("leaving", 2, Duration::from_secs(10));
    let service = closed(&server.url(), policy).await.layer(endless());
    let leaving = (0..12u64).map(|i| {
        let service = service.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let wait = Duration::from_millis(20 + i % 4);
            let left = tokio::time::timeout(wait, service.oneshot(request("k"))).await;
            assert!(left.is_err(), "answered before the client left");
        }
    });
    futures::join!(stop_redis(&server, "sleep", 0.2), join_all(leaving));
    let took = both_slots_free(&service, "k", Duration::from_secs(1)).await;
    assert!(
        took.is_some(),
        "the key's slots were not free within a second"
    );
}

/// Decisions answered 503 while Redis sleeps 1 s (`FailureMode::Closed`) are run by Redis when
/// it wakes and take the key's slots; the instance gives them back, so both slots are free
/// again within a second of Redis answering (before, they blocked the key for a lifetime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_answered_503_during_a_stall_leave_no_slot_taken_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("stalled", 2, Duration::from_secs(10));
    let service = closed(&server.url(), policy).await.layer(endless());
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let asks = (0..6).map(|_| service.clone().oneshot(request("k")));
        let statuses: Vec<_> = join_all(asks)
            .await
            .into_iter()
            .map(|r| r.unwrap().status())
            .collect();
        assert!(
            statuses
                .iter()
                .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
            "{statuses:?}"
        );
    };
    futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    let took = both_slots_free(&service, "k", Duration::from_secs(1)).await;
    assert!(
        took.is_some(),
        "the key's slots were not free within a second of Redis waking"
    );
}

/// Memory pressure on the memory store: `max_keys(10_000)`, a key holding both its slots with
/// two streams, then 20 000 other clients decided: the key's slots stay (its entry is pinned
/// while it holds slots), so a third stream of the key is refused and at most 2 are in flight
/// (before, its slots were evicted and a third was admitted: 3 in flight at cap 2).
#[tokio::test]
async fn a_flood_of_other_keys_never_evicts_slots_in_use_on_memory() {
    let store = MemoryStore::builder().max_keys(10_000).build();
    let layer = limited(store.clone(), streams("evict", 2, Duration::from_secs(10)));
    let service = layer.layer(endless());
    let [first, second, refused] = fill_two(&service).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let others = Policy::new("others", ["5/1m".parse().unwrap()]).unwrap();
    for i in 0..20_000 {
        let key = Key::from(format!("client-{i}"));
        assert!(store.check(&key, &others, 1).await.unwrap().is_allowed());
    }
    assert!(store.key_count() <= 10_000, "{} keys", store.key_count());
    let third = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(
        third.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a third in flight"
    );
    drop((first, second));
}

/// Under `FailureMode::Open` (the default), a concurrency limit holds on each instance alone
/// while Redis is out of reach: with one stream of the key held and Redis asleep 1 s, one more
/// request of the key is admitted (2 in flight here, the cap) and the others are refused for a
/// slot (before, each was admitted without a slot: 10 in flight at cap 2 in the attack).
/// Once Redis answers again, the slot held alone still counts on this instance until its
/// request ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_open_keeps_the_cap_on_each_instance_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let layer = limited(store, streams("open", 2, Duration::from_secs(10)));
    let service = layer.layer(endless());
    let held = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut responses = Vec::new();
        for _ in 0..4 {
            responses.push(service.clone().oneshot(request("k")).await.unwrap());
        }
        responses
    };
    let ((), responses) = futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    let statuses: Vec<_> = responses.iter().map(|r| r.status()).collect();
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 1, "{statuses:?}");
    assert!(statuses
        .iter()
        .all(|s| *s == StatusCode::OK || *s == StatusCode::TOO_MANY_REQUESTS));
    // Redis answers again (past the breaker's retry interval), and does not know the slot
    // held alone: the layer counts it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(
        after.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "past the cap after the outage"
    );
    // Its slot given back (the refused one's Redis slot too, on its way): admitted again.
    drop(responses);
    until_admitted(&service, "k", Duration::from_secs(1)).await;
    drop(held);
}

/// A request waiting for a slot (`max_wait`) while Redis sleeps is not let in by the outage
/// under `FailureMode::Open`: the instance holds the key's cap, so the waiter waits out its
/// time and is refused (before, the first store error let it in: 12 in flight at cap 2 in
/// the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_does_not_let_waiters_in_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = streams("waiters", 2, Duration::from_secs(10));
    let layer = limited_waiting(store, policy, Duration::from_millis(1500));
    let service = layer.layer(endless());
    let [first, second, _] = fill_two(&service).await;
    let waiter = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let asked = tokio::time::Instant::now();
        let status = service
            .clone()
            .oneshot(request("k"))
            .await
            .unwrap()
            .status();
        (status, asked.elapsed())
    };
    let ((), (status, waited)) = futures::join!(stop_redis(&server, "sleep", 1.0), waiter);
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        waited >= Duration::from_millis(1400),
        "refused after {waited:?}, not waiting"
    );
    drop((first, second));
}

/// Two rules of one layer that share a policy (and so its slots in Redis) share its cap while
/// Redis is out of reach too (before, each rule kept the cap on its own: 4 in flight at cap 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_sharing_a_policy_share_its_cap_while_failing_open_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = streams("shared", 2, Duration::from_secs(10));
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .rule(Rule::new(policy.clone()).path("/a"))
        .rule(Rule::new(policy).path("/b"))
        .build()
        .unwrap();
    let service = layer.layer(endless());
    let to = |path: &str| {
        Request::builder()
            .uri(path)
            .header("x-api-key", "k")
            .body(())
            .unwrap()
    };
    let held = service.clone().oneshot(to("/a")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut responses = Vec::new();
        for path in ["/a", "/b", "/a", "/b"] {
            responses.push(service.clone().oneshot(to(path)).await.unwrap());
        }
        responses
    };
    let ((), responses) = futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    let statuses: Vec<_> = responses.iter().map(|r| r.status()).collect();
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 1, "{statuses:?}");
    drop((held, responses));
}

/// One stalled connection of the store's pool holds up a decision for 1.2 s while other
/// requests keep the breaker closed: the decision is answered 503, and its call lands late and
/// takes a slot nobody holds. The instance's give-back of that slot, sent again while it finds
/// nothing (at most 0.8 s apart), removes it soon after: both slots are free within 1.5 s of
/// the connection going on (before, the give-back stopped after 3 tries 100 ms apart, and the
/// slot blocked the key for its stored lifetime: 10 of 10 trials, 3.5 s at `L` = 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_held_up_on_one_stalled_connection_leaves_no_slot_taken_on_redis() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let store = RedisStore::connect(&proxy.url()).await.unwrap();
    let layer = |policy: Policy, mode: FailureMode| {
        RateLimitLayer::builder()
            .key(api_key())
            .store(store.clone())
            .policy(policy)
            .failure_mode(mode)
            .build()
            .unwrap()
            .layer(endless())
    };
    let service = layer(
        streams("one-stalled", 2, Duration::from_secs(2)),
        FailureMode::Closed,
    );
    let others = layer(
        Policy::new("others", ["1000000/1m".parse().unwrap()]).unwrap(),
        FailureMode::Open,
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            for i in 0u64.. {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let (others, key) = (others.clone(), format!("other-{}", i % 50));
                tokio::spawn(async move { drop(others.oneshot(request(&key)).await) });
                tokio::time::sleep(Duration::from_millis(7)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.pause_connection_at(b"victim");
    let held_up = service.clone().oneshot(request("victim")).await.unwrap();
    assert_eq!(held_up.status(), StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    proxy.resume();
    let took = both_slots_free(&service, "victim", Duration::from_millis(1500)).await;
    stop.store(true, Ordering::SeqCst);
    traffic.await.unwrap();
    assert!(
        took.is_some(),
        "the slot taken late was not given back within 1.5 s"
    );
}

/// A shadow layer passes requests on at the cap while Redis is out of reach, as it does over a
/// limit (before, failing open refused them for a slot: a shadow layer enforced the cap
/// during an outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_layer_refuses_nothing_while_failing_open_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(RedisStore::connect(&server.url()).await.unwrap())
        .policy(streams("shadow", 1, Duration::from_secs(10)))
        .shadow(true)
        .build()
        .unwrap();
    let service = layer.layer(endless());
    let held = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(
                service
                    .clone()
                    .oneshot(request("k"))
                    .await
                    .unwrap()
                    .status(),
            );
        }
        statuses
    };
    let ((), statuses) = futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    drop(held);
}

/// How many pairs of `order` are out of order: the number of inversions.
fn inversions(order: &[usize]) -> usize {
    let pairs = order
        .iter()
        .enumerate()
        .flat_map(|(i, a)| order[i + 1..].iter().map(move |b| (a, b)));
    pairs.filter(|(a, b)| a > b).count()
}

/// Waiters of one key on two instances get its slot in the order they came, whichever
/// instance gives it back: the store keeps their line, and a slot given back is kept for the
/// first in it. Without the line, the instance that gives a slot back wakes its own waiters at
/// once, and the other's, which look every 50 ms, lose it to them.
#[tokio::test]
async fn waiters_on_two_instances_get_slots_in_arrival_order_on_redis() {
    let server = RedisServer::start();
    let policy = streams("fleet-line", 1, Duration::from_secs(10));
    let mut instances = Vec::new();
    for _ in 0..2 {
        let store = server.store().await;
        let layer = limited_waiting(store, policy.clone(), Duration::from_secs(30));
        instances.push(layer.layer(endless()));
    }
    let held = instances[0].clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    // 20 waiters, 40 ms apart, alternating between the instances; each holds its slot 30 ms.
    let start = tokio::time::Instant::now();
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..20 {
        let (service, served) = (instances[i % 2].clone(), Arc::clone(&served));
        waiters.push(tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "waiter {i}");
            let admitted = start.elapsed();
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(response);
            served.lock().unwrap().push((i, admitted, start.elapsed()));
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    drop(held);
    let released = start.elapsed();
    for waiter in waiters {
        waiter.await.unwrap();
    }
    let served = served.lock().unwrap().clone();
    let order: Vec<usize> = served.iter().map(|&(i, _, _)| i).collect();
    // From each give-back to the next admission: the slot free, kept for the first in line.
    let mut ends = vec![released];
    ends.extend(served.iter().map(|&(_, _, ended)| ended));
    let mut gaps: Vec<Duration> = served
        .iter()
        .zip(&ends)
        .map(|(&(_, admitted, _), &ended)| admitted.saturating_sub(ended))
        .collect();
    gaps.sort();
    println!(
        "served {order:?}; gap from give-back to next admission: median {:?}, max {:?}",
        gaps[gaps.len() / 2],
        gaps[gaps.len() - 1]
    );
    assert_eq!(inversions(&order), 0, "{order:?}");
}

/// The `Retry-After` of a refusal for a slot says how long the key's slots are typically held
/// across the fleet, as the store keeps it, even on an instance that never held one.
#[tokio::test]
async fn a_slot_refusal_says_the_fleets_hold_time_on_redis() {
    let server = RedisServer::start();
    let policy = streams("fleet-hold", 2, Duration::from_secs(20));
    let holder = limited(server.store().await, policy.clone()).layer(endless());
    let fresh = limited(server.store().await, policy).layer(endless());
    refused_after_holds(
        &holder,
        &fresh,
        Duration::from_millis(2_500),
        tokio::time::sleep,
    )
    .await;
}

/// The same on one memory store shared by two layers.
#[tokio::test(start_paused = true)]
async fn a_slot_refusal_says_the_fleets_hold_time_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("fleet-hold-memory", 2, Duration::from_secs(60));
    let holder = limited(store.clone(), policy.clone()).layer(endless());
    let fresh = limited(store, policy).layer(endless());
    refused_after_holds(&holder, &fresh, Duration::from_secs(7), tokio::time::sleep).await;
}

/// `holder` takes the key's two slots and keeps them `held`, twice; then, with both held
/// again, `fresh` (which has held none) is refused with a `Retry-After` of `held`, rounded up.
async fn refused_after_holds<S, F, Fut>(holder: &S, fresh: &S, held: Duration, sleep: F)
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = ()>,
{
    for _ in 0..2 {
        let both = join_all((0..2).map(|_| holder.clone().oneshot(request("k")))).await;
        assert!(both
            .iter()
            .all(|r| r.as_ref().unwrap().status() == StatusCode::OK));
        sleep(held).await;
        drop(both);
        // The give-backs are on their way (at once on the memory store).
        sleep(Duration::from_millis(200)).await;
    }
    let _both = join_all((0..2).map(|_| holder.clone().oneshot(request("k")))).await;
    let refused = fresh.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .to_owned();
    let expected = held.as_secs_f64().ceil() as u64;
    assert_eq!(retry, expected.to_string(), "held {held:?}");
}

/// A waiter whose client goes away leaves the store's line at once: the slot it would have
/// been kept for goes to the next request, not after the waiter's deadline.
#[tokio::test]
async fn a_waiter_whose_client_leaves_gives_up_its_place_on_redis() {
    let server = RedisServer::start();
    let policy = streams("left-line", 1, Duration::from_secs(10));
    let waiting = limited_waiting(
        server.store().await,
        policy.clone(),
        Duration::from_secs(30),
    );
    let waiting = waiting.layer(endless());
    let other = limited(server.store().await, policy).layer(endless());
    let held = other.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let waiter = tokio::spawn(waiting.oneshot(request("k")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    waiter.abort();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(held);
    let took = until_admitted(&other, "k", Duration::from_secs(5)).await;
    println!("admitted {took:?} after the give-back");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// Waiters that stop waiting, on their own or because their client went away, leave the
/// store's line even when one goes with an ask on its way: once every request has ended, the
/// next is admitted at once. Before, an ask that Redis ran after the waiter's leave put it back
/// in line, and the key was refused until that waiter's deadline (until 3.4 s, in 4 of 4 runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_stop_waiting_leave_the_line_on_redis() {
    let server = RedisServer::start();
    let policy = streams("stop-waiting", 1, Duration::from_secs(10));
    let short = limited_waiting(
        server.store().await,
        policy.clone(),
        Duration::from_millis(300),
    );
    let long = limited_waiting(server.store().await, policy.clone(), Duration::from_secs(3));
    let (short, long) = (short.layer(endless()), long.layer(endless()));
    let other = limited(server.store().await, policy).layer(endless());
    let held = other.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let timed_out: Vec<_> = (0..3)
        .map(|_| tokio::spawn(short.clone().oneshot(request("k"))))
        .collect();
    let gone: Vec<_> = (0..3)
        .map(|_| {
            let call = long.clone().oneshot(request("k"));
            tokio::spawn(tokio::time::timeout(Duration::from_millis(200), call))
        })
        .collect();
    for waiter in timed_out {
        let status = waiter.await.unwrap().unwrap().status();
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    }
    for waiter in gone {
        assert!(waiter.await.unwrap().is_err(), "a waiter got the held slot");
    }
    drop(held);
    let took = until_admitted(&other, "k", Duration::from_secs(5)).await;
    println!("admitted {took:?} after the give-back");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// Waiters that lost their place in the store's line to a restart without data join it
/// again, and their instance's line follows the store's: every waiter is served, in arrival
/// order, and the slot never sits free while one waits. Before, the waiter whose place was
/// lost stayed first on its instance, where it alone asked, while the store kept the slot for
/// a later waiter that never asked: the slot sat free for 2.9 s, and that waiter was refused
/// after its whole wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_lose_their_place_to_a_restart_are_served_in_order_on_redis() {
    let mut server = RedisServer::start();
    let policy = streams("lost-place", 1, Duration::from_secs(2));
    let wait = Duration::from_secs(4);
    let a = limited_waiting(server.store().await, policy.clone(), wait).layer(endless());
    let b = limited_waiting(server.store().await, policy, wait).layer(endless());
    let held = a.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let start = tokio::time::Instant::now();
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let waiter = |name: &'static str, service: &RateLimit<_, Header, RedisStore>, hold: u64| {
        let (service, served) = (service.clone(), Arc::clone(&served));
        tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            served
                .lock()
                .unwrap()
                .push((name, response.status(), start.elapsed()));
            tokio::time::sleep(Duration::from_millis(hold)).await;
        })
    };
    let w1 = waiter("W1", &a, 700);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let w2 = waiter("W2", &a, 300);
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::task::block_in_place(|| server.restart());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = waiter("C", &b, 300);
    for task in [w1, w2, c] {
        task.await.unwrap();
    }
    drop(held);
    let served = served.lock().unwrap().clone();
    println!("{served:?}");
    let order: Vec<_> = served
        .iter()
        .map(|&(name, status, _)| (name, status))
        .collect();
    let ok = StatusCode::OK;
    assert_eq!(order, [("W1", ok), ("W2", ok), ("C", ok)]);
    // Each next one within half a second of the slot's give-back.
    assert!(
        served[1].2 < served[0].2 + Duration::from_millis(1_200),
        "{served:?}"
    );
    assert!(
        served[2].2 < served[1].2 + Duration::from_millis(800),
        "{served:?}"
    );
}

/// Waiters decided in one call to Redis share a deadline there: the store orders them by id,
/// and so does their instance, whose first in line is then the store's first. Before, the
/// instance ordered them by arrival of the answers: its first asked again and again behind a
/// waiter that never did, and most were refused after their whole wait with the slot free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_decided_together_are_all_served_on_redis() {
    let server = RedisServer::start();
    let policy = streams("together", 1, Duration::from_secs(10));
    let waiting = limited_waiting(server.store().await, policy, Duration::from_secs(6));
    let service = waiting.layer(endless());
    let held = service.clone().oneshot(request("k")).await.unwrap();
    let waiters: Vec<_> = (0..20)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move {
                let response = service.oneshot(request("k")).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
                response.status()
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = tokio::time::Instant::now();
    drop(held);
    let statuses = join_all(waiters).await;
    let served = statuses
        .iter()
        .filter(|s| *s.as_ref().unwrap() == StatusCode::OK)
        .count();
    println!("{served} of 20 served in {:?}", started.elapsed());
    assert_eq!(served, 20);
}

/// A waiter whose first answer never comes (its decision timed out while Redis slept) may
/// still have been put in line when Redis woke: it leaves the line all the same, so the slot
/// is not kept for it until its deadline.
#[tokio::test]
async fn a_waiter_whose_first_answer_is_lost_leaves_the_line_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("lost-ask", 1, Duration::from_secs(10));
    let plain = closed(&server.url(), policy.clone()).await.layer(endless());
    let waiting = RateLimitLayer::builder()
        .key(api_key())
        .store(server.store().await)
        .policy(policy)
        .failure_mode(FailureMode::Closed)
        .max_wait(Duration::from_secs(8))
        .build()
        .unwrap()
        .layer(endless());
    let held = plain.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    // The layer (and its store) lives on: it sends what its requests leave behind.
    let ask = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiting
            .clone()
            .oneshot(request("k"))
            .await
            .unwrap()
            .status()
    };
    let (_, status) = futures::join!(stop_redis(&server, "sleep", 0.3), ask);
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the decision timed out"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);
    let took = until_admitted(&plain, "k", Duration::from_secs(5)).await;
    println!("admitted {took:?} after the give-back");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// A layer failing open that holds the key's cap answers its waiters' failed asks with a
/// refusal of its own; the asks may still have put them in the store's line (a stalled Redis
/// runs them when it wakes). A waiter that stops leaves the line all the same: `queued`, one
/// whose client left during the outage; `lost`, one whose first ask was held up past its
/// whole wait. The key is free within a second of Redis answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_failing_open_leaves_the_line_it_may_be_in_on_redis() {
    for case in ["queued", "lost"] {
        let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let policy = streams(&format!("open-{case}"), 1, Duration::from_secs(10));
        let plain = closed(&server.url(), policy.clone()).await.layer(endless());
        let wait = match case {
            "queued" => Duration::from_secs(8),
            _ => Duration::from_secs(2),
        };
        let waiting = RateLimitLayer::builder()
            .key(api_key())
            .store(server.store().await)
            .policy(policy)
            .failure_mode(FailureMode::Open)
            .max_wait(wait)
            .build()
            .unwrap()
            .layer(endless());
        // This layer holds the cap, so that failing open it refuses its waiters itself.
        let held = waiting.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(held.status(), StatusCode::OK);
        let stall = match case {
            "queued" => 1.5,
            _ => 3.0,
        };
        let waiter = tokio::spawn({
            let waiting = waiting.clone();
            async move {
                if case == "lost" {
                    // Asked while Redis sleeps: the ask waits for it, past the whole wait.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                waiting.oneshot(request("k")).await.unwrap().status()
            }
        });
        if case == "queued" {
            // In the store's line before the stall.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let outage = tokio::spawn({
            let port = server.port();
            async move {
                tokio::task::spawn_blocking(move || {
                    common::cluster::cli(port, &["DEBUG", "SLEEP", &stall.to_string()]);
                })
                .await
                .unwrap();
            }
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        match case {
            // Its client leaves during the outage.
            "queued" => waiter.abort(),
            // It gives up at its deadline, during the outage.
            _ => assert_eq!(waiter.await.unwrap(), StatusCode::TOO_MANY_REQUESTS),
        }
        drop(held);
        outage.await.unwrap();
        let took = until_admitted(&plain, "k", Duration::from_secs(8)).await;
        println!("{case}: admitted {took:?} after Redis woke");
        assert!(took < Duration::from_secs(1), "{case}: {took:?}");
    }
}
