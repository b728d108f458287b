//! An axum server that limits `/` per client IP.
//!
//! ```text
//! cargo run --example quickstart                                   # embedded store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example quickstart  # shared through Redis
//! ```
//!
//! Environment: `BIND` (default `127.0.0.1:3000`), `RATE_LIMIT` (default `5/10s`, any policy
//! text such as `1/1m + 5/1h`), `REDIS_URL` (absent: the embedded store).

use std::net::SocketAddr;

use axum::routing::get;
use axum::Router;
use tower_redis_ratelimit::{Policy, RateLimitLayer, RedisStore, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let policy: Policy = std::env::var("RATE_LIMIT")
        .unwrap_or_else(|_| "5/10s".into())
        .parse()?;
    let builder = RateLimitLayer::builder().policy(policy);
    match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::connect(&url).await?;
            serve(
                &bind,
                builder.store(store).build()?,
                &format!("redis at {url}"),
            )
            .await
        }
        Err(_) => serve(&bind, builder.build()?, "memory (this process only)").await,
    }
}

async fn serve<St: Store>(
    bind: &str,
    layer: RateLimitLayer<tower_redis_ratelimit::PeerIp, St>,
    store: &str,
) -> Result<(), Error> {
    let limits: Vec<String> = layer
        .rule_table()
        .policies()
        .iter()
        .map(|p| p.to_string())
        .collect();
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind(bind).await?;
    println!(
        "listening on http://{} with limit {} per client IP, store: {store}",
        listener.local_addr()?,
        limits.join(", ")
    );
    // `ConnectInfo<SocketAddr>` gives the layer each client's address.
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app).await?;
    Ok(())
}
