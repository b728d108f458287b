//! The outbound layer on the memory store, on tokio's paused clock: calls wait for their turn
//! under the upstream's limit, in reservation order, and a call dropped while waiting gives
//! its turn back.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::client::{Outbound, OutboundError, OutboundLayer};
use tower_redis_ratelimit::key::Global;
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, Store};

type Arrivals = Arc<Mutex<Vec<(Instant, u64)>>>;

/// The upstream: records when each request arrives, and the number it carries, and answers
/// 5 ms later (a call takes time, so the workers' calls interleave as over a network).
fn upstream(arrivals: Arrivals) -> BoxCloneService<Request<u64>, Response<()>, Infallible> {
    BoxCloneService::new(tower::service_fn(move |request: Request<u64>| {
        let arrivals = arrivals.clone();
        async move {
            arrivals
                .lock()
                .unwrap()
                .push((Instant::now(), *request.body()));
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok::<_, Infallible>(Response::new(()))
        }
    }))
}

/// `upstream` behind an outbound layer of `policy` over `store`, whose calls wait for their
/// turn up to `max_wait`.
fn client<S>(
    policy: Policy,
    store: MemoryStore,
    max_wait: Duration,
    upstream: S,
) -> Outbound<S, Global, MemoryStore> {
    let layer = OutboundLayer::builder()
        .policy(policy)
        .store(store)
        .max_wait(max_wait)
        .build()
        .unwrap();
    ServiceBuilder::new().layer(layer).service(upstream)
}

fn ten_per_second() -> Policy {
    "10/1s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

#[tokio::test(start_paused = true)]
async fn four_workers_share_ten_per_second_in_turn() {
    let arrivals: Arrivals = Arc::default();
    let client = client(
        ten_per_second(),
        MemoryStore::new(),
        Duration::from_secs(60),
        upstream(arrivals.clone()),
    );
    let start = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let workers = (0..4).map(|_| {
        let (mut client, next) = (client.clone(), next.clone());
        tokio::spawn(async move {
            for _ in 0..30 {
                let number = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let call = client.ready().await.unwrap().call(Request::new(number));
                call.await.unwrap();
            }
            Instant::now()
        })
    });
    let finished: Vec<Instant> = futures::future::join_all(workers)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 120);
    for &(t, _) in &arrivals {
        let held = arrivals
            .iter()
            .filter(|&&(s, _)| s <= t && s + Duration::from_secs(1) > t)
            .count();
        assert!(
            held <= 10,
            "{held} arrived in the second ending {:?} in",
            t - start
        );
    }
    // Ten at 0 s, 1 s, ..., 11 s: the ideal, 12 s of budget for 120 calls.
    let took = finished.iter().max().unwrap().duration_since(start);
    assert!(took <= Duration::from_secs(12).mul_f64(1.15), "{took:?}");
    // Within a tenth of the run of each other (the last round of turns may fall on both
    // sides of a window's start: docs/outbound.md, "Turns at one instant").
    let spread = *finished.iter().max().unwrap() - *finished.iter().min().unwrap();
    assert!(
        spread <= took / 10,
        "the workers finished {spread:?} apart in {took:?}"
    );
    // In reservation order: a call reserved before another never arrives after it.
    for &(t, n) in &arrivals {
        let overtaken = arrivals.iter().filter(|&&(s, m)| m < n && s > t).count();
        assert_eq!(
            overtaken, 0,
            "call {n} arrived before {overtaken} reserved earlier"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn calls_dropped_while_waiting_give_their_turns_back() {
    let arrivals: Arrivals = Arc::default();
    let store = MemoryStore::new();
    let policy = ten_per_second();
    let client = client(
        policy.clone(),
        store.clone(),
        Duration::from_secs(60),
        upstream(arrivals.clone()),
    );
    // Twenty calls: ten go at once, ten wait for 1 s; those ten are dropped.
    let calls: Vec<_> = (0..20)
        .map(|n| tokio::spawn(client.clone().oneshot(Request::new(n))))
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for call in &calls[10..] {
        call.abort();
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let key = Key::from("global");
    let at_one = store.peek(&key, &policy, 1).await.unwrap();
    assert!(!at_one.is_allowed(), "the first ten still hold the window");
    // Just past 1 s the first ten have left the window, and the dropped calls' turns (at
    // 1 s) were given back: all ten units are free.
    tokio::time::advance(Duration::from_millis(900)).await;
    let free = store.peek(&key, &policy, 1).await.unwrap();
    assert_eq!(
        free.remaining(),
        10,
        "the dropped calls' turns were given back: {free:?}"
    );
    let more: Vec<_> = (20..30)
        .map(|n| tokio::spawn(client.clone().oneshot(Request::new(n))))
        .collect();
    for call in more {
        call.await.unwrap().unwrap();
    }
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 20, "ten at once, ten after the drops");
}

#[tokio::test(start_paused = true)]
async fn a_turn_past_max_wait_fails_at_once() {
    let client = client(
        ten_per_second(),
        MemoryStore::new(),
        Duration::from_millis(500),
        upstream(Arrivals::default()),
    );
    let start = Instant::now();
    for n in 0..10 {
        client.clone().oneshot(Request::new(n)).await.unwrap();
    }
    let late = client.clone().oneshot(Request::new(10)).await;
    match late {
        // When the first of the ten leaves the window read 50 ms longer (the layer's default
        // margin); each call took 5 ms.
        Err(OutboundError::TooLate { turn }) => {
            let window = Duration::from_millis(1_050);
            assert_eq!(turn, Some(window - start.elapsed()))
        }
        other => panic!("expected TooLate, got {other:?}"),
    }
}

/// The upstream's limit, as the fleet tests use it: 10 per second, and one per 50 ms (100 ms
/// with the layer's margin), so that turns come one at a time.
fn spaced() -> Policy {
    let limits = ["10/1s".parse().unwrap(), "1/50ms".parse().unwrap()];
    Policy::new("api", limits)
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

/// Arrivals per second at the upstream, after `since`: the calls that arrived after it, over
/// the time from it to the last of them.
fn rate_after(arrivals: &[(Instant, u64)], since: Instant) -> (usize, f64) {
    let after: Vec<Instant> = arrivals
        .iter()
        .map(|&(t, _)| t)
        .filter(|&t| t > since)
        .collect();
    let last = after.iter().max().copied().unwrap_or(since);
    let span = (last - since).as_secs_f64();
    (after.len(), after.len() as f64 / span)
}

#[tokio::test(start_paused = true)]
async fn cancelling_half_of_the_waiting_calls_keeps_the_rest_at_the_full_rate() {
    let arrivals: Arrivals = Arc::default();
    let store = MemoryStore::new();
    let client = client(
        spaced(),
        store.clone(),
        Duration::from_secs(60),
        upstream(arrivals.clone()),
    );
    let calls: Vec<_> = (0..60)
        .map(|n| tokio::spawn(client.clone().oneshot(Request::new(n))))
        .collect();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let cancelled = Instant::now();
    let mut kept = Vec::new();
    for (n, call) in calls.into_iter().enumerate() {
        match n % 2 == 1 && !call.is_finished() {
            true => call.abort(),
            false => kept.push(call),
        }
    }
    for call in kept {
        call.await.unwrap().unwrap();
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let (count, rate) = rate_after(&arrivals, cancelled);
    println!("{count} calls after the cancellations, at {rate:.2} per second");
    assert!(rate >= 9.0, "{rate:.2} per second");
    // Nothing is left reserved: ten calls go at once.
    tokio::time::advance(Duration::from_secs(2)).await;
    let free = store
        .peek(&Key::from("global"), &spaced(), 1)
        .await
        .unwrap();
    assert_eq!(free.remaining(), 1, "{free:?}");
}

#[tokio::test(start_paused = true)]
async fn an_upstream_429_pauses_every_call_for_its_retry_after() {
    let arrivals: Arrivals = Arc::default();
    let refused_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let upstream = {
        let (arrivals, refused_once) = (arrivals.clone(), refused_once.clone());
        tower::service_fn(move |request: Request<u64>| {
            let (arrivals, refused_once) = (arrivals.clone(), refused_once.clone());
            async move {
                let n = *request.body();
                arrivals.lock().unwrap().push((Instant::now(), n));
                let refuse =
                    n == 14 && !refused_once.swap(true, std::sync::atomic::Ordering::SeqCst);
                let status = match refuse {
                    true => http::StatusCode::TOO_MANY_REQUESTS,
                    false => http::StatusCode::OK,
                };
                let response = Response::builder()
                    .status(status)
                    .header("retry-after", "2")
                    .body(())
                    .unwrap();
                Ok::<_, Infallible>(response)
            }
        })
    };
    let client = client(
        spaced(),
        MemoryStore::new(),
        Duration::from_secs(60),
        upstream,
    );
    let calls: Vec<_> = (0..30)
        .map(|n| tokio::spawn(client.clone().oneshot(Request::new(n))))
        .collect();
    let mut refused = 0;
    for call in calls {
        let response = call.await.unwrap().unwrap();
        refused += usize::from(response.status() == http::StatusCode::TOO_MANY_REQUESTS);
    }
    assert_eq!(refused, 1);
    let arrivals = arrivals.lock().unwrap().clone();
    let at_429 = arrivals.iter().find(|&&(_, n)| n == 14).unwrap().0;
    let during: Vec<_> = arrivals
        .iter()
        .filter(|&&(t, _)| t > at_429 && t < at_429 + Duration::from_secs(2))
        .collect();
    assert!(during.is_empty(), "sent during the pause: {during:?}");
    let after = arrivals.iter().filter(|&&(t, _)| t > at_429).count();
    assert_eq!(after, 15, "every call resumed after the pause");
    let first_after = arrivals
        .iter()
        .map(|&(t, _)| t)
        .filter(|&t| t > at_429)
        .min()
        .unwrap();
    println!("resumed {:?} after the 429", first_after - at_429);
}

/// Work that is not an HTTP call waits through `Turns`: turns come at the policy's rate, a
/// wait dropped before its turn gives its place back (the one behind it moves up), and a
/// pause delays the next.
#[tokio::test(start_paused = true)]
async fn turns_wait_without_http_and_a_dropped_wait_gives_its_place_back() {
    let layer = OutboundLayer::builder()
        .policy(
            "1/1s"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(Algorithm::Gcra),
        )
        .margin(Duration::ZERO)
        .build()
        .unwrap();
    let turns = layer.turns();
    let start = Instant::now();
    let key = Key::from("mail");
    turns.wait(key.clone(), 1).await.unwrap().go();
    // The second wait, dropped before its turn while the third waits behind it.
    let second = tokio::spawn(turns.wait(key.clone(), 1));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let third = tokio::spawn({
        let turns = turns.clone();
        let key = key.clone();
        async move {
            let turn = turns.wait(key, 1).await.unwrap();
            let at = Instant::now();
            turn.go();
            at
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    second.abort();
    let third = third.await.unwrap() - start;
    assert!(
        third < Duration::from_millis(1500),
        "{third:?}: not moved up"
    );
    turns.pause(&key, Duration::from_secs(5));
    tokio::task::yield_now().await;
    let paused = Instant::now();
    turns.wait(key, 1).await.unwrap().go();
    assert!(Instant::now() - paused >= Duration::from_secs(5));
    // A cost of zero is refused by the store.
    let zero = layer.turns().wait(Key::from("mail"), 0).await;
    assert!(matches!(zero, Err(OutboundError::Store(_))));
}
