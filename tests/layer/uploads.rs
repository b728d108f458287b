//! Request bodies metered as they stream: concurrent uploads of one key never pass the quota
//! at the handlers, the unused part of the last step is refunded, and a refused step is
//! answered 413 or 429 as HTTP says.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, StreamBody};
use tower::{service_fn, Layer, ServiceExt};
use tower_redis_ratelimit::metered::{Metered, RequestBytes};
use tower_redis_ratelimit::test_util::FaultyStore;
use tower_redis_ratelimit::usage::QuotaExceeded;
use tower_redis_ratelimit::{FailureMode, Header, Key, MemoryStore, Policy, RateLimitLayer, Store};

/// A client's body: `total` bytes in frames of `frame`, with no size hint (chunked), counting
/// the frames the server polled.
type Upload = StreamBody<futures::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

fn upload(total: usize, frame: usize, polled: &Arc<AtomicUsize>) -> Upload {
    let polled = Arc::clone(polled);
    let sizes = (0..total.div_ceil(frame)).map(move |i| frame.min(total - i * frame));
    let frames = futures::stream::iter(sizes).map(move |n| {
        polled.fetch_add(1, Ordering::SeqCst);
        Ok(Frame::data(Bytes::from(vec![7u8; n])))
    });
    StreamBody::new(Box::pin(frames) as futures::stream::BoxStream<'static, _>)
}

use futures::StreamExt;

/// What one handler got: the bytes it read, and the error its body ended with.
#[derive(Debug, Default, Clone)]
struct Got {
    bytes: u64,
    error: Option<QuotaExceeded>,
    /// An error of another kind (a store failure, under `FailureMode::Closed`).
    other: Option<String>,
}

/// A handler that reads its body to the end, or to its first error (answered 400, as axum's
/// extractors answer an unknown body error), and records what it got; it stops after `stop`
/// bytes when given, dropping the rest of the body unread.
#[derive(Clone)]
struct Handler {
    got: Arc<Mutex<Vec<Got>>>,
    stop: Option<u64>,
}

impl Handler {
    fn new() -> Handler {
        Handler {
            got: Arc::default(),
            stop: None,
        }
    }

    async fn handle<B>(self, request: Request<B>) -> Result<Response<Full<Bytes>>, Infallible>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut body = request.into_body();
        let mut got = Got::default();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    got.bytes += frame.data_ref().map_or(0, |d| d.len() as u64);
                    if self.stop.is_some_and(|stop| got.bytes >= stop) {
                        break;
                    }
                }
                Err(error) => {
                    let error: Box<dyn std::error::Error + Send + Sync> = error.into();
                    got.error = error.downcast_ref::<QuotaExceeded>().cloned();
                    if got.error.is_none() {
                        got.other = Some(error.to_string());
                    }
                    break;
                }
            }
        }
        drop(body);
        let status = match got.error.is_some() || got.other.is_some() {
            true => StatusCode::BAD_REQUEST,
            false => StatusCode::OK,
        };
        self.got.lock().unwrap().push(got);
        let mut response = Response::new(Full::new(Bytes::from_static(b"handled")));
        *response.status_mut() = status;
        Ok(response)
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }
}

fn uploads(count: &str) -> Policy {
    Policy::new("uploads", [count.parse().unwrap()]).unwrap()
}

fn user() -> Header {
    Header::new(HeaderName::from_static("x-user"))
}

fn post<B>(body: B) -> Request<B> {
    Request::post("/upload")
        .header("x-user", "ann")
        .body(body)
        .unwrap()
}

/// Sends `request` through a metered layer on `store` to `handler`.
async fn send<B>(
    store: &MemoryStore,
    policy: &Policy,
    handler: &Handler,
    request: Request<B>,
) -> Response<Bytes>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let layer = RateLimitLayer::builder()
        .key(user())
        .store(store.clone())
        .policy(policy.clone())
        .request_bytes(RequestBytes::new())
        .build()
        .unwrap();
    through(layer, handler, request).await
}

/// Sends `request` through `layer` to `handler`.
async fn through<St, B>(
    layer: RateLimitLayer<Header, St, Metered>,
    handler: &Handler,
    request: Request<B>,
) -> Response<Bytes>
where
    St: Store,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let handler = handler.clone();
    let service = service_fn(move |request| handler.clone().handle(request));
    let response = layer.layer(service).oneshot(request).await.unwrap();
    let (head, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Response::from_parts(head, body)
}

fn retry_after(response: &Response<Bytes>) -> Option<u64> {
    let value = response.headers().get(RETRY_AFTER)?;
    value.to_str().ok()?.parse().ok()
}

#[tokio::test(start_paused = true)]
async fn two_chunked_uploads_never_pass_the_quota_at_the_handlers() {
    // Two instances of the layer (built apart) on one store, as two services would share it.
    let (store, policy, handler) = (MemoryStore::new(), uploads("1000000/1h"), Handler::new());
    let polled = Arc::new(AtomicUsize::new(0));
    let (a, b) = tokio::join!(
        send(
            &store,
            &policy,
            &handler,
            post(upload(2_000_000, 16 * 1024, &polled))
        ),
        send(
            &store,
            &policy,
            &handler,
            post(upload(2_000_000, 16 * 1024, &polled))
        ),
    );
    let got = handler.got();
    let total: u64 = got.iter().map(|g| g.bytes).sum();
    assert!(
        total <= 1_000_000,
        "the handlers got {total} bytes: {got:?}"
    );
    assert!(total >= 1_000_000 - 2 * 64 * 1024, "{got:?}");
    for (response, got) in [a, b].iter().zip(&got) {
        let exceeded = got.error.as_ref().expect("each upload was cut");
        assert_eq!(exceeded.policy(), "uploads");
        assert!(
            [StatusCode::PAYLOAD_TOO_LARGE, StatusCode::TOO_MANY_REQUESTS]
                .contains(&response.status()),
            "{response:?}"
        );
    }
}

/// What `ann` has used of `policy`, as a look at the store says.
async fn used(store: &MemoryStore, policy: &Policy) -> u64 {
    let count = policy.limits()[0].count();
    let look = store.peek(&Key::from("ann"), policy, 0).await.unwrap();
    count - look.remaining()
}

#[tokio::test(start_paused = true)]
async fn the_last_step_unused_is_refunded_at_end_and_drop() {
    let (store, policy) = (MemoryStore::new(), uploads("1000000/1h"));
    let polled = Arc::new(AtomicUsize::new(0));
    let whole = Handler::new();
    let response = send(
        &store,
        &policy,
        &whole,
        post(upload(100_000, 10_000, &polled)),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(whole.got()[0].bytes, 100_000);
    // Two steps (131 072 bytes) were admitted; the unused part came back at the end.
    assert_eq!(used(&store, &policy).await, 100_000);

    let (store, policy) = (MemoryStore::new(), uploads("1000000/1h"));
    let leaves = Handler {
        stop: Some(70_000),
        ..Handler::new()
    };
    let response = send(
        &store,
        &policy,
        &leaves,
        post(upload(100_000, 10_000, &polled)),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(leaves.got()[0].bytes, 70_000);
    assert_eq!(used(&store, &policy).await, 70_000, "charged what passed");
}

/// A chunked body for axum: `total` bytes in frames of 16 KiB.
fn axum_upload(total: usize) -> Request<axum::body::Body> {
    let polled = Arc::new(AtomicUsize::new(0));
    post(axum::body::Body::new(upload(total, 16 * 1024, &polled)))
}

#[tokio::test(start_paused = true)]
async fn an_axum_extractor_error_becomes_the_layers_answer() {
    async fn keep(body: Bytes) -> String {
        format!("{} bytes\n", body.len())
    }
    let app = |store: &MemoryStore| {
        let layer = RateLimitLayer::builder()
            .key(user())
            .store(store.clone())
            .policy(uploads("200000/1h"))
            .request_bytes(RequestBytes::new())
            .build()
            .unwrap();
        axum::Router::new()
            .route("/upload", axum::routing::post(keep))
            .layer(layer)
    };
    // 300 000 bytes can never fit in 200 000 an hour: 413, no Retry-After.
    let memory = MemoryStore::new();
    let response = app(&memory).oneshot(axum_upload(300_000)).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(response.headers().get(RETRY_AFTER).is_none());

    // 100 000 stored, then 150 000 more fits only once the first has aged out: 429.
    let memory = MemoryStore::new();
    let first = app(&memory).oneshot(axum_upload(100_000)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let response = app(&memory).oneshot(axum_upload(150_000)).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let text = response.into_body().collect().await.unwrap().to_bytes();
    assert!(
        text.starts_with(b"Too Many Requests: retry in "),
        "{text:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_cut_retry_after_is_true_for_the_whole_body() {
    let (store, policy, handler) = (MemoryStore::new(), uploads("200000/1m"), Handler::new());
    let polled = Arc::new(AtomicUsize::new(0));
    // 60 000 bytes at 0 s and at 20 s; at 30 s a chunked upload of 150 000 passes what is
    // left (80 000) and is cut. Its whole body fits only once all three have aged out, at
    // 90 s: a step, or what the body had sent when it was cut, would fit sooner.
    for wait in [20, 10] {
        let sent = send(
            &store,
            &policy,
            &handler,
            post(upload(60_000, 16 * 1024, &polled)),
        )
        .await;
        assert_eq!(sent.status(), StatusCode::OK);
        tokio::time::advance(Duration::from_secs(wait)).await;
    }
    let cut = send(
        &store,
        &policy,
        &handler,
        post(upload(150_000, 16 * 1024, &polled)),
    )
    .await;
    assert_eq!(cut.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        handler.got()[2].bytes,
        80_000,
        "a body near the quota gets all of it"
    );
    let wait = retry_after(&cut).expect("a wait helps");
    assert_eq!(wait, 60, "the whole body fits at 90 s");
    // A second early, the whole body would not fit (looked at, recording nothing).
    tokio::time::advance(Duration::from_secs(wait - 1)).await;
    let early = store
        .peek(&Key::from("ann"), &policy, 150_000)
        .await
        .unwrap();
    assert!(!early.is_allowed(), "a second early");
    // At Retry-After, the same chunked upload again reaches its handler whole.
    tokio::time::advance(Duration::from_secs(1)).await;
    let retried = send(
        &store,
        &policy,
        &handler,
        post(upload(150_000, 16 * 1024, &polled)),
    )
    .await;
    assert_eq!(
        retried.status(),
        StatusCode::OK,
        "at Retry-After ({wait} s)"
    );
    assert_eq!(handler.got()[3].bytes, 150_000);
}

#[tokio::test(start_paused = true)]
async fn steps_neither_box_nor_take_a_slot() {
    let policy = uploads("2000000/1h")
        .block_for(Duration::from_secs(3600))
        .unwrap()
        .concurrency(1)
        .unwrap();
    let (store, handler) = (MemoryStore::new(), Handler::new());
    let polled = Arc::new(AtomicUsize::new(0));
    // 20 steps of 64 KiB, each decided while the request holds the only slot.
    let twenty = 20 * 64 * 1024;
    let whole = send(
        &store,
        &policy,
        &handler,
        post(upload(twenty, 16 * 1024, &polled)),
    )
    .await;
    assert_eq!(
        whole.status(),
        StatusCode::OK,
        "a step was refused for a slot"
    );
    assert_eq!(handler.got()[0].bytes, twenty as u64);
    // The next upload is cut when the quota is spent; its refused step boxes nobody.
    let cut = send(
        &store,
        &policy,
        &handler,
        post(upload(twenty, 16 * 1024, &polled)),
    )
    .await;
    assert_eq!(cut.status(), StatusCode::TOO_MANY_REQUESTS);
    let look = store.peek(&Key::from("ann"), &policy, 0).await.unwrap();
    assert!(!look.in_penalty_box(), "a refused step set the box");
}

#[tokio::test(start_paused = true)]
async fn a_soft_limit_passes_a_refused_step_on_and_charges_it() {
    // GCRA, whose drain time tells what was charged: 100 000 drain in an hour.
    let policy = uploads("100000/1h").with_algorithm(tower_redis_ratelimit::Algorithm::Gcra);
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder()
        .key(user())
        .store(store.clone())
        .rule(tower_redis_ratelimit::Rule::new(policy.clone()).soft())
        .request_bytes(RequestBytes::new())
        .build()
        .unwrap();
    let (handler, polled) = (Handler::new(), Arc::new(AtomicUsize::new(0)));
    let response = through(layer, &handler, post(upload(300_000, 16 * 1024, &polled))).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(handler.got()[0].bytes, 300_000, "a step was refused");
    // What passed over the limit is charged when the body ends, as a response's is: the
    // 300 000 drain for three hours, less the hour's first 100 000.
    let look = store.peek(&Key::from("ann"), &policy, 1).await.unwrap();
    let wait = look.retry_after().expect("refused");
    assert!(
        wait > Duration::from_secs(7100),
        "what passed uncounted was not charged: {wait:?}"
    );
}

/// A chunked upload that makes the store fail once its first step has passed.
fn failing_after_a_step(store: &FaultyStore<MemoryStore>) -> Request<Upload> {
    let (store, polled) = (store.clone(), Arc::new(AtomicUsize::new(0)));
    let frames = upload(200_000, 16 * 1024, &polled).into_data_stream();
    let frames = frames.enumerate().map(move |(i, data)| {
        if i == 4 {
            store.fail(true);
        }
        data.map(Frame::data)
    });
    post(StreamBody::new(
        Box::pin(frames) as futures::stream::BoxStream<'static, _>
    ))
}

#[tokio::test(start_paused = true)]
async fn a_store_failure_mid_body_follows_the_failure_mode() {
    let layer = |store: &FaultyStore<MemoryStore>, mode| {
        RateLimitLayer::builder()
            .key(user())
            .store(store.clone())
            .policy(uploads("1000000/1h"))
            .request_bytes(RequestBytes::new())
            .failure_mode(mode)
            .build()
            .unwrap()
    };
    // Closed: the body is cut where the store failed, and the layer answers 503.
    let (store, handler) = (FaultyStore::new(MemoryStore::new()), Handler::new());
    let request = failing_after_a_step(&store);
    let response = through(layer(&store, FailureMode::Closed), &handler, request).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let got = &handler.got()[0];
    assert_eq!(got.bytes, 64 * 1024, "{got:?}");
    assert!(got.other.is_some(), "{got:?}");
    // Open: the body passes, uncounted.
    let (store, handler) = (FaultyStore::new(MemoryStore::new()), Handler::new());
    let request = failing_after_a_step(&store);
    let response = through(layer(&store, FailureMode::Open), &handler, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(handler.got()[0].bytes, 200_000);
}

#[tokio::test(start_paused = true)]
async fn a_declared_length_over_the_count_is_413_unread() {
    let (store, policy, handler) = (MemoryStore::new(), uploads("1000000/1h"), Handler::new());
    let polled = Arc::new(AtomicUsize::new(0));
    let mut request = post(upload(2_000_000, 16 * 1024, &polled));
    request
        .headers_mut()
        .insert(CONTENT_LENGTH, 2_000_000.into());
    let response = send(&store, &policy, &handler, request).await;
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(response.headers().get(RETRY_AFTER).is_none());
    assert_eq!(
        response.headers()["ratelimit-policy"],
        "\"uploads\";q=1000000;w=3600;qu=\"content-bytes\""
    );
    assert!(response.body().starts_with(b"Content Too Large: "));
    assert_eq!(polled.load(Ordering::SeqCst), 0, "the body was read");
    assert!(handler.got().is_empty(), "the handler was called");
}

#[tokio::test(start_paused = true)]
async fn grpc_keeps_resource_exhausted() {
    let (store, policy, handler) = (MemoryStore::new(), uploads("1000000/1h"), Handler::new());
    let polled = Arc::new(AtomicUsize::new(0));
    let mut request = post(upload(2_000_000, 16 * 1024, &polled));
    let headers = request.headers_mut();
    headers.insert(CONTENT_LENGTH, 2_000_000.into());
    headers.insert(CONTENT_TYPE, "application/grpc".parse().unwrap());
    let response = send(&store, &policy, &handler, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "8");
    assert_eq!(response.headers()["grpc-retry-pushback-ms"], "-1");

    // Cut while it streams: the handler's answer is replaced by RESOURCE_EXHAUSTED too.
    let mut request = post(upload(2_000_000, 16 * 1024, &polled));
    request
        .headers_mut()
        .insert(CONTENT_TYPE, "application/grpc".parse().unwrap());
    let response = send(&store, &policy, &handler, request).await;
    assert_eq!(response.headers()["grpc-status"], "8");
}

#[tokio::test(start_paused = true)]
async fn no_declared_length_is_metered_not_refused() {
    let (store, policy, handler) = (MemoryStore::new(), uploads("1000000/1h"), Handler::new());
    let polled = Arc::new(AtomicUsize::new(0));
    let response = send(
        &store,
        &policy,
        &handler,
        post(upload(2_000_000, 16 * 1024, &polled)),
    )
    .await;
    let got = &handler.got()[0];
    assert!(got.bytes > 900_000 && got.bytes <= 1_000_000, "{got:?}");
    assert!(got.error.is_some());
    // Read on past the cut, the body proved larger than the count: it can never fit.
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // A chunked body that fits the count but not what is left is told when all of it fits.
    let (store, handler) = (MemoryStore::new(), Handler::new());
    let first = send(
        &store,
        &policy,
        &handler,
        post(upload(600_000, 16 * 1024, &polled)),
    )
    .await;
    assert_eq!(first.status(), StatusCode::OK);
    let response = send(
        &store,
        &policy,
        &handler,
        post(upload(600_000, 16 * 1024, &polled)),
    )
    .await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(handler.got()[1].bytes, 400_000, "the rest of the count");
    assert_eq!(retry_after(&response), Some(3600));
    // An empty body costs nothing.
    let empty = send(&store, &policy, &handler, post(Full::new(Bytes::new()))).await;
    assert_eq!(empty.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_token_layer_keeps_429() {
    let layer = RateLimitLayer::builder()
        .key(user())
        .policy(uploads("1000000/1h"))
        .cost(|_| 2_000_000)
        .build()
        .unwrap();
    let app = layer.layer(service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let response = app.oneshot(post(Full::new(Bytes::new()))).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().get(RETRY_AFTER).is_none());
    assert_eq!(
        response.headers()["ratelimit-policy"],
        "\"uploads\";q=1000000;w=3600"
    );
}

/// A tonic server takes a metered layer: its routes accept any request body. A health check
/// (a gRPC message of 5 bytes) is metered in bytes: two fit in 10 bytes an hour, the third is
/// refused `RESOURCE_EXHAUSTED`.
#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_tonic_server_meters_its_request_bodies() {
    use tonic::transport::server::TcpIncoming;
    use tonic::transport::{Endpoint, Server};
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let layer = RateLimitLayer::builder()
        .key(tower_redis_ratelimit::Global)
        .policy(uploads("10/1h"))
        .request_bytes(RequestBytes::new().step(5))
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let ask = || HealthCheckRequest {
        service: String::new(),
    };
    for _ in 0..2 {
        client.check(ask()).await.expect("admitted");
    }
    let status = client.check(ask()).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
}
