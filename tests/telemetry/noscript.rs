//! Scripts flushed or lost in a restart under load never fail a request with `NOSCRIPT`, as
//! the logs of every thread show: the test installs the binary's one global subscriber.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::load::{self, assert_within_budget, layer, store};
use crate::support::scenarios::layered;
use crate::support::{self, Captured, RedisServer};
use fred::prelude::*;
use tower_redis_ratelimit::FailureMode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_and_restart_never_fail_a_request_with_noscript() {
    let _alone = support::one_at_a_time();
    let captured = Captured::default();
    tracing::subscriber::set_global_default(captured.subscriber())
        .expect("the only global subscriber of this binary");

    let server = Arc::new(Mutex::new(RedisServer::start()));
    let url = server.lock().unwrap().url();
    let store = store(url).await;
    let url = server.lock().unwrap().url();
    let admin = support::client(&url).await;
    let service = layered(&layer(store, FailureMode::Closed));

    // SCRIPT FLUSH twice under load: every request is still decided by Redis.
    let flushes = tokio::spawn(async move {
        for _ in 0..2 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            let _: () = admin.script_flush(false).await.unwrap();
        }
    });
    let samples = load::run(
        service.clone(),
        8,
        Duration::from_millis(1200),
        Duration::from_millis(2),
    )
    .await;
    flushes.await.unwrap();
    assert!(
        samples.iter().all(|s| s.status == 200),
        "a request failed across SCRIPT FLUSH"
    );

    // A restart loses the scripts too; requests fail only while Redis is down.
    // The closure gets its own handle: dropping the last one would stop the server again.
    let handle = Arc::clone(&server);
    let restart = tokio::task::spawn_blocking(move || handle.lock().unwrap().restart());
    let samples = load::run(service, 8, Duration::from_secs(3), Duration::from_millis(5)).await;
    restart.await.unwrap();
    assert_within_budget(&samples);
    assert_eq!(samples.last().unwrap().status, 200);
    let log = captured.text();
    assert!(!log.contains("NOSCRIPT"), "{log}");
}
