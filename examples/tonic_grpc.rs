//! A tonic gRPC server behind the layer: the standard gRPC health service (from `tonic-health`,
//! so no protobuf compiler is needed), limited to 3 calls per 10 seconds per client IP, which
//! the layer reads from tonic's `TcpConnectInfo`.
//!
//! ```text
//! cargo run --example tonic_grpc --features tonic                  # serve until Ctrl-C
//! cargo run --example tonic_grpc --features tonic -- --client      # call a running server 4 times
//! cargo run --example tonic_grpc --features tonic -- --self-check  # serve, call itself, exit
//! ```
//!
//! `BIND` sets the address to serve on (default `127.0.0.1:50051`); `--client [URL]` calls
//! `http://127.0.0.1:50051` unless given another URL, and prints what a tonic client sees,
//! `RESOURCE_EXHAUSTED` and the retry delay included.

use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::ServingStatus;
use tower_redis_ratelimit::{ClientIp, RateLimitLayer};

type Error = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_BIND: &str = "127.0.0.1:50051";

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => serve_until_ctrl_c().await,
        Some("--client") => {
            let url = args
                .get(1)
                .cloned()
                .unwrap_or_else(|| format!("http://{DEFAULT_BIND}"));
            call(&url, 4).await
        }
        Some("--self-check") => self_check().await,
        Some(other) => Err(format!(
            "unknown argument {other:?}; use no argument, --client [URL] or --self-check"
        )
        .into()),
    }
}

/// The health service behind a layer of 3 calls per 10 s per client IP.
async fn server(
    listener: tokio::net::TcpListener,
) -> Result<impl std::future::Future<Output = Result<(), tonic::transport::Error>>, Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let layer = RateLimitLayer::builder()
        .policy("3/10s")
        .key(ClientIp::new())
        .build()?;
    Ok(Server::builder()
        .layer(layer)
        .add_service(health)
        .serve_with_incoming(TcpIncoming::from(listener)))
}

async fn serve_until_ctrl_c() -> Result<(), Error> {
    let bind = std::env::var("BIND").unwrap_or_else(|_| DEFAULT_BIND.to_string());
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;
    let serving = server(listener).await?;
    println!("gRPC health service on {addr}, limited to 3 calls per 10 s per client IP");
    println!("call it from another terminal, 4 times within 10 s to see a refusal:");
    println!("  cargo run --example tonic_grpc --features tonic -- --client http://{addr}");
    println!("  grpc_health_probe -addr={addr}");
    println!(
        "  grpcurl -plaintext -proto health.proto {addr} grpc.health.v1.Health/Check   (health.proto from grpc/grpc-proto)"
    );
    println!("Ctrl-C stops it");
    tokio::select! {
        served = serving => served?,
        signal = tokio::signal::ctrl_c() => {
            signal?;
            println!("stopped");
        }
    }
    Ok(())
}

/// Calls the health service `calls` times and prints each answer as the tonic client sees it.
async fn call(url: &str, calls: u32) -> Result<(), Error> {
    let channel = Channel::from_shared(url.to_string())?.connect().await?;
    let mut client = HealthClient::new(channel);
    for call in 1..=calls {
        let request = HealthCheckRequest {
            service: String::new(),
        };
        match client.check(request).await {
            Ok(reply) => println!("call {call}: OK, status {:?}", reply.get_ref().status()),
            Err(status) => {
                let metadata = status.metadata();
                let text = |name: &str| {
                    metadata
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("-")
                        .to_string()
                };
                println!(
                    "call {call}: {:?}: {} (grpc-retry-pushback-ms: {}, retry-after: {}, ratelimit: {})",
                    status.code(),
                    status.message(),
                    text("grpc-retry-pushback-ms"),
                    text("retry-after"),
                    text("ratelimit"),
                );
            }
        }
    }
    Ok(())
}

/// Serves on a free port, calls itself 4 times, and exits.
async fn self_check() -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("gRPC health service on {addr}, limited to 3 calls per 10 s per client IP");
    tokio::spawn(server(listener).await?);
    call(&format!("http://{addr}"), 4).await
}
