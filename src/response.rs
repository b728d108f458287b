//! The responses and header fields the layer writes.
//!
//! Header syntax follows draft-ietf-httpapi-ratelimit-headers-10:
//!
//! ```text
//! RateLimit-Policy: "default";q=5;w=10
//! RateLimit: "default";r=0;t=7
//! Retry-After: 7
//! ```
//!
//! Each layer adds its own members after those of layers further in, so that stacked layers
//! (per route and site-wide, per API key and per IP) each show their policy; a refusal by a
//! layer further in keeps its member, with `r=0`.
//!
//! `RateLimit-Policy` lists every limit of the policy (a multi-limit policy names each limit
//! `<policy>-<window>`, e.g. `"api-1h"`; a concurrency limit comes last, as
//! `"api-concurrency";q=2;qu="concurrent-requests"`), with the counts of the request's plan, or only the
//! limit of the decision, at the count it was decided by, when an override in the store
//! changed it (see [`store::Overrides`](crate::store::Overrides)); `RateLimit` describes the limit of the
//! [`Decision`]: the one that refused, or the tightest after admitting. Seconds are rounded
//! up, so `Retry-After` is never 0 while a client is refused, and a refusal's `t` is never
//! less than its `Retry-After`.
//!
//! gRPC requests (`content-type: application/grpc*`, any case) are answered the gRPC way, in
//! their own content type: HTTP 200 with no body and the status in `grpc-status` (8 `RESOURCE_EXHAUSTED` for a refusal, 14
//! `UNAVAILABLE`, 13 `INTERNAL`, 3 `INVALID_ARGUMENT` for the other answers), a `grpc-message`,
//! and the delay in `retry-after` (seconds) and `grpc-retry-pushback-ms` (milliseconds, or
//! `-1` when no wait helps), the metadata gRPC clients read for retry throttling.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;

use crate::{Decision, KeyError, Policy};

/// The `RateLimit-Policy` header field name.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// The `RateLimit` header field name.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

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

/// Builds the response for a refused request; see
/// [`RateLimitLayerBuilder::on_rejection`](crate::RateLimitLayerBuilder::on_rejection).
pub(crate) type RejectionFn = dyn Fn(&Decision) -> Response<Bytes> + Send + Sync;

/// What the layer does when a request yields no key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer at once, without calling the service: `500 Internal Server Error` when the peer
    /// address is missing (a server set-up fault; the body says how to fix it), `400 Bad
    /// Request` when the request itself lacks the key (e.g. an absent API-key header).
    #[default]
    Reject,
    /// Call the service without limiting the request.
    Allow,
    /// Count the request under this one shared key.
    Use(crate::Key),
}

/// What the layer does when the store cannot decide (Redis unreachable or too slow).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum FailureMode {
    /// Admit the request: the limiter never becomes the outage.
    #[default]
    Open,
    /// Refuse with `503 Service Unavailable` and `Retry-After: 1`.
    Closed,
    /// Decide with this local store while the main one is unavailable: every instance then
    /// limits on its own, so a client may get up to one budget per instance until Redis is
    /// back.
    Fallback(crate::MemoryStore),
}

/// The layer's choices, set through [`RateLimitLayerBuilder`](crate::RateLimitLayerBuilder).
#[derive(Clone, Default)]
pub(crate) struct Options {
    pub(crate) hide_allowed_headers: bool,
    pub(crate) shadow: bool,
    /// Requests over the limit are passed on, marked, instead of refused (`Rule::soft`).
    pub(crate) soft: bool,
    /// Decisions are not put in the requests' extensions (`RateLimitLayerBuilder::decisions`).
    pub(crate) no_decisions: bool,
    /// How long a request refused for a concurrency slot waits for one
    /// (`RateLimitLayerBuilder::max_wait`); zero: not at all.
    pub(crate) max_wait: Duration,
    pub(crate) on_rejection: Option<Arc<RejectionFn>>,
    pub(crate) failure_mode: FailureMode,
    #[cfg(feature = "redis")]
    pub(crate) unique: Option<crate::unique::UniqueClients>,
}

/// What became of a decided request, for the counts operators see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tally {
    Allowed,
    /// Refused by the store (or counted as refused in shadow mode).
    Denied,
    /// Refused again by the deny cache.
    DeniedCached,
    /// Refused by the store for a concurrency slot.
    DeniedConcurrency,
}

impl Options {
    /// Counts a decided request in the metrics and, with `unique_clients`, as a unique client
    /// of `policy`.
    pub(crate) fn tally(&self, policy: &crate::Policy, key: &crate::Key, tally: Tally) {
        use crate::metrics::Report;
        match tally {
            Tally::Allowed => Report::allowed(policy),
            Tally::Denied => Report::denied(policy, false),
            Tally::DeniedCached => Report::denied(policy, true),
            Tally::DeniedConcurrency => Report::denied_concurrency(policy),
        }
        #[cfg(feature = "redis")]
        if let Some(unique) = &self.unique {
            unique.record(policy.shared_name(), key, tally != Tally::Allowed);
        }
        #[cfg(not(feature = "redis"))]
        let _ = key;
    }
}

/// Everything a response needs, shared by the layer, its services and their futures.
pub(crate) struct Responder {
    pub(crate) policy: Policy,
    pub(crate) policy_header: HeaderValue,
    /// The header name of each limit, computed once rather than per response.
    limit_names: Vec<String>,
    pub(crate) options: Options,
}

impl Responder {
    pub(crate) fn new(policy: Policy, options: Options) -> Self {
        let mut limit_names: Vec<String> = (0..policy.limits().len())
            .map(|i| policy.limit_name(i))
            .collect();
        let mut items: Vec<String> = policy
            .limits()
            .iter()
            .zip(&limit_names)
            .map(|(l, name)| format!("\"{name}\";q={};w={}", l.count(), ceil_secs(l.window())))
            .collect();
        // The concurrency limit, after the rate limits (its decisions' index), in the draft's
        // quota unit for it.
        if let Some(slots) = policy.concurrency_limit() {
            let name = format!("{}-concurrency", policy.name());
            items.push(format!("\"{name}\";q={slots};qu=\"concurrent-requests\""));
            limit_names.push(name);
        }
        Responder {
            policy_header: value(items.join(", ")),
            limit_names,
            policy,
            options,
        }
    }

    /// Adds `RateLimit-Policy` and `RateLimit` for `decision`.
    pub(crate) fn add_headers(&self, headers: &mut HeaderMap, decision: &Decision) {
        let name = self
            .limit_names
            .get(decision.limit_index())
            .map_or(self.policy.name(), String::as_str);
        // Built by hand: `format!` costs more than the rest of a refusal answered from the
        // deny cache. `concat` sizes the text exactly, so that the header value takes it over
        // without a second allocation.
        // A refused client reads `t` as when to come back, so it is never before `Retry-After`,
        // which is later than the limit's next reset when usage recorded after the fact took
        // the key past its limit, or when the request costs more than one unit.
        let reset = match decision.retry_after() {
            Some(retry) if !decision.is_allowed() => decision.reset_after().max(retry),
            _ => decision.reset_after(),
        };
        let reset = reset.as_micros().div_ceil(1_000_000);
        let (mut remaining, mut reset_secs) = (itoa::Buffer::new(), itoa::Buffer::new());
        let state = [
            "\"",
            name,
            "\";r=",
            remaining.format(decision.remaining()),
            ";t=",
            reset_secs.format(u64::try_from(reset).unwrap_or(u64::MAX)),
        ]
        .concat();
        // An override in the store decided the request by other counts than the policy's own:
        // the field then states the one limit the decision knows, as it was decided.
        let own = self.policy.limits().get(decision.limit_index());
        let policy = match own {
            Some(limit) if limit.count() != decision.limit() => value(format!(
                "\"{name}\";q={};w={}",
                decision.limit(),
                ceil_secs(limit.window())
            )),
            _ => self.policy_header.clone(),
        };
        add_member(headers, RATELIMIT_POLICY, policy);
        add_member(headers, RATELIMIT, value(state));
    }

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

    /// The answer when no key could be extracted and [`MissingKey::Reject`] applies.
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

    /// The answer when the store failed and [`FailureMode::Closed`] applies.
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

/// Adds `member` to the list field `name`: after the members that layers further in put there
/// (each layer of a stack adds its own policy's; draft-ietf-httpapi-ratelimit-headers-10 makes
/// both fields lists), or as the field itself.
fn add_member(headers: &mut HeaderMap, name: HeaderName, member: HeaderValue) {
    match headers.entry(name) {
        http::header::Entry::Occupied(mut inner) => {
            let inner = inner.get_mut();
            let mut list = Vec::with_capacity(inner.len() + 2 + member.len());
            list.extend_from_slice(inner.as_bytes());
            list.extend_from_slice(b", ");
            list.extend_from_slice(member.as_bytes());
            if let Ok(list) = HeaderValue::from_bytes(&list) {
                *inner = list;
            }
        }
        http::header::Entry::Vacant(empty) => {
            empty.insert(member);
        }
    }
}

/// Whole seconds, rounded up, and at least 1.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_micros().div_ceil(1_000_000).max(1) as u64
}

/// Our header texts are built from policy names limited to visible ASCII, and numbers.
/// `text` as a header value. `Bytes` takes a string over as it is when its capacity is its
/// length; otherwise it allocates a shared header for it.
fn value(text: String) -> HeaderValue {
    HeaderValue::try_from(text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Outcome;

    #[test]
    fn renders_draft_10_fields() {
        let policy: Policy = "2/2s + 3/10s".parse().unwrap();
        let responder = Responder::new(policy.clone(), Options::default());
        assert_eq!(
            responder.policy_header,
            "\"default-2s\";q=2;w=2, \"default-10s\";q=3;w=10"
        );
        let denied = Decision::from_outcome(
            Outcome {
                allowed: false,
                index: 1,
                remaining: 0,
                reset_after: 7_800_000,
                retry_after: Some(7_800_000),
            },
            &policy,
        );
        let response = responder.rejection(&denied, None);
        assert_eq!(response.status(), 429);
        let h = response.headers();
        assert_eq!(h[RETRY_AFTER], "8");
        assert_eq!(h[RATELIMIT], "\"default-10s\";r=0;t=8");

        // Over the limit (usage recorded after the fact): the oldest entry leaves in 2 s, but
        // the request fits only in 9.
        let over = Decision::from_outcome(
            Outcome {
                allowed: false,
                index: 1,
                remaining: 0,
                reset_after: 2_000_000,
                retry_after: Some(8_500_000),
            },
            &policy,
        );
        let h = responder.rejection(&over, None).headers().clone();
        assert_eq!(
            (&h[RETRY_AFTER], &h[RATELIMIT]),
            (
                &"9".parse::<HeaderValue>().unwrap(),
                &"\"default-10s\";r=0;t=9".parse::<HeaderValue>().unwrap()
            )
        );

        let web = HeaderValue::from_static("application/grpc-web+proto");
        let grpc = responder.rejection(&denied, Some(&web));
        assert_eq!(grpc.status(), 200);
        let h = grpc.headers();
        assert_eq!(h[CONTENT_TYPE], web);
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(h["grpc-retry-pushback-ms"], "7800");
        assert_eq!(h[RETRY_AFTER], "8");
    }

    #[test]
    fn rounds_up_and_never_zero() {
        assert_eq!(ceil_secs(Duration::ZERO), 1);
        assert_eq!(ceil_secs(Duration::from_micros(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
    }
}
