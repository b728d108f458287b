//! The outbound layer against a real Redis and a local stand-in for a third-party API that
//! allows 10 requests per second (any second) and answers 429 beyond: four workers, each
//! with a store of its own, share the API's limit through Redis.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::client::OutboundLayer;
use tower_redis_ratelimit::{Algorithm, Policy};

/// Arrival times at the stand-in.
type Arrivals = Arc<Mutex<Vec<Instant>>>;

/// The stand-in: 10 per second over any second; beyond, 429 with `Retry-After: 1`.
async fn stand_in() -> (SocketAddr, Arrivals) {
    let arrivals: Arrivals = Arc::default();
    let seen = arrivals.clone();
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let seen = seen.clone();
            async move {
                let now = Instant::now();
                let mut seen = seen.lock().unwrap();
                let last_second = seen.iter().filter(|&&t| t + Duration::from_secs(1) > now);
                if last_second.count() >= 10 {
                    return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]).into_response();
                }
                seen.push(now);
                StatusCode::OK.into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, arrivals)
}

use axum::response::IntoResponse;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_share_the_upstream_limit_through_redis() {
    let server = common::RedisServer::start();
    let (addr, arrivals) = stand_in().await;
    // 10 per second, and one per 50 ms (100 ms with the layer's 50 ms margin): turns spaced,
    // so that a worker served asks again behind the others (with 10 turns at one instant,
    // whoever answers first takes more of them).
    let limits = ["10/1s".parse().unwrap(), "1/50ms".parse().unwrap()];
    let policy = Policy::new("api", limits)
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..4 {
        let layer = OutboundLayer::builder()
            .policy(policy.clone())
            .store(server.store().await)
            .max_wait(Duration::from_secs(30))
            .build()
            .unwrap();
        let http = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let mut client = ServiceBuilder::new().layer(layer).service(http);
        workers.push(tokio::spawn(async move {
            let mut refused = 0;
            for _ in 0..30 {
                let request = http::Request::get(format!("http://{addr}/")).body(Empty::new());
                let response = client.ready().await.unwrap().call(request.unwrap()).await;
                refused += usize::from(response.unwrap().status() == StatusCode::TOO_MANY_REQUESTS);
            }
            (Instant::now(), refused)
        }));
    }
    let mut finished = Vec::new();
    let mut refused = 0;
    for worker in workers {
        let (at, r) = worker.await.unwrap();
        finished.push(at);
        refused += r;
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let took = *finished.iter().max().unwrap() - start;
    let spread = *finished.iter().max().unwrap() - *finished.iter().min().unwrap();
    let fullest = arrivals
        .iter()
        .map(|&t| {
            arrivals
                .iter()
                .filter(|&&s| s <= t && s + Duration::from_secs(1) > t)
                .count()
        })
        .max()
        .unwrap_or(0);
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
}
