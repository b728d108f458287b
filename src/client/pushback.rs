//! Upstream pushback: how long an upstream that refused a request for its rate asks callers to
//! wait, read from its response.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, Response, StatusCode};

/// The longest pause an upstream's answer sets: a `Retry-After` of days (or a date far off)
/// is more likely a mistake than a plan, and pauses every caller of the key.
pub(super) const MAX_PAUSE: Duration = Duration::from_secs(3600);

/// How long `response` asks its key to pause: a `429 Too Many Requests` or `503 Service
/// Unavailable` with `Retry-After` (seconds, or an HTTP date), or a gRPC `RESOURCE_EXHAUSTED`
/// (status 8, in the headers of a trailers-only response) with `grpc-retry-pushback-ms`; at
/// most [`MAX_PAUSE`]. `None` for any other answer, and for a refusal that names no wait.
pub(super) fn pushback<B>(response: &Response<B>) -> Option<Duration> {
    let headers = response.headers();
    let wait = match response.status() {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => retry_after(headers),
        _ => grpc_pushback(headers),
    };
    wait.map(|wait| wait.min(MAX_PAUSE))
}

/// `Retry-After`: delta-seconds or an HTTP date (RFC 9110, 10.2.3).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// gRPC's pushback: `grpc-status: 8` with `grpc-retry-pushback-ms` (gRFC A6).
fn grpc_pushback(headers: &HeaderMap) -> Option<Duration> {
    if headers.get("grpc-status")?.as_bytes() != b"8" {
        return None;
    }
    let ms = headers.get("grpc-retry-pushback-ms")?.to_str().ok()?;
    ms.trim().parse::<u64>().ok().map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)]) -> Response<()> {
        let mut response = Response::builder().status(status);
        for (name, value) in headers {
            response = response.header(*name, *value);
        }
        response.body(()).unwrap()
    }

    #[test]
    fn a_refusal_with_a_wait_pauses_and_others_do_not() {
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(pushback(&answer(429, &[("retry-after", "2")])), secs(2));
        assert_eq!(pushback(&answer(503, &[("retry-after", " 7 ")])), secs(7));
        assert_eq!(
            pushback(&answer(429, &[("retry-after", "86400")])),
            Some(MAX_PAUSE)
        );
        assert_eq!(pushback(&answer(429, &[])), None);
        assert_eq!(pushback(&answer(500, &[("retry-after", "2")])), None);
        assert_eq!(pushback(&answer(200, &[("retry-after", "2")])), None);
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
        let wait = pushback(&answer(429, &[("retry-after", later.as_str())])).unwrap();
        assert!(wait > Duration::from_secs(28) && wait <= Duration::from_secs(30));
        let past = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(30));
        assert_eq!(
            pushback(&answer(429, &[("retry-after", past.as_str())])),
            secs(0)
        );
    }

    #[test]
    fn grpc_resource_exhausted_pauses_for_its_pushback() {
        let exhausted = [("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")];
        assert_eq!(
            pushback(&answer(200, &exhausted)),
            Some(Duration::from_millis(1500))
        );
        let other = [("grpc-status", "14"), ("grpc-retry-pushback-ms", "1500")];
        assert_eq!(pushback(&answer(200, &other)), None);
        assert_eq!(pushback(&answer(200, &[("grpc-status", "8")])), None);
    }
}
