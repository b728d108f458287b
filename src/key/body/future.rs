//! [`ResponseFuture`]: reads the body up to the limit, then waits for the inner service.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::combinators::Collect;
use http_body_util::{BodyExt, Collected, Full, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::bodies::RequestBody;
use super::error::InnerError;
use super::field::{BodyField, BodyFields, Settings};
use super::parse::{Format, Problem};
use crate::body::ResponseBody;

pub(super) type BoxError = Box<dyn StdError + Send + Sync>;

pin_project! {
    /// Response future of [`BodyFieldService`]: `Reading` (the body, up to the limit) →
    /// `Calling` (the inner service), or an answer of the layer's own.
    ///
    /// [`BodyFieldService`]: super::BodyFieldService
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<RequestBody<B>>>,
        B: Body,
        B::Error: Into<BoxError>,
    {
        #[pin]
        state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<RequestBody<B>>>,
        B: Body,
        B::Error: Into<BoxError>,
    {
        Reading {
            #[pin]
            collect: Collect<Limited<B>>,
            reading: Option<Reading<S>>,
        },
        Calling {
            #[pin]
            future: S::Future,
        },
        Answer {
            response: Option<Response<Full<Bytes>>>,
        },
    }
}

/// What a request being read waits with: its head, the service made ready for it, and what
/// to read.
struct Reading<S> {
    parts: Parts,
    inner: S,
    format: Format,
    settings: Arc<Settings>,
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<RequestBody<B>>>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    /// Answers without the inner service.
    pub(super) fn answer(problem: Problem, settings: &Settings) -> Self {
        ResponseFuture {
            state: State::answer(problem, settings),
        }
    }

    /// Waits for the inner service, called with a request passed on unread.
    pub(super) fn calling(future: S::Future) -> Self {
        ResponseFuture {
            state: State::Calling { future },
        }
    }

    /// Reads `body` up to the limit, then calls `inner` (made ready) with the field, or
    /// answers itself.
    pub(super) fn reading(
        parts: Parts,
        body: B,
        inner: S,
        format: Format,
        settings: Arc<Settings>,
    ) -> Self {
        ResponseFuture {
            state: State::Reading {
                collect: Limited::new(body, settings.limit).collect(),
                reading: Some(Reading {
                    parts,
                    inner,
                    format,
                    settings,
                }),
            },
        }
    }
}

impl<S, B> State<S, B>
where
    S: Service<Request<RequestBody<B>>>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    fn answer(problem: Problem, settings: &Settings) -> Self {
        State::Answer {
            response: Some(problem.response(settings)),
        }
    }

    /// With the body read: the inner service called with the field, or the layer's answer.
    fn read(reading: Reading<S>, read: Result<Collected<Bytes>, BoxError>) -> Self {
        let Reading {
            parts,
            mut inner,
            format,
            settings,
        } = reading;
        let collected = match read {
            Ok(collected) => collected,
            Err(error) if over_limit(&*error) => {
                return State::answer(Problem::TooLarge, &settings)
            }
            Err(_) => return State::answer(Problem::Unreadable, &settings),
        };
        let trailers = collected.trailers().cloned();
        let bytes = collected.to_bytes();
        let read = match format.fields(&bytes, &settings.field, &settings.numbers) {
            Ok(read) => read,
            Err(problem) => return State::answer(problem, &settings),
        };
        let value = settings.normalize.apply(&read.key);
        if value.is_empty() {
            return State::answer(Problem::Missing, &settings);
        }
        let mut request = Request::from_parts(parts, RequestBody::buffered(bytes, trailers));
        let extensions = request.extensions_mut();
        extensions.insert(BodyField::shared(Arc::clone(&settings.field), value));
        if !settings.numbers.is_empty() {
            let numbers = Arc::clone(&settings.numbers);
            extensions.insert(BodyFields::shared(numbers, read.numbers));
        }
        State::Calling {
            future: inner.call(request),
        }
    }
}

/// Whether a body error is a body over the limit: `Limited`'s own, or one from a limit
/// further out (tower-http's `RequestBodyLimit`), perhaps wrapped (axum's `Body`).
fn over_limit(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<LengthLimitError>() {
            return true;
        }
        next = error.source();
    }
    false
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, InnerError<S::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Reading { collect, reading } => {
                    let read = ready!(collect.poll(cx));
                    let reading = reading
                        .take()
                        .expect("ResponseFuture polled after completion");
                    let next = State::read(reading, read);
                    this.state.set(next);
                }
                StateProj::Calling { future } => {
                    let response = ready!(future.poll(cx)).map_err(InnerError)?;
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Answer { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::own)));
                }
            }
        }
    }
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<RequestBody<B>>>,
    B: Body,
    B::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_body_over_the_limit_is_one_somewhere_in_the_error_chain() {
        #[derive(Debug)]
        struct Wrapped(BoxError);
        impl fmt::Display for Wrapped {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl StdError for Wrapped {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&*self.0)
            }
        }
        let too_long = || async {
            let body = Limited::new(Full::new(Bytes::from("ab")), 1);
            body.collect().await.unwrap_err()
        };
        assert!(over_limit(&*too_long().await));
        assert!(over_limit(&Wrapped(too_long().await)));
        assert!(!over_limit(&Wrapped("broken pipe".into())));
    }
}
