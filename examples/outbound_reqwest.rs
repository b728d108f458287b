//! reqwest calls that wait their turn: three instances, each with a reqwest client and a
//! `RedisStore` of its own (as three processes of a fleet would have), share a third-party
//! API's limit through Redis, with `OutboundMiddleware` in their reqwest-middleware chain. The
//! API is a local stand-in that allows 10 requests in any second and answers `429` beyond; it
//! also pushes back once, on its 15th request, with `429` and `Retry-After: 1`, which pauses
//! every instance for a second. The stand-in prints what it saw, second by second.
//!
//! ```text
//! cargo run --example outbound_reqwest --features redis,reqwest
//! ```
//!
//! Uses `REDIS_URL` if set; otherwise starts its own `redis-server` on a free loopback port.

#[path = "support/redis.rs"]
#[allow(dead_code)]
mod scratch;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::IntoResponse;
use http::StatusCode;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tokio::time::Instant;
use tower_redis_ratelimit::client::{OutboundError, OutboundLayer, OutboundMiddleware};
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
    let policy = Policy::new("provider", ["10/1s".parse()?])?.with_algorithm(Algorithm::SlidingLog);
    let start = Instant::now();
    let mut instances = Vec::new();
    for instance in 0..3 {
        let layer = OutboundLayer::builder()
            .policy(policy.clone())
            .store(RedisStore::connect(&url).await?)
            .max_wait(Duration::from_secs(30))
            .build()?;
        let middleware: OutboundMiddleware<RedisStore> = layer.middleware();
        // No proxy: the stand-in is on loopback.
        let http = reqwest::Client::builder().no_proxy().build()?;
        let client: ClientWithMiddleware = ClientBuilder::new(http).with(middleware).build();
        instances.push(tokio::spawn(run(instance, client, api, start)));
    }
    for instance in instances {
        instance.await?;
    }
    report(&seen.lock().unwrap(), start);
    Ok(())
}

/// An instance's 10 calls, sent at once: they wait for their turns in the middleware.
async fn run(instance: usize, client: ClientWithMiddleware, api: SocketAddr, start: Instant) {
    let calls: Vec<_> = (0..10)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.get(format!("http://{api}/")).send().await })
        })
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        match call.await {
            Ok(Ok(response)) => statuses.push(response.status()),
            Ok(Err(error)) => eprintln!("instance {instance}: {}", explain(&error)),
            Err(error) => eprintln!("instance {instance}: {error}"),
        }
    }
    println!(
        "instance {instance}: {} answered by {:.1} s, {} refused",
        statuses.len(),
        start.elapsed().as_secs_f64(),
        statuses.iter().filter(|s| **s != StatusCode::OK).count()
    );
}

/// What a failed call says: the middleware's `OutboundError` (a call that did not go out) or
/// reqwest's, with their causes.
fn explain(error: &reqwest_middleware::Error) -> String {
    match error {
        reqwest_middleware::Error::Middleware(error) => {
            match error.downcast_ref::<OutboundError<Infallible>>() {
                Some(OutboundError::TooLate { turn }) => format!("not sent: turn in {turn:?}"),
                _ => format!("not sent: {error:#}"),
            }
        }
        reqwest_middleware::Error::Reqwest(error) => {
            let mut text = error.to_string();
            let mut source = std::error::Error::source(error);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        }
    }
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
                let refused = served.count() >= 10 || seen.len() + 1 == 15;
                seen.push((now, refused));
                match refused {
                    true => (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]).into_response(),
                    false => StatusCode::OK.into_response(),
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
