//! The layer on a plain hyper 1 server, without axum: each connection's peer address goes into
//! the request extensions, where the key extractor finds it.
//!
//! ```text
//! cargo run --example hyper_server
//! curl -i http://127.0.0.1:3000/
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tower::ServiceBuilder;
use tower_redis_ratelimit::RateLimitLayer;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let layer = RateLimitLayer::builder().policy("5/10s").build()?;
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!("listening on http://{}", listener.local_addr()?);
    loop {
        let (stream, peer) = listener.accept().await?;
        let service = ServiceBuilder::new()
            .map_request(move |mut request: Request<Incoming>| {
                request.extensions_mut().insert::<SocketAddr>(peer);
                request
            })
            .layer(layer.clone())
            .service_fn(|_request| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello\n"))))
            });
        tokio::spawn(async move {
            let connection = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
            if let Err(error) = connection.await {
                eprintln!("connection from {peer}: {error}");
            }
        });
    }
}
