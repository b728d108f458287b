//! Event times in any order, decided by both stores exactly as the definition says: an event
//! is admitted iff every window `(a, a + w]` of each limit that contains it would hold at most
//! the limit's count.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::RedisServer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower_redis_ratelimit::test_util::limit_index;
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

/// Both stores give the same decisions, every figure of them, for requests of very different
/// costs at event times in any order, in the past (trimmed as requests made then) or ahead.
async fn weighted_schedules<A: Store, B: Store>(a: &A, b: &B, base: i64) {
    let policy: Policy = "3000/10s + 10000/1m".parse().unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    for round in 0..6 {
        let key = Key::from(format!("usage-{base}-{round}"));
        let mut admitted = 0;
        for step in 0..80 {
            let t = rng.random_range(0..300_000i64);
            let cost = match rng.random_range(0..4) {
                0 => 1,
                1 => rng.random_range(1..50),
                _ => rng.random_range(50..=2_500),
            };
            let at = UNIX_EPOCH + Duration::from_millis((base + t) as u64);
            let x = a.check_at(&key, &policy, cost, at).await.unwrap();
            let y = b.check_at(&key, &policy, cost, at).await.unwrap();
            let figures = |d: &tower_redis_ratelimit::Decision| {
                (
                    d.is_allowed(),
                    limit_index(d),
                    d.remaining(),
                    d.reset_after(),
                    d.retry_after(),
                )
            };
            assert_eq!(
                figures(&x),
                figures(&y),
                "round {round}, step {step}: cost {cost} at +{t} ms"
            );
            admitted += usize::from(x.is_allowed());
        }
        assert!(admitted >= 10, "the schedule admitted too little to test");
    }
}

#[tokio::test]
async fn weighted_events_decide_alike_on_both_stores() {
    let server = RedisServer::start();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    // Ahead: nothing is trimmed. Behind (ending 10 min ago): trimmed at each event's time.
    for base in [now + 86_400_000, now - 900_000] {
        let redis = server.store().await;
        weighted_schedules(&MemoryStore::new(), &redis, base).await;
    }
}
