//! The layer's own answers, HTTP and gRPC: a refusal, a blocked client's, a missing key's and
//! a failed store's, each marked [`Refused`]; and [`answer`], the layer's answer to a decision
//! that code made with a store itself.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;

use super::fields::{ceil_secs, value, RATELIMIT};
use super::responder::{Options, Responder, Unit};
use crate::{Decision, KeyError, Policy};

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

/// What the layer answers for `decision`, for code that decides with a store itself: a
/// handler that calls [`Store::check`](crate::Store::check) (a limit on one action of a route,
/// a key known only in the handler) and should answer a client as the layer would.
///
/// - **Refused**: `Err` with the layer's refusal, built by the layer's own code: `429 Too
///   Many Requests`, `Retry-After` in whole seconds rounded up (never `0`; absent only where
///   no wait helps: a block, or a request larger than the limit itself), the
///   [`RATELIMIT_POLICY`](super::RATELIMIT_POLICY) and [`RATELIMIT`] fields and a plain-text
///   body; for a gRPC request (`content-type: application/grpc*` in `request`), HTTP 200
///   with `grpc-status: 8` (`RESOURCE_EXHAUSTED`) and `grpc-retry-pushback-ms`. It is marked
///   [`Refused`].
/// - **Admitted**: `Ok` with the fields the layer adds to an admitted answer,
///   `RateLimit-Policy` and `RateLimit`, for the handler to send with its own answer (or to
///   drop).
///
/// `policy` is the one `decision` was made under; the fields name its limits, as the layer's
/// do. With another policy the answer is still well formed, never a panic, but the fields may
/// name other limits. The layer's own choices ([`on_rejection`], [`headers_on_allowed`]) are
/// not known here: the answer is the layer's default one.
///
/// [`on_rejection`]: crate::RateLimitLayerBuilder::on_rejection
/// [`headers_on_allowed`]: crate::RateLimitLayerBuilder::headers_on_allowed
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::extract::State;
/// use axum::response::{IntoResponse, Response};
/// use axum::{http::HeaderMap, http::StatusCode, routing::post, Router};
/// use tower::ServiceExt;
/// use tower_redis_ratelimit::{response, Key, MemoryStore, Policy, Store};
///
/// #[derive(Clone)]
/// struct App {
///     store: MemoryStore,
///     sms: Policy,
/// }
///
/// // One text message a minute per phone number, which only the handler knows.
/// async fn send(State(app): State<App>, headers: HeaderMap) -> Response {
///     let Some(phone) = headers.get("x-phone").map(|v| Key::from(v.as_bytes())) else {
///         return (StatusCode::BAD_REQUEST, "x-phone is missing\n").into_response();
///     };
///     let decision = match app.store.check(&phone, &app.sms, 1).await {
///         Ok(decision) => decision,
///         Err(error) => {
///             return (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()
///         }
///     };
///     match response::answer(&decision, &app.sms, &headers) {
///         Ok(fields) => (fields, "sent\n").into_response(),
///         Err(refusal) => refusal.into_response(),
///     }
/// }
///
/// let app = App { store: MemoryStore::new(), sms: Policy::new("sms", ["1/1m".parse()?])? };
/// let router = Router::new().route("/send", post(send)).with_state(app);
/// let request = || {
///     http::Request::post("/send")
///         .header("x-phone", "+44 7700 900123")
///         .body(axum::body::Body::empty())
/// };
///
/// let sent = router.clone().oneshot(request()?).await?;
/// assert_eq!(sent.status(), StatusCode::OK);
/// assert_eq!(sent.headers()["ratelimit"], "\"sms\";r=0;t=60");
///
/// let refused = router.oneshot(request()?).await?;
/// assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
/// assert_eq!(refused.headers()["retry-after"], "60");
/// assert_eq!(refused.headers()["ratelimit-policy"], "\"sms\";q=1;w=60");
/// # Ok(()) }
/// ```
// The refusal is returned once and sent as it is (`Result<_, Response>`, as axum handlers
// return): boxing it would cost an allocation and an unboxing for nothing.
#[allow(clippy::result_large_err)]
pub fn answer(
    decision: &Decision,
    policy: &Policy,
    request: &HeaderMap,
) -> Result<HeaderMap, Response<Full<Bytes>>> {
    let responder = Responder::new(policy.clone(), Options::default());
    if decision.is_allowed() {
        let mut fields = HeaderMap::new();
        responder.add_headers(&mut fields, decision);
        return Ok(fields);
    }
    let grpc = grpc_content_type(request);
    Err(responder.rejection(decision, grpc.as_ref()))
}

/// Marks `response` as the layer's own answer (see [`Refused`]).
fn refused<B>(mut response: Response<B>) -> Response<B> {
    response.extensions_mut().insert(Refused);
    response
}

impl Responder {
    /// The `429 Too Many Requests` answer to a refused request; `413 Content Too Large`, with
    /// no `Retry-After`, for a request body larger than a limit in bytes itself.
    pub(crate) fn rejection(
        &self,
        decision: &Decision,
        grpc: Option<&HeaderValue>,
    ) -> Response<Full<Bytes>> {
        let retry = decision.retry_after().map(ceil_secs);
        // A body in bytes larger than the limit itself: no wait helps, HTTP's 413 says so.
        let too_large = self.options.unit == Unit::ContentBytes
            && retry.is_none()
            && decision.limit() > 0
            && !decision.is_concurrency_limit();
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
                    None if too_large => format!(
                        "Content Too Large: the request body exceeds the limit \"{}\" ({} per {} s) itself\n",
                        self.policy.name(),
                        decision.limit(),
                        ceil_secs(decision.window()),
                    ),
                    None => "Too Many Requests: this request exceeds the limit itself\n".into(),
                };
                let mut response = Response::new(Bytes::from(text));
                *response.status_mut() = match too_large {
                    true => StatusCode::PAYLOAD_TOO_LARGE,
                    false => StatusCode::TOO_MANY_REQUESTS,
                };
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

#[cfg(test)]
mod tests {
    use http::header::HeaderName;

    use super::*;
    use crate::model::Outcome;
    use crate::response::RATELIMIT_POLICY;

    fn refused(policy: &Policy, index: usize, retry_after: Option<u64>) -> Decision {
        let outcome = Outcome {
            allowed: false,
            index,
            remaining: 0,
            reset_after: retry_after.unwrap_or(0),
            retry_after,
        };
        Decision::from_outcome(outcome, policy)
    }

    fn field<'a>(response: &'a Response<Full<Bytes>>, name: &HeaderName) -> Option<&'a str> {
        response.headers().get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn a_refusal_is_the_layers_429() {
        let policy: Policy = "2/2s + 3/10s".parse().unwrap();
        let decision = refused(&policy, 1, Some(7_800_000));
        let got = answer(&decision, &policy, &HeaderMap::new()).unwrap_err();
        let layers = Responder::new(policy.clone(), Options::default()).rejection(&decision, None);
        assert_eq!(got.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(got.headers(), layers.headers());
        assert_eq!(field(&got, &RETRY_AFTER), Some("8"));
        assert_eq!(field(&got, &RATELIMIT), Some("\"default-10s\";r=0;t=8"));
        assert_eq!(
            field(&got, &RATELIMIT_POLICY),
            Some("\"default-2s\";q=2;w=2, \"default-10s\";q=3;w=10")
        );
        assert!(got.extensions().get::<Refused>().is_some());
    }

    #[test]
    fn never_retry_after_zero() {
        let policy: Policy = "5/1s".parse().unwrap();
        for micros in [0, 1, 999_999, 1_000_000] {
            let decision = refused(&policy, 0, Some(micros));
            let got = answer(&decision, &policy, &HeaderMap::new()).unwrap_err();
            assert_eq!(field(&got, &RETRY_AFTER), Some("1"), "{micros} µs");
        }
        // A block, and a request larger than the limit: no wait helps, so no Retry-After.
        let blocked = Decision::blocked(&policy);
        let got = answer(&blocked, &policy, &HeaderMap::new()).unwrap_err();
        assert_eq!(got.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(field(&got, &RETRY_AFTER), None);
        let too_large = refused(&policy, 0, None);
        let got = answer(&too_large, &policy, &HeaderMap::new()).unwrap_err();
        assert_eq!(field(&got, &RETRY_AFTER), None);
    }

    #[test]
    fn an_admitted_decision_gives_the_fields_of_an_admitted_answer() {
        let policy: Policy = "5/10s".parse().unwrap();
        let outcome = Outcome {
            allowed: true,
            index: 0,
            remaining: 4,
            reset_after: 10_000_000,
            retry_after: None,
        };
        let decision = Decision::from_outcome(outcome, &policy);
        let fields = answer(&decision, &policy, &HeaderMap::new()).unwrap();
        assert_eq!(fields.len(), 2);
        assert_eq!(fields[RATELIMIT_POLICY], "\"default\";q=5;w=10");
        assert_eq!(fields[RATELIMIT], "\"default\";r=4;t=10");
    }

    #[test]
    fn a_grpc_request_gets_the_grpc_refusal() {
        let policy: Policy = "5/1s".parse().unwrap();
        let mut request = HeaderMap::new();
        request.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        let decision = refused(&policy, 0, Some(1_500_000));
        let got = answer(&decision, &policy, &request).unwrap_err();
        assert_eq!(got.status(), StatusCode::OK);
        assert_eq!(field(&got, &CONTENT_TYPE), Some("application/grpc"));
        assert_eq!(got.headers()["grpc-status"], "8");
        assert_eq!(got.headers()["grpc-retry-pushback-ms"], "1500");
        assert_eq!(field(&got, &RETRY_AFTER), Some("2"));
    }

    #[test]
    fn another_policy_never_panics() {
        let three: Policy = "1/1s + 2/1m + 3/1h".parse().unwrap();
        let one: Policy = "1/1s".parse().unwrap();
        let decision = refused(&three, 2, Some(10_000_000));
        let got = answer(&decision, &one, &HeaderMap::new()).unwrap_err();
        assert_eq!(got.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(field(&got, &RETRY_AFTER), Some("10"));
    }
}
