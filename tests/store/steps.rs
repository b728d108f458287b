//! Steps of a metered body (`Engine::step`, reached through `Store`), on both stores: decided
//! and recorded by the limits alone, so that steps admit at most a limit's count, a refund of
//! a step's unused part frees it, and a step neither meets nor sets a penalty box nor takes a
//! concurrency slot.

use std::time::Duration;

use crate::support::RedisServer;
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, Settlement, Store};

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::Gcra,
    Algorithm::SlidingLog,
];

fn uploads(algorithm: Algorithm) -> Policy {
    "1000/1h"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(algorithm)
}

/// Steps of 300 at `1000/1h`: three are admitted, the fourth is refused, and what they
/// recorded is what the key holds.
async fn steps_admit_at_most_the_count<St: Store>(store: &St) {
    for algorithm in ALGORITHMS {
        let (key, policy) = (
            Key::from(format!("count-{algorithm:?}")),
            uploads(algorithm),
        );
        for step in 0..3 {
            let decision = store.step(&key, &policy, 300).await.unwrap();
            assert!(decision.is_allowed(), "{algorithm:?}: step {step} refused");
        }
        let fourth = store.step(&key, &policy, 300).await.unwrap();
        assert!(!fourth.is_allowed(), "{algorithm:?}: 1200 of 1000 admitted");
        assert!(
            fourth.retry_after().is_some(),
            "{algorithm:?}: a wait helps"
        );
        let left = store.peek(&key, &policy, 1).await.unwrap();
        assert_eq!(left.remaining(), 100, "{algorithm:?}: 900 recorded");
    }
}

/// A step of 600 of which 100 were used: refunding the other 500 lets a step of 900 in,
/// which the step's full charge would have refused.
async fn a_steps_unused_part_is_refunded<St: Store>(store: &St) {
    for algorithm in ALGORITHMS {
        let (key, policy) = (
            Key::from(format!("refund-{algorithm:?}")),
            uploads(algorithm),
        );
        let step = store.step(&key, &policy, 600).await.unwrap();
        assert!(step.is_allowed());
        let refund = Settlement::refund(&step, 500).unwrap();
        store.settle(&key, &policy, refund).await.unwrap();
        let next = store.step(&key, &policy, 900).await.unwrap();
        assert!(
            next.is_allowed(),
            "{algorithm:?}: the refunded 500 were not freed"
        );
        let over = store.step(&key, &policy, 1).await.unwrap();
        assert!(!over.is_allowed(), "{algorithm:?}: 1001 of 1000 admitted");
    }
}

/// Under a concurrency limit of 1 with a request in flight, steps are admitted (they take
/// no slot); a refused step sets no penalty box: once its units are refunded, a request is
/// admitted.
async fn a_step_takes_no_slot_and_sets_no_box<St: Store>(store: &St) {
    let policy = "10/1h"
        .parse::<Policy>()
        .unwrap()
        .block_for(Duration::from_secs(3600))
        .unwrap()
        .concurrency(1)
        .unwrap();
    let key = Key::from("slots");
    let request = store.check(&key, &policy, 1).await.unwrap();
    assert!(request.is_allowed());
    let second = store.check(&key, &policy, 1).await.unwrap();
    assert!(!second.is_allowed(), "the slot is held");
    let step = store.step(&key, &policy, 8).await.unwrap();
    assert!(step.is_allowed(), "a step was refused for a slot");
    let refused = store.step(&key, &policy, 2).await.unwrap();
    assert!(!refused.is_allowed(), "11 of 10 admitted");
    assert!(!refused.in_penalty_box());
    let refund = Settlement::refund(&step, 8).unwrap();
    store.settle(&key, &policy, refund).await.unwrap();
    let release = Settlement::release(&request).unwrap();
    store.settle(&key, &policy, release).await.unwrap();
    let after = store.check(&key, &policy, 1).await.unwrap();
    assert!(
        after.is_allowed(),
        "the refused step boxed the key: {after:?}"
    );
}

/// A key in its penalty box: its requests are refused, its steps decided by its limits.
async fn a_step_in_a_box_is_decided_by_the_limits<St: Store>(store: &St) {
    let policy = "10/1h"
        .parse::<Policy>()
        .unwrap()
        .block_for(Duration::from_secs(3600))
        .unwrap();
    let key = Key::from("boxed");
    let full = store.check(&key, &policy, 10).await.unwrap();
    assert!(full.is_allowed());
    let over = store.check(&key, &policy, 1).await.unwrap();
    assert!(over.in_penalty_box(), "the box was not set: {over:?}");
    let refund = Settlement::refund(&full, 5).unwrap();
    store.settle(&key, &policy, refund).await.unwrap();
    let request = store.check(&key, &policy, 1).await.unwrap();
    assert!(request.in_penalty_box(), "a request passed the box");
    let step = store.step(&key, &policy, 5).await.unwrap();
    assert!(step.is_allowed(), "a step met the box: {step:?}");
    let past = store.step(&key, &policy, 1).await.unwrap();
    assert!(!past.is_allowed(), "11 of 10 admitted");
}

#[tokio::test]
async fn memory_steps_admit_at_most_the_count() {
    steps_admit_at_most_the_count(&MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_steps_admit_at_most_the_count() {
    let server = RedisServer::start();
    steps_admit_at_most_the_count(&server.store().await).await;
}

#[tokio::test]
async fn memory_a_steps_unused_part_is_refunded() {
    a_steps_unused_part_is_refunded(&MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_a_steps_unused_part_is_refunded() {
    let server = RedisServer::start();
    a_steps_unused_part_is_refunded(&server.store().await).await;
}

#[tokio::test]
async fn memory_a_step_takes_no_slot_and_sets_no_box() {
    a_step_takes_no_slot_and_sets_no_box(&MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_a_step_takes_no_slot_and_sets_no_box() {
    let server = RedisServer::start();
    a_step_takes_no_slot_and_sets_no_box(&server.store().await).await;
}

#[tokio::test]
async fn memory_a_step_in_a_box_is_decided_by_the_limits() {
    a_step_in_a_box_is_decided_by_the_limits(&MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_a_step_in_a_box_is_decided_by_the_limits() {
    let server = RedisServer::start();
    a_step_in_a_box_is_decided_by_the_limits(&server.store().await).await;
}
