//! [`MeteredBody`]: a request body that passes on only what the store admitted.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::flow::{Asking, Meter};
use super::BoxError;

pin_project! {
    /// The request body a layer built with
    /// [`request_bytes`](crate::RateLimitLayerBuilder::request_bytes) gives the inner
    /// service: the client's body, of which it passes on only the bytes the store admitted.
    ///
    /// A data frame passes whole while the admitted bytes cover it; otherwise the covered part
    /// passes (split off, not copied), and the rest waits for the store's decision on one more
    /// step. When a step is refused the body is cut: this poll and every later one return a
    /// [`QuotaExceeded`](crate::usage::QuotaExceeded) error (find it with `downcast_ref`, or in
    /// the error's source chain where a framework wraps it), the client's body is not read
    /// again, and the layer replaces the handler's response with its own answer. Trailers pass
    /// as they are. A request passed on without a decision (no rule matches it, its key is
    /// allow-listed or missing, the store failed and the layer fails open) is not metered.
    pub struct MeteredBody<B> {
        #[pin]
        inner: B,
        meter: Option<Meter>,
        // The part of a data frame not covered yet.
        held: Option<Bytes>,
        // The store's decision under way.
        asking: Option<Asking>,
    }
}

impl<B> MeteredBody<B> {
    pub(crate) fn new(inner: B, meter: Option<Meter>) -> Self {
        MeteredBody {
            inner,
            meter,
            held: None,
            asking: None,
        }
    }
}

impl<B> std::fmt::Debug for MeteredBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredBody")
            .field("meter", &self.meter)
            .finish_non_exhaustive()
    }
}

impl<B> Body for MeteredBody<B>
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
        let mut this = self.project();
        let Some(meter) = this.meter.as_mut() else {
            let frame = ready!(this.inner.poll_frame(cx));
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        };
        loop {
            if let Some(error) = meter.cut() {
                return Poll::Ready(Some(Err(error)));
            }
            if let Some(asking) = this.asking.as_mut() {
                let outcome = ready!(asking.poll(cx));
                let asked = this.asking.take().expect("a decision under way");
                *this.asking = meter.decided(asked, outcome);
                continue;
            }
            if meter.is_reading() {
                // A refused body is read on, unpassed, to learn its size for the answer.
                this.held.take();
                let done = match ready!(this.inner.as_mut().poll_frame(cx)) {
                    Some(Ok(frame)) => frame
                        .data_ref()
                        .is_some_and(|data| meter.read(data.len() as u64)),
                    None | Some(Err(_)) => true,
                };
                if done {
                    *this.asking = meter.read_all();
                }
                continue;
            }
            if let Some(mut data) = this.held.take() {
                let covered = meter.cover(data.len() as u64) as usize;
                if covered == data.len() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                if covered > 0 {
                    let part = data.split_to(covered);
                    *this.held = Some(data);
                    return Poll::Ready(Some(Ok(Frame::data(part))));
                }
                let short = data.len() as u64;
                *this.held = Some(data);
                *this.asking = meter.step(short);
                continue;
            }
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                None => {
                    meter.refund();
                    return Poll::Ready(None);
                }
                Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if data.is_empty() => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Ok(data) => *this.held = Some(data),
                    Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
