//! The request body the layer hands the inner service: [`RequestBody`].

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The request body the inner service of a [`BodyFieldLayer`] gets: the bytes the layer
    /// read (and the trailers, if any), or the original body of a request passed on unread
    /// ([`OtherContent::Pass`]).
    ///
    /// [`BodyFieldLayer`]: super::BodyFieldLayer
    /// [`OtherContent::Pass`]: super::OtherContent::Pass
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Buffered { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Passed { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(super) fn buffered(bytes: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!bytes.is_empty()).then_some(bytes);
        RequestBody {
            kind: RequestKind::Buffered { data, trailers },
        }
    }

    pub(super) fn passed(body: B) -> Self {
        RequestBody {
            kind: RequestKind::Passed { body },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Buffered { data, trailers } => {
                let frame = match data.take() {
                    Some(data) => Some(Frame::data(data)),
                    None => trailers.take().map(Frame::trailers),
                };
                Poll::Ready(frame.map(Ok))
            }
            RequestKindProj::Passed { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            RequestKind::Passed { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |data| data.len() as u64))
            }
            RequestKind::Passed { body } => body.size_hint(),
        }
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestBody").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use http_body_util::{BodyExt, Empty};

    use super::*;

    #[tokio::test]
    async fn hands_on_the_bytes_and_the_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-check", HeaderValue::from_static("1"));
        let body = RequestBody::<Empty<Bytes>>::buffered(Bytes::from("a=1"), Some(trailers));
        assert_eq!(body.size_hint().exact(), Some(3));
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-check"], "1");
        assert_eq!(collected.to_bytes(), "a=1");
        let empty = RequestBody::<Empty<Bytes>>::buffered(Bytes::new(), None);
        assert!(empty.is_end_stream());
    }
}
