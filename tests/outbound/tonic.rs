//! A tonic `Channel` behind the outbound layer, as it is (no adapter): gRPC calls to a local
//! tonic server wait for their turns, and a `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`
//! pauses the key.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tonic::codegen::tokio_stream::Stream;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower::ServiceBuilder;
use tower_redis_ratelimit::client::{Outbound, OutboundError, OutboundLayer};
use tower_redis_ratelimit::key::Global;
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy};

/// The upstream: a gRPC health service that records when each call arrives, and refuses the
/// call that arrives `refuse`-th (from 1) with `RESOURCE_EXHAUSTED` and a pushback of
/// `pushback`, as a gRPC server that limits its callers does (gRFC A6).
#[derive(Clone)]
struct Upstream {
    arrivals: Arc<Mutex<Vec<Instant>>>,
    refuse: Option<(usize, Duration)>,
}

#[tonic::async_trait]
impl Health for Upstream {
    async fn check(
        &self,
        _: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
        let arrived = {
            let mut arrivals = self.arrivals.lock().unwrap();
            arrivals.push(Instant::now());
            arrivals.len()
        };
        if let Some((n, pushback)) = self.refuse.filter(|&(n, _)| n == arrived) {
            let mut status = Status::resource_exhausted(format!("call {n}: slow down"));
            let ms = pushback.as_millis().to_string().parse().unwrap();
            status.metadata_mut().insert("grpc-retry-pushback-ms", ms);
            return Err(status);
        }
        Ok(tonic::Response::new(HealthCheckResponse { status: 1 }))
    }

    type WatchStream =
        Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send + 'static>>;

    async fn watch(
        &self,
        _: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not used here"))
    }
}

/// Serves `upstream` on a free loopback port.
async fn serve(upstream: Upstream) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .add_service(HealthServer::new(upstream))
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    addr
}

/// The client under test: a tonic `Channel` to `addr` behind an outbound layer of `policy`
/// (the default margin, 50 ms), with the generated client over it. `HealthClient<Outbound<..>>`
/// is all it takes: `Outbound` is a `Service<http::Request<tonic::body::Body>>` whose response
/// is the channel's own, and its error (`OutboundError<tonic::transport::Error>`) converts
/// into the boxed error tonic's generated clients ask for.
async fn client(addr: SocketAddr, policy: Policy) -> HealthClient<Outbound<Channel>> {
    client_waiting(addr, policy, Duration::from_secs(10)).await
}

/// [`client`], whose calls wait up to `max_wait` for their turns.
async fn client_waiting(
    addr: SocketAddr,
    policy: Policy,
    max_wait: Duration,
) -> HealthClient<Outbound<Channel>> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let layer: OutboundLayer<Global, MemoryStore> = OutboundLayer::builder()
        .policy(policy)
        .max_wait(max_wait)
        .build()
        .unwrap();
    HealthClient::new(ServiceBuilder::new().layer(layer).service(channel))
}

fn ask() -> HealthCheckRequest {
    HealthCheckRequest {
        service: String::new(),
    }
}

/// Sends `n` calls at once on clones of `client`; what each returned.
async fn at_once(client: &HealthClient<Outbound<Channel>>, n: usize) -> Vec<Result<(), Status>> {
    let calls: Vec<_> = (0..n)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move { client.check(ask()).await.map(drop) })
        })
        .collect();
    let mut results = Vec::new();
    for call in calls {
        results.push(call.await.unwrap());
    }
    results
}

/// One call per 100 ms (a sliding log), 6 calls sent at once: all are served, none fails,
/// and they reach the server one by one, each at least 100 ms after the one before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_through_a_channel_wait_for_their_turns() {
    let arrivals = Arc::<Mutex<Vec<Instant>>>::default();
    let upstream = Upstream {
        arrivals: arrivals.clone(),
        refuse: None,
    };
    let addr = serve(upstream).await;
    let policy = "1/100ms".parse::<Policy>().unwrap();
    let client = client(addr, policy.with_algorithm(Algorithm::SlidingLog)).await;
    let started = Instant::now();
    let results = at_once(&client, 6).await;
    let took = started.elapsed();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let mut arrived = arrivals.lock().unwrap().clone();
    arrived.sort();
    let gaps: Vec<Duration> = arrived.windows(2).map(|w| w[1] - w[0]).collect();
    eprintln!("6 calls at once took {took:?}; gaps between arrivals {gaps:?}");
    assert_eq!(arrived.len(), 6);
    let closest = gaps.iter().min().unwrap();
    assert!(*closest >= Duration::from_millis(100), "{gaps:?}");
    // Turns 150 ms apart (the window and the margin): five of them after the first, 750 ms;
    // a call that could not leave within its margin (a busy machine) waits for a later turn.
    assert!(took < Duration::from_secs(2), "{took:?}");
}

/// The server refuses the 2nd call with `RESOURCE_EXHAUSTED` and a pushback of 600 ms; the
/// caller sees the refusal as tonic shows it, and the 4 calls sent right after it reach the
/// server only once the pause is over, though the client's policy (100 per second) has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_exhausted_with_a_pushback_pauses_the_channel() {
    let pushback = Duration::from_millis(600);
    let arrivals = Arc::<Mutex<Vec<Instant>>>::default();
    let upstream = Upstream {
        arrivals: arrivals.clone(),
        refuse: Some((2, pushback)),
    };
    let addr = serve(upstream).await;
    let policy = "100/1s".parse::<Policy>().unwrap();
    let mut client = client(addr, policy.with_algorithm(Algorithm::Gcra)).await;
    client.check(ask()).await.expect("the first call is served");
    let refused = client
        .check(ask())
        .await
        .expect_err("the second is refused");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    let results = at_once(&client, 4).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let arrived = arrivals.lock().unwrap().clone();
    assert_eq!(arrived.len(), 6);
    let after: Vec<Duration> = arrived[2..].iter().map(|&t| t - arrived[1]).collect();
    eprintln!("after the pushback of {pushback:?}, the next calls arrived {after:?} later");
    let soonest = after.iter().min().unwrap();
    assert!(*soonest >= pushback, "{after:?}");
    assert!(
        *soonest < pushback + Duration::from_millis(400),
        "{after:?}"
    );
}

/// One call per second, calls wait at most 300 ms: the second call fails at once, never
/// reaching the server, with the `Status` tonic makes of a service's error (`Code::Unknown`),
/// whose source is the layer's `OutboundError::TooLate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_whose_turn_is_too_far_fails_at_once() {
    let arrivals = Arc::<Mutex<Vec<Instant>>>::default();
    let upstream = Upstream {
        arrivals: arrivals.clone(),
        refuse: None,
    };
    let addr = serve(upstream).await;
    let policy = "1/1s".parse::<Policy>().unwrap();
    let policy = policy.with_algorithm(Algorithm::SlidingLog);
    let mut client = client_waiting(addr, policy, Duration::from_millis(300)).await;
    client.check(ask()).await.expect("the first call is served");
    let started = Instant::now();
    let failed = client
        .check(ask())
        .await
        .expect_err("the second is too late");
    assert!(started.elapsed() < Duration::from_millis(100));
    assert_eq!(failed.code(), Code::Unknown, "{failed:?}");
    let source = std::error::Error::source(&failed).expect("the layer's error");
    let outbound = source.downcast_ref::<OutboundError<tonic::transport::Error>>();
    assert!(
        matches!(outbound, Some(OutboundError::TooLate { turn: Some(_) })),
        "{source:?}"
    );
    assert_eq!(arrivals.lock().unwrap().len(), 1);
}
