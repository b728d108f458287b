//! An upload service whose clients may send 10 MB an hour each, metered as the bytes arrive:
//! however many uploads a client runs at once, its handlers get at most its quota.
//!
//! ```text
//! cargo run --example upload_service
//! head -c 4000000 /dev/zero | curl -i --data-binary @- http://127.0.0.1:3000/upload
//!     # 200: 4 000 000 bytes stored
//! head -c 20000000 /dev/zero | curl -i --data-binary @- http://127.0.0.1:3000/upload
//!     # 413 Content Too Large, before the body is read: 20 MB never fit in 10 MB an hour
//! head -c 8000000 /dev/zero | curl -i -H 'transfer-encoding: chunked' --data-binary @- \
//!     http://127.0.0.1:3000/upload
//!     # 429 with Retry-After: the body is cut when its quota is spent (6 MB were left)
//! ```
//!
//! An upload that declares its length (`Content-Length`) is admitted for all of it at once,
//! or refused at once; a chunked one is decided 256 KiB at a time while it streams, and cut
//! when a step is refused. The handler reads its body as usual (here with axum's `Bytes`
//! extractor); when the body is cut, the layer answers the client in its place. Give the
//! builder a `RedisStore` (`.store(..)`) for a quota shared by every instance of the service.
//!
//! `BIND` sets the address (default `127.0.0.1:3000`).

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::routing::post;
use axum::Router;
use tower_redis_ratelimit::metered::RequestBytes;
use tower_redis_ratelimit::{Policy, RateLimitLayer};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Stores an upload (here: counts it).
async fn upload(body: Bytes) -> String {
    format!("{} bytes stored\n", body.len())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());

    // 10 MB of request bodies an hour per client address, decided 256 KiB at a time.
    let uploads = RateLimitLayer::builder()
        .policy(Policy::new("uploads", ["10000000/1h".parse()?])?)
        .request_bytes(RequestBytes::new().step(256 * 1024))
        .build()?;

    let app = Router::new()
        .route("/upload", post(upload))
        // axum's own body limit (2 MB by default) would refuse the larger uploads first.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(uploads);

    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
