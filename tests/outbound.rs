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
use tower_redis_ratelimit::client::{OutboundError, OutboundLayer};
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

fn ten_per_second() -> Policy {
    "10/1s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

#[tokio::test(start_paused = true)]
async fn four_workers_share_ten_per_second_in_turn() {
    let arrivals: Arrivals = Arc::default();
    let layer = OutboundLayer::builder()
        .policy(ten_per_second())
        .max_wait(Duration::from_secs(60))
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layer)
        .service(upstream(arrivals.clone()));
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
    let spread = *finished.iter().max().unwrap() - *finished.iter().min().unwrap();
    assert!(
        spread <= Duration::from_secs(1),
        "the workers finished {spread:?} apart"
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
    let layer = OutboundLayer::builder()
        .policy(policy.clone())
        .store(store.clone())
        .max_wait(Duration::from_secs(60))
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layer)
        .service(upstream(arrivals.clone()));
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
    let layer = OutboundLayer::builder()
        .policy(ten_per_second())
        .max_wait(Duration::from_millis(500))
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layer)
        .service(upstream(Arrivals::default()));
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
