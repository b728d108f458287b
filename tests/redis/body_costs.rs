//! A cost read from the request body, on Redis: an LLM gateway of two instances sharing one
//! `redis-server` reserves the `max_tokens` a JSON body asks for at admission, and settles it
//! to the tokens the handler reports, so that the other instance sees the settled count.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Extension;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_redis_ratelimit::key::body::BodyKey;
use tower_redis_ratelimit::usage::{Usage, UsageReport};
use tower_redis_ratelimit::{Decisions, Key, Policy, RateLimitLayer, RedisStore, Store};

use crate::support::RedisServer;

fn tokens() -> Policy {
    Policy::new("tokens", ["10000/1m".parse().unwrap()]).unwrap()
}

/// One instance of the gateway: keyed on the body's `user`, reserving its `max_tokens`
/// (100 when absent), settled to the 300 tokens the handler reports. Returns the router and
/// the layer, whose `settled` waits for the settle to reach Redis.
fn instance(store: RedisStore) -> (Router, RateLimitLayer<BodyKey, RedisStore>) {
    let read = crate::support::gateway::body_fields();
    let limit = RateLimitLayer::builder()
        .key(read.key())
        .store(store)
        .policy(tokens())
        .cost(crate::support::gateway::max_tokens)
        .usage(UsageReport::new())
        .build()
        .unwrap();
    let complete = |Extension(decisions): Extension<Decisions>| async move {
        let allowance = decisions.allowance("tokens").unwrap();
        (Extension(Usage(300)), allowance.to_string())
    };
    let app = Router::new()
        .route("/v1/chat", post(complete))
        .layer(limit.clone())
        .layer(read);
    (app, limit)
}

async fn chat(app: &Router, body: &str) -> (StatusCode, String) {
    let request = Request::post("/v1/chat")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// The tokens `user` has left, recording nothing.
async fn left(store: &RedisStore, user: &str) -> u64 {
    let decision = store.peek(&Key::from(user), &tokens(), 1).await.unwrap();
    decision.remaining()
}

#[tokio::test]
async fn max_tokens_from_the_body_is_reserved_then_settled_across_instances() {
    let server = RedisServer::start();
    let (one, one_layer) = instance(RedisStore::builder(server.url()).connect().await.unwrap());
    let (two, two_layer) = instance(RedisStore::builder(server.url()).connect().await.unwrap());
    let store = RedisStore::builder(server.url()).connect().await.unwrap();

    // Instance one reserves the body's 800: the handler may use all 10 000.
    let first = r#"{"user": "Ann", "max_tokens": 800}"#;
    assert_eq!(chat(&one, first).await, (StatusCode::OK, "10000".into()));
    assert_eq!(one_layer.settled(Duration::from_secs(5)).await, 0);
    // Settled to the 300 used, in Redis: instance two sees 9 700 left.
    assert_eq!(left(&store, "ann").await, 9_700);
    let second = r#"{"user": "ann", "max_tokens": 9000}"#;
    assert_eq!(chat(&two, second).await, (StatusCode::OK, "9700".into()));
    // After 300 + 300 used, 9 400 are left: 9 500 asked is refused on either instance.
    let greedy = r#"{"user": "ann", "max_tokens": 9500}"#;
    assert_eq!(two_layer.settled(Duration::from_secs(5)).await, 0);
    assert_eq!(left(&store, "ann").await, 9_400);
    assert_eq!(chat(&one, greedy).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(chat(&two, greedy).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(chat(&two, r#"{"user": "ann"}"#).await.0, StatusCode::OK);
}
