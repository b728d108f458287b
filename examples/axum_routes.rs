//! Per-route limits in one axum app: a rule table in one layer, and an API-key limit on the
//! `/api` routes with `route_layer`.
//!
//! ```text
//! cargo run --example axum_routes
//! curl -i -X POST http://127.0.0.1:3000/login        # 3 per minute per client IP
//! curl -i http://127.0.0.1:3000/search/rust          # 10 per minute per client IP
//! curl -i http://127.0.0.1:3000/                     # 60 per minute per client IP
//! curl -i -H 'x-api-key: k1' http://127.0.0.1:3000/api/items   # 5 per 10 s per API key
//! ```
//!
//! `BIND` sets the address (default `127.0.0.1:3000`); `TRUSTED_PROXY` (e.g. `10.0.0.0/8`)
//! makes the client IP come from `X-Forwarded-For`/`Forwarded` when the peer is that proxy.

use std::net::SocketAddr;

use axum::routing::{get, post};
use axum::Router;
use http::{HeaderName, Method};
use tower_redis_ratelimit::{ClientIp, Header, Policy, RateLimitLayer, Rule};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let mut client_ip = ClientIp::builder();
    if let Ok(proxy) = std::env::var("TRUSTED_PROXY") {
        client_ip = client_ip.trust(&proxy)?;
    }

    // One layer, three policies: the first matching rule wins, the default takes the rest.
    let per_route = RateLimitLayer::builder()
        .key(client_ip.build()?)
        .rule(
            Rule::new(Policy::new("login", ["3/1m".parse()?])?)
                .method(Method::POST)
                .path("/login"),
        )
        .rule(Rule::new(Policy::new("search", ["10/1m".parse()?])?).path("/search/{*query}"))
        .policy(Policy::new("site", ["60/1m".parse()?])?)
        .build()?;

    // The API routes are limited per API key, on top of the per-IP limits.
    let per_api_key = RateLimitLayer::builder()
        .key(Header::new(HeaderName::from_static("x-api-key")))
        .policy(Policy::new("api", ["5/10s".parse()?])?)
        .build()?;
    let api = Router::new()
        .route("/api/items", get(|| async { "[]\n" }))
        .route_layer(per_api_key);

    let app = Router::new()
        .route("/", get(|| async { "home\n" }))
        .route("/login", post(|| async { "welcome\n" }))
        .route("/search/{*query}", get(|| async { "results\n" }))
        .merge(api)
        .layer(per_route);

    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
