//! Upstream pushback: how long an upstream that refused a request for its rate asks callers to
//! wait, read from its answer's status and headers (an `http::Response`'s, or a reqwest
//! response's: both are http 1 types).
//!
//! A value that is not what its header's grammar allows (`Retry-After: soon`, `-5`, `1.5`) is
//! an error, [`PushbackError`]: the layer logs it and pauses nothing, rather than guess. A
//! value of digits too large for any clock is a long wait, capped as any other.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderValue};

/// The longest pause an upstream's answer sets by default
/// ([`OutboundLayerBuilder::max_pause`](super::OutboundLayerBuilder::max_pause)): a
/// `Retry-After` of days (or a date far off) is more likely a mistake than a plan, and pauses
/// every caller of the key.
pub(super) const MAX_PAUSE: Duration = Duration::from_secs(3600);

/// The longest `max_pause` the builder takes: a day (a daily quota's reset).
pub(super) const MAX_PAUSE_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// The most of an upstream's value an error keeps (the rest is cut): it ends up in logs.
const SHOWN: usize = 64;

/// A pushback header whose value is not what its grammar allows: it pauses nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PushbackError {
    /// `Retry-After` is neither whole seconds nor an HTTP date (RFC 9110, 10.2.3).
    #[error("Retry-After {0:?} is neither whole seconds nor an HTTP date")]
    RetryAfter(String),
    /// `grpc-retry-pushback-ms` is not a whole number of milliseconds (gRFC A6).
    #[error("grpc-retry-pushback-ms {0:?} is not a whole number of milliseconds")]
    GrpcPushback(String),
}

/// How long an answer of `status` with `headers` asks its key to pause, at most `cap`:
/// a `429 Too Many Requests` or `503 Service Unavailable` with `Retry-After` (seconds, or an
/// HTTP date: one in the past is no wait), or a gRPC `RESOURCE_EXHAUSTED` (`grpc-status: 8`,
/// in the headers of a trailers-only response) with `grpc-retry-pushback-ms` (a negative
/// one, gRPC's "do not retry", names no wait). `None` for any other answer, and for a refusal
/// that names no wait; an error for a value its header's grammar does not allow.
pub(crate) fn pushback_of(
    status: u16,
    headers: &HeaderMap,
    cap: Duration,
) -> Result<Option<Duration>, PushbackError> {
    let wait = match status {
        429 | 503 => match headers.get(RETRY_AFTER) {
            Some(value) => Some(retry_after(value, SystemTime::now())?),
            None => None,
        },
        _ => grpc_pushback(headers)?,
    };
    Ok(wait.map(|wait| wait.min(cap)))
}

/// [`pushback_of`], with an error logged (at WARN the first time for each header, at DEBUG
/// after: an upstream that sends one bad value sends it on every refusal) and ignored.
pub(crate) fn pushback_or_log(status: u16, headers: &HeaderMap, cap: Duration) -> Option<Duration> {
    static WARNED: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
    match pushback_of(status, headers, cap) {
        Ok(wait) => wait,
        Err(error) => {
            let kind = match error {
                PushbackError::RetryAfter(_) => 0,
                PushbackError::GrpcPushback(_) => 1,
            };
            let why = "an upstream's pushback ignored";
            match WARNED[kind].swap(true, Ordering::Relaxed) {
                false => tracing::warn!(target: "tower_redis_ratelimit", %error, status, "{why}"),
                true => tracing::debug!(target: "tower_redis_ratelimit", %error, status, "{why}"),
            }
            None
        }
    }
}

/// How long `response` asks its key to pause, at most [`MAX_PAUSE`]
/// ([`pushback_or_log`] for a response).
#[cfg(test)]
pub(super) fn pushback<B>(response: &http::Response<B>) -> Option<Duration> {
    pushback_or_log(response.status().as_u16(), response.headers(), MAX_PAUSE)
}

/// `Retry-After`: delta-seconds or an HTTP date (RFC 9110, 10.2.3), as of `now`.
fn retry_after(value: &HeaderValue, now: SystemTime) -> Result<Duration, PushbackError> {
    let bad = || PushbackError::RetryAfter(shown(value));
    let text = value.to_str().map_err(|_| bad())?.trim();
    if let Some(seconds) = digits(text) {
        return Ok(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(text).map_err(|_| bad())?;
    Ok(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// gRPC's pushback: `grpc-status: 8` with `grpc-retry-pushback-ms` (gRFC A6).
fn grpc_pushback(headers: &HeaderMap) -> Result<Option<Duration>, PushbackError> {
    let exhausted = headers
        .get("grpc-status")
        .is_some_and(|status| status.as_bytes() == b"8");
    let Some(value) = headers.get("grpc-retry-pushback-ms").filter(|_| exhausted) else {
        return Ok(None);
    };
    let bad = || PushbackError::GrpcPushback(shown(value));
    let text = value.to_str().map_err(|_| bad())?.trim();
    match text.strip_prefix('-') {
        Some(rest) if digits(rest).is_some() => Ok(None),
        _ => digits(text)
            .map(|ms| Some(Duration::from_millis(ms)))
            .ok_or_else(bad),
    }
}

/// A whole number of ASCII digits, `u64::MAX` where it is larger; `None` for anything else.
fn digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse().unwrap_or(u64::MAX))
}

/// The start of an upstream's value, for an error.
fn shown(value: &HeaderValue) -> String {
    let text = String::from_utf8_lossy(value.as_bytes());
    text.chars().take(SHOWN).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = MAX_PAUSE;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            let name = http::HeaderName::from_bytes(name.as_bytes()).unwrap();
            headers.append(name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    fn retry(status: u16, value: &str) -> Result<Option<Duration>, PushbackError> {
        pushback_of(status, &headers(&[("retry-after", value)]), CAP)
    }

    fn secs(s: u64) -> Result<Option<Duration>, PushbackError> {
        Ok(Some(Duration::from_secs(s)))
    }

    #[test]
    fn a_refusal_with_a_wait_pauses_and_others_do_not() {
        assert_eq!(retry(429, "2"), secs(2));
        assert_eq!(retry(503, " 7 "), secs(7));
        assert_eq!(retry(429, "0"), secs(0));
        assert_eq!(pushback_of(429, &headers(&[]), CAP), Ok(None));
        assert_eq!(retry(500, "2"), Ok(None));
        assert_eq!(retry(200, "2"), Ok(None));
        assert_eq!(
            retry(500, "soon"),
            Ok(None),
            "only a refusal's header is read"
        );
    }

    #[test]
    fn a_value_outside_the_grammar_is_an_error() {
        for value in ["soon", "-5", "1.5", "+3", "2 s", "0x10", "", "Tuesday"] {
            assert_eq!(
                retry(429, value),
                Err(PushbackError::RetryAfter(value.to_owned())),
                "{value:?}"
            );
        }
        let long = "x".repeat(500);
        let Err(PushbackError::RetryAfter(shown)) = retry(429, &long) else {
            panic!("a long bad value is an error");
        };
        assert_eq!(
            shown.len(),
            SHOWN,
            "an upstream's value is cut before it is logged"
        );
        let opaque = HeaderValue::from_bytes(b"\xff\xfe").unwrap();
        let mut map = HeaderMap::new();
        map.insert(RETRY_AFTER, opaque);
        assert!(pushback_of(429, &map, CAP).is_err());
    }

    #[test]
    fn a_wait_is_capped_however_large() {
        assert_eq!(retry(429, "999999"), Ok(Some(CAP)));
        assert_eq!(retry(429, "99999999999999999999999999"), Ok(Some(CAP)));
        let short = Duration::from_secs(5);
        let map = headers(&[("retry-after", "999999")]);
        assert_eq!(pushback_of(429, &map, short), Ok(Some(short)));
        let map = headers(&[("retry-after", "3")]);
        assert_eq!(
            pushback_of(429, &map, short),
            secs(3),
            "below the cap: as given"
        );
    }

    #[test]
    fn a_date_is_a_wait_from_now_and_one_in_the_past_none() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let value = |at| HeaderValue::from_str(&httpdate::fmt_http_date(at)).unwrap();
        let later = retry_after(&value(now + Duration::from_secs(30)), now);
        assert_eq!(later, Ok(Duration::from_secs(30)));
        let past = retry_after(&value(now - Duration::from_secs(30)), now);
        assert_eq!(past, Ok(Duration::ZERO));
        // Through the public entry, on the real clock.
        let far = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(10 * 86_400));
        assert_eq!(retry(429, &far), Ok(Some(CAP)));
        let gone = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(30));
        assert_eq!(retry(429, &gone), secs(0));
    }

    #[test]
    fn grpc_resource_exhausted_pauses_for_its_pushback() {
        let of = |pairs: &[(&str, &str)]| pushback_of(200, &headers(pairs), CAP);
        let exhausted = [("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")];
        assert_eq!(of(&exhausted), Ok(Some(Duration::from_millis(1500))));
        let other = [("grpc-status", "14"), ("grpc-retry-pushback-ms", "1500")];
        assert_eq!(of(&other), Ok(None));
        assert_eq!(of(&[("grpc-status", "8")]), Ok(None));
        let never = [("grpc-status", "8"), ("grpc-retry-pushback-ms", "-1")];
        assert_eq!(
            of(&never),
            Ok(None),
            "gRPC's negative pushback: do not retry"
        );
        let huge = [
            ("grpc-status", "8"),
            ("grpc-retry-pushback-ms", "99999999999999"),
        ];
        assert_eq!(of(&huge), Ok(Some(CAP)));
        let bad = [("grpc-status", "8"), ("grpc-retry-pushback-ms", "1.5s")];
        assert_eq!(of(&bad), Err(PushbackError::GrpcPushback("1.5s".into())));
    }

    #[test]
    fn a_response_pauses_as_its_head_says_and_a_bad_value_is_ignored() {
        let answer = |value: &str| {
            http::Response::builder()
                .status(429)
                .header("retry-after", value)
                .body(())
                .unwrap()
        };
        assert_eq!(pushback(&answer("2")), Some(Duration::from_secs(2)));
        assert_eq!(pushback(&answer("86400")), Some(MAX_PAUSE));
        assert_eq!(pushback(&answer("soon")), None);
        assert_eq!(
            pushback(&answer("soon")),
            None,
            "logged once, ignored each time"
        );
    }
}
