//! Response streams metered as they go, on instances that share Redis: two SSE streams of one
//! key at once, each cut within one step of the quota, with their final events, and charged
//! what they sent.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tower::{service_fn, Layer, ServiceExt};
use tower_redis_ratelimit::key::Header;
use tower_redis_ratelimit::usage::{Cut, UsageMeter, UsageReport};
use tower_redis_ratelimit::{Key, Policy, RateLimitLayer, RedisStore, Store};

use crate::support::RedisServer;

const EVENT: &[u8] = b"data: fifty tokens\n\n";
const FINAL: &[u8] = b"event: error\ndata: {\"error\": \"token quota spent\"}\n\n";

fn tokens() -> Policy {
    Policy::new("tokens", ["10000/1m".parse().unwrap()]).unwrap()
}

fn layer(store: RedisStore) -> RateLimitLayer<Header, RedisStore> {
    let report = UsageReport::new()
        .step(500)
        .on_cut(Cut::Final(Bytes::from_static(FINAL)));
    RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-api-key")))
        .policy(tokens())
        .store(store)
        .usage(report)
        .build()
        .unwrap()
}

/// Streams one request through `layer` to an SSE handler of as good as endless 50-token
/// events (counted on the meter before each is yielded): the tokens received, and the last
/// frame.
async fn stream(layer: &RateLimitLayer<Header, RedisStore>) -> (u64, Bytes) {
    let sse = service_fn(|request: Request<()>| {
        let meter = request.extensions().get::<UsageMeter>().cloned().unwrap();
        let events = (0..1000).map(move |_| {
            meter.add(50);
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(EVENT)))
        });
        let body = StreamBody::new(futures::stream::iter(events));
        async move { Ok::<_, Infallible>(Response::new(body)) }
    });
    let request = Request::builder()
        .header("x-api-key", "key-1")
        .body(())
        .unwrap();
    let mut body = layer.layer(sse).oneshot(request).await.unwrap().into_body();
    let (mut tokens, mut last) = (0, Bytes::new());
    while let Some(frame) = body.frame().await {
        let data = frame.unwrap().into_data().unwrap();
        tokens += if data == EVENT { 50 } else { 0 };
        last = data;
    }
    (tokens, last)
}

#[tokio::test]
async fn two_sse_streams_on_two_instances_are_cut_within_a_step_each() {
    let server = RedisServer::start();
    let (one, two) = (layer(server.store().await), layer(server.store().await));
    let ((a, a_last), (b, b_last)) = tokio::join!(stream(&one), stream(&two));
    // Each stream stops once a step of 500 is refused, holding less than a step unused.
    assert!(
        (10_000 - 1100..=10_000).contains(&(a + b)),
        "{a} + {b} tokens"
    );
    assert_eq!((&a_last[..], &b_last[..]), (FINAL, FINAL), "no final event");
    assert_eq!(one.settled(Duration::from_secs(5)).await, 0);
    assert_eq!(two.settled(Duration::from_secs(5)).await, 0);
    let store = server.store().await;
    let peek = store.peek(&Key::from("key-1"), &tokens(), 0).await.unwrap();
    assert_eq!(
        peek.limit() - peek.remaining(),
        a + b,
        "charged what was sent"
    );
}
