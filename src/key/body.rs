//! Keys from the request body: a login form's user name, a JSON body's account id.
//!
//! A [`KeyExtractor`] sees a request before anybody has read its body, so a key that lives in
//! the body needs a layer in front of the rate-limit layer (outside it) that reads it first.
//! [`BodyFieldLayer`] buffers at most [`limit`](BodyFieldBuilder::limit) bytes of the body,
//! takes one field from a form (`application/x-www-form-urlencoded`) or a JSON object
//! (`application/json`, `application/*+json`), puts it into the request's extensions as a
//! [`BodyField`], and hands the inner service the request with the same bytes as its body.
//! [`BodyKey`] is the key extractor that reads the field from there, so key extraction stays
//! synchronous.
//!
//! ```
//! use std::collections::HashMap;
//!
//! use axum::{routing::post, Form, Router};
//! use tower_redis_ratelimit::key::body::BodyFieldLayer;
//! use tower_redis_ratelimit::RateLimitLayer;
//! # use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let username = BodyFieldLayer::builder("username").limit(4 * 1024).build()?;
//! let limit = RateLimitLayer::builder()
//!     .policy("3/1m")
//!     .key(username.key())
//!     .build()?;
//!
//! let app = Router::new()
//!     .route(
//!         "/login",
//!         // The form arrives whole: the layer hands on the bytes it read.
//!         post(|Form(form): Form<HashMap<String, String>>| async move {
//!             format!("hello {}", form["username"])
//!         }),
//!     )
//!     .layer(limit) // inner: keys on the field
//!     .layer(username); // outer: reads it first
//! # let login = |body: &'static str| {
//! #     http::Request::post("/login")
//! #         .header("content-type", "application/x-www-form-urlencoded")
//! #         .body(axum::body::Body::from(body))
//! #         .unwrap()
//! # };
//! # for _ in 0..3 {
//! #     let response = app.clone().oneshot(login("username=Ann&password=x")).await?;
//! #     assert_eq!(response.status(), 200);
//! # }
//! # // `ANN ` is Ann (normalised): her fourth attempt is refused.
//! # let response = app.clone().oneshot(login("username=ANN+&password=x")).await?;
//! # assert_eq!(response.status(), 429);
//! # let response = app.clone().oneshot(login("username=bob&password=x")).await?;
//! # assert_eq!(response.status(), 200);
//! # Ok(()) }
//! ```
//!
//! # What the layer answers
//!
//! | request | answer |
//! |---|---|
//! | `Content-Length` (or the body's size hint) above the limit | `413`, the body unread |
//! | a body that grows past the limit (chunked, streamed) | `413`, having read the limit and one frame at most |
//! | a body that fails while being read | `400` |
//! | another content type, none, or a `Content-Encoding` (say `gzip`) | `415` by default; or passed on untouched, see [`OtherContent`] |
//! | a JSON body that is not one object | `400` |
//! | the field missing, empty, sent twice, or (JSON) neither a string nor a number | `400` |
//! | a form or JSON object with the field | the inner service, with a [`BodyField`] |
//!
//! A field sent twice is refused rather than one of its values picked: parsers disagree on
//! which one counts (axum's `Form` and serde refuse it, most JSON parsers keep the last), and a
//! client must not be counted under one name while the application reads another. A JSON
//! number counts as its text (`42` is the key `"42"`, and so is the string `"42"`).
//!
//! `415` rather than `400` for another content type, by default, because it says what is wrong
//! (RFC 9110 §15.5.16: a format, or a content coding, this resource does not take); passing
//! such requests on is the choice for a layer that sits in front of routes that take other
//! bodies too, and then the rate-limit layer finds no key and its
//! [`MissingKey`](crate::MissingKey) applies (`400` by default).
//!
//! # Normalisation
//!
//! [`Normalize::Fold`], the default, makes `ann`, `Ann`, ` ANN ` and the full-width `ＡＮＮ`
//! one budget: the value is put in Unicode normalisation form NFKC, trimmed and lowercased
//! (`str::to_lowercase`, which knows every script's case; it does not fold `ß` into `ss`).
//! A lockout that a client can sidestep by writing its name in capitals locks nobody out, and
//! folding can only merge budgets, never split one; [`Normalize::Trim`] and
//! [`Normalize::Exact`] are there for fields whose case matters. The handler still gets the
//! body as it was sent; [`BodyField::value`] is the normalised value, and
//! [`Normalize::apply`] normalises the same way for the application's own lookups.
//!
//! # Bounds
//!
//! At most the limit (16 KiB unless set) and one frame of a body is read, before the
//! rate-limit layer has decided anything, so a client can make each of its requests in flight
//! cost that much memory: keep the limit near the largest form the route takes. The key itself
//! is bounded as every key is: a value over [`Key::MAX_LEN`] bytes, or not plain ASCII, is
//! stored as its hash.
//!
//! # The bodies
//!
//! The inner service gets a [`RequestBody`]: the bytes read (and trailers, if any) as one
//! frame, or the original body when the request was passed on unread. axum's `Router`,
//! `MethodRouter` and extractors (`Form`, `Json`, `Bytes`) take any such body; a service typed
//! on one body type takes `Request<RequestBody<B>>`. Responses come back as a
//! [`ResponseBody`]: the inner service's body, or the layer's own answer.
//!
//! # gRPC
//!
//! The layer reads forms and JSON; a gRPC request (`application/grpc`) is another content
//! type: refused with `415` by default, or passed on untouched, its stream unread, with
//! [`OtherContent::Pass`]. Put the layer on the HTTP routes that take the form, not on a
//! tonic server.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::Collect;
use http_body_util::{BodyExt, Collected, Full, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use tower_layer::Layer;
use tower_service::Service;
use unicode_normalization::UnicodeNormalization;

use super::{Key, KeyError, KeyExtractor};

type BoxError = Box<dyn StdError + Send + Sync>;

/// Reads one field of a form or JSON request body into the request's extensions, for
/// [`BodyKey`]; see the [module documentation](self) for what it answers and why.
///
/// ```
/// use tower_redis_ratelimit::key::body::{BodyFieldLayer, Normalize, OtherContent};
///
/// let layer = BodyFieldLayer::builder("username")
///     .limit(4 * 1024)
///     .normalize(Normalize::Trim)
///     .other_content(OtherContent::Pass)
///     .build()
///     .unwrap();
/// assert_eq!(layer.field(), "username");
/// assert!(BodyFieldLayer::builder("").build().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct BodyFieldLayer {
    settings: Arc<Settings>,
}

#[derive(Debug)]
struct Settings {
    field: Arc<str>,
    limit: usize,
    normalize: Normalize,
    other: OtherContent,
}

impl BodyFieldLayer {
    /// The body limit unless [`BodyFieldBuilder::limit`] sets another: 16 KiB, many times a
    /// login form.
    pub const DEFAULT_LIMIT: usize = 16 * 1024;

    /// Reads field `field` with the defaults: [`DEFAULT_LIMIT`](Self::DEFAULT_LIMIT),
    /// [`Normalize::Fold`], [`OtherContent::Reject`].
    pub fn new(field: &str) -> Result<Self, BodyFieldError> {
        Self::builder(field).build()
    }

    /// A builder for a layer that reads field `field`.
    pub fn builder(field: &str) -> BodyFieldBuilder {
        BodyFieldBuilder {
            field: field.to_owned(),
            limit: Self::DEFAULT_LIMIT,
            normalize: Normalize::default(),
            other: OtherContent::default(),
        }
    }

    /// The key extractor for the field this layer reads.
    pub fn key(&self) -> BodyKey {
        BodyKey {
            field: Arc::clone(&self.settings.field),
        }
    }

    /// The name of the field read.
    pub fn field(&self) -> &str {
        &self.settings.field
    }

    /// The most bytes of a body read.
    pub fn limit(&self) -> usize {
        self.settings.limit
    }
}

impl<S> Layer<S> for BodyFieldLayer {
    type Service = BodyFieldService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BodyFieldService {
            inner,
            settings: Arc::clone(&self.settings),
        }
    }
}

/// Builds a [`BodyFieldLayer`], checking its settings.
#[derive(Debug, Clone)]
#[must_use]
pub struct BodyFieldBuilder {
    field: String,
    limit: usize,
    normalize: Normalize,
    other: OtherContent,
}

impl BodyFieldBuilder {
    /// Reads at most `bytes` bytes of a body; a larger body is answered with `413`.
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }

    /// How the value is normalised before it becomes a key ([`Normalize::Fold`] unless set).
    pub fn normalize(mut self, normalize: Normalize) -> Self {
        self.normalize = normalize;
        self
    }

    /// What happens to a request that is neither a form nor JSON ([`OtherContent::Reject`]
    /// unless set).
    pub fn other_content(mut self, other: OtherContent) -> Self {
        self.other = other;
        self
    }

    /// The layer, or why these settings cannot make one.
    pub fn build(self) -> Result<BodyFieldLayer, BodyFieldError> {
        if self.field.is_empty() {
            return Err(BodyFieldError::EmptyName);
        }
        if self.limit == 0 {
            return Err(BodyFieldError::ZeroLimit);
        }
        Ok(BodyFieldLayer {
            settings: Arc::new(Settings {
                field: Arc::from(self.field),
                limit: self.limit,
                normalize: self.normalize,
                other: self.other,
            }),
        })
    }
}

/// Why a [`BodyFieldBuilder`] cannot make a layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BodyFieldError {
    /// The field's name is empty.
    #[error("the body field's name is empty")]
    EmptyName,
    /// The limit is 0 bytes: no body could carry the field.
    #[error("the body limit is 0 bytes: no body could carry the field")]
    ZeroLimit,
}

/// How a field's value is normalised before it becomes a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Normalize {
    /// The value as sent: `Ann` and `ann` are two budgets.
    Exact,
    /// Leading and trailing white space removed (Unicode's `White_Space`).
    Trim,
    /// Unicode NFKC, trimmed, lowercased: `ann`, ` ANN ` and `ＡＮＮ` are one budget. The
    /// default.
    #[default]
    Fold,
}

impl Normalize {
    /// `value`, normalised.
    ///
    /// ```
    /// use tower_redis_ratelimit::key::body::Normalize;
    ///
    /// assert_eq!(Normalize::Fold.apply(" ANN "), "ann");
    /// assert_eq!(Normalize::Fold.apply("ＡＮＮ"), "ann");
    /// assert_eq!(Normalize::Fold.apply("ÉLODIE"), "élodie");
    /// assert_eq!(Normalize::Trim.apply(" Ann "), "Ann");
    /// assert_eq!(Normalize::Exact.apply(" Ann "), " Ann ");
    /// ```
    pub fn apply(self, value: &str) -> String {
        match self {
            Normalize::Exact => value.to_owned(),
            Normalize::Trim => value.trim().to_owned(),
            // NFKC leaves ASCII as it is.
            Normalize::Fold if value.is_ascii() => value.trim().to_ascii_lowercase(),
            Normalize::Fold => value.nfkc().collect::<String>().trim().to_lowercase(),
        }
    }
}

/// What [`BodyFieldLayer`] does with a request that is neither a form nor JSON: another
/// `Content-Type` or none, or a `Content-Encoding` other than `identity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OtherContent {
    /// Answer `415 Unsupported Media Type`. The default.
    #[default]
    Reject,
    /// Hand the request on untouched, its body unread and without a [`BodyField`]; a
    /// [`BodyKey`] then finds no key, and the rate-limit layer's
    /// [`MissingKey`](crate::MissingKey) applies.
    Pass,
}

/// The field a [`BodyFieldLayer`] read, in the request's extensions: its name and its
/// normalised value, never empty.
///
/// Handlers can read it too (axum: `Extension<BodyField>`). Its `Debug` output shows the
/// value as [`Key::loggable`] does, so that a user name stays out of the logs.
#[derive(Clone, PartialEq, Eq)]
pub struct BodyField {
    name: Arc<str>,
    value: String,
}

impl BodyField {
    /// A field as the layer would have put it, e.g. to test a handler.
    pub fn new(name: &str, value: impl Into<String>) -> Self {
        BodyField {
            name: Arc::from(name),
            value: value.into(),
        }
    }

    /// The field's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The field's value, normalised as the layer was told.
    pub fn value(&self) -> &str {
        &self.value
    }
}

impl fmt::Debug for BodyField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyField")
            .field("name", &self.name)
            .field("value", &Key::from(self.value.as_str()).loggable())
            .finish()
    }
}

/// The key of a request: the [`BodyField`] a [`BodyFieldLayer`] outside the rate-limit layer
/// read. Without it (no such layer, another field, or a request passed on unread) the
/// request has no key ([`KeyError::MissingBodyField`]).
///
/// ```
/// use http::Request;
/// use tower_redis_ratelimit::key::body::{BodyField, BodyKey};
/// use tower_redis_ratelimit::{Key, KeyExtractor};
///
/// let mut request = Request::new(());
/// request.extensions_mut().insert(BodyField::new("username", "ann"));
/// assert_eq!(BodyKey::new("username").extract(&request), Ok(Key::from("ann")));
/// assert!(BodyKey::new("email").extract(&request).is_err());
/// ```
#[derive(Debug, Clone)]
pub struct BodyKey {
    field: Arc<str>,
}

impl BodyKey {
    /// Keys requests by body field `field` (see also [`BodyFieldLayer::key`]).
    pub fn new(field: &str) -> Self {
        BodyKey {
            field: Arc::from(field),
        }
    }
}

impl<B> KeyExtractor<B> for BodyKey {
    fn extract(&self, request: &Request<B>) -> Result<Key, KeyError> {
        match request.extensions().get::<BodyField>() {
            Some(found) if found.name == self.field && !found.value.is_empty() => {
                Ok(Key::from(found.value.as_str()))
            }
            _ => Err(KeyError::MissingBodyField(self.field.to_string())),
        }
    }
}

/// The service of a [`BodyFieldLayer`].
#[derive(Debug, Clone)]
pub struct BodyFieldService<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S, B, ResBody> Service<Request<B>> for BodyFieldService<S>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let settings = &self.settings;
        let Some(format) = Format::of(request.headers()) else {
            let state = match settings.other {
                OtherContent::Reject => State::answer(Problem::Unsupported, settings),
                OtherContent::Pass => State::Calling {
                    future: self.inner.call(request.map(RequestBody::passed)),
                },
            };
            return ResponseFuture { state };
        };
        if declared_over(&request, settings.limit) {
            let state = State::answer(Problem::TooLarge, settings);
            return ResponseFuture { state };
        }
        // The service made ready goes with the request; this one keeps a clone.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let (parts, body) = request.into_parts();
        ResponseFuture {
            state: State::Reading {
                collect: Limited::new(body, settings.limit).collect(),
                waiting: Some(Waiting {
                    parts,
                    inner,
                    format,
                    settings: Arc::clone(settings),
                }),
            },
        }
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

pin_project! {
    /// Response future of [`BodyFieldService`]: `Reading` (the body, up to the limit) →
    /// `Calling` (the inner service), or an answer of the layer's own.
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
            waiting: Option<Waiting<S>>,
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
struct Waiting<S> {
    parts: Parts,
    inner: S,
    format: Format,
    settings: Arc<Settings>,
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
    fn read(waiting: Waiting<S>, read: Result<Collected<Bytes>, BoxError>) -> Self {
        let Waiting {
            parts,
            mut inner,
            format,
            settings,
        } = waiting;
        let collected = match read {
            Ok(collected) => collected,
            Err(error) if over_limit(&*error) => {
                return State::answer(Problem::TooLarge, &settings)
            }
            Err(_) => return State::answer(Problem::Unreadable, &settings),
        };
        let trailers = collected.trailers().cloned();
        let bytes = collected.to_bytes();
        let value = match format.field(&bytes, &settings.field) {
            Ok(raw) => settings.normalize.apply(&raw),
            Err(problem) => return State::answer(problem, &settings),
        };
        if value.is_empty() {
            return State::answer(Problem::Missing, &settings);
        }
        let mut request = Request::from_parts(parts, RequestBody::buffered(bytes, trailers));
        request.extensions_mut().insert(BodyField {
            name: Arc::clone(&settings.field),
            value,
        });
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
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Reading { collect, waiting } => {
                    let read = ready!(collect.poll(cx));
                    let waiting = waiting
                        .take()
                        .expect("ResponseFuture polled after completion");
                    let next = State::read(waiting, read);
                    this.state.set(next);
                }
                StateProj::Calling { future } => {
                    let response = ready!(future.poll(cx))?;
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

/// Why the layer answers a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Problem {
    TooLarge,
    Unreadable,
    Unsupported,
    NotJsonObject,
    Missing,
    Twice,
    NotText,
}

impl Problem {
    fn response(self, settings: &Settings) -> Response<Full<Bytes>> {
        let field = &settings.field;
        let (status, text) = match self {
            Problem::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is over {} bytes", settings.limit),
            ),
            Problem::Unreadable => (
                StatusCode::BAD_REQUEST,
                "the request body could not be read".to_owned(),
            ),
            Problem::Unsupported => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send a form (application/x-www-form-urlencoded) or JSON (application/json), \
                 without a Content-Encoding"
                    .to_owned(),
            ),
            Problem::NotJsonObject => (
                StatusCode::BAD_REQUEST,
                "the request body is not a JSON object".to_owned(),
            ),
            Problem::Missing => (
                StatusCode::BAD_REQUEST,
                format!("the request body has no field {field:?}, or it is empty"),
            ),
            Problem::Twice => (
                StatusCode::BAD_REQUEST,
                format!("the request body has the field {field:?} more than once"),
            ),
            Problem::NotText => (
                StatusCode::BAD_REQUEST,
                format!("the field {field:?} is neither a string nor a number"),
            ),
        };
        let reason = status.canonical_reason().unwrap_or("Error");
        let mut response = Response::new(Full::new(Bytes::from(format!("{reason}: {text}\n"))));
        *response.status_mut() = status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        response
    }
}

/// The body formats the layer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Form,
    Json,
}

impl Format {
    /// The format of a request with `headers`: one `Content-Type` the layer reads (as axum's
    /// `Form` and `Json` do: parameters ignored, `application/*+json` is JSON), and no
    /// `Content-Encoding` other than `identity`.
    fn of(headers: &HeaderMap) -> Option<Format> {
        let encoded = headers.get_all(CONTENT_ENCODING).iter().any(|coding| {
            !coding
                .as_bytes()
                .trim_ascii()
                .eq_ignore_ascii_case(b"identity")
        });
        let mut types = headers.get_all(CONTENT_TYPE).iter();
        let (Some(content_type), None, false) = (types.next(), types.next(), encoded) else {
            return None;
        };
        let essence = content_type.to_str().ok()?.split(';').next()?.trim();
        let (kind, subtype) = essence.split_once('/')?;
        if !kind.eq_ignore_ascii_case("application") {
            return None;
        }
        let subtype = subtype.to_ascii_lowercase();
        if subtype == "x-www-form-urlencoded" {
            Some(Format::Form)
        } else if subtype == "json" || subtype.ends_with("+json") {
            Some(Format::Json)
        } else {
            None
        }
    }

    /// The raw value of field `name` in `body`.
    fn field(self, body: &[u8], name: &str) -> Result<String, Problem> {
        match self {
            Format::Form => form_field(body, name),
            Format::Json => json_field(body, name),
        }
    }
}

/// Field `name` of a form, percent-decoded as axum's `Form` decodes it (`+` is a space, bytes
/// that are not UTF-8 become U+FFFD).
fn form_field(body: &[u8], name: &str) -> Result<String, Problem> {
    let mut found = None;
    for (key, value) in form_urlencoded::parse(body) {
        if key == name {
            if found.is_some() {
                return Err(Problem::Twice);
            }
            found = Some(value);
        }
    }
    found
        .map(|value| value.into_owned())
        .ok_or(Problem::Missing)
}

/// Field `name` of a JSON object: a string, or a number as its text.
fn json_field(body: &[u8], name: &str) -> Result<String, Problem> {
    let mut json = serde_json::Deserializer::from_slice(body);
    let found = json
        .deserialize_map(TopLevel { name })
        .map_err(|_| Problem::NotJsonObject)?;
    json.end().map_err(|_| Problem::NotJsonObject)?;
    found
}

/// Walks a JSON object's fields, skipping all but `name`'s value without keeping them.
struct TopLevel<'a> {
    name: &'a str,
}

impl<'de> Visitor<'de> for TopLevel<'_> {
    type Value = Result<String, Problem>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(is_field) = map.next_key_seed(IsField(self.name))? {
            if !is_field {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let value = map.next_value::<serde_json::Value>()?;
            found = Some(match (found, value) {
                (Some(_), _) => Err(Problem::Twice),
                (None, serde_json::Value::String(text)) => Ok(text),
                (None, serde_json::Value::Number(number)) => Ok(number.to_string()),
                (None, _) => Err(Problem::NotText),
            });
        }
        Ok(found.unwrap_or(Err(Problem::Missing)))
    }
}

/// Whether a JSON object's key is the field's name, without keeping the key.
struct IsField<'a>(&'a str);

impl<'de> DeserializeSeed<'de> for IsField<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for IsField<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

pin_project! {
    /// The request body the inner service of a [`BodyFieldLayer`] gets: the bytes the layer
    /// read (and the trailers, if any), or the original body of a request passed on unread
    /// ([`OtherContent::Pass`]).
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
    /// A body of `bytes`, as the layer hands on one it read.
    pub fn new(bytes: Bytes) -> Self {
        Self::buffered(bytes, None)
    }

    fn buffered(bytes: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!bytes.is_empty()).then_some(bytes);
        RequestBody {
            kind: RequestKind::Buffered { data, trailers },
        }
    }

    fn passed(body: B) -> Self {
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

pin_project! {
    /// The response body of a [`BodyFieldService`]: the inner service's body, or the short
    /// body of an answer of the layer's own (`413`, `415`, `400`).
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B> {
        Inner { #[pin] body: B },
        Own { #[pin] body: Full<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    fn inner(body: B) -> Self {
        ResponseBody {
            kind: ResponseKind::Inner { body },
        }
    }

    fn own(body: Full<Bytes>) -> Self {
        ResponseBody {
            kind: ResponseKind::Own { body },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ResponseKindProj::Inner { body } => body.poll_frame(cx),
            ResponseKindProj::Own { body } => match body.poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                // `Full` never fails, and has its frame at once.
                _ => Poll::Ready(None),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Inner { body } => body.is_end_stream(),
            ResponseKind::Own { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Inner { body } => body.size_hint(),
            ResponseKind::Own { body } => body.size_hint(),
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{Empty, StreamBody};
    use tower::{service_fn, ServiceExt};

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|&(name, value)| {
                (
                    http::HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                )
            })
            .collect()
    }

    fn of(pairs: &[(&'static str, &'static str)]) -> Option<Format> {
        Format::of(&headers(pairs))
    }

    #[test]
    fn reads_forms_and_json_as_axum_does_and_nothing_else() {
        let form = "application/x-www-form-urlencoded";
        assert_eq!(of(&[("content-type", form)]), Some(Format::Form));
        assert_eq!(
            of(&[(
                "content-type",
                "Application/X-WWW-Form-Urlencoded; charset=UTF-8"
            )]),
            Some(Format::Form)
        );
        assert_eq!(
            of(&[("content-type", "application/json")]),
            Some(Format::Json)
        );
        assert_eq!(
            of(&[("content-type", "application/vnd.api+json")]),
            Some(Format::Json)
        );
        for other in [
            "text/plain",
            "application/grpc",
            "multipart/form-data",
            "json",
        ] {
            assert_eq!(of(&[("content-type", other)]), None, "{other}");
        }
        assert_eq!(of(&[]), None);
        assert_eq!(
            of(&[("content-type", form), ("content-encoding", "gzip")]),
            None
        );
        assert_eq!(
            of(&[("content-type", form), ("content-encoding", "identity")]),
            Some(Format::Form)
        );
        let mut two = headers(&[("content-type", form)]);
        two.append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        assert_eq!(Format::of(&two), None);
    }

    #[test]
    fn takes_one_form_field_decoded() {
        let field = |body: &str| form_field(body.as_bytes(), "username");
        assert_eq!(field("password=x&username=ann").as_deref(), Ok("ann"));
        assert_eq!(field("username=ANN+%41%C3%A9").as_deref(), Ok("ANN Aé"));
        assert_eq!(field("username=%FF").as_deref(), Ok("\u{FFFD}"));
        assert_eq!(field("user=ann"), Err(Problem::Missing));
        assert_eq!(field(""), Err(Problem::Missing));
        assert_eq!(field("username=ann&username=bob"), Err(Problem::Twice));
    }

    #[test]
    fn takes_one_top_level_json_field() {
        let field = |body: &str| json_field(body.as_bytes(), "username");
        assert_eq!(field(r#"{"username": "ann"}"#).as_deref(), Ok("ann"));
        assert_eq!(
            field(r#"{"a": [1, {"username": "x"}], "username": "\u0041nn"}"#).as_deref(),
            Ok("Ann")
        );
        assert_eq!(field(r#"{"username": 42}"#).as_deref(), Ok("42"));
        assert_eq!(field(r#"{"username": -4.5}"#).as_deref(), Ok("-4.5"));
        assert_eq!(
            field(r#"{"user": "ann", "nested": {"username": "x"}}"#),
            Err(Problem::Missing)
        );
        for not_text in [
            r#"{"username": null}"#,
            r#"{"username": ["ann"]}"#,
            r#"{"username": true}"#,
        ] {
            assert_eq!(field(not_text), Err(Problem::NotText), "{not_text}");
        }
        assert_eq!(
            field(r#"{"username": "ann", "username": "bob"}"#),
            Err(Problem::Twice)
        );
        for broken in [
            "",
            "[]",
            r#""ann""#,
            r#"{"username": "ann""#,
            r#"{"username": "ann"} x"#,
        ] {
            assert_eq!(field(broken), Err(Problem::NotJsonObject), "{broken}");
        }
        // Deep values do not overflow the stack: skipped ones are walked without recursion,
        // and the field's own stops at serde_json's depth limit.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let skipped = format!(r#"{{"a": {deep}, "username": "ann"}}"#);
        assert_eq!(field(&skipped).as_deref(), Ok("ann"));
        let kept = format!(r#"{{"username": {deep}}}"#);
        assert_eq!(field(&kept), Err(Problem::NotJsonObject));
    }

    #[test]
    fn folds_case_width_and_white_space() {
        assert_eq!(Normalize::Fold.apply("\u{3000}ＡＮＮ\t"), "ann");
        assert_eq!(Normalize::Fold.apply("ÅSA"), "åsa");
        // NFKC composes: a decomposed é is the composed one.
        assert_eq!(Normalize::Fold.apply("E\u{301}"), "\u{e9}");
        assert_eq!(Normalize::Trim.apply("\u{3000}Ann "), "Ann");
    }

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

    #[tokio::test]
    async fn hands_on_the_bytes_and_the_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-check", HeaderValue::from_static("1"));
        let body = RequestBody::<Empty<Bytes>>::buffered(Bytes::from("a=1"), Some(trailers));
        assert_eq!(body.size_hint().exact(), Some(3));
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-check"], "1");
        assert_eq!(collected.to_bytes(), "a=1");
        let empty = RequestBody::<Empty<Bytes>>::new(Bytes::new());
        assert!(empty.is_end_stream());
    }

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
                let text = format!("{:?} {}", field.map(|f| f.value), body.len());
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
        let layer = BodyFieldLayer::new("username").unwrap();
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
        let layer = BodyFieldLayer::new("username").unwrap();
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

    #[test]
    fn the_builder_refuses_what_cannot_work() {
        assert_eq!(
            BodyFieldLayer::new("").unwrap_err(),
            BodyFieldError::EmptyName
        );
        assert_eq!(
            BodyFieldLayer::builder("u").limit(0).build().unwrap_err(),
            BodyFieldError::ZeroLimit
        );
    }

    #[test]
    fn the_key_is_the_field_of_its_name_and_bounded() {
        let key = BodyKey::new("username");
        let with = |field: BodyField| {
            let mut request = Request::new(());
            request.extensions_mut().insert(field);
            request
        };
        assert_eq!(
            key.extract(&with(BodyField::new("username", "ann"))),
            Ok(Key::from("ann"))
        );
        let huge = key
            .extract(&with(BodyField::new("username", "a".repeat(16_000))))
            .unwrap();
        assert_eq!(huge.as_str().len(), 33);
        assert_eq!(
            key.extract(&with(BodyField::new("email", "ann"))),
            Err(KeyError::MissingBodyField("username".to_owned()))
        );
        assert!(key.extract(&Request::new(())).is_err());
        let shown = format!("{:?}", BodyField::new("username", "ann"));
        assert!(!shown.contains("\"ann\""), "{shown}");
    }
}
