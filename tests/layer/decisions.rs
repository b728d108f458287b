//! What a handler sees of the layers' decisions (`Decisions` in the request's extensions), soft
//! limits that pass a request over the limit on marked as over, and the `RateLimit` fields of
//! stacked layers, each adding its own member.

use std::sync::Arc;

use crate::support::RedisServer;
use axum::routing::{get, post};
use axum::{Extension, Router};
use http::{HeaderName, Request};
use tower::ServiceExt;
use tower_redis_ratelimit::{Decisions, Header, Policy, RateLimitLayer, Rule, Store};

/// The members of a `RateLimit` or `RateLimit-Policy` field, parsed as the structured-field
/// list draft-ietf-httpapi-ratelimit-headers-10 makes them: (policy, parameter `param`).
fn members(
    response: &http::Response<axum::body::Body>,
    field: &str,
    param: &str,
) -> Vec<(String, i64)> {
    let Some(value) = response.headers().get(field) else {
        return Vec::new();
    };
    let list: sfv::List = sfv::Parser::new(value.as_bytes())
        .parse()
        .unwrap_or_else(|e| panic!("{field}: {value:?} is not a structured list: {e}"));
    list.iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item.bare_item.as_string().unwrap().as_str().to_owned();
                let value = item
                    .params
                    .iter()
                    .find(|(k, _)| k.as_str() == param)
                    .and_then(|(_, v)| v.as_integer())
                    .map(i64::from)
                    .unwrap();
                (name, value)
            }
            other => panic!("{field}: unexpected {other:?}"),
        })
        .collect()
}

fn api_key() -> Header {
    Header::new(HeaderName::from_static("x-api-key"))
}

fn request(method: &str, path: &str, key: &str) -> Request<axum::body::Body> {
    Request::builder()
        .method(method)
        .uri(path)
        .header("x-api-key", key)
        .body(axum::body::Body::empty())
        .unwrap()
}

/// The handler's view: each decision as `policy:remaining:allowed`.
async fn echo(Extension(decisions): Extension<Decisions>) -> String {
    let seen: Vec<String> = decisions
        .iter()
        .map(|(policy, d)| format!("{policy}:{}:{}", d.remaining(), d.is_allowed()))
        .collect();
    seen.join(" ")
}

async fn body(response: http::Response<axum::body::Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// 50 requests at once: what each handler saw is what its response's `RateLimit` says.
async fn decisions_match_fields<St: Store>(store: St) {
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .policy(Policy::new("api", ["40/1h".parse().unwrap()]).unwrap())
        .build()
        .unwrap();
    let app = Router::new().route("/", get(echo)).layer(layer);
    let answers = futures::future::join_all((0..50).map(|_| {
        let app = app.clone();
        tokio::spawn(async move { app.oneshot(request("GET", "/", "k")).await.unwrap() })
    }))
    .await;
    let (mut admitted, mut remaining) = (0, Vec::new());
    for answer in answers {
        let response = answer.unwrap();
        let status = response.status();
        let fields = members(&response, "ratelimit", "r");
        if status == 200 {
            admitted += 1;
            let seen = body(response).await;
            assert_eq!(seen, format!("api:{}:true", fields[0].1), "{fields:?}");
            remaining.push(fields[0].1);
        } else {
            assert_eq!(status, 429);
        }
    }
    assert_eq!(admitted, 40);
    remaining.sort_unstable();
    assert_eq!(
        remaining,
        (0..40).collect::<Vec<i64>>(),
        "each remaining once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_sees_the_decision_its_fields_describe_on_memory() {
    decisions_match_fields(tower_redis_ratelimit::MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_sees_the_decision_its_fields_describe_on_redis() {
    let server = RedisServer::start();
    decisions_match_fields(server.store().await).await;
}

/// The shape of `examples/axum_routes.rs`: `site` per key around the whole app, `api` per key
/// on the API routes. Each layer adds its own member to both fields, the refusal included, and
/// the handler sees both decisions, outermost first.
#[tokio::test]
async fn stacked_layers_each_add_their_member() {
    let site = RateLimitLayer::builder()
        .key(api_key())
        .policy(Policy::new("site", ["60/1m".parse().unwrap()]).unwrap())
        .build()
        .unwrap();
    let api = RateLimitLayer::builder()
        .key(api_key())
        .policy(Policy::new("api", ["5/10s".parse().unwrap()]).unwrap())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/api/items", get(echo))
        .route_layer(api)
        .layer(site);
    for i in 0..5i64 {
        let response = app
            .clone()
            .oneshot(request("GET", "/api/items", "k1"))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let limits = members(&response, "ratelimit", "r");
        assert_eq!(limits, [("api".into(), 4 - i), ("site".into(), 59 - i)]);
        let quotas = members(&response, "ratelimit-policy", "q");
        assert_eq!(quotas, [("api".into(), 5), ("site".into(), 60)]);
        assert_eq!(
            body(response).await,
            format!("site:{}:true api:{}:true", 59 - i, 4 - i)
        );
    }
    let refused = app
        .clone()
        .oneshot(request("GET", "/api/items", "k1"))
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "10");
    assert_eq!(
        members(&refused, "ratelimit", "r"),
        [("api".into(), 0), ("site".into(), 54)]
    );
    assert_eq!(
        members(&refused, "ratelimit-policy", "q"),
        [("api".into(), 5), ("site".into(), 60)]
    );
}

/// A soft policy passes the fourth failed login on to the handler, marked over, with the
/// fields of a refusal: the handler asks for a captcha instead of a wall.
#[tokio::test]
async fn a_soft_limit_passes_the_request_on_marked_over() {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let login = move |Extension(decisions): Extension<Decisions>| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            if decisions.is_over() {
                "captcha"
            } else {
                "password"
            }
        }
    };
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .rule(
            Rule::new(Policy::new("login", ["3/1m".parse().unwrap()]).unwrap())
                .path("/login")
                .soft(),
        )
        .policy(Policy::new("site", ["100/1m".parse().unwrap()]).unwrap())
        .build()
        .unwrap();
    let app = Router::new()
        .route("/login", post(login))
        .route("/", get(echo))
        .layer(layer);
    let mut seen = Vec::new();
    for _ in 0..5 {
        let response = app
            .clone()
            .oneshot(request("POST", "/login", "u"))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let remaining = members(&response, "ratelimit", "r");
        seen.push((body(response).await, remaining[0].1));
    }
    assert_eq!(
        seen,
        [
            ("password".into(), 2),
            ("password".into(), 1),
            ("password".into(), 0),
            ("captcha".into(), 0),
            ("captcha".into(), 0),
        ]
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 5);
    // Other policies of the layer are not soft.
    for i in 0..101 {
        let response = app.clone().oneshot(request("GET", "/", "v")).await.unwrap();
        assert_eq!(response.status() == 200, i < 100, "request {i}");
    }
}

/// `.decisions(false)` keeps the decisions out of the requests; a soft limit needs them.
#[tokio::test]
async fn decisions_can_be_left_out() {
    let seen = |request: Request<axum::body::Body>| async move {
        let found = request.extensions().get::<Decisions>().is_some();
        Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from(
            found.to_string(),
        )))
    };
    for enabled in [true, false] {
        let layer = RateLimitLayer::builder()
            .key(api_key())
            .policy("5/1m")
            .decisions(enabled)
            .build()
            .unwrap();
        let service = tower::ServiceBuilder::new()
            .layer(layer)
            .service(tower::service_fn(seen));
        let response = service.oneshot(request("GET", "/", "k")).await.unwrap();
        let bytes = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(bytes, enabled.to_string());
    }
    let soft = RateLimitLayer::builder()
        .rule(Rule::new("5/1m").soft())
        .decisions(false)
        .build();
    assert!(soft.is_err());
}

/// The login handler of the docs: `Extension<Decisions>`, a captcha when over. Answers what
/// its layers' entries say: `policy:remaining` per decision, `policy:why` per layer that did
/// not decide.
async fn login(Extension(decisions): Extension<Decisions>) -> (http::StatusCode, String) {
    let mut seen: Vec<String> = decisions
        .iter()
        .map(|(policy, d)| format!("{policy}:{}", d.remaining()))
        .collect();
    seen.extend(
        decisions
            .undecided()
            .map(|(policy, why)| format!("{policy}:{why:?}")),
    );
    match decisions.is_over() {
        true => (http::StatusCode::FORBIDDEN, "captcha".into()),
        false => (http::StatusCode::UNAUTHORIZED, seen.join(" ")),
    }
}

/// The limiter is never the outage: with Redis gone and the layer failing open, an
/// allow-listed key, or a request without a key let through, the handler that takes
/// `Extension<Decisions>` runs and learns why there was no decision.
#[tokio::test]
async fn every_request_passed_on_carries_decisions() {
    use tower_redis_ratelimit::response::MissingKey;

    let mut server = RedisServer::start();
    let layer = |store| {
        RateLimitLayer::builder()
            .key(api_key())
            .store(store)
            .policy(Policy::new("login", ["3/1m".parse().unwrap()]).unwrap())
            .allow_key("ops")
            .on_missing_key(MissingKey::Allow)
            .count_when(|head| head.status == http::StatusCode::UNAUTHORIZED)
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route("/login", post(login))
        .layer(layer(server.store().await));
    let send = |key: Option<&str>| {
        let request = Request::post("/login");
        let request = match key {
            Some(key) => request.header("x-api-key", key),
            None => request,
        };
        app.clone()
            .oneshot(request.body(axum::body::Body::empty()).unwrap())
    };
    let answer = |response: http::Response<axum::body::Body>| async move {
        (response.status().as_u16(), body(response).await)
    };
    assert_eq!(
        answer(send(Some("ann")).await.unwrap()).await,
        (401, "login:2".into())
    );
    assert_eq!(
        answer(send(Some("ops")).await.unwrap()).await,
        (401, "login:AllowListed".into())
    );
    assert_eq!(
        answer(send(None).await.unwrap()).await,
        (401, "login:MissingKey".into())
    );
    server.kill();
    for _ in 0..5 {
        let (status, seen) = answer(send(Some("ann")).await.unwrap()).await;
        assert_eq!((status, seen.as_str()), (401, "login:StoreUnavailable"));
    }
}

/// Two stacked layers whose policies share a name: `get` finds the outer one, `iter` both,
/// and the inner layer warns once, however many requests it sees.
#[tokio::test]
async fn equal_policy_names_on_one_request_are_warned_about_once() {
    let captured = crate::support::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let layer = |limit: &str| {
        RateLimitLayer::builder()
            .key(api_key())
            .policy(limit)
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route("/", get(echo))
        .layer(layer("4/1m"))
        .layer(layer("99/1m"));
    for i in 0..3 {
        let response = app.clone().oneshot(request("GET", "/", "k")).await.unwrap();
        let inner = format!("default:{}:true", 3 - i);
        assert_eq!(
            body(response).await,
            format!("default:{}:true {inner}", 98 - i)
        );
    }
    let text = captured.text();
    let warnings = text.matches("policies of the same name").count();
    assert_eq!(warnings, 1, "{text}");
}

/// The handler's view of policy `uploads`: `allowance:remaining:allowed`, `none` when the
/// layer did not decide.
async fn allowance(Extension(decisions): Extension<Decisions>) -> String {
    match (decisions.allowance("uploads"), decisions.get("uploads")) {
        (Some(allowance), Some(d)) => {
            format!("{allowance}:{}:{}", d.remaining(), d.is_allowed())
        }
        (None, None) => "none".into(),
        other => panic!("allowance and decision disagree: {other:?}"),
    }
}

/// A request costing 600 of `1000/1h` may use 1000: its own 600 and the 400 left after it.
/// A request passed over a soft limit holds nothing and may use what is left; an allow-listed
/// one has no allowance of the policy.
async fn allowance_is_reservation_plus_remaining<St: Store + Clone>(store: St) {
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store.clone())
        .rule(Rule::new(Policy::new("uploads", ["1000/1h".parse().unwrap()]).unwrap()).soft())
        .cost(|head| {
            let cost = head.headers.get("x-cost").and_then(|v| v.to_str().ok());
            cost.and_then(|v| v.parse().ok()).unwrap_or(1)
        })
        .allow_key("trusted")
        .build()
        .unwrap();
    let app = Router::new().route("/", post(allowance)).layer(layer);
    let mut seen = Vec::new();
    for (key, cost) in [("u", 600), ("u", 300), ("u", 300), ("trusted", 600)] {
        let mut request = request("POST", "/", key);
        request.headers_mut().insert("x-cost", cost.into());
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), 200);
        seen.push(body(response).await);
    }
    assert_eq!(
        seen,
        ["1000:400:true", "400:100:true", "100:100:false", "none"]
    );
    // A policy with only a concurrency limit does not bound what a request uses.
    let slots = Policy::new("uploads", []).unwrap().concurrency(2).unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .policy(slots)
        .build()
        .unwrap();
    let app = Router::new().route("/", post(allowance)).layer(layer);
    let response = app.oneshot(request("POST", "/", "u")).await.unwrap();
    assert_eq!(body(response).await, format!("{}:0:true", u64::MAX));
}

#[tokio::test]
async fn allowance_is_reservation_plus_remaining_on_memory() {
    allowance_is_reservation_plus_remaining(tower_redis_ratelimit::MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowance_is_reservation_plus_remaining_on_redis() {
    let server = RedisServer::start();
    allowance_is_reservation_plus_remaining(server.store().await).await;
}
