//! Concurrent request load against a layered service, recording what each request got, and
//! the layer over Redis it runs against, with its time budget.

use std::convert::Infallible;
use std::time::Duration;

use tokio::time::Instant;
use tower::{Service, ServiceExt};
use tower_redis_ratelimit::{FailureMode, PeerIp, RateLimitLayer, RedisStore};

use super::scenarios::{request_from, Reply};

/// The decision budget of [`store`].
pub const BUDGET: Duration = Duration::from_millis(200);
/// Scheduling slack on a shared two-core machine.
pub const MARGIN: Duration = Duration::from_millis(300);

/// A store with a budget of [`BUDGET`] and a short breaker interval.
pub async fn store(url: String) -> RedisStore {
    super::store_within(url, BUDGET).await
}

/// A layer that never refuses for the rate (`1000000/1m`), deciding with `store` and failing
/// as `mode` says.
pub fn layer(store: RedisStore, mode: FailureMode) -> RateLimitLayer<PeerIp, RedisStore> {
    RateLimitLayer::builder()
        .policy("1000000/1m")
        .store(store)
        .failure_mode(mode)
        .build()
        .unwrap()
}

/// Asserts that no request waited past the budget plus the margin.
pub fn assert_within_budget(samples: &[Sample]) {
    let slowest = samples.iter().map(|s| s.latency).max().unwrap();
    assert!(
        slowest <= BUDGET + MARGIN,
        "slowest of {} requests took {slowest:?}",
        samples.len()
    );
}

/// One request of a load run.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// When it was sent, from the start of the run.
    pub at: Duration,
    pub latency: Duration,
    pub status: u16,
    /// Whether the response carries a decision (`RateLimit` field).
    pub decided: bool,
}

/// `workers` loops send requests (each `pause` apart) for `length`.
pub async fn run<S>(service: S, workers: usize, length: Duration, pause: Duration) -> Vec<Sample>
where
    S: Service<http::Request<()>, Response = Reply, Error = Infallible> + Clone,
{
    let start = Instant::now();
    let workers = (0..workers).map(|_| {
        let service = service.clone();
        async move {
            let mut samples = Vec::new();
            while start.elapsed() < length {
                let sent = Instant::now();
                let reply = service
                    .clone()
                    .oneshot(request_from("192.0.2.1"))
                    .await
                    .unwrap();
                samples.push(Sample {
                    at: sent - start,
                    latency: sent.elapsed(),
                    status: reply.status().as_u16(),
                    decided: reply.headers().contains_key("ratelimit"),
                });
                tokio::time::sleep(pause).await;
            }
            samples
        }
    });
    let mut all: Vec<Sample> = futures::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
        .collect();
    all.sort_by_key(|s| s.at);
    all
}
