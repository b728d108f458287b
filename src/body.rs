//! The response body of a rate-limited service.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

use crate::concurrency::holds::Slot;
use crate::usage::Tab;

pin_project! {
    /// The inner service's body, or the short body of a response the layer answered itself
    /// (a rejection). Having its own body type spares the inner body a `Default` or
    /// `From<String>` bound, as tower-http does.
    ///
    /// When the layer limits by [usage](crate::usage), the body settles the request's usage
    /// when it ends (its last frame, its trailers, an error) or is dropped; under a
    /// concurrency limit it gives the request's slot back then.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B, tab: Option<Box<Tab>>, slot: Option<Slot> },
        Own { body: Full<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody::metered(body, None, None)
    }

    /// The inner service's body, settling `tab` (if any) and giving `slot` (if any) back when
    /// it ends or is dropped.
    pub(crate) fn metered(body: B, tab: Option<Box<Tab>>, slot: Option<Slot>) -> Self {
        ResponseBody {
            kind: Kind::Inner { body, tab, slot },
        }
    }

    pub(crate) fn own(body: Full<Bytes>) -> Self {
        ResponseBody {
            kind: Kind::Own { body },
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Own { .. } => "rejection",
        };
        f.debug_tuple("ResponseBody").field(&kind).finish()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body, tab, slot } => {
                let frame = body.poll_frame(cx);
                if slot.is_some() && matches!(frame, Poll::Ready(None | Some(Err(_)))) {
                    // The end, or an error: the request is no longer in flight.
                    *slot = None;
                }
                if let Some(open) = tab {
                    match &frame {
                        Poll::Ready(Some(Ok(frame))) => {
                            if let Some(trailers) = frame.trailers_ref() {
                                open.read_trailers(trailers);
                            }
                        }
                        // The end, or an error: settle now (dropping the tab does).
                        Poll::Ready(_) => *tab = None,
                        Poll::Pending => {}
                    }
                }
                frame
            }
            KindProj::Own { body } => Pin::new(body)
                .poll_frame(cx)
                .map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Own { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Own { body } => body.size_hint(),
        }
    }
}
