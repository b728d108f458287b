//! Which script decides a request: a look, an admission or a lease of a policy with no penalty
//! box, concurrency limit or attempts goes to the plain scripts, which read no hash of
//! overrides, once a full call has confirmed the overrides of its lane; the rest, and every
//! request of a store with the plain scripts off, go to the full scripts, which read it in
//! every call.

use std::time::{Duration, Instant};

use crate::support::{command_calls, evalsha_calls, RedisServer};
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

/// How long the plain tier goes by the overrides a full call confirmed (`docs/promises.md`).
const FOLLOW: Duration = Duration::from_millis(250);

/// Decides `requests` requests one after the other under `policy` (each its own call, over
/// a few keys) through `store`; the script calls and the reads of the hash of overrides
/// (`HLEN`, one per full call) Redis ran meanwhile, and how long it took.
async fn decide(
    server: &RedisServer,
    store: &RedisStore,
    policy: &Policy,
    requests: usize,
) -> (u64, u64, Duration) {
    let admin = server.client().await;
    let (calls, reads) = (
        evalsha_calls(&admin).await,
        command_calls(&admin, "hlen").await,
    );
    let started = Instant::now();
    for i in 0..requests {
        let key = Key::from(format!("k{}", i % 7));
        store.check(&key, policy, 1).await.unwrap();
    }
    let took = started.elapsed();
    let calls = evalsha_calls(&admin).await - calls;
    let reads = command_calls(&admin, "hlen").await - reads;
    (calls, reads, took)
}

/// A store deciding plain requests one by one reads the hash of overrides about once per
/// 250 ms (the full call that confirms its lane), not once per call; with the plain scripts
/// off, once per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_requests_read_the_overrides_once_per_quarter_second_not_per_call() {
    let server = RedisServer::start();
    let plain = server.store().await;
    let full = server.full_scripts_store().await;
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let policy = Policy::new("api", ["1000000/1h".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let (calls, reads, took) = decide(&server, &plain, &policy, 400).await;
        let confirmations = took.as_millis() as u64 / FOLLOW.as_millis() as u64 + 2;
        assert!(calls >= 400, "{algorithm:?}: {calls} calls");
        assert!(
            reads <= confirmations,
            "{algorithm:?}: {reads} reads of the overrides in {calls} calls over {took:?}"
        );
        let (calls, reads, _) = decide(&server, &full, &policy, 400).await;
        assert_eq!(reads, calls, "{algorithm:?} on the full scripts alone");
    }
}

/// A policy with a penalty box, or with a concurrency limit, goes to the full scripts in every
/// call, confirmed or not: the plain ones decide neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_with_a_box_or_slots_is_decided_by_the_full_scripts() {
    let server = RedisServer::start();
    let store = server.store().await;
    let api = || Policy::new("api", ["1000000/1h".parse().unwrap()]).unwrap();
    let boxed = api().block_for(Duration::from_secs(60)).unwrap();
    let slots = api().concurrency(1_000_000).unwrap();
    for policy in [boxed, slots] {
        let (calls, reads, _) = decide(&server, &store, &policy, 100).await;
        assert!(
            calls >= 100 && reads == calls,
            "{calls} calls, {reads} reads"
        );
    }
}

/// A leasing store's lease calls, each a call of its own outside the batches, go to the plain
/// scripts too: the reads of the hash of overrides stay at about one per 250 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_calls_go_to_the_plain_scripts() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .leases(Leases::new())
        .connect()
        .await
        .unwrap();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let policy = Policy::new("api", ["100000/1m".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let (calls, reads, took) = decide(&server, &store, &policy, 20_000).await;
        let confirmations = took.as_millis() as u64 / FOLLOW.as_millis() as u64 + 2;
        eprintln!("{algorithm:?}: {calls} calls, {reads} reads in {took:?}");
        assert!(calls >= 20, "{algorithm:?}: {calls} calls");
        assert!(
            reads <= confirmations,
            "{algorithm:?}: {reads} reads of the overrides in {calls} calls over {took:?}"
        );
    }
}
