//! The layer in the servers users run: axum, a plain hyper server, a tower `ServiceBuilder`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use crate::support::http::{get as fetch, serve_axum};
use crate::support::scenarios::{layered, request_from};
use crate::support::RedisServer;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::{FailureMode, Header, MissingKey, Policy, RateLimitLayer, RedisStore};

fn hello_app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer)
}

#[tokio::test]
async fn axum_layer_answers_429_after_the_limit() {
    let layer = RateLimitLayer::builder().policy("5/10s").build().unwrap();
    let addr = serve_axum(hello_app(layer), true).await;
    for i in 1..=5 {
        let reply = fetch(addr, "/").await;
        assert_eq!(reply.status, StatusCode::OK, "request {i}");
        assert_eq!(reply.body, "hello");
        assert_eq!(reply.headers["ratelimit-policy"], "\"default\";q=5;w=10");
        assert_eq!(
            reply.headers["ratelimit"],
            format!("\"default\";r={};t=10", 5 - i).as_str()
        );
    }
    let reply = fetch(addr, "/").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = reply.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=10).contains(&retry), "Retry-After {retry}");
    assert_eq!(reply.headers["ratelimit-policy"], "\"default\";q=5;w=10");
    assert_eq!(
        reply.headers["ratelimit"],
        format!("\"default\";r=0;t={retry}").as_str()
    );
    assert_eq!(reply.headers["content-type"], "text/plain; charset=utf-8");
    assert!(
        reply.body.starts_with("Too Many Requests"),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn missing_connect_info_is_explained() {
    let layer = RateLimitLayer::builder().policy("5/10s").build().unwrap();
    let addr = serve_axum(hello_app(layer), false).await;
    let reply = fetch(addr, "/").await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        reply
            .body
            .contains("into_make_service_with_connect_info::<SocketAddr>()"),
        "{}",
        reply.body
    );
}

#[tokio::test]
async fn route_layer_limits_only_its_route() {
    let strict = RateLimitLayer::builder().policy("1/1m").build().unwrap();
    let app = Router::new()
        .route("/limited", get(|| async { "limited" }))
        .route_layer(strict)
        .route("/free", get(|| async { "free" }));
    let addr = serve_axum(app, true).await;
    assert_eq!(fetch(addr, "/limited").await.status, StatusCode::OK);
    assert_eq!(fetch(addr, "/limited").await.status, 429);
    for _ in 0..5 {
        let reply = fetch(addr, "/free").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(!reply.headers.contains_key("ratelimit"));
    }
    // Unknown paths are not routed through `route_layer`: still 404, not 429.
    assert_eq!(fetch(addr, "/nowhere").await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn clients_are_limited_separately() {
    let layer = RateLimitLayer::builder().policy("2/1m").build().unwrap();
    let service = layered(&layer);
    for ip in ["192.0.2.1", "192.0.2.2"] {
        for _ in 0..2 {
            let r = service.clone().oneshot(request_from(ip)).await.unwrap();
            assert_eq!(r.status(), 200, "{ip}");
        }
        let r = service.clone().oneshot(request_from(ip)).await.unwrap();
        assert_eq!(r.status(), 429, "{ip}");
    }
}

#[tokio::test]
async fn service_builder_and_header_key() {
    let layer = RateLimitLayer::builder()
        .policy("1/1m")
        .key(Header::new(http::HeaderName::from_static("x-api-key")))
        .build()
        .unwrap();
    let service =
        ServiceBuilder::new()
            .layer(layer)
            .service(service_fn(|_: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::<Bytes>::from("ok")))
            }));
    let send = |key: Option<&'static str>| {
        let service = service.clone();
        async move {
            let mut request = Request::builder();
            if let Some(key) = key {
                request = request.header("x-api-key", key);
            }
            let request = request.body(Full::default()).unwrap();
            service.oneshot(request).await.unwrap().status()
        }
    };
    assert_eq!(send(Some("alpha")).await, 200);
    assert_eq!(send(Some("alpha")).await, 429);
    assert_eq!(send(Some("beta")).await, 200);
    assert_eq!(send(None).await, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn missing_key_can_allow_or_share_a_key() {
    let allow = layered(
        &RateLimitLayer::builder()
            .policy("1/1m")
            .on_missing_key(MissingKey::Allow)
            .build()
            .unwrap(),
    );
    for _ in 0..3 {
        let r = allow.clone().oneshot(Request::new(())).await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(!r.headers().contains_key("ratelimit"));
    }
    let shared = layered(
        &RateLimitLayer::builder()
            .policy("1/1m")
            .on_missing_key(MissingKey::Use("anonymous".into()))
            .build()
            .unwrap(),
    );
    for expected in [200, 429] {
        let r = shared.clone().oneshot(Request::new(())).await.unwrap();
        assert_eq!(r.status(), expected, "keyless requests share one budget");
    }
}

#[tokio::test]
async fn custom_rejection_keeps_the_rate_limit_fields() {
    let layer = RateLimitLayer::builder()
        .policy("1/1m")
        .headers_on_allowed(false)
        .on_rejection(|d| {
            let body = format!(r#"{{"error":"rate_limited","limit":{}}}"#, d.limit());
            let mut r = Response::new(Bytes::from(body));
            *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            r.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            r
        })
        .build()
        .unwrap();
    let service = layered(&layer);
    let first = service
        .clone()
        .oneshot(request_from("192.0.2.9"))
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert!(!first.headers().contains_key("ratelimit"), "switched off");
    let second = service.oneshot(request_from("192.0.2.9")).await.unwrap();
    assert_eq!(second.status(), 429);
    assert_eq!(second.headers()["content-type"], "application/json");
    assert_eq!(second.headers()["retry-after"], "60");
    assert!(second.headers().contains_key("ratelimit"));
    let body = second.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"error":"rate_limited","limit":1}"#);
}

#[tokio::test]
async fn hyper_server_with_socket_addr_extension() {
    use hyper::server::conn::http1;
    use hyper_util::rt::TokioIo;
    use hyper_util::service::TowerToHyperService;

    let layer = RateLimitLayer::builder().policy("2/1m").build().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = listener.accept().await.unwrap();
            let service = ServiceBuilder::new()
                .map_request(move |mut req: Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert::<SocketAddr>(peer);
                    req
                })
                .layer(layer.clone())
                .service_fn(|_| async {
                    Ok::<_, Infallible>(Response::new(Full::<Bytes>::from("hi")))
                });
            tokio::spawn(
                http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service)),
            );
        }
    });
    assert_eq!(fetch(addr, "/").await.status, 200);
    assert_eq!(fetch(addr, "/").await.status, 200);
    let reply = fetch(addr, "/").await;
    assert_eq!(reply.status, 429);
    assert!(reply.headers.contains_key("retry-after"));
}

/// With Redis gone, `Open` admits and `Closed` refuses with 503, each within the timeout.
#[tokio::test]
async fn failure_modes_when_redis_is_gone() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    // Two layers on one store: named, each its own budget.
    let build = |name: &str, mode| {
        layered(
            &RateLimitLayer::builder()
                .policy(Policy::new(name, ["5/10s".parse().unwrap()]).unwrap())
                .store(store.clone())
                .failure_mode(mode)
                .build()
                .unwrap(),
        )
    };
    let (open, closed) = (
        build("open", FailureMode::Open),
        build("closed", FailureMode::Closed),
    );
    assert_eq!(
        open.clone()
            .oneshot(request_from("192.0.2.1"))
            .await
            .unwrap()
            .status(),
        200
    );
    drop(server);

    let started = tokio::time::Instant::now();
    let r = open.oneshot(request_from("192.0.2.1")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        !r.headers().contains_key("ratelimit"),
        "no decision, no fields"
    );
    let r = closed.oneshot(request_from("192.0.2.1")).await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()["retry-after"], "1");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// The layer calls the very service that `poll_ready` made ready: a `ConcurrencyLimit` inside
/// panics if a clone that was never made ready is called instead.
#[tokio::test]
async fn readiness_of_the_inner_service_is_kept() {
    use tower::Service;

    let layer = RateLimitLayer::builder().policy("2/1m").build().unwrap();
    let mut service = ServiceBuilder::new()
        .layer(layer)
        .concurrency_limit(1)
        .service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(Full::<Bytes>::from("ok")))
        });
    for expected in [200, 200, 429] {
        let ready = service.ready().await.unwrap();
        let response = ready.call(request_from("192.0.2.5")).await.unwrap();
        assert_eq!(response.status(), expected);
    }
}
