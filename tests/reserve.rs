//! Reservations on the memory store, on a manual clock: turns in reservation order, a wait
//! past `max_wait` refused without recording, a reservation given back frees its place, and
//! the policies that cannot reserve say so.

use std::time::{Duration, UNIX_EPOCH};

use tower_redis_ratelimit::store::{ManualClock, Override, Reserve, Scope};
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, Settlement, Store, StoreError};

const MS: Duration = Duration::from_millis(1);

fn store() -> (MemoryStore, ManualClock) {
    let clock = ManualClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    (MemoryStore::builder().clock(clock.clone()).build(), clock)
}

fn policy(limit: &str, algorithm: Algorithm) -> Policy {
    Policy::new("api", [limit.parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
}

/// The turns of `n` reservations of 1, each allowed to wait `max_wait`; `None` for a refusal.
async fn turns(
    store: &MemoryStore,
    key: &Key,
    policy: &Policy,
    n: usize,
    max_wait: Duration,
) -> Vec<Option<Duration>> {
    let mut turns = Vec::new();
    for _ in 0..n {
        let d = store
            .reserve(key, policy, 1, max_wait, Duration::ZERO)
            .await
            .unwrap();
        turns.push(d.is_allowed().then(|| d.turn()));
    }
    turns
}

#[tokio::test]
async fn turns_follow_reservation_order_one_drain_apart() {
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let (store, _) = store();
        let (key, policy) = (Key::from("k"), policy("10/1s", algorithm));
        let got = turns(&store, &key, &policy, 12, Duration::from_secs(5)).await;
        assert!(
            got[..10].iter().all(|t| *t == Some(Duration::ZERO)),
            "{algorithm:?}: {got:?}"
        );
        let expected = match algorithm {
            // One unit drains every 100 ms.
            Algorithm::Gcra => [100 * MS, 200 * MS],
            // The first two units leave the window at 1 s.
            _ => [1000 * MS, 1000 * MS],
        };
        assert_eq!(
            got[10..],
            [Some(expected[0]), Some(expected[1])],
            "{algorithm:?}"
        );
        // A plain decision waits behind the reservations.
        let now = store.peek(&key, &policy, 1).await.unwrap();
        assert!(
            !now.is_allowed() && now.retry_after() > Some(expected[1] - MS),
            "{now:?}"
        );
    }
}

#[tokio::test]
async fn past_max_wait_nothing_is_recorded() {
    let (store, _) = store();
    let (key, policy) = (Key::from("k"), policy("10/1s", Algorithm::Gcra));
    turns(&store, &key, &policy, 10, Duration::ZERO).await;
    let late = store
        .reserve(&key, &policy, 1, 50 * MS, Duration::ZERO)
        .await
        .unwrap();
    assert!(!late.is_allowed());
    assert_eq!(
        late.retry_after(),
        Some(100 * MS),
        "the turn it would have had"
    );
    // Nothing recorded: the next one gets the same turn.
    let next = store
        .reserve(&key, &policy, 1, 100 * MS, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((next.is_allowed(), next.turn()), (true, 100 * MS));
    // A cost over the count never gets a turn.
    let never = store
        .reserve(&key, &policy, 11, Duration::MAX, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((never.is_allowed(), never.retry_after()), (false, None));
}

#[tokio::test]
async fn a_reservation_given_back_before_its_turn_frees_its_place() {
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let (store, clock) = store();
        let (key, policy) = (Key::from("k"), policy("10/1s", algorithm));
        turns(&store, &key, &policy, 10, Duration::ZERO).await;
        let waiting = store
            .reserve(&key, &policy, 1, Duration::from_secs(5), Duration::ZERO)
            .await
            .unwrap();
        let turn = waiting.turn();
        clock.advance(10 * MS);
        store
            .settle(&key, &policy, Settlement::refund(&waiting, 1).unwrap())
            .await
            .unwrap();
        // Given back whole: the next caller takes the same turn (10 ms later now).
        let next = store
            .reserve(&key, &policy, 1, Duration::from_secs(5), Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(next.turn(), turn - 10 * MS, "{algorithm:?}");
        // And a give-back of more than was reserved frees no more.
        store
            .settle(&key, &policy, Settlement::refund(&next, 5).unwrap())
            .await
            .unwrap();
        let after = store
            .reserve(&key, &policy, 1, Duration::from_secs(5), Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(after.turn(), turn - 10 * MS, "{algorithm:?}");
    }
}

#[tokio::test]
async fn an_override_sets_the_turns() {
    let (store, _) = store();
    let (key, policy) = (Key::from("k"), policy("10/1s", Algorithm::Gcra));
    let cut = Override::Limits(vec!["2/1s".parse().unwrap()]);
    store
        .overrides()
        .set(&policy, &Scope::Key(key.clone()), &cut)
        .await
        .unwrap();
    let got = turns(&store, &key, &policy, 3, Duration::from_secs(5)).await;
    assert_eq!(
        got,
        [Some(Duration::ZERO), Some(Duration::ZERO), Some(500 * MS)]
    );
}

#[tokio::test]
async fn policies_that_cannot_reserve_say_so() {
    let (store, _) = store();
    let key = Key::from("k");
    let boxed = policy("10/1s", Algorithm::Gcra)
        .block_for(Duration::from_secs(1))
        .unwrap();
    let slots = policy("10/1s", Algorithm::SlidingLog)
        .concurrency(2)
        .unwrap();
    for policy in [
        policy("10/1s", Algorithm::FixedWindow),
        policy("10/1s", Algorithm::SlidingWindow),
        boxed,
        slots,
    ] {
        let got = store
            .reserve(&key, &policy, 1, Duration::from_secs(1), Duration::ZERO)
            .await;
        assert!(
            matches!(got, Err(StoreError::Unsupported(_))),
            "{policy:?}: {got:?}"
        );
    }
}

mod common;

/// The same on Redis, two stores sharing it: turns follow reservation order whichever store
/// reserves, and a reservation given back frees its turn. Real time passes between the calls,
/// so turns are compared where they were recorded (Redis time).
#[tokio::test]
async fn turns_follow_reservation_order_across_stores_on_redis() {
    let server = common::RedisServer::start();
    let stores = [server.store().await, server.store().await];
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let key = Key::from(format!("{algorithm:?}"));
        let policy = policy("10/1s", algorithm);
        let mut at = Vec::new();
        for i in 0..12 {
            let store = &stores[i % 2];
            let d = store
                .reserve(&key, &policy, 1, Duration::from_secs(5), Duration::ZERO)
                .await
                .unwrap();
            assert!(d.is_allowed(), "{algorithm:?} {i}: {d:?}");
            let Some(Settlement::Charge(units)) = Settlement::charge(&d, 1) else {
                unreachable!()
            };
            at.push(units.admitted_at().unwrap());
        }
        let first = at[0];
        let after = |i: usize| Duration::from_micros((at[i] - first) as u64);
        assert!(
            after(9) < 100 * MS,
            "{algorithm:?}: the burst took {:?}",
            after(9)
        );
        match algorithm {
            // One unit drains every 100 ms from the first burst on.
            Algorithm::Gcra => {
                assert!(
                    after(10) >= 95 * MS && after(10) <= 200 * MS,
                    "{:?}",
                    after(10)
                );
                assert_eq!(at[11] - at[10], 100_000, "one drain apart");
            }
            // The first units leave the window a second after they were logged.
            _ => {
                assert!(after(10) >= Duration::from_secs(1) - MS, "{:?}", after(10));
                assert!(at[11] >= at[10], "in order");
            }
        }
        // Given back before its turn, the last reservation's turn goes to the next caller.
        let last = stores[1]
            .reserve(&key, &policy, 1, Duration::from_secs(5), Duration::ZERO)
            .await
            .unwrap();
        let refund = Settlement::refund(&last, 1).unwrap();
        stores[1].settle(&key, &policy, refund).await.unwrap();
        let next = stores[0]
            .reserve(&key, &policy, 1, Duration::from_secs(5), Duration::ZERO)
            .await
            .unwrap();
        let turn_of = |d: &tower_redis_ratelimit::Decision| match Settlement::charge(d, 1) {
            Some(Settlement::Charge(units)) => units.admitted_at().unwrap(),
            _ => unreachable!(),
        };
        assert_eq!(
            turn_of(&next),
            turn_of(&last),
            "{algorithm:?}: the turn given back"
        );
    }
}
