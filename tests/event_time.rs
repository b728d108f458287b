//! Event times in any order, decided by both stores exactly as the definition says: an event
//! is admitted iff every window `(a, a + w]` of each limit that contains it would hold at most
//! the limit's count.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::RedisServer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower_redis_ratelimit::{Key, MemoryStore, Policy, Store};

/// Times are whole seconds; windows too. A window's count only changes when an edge crosses an
/// event, so checking the windows that start on whole seconds covers them all.
fn reference(admitted: &[(i64, u64)], t: i64, policy: &Policy, cost: u64) -> bool {
    policy.limits().iter().all(|limit| {
        let w = limit.window().as_secs() as i64;
        (t - w..t).all(|a| {
            let held: u64 = admitted
                .iter()
                .filter(|&&(e, _)| a < e && e <= a + w)
                .map(|&(_, c)| c)
                .sum();
            held + cost <= limit.count()
        })
    })
}

async fn random_schedules<St: Store>(store: &St) {
    let policy: Policy = "1/10s + 3/1m + 5/5m".parse().unwrap();
    // Tomorrow, so that nothing is older than the longest window before now.
    let base = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        + 86_400;
    let mut rng = StdRng::seed_from_u64(7);
    for round in 0..20 {
        let key = Key::from(format!("user-{round}"));
        let mut admitted = Vec::new();
        for _ in 0..40 {
            let t = rng.random_range(0..900i64);
            let cost = rng.random_range(1..=2u64);
            let expected = reference(&admitted, t, &policy, cost);
            let at = UNIX_EPOCH + Duration::from_secs((base + t) as u64);
            let d = store
                .check_at(&key, &policy, cost as u32, at)
                .await
                .unwrap();
            assert_eq!(
                d.is_allowed(),
                expected,
                "round {round}, event at +{t} s, cost {cost}"
            );
            if expected {
                admitted.push((t, cost));
            }
        }
        assert!(
            admitted.len() >= 5,
            "the schedule admitted too little to test"
        );
    }
}

#[tokio::test]
async fn memory_store_follows_the_definition() {
    random_schedules(&MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_store_follows_the_definition() {
    let server = RedisServer::start();
    random_schedules(&server.store().await).await;
}
