//! Counting by outcome (`count_when`): failed logins count, successes never do; the fourth
//! failure of `3/1m` meets the refusal (or, soft, the captcha), never the fifth; concurrent
//! successes are never refused for attempts in flight. On both stores, every algorithm.

mod common;

use std::time::Duration;

use axum::routing::post;
use axum::{Extension, Router};
use common::RedisServer;
use common::ALGORITHMS;
use http::{HeaderMap, HeaderName, Request, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::{
    Algorithm, Decisions, Header, MemoryStore, Policy, RateLimitLayer, Rule, Store,
};

/// The login form: `x-password: right` logs in. A request over a soft limit must solve the
/// captcha first (`x-password: captcha-solved <password>` stands for it here).
async fn login(
    decisions: Option<Extension<Decisions>>,
    headers: HeaderMap,
) -> (StatusCode, &'static str) {
    let given = headers.get("x-password").and_then(|v| v.to_str().ok());
    let (solved, password) = match given.and_then(|p| p.strip_prefix("captcha-solved ")) {
        Some(password) => (true, Some(password)),
        None => (false, given),
    };
    if decisions.is_some_and(|Extension(d)| d.is_over()) && !solved {
        return (StatusCode::FORBIDDEN, "captcha");
    }
    match password {
        Some("right") => (StatusCode::OK, "welcome"),
        _ => (StatusCode::UNAUTHORIZED, "wrong password"),
    }
}

fn form<St: Store>(
    store: St,
    algorithm: Algorithm,
    soft: bool,
) -> (Router, RateLimitLayer<Header, St>) {
    let policy = Policy::new("login-failures", ["3/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm);
    let rule = if soft {
        Rule::new(policy).soft()
    } else {
        Rule::new(policy)
    };
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-user")))
        .store(store)
        .rule(rule)
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/login", post(login))
        .layer(layer.clone());
    (app, layer)
}

/// One attempt, its status once every count it caused has landed.
async fn attempt<St: Store>(
    (app, layer): &(Router, RateLimitLayer<Header, St>),
    user: &str,
    password: &str,
) -> u16 {
    let request = Request::post("/login")
        .header("x-user", user)
        .header("x-password", password)
        .body(axum::body::Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    status
}

async fn outcomes<St: Store>(store: St) {
    for algorithm in ALGORITHMS {
        let hard = form(store.clone(), algorithm, false);
        let what = format!("{algorithm:?}");
        let mut seen = Vec::new();
        for password in ["bad", "bad", "right", "bad", "bad", "right"] {
            seen.push(attempt(&hard, &format!("ann-{what}"), password).await);
        }
        assert_eq!(
            seen,
            [401, 401, 200, 401, 429, 429],
            "{what}: the fourth failure is refused"
        );

        let mut successes = Vec::new();
        for _ in 0..10 {
            successes.push(attempt(&hard, &format!("bob-{what}"), "right").await);
        }
        assert!(successes.iter().all(|&s| s == 200), "{what}: {successes:?}");

        // Six successful logins at once: nothing is reserved for them, none is refused.
        let cat = format!("cat-{what}");
        let at_once =
            futures::future::join_all((0..6).map(|_| attempt(&hard, &cat, "right"))).await;
        assert_eq!(at_once, [200; 6], "{what}");

        let soft = form(store.clone(), algorithm, true);
        let mut seen = Vec::new();
        for password in ["bad", "bad", "bad", "right", "bad"] {
            seen.push(attempt(&soft, &format!("dan-{what}"), password).await);
        }
        assert_eq!(
            seen,
            [401, 401, 401, 403, 403],
            "{what}: the captcha from the fourth on"
        );
    }
}

#[tokio::test]
async fn failures_count_and_successes_never_do_on_memory() {
    outcomes(MemoryStore::new()).await;
}

#[tokio::test]
async fn failures_count_and_successes_never_do_on_redis() {
    let server = RedisServer::start();
    outcomes(server.store().await).await;
}

/// Failures past the captcha still count: `3/1m + 5/1h`, soft. After three failures the
/// form asks for a captcha; two more failures with it solved fill the hour's limit, so the
/// captcha is still asked once the minute is over. Had they not counted, the form would be
/// open again a minute later.
#[tokio::test]
async fn failures_over_a_soft_limit_still_count() {
    use std::time::UNIX_EPOCH;
    use tower_redis_ratelimit::store::ManualClock;

    let clock = ManualClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy = Policy::new("login", ["3/1m".parse().unwrap(), "5/1h".parse().unwrap()]).unwrap();
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-user")))
        .store(store)
        .rule(Rule::new(policy).soft())
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap();
    let form = (
        Router::new()
            .route("/login", post(login))
            .layer(layer.clone()),
        layer,
    );
    let mut seen = Vec::new();
    for password in [
        "bad",
        "bad",
        "bad",
        "bad",
        "captcha-solved bad",
        "captcha-solved bad",
    ] {
        seen.push(attempt(&form, "eve", password).await);
    }
    assert_eq!(seen, [401, 401, 401, 403, 401, 401]);
    clock.advance(Duration::from_secs(61));
    assert_eq!(attempt(&form, "eve", "bad").await, 403, "the hour is full");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(attempt(&form, "eve", "right").await, 200);
}
