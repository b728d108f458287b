//! An axum server that limits `/` per client IP and serves what the limiter counts at
//! `/metrics`, in the Prometheus text format (feature `metrics`).
//!
//! ```text
//! cargo run --example prometheus --features metrics
//! for i in 1 2 3 4; do curl -s -o /dev/null -w '%{http_code}\n' localhost:3000/; done
//! curl -s localhost:3000/metrics
//! ```
//!
//! Environment: `BIND` (default `127.0.0.1:3000`), `RATE_LIMIT` (default `3/1m`).

use std::net::SocketAddr;

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusBuilder;
use tower_redis_ratelimit::{Policy, RateLimitLayer};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    // Any `metrics` recorder works; this one renders Prometheus text on demand.
    let recorder = PrometheusBuilder::new().build_recorder();
    let prometheus = recorder.handle();
    metrics::set_global_recorder(recorder)?;

    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let limit = std::env::var("RATE_LIMIT").unwrap_or_else(|_| "3/1m".into());
    let policy = limit.parse::<Policy>()?.named("hello")?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        // Only `/` is limited: `route_layer` applies to the routes added before it.
        .route_layer(RateLimitLayer::builder().policy(policy).build()?)
        .route("/metrics", get(move || async move { prometheus.render() }));

    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!(
        "listening on http://{}: / limited to {limit} per client IP, metrics at /metrics",
        listener.local_addr()?
    );
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app).await?;
    Ok(())
}
