//! A tonic gRPC server behind the layer, and a client that calls it until it is refused with
//! `RESOURCE_EXHAUSTED`.
//!
//! ```text
//! cargo run --example tonic_grpc --features tonic
//! ```
//!
//! The server is the standard gRPC health service (from `tonic-health`), limited to 3 calls per
//! 10 seconds per client IP, which the layer reads from tonic's `TcpConnectInfo`.

use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::ServingStatus;
use tower_redis_ratelimit::{ClientIp, RateLimitLayer};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let layer = RateLimitLayer::builder()
        .policy("3/10s")
        .key(ClientIp::new())
        .build()?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("gRPC health service on {addr}, limited to 3 calls per 10 s per client IP");
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );

    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);
    for call in 1..=4 {
        let request = HealthCheckRequest {
            service: String::new(),
        };
        match client.check(request).await {
            Ok(reply) => println!("call {call}: OK, status {:?}", reply.get_ref().status()),
            Err(status) => {
                let pushback = status.metadata().get("grpc-retry-pushback-ms");
                println!(
                    "call {call}: {:?}: {} (grpc-retry-pushback-ms: {:?})",
                    status.code(),
                    status.message(),
                    pushback
                );
            }
        }
    }
    Ok(())
}
