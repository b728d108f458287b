//! Keys from the request body: a login form's user name, a JSON body's account id.
//!
//! A [`KeyExtractor`] sees a request before anybody has read its body, so a key that lives in
//! the body needs a layer in front of the rate-limit layer (outside it) that reads it first.
//! [`BodyFieldLayer`] buffers at most [`limit`](BodyFieldBuilder::limit) bytes of the body,
//! takes one field from a form (`application/x-www-form-urlencoded`) or a JSON object
//! (`application/json`, `application/*+json`), puts it into the request's extensions as a
//! [`BodyField`], and hands the inner service the request with the same bytes as its body.
//! [`BodyKey`] is the key extractor that reads the field from there, so key extraction stays
//! synchronous. [`number`](BodyFieldBuilder::number) reads more fields in the same pass, each
//! kept as the number it is, into the request's [`BodyFields`]: a cost read from the body,
//! such as an LLM request's `max_tokens`.
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
//! | a [`number`](BodyFieldBuilder::number) field sent twice, or not a whole number of at least 0 | `400` |
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
//! [`Normalize::Fold`], the default, makes `ann`, `Ann`, ` ANN `, the full-width `ＡＮＮ`,
//! `Ánn` and `an\u{AD}n` (a soft hyphen inside) one budget: the value is decomposed (NFKD),
//! its accents and its invisible characters (controls and Unicode's default-ignorable code
//! points, which render as nothing and which database collations such as MySQL's
//! `utf8mb4_0900_ai_ci` ignore) are dropped, and what is left is composed again (NFKC),
//! trimmed and lowercased (`str::to_lowercase`, which knows every script's case; it does not
//! fold `ß` into `ss`). Letters of other scripts that look alike (a Cyrillic `а`) stay apart,
//! as they do in a user table.
//! A lockout that a client can sidestep by writing its name in capitals locks nobody out, and
//! folding can only merge budgets, never split one; [`Normalize::Trim`] and
//! [`Normalize::Exact`] are there for fields whose case matters. The handler still gets the
//! body as it was sent; [`BodyField::value`] is the normalised value.
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
//! [`ResponseBody`](crate::body::ResponseBody), as the rate-limit layer's: the inner
//! service's body, or the layer's own answer.
//!
//! # gRPC
//!
//! The layer reads forms and JSON; a gRPC request (`application/grpc`) is another content
//! type: refused with `415` by default, or passed on untouched, its stream unread, with
//! [`OtherContent::Pass`]. Put the layer on the HTTP routes that take the form, not on a
//! tonic server.
//!
//! [`KeyExtractor`]: crate::KeyExtractor
//! [`Key::MAX_LEN`]: crate::Key::MAX_LEN

mod bodies;
mod error;
mod field;
mod future;
mod parse;
mod service;

use std::sync::Arc;

use tower_layer::Layer;

pub use bodies::RequestBody;
pub use error::InnerError;
use field::Settings;
pub use field::{BodyField, BodyFields, BodyKey, Normalize, OtherContent};
pub use future::ResponseFuture;
pub use service::BodyFieldService;

/// Reads one field of a form or JSON request body into the request's extensions, for
/// [`BodyKey`] (and any [number fields](BodyFieldBuilder::number), for a cost); see the
/// [module documentation](self) for what it answers and why.
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
/// # drop(layer);
/// assert!(BodyFieldLayer::builder("").build().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct BodyFieldLayer {
    settings: Arc<Settings>,
}

impl BodyFieldLayer {
    /// The body limit unless [`BodyFieldBuilder::limit`] sets another: 16 KiB, many times a
    /// login form.
    pub const DEFAULT_LIMIT: usize = 16 * 1024;

    /// A builder for a layer that reads field `field`.
    pub fn builder(field: &str) -> BodyFieldBuilder {
        BodyFieldBuilder {
            field: field.to_owned(),
            numbers: Vec::new(),
            limit: Self::DEFAULT_LIMIT,
            normalize: Normalize::default(),
            other: OtherContent::default(),
        }
    }

    /// The key extractor for the field this layer reads.
    pub fn key(&self) -> BodyKey {
        BodyKey::shared(Arc::clone(&self.settings.field))
    }
}

impl<S> Layer<S> for BodyFieldLayer {
    type Service = BodyFieldService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BodyFieldService::new(inner, Arc::clone(&self.settings))
    }
}

/// Builds a [`BodyFieldLayer`], checking its settings.
#[derive(Debug, Clone)]
#[must_use]
pub struct BodyFieldBuilder {
    field: String,
    numbers: Vec<String>,
    limit: usize,
    normalize: Normalize,
    other: OtherContent,
}

impl BodyFieldBuilder {
    /// Reads number field `name` too, in the same pass over the body, into the request's
    /// [`BodyFields`]: a cost read from the body (an LLM request's `max_tokens`). The value is
    /// kept as the number it is, not normalised: in JSON an integer of at least 0 (at most
    /// `u64::MAX`), in a form its decimal digits. A body without the field is read as without
    /// it (`None`); one with the field twice, or with a value that is no such number (a
    /// fraction, a negative number, a string in JSON), is answered `400`. Repeat for more
    /// fields.
    pub fn number(mut self, name: &str) -> Self {
        self.numbers.push(name.to_owned());
        self
    }

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
        for (index, name) in self.numbers.iter().enumerate() {
            if name.is_empty() {
                return Err(BodyFieldError::EmptyName);
            }
            if *name == self.field || self.numbers[..index].contains(name) {
                return Err(BodyFieldError::NamedTwice(name.clone()));
            }
        }
        Ok(BodyFieldLayer {
            settings: Arc::new(Settings {
                field: Arc::from(self.field),
                numbers: self.numbers.into_iter().map(Arc::from).collect(),
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
    /// A field is named twice: a number field is the key field or another number field.
    #[error("the body field {0:?} is named twice")]
    NamedTwice(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_refuses_what_cannot_work() {
        assert_eq!(
            BodyFieldLayer::builder("").build().unwrap_err(),
            BodyFieldError::EmptyName
        );
        assert_eq!(
            BodyFieldLayer::builder("u").limit(0).build().unwrap_err(),
            BodyFieldError::ZeroLimit
        );
        let twice = |numbers: &[&str]| {
            let builder = numbers
                .iter()
                .fold(BodyFieldLayer::builder("u"), |b, n| b.number(n));
            builder.build().err()
        };
        assert_eq!(twice(&["n", "m"]), None);
        assert_eq!(
            twice(&["n", "n"]),
            Some(BodyFieldError::NamedTwice("n".into()))
        );
        assert_eq!(twice(&["u"]), Some(BodyFieldError::NamedTwice("u".into())));
        assert_eq!(twice(&[""]), Some(BodyFieldError::EmptyName));
    }
}
