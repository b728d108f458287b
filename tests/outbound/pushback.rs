//! After an upstream's pushback, no second wave of refusals: a client policy (`100/1s`) far
//! above the upstream's real limit (5 in any second) is pushed back once, and the calls held
//! by the pause resume spread at the rate the layer learned, not all at the pause's end.
//!
//! Each test starts 20 calls, one every 50 ms. The first five arrive within the upstream's
//! limit; the sixth, at 250 ms, is refused with `Retry-After: 1` (the second the limit frees,
//! rounded up), which pauses the key until 1.25 s. The 14 calls started during the pause then
//! go at the learned rate: half of the 6 this instance sent in the last second, 3 per second.
//! Without the pace they all go at 1.25 s, and the upstream refuses 9 of them.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::client::{Outbound, OutboundLayer};
use tower_redis_ratelimit::key::Global;
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, RedisStore, Store};

/// What the upstream saw: when each call arrived, and whether it was refused.
type Arrivals = Arc<Mutex<Vec<(Instant, bool)>>>;
type Upstream = BoxCloneService<Request<()>, Response<()>, Infallible>;

/// The upstream's real limit: 5 calls in any second (those it served), and beyond, `429` with
/// `Retry-After` in whole seconds until its oldest served call leaves the second, rounded up.
const ALLOWED: usize = 5;

fn upstream(arrivals: Arrivals) -> Upstream {
    BoxCloneService::new(tower::service_fn(move |_: Request<()>| {
        let arrivals = arrivals.clone();
        async move {
            let now = Instant::now();
            let mut seen = arrivals.lock().unwrap();
            let served: Vec<Instant> = seen
                .iter()
                .filter(|&&(t, refused)| !refused && t + Duration::from_secs(1) > now)
                .map(|&(t, _)| t)
                .collect();
            let refused = served.len() >= ALLOWED;
            seen.push((now, refused));
            let mut response = Response::new(());
            if refused {
                let frees = served[0] + Duration::from_secs(1) - now;
                let seconds = frees.as_micros().div_ceil(1_000_000).max(1);
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                let value = http::HeaderValue::from(seconds as u64);
                response
                    .headers_mut()
                    .insert(http::header::RETRY_AFTER, value);
            }
            Ok(response)
        }
    }))
}

/// The client's policy: 100 in any second, twenty times what the upstream allows.
fn policy() -> Policy {
    Policy::new("pushback", ["100/1s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

fn client<St: Store>(store: St, arrivals: Arrivals) -> Outbound<Upstream, Global, St> {
    let layer = OutboundLayer::builder()
        .policy(policy())
        .store(store)
        .max_wait(Duration::from_secs(30))
        .build()
        .unwrap();
    ServiceBuilder::new()
        .layer(layer)
        .service(upstream(arrivals))
}

/// Starts 20 calls, one every 50 ms, and waits for them all; each must be answered (served or
/// refused by the upstream), none fails in the layer.
async fn twenty_calls<St: Store>(client: Outbound<Upstream, Global, St>) {
    let calls = (0..20u32).map(|i| {
        let mut client = client.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50) * i).await;
            let call = client.ready().await.unwrap().call(Request::new(()));
            call.await.map(|_| ())
        })
    });
    for done in futures::future::join_all(calls).await {
        done.unwrap()
            .expect("every call is answered by the upstream");
    }
}

/// The refusals, and those that came after the first pause had ended (a second wave).
fn refusals(arrivals: &Arrivals) -> (usize, usize) {
    let arrivals = arrivals.lock().unwrap();
    assert_eq!(arrivals.len(), 20, "every call reached the upstream");
    let refused: Vec<Instant> = arrivals
        .iter()
        .filter(|&&(_, refused)| refused)
        .map(|&(t, _)| t)
        .collect();
    let Some(&first) = refused.first() else {
        return (0, 0);
    };
    // The first refusal said `Retry-After: 1`.
    let resumed = first + Duration::from_secs(1);
    let again = refused.iter().filter(|&&t| t >= resumed).count();
    (refused.len(), again)
}

/// One process, the memory store, tokio's paused clock. Expected: the sixth call refused,
/// and nothing else (bound: at most 2 refusals, none after the pause).
#[tokio::test(start_paused = true)]
async fn a_pushback_leaves_no_second_wave_on_the_memory_store() {
    let arrivals: Arrivals = Arc::default();
    twenty_calls(client(MemoryStore::new(), arrivals.clone())).await;
    let (refused, again) = refusals(&arrivals);
    assert_eq!(again, 0, "refused again after the pause ({refused} in all)");
    assert!(refused <= 2, "{refused} refused");
}

/// The same through Redis, on the real clock (the pause goes through the store; the pace is
/// the instance's own). Bound: at most 2 refusals, none after the pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushback_leaves_no_second_wave_on_redis() {
    let server = crate::support::RedisServer::start();
    let store: RedisStore = server.store().await;
    let arrivals: Arrivals = Arc::default();
    twenty_calls(client(store, arrivals.clone())).await;
    let (refused, again) = refusals(&arrivals);
    assert_eq!(again, 0, "refused again after the pause ({refused} in all)");
    assert!(refused <= 2, "{refused} refused");
}
