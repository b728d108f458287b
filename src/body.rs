//! The response body of a rate-limited service.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

use crate::ledger::Receipt;

pin_project! {
    /// The inner service's body, or the short body of a response the layer answered itself
    /// (a rejection). Having its own body type spares the inner body a `Default` or
    /// `From<String>` bound, as tower-http does.
    ///
    /// The body carries what the request owes the store (its usage, when the layer limits by
    /// [usage](crate::usage); its slot, under a concurrency limit), settled when the body ends
    /// (its last frame, its trailers, an error) or is dropped.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B, receipt: Option<Receipt> },
        Own { body: Full<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner {
                body,
                receipt: None,
            },
        }
    }

    /// The inner service's body, settling `receipt` when it ends or is dropped.
    pub(crate) fn owing(body: B, receipt: Receipt) -> Self {
        let receipt = (!receipt.is_empty()).then_some(receipt);
        ResponseBody {
            kind: Kind::Inner { body, receipt },
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
            KindProj::Inner { body, receipt } => {
                let frame = body.poll_frame(cx);
                if let Some(owed) = receipt {
                    match &frame {
                        Poll::Ready(Some(Ok(frame))) => {
                            if let Some(trailers) = frame.trailers_ref() {
                                owed.read_trailers(trailers);
                            }
                        }
                        // The end, or an error: the request is done; settle now (dropping the
                        // receipt does).
                        Poll::Ready(_) => *receipt = None,
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
