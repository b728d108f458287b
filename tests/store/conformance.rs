//! The conformance table of `common/conformance.rs`, against both stores.

use std::time::{Duration, UNIX_EPOCH};

use crate::support::conformance::{self, SCENARIOS};
use crate::support::RedisServer;
use crate::support::ALGORITHMS;
use tower_redis_ratelimit::test_util::tokio_clock_at;
use tower_redis_ratelimit::{MemoryStore, RedisStore};

/// A memory store whose virtual clock starts at the epoch, a boundary of every window.
fn memory() -> MemoryStore {
    MemoryStore::builder()
        .clock(tokio_clock_at(UNIX_EPOCH))
        .build()
}

#[tokio::test(start_paused = true)]
async fn memory_store_passes_every_scenario() {
    for scenario in SCENARIOS {
        conformance::run(&memory(), scenario, Duration::ZERO).await;
    }
}

/// Scenarios run concurrently, each on its own server, so the whole table takes one scenario's
/// real time. `plain`: whether plain requests go to the plain scripts (the default) or every
/// request to the full ones.
async fn redis_store_passes(plain: bool) {
    let servers: Vec<RedisServer> = SCENARIOS.iter().map(|_| RedisServer::start()).collect();
    let mut runs = Vec::new();
    for (server, scenario) in servers.iter().zip(SCENARIOS) {
        let store = RedisStore::builder(server.url())
            .plain_scripts(plain)
            .connect()
            .await
            .expect("connect store");
        runs.push(tokio::spawn(async move {
            conformance::run(&store, scenario, Duration::from_millis(60)).await;
        }));
    }
    for run in runs {
        run.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_passes_every_scenario() {
    redis_store_passes(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_passes_every_scenario_on_the_full_scripts_alone() {
    redis_store_passes(false).await;
}

#[tokio::test]
async fn scheduled_sends_on_memory_store() {
    conformance::scheduled_sends(&MemoryStore::new()).await;
}

#[tokio::test]
async fn scheduled_sends_on_redis_store() {
    let server = RedisServer::start();
    conformance::scheduled_sends(&server.store().await).await;
}

#[tokio::test]
async fn peek_and_reset_on_memory_store() {
    for algorithm in ALGORITHMS {
        conformance::peek_and_reset(&MemoryStore::new(), algorithm).await;
    }
}

#[tokio::test]
async fn peek_and_reset_on_redis_store() {
    let server = RedisServer::start();
    let store = server.store().await;
    for algorithm in ALGORITHMS {
        conformance::peek_and_reset(&store, algorithm).await;
    }
}
