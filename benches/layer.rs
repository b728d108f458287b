//! What each limiter adds to one request through an axum router, in process (no sockets, so
//! the machine's network noise stays out): the hello-world route bare, behind this crate's
//! layer on the memory store, and behind `tower_governor`, on the same 1000 keys with limits
//! nothing reaches; and a flood of one refused key answered from the deny cache.
//! `cargo bench --bench layer`.
//!
//! Uploads (group `upload`): a 1 MiB request body through a route whose handler reads it
//! frame by frame, limited in bytes by a `.cost` read from `Content-Length` (one decision, the
//! baseline), or metered as it streams (`request_bytes`, steps of 64 KiB): declared (one
//! decision too) or chunked (16 frames of 64 KiB, no length: a decision per step).
//! `cargo bench --bench layer -- upload`.
//!
//! Times on a shared machine are noisy, so the bench can also count instructions: with
//! `LAYER_REQUESTS=<router>:<n>` set it sends `n` requests (after 2000 to warm up) through one
//! of the routers below, by its name in the table, and exits without timing anything. Run it
//! under `valgrind --tool=callgrind` for two values of `n`; the difference of the totals over the
//! difference of `n` is the instructions per request. Runs differ only by a few hundred
//! instructions (random hash seeds, maps growing at other moments), however busy the machine
//! (README, Performance).

use std::convert::Infallible;
use std::hint::black_box;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::routing::{get, post};
use axum::Router;
use criterion::{criterion_group, Criterion};
use futures::executor::block_on;
use http::{HeaderName, HeaderValue, Request};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;
use tower_governor::{GovernorError, GovernorLayer};
use tower_redis_ratelimit::metered::RequestBytes;
use tower_redis_ratelimit::test_util::FaultyStore;
use tower_redis_ratelimit::{Algorithm, Header, MemoryStore, Policy, RateLimitLayer};

const KEYS: usize = 1000;
const CLIENT: &str = "x-client";

fn route() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

fn ours(algorithm: Algorithm, headers: bool) -> Router {
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static(CLIENT)))
        .policy(
            "1000000/1s"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(algorithm),
        )
        .headers_on_allowed(headers)
        .build()
        .unwrap();
    route().layer(layer)
}

/// A flood on one key already over `1/1h`, refused by the deny cache.
fn flood() -> Router {
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static(CLIENT)))
        .policy("1/1h")
        // The memory store answering as a remote one, so that the layer keeps its deny cache
        // on, as it does for Redis: the refusals a flood gets then come from the cache.
        .store(FaultyStore::new(MemoryStore::new()).remote())
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

fn status(router: &Router, client: &HeaderValue) -> Result<u16, Infallible> {
    let request = Request::get("/")
        .header(CLIENT, client.clone())
        .body(Body::empty())
        .unwrap();
    let response = block_on(router.clone().oneshot(request))?;
    Ok(response.status().as_u16())
}

fn routers() -> [(&'static str, Router); 5] {
    [
        ("bare", route()),
        ("ours_memory_gcra_no_headers", ours(Algorithm::Gcra, false)),
        ("ours_memory_gcra", ours(Algorithm::Gcra, true)),
        ("ours_memory_sliding_log", ours(Algorithm::SlidingLog, true)),
        ("tower_governor", governor()),
    ]
}

fn per_request(c: &mut Criterion) {
    let clients = requests();
    let mut group = c.benchmark_group("request");
    for (name, router) in routers() {
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % KEYS;
                assert_eq!(status(black_box(&router), &clients[i]).unwrap(), 200);
            })
        });
    }
    let (router, client) = (flood(), HeaderValue::from_static("flooder"));
    assert_eq!(status(&router, &client).unwrap(), 200);
    group.bench_function("ours_denied_flood_deny_cache", |b| {
        b.iter(|| assert_eq!(status(black_box(&router), &client).unwrap(), 429))
    });
    group.finish();
}

/// `LAYER_REQUESTS=<router>:<n>`: sends 2000 + `n` requests through that router, untimed.
fn count_only(spec: &str) {
    let (name, n) = spec
        .split_once(':')
        .expect("LAYER_REQUESTS is <router>:<requests>");
    let n: usize = n.parse().expect("a number of requests");
    let (_, router) = routers()
        .into_iter()
        .find(|(known, _)| *known == name)
        .unwrap_or_else(|| panic!("no router named {name:?}"));
    let clients = requests();
    for i in 0..2000 + n {
        assert_eq!(status(&router, &clients[i % KEYS]).unwrap(), 200);
    }
}

/// The bytes of an upload, and of each of its frames when it is chunked.
const UPLOAD: usize = 1 << 20;
const FRAME: usize = 64 * 1024;
/// Bytes per second per key that no upload reaches.
const BYTES: &str = "1000000000/1s";

/// A route that reads its upload frame by frame, without copying it, and answers its length
/// (`collect`: that takes it whole, with axum's `Bytes` extractor, which copies a body of
/// several frames into one buffer, as a handler that stores uploads would).
fn upload_route(collect: bool) -> Router {
    async fn whole(body: Bytes) -> String {
        body.len().to_string()
    }
    if collect {
        return Router::new().route("/upload", post(whole));
    }
    async fn read(body: Body) -> String {
        let mut body = body;
        let mut bytes = 0;
        while let Some(frame) = body.frame().await {
            let frame = frame.expect("not cut: the limit is never reached");
            bytes += frame.data_ref().map_or(0, Bytes::len);
        }
        bytes.to_string()
    }
    Router::new().route("/upload", post(read))
}

fn bytes_policy() -> Policy {
    BYTES
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::Gcra)
}

/// The upload route limited by a cost read from `Content-Length` (1 without one).
fn upload_costed(collect: bool) -> Router {
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static(CLIENT)))
        .policy(bytes_policy())
        .cost(|head| {
            let length = head.headers.get(http::header::CONTENT_LENGTH);
            let length = length.and_then(|v| v.to_str().ok()?.parse().ok());
            length.unwrap_or(1)
        })
        .build()
        .unwrap();
    upload_route(collect).layer(layer)
}

/// The upload route with its request bodies metered as they stream.
fn upload_metered(collect: bool) -> Router {
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static(CLIENT)))
        .policy(bytes_policy())
        .request_bytes(RequestBytes::new().step(FRAME as u32))
        .build()
        .unwrap();
    upload_route(collect).layer(layer)
}

/// A 1 MiB upload of `client`: declared (`Content-Length`, one frame) or chunked (frames of
/// 64 KiB, no length). The bytes are shared, not copied.
fn upload(data: &Bytes, client: &HeaderValue, declared: bool) -> Request<Body> {
    let request = Request::post("/upload").header(CLIENT, client.clone());
    if declared {
        let request = request.header(http::header::CONTENT_LENGTH, UPLOAD);
        return request.body(Body::from(data.clone())).unwrap();
    }
    let frames: Vec<Result<Bytes, Infallible>> = (0..UPLOAD / FRAME)
        .map(|i| Ok(data.slice(i * FRAME..(i + 1) * FRAME)))
        .collect();
    let stream = futures::stream::iter(frames);
    request.body(Body::from_stream(stream)).unwrap()
}

fn per_upload(c: &mut Criterion) {
    let (clients, data) = (requests(), Bytes::from(vec![7u8; UPLOAD]));
    let mut group = c.benchmark_group("upload");
    let routes = [
        ("cost_content_length_declared", upload_costed(false), true),
        ("metered_declared", upload_metered(false), true),
        ("cost_content_length_chunked", upload_costed(false), false),
        ("metered_chunked", upload_metered(false), false),
        (
            "collected/cost_content_length_chunked",
            upload_costed(true),
            false,
        ),
        ("collected/metered_chunked", upload_metered(true), false),
    ];
    for (name, router, declared) in routes {
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % KEYS;
                let request = upload(&data, &clients[i], declared);
                let response = block_on(black_box(&router).clone().oneshot(request)).unwrap();
                assert_eq!(response.status(), 200);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, per_request, per_upload);

fn main() {
    if let Ok(spec) = std::env::var("LAYER_REQUESTS") {
        return count_only(&spec);
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
