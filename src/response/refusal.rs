//! The layer's own answers, HTTP and gRPC: a refusal, a blocked client's, a missing key's and
//! a failed store's, each marked [`Refused`].

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;

use super::fields::{ceil_secs, value, RATELIMIT};
use super::responder::Responder;
use crate::{Decision, KeyError};

/// Marks a response that a layer of this crate answered itself, without calling the service
/// it wraps: a refusal (`429`, gRPC `RESOURCE_EXHAUSTED`), a blocked client's `403`, or the
/// `503`/`400`/`500` of a store failure or a missing key. Found in the response's extensions.
///
/// A usage-limited layer further out, which admitted the request and reserved units for it,
/// settles such a request to zero: a request refused by one limiter costs the others nothing
/// (see [`usage`](crate::usage)). A middleware of your own that refuses requests can insert it
/// too, for the same effect.
///
/// ```
/// use tower_redis_ratelimit::response::Refused;
///
/// let mut response = http::Response::new(());
/// response.extensions_mut().insert(Refused);
/// assert!(response.extensions().get::<Refused>().is_some());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Refused;

/// Marks `response` as the layer's own answer (see [`Refused`]).
fn refused<B>(mut response: Response<B>) -> Response<B> {
    response.extensions_mut().insert(Refused);
    response
}

impl Responder {
    /// The `429 Too Many Requests` answer to a refused request.
    pub(crate) fn rejection(
        &self,
        decision: &Decision,
        grpc: Option<&HeaderValue>,
    ) -> Response<Full<Bytes>> {
        let retry = decision.retry_after().map(ceil_secs);
        let mut response = match (&self.options.on_rejection, grpc) {
            (_, Some(content_type)) => {
                let message = match decision.is_concurrency_limit() {
                    true => format!("concurrency limit {} reached", self.policy.name()),
                    false => format!("rate limit {} exceeded", self.policy.name()),
                };
                grpc_status(content_type, 8, &message, decision.retry_after()).map(|_| Bytes::new())
            }
            (Some(custom), None) => custom(decision),
            (None, None) => {
                let text = match retry {
                    Some(secs) if decision.is_concurrency_limit() => format!(
                        "Too Many Requests: {} requests of this client are in flight; retry in {secs} s\n",
                        decision.limit()
                    ),
                    // Sized exactly, so that `Bytes` takes it over without allocating again.
                    Some(secs) => [
                        "Too Many Requests: retry in ",
                        itoa::Buffer::new().format(secs),
                        " s\n",
                    ]
                    .concat(),
                    // A limit of 0: an override blocks the key (`store::Override::Block`).
                    None if decision.limit() == 0 => "Too Many Requests: blocked\n".into(),
                    None => "Too Many Requests: this request exceeds the limit itself\n".into(),
                };
                let mut response = Response::new(Bytes::from(text));
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                response.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                response
            }
        };
        let headers = response.headers_mut();
        if let Some(secs) = retry {
            headers
                .entry(RETRY_AFTER)
                .or_insert_with(|| HeaderValue::from(secs));
        }
        if !headers.contains_key(RATELIMIT) {
            self.add_headers(headers, decision);
        }
        refused(response.map(Full::new))
    }

    /// The answer when no key could be extracted and
    /// [`MissingKey::Reject`](super::MissingKey::Reject) applies.
    pub(crate) fn missing_key(
        error: &KeyError,
        grpc: Option<&HeaderValue>,
    ) -> Response<Full<Bytes>> {
        let (status, code) = match error {
            KeyError::MissingPeerAddr => (StatusCode::INTERNAL_SERVER_ERROR, 13),
            _ => (StatusCode::BAD_REQUEST, 3),
        };
        let text = format!("rate limiter: {error}");
        refused(match grpc {
            Some(content_type) => grpc_status(content_type, code, &text, None),
            None => plain(status, text + "\n", None),
        })
    }

    /// The answer to a blocked client: 403, or gRPC `PERMISSION_DENIED`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn forbidden(grpc: Option<&HeaderValue>) -> Response<Full<Bytes>> {
        let text = "Forbidden: this client is blocked";
        refused(match grpc {
            Some(content_type) => grpc_status(content_type, 7, text, None),
            None => plain(StatusCode::FORBIDDEN, format!("{text}\n"), None),
        })
    }

    /// The answer when the store failed and
    /// [`FailureMode::Closed`](super::FailureMode::Closed) applies.
    pub(crate) fn unavailable(grpc: Option<&HeaderValue>) -> Response<Full<Bytes>> {
        let text = "Service Unavailable: rate limiter store is unreachable";
        refused(match grpc {
            Some(content_type) => grpc_status(content_type, 14, text, Some(Duration::from_secs(1))),
            None => plain(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{text}\n"),
                Some(1),
            ),
        })
    }
}

/// The content type of a gRPC request (`application/grpc`, `application/grpc+proto`,
/// `application/grpc-web`, ...), which its answer repeats; `None` for other requests.
pub(crate) fn grpc_content_type(headers: &HeaderMap) -> Option<HeaderValue> {
    headers
        .get(CONTENT_TYPE)
        .filter(|v| {
            v.as_bytes()
                .get(..16)
                .is_some_and(|p| p.eq_ignore_ascii_case(b"application/grpc"))
        })
        .cloned()
}

/// A trailers-only gRPC answer: HTTP 200, no body, the status in the headers.
fn grpc_status(
    content_type: &HeaderValue,
    code: u8,
    message: &str,
    retry: Option<Duration>,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, content_type.clone());
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    // Our messages are printable ASCII without '%', which grpc-message carries as is.
    headers.insert("grpc-message", value(message.to_owned()));
    match retry {
        Some(retry) => {
            headers.insert(RETRY_AFTER, HeaderValue::from(ceil_secs(retry)));
            let ms = retry.as_micros().div_ceil(1000).max(1) as u64;
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from(ms));
        }
        // gRFC A6: a negative pushback tells the client not to retry.
        None => {
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from_static("-1"));
        }
    }
    response
}

/// A plain-text answer with `status`, and `Retry-After` when `retry_after` is given.
fn plain(status: StatusCode, text: String, retry_after: Option<u64>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Some(secs) = retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}
