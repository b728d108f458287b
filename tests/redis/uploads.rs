//! Uploads metered as they stream, on instances that share Redis: the handlers of all of
//! them get at most the quota.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderName, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use tower::{service_fn, Layer, ServiceExt};
use tower_redis_ratelimit::metered::{MeteredBody, RequestBytes};
use tower_redis_ratelimit::usage::QuotaExceeded;
use tower_redis_ratelimit::{Header, Policy, RateLimitLayer, RedisStore};

use crate::support::RedisServer;

type Upload = StreamBody<futures::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

/// `total` bytes in frames of 16 KiB, with no size hint (chunked).
fn upload(total: usize) -> Request<Upload> {
    let frame = 16 * 1024;
    let sizes = (0..total.div_ceil(frame)).map(move |i| frame.min(total - i * frame));
    let frames = futures::stream::iter(sizes).map(|n| Ok(Frame::data(Bytes::from(vec![7u8; n]))));
    let body = StreamBody::new(Box::pin(frames) as futures::stream::BoxStream<'static, _>);
    Request::post("/upload")
        .header("x-user", "ann")
        .body(body)
        .unwrap()
}

/// What each handler got: the bytes it read, and the cut that ended its body.
type Got = Arc<Mutex<Vec<(u64, Option<QuotaExceeded>)>>>;

/// Reads the body to its end or its first error; records the bytes read and the cut.
async fn handle(
    got: Got,
    request: Request<MeteredBody<Upload>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut body = request.into_body();
    let (mut bytes, mut cut) = (0, None);
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => bytes += frame.data_ref().map_or(0, |d| d.len() as u64),
            Err(error) => {
                cut = error.downcast_ref::<QuotaExceeded>().cloned();
                break;
            }
        }
    }
    let status = match cut {
        Some(_) => StatusCode::BAD_REQUEST,
        None => StatusCode::OK,
    };
    got.lock().unwrap().push((bytes, cut));
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = status;
    Ok(response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_chunked_uploads_on_two_instances_never_pass_the_quota() {
    let server = RedisServer::start();
    let policy = Policy::new("uploads", ["1000000/1h".parse().unwrap()]).unwrap();
    let got: Got = Arc::default();
    let instance = |store: RedisStore| {
        let layer = RateLimitLayer::builder()
            .key(Header::new(HeaderName::from_static("x-user")))
            .store(store)
            .policy(policy.clone())
            .request_bytes(RequestBytes::new())
            .build()
            .unwrap();
        let got = Arc::clone(&got);
        layer.layer(service_fn(move |request| handle(Arc::clone(&got), request)))
    };
    let (a, b) = (
        instance(server.store().await),
        instance(server.store().await),
    );
    let (a, b) = tokio::join!(
        tokio::spawn(a.oneshot(upload(2_000_000))),
        tokio::spawn(b.oneshot(upload(2_000_000))),
    );
    let got = got.lock().unwrap().clone();
    let total: u64 = got.iter().map(|(bytes, _)| bytes).sum();
    assert!(
        total <= 1_000_000,
        "the handlers got {total} bytes: {got:?}"
    );
    // A step of what is left is asked before a cut: the count reaches the handlers whole.
    assert_eq!(total, 1_000_000, "{got:?}");
    for (bytes, cut) in &got {
        let cut = cut
            .as_ref()
            .unwrap_or_else(|| panic!("not cut after {bytes} bytes"));
        assert_eq!(cut.policy(), "uploads");
    }
    for response in [a, b] {
        let response = response.unwrap().unwrap();
        let status = response.status();
        // Read on past its cut, each 2 MB body proved larger than the count: it never fits.
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let _ = response.into_body().collect().await.unwrap();
    }
}
