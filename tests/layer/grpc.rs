#![cfg(feature = "tonic")]
//! gRPC: a real tonic server behind the layer, and a real tonic client that sees
//! `RESOURCE_EXHAUSTED` with the retry delay in its metadata.

use std::time::Duration;

use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::ServingStatus;
use tower_redis_ratelimit::{ClientIp, RateLimitLayer};

#[tokio::test]
async fn tonic_client_sees_resource_exhausted() {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;

    // Keyed by the peer address tonic puts in `TcpConnectInfo`.
    let layer = RateLimitLayer::builder()
        .policy("2/1m")
        .key(ClientIp::new())
        .build()
        .unwrap();
    // Around it, a site-wide limit: a stacked layer adds its own member to the fields.
    let site = RateLimitLayer::builder()
        .policy(
            "100/1m"
                .parse::<tower_redis_ratelimit::Policy>()
                .unwrap()
                .named("site")
                .unwrap(),
        )
        .key(ClientIp::new())
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(site)
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );

    let mut client = connect(addr).await;
    let ask = || HealthCheckRequest {
        service: String::new(),
    };
    for _ in 0..2 {
        let reply = client.check(ask()).await.expect("admitted");
        assert_eq!(reply.get_ref().status, ServingStatus::Serving as i32);
    }
    let status = client.check(ask()).await.expect_err("refused");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(status.message(), "rate limit default exceeded");
    let metadata = status.metadata();
    let pushback: u64 = metadata
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("retry delay in metadata");
    assert!(
        (1..=60_000).contains(&pushback),
        "pushback {pushback} ms within the window"
    );
    let retry_after: u64 = metadata
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        retry_after,
        Duration::from_millis(pushback).as_secs_f64().ceil() as u64
    );
    // The refusing policy's member with nothing left, and the site's after it.
    let fields = metadata.get("ratelimit").unwrap().to_str().unwrap();
    let members: Vec<&str> = fields.split(", ").collect();
    assert_eq!(members.len(), 2, "{fields}");
    assert!(members[0].starts_with("\"default\";r=0;t="), "{fields}");
    assert!(members[1].starts_with("\"site\";r=97;t="), "{fields}");
}

/// A concurrency limit over gRPC streams: a `Watch` stream holds its slot while it is open, a
/// second call is refused with `RESOURCE_EXHAUSTED`, and a client that cancels its stream frees
/// the slot (HTTP/2 `RST_STREAM`: the server drops the response body).
#[tokio::test]
async fn a_cancelled_grpc_stream_gives_its_slot_back() {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let policy = tower_redis_ratelimit::Policy::new("streams", ["1000/1m".parse().unwrap()])
        .unwrap()
        .concurrency(1)
        .unwrap();
    let layer = RateLimitLayer::builder()
        .policy(policy)
        .key(ClientIp::new())
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    let mut client = connect(addr).await;
    let ask = || HealthCheckRequest {
        service: String::new(),
    };
    let mut watching = client.watch(ask()).await.expect("admitted").into_inner();
    let first = watching.message().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    let refused = client.check(ask()).await.expect_err("one stream is open");
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(refused.metadata().get("retry-after").unwrap(), "1");
    drop(watching);
    let started = std::time::Instant::now();
    loop {
        match client.check(ask()).await {
            Ok(_) => break,
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted);
                assert!(started.elapsed() < Duration::from_secs(1), "still refused");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    println!(
        "a cancelled stream's slot was free after {:?}",
        started.elapsed()
    );
}

/// A health client connected to the server at `addr`.
async fn connect(addr: std::net::SocketAddr) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}
