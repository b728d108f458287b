//! What each limiter adds to one request through an axum router, in process (no sockets, so
//! the machine's network noise stays out): the hello-world route bare, behind this crate's
//! layer on the memory store, and behind `tower_governor`, on the same 1000 keys with limits
//! nothing reaches. `cargo bench --bench layer`.

use std::convert::Infallible;
use std::hint::black_box;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use criterion::{criterion_group, criterion_main, Criterion};
use futures::executor::block_on;
use http::{HeaderName, HeaderValue, Request};
use tower::ServiceExt;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;
use tower_governor::{GovernorError, GovernorLayer};
use tower_redis_ratelimit::{Algorithm, Header, RateLimitLayer};

const KEYS: usize = 1000;
const CLIENT: &str = "x-client";

fn route() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

fn ours(algorithm: Algorithm, headers: bool) -> Router {
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static(CLIENT)))
        .policy("1000000/1s")
        .algorithm(algorithm)
        .headers_on_allowed(headers)
        .build()
        .unwrap();
    route().layer(layer)
}

#[derive(Debug, Clone, Copy)]
struct ClientHeader;

impl KeyExtractor for ClientHeader {
    type Key = HeaderValue;

    fn extract<T>(&self, request: &Request<T>) -> Result<HeaderValue, GovernorError> {
        let value = request.headers().get(CLIENT);
        value.cloned().ok_or(GovernorError::UnableToExtractKey)
    }
}

fn governor() -> Router {
    let config = GovernorConfigBuilder::default()
        .key_extractor(ClientHeader)
        .period(Duration::from_micros(1))
        .burst_size(1_000_000)
        .finish()
        .unwrap();
    route().layer(GovernorLayer::new(config))
}

fn requests() -> Vec<HeaderValue> {
    (0..KEYS)
        .map(|i| HeaderValue::from_str(&format!("c{i}")).unwrap())
        .collect()
}

fn one(router: &Router, client: &HeaderValue) -> Result<bool, Infallible> {
    let request = Request::get("/")
        .header(CLIENT, client.clone())
        .body(Body::empty())
        .unwrap();
    let response = block_on(router.clone().oneshot(request))?;
    Ok(response.status().is_success())
}

fn per_request(c: &mut Criterion) {
    let clients = requests();
    let mut group = c.benchmark_group("request");
    let routers = [
        ("bare", route()),
        ("ours_memory_gcra_no_headers", ours(Algorithm::Gcra, false)),
        ("ours_memory_gcra", ours(Algorithm::Gcra, true)),
        ("ours_memory_sliding_log", ours(Algorithm::SlidingLog, true)),
        ("tower_governor", governor()),
    ];
    for (name, router) in routers {
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % KEYS;
                assert!(one(black_box(&router), &clients[i]).unwrap());
            })
        });
    }
    group.finish();
}

criterion_group!(benches, per_request);
criterion_main!(benches);
