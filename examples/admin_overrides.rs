//! An admin endpoint for the store's overrides ("raise this customer's limit now"), protected
//! by a bearer token: anything without it is answered `401`.
//!
//! ```text
//! ADMIN_TOKEN=s3cret cargo run --example admin_overrides            # serve on BIND
//! cargo run --example admin_overrides -- --demo                     # a demonstration
//! ```
//!
//! The app limits `GET /` to `5/1h` per `x-api-key` (policy `api`). The admin routes, under
//! `/admin/overrides/{policy}`:
//!
//! | request | does |
//! |---|---|
//! | `GET /admin/overrides/api` | lists the overrides of `api`, one per line: `all`, `plan:<plan>` or `key:<key>`, a tab, the override |
//! | `PUT /admin/overrides/api` with body `20/1h` | sets `api` to `20/1h` for every key |
//! | `PUT /admin/overrides/api/plans/{plan}` with body `10/1h` | sets the customers of one plan's |
//! | `PUT /admin/overrides/api/{key}` with body `50/1h` or `block` | sets one key's |
//! | `DELETE /admin/overrides/api[/{key}]`, `DELETE /admin/overrides/api/plans/{plan}` | removes one |
//!
//! Which one decides a request (a key's, its plan's, the policy-wide one): `Scope`'s
//! documentation.
//!
//! A malformed limit or other windows than the policy's is `400` with the reason; an unknown
//! policy `404`. `REDIS_URL` keeps the overrides in Redis, shared by every instance; without it
//! they live in this process. In production, serve the admin routes on an internal listener
//! too, and keep the token in a secret store.

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tower_redis_ratelimit::store::{Override, OverrideError, Overrides, Scope};
use tower_redis_ratelimit::{Header, Key, Policy, RateLimitLayer, RedisStore, RuleTable, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone)]
struct Admin {
    overrides: Overrides,
    table: RuleTable,
}

/// The admin routes, for the policies of `table`, behind `Authorization: Bearer <token>`.
pub fn admin(overrides: Overrides, table: RuleTable, token: &str) -> Router {
    // Compared as BLAKE3 hashes, whose equality takes the same time wherever they differ.
    let expected = blake3::hash(format!("Bearer {token}").as_bytes());
    let authorized = move |request: Request, next: Next| async move {
        let given = request.headers().get(header::AUTHORIZATION);
        match given.map(|value| blake3::hash(value.as_bytes())) {
            Some(hash) if hash == expected => next.run(request).await,
            _ => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "a valid bearer token is required\n",
            )
                .into_response(),
        }
    };
    Router::new()
        .route(
            "/admin/overrides/{policy}",
            get(list).put(set_all).delete(remove_all),
        )
        .route(
            "/admin/overrides/{policy}/{key}",
            axum::routing::put(set_key).delete(remove_key),
        )
        .route(
            "/admin/overrides/{policy}/plans/{plan}",
            axum::routing::put(set_plan).delete(remove_plan),
        )
        .layer(middleware::from_fn(authorized))
        .with_state(Admin { overrides, table })
}

impl Admin {
    /// The layer's policy named `name`, or the `404` answer.
    fn policy(&self, name: &str) -> Result<Policy, Box<Response>> {
        let policies = self.table.policies();
        let found = policies.into_iter().find(|p| p.name() == name);
        let unknown = (StatusCode::NOT_FOUND, format!("no policy {name:?}\n"));
        found.ok_or_else(|| Box::new(unknown.into_response()))
    }

    async fn set(&self, name: &str, scope: Scope, body: &[u8]) -> Response {
        let policy = match self.policy(name) {
            Ok(policy) => policy,
            Err(response) => return *response,
        };
        let text = String::from_utf8_lossy(body);
        let to = match text.trim() {
            "block" => Override::Block,
            limits => match limits.parse::<Policy>() {
                Ok(parsed) => Override::Limits(parsed.limits().to_vec()),
                Err(error) => {
                    return (StatusCode::BAD_REQUEST, format!("{error}\n")).into_response()
                }
            },
        };
        match self.overrides.set(&policy, &scope, &to).await {
            Ok(()) => (StatusCode::OK, format!("{name}: {}\n", describe(&to))).into_response(),
            Err(error) => failed(error),
        }
    }

    async fn remove(&self, name: &str, scope: Scope) -> Response {
        let policy = match self.policy(name) {
            Ok(policy) => policy,
            Err(response) => return *response,
        };
        match self.overrides.remove(&policy, &scope).await {
            Ok(true) => (StatusCode::OK, "removed\n").into_response(),
            Ok(false) => (StatusCode::NOT_FOUND, "no such override\n").into_response(),
            Err(error) => failed(error),
        }
    }
}

/// `50/1h + 500/1d`, or `block`.
fn describe(to: &Override) -> String {
    match to {
        Override::Limits(limits) => {
            let limits: Vec<String> = limits.iter().map(ToString::to_string).collect();
            limits.join(" + ")
        }
        _ => "block".to_owned(),
    }
}

/// `400` for what the operator sent, `503` when the store failed; the body says whether the
/// change may have landed (`Unconfirmed`: sending it again is safe).
fn failed(error: OverrideError) -> Response {
    let status = match error {
        OverrideError::Store(_) | OverrideError::Unconfirmed(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    };
    (status, format!("{error}\n")).into_response()
}

async fn list(State(admin): State<Admin>, Path(name): Path<String>) -> Response {
    let policy = match admin.policy(&name) {
        Ok(policy) => policy,
        Err(response) => return *response,
    };
    match admin.overrides.list(&policy).await {
        Ok(listed) => {
            // `all`, `plan:<plan>` or `key:<key>`: a key named `all` is `key:all`.
            let lines: String = listed
                .iter()
                .map(|(scope, to)| format!("{scope}\t{}\n", describe(to)))
                .collect();
            lines.into_response()
        }
        Err(error) => failed(error),
    }
}

async fn set_all(State(admin): State<Admin>, Path(name): Path<String>, body: Bytes) -> Response {
    admin.set(&name, Scope::All, &body).await
}

async fn set_key(
    State(admin): State<Admin>,
    Path((name, key)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    admin.set(&name, Scope::Key(Key::from(key)), &body).await
}

async fn set_plan(
    State(admin): State<Admin>,
    Path((name, plan)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    admin.set(&name, Scope::Plan(plan), &body).await
}

async fn remove_plan(
    State(admin): State<Admin>,
    Path((name, plan)): Path<(String, String)>,
) -> Response {
    admin.remove(&name, Scope::Plan(plan)).await
}

async fn remove_all(State(admin): State<Admin>, Path(name): Path<String>) -> Response {
    admin.remove(&name, Scope::All).await
}

async fn remove_key(
    State(admin): State<Admin>,
    Path((name, key)): Path<(String, String)>,
) -> Response {
    admin.remove(&name, Scope::Key(Key::from(key))).await
}

/// The app: `GET /` at `5/1h` per `x-api-key`, and the admin routes.
pub fn app<St: Store>(store: St, overrides: Overrides, token: &str) -> Result<Router, Error> {
    let layer = RateLimitLayer::builder()
        .key(Header::new(header::HeaderName::from_static("x-api-key")))
        .policy(Policy::new("api", ["5/1h".parse()?])?)
        .store(store)
        .build()?;
    let admin = admin(overrides, layer.rule_table(), token);
    let limited = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    Ok(limited.merge(admin))
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let demo = std::env::args().any(|a| a == "--demo");
    let token = match std::env::var("ADMIN_TOKEN") {
        Ok(token) if !token.is_empty() => token,
        _ if demo => "demo-token".to_owned(),
        _ => return Err("set ADMIN_TOKEN: the admin routes need a bearer token".into()),
    };
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::connect(&url).await?;
            app(store.clone(), store.overrides(), &token)?
        }
        Err(_) => {
            let store = tower_redis_ratelimit::MemoryStore::new();
            app(store.clone(), store.overrides(), &token)?
        }
    };
    let bind = if demo {
        "127.0.0.1:0".to_owned()
    } else {
        std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into())
    };
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    println!("serving http://{addr}; admin routes under /admin/overrides/api");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    if demo {
        demonstrate(addr, &token).await?;
        return Ok(());
    }
    server.await??;
    Ok(())
}

/// Sends requests as a customer and as an operator, printing each answer.
async fn demonstrate(addr: SocketAddr, token: &str) -> Result<(), Error> {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let send = |method: &str, path: &str, auth: Option<&str>, body: &'static str| {
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"))
            .header("x-api-key", "customer-42");
        if let Some(auth) = auth {
            request = request.header(header::AUTHORIZATION, auth);
        }
        let request = request.body(Full::new(Bytes::from_static(body.as_bytes())));
        let client = client.clone();
        let what = format!("{method} {path}");
        async move {
            let response = client.request(request?).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            println!(
                "{what:<40} -> {status} {}",
                String::from_utf8_lossy(&body).trim()
            );
            Ok::<u16, Error>(status)
        }
    };
    let bearer = format!("Bearer {token}");
    let bearer = Some(bearer.as_str());
    for _ in 0..6 {
        send("GET", "/", None, "").await?;
    }
    assert_eq!(
        send("PUT", "/admin/overrides/api/customer-42", None, "8/1h").await?,
        401
    );
    let wrong = Some("Bearer guess");
    assert_eq!(
        send("PUT", "/admin/overrides/api/customer-42", wrong, "8/1h").await?,
        401
    );
    assert_eq!(
        send("PUT", "/admin/overrides/api/customer-42", bearer, "8/1d").await?,
        400
    );
    assert_eq!(
        send("PUT", "/admin/overrides/api/customer-42", bearer, "eight").await?,
        400
    );
    assert_eq!(
        send("PUT", "/admin/overrides/api/customer-42", bearer, "8/1h").await?,
        200
    );
    let statuses = [
        send("GET", "/", None, "").await?,
        send("GET", "/", None, "").await?,
        send("GET", "/", None, "").await?,
        send("GET", "/", None, "").await?,
    ];
    assert_eq!(statuses, [200, 200, 200, 429], "three more of 8/1h");
    assert_eq!(send("GET", "/admin/overrides/api", bearer, "").await?, 200);
    assert_eq!(
        send("DELETE", "/admin/overrides/api/customer-42", bearer, "").await?,
        200
    );
    Ok(())
}
