//! [`BodyFieldService`]: hands the inner service a request whose field the layer read, or
//! answers itself.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::bodies::RequestBody;
use super::error::InnerError;
use super::field::{OtherContent, Settings};
use super::future::{BoxError, ResponseFuture};
use super::parse::{Format, Problem};
use crate::body::ResponseBody;

/// The service of a [`BodyFieldLayer`].
///
/// [`BodyFieldLayer`]: super::BodyFieldLayer
#[derive(Debug, Clone)]
pub struct BodyFieldService<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> BodyFieldService<S> {
    /// Wraps `inner` in a layer with `settings`.
    pub(super) fn new(inner: S, settings: Arc<Settings>) -> Self {
        BodyFieldService { inner, settings }
    }
}

impl<S, B, ResBody> Service<Request<B>> for BodyFieldService<S>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = InnerError<S::Error>;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(InnerError)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let settings = &self.settings;
        let Some(format) = Format::of(request.headers()) else {
            return match settings.other {
                OtherContent::Reject => ResponseFuture::answer(Problem::Unsupported, settings),
                OtherContent::Pass => {
                    ResponseFuture::calling(self.inner.call(request.map(RequestBody::passed)))
                }
            };
        };
        if declared_over(&request, settings.limit) {
            return ResponseFuture::answer(Problem::TooLarge, settings);
        }
        // The service made ready goes with the request; this one keeps a clone.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let (parts, body) = request.into_parts();
        ResponseFuture::reading(parts, body, inner, format, Arc::clone(settings))
    }
}

/// Whether the request says, before it is read, that its body is over `limit` bytes.
fn declared_over<B: Body>(request: &Request<B>, limit: usize) -> bool {
    let limit = u64::try_from(limit).unwrap_or(u64::MAX);
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok());
    declared.is_some_and(|length| length > limit) || request.body().size_hint().lower() > limit
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::header::CONTENT_TYPE;
    use http::StatusCode;
    use http_body::Frame;
    use http_body_util::{BodyExt, Full, StreamBody};
    use tower::{service_fn, Layer, ServiceExt};

    use super::super::{BodyField, BodyFieldLayer};
    use super::*;

    /// Echoes the field it got, or says it got none.
    fn echo() -> impl Service<
        Request<RequestBody<StreamBody<Frames>>>,
        Response = Response<Full<Bytes>>,
        Error = Infallible,
        Future = impl Send,
    > + Clone {
        service_fn(
            |request: Request<RequestBody<StreamBody<Frames>>>| async move {
                let field = request.extensions().get::<BodyField>().cloned();
                let body = request.into_body().collect().await.unwrap().to_bytes();
                let text = format!("{:?} {}", field.as_ref().map(BodyField::value), body.len());
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))))
            },
        )
    }

    type Frames = futures::stream::Iter<
        std::iter::FromFn<Box<dyn FnMut() -> Option<Result<Frame<Bytes>, Infallible>> + Send>>,
    >;

    /// An endless body of 100-byte frames, counting the frames read.
    fn endless(read: Arc<AtomicUsize>) -> StreamBody<Frames> {
        let next: Box<dyn FnMut() -> Option<Result<Frame<Bytes>, Infallible>> + Send> =
            Box::new(move || {
                read.fetch_add(1, Ordering::SeqCst);
                Some(Ok(Frame::data(Bytes::from(vec![b'a'; 100]))))
            });
        StreamBody::new(futures::stream::iter(std::iter::from_fn(next)))
    }

    fn once(bytes: &'static [u8]) -> StreamBody<Frames> {
        let mut left = Some(Bytes::from_static(bytes));
        let next: Box<dyn FnMut() -> Option<Result<Frame<Bytes>, Infallible>> + Send> =
            Box::new(move || left.take().map(|bytes| Ok(Frame::data(bytes))));
        StreamBody::new(futures::stream::iter(std::iter::from_fn(next)))
    }

    async fn answer(
        layer: &BodyFieldLayer,
        request: Request<StreamBody<Frames>>,
    ) -> (StatusCode, String) {
        let response = layer.layer(echo()).oneshot(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    fn form() -> http::request::Builder {
        Request::post("/").header(CONTENT_TYPE, "application/x-www-form-urlencoded")
    }

    #[tokio::test]
    async fn reads_up_to_the_limit_and_one_frame_then_answers_413() {
        let layer = BodyFieldLayer::builder("username")
            .limit(1_000)
            .build()
            .unwrap();
        let read = Arc::new(AtomicUsize::new(0));
        let body = endless(Arc::clone(&read));
        let request = form().body(body).unwrap();
        let (status, text) = answer(&layer, request).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
        assert_eq!(
            text,
            "Payload Too Large: the request body is over 1000 bytes\n"
        );
        // Ten frames fill the limit; the eleventh is one too many.
        assert_eq!(read.load(Ordering::SeqCst), 11);
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_answered_unread() {
        let layer = BodyFieldLayer::builder("username")
            .limit(1_000)
            .build()
            .unwrap();
        let read = Arc::new(AtomicUsize::new(0));
        let request = form()
            .header(CONTENT_LENGTH, "1001")
            .body(endless(Arc::clone(&read)))
            .unwrap();
        let (status, _) = answer(&layer, request).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(read.load(Ordering::SeqCst), 0);
        // At the limit exactly, the body is read.
        let body: &'static [u8] = Box::leak(
            format!("username=ann&p={}", "x".repeat(985))
                .into_bytes()
                .into_boxed_slice(),
        );
        assert_eq!(body.len(), 1_000);
        let request = form()
            .header(CONTENT_LENGTH, "1000")
            .body(once(body))
            .unwrap();
        assert_eq!(
            answer(&layer, request).await,
            (StatusCode::OK, "Some(\"ann\") 1000".to_owned())
        );
    }

    #[tokio::test]
    async fn other_content_is_refused_or_passed_unread() {
        let plain = |read: &Arc<AtomicUsize>| {
            Request::post("/")
                .header(CONTENT_TYPE, "application/grpc")
                .body(endless(Arc::clone(read)))
                .unwrap()
        };
        let read = Arc::new(AtomicUsize::new(0));
        let layer = BodyFieldLayer::builder("username").build().unwrap();
        let (status, _) = answer(&layer, plain(&read)).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(read.load(Ordering::SeqCst), 0);

        let passing = BodyFieldLayer::builder("username")
            .other_content(OtherContent::Pass)
            .build()
            .unwrap();
        let request = Request::post("/").body(once(b"username=ann")).unwrap();
        assert_eq!(
            answer(&passing, request).await,
            (StatusCode::OK, "None 12".to_owned())
        );
    }

    #[tokio::test]
    async fn a_field_missing_empty_or_twice_is_a_400() {
        let layer = BodyFieldLayer::builder("username").build().unwrap();
        for body in [&b"user=ann"[..], b"username=+", b"username=a&username=b"] {
            let request = form().body(once(body)).unwrap();
            let (status, text) = answer(&layer, request).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
            assert!(text.contains("\"username\""), "{text}");
        }
        let request = form().body(once(b"username=+Ann+")).unwrap();
        assert_eq!(
            answer(&layer, request).await,
            (StatusCode::OK, "Some(\"ann\") 14".to_owned())
        );
    }
}
