//! The response body of a rate-limited service.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

use crate::ledger::stream::{BoxError, Finale, Gate};
use crate::ledger::Receipt;

pin_project! {
    /// The inner service's body, or the short body of a response the layer answered itself
    /// (a rejection). Having its own body type spares the inner body a `Default` or
    /// `From<String>` bound, as tower-http does.
    ///
    /// The body carries what the request owes the store (its usage, when the layer limits by
    /// [usage](crate::usage); its slot, under a concurrency limit), settled when the body ends
    /// (its last frame, its trailers, an error) or is dropped.
    ///
    /// Its errors are boxed, as servers take them: the inner body's as they are, and, for a
    /// response metered as it streams ([`UsageReport::step`](crate::usage::UsageReport::step))
    /// and cut with [`Cut::Abort`](crate::usage::Cut::Abort), a
    /// [`QuotaExceeded`](crate::usage::QuotaExceeded) (find it with `downcast_ref`).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin] body: B,
            receipt: Option<Receipt>,
            // A data frame waiting for its step to be decided.
            held: Option<Frame<Bytes>>,
            // Set once the response is cut: what it ends with.
            ending: Option<Ending>,
        },
        Own { body: Full<Bytes> },
    }
}

/// What a cut response has left to yield.
enum Ending {
    /// Its last frame (a final event, gRPC trailers) or its error.
    Last(Finale),
    /// Nothing: it has ended.
    Done,
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: Kind::Inner {
                body,
                receipt: None,
                held: None,
                ending: None,
            },
        }
    }

    /// The inner service's body, settling `receipt` when it ends or is dropped.
    pub(crate) fn owing(body: B, receipt: Receipt) -> Self {
        let receipt = (!receipt.is_empty()).then_some(receipt);
        ResponseBody {
            kind: Kind::Inner {
                body,
                receipt,
                held: None,
                ending: None,
            },
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
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner {
                body,
                receipt,
                held,
                ending,
            } => poll_inner(body, receipt, held, ending, cx),
            KindProj::Own { body } => Pin::new(body)
                .poll_frame(cx)
                .map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner {
                ending: Some(ending),
                ..
            } => matches!(ending, Ending::Done),
            Kind::Inner { held: Some(_), .. } => false,
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Own { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // A metered response may be cut, or end with a frame of the layer's.
            Kind::Inner {
                receipt: Some(owed),
                ..
            } if owed.may_cut() => SizeHint::default(),
            Kind::Inner {
                ending: Some(_), ..
            } => SizeHint::default(),
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Own { body } => body.size_hint(),
        }
    }
}

type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

/// The inner service's body, metered where its receipt says so: a frame the credit covers
/// passes; one that is short waits (`held`) for its step; a refused step cuts the response.
fn poll_inner<B>(
    mut body: Pin<&mut B>,
    receipt: &mut Option<Receipt>,
    held: &mut Option<Frame<Bytes>>,
    ending: &mut Option<Ending>,
    cx: &mut Context<'_>,
) -> Polled
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    loop {
        if let Some(last) = next_ending(ending) {
            return Poll::Ready(last);
        }
        // A frame held for its step: it passes, or the response is cut.
        if let (Some(owed), Some(_)) = (receipt.as_mut(), held.as_ref()) {
            let gate = std::task::ready!(owed.gate(cx));
            match (gate, held.take()) {
                (Gate::Pass, Some(frame)) => {
                    if body.is_end_stream() {
                        owed.ended();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                (Gate::Cut(last), _) => cut(receipt, ending, last),
                (Gate::Pass, None) => {}
            }
            continue;
        }
        let frame = std::task::ready!(body.as_mut().poll_frame(cx));
        let Some(owed) = receipt else {
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        };
        let frame = match frame {
            Some(Ok(frame)) => frame,
            // The end, or an error: the request is done; settle now (dropping the receipt
            // does).
            None => {
                owed.ended();
                *receipt = None;
                return Poll::Ready(None);
            }
            Some(Err(error)) => {
                *receipt = None;
                return Poll::Ready(Some(Err(error.into())));
            }
        };
        if let Some(trailers) = frame.trailers_ref() {
            owed.read_trailers(trailers);
            owed.ended();
        }
        let len = match frame.data_ref() {
            Some(data) if owed.metered() => data.len(),
            _ => return Poll::Ready(Some(Ok(frame))),
        };
        match owed.frame(len, cx) {
            Poll::Ready(Gate::Pass) => {
                if body.is_end_stream() {
                    owed.ended();
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Gate::Cut(last)) => cut(receipt, ending, last),
            Poll::Pending => {
                *held = Some(frame);
                return Poll::Pending;
            }
        }
    }
}

/// What a cut response yields next: its last frame or error once, then its end.
fn next_ending(ending: &mut Option<Ending>) -> Option<Option<Result<Frame<Bytes>, BoxError>>> {
    match ending.take()? {
        Ending::Last(last) => {
            *ending = Some(Ending::Done);
            Some(Some(last))
        }
        Ending::Done => {
            *ending = Some(Ending::Done);
            Some(None)
        }
    }
}

/// Cuts a response: what it owes is settled now (dropping the receipt does: it is charged
/// what it sent), and it ends with `last`.
fn cut(receipt: &mut Option<Receipt>, ending: &mut Option<Ending>, last: Finale) {
    *receipt = None;
    *ending = Some(Ending::Last(last));
}
