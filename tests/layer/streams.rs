//! Response streams metered as they go: cut within one step of the quota, visible in the
//! store while they run, and a client that leaves charged what was sent.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, StreamBody};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_redis_ratelimit::key::Header;
use tower_redis_ratelimit::usage::{Cut, QuotaExceeded, UsageMeter, UsageReport};
use tower_redis_ratelimit::{Key, MemoryStore, Policy, RateLimitLayer, Store};

const API_KEY: &str = "key-1";
/// Tokens in one event of the stream.
const EVENT_TOKENS: u64 = 50;
/// As good as endless: 50 000 tokens, five times the quotas below.
const ENDLESS: u64 = 1000;
const FINAL: &[u8] = b"event: error\ndata: {\"error\": \"token quota spent\"}\n\n";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn policy(name: &str, limit: &str) -> Policy {
    Policy::new(name, [limit.parse().unwrap()]).unwrap()
}

fn layer<St: Store>(store: St, policy: &Policy, report: UsageReport) -> RateLimitLayer<Header, St> {
    RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-api-key")))
        .policy(policy.clone())
        .store(store)
        .usage(report)
        .build()
        .unwrap()
}

fn request() -> Request<()> {
    Request::builder()
        .header("x-api-key", API_KEY)
        .body(())
        .unwrap()
}

/// Units the test key used under `policy`, as the store holds them now.
async fn used<St: Store>(store: &St, policy: &Policy) -> u64 {
    let peek = store.peek(&Key::from(API_KEY), policy, 0).await.unwrap();
    peek.limit() - peek.remaining()
}

/// An SSE handler streaming up to `events` events of 50 tokens, `gap` apart, each counted on
/// the request's meter just before it is yielded, as an LLM proxy counts what it relays.
fn sse(
    events: u64,
    gap: Duration,
) -> impl Service<
    Request<()>,
    Response = Response<impl Body<Data = Bytes, Error = Infallible> + Send + Sync>,
    Error = Infallible,
    Future: Send,
> + Clone {
    service_fn(move |request: Request<()>| {
        let meter = request.extensions().get::<UsageMeter>().cloned().unwrap();
        async move {
            let stream = futures::stream::unfold(0, move |sent| {
                let meter = meter.clone();
                async move {
                    if sent == events {
                        return None;
                    }
                    if !gap.is_zero() {
                        tokio::time::sleep(gap).await;
                    }
                    meter.add(EVENT_TOKENS);
                    let event = Frame::data(Bytes::from_static(b"data: fifty tokens\n\n"));
                    Some((Ok::<_, Infallible>(event), sent + 1))
                }
            });
            let response = Response::builder()
                .header("content-type", "text/event-stream")
                .body(StreamBody::new(Box::pin(stream)))
                .unwrap();
            Ok::<_, Infallible>(response)
        }
    })
}

/// What a client read of a response body.
#[derive(Default)]
struct Read {
    /// Tokens in the events received.
    tokens: u64,
    /// Data bytes received.
    bytes: u64,
    /// The last data frame.
    last: Option<Bytes>,
    trailers: Option<HeaderMap>,
    error: Option<BoxError>,
}

/// Reads `body` to its end, or its error.
async fn read<B: Body<Data = Bytes, Error = BoxError> + Unpin>(mut body: B) -> Read {
    let mut read = Read::default();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => match frame.into_data() {
                Ok(data) => {
                    if data.starts_with(b"data: fifty") {
                        read.tokens += EVENT_TOKENS;
                    }
                    read.bytes += data.len() as u64;
                    read.last = Some(data);
                }
                Err(frame) => read.trailers = frame.into_trailers().ok(),
            },
            Err(error) => {
                read.error = Some(error);
                break;
            }
        }
    }
    read
}

#[tokio::test]
async fn an_sse_stream_is_cut_within_one_step_of_the_quota() {
    let (store, tokens) = (MemoryStore::new(), policy("tokens", "10000/1m"));
    let report = UsageReport::new()
        .step(500)
        .on_cut(Cut::Final(Bytes::from_static(FINAL)));
    let service = layer(store.clone(), &tokens, report).layer(sse(ENDLESS, Duration::ZERO));
    let response = service.oneshot(request()).await.unwrap();
    let read = read(response.into_body()).await;
    // A step of 500 is refused once less than 500 is left; frames pass whole (50 tokens).
    assert!(
        (10_000 - 550..=10_000).contains(&read.tokens),
        "{} tokens received",
        read.tokens
    );
    assert!(read.error.is_none(), "{:?}", read.error);
    assert_eq!(read.last.as_deref(), Some(FINAL), "no final event");
    assert_eq!(
        used(&store, &tokens).await,
        read.tokens,
        "charged what was sent"
    );
}

#[tokio::test]
async fn a_cut_without_a_final_event_is_an_error_naming_the_quota() {
    let (store, tokens) = (MemoryStore::new(), policy("tokens", "1000/1m"));
    let service = layer(store, &tokens, UsageReport::new().step(200));
    let response = service
        .layer(sse(ENDLESS, Duration::ZERO))
        .oneshot(request())
        .await
        .unwrap();
    let read = read(response.into_body()).await;
    let error = read.error.expect("the stream ended without an error");
    let cut = error.downcast_ref::<QuotaExceeded>().unwrap();
    assert_eq!(cut.policy(), "tokens");
    assert_eq!(cut.passed(), read.tokens);
    assert!(cut.retry_after().is_some(), "{cut}");
    assert!(
        (1000 - 250..=1000).contains(&read.tokens),
        "{}",
        read.tokens
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_is_visible_in_the_store_while_it_runs() {
    let (store, tokens) = (MemoryStore::new(), policy("tokens", "100000/1h"));
    // 600 events 100 ms apart: 30 000 tokens over 60 s.
    let service = layer(store.clone(), &tokens, UsageReport::new().step(500))
        .layer(sse(600, Duration::from_millis(100)));
    let mut body = service.oneshot(request()).await.unwrap().into_body();
    let sent = Arc::new(AtomicU64::new(0));
    let reader = tokio::spawn({
        let sent = Arc::clone(&sent);
        async move {
            while let Some(frame) = body.frame().await {
                if frame.unwrap().is_data() {
                    sent.fetch_add(EVENT_TOKENS, Ordering::SeqCst);
                }
            }
        }
    });
    for second in [10, 20, 30, 40, 50] {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let (sent, used) = (sent.load(Ordering::SeqCst), used(&store, &tokens).await);
        assert!(sent > 0, "nothing sent after {second} s");
        assert!(
            (sent..=sent + 500).contains(&used),
            "after {second} s: {sent} sent, {used} in the store"
        );
    }
    reader.await.unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 30_000);
    assert_eq!(
        used(&store, &tokens).await,
        30_000,
        "the unused step refunded"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_is_charged_what_was_sent() {
    let (store, tokens) = (MemoryStore::new(), policy("tokens", "10000/1m"));
    let service = layer(store.clone(), &tokens, UsageReport::new().step(500))
        .layer(sse(ENDLESS, Duration::from_millis(100)));
    let mut body = service.oneshot(request()).await.unwrap().into_body();
    for _ in 0..13 {
        assert!(body.frame().await.unwrap().unwrap().is_data());
    }
    // 650 tokens sent; the reservation and two steps (1 001) recorded.
    assert_eq!(used(&store, &tokens).await, 1001);
    drop(body);
    assert_eq!(used(&store, &tokens).await, 650);
}

#[tokio::test]
async fn the_unused_credit_is_refunded_at_the_end() {
    let (store, tokens) = (MemoryStore::new(), policy("tokens", "10000/1m"));
    let service = layer(store.clone(), &tokens, UsageReport::new().step(500));
    let response = service
        .layer(sse(7, Duration::ZERO))
        .oneshot(request())
        .await
        .unwrap();
    let read = read(response.into_body()).await;
    assert_eq!(read.tokens, 350);
    assert_eq!(used(&store, &tokens).await, 350, "charged the whole step");
}

/// A gRPC handler streaming endless messages of 60 bytes.
fn grpc_stream() -> impl Service<
    Request<()>,
    Response = Response<impl Body<Data = Bytes, Error = Infallible> + Send + Sync>,
    Error = Infallible,
> + Clone {
    service_fn(|_: Request<()>| async {
        let message = || Ok::<_, Infallible>(Frame::data(Bytes::from(vec![0; 60])));
        let stream = futures::stream::iter((0..ENDLESS).map(move |_| message()));
        let response = Response::builder()
            .header("content-type", "application/grpc")
            .body(StreamBody::new(stream))
            .unwrap();
        Ok::<_, Infallible>(response)
    })
}

#[tokio::test]
async fn a_grpc_stream_is_cut_with_resource_exhausted() {
    let (store, bytes) = (MemoryStore::new(), policy("replies", "1000/1m"));
    let report = UsageReport::new().bytes().step(100);
    let service = layer(store.clone(), &bytes, report).layer(grpc_stream());
    let response = service.oneshot(request()).await.unwrap();
    let read = read(response.into_body()).await;
    assert!(read.error.is_none(), "{:?}", read.error);
    assert!((1000 - 160..=1000).contains(&read.bytes), "{}", read.bytes);
    let trailers = read.trailers.expect("no trailers");
    assert_eq!(trailers["grpc-status"], "8");
    let message = trailers["grpc-message"].to_str().unwrap();
    assert!(message.contains("\"replies\""), "{message}");
    assert_eq!(used(&store, &bytes).await, read.bytes);
}

#[test]
fn a_step_that_no_limit_admits_is_a_build_error() {
    let tokens = policy("tokens", "1000/1m");
    for step in [0, 1001] {
        let built = RateLimitLayer::builder()
            .policy(tokens.clone())
            .usage(UsageReport::new().step(step))
            .build();
        let Err(error) = built else {
            panic!("built with a step of {step}");
        };
        let error = error.to_string();
        assert!(error.contains("tokens"), "{error}");
    }
}

#[tokio::test]
async fn max_tokens_reserved_then_settled_to_usage() {
    use axum::routing::post;
    use axum::{Extension, Router};
    use tower_redis_ratelimit::Decisions;

    let (store, tokens) = (MemoryStore::new(), policy("tokens", "10000/1m"));
    let read = crate::support::gateway::body_fields();
    let limit = RateLimitLayer::builder()
        .key(read.key())
        .store(store.clone())
        .policy(tokens.clone())
        .cost(crate::support::gateway::max_tokens)
        .usage(UsageReport::new().step(500))
        .build()
        .unwrap();
    // The handler sees its reservation and allowance, and streams 6 events of 50 tokens.
    let complete = |Extension(decisions): Extension<Decisions>,
                    Extension(meter): Extension<UsageMeter>| async move {
        let d = decisions.get("tokens").unwrap();
        let seen = format!(
            "reserved {} allowance {}\n",
            d.reserved(),
            decisions.allowance("tokens").unwrap()
        );
        let events = (0..6).map(move |_| {
            meter.add(EVENT_TOKENS);
            Ok::<_, Infallible>(Bytes::from_static(b"data: fifty tokens\n\n"))
        });
        let head = futures::stream::iter([Ok(Bytes::from(seen))]);
        let stream = futures::StreamExt::chain(head, futures::stream::iter(events));
        axum::body::Body::from_stream(stream)
    };
    let app = Router::new()
        .route("/v1/chat", post(complete))
        .layer(limit)
        .layer(read);
    let chat = Request::post("/v1/chat")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(
            r#"{"user": "ann", "max_tokens": 800}"#,
        ))
        .unwrap();
    let response = app.oneshot(chat).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(text.starts_with("reserved 800 allowance 10000\n"), "{text}");
    assert_eq!(text.matches("data: fifty").count(), 6);
    let peek = store.peek(&Key::from("ann"), &tokens, 0).await.unwrap();
    assert_eq!(peek.limit() - peek.remaining(), 300, "settled to the usage");
}

/// Reads `count` data frames of `body`, then the rest until it ends or fails.
async fn read_after<B>(body: &mut B, count: usize) -> Read
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    for _ in 0..count {
        assert!(body.frame().await.unwrap().unwrap().is_data());
    }
    read(body).await
}

#[tokio::test]
async fn a_stream_whose_step_the_store_cannot_decide_follows_the_failure_mode() {
    use tower_redis_ratelimit::test_util::FaultyStore;
    use tower_redis_ratelimit::{FailureMode, StoreError};

    let tokens = policy("tokens", "10000/1m");
    for mode in [FailureMode::Closed, FailureMode::Open] {
        let closed = matches!(mode, FailureMode::Closed);
        // A store in another process: each step is a future the body polls.
        let store = FaultyStore::new(MemoryStore::new()).remote();
        let service = RateLimitLayer::builder()
            .key(Header::new(HeaderName::from_static("x-api-key")))
            .policy(tokens.clone())
            .store(store.clone())
            .usage(UsageReport::new().step(500))
            .failure_mode(mode)
            .build()
            .unwrap()
            .layer(sse(40, Duration::ZERO));
        let mut body = service.oneshot(request()).await.unwrap().into_body();
        // 20 events (1 000 tokens) on steps the store decided; then it fails.
        for _ in 0..20 {
            assert!(body.frame().await.unwrap().unwrap().is_data());
        }
        store.fail(true);
        let rest = read_after(&mut body, 0).await;
        let used = used(store.inner(), &tokens).await;
        if closed {
            // Cut at the next step: what the last admitted step covered passed.
            let error = rest.error.expect("not cut");
            assert!(error.downcast_ref::<StoreError>().is_some(), "{error}");
            assert_eq!(1000 + rest.tokens, 1000, "{} more passed", rest.tokens);
            assert_eq!(used, 1000, "closed: charged what was sent");
        } else {
            // Passed uncounted, and charged when the stream ended (settles reach the store).
            assert!(rest.error.is_none(), "{:?}", rest.error);
            assert_eq!(rest.tokens, 1000);
            assert_eq!(used, 2000, "open: charged what was sent");
        }
    }
}

#[tokio::test]
async fn a_shadow_layer_passes_a_stream_over_its_quota_and_charges_it() {
    // GCRA, whose bucket says how far over the key is: 60 ms a token to drain.
    let tokens = policy("tokens", "1000/1m").with_algorithm(tower_redis_ratelimit::Algorithm::Gcra);
    let store = MemoryStore::new();
    let service = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-api-key")))
        .policy(tokens.clone())
        .store(store.clone())
        .usage(UsageReport::new().step(200))
        .shadow(true)
        .build()
        .unwrap()
        .layer(sse(40, Duration::ZERO));
    let response = service.oneshot(request()).await.unwrap();
    let read = read(response.into_body()).await;
    assert!(read.error.is_none(), "{:?}", read.error);
    assert_eq!(read.tokens, 2000, "cut in shadow mode");
    // Steps were admitted up to the quota; the rest passed uncounted, charged at the end:
    // 2 000 tokens take 120 s to drain.
    let peek = store.peek(&Key::from(API_KEY), &tokens, 0).await.unwrap();
    let drained_in = peek.reset_after().as_secs_f64();
    assert!((119.0..=120.5).contains(&drained_in), "{drained_in} s");
}

#[tokio::test]
async fn a_response_metered_in_bytes_without_steps_is_charged_its_bytes_at_the_end() {
    let (store, bytes) = (MemoryStore::new(), policy("bytes", "10000/1m"));
    let handler = service_fn(|request: Request<()>| async move {
        // The meter is not read when the usage is the body's bytes.
        request.extensions().get::<UsageMeter>().unwrap().set(5);
        let body = http_body_util::Full::new(Bytes::from(vec![b'x'; 1234]));
        Ok::<_, Infallible>(Response::new(body))
    });
    let service = layer(store.clone(), &bytes, UsageReport::new().bytes()).layer(handler);
    let response = service.oneshot(request()).await.unwrap();
    assert_eq!(response.body().size_hint().exact(), Some(1234));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 1234);
    assert_eq!(used(&store, &bytes).await, 1234);
}

#[tokio::test]
async fn a_client_of_a_real_server_sees_an_aborted_stream_fail() {
    use hyper::server::conn::http1;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::service::TowerToHyperService;

    let tokens = policy("tokens", "1000/1m");
    let layer = layer(MemoryStore::new(), &tokens, UsageReport::new().step(200));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = tower::ServiceBuilder::new()
                .map_request(|request: Request<hyper::body::Incoming>| request.map(|_| ()))
                .layer(layer.clone())
                .service(sse(ENDLESS, Duration::ZERO));
            let service = TowerToHyperService::new(service);
            tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
        }
    });
    let client = Client::builder(TokioExecutor::new()).build_http::<http_body_util::Empty<Bytes>>();
    let request = Request::get(format!("http://{addr}/"))
        .header("x-api-key", API_KEY)
        .body(http_body_util::Empty::new())
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    // The chunked body stops before its last chunk: the client's read fails.
    let error = response.into_body().collect().await.err();
    assert!(error.is_some(), "the client read a whole response");
}
