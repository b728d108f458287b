//! A step on Redis (`Engine::step`) is no attempt where requests count by their outcome
//! (`model::attempts`): it is sent with attempt 0, and its decision settles none. Policies
//! counting attempts are the layer's own (`count_when`), so this is tested here rather than
//! in `tests/store/steps.rs`.

use std::time::Duration;

use super::differential::Server;
use crate::store::engine::Engine;
use crate::{Key, Policy, RedisStore, Store};

#[test]
fn a_step_is_no_attempt_where_requests_count_by_outcome() {
    let server = Server::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = format!("redis://127.0.0.1:{}", server.port);
    runtime.block_on(async {
        let mut store = None;
        for _ in 0..100 {
            if let Ok(connected) = RedisStore::connect(&url).await {
                store = Some(connected);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let store = store.expect("redis-server did not come up");
        let key = Key::from("ann");
        let policy = "10/1h".parse::<Policy>().unwrap().counting_attempts();
        let request = store.check(&key, &policy, 1).await.unwrap();
        assert_ne!(request.attempt, 0, "a request is an attempt");
        assert!(
            store.step_now(&key, &policy, 5).is_none(),
            "decided in Redis"
        );
        let step = store.step(&key, &policy, 5).await.unwrap();
        assert!(step.is_allowed());
        assert_eq!(step.attempt, 0, "a step was counted as an attempt");
        let past = store.step(&key, &policy, 5).await.unwrap();
        assert!(!past.is_allowed(), "11 of 10 admitted");
    });
}
