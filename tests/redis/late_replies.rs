//! Decisions that Redis answers after the time budget. The caller saw a failure (the layer
//! followed its failure mode), but the script ran when Redis woke up and recorded the units:
//! the store reads the late reply and gives them back, so that right passwords sent during a
//! stall do not lock their user out.

use std::time::Duration;

use crate::support::RedisServer;
use axum::routing::post;
use axum::Router;
use fred::cmd;
use fred::prelude::*;
use http::{HeaderMap, HeaderName, Request, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::{Header, Key, Policy, RateLimitLayer, RedisStore, Store};

/// The time budget of a decision: far below the stall.
const BUDGET: Duration = Duration::from_millis(100);

/// A server that takes `DEBUG SLEEP`, and a store on it with a short budget.
async fn stalling() -> (RedisServer, RedisStore) {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::builder(server.url())
        .timeout(BUDGET)
        .connect()
        .await
        .unwrap();
    (server, store)
}

/// Stalls Redis for `seconds` (`DEBUG SLEEP` on a connection of its own); returns once the
/// stall has begun.
async fn stall(server: &RedisServer, seconds: &'static str) -> tokio::task::JoinHandle<()> {
    let client = server.client().await;
    let stalled = tokio::spawn(async move {
        let _: Value = client
            .custom(cmd!("DEBUG"), vec!["SLEEP", seconds])
            .await
            .unwrap();
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    stalled
}

/// What `key` has left under `policy` once Redis answers again, read until it reaches
/// `expected` or 3 s have passed (the breaker, the late replies and their refunds take a
/// moment after the stall).
async fn remaining_settles_at(
    store: &RedisStore,
    key: &Key,
    policy: &Policy,
    expected: u64,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    let mut seen = None;
    while tokio::time::Instant::now() < deadline {
        if let Ok(decision) = store.peek(key, policy, 1).await {
            seen = Some(decision.remaining());
            if decision.remaining() == expected {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen.expect("Redis answered again")
}

#[tokio::test]
async fn units_of_decisions_answered_after_their_budget_are_given_back() {
    let (server, store) = stalling().await;
    let policy: Policy = "10/1h".parse().unwrap();
    let key = Key::from("ann");
    let stalled = stall(&server, "0.5").await;
    let checks = futures::future::join_all((0..10).map(|_| store.check(&key, &policy, 1))).await;
    for check in checks {
        // Out of time: the store's budget, or the call's (the same length).
        assert!(check.is_err(), "a decision during the stall: {check:?}");
    }
    stalled.await.unwrap();
    // Redis ran the ten scripts when it woke up; their units are given back.
    assert_eq!(remaining_settles_at(&store, &key, &policy, 10).await, 10);
    // A decision answered in time keeps its units.
    assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
    assert_eq!(remaining_settles_at(&store, &key, &policy, 9).await, 9);
}

/// `x-password: right` logs in.
async fn login(headers: HeaderMap) -> StatusCode {
    match headers.get("x-password").map(|v| v.as_bytes()) {
        Some(b"right") => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}

fn attempt(password: &str) -> Request<axum::body::Body> {
    Request::post("/login")
        .header("x-user", "ann")
        .header("x-password", password)
        .body(axum::body::Body::empty())
        .unwrap()
}

#[tokio::test]
async fn right_passwords_during_a_stall_lock_nobody_out() {
    let (server, store) = stalling().await;
    // Ten failed logins an hour, then an hour in the box.
    let policy = Policy::new("login", ["10/1h".parse().unwrap()])
        .unwrap()
        .block_for(Duration::from_secs(3600))
        .unwrap();
    let layer = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-user")))
        .policy(policy.clone())
        .store(store.clone())
        .count_when(|response| response.status == StatusCode::UNAUTHORIZED)
        .build()
        .unwrap();
    let app = Router::new().route("/login", post(login)).layer(layer);

    let stalled = stall(&server, "0.5").await;
    let logins = (0..10).map(|_| app.clone().oneshot(attempt("right")));
    for reply in futures::future::join_all(logins).await {
        // Failing open: let in, undecided.
        assert_eq!(reply.unwrap().status(), StatusCode::OK);
    }
    stalled.await.unwrap();
    let left = remaining_settles_at(&store, &Key::from("ann"), &policy, 10).await;

    // Ann logs in; then her failures count as ever: ten, and the box.
    let reply = app.clone().oneshot(attempt("right")).await.unwrap();
    assert_eq!(
        (reply.status(), left),
        (StatusCode::OK, 10),
        "a right password after the stall, and what the key had left before it"
    );
    for i in 0..10 {
        let reply = app.clone().oneshot(attempt("wrong")).await.unwrap();
        assert_eq!(reply.status(), StatusCode::UNAUTHORIZED, "failure {i}");
    }
    let reply = app.clone().oneshot(attempt("right")).await.unwrap();
    assert_eq!(reply.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn decisions_their_callers_dropped_give_their_units_back() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    // A budget longer than the stall: the callers go away before it runs out.
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let policy: Policy = "10/1h".parse().unwrap();
    let key = Key::from("ann");
    let stalled = stall(&server, "0.3").await;
    let checks = (0..5).map(|_| tokio::time::timeout(BUDGET, store.check(&key, &policy, 1)));
    for check in futures::future::join_all(checks).await {
        assert!(check.is_err(), "the caller stopped waiting");
    }
    stalled.await.unwrap();
    assert_eq!(remaining_settles_at(&store, &key, &policy, 10).await, 10);
}
