//! Serving apps on loopback and sending them requests.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// What a client sees of a response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

/// Serves `app` on a free loopback port, with axum's `ConnectInfo<SocketAddr>` when
/// `connect_info` is set. The server runs until the test's runtime stops.
pub async fn serve_axum(app: axum::Router, connect_info: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        if connect_info {
            let make = app.into_make_service_with_connect_info::<SocketAddr>();
            axum::serve(listener, make).await.unwrap();
        } else {
            axum::serve(listener, app).await.unwrap();
        }
    });
    addr
}

/// `GET http://{addr}{path}`.
pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let request = Request::get(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap();
    let response = client.request(request).await.expect("request");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// The body of the requests and responses of a service behind a layer, called in process.
pub type LayerBody = http_body_util::Full<Bytes>;

/// The `x-api-key` header as a layer's key.
pub fn api_key() -> tower_redis_ratelimit::Header {
    tower_redis_ratelimit::Header::new(http::HeaderName::from_static("x-api-key"))
}

/// One instance of a service: a layer of `policy` keyed by `x-api-key`, with its deny cache
/// (on by default for Redis), over `store`.
pub fn instance<St: tower_redis_ratelimit::Store>(
    store: St,
    policy: &tower_redis_ratelimit::Policy,
) -> impl tower::Service<
    Request<LayerBody>,
    Response = http::Response<impl Sized>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    let layer = tower_redis_ratelimit::RateLimitLayer::builder()
        .policy(policy.clone())
        .key(api_key())
        .store(store)
        .build()
        .unwrap();
    served(layer)
}

/// A service behind `layer` that answers every admitted request with 200.
pub fn served<St: tower_redis_ratelimit::Store>(
    layer: tower_redis_ratelimit::RateLimitLayer<tower_redis_ratelimit::Header, St>,
) -> impl tower::Service<
    Request<LayerBody>,
    Response = http::Response<impl Sized>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone {
    tower::ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<LayerBody>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(LayerBody::from("ok")))
        }))
}

/// A request with an `x-api-key` header of `key`.
pub fn keyed(key: &str) -> Request<LayerBody> {
    Request::builder()
        .header("x-api-key", key)
        .body(LayerBody::default())
        .unwrap()
}

/// How many of `tries` requests for `key` through `service` are admitted ([`passes`]).
pub async fn admitted<S, B>(service: &S, key: &str, tries: usize) -> usize
where
    S: tower::Service<Request<LayerBody>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    let mut admitted = 0;
    for _ in 0..tries {
        admitted += usize::from(passes(service, key).await);
    }
    admitted
}

/// Whether one request for `key` through `service` is admitted: 200, or 429 for a refusal
/// (any other status fails the test).
pub async fn passes<S, B>(service: &S, key: &str) -> bool
where
    S: tower::Service<Request<LayerBody>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let response = service.clone().oneshot(keyed(key)).await.unwrap();
    match response.status().as_u16() {
        200 => true,
        429 => false,
        other => panic!("unexpected status {other}"),
    }
}
