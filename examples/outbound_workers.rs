//! Outbound calls that wait their turn: four workers, each with a store of its own (as four
//! processes of a fleet would have), share a third-party API's limit through Redis. The API is
//! a local stand-in that allows 10 requests in any second and answers `429` beyond; it also
//! pushes back once, on its 25th request, with `429` and `Retry-After: 2`, which pauses every
//! worker for two seconds. The stand-in prints what it saw, second by second.
//!
//! ```text
//! cargo run --example outbound_workers --features redis
//! ```
//!
//! Uses `REDIS_URL` if set; otherwise starts its own `redis-server` on a free loopback port.

#[path = "support/redis.rs"]
#[allow(dead_code)]
mod scratch;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::IntoResponse;
use bytes::Bytes;
use http::StatusCode;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::client::OutboundLayer;
use tower_redis_ratelimit::{Algorithm, Policy, RedisStore};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// When each request reached the stand-in, and whether it was refused.
type Seen = Arc<Mutex<Vec<(Instant, bool)>>>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = scratch::Scratch::start(0)?;
            (server.url(), Some(server))
        }
    };
    let seen: Seen = Arc::default();
    let api = stand_in(seen.clone()).await?;
    // The provider's limit, 10 in any second, with turns at least 50 ms apart (100 ms with the
    // layer's margin for the network), so that the workers take turns one at a time.
    let limits = ["10/1s".parse()?, "1/50ms".parse()?];
    let policy = Policy::new("provider", limits)?.with_algorithm(Algorithm::SlidingLog);
    // Every worker's client first (each connects a store of its own), then all start at
    // once: a worker that starts after the first second's turns were taken (connecting takes
    // about 10 ms here) starts that many turns behind, and stays behind.
    let mut clients = Vec::new();
    for _ in 0..4 {
        let layer = OutboundLayer::builder()
            .policy(policy.clone())
            .store(RedisStore::connect(&url).await?)
            .max_wait(Duration::from_secs(30))
            .build()?;
        let http = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        clients.push(ServiceBuilder::new().layer(layer).service(http));
    }
    let start = Instant::now();
    let mut workers = Vec::new();
    for (worker, mut client) in clients.into_iter().enumerate() {
        workers.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..15 {
                let request = http::Request::get(format!("http://{api}/")).body(Empty::new());
                let response = client.ready().await?.call(request?).await?;
                statuses.push(response.status());
            }
            println!(
                "worker {worker}: 15 calls in {:.1} s, {} refused",
                start.elapsed().as_secs_f64(),
                statuses.iter().filter(|s| **s != StatusCode::OK).count()
            );
            Ok::<_, Error>(())
        }));
    }
    for worker in workers {
        worker.await??;
    }
    report(&seen.lock().unwrap(), start);
    Ok(())
}

/// The stand-in API, on a free loopback port.
async fn stand_in(seen: Seen) -> Result<SocketAddr, Error> {
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
                let wait = match (served.count() >= 10, seen.len() + 1 == 25) {
                    (true, _) => Some("1"),
                    (false, true) => Some("2"),
                    (false, false) => None,
                };
                seen.push((now, wait.is_some()));
                match wait {
                    Some(wait) => {
                        (StatusCode::TOO_MANY_REQUESTS, [("retry-after", wait)]).into_response()
                    }
                    None => StatusCode::OK.into_response(),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// What the stand-in saw in each second of the run, and the most it served in any second.
fn report(seen: &[(Instant, bool)], start: Instant) {
    let last = seen
        .iter()
        .map(|&(t, _)| t - start)
        .max()
        .unwrap_or_default();
    println!("\nsecond  served  refused");
    for s in 0..=last.as_secs() {
        let at = |&&(t, _): &&(Instant, bool)| (t - start).as_secs() == s;
        let served = seen.iter().filter(at).filter(|&&(_, r)| !r).count();
        let refused = seen.iter().filter(at).filter(|&&(_, r)| r).count();
        println!("{s:>6}  {served:>6}  {refused:>7}");
    }
    let served: Vec<Instant> = seen.iter().filter(|&&(_, r)| !r).map(|&(t, _)| t).collect();
    let fullest = served
        .iter()
        .map(|&t| {
            let window = |&&s: &&Instant| s <= t && s + Duration::from_secs(1) > t;
            served.iter().filter(window).count()
        })
        .max()
        .unwrap_or(0);
    println!(
        "\n{} served, {} refused, at most {fullest} in any second, {:.1} s in all",
        served.len(),
        seen.len() - served.len(),
        last.as_secs_f64()
    );
}
