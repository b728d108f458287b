//! Login protection end to end: failed logins counted by outcome (`count_when`), a penalty box
//! (`Policy::block_for`), a soft limit asking for a captcha. What a user of the login form
//! sees: the `Retry-After` of a lockout is the real time until an attempt is let through again
//! (never early, at most a second late), and neither the attempts refused meanwhile nor the
//! failures past a captcha extend the box. The memory store on a manual clock, every algorithm.

use std::time::{Duration, UNIX_EPOCH};

use crate::support::ALGORITHMS;
use axum::routing::post;
use axum::{Extension, Router};
use http::{HeaderMap, Request, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::{Algorithm, Decisions, MemoryStore, Policy, Rule};

/// An hour boundary on the store's clock, so that a fixed window starts with the test.
const START: u64 = 1_699_999_200;

/// `x-password: right` logs in; over a soft limit, the captcha must be solved first
/// (`x-captcha: solved`).
async fn login(
    Extension(decisions): Extension<Decisions>,
    headers: HeaderMap,
) -> (StatusCode, &'static str) {
    if decisions.is_over() && headers.get("x-captcha").is_none() {
        return (StatusCode::FORBIDDEN, "solve the captcha first");
    }
    match headers.get("x-password").map(|v| v.as_bytes()) {
        Some(b"right") => (StatusCode::OK, "welcome"),
        _ => (StatusCode::UNAUTHORIZED, "wrong password"),
    }
}

/// The login form of `rule`, counting failures, on a store whose clock the test moves.
fn form(rule: Rule, clock: &ManualClock) -> Router {
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let layer = crate::outcomes::counting_failures(store, rule);
    Router::new().route("/login", post(login)).layer(layer)
}

/// One attempt: its status and `Retry-After` (whole seconds).
async fn attempt(app: &Router, user: &str, headers: &[(&str, &str)]) -> (u16, Option<u64>) {
    let mut request = Request::post("/login").header("x-user", user);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(axum::body::Body::empty()).unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let retry_after = response.headers().get("retry-after");
    let retry_after = retry_after.map(|v| v.to_str().unwrap().parse().unwrap());
    (response.status().as_u16(), retry_after)
}

fn ten_an_hour_then_fifteen_minutes_out(algorithm: Algorithm) -> Policy {
    Policy::new("login", ["10/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
        .block_for(Duration::from_secs(15 * 60))
        .unwrap()
}

/// Failures at the given offsets (seconds), then the lockout: its `Retry-After` R, an attempt
/// at R − 1 s refused, one at R let through.
async fn lockout(algorithm: Algorithm, failures_at: &[u64]) -> u64 {
    let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(START));
    let app = form(
        Rule::new(ten_an_hour_then_fifteen_minutes_out(algorithm)),
        &clock,
    );
    let mut now = 0;
    for &at in failures_at {
        clock.advance(Duration::from_secs(at - now));
        now = at;
        assert_eq!(
            attempt(&app, "ann", &[]).await,
            (401, None),
            "{algorithm:?}"
        );
    }
    let (status, retry_after) = attempt(&app, "ann", &[("x-password", "right")]).await;
    assert_eq!(status, 429, "{algorithm:?}");
    let r = retry_after.unwrap();
    assert!(r >= 900, "{algorithm:?}: at least the box, got {r}");
    clock.advance(Duration::from_secs(r - 1));
    let early = attempt(&app, "ann", &[("x-password", "right")]).await;
    assert_eq!(
        early.0, 429,
        "{algorithm:?}: a second before Retry-After {r}"
    );
    assert_eq!(early.1, Some(1), "{algorithm:?}: the refusal counts down");
    clock.advance(Duration::from_secs(1));
    let on_time = attempt(&app, "ann", &[("x-password", "right")]).await;
    assert_eq!(on_time, (200, None), "{algorithm:?}: at Retry-After {r}");
    r
}

/// Ten failures at once: the box (15 minutes) ends long before the hour's limit admits again,
/// and `Retry-After` says when that is.
#[tokio::test]
async fn a_lockout_says_when_the_limits_admit_again() {
    for algorithm in ALGORITHMS {
        let r = lockout(algorithm, &[0; 10]).await;
        let expected = match algorithm {
            // The window ends an hour after the failures.
            Algorithm::SlidingLog | Algorithm::FixedWindow => 3600,
            // 10 × (1 − x/3600) + 1 ≤ 10 from x = 360 s into the next window.
            Algorithm::SlidingWindow => 3960,
            // One unit drains every 6 minutes: the box is the longer.
            Algorithm::Gcra => 900,
            other => panic!("{other:?}: no expectation"),
        };
        assert_eq!(r, expected, "{algorithm:?}");
    }
}

/// Ten failures spread over the hour, one every 6 minutes: the limits admit again (the first
/// failure leaves the window) before the box ends, so the box says when. GCRA drains one
/// unit per 6 minutes and never fills at that pace.
#[tokio::test]
async fn a_lockout_lasts_the_box_when_the_limits_free_first() {
    let spread: Vec<u64> = (0..10).map(|i| i * 360).collect();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
    ] {
        assert_eq!(lockout(algorithm, &spread).await, 900, "{algorithm:?}");
    }
}

/// A soft limit with a box: past `3/1m`, the form asks for a captcha for 5 minutes. Failures
/// with the captcha solved still count (they fill the minute's limit again), and never extend
/// the box: 5 minutes after the limit was first hit, with those failures out of the window,
/// the form is open again.
#[tokio::test]
async fn failures_past_a_captcha_never_extend_the_box() {
    for algorithm in ALGORITHMS {
        let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(START));
        let policy = Policy::new("captcha", ["3/1m".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm)
            .block_for(Duration::from_secs(5 * 60))
            .unwrap();
        let app = form(Rule::new(policy).soft(), &clock);
        for _ in 0..3 {
            assert_eq!(attempt(&app, "bob", &[]).await.0, 401, "{algorithm:?}");
        }
        assert_eq!(
            attempt(&app, "bob", &[]).await.0,
            403,
            "{algorithm:?}: captcha"
        );
        // A minute later, three failures with the captcha solved fill the limit again.
        clock.advance(Duration::from_secs(60));
        for _ in 0..3 {
            let solved = attempt(&app, "bob", &[("x-captcha", "solved")]).await;
            assert_eq!(solved.0, 401, "{algorithm:?}: a failure past the captcha");
        }
        assert_eq!(attempt(&app, "bob", &[]).await.0, 403, "{algorithm:?}");
        clock.advance(Duration::from_secs(240));
        let open = attempt(&app, "bob", &[("x-password", "right")]).await;
        assert_eq!(
            open.0, 200,
            "{algorithm:?}: the box ended 5 minutes after the limit"
        );
    }
}
