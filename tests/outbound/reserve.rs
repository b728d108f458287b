//! Reservations on the memory store, on a manual clock: turns in reservation order, a wait
//! past `max_wait` refused without recording, a reservation given back frees its place, and
//! the policies that cannot reserve say so.

use std::time::{Duration, UNIX_EPOCH};

use tower_redis_ratelimit::store::{ManualClock, Override, Scope};
use tower_redis_ratelimit::test_util::turn;
use tower_redis_ratelimit::test_util::{recorded_at, Reserve, Ticket, MAX_LATE};
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, MemoryStore, Policy, Settlement, Store, StoreError,
};

const MS: Duration = Duration::from_millis(1);

/// A ticket of `cost` with a fresh id, for a reservation that waits up to `max_wait` and uses
/// its units up to `late` after its turn.
fn ticket(cost: u32, max_wait: Duration, late: Duration) -> Ticket {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = 1_000_000_000_000_000 + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ticket {
        cost,
        late,
        ..Ticket::new(id, max_wait)
    }
}

fn store() -> (MemoryStore, ManualClock) {
    let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    (MemoryStore::builder().clock(clock.clone()).build(), clock)
}

fn policy(limit: &str, algorithm: Algorithm) -> Policy {
    Policy::new("api", [limit.parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
}

/// A reservation of 1 that waits up to 5 s.
async fn reserve_one<S: Store>(store: &S, key: &Key, policy: &Policy) -> Decision {
    store
        .reserve(
            key,
            policy,
            ticket(1, Duration::from_secs(5), Duration::ZERO),
        )
        .await
        .unwrap()
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
            .reserve(key, policy, ticket(1, max_wait, Duration::ZERO))
            .await
            .unwrap();
        turns.push(d.is_allowed().then(|| turn(&d)));
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
        .reserve(&key, &policy, ticket(1, 50 * MS, Duration::ZERO))
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
        .reserve(&key, &policy, ticket(1, 100 * MS, Duration::ZERO))
        .await
        .unwrap();
    assert_eq!((next.is_allowed(), turn(&next)), (true, 100 * MS));
    // A cost over the count never gets a turn.
    let never = store
        .reserve(&key, &policy, ticket(11, Duration::MAX, Duration::ZERO))
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
        let waiting = reserve_one(&store, &key, &policy).await;
        let first_turn = turn(&waiting);
        clock.advance(10 * MS);
        store
            .settle(&key, &policy, Settlement::refund(&waiting, 1).unwrap())
            .await
            .unwrap();
        // Given back whole: the next caller takes the same turn (10 ms later now).
        let next = reserve_one(&store, &key, &policy).await;
        assert_eq!(turn(&next), first_turn - 10 * MS, "{algorithm:?}");
        // And a give-back of more than was reserved frees no more.
        store
            .settle(&key, &policy, Settlement::refund(&next, 5).unwrap())
            .await
            .unwrap();
        let after = reserve_one(&store, &key, &policy).await;
        assert_eq!(turn(&after), first_turn - 10 * MS, "{algorithm:?}");
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
            .reserve(
                &key,
                &policy,
                ticket(1, Duration::from_secs(1), Duration::ZERO),
            )
            .await;
        assert!(
            matches!(got, Err(StoreError::Unsupported(_))),
            "{policy:?}: {got:?}"
        );
    }
}

/// A reservation whose units may be used more than an hour late is refused, on both stores,
/// and on GCRA one whose `late` is a whole window (its bucket would have no room); an hour on
/// the log, and `Duration::MAX` waits, are fine.
async fn a_late_past_an_hour_is_refused<S: Store>(store: &S) {
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let policy = policy("3/1s", algorithm);
        let key = Key::from(format!("late-{algorithm:?}"));
        let hour = MAX_LATE;
        let refused = match algorithm {
            // One unit drains in 333 ms: a bucket of 3 keeping more than 667 ms free has no
            // room for one.
            Algorithm::Gcra => vec![Duration::MAX, hour, 700 * MS],
            _ => vec![Duration::MAX, hour + MS],
        };
        for late in refused {
            let got = store
                .reserve(&key, &policy, ticket(1, Duration::MAX, late))
                .await;
            assert!(
                matches!(got, Err(StoreError::Unsupported(_))),
                "{algorithm:?} late {late:?}: {got:?}"
            );
        }
        let fine = match algorithm {
            Algorithm::Gcra => 600 * MS,
            _ => hour,
        };
        let d = store
            .reserve(&key, &policy, ticket(1, Duration::MAX, fine))
            .await;
        assert!(d.unwrap().is_allowed(), "{algorithm:?}");
    }
}

#[tokio::test]
async fn a_late_past_an_hour_is_refused_on_memory() {
    let (store, _) = store();
    a_late_past_an_hour_is_refused(&store).await;
}

#[tokio::test]
async fn a_late_past_an_hour_is_refused_on_redis() {
    let server = crate::support::RedisServer::start();
    a_late_past_an_hour_is_refused(&server.store().await).await;
}

/// GCRA keeps `late` of drain free in every bucket on the memory store as on Redis: units
/// used up to `late` after their turns stay within the bucket. Under `10/1s` with 50 ms late,
/// nine turns at once and the tenth 50 ms on, not ten at once.
#[tokio::test]
async fn gcra_keeps_the_late_margin_on_memory() {
    let (store, _) = store();
    let (key, policy) = (Key::from("k"), policy("10/1s", Algorithm::Gcra));
    let mut got = Vec::new();
    for _ in 0..11 {
        let d = store
            .reserve(&key, &policy, ticket(1, Duration::from_secs(5), 50 * MS))
            .await
            .unwrap();
        got.push(turn(&d));
    }
    assert!(got[..9].iter().all(|t| t.is_zero()), "{got:?}");
    assert_eq!(got[9..], [50 * MS, 150 * MS], "{got:?}");
}

/// The same on Redis, two stores sharing it: turns follow reservation order whichever store
/// reserves, and a reservation given back frees its turn. Real time passes between the calls,
/// so turns are compared where they were recorded (Redis time).
#[tokio::test]
async fn turns_follow_reservation_order_across_stores_on_redis() {
    let server = crate::support::RedisServer::start();
    let stores = [server.store().await, server.store().await];
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let key = Key::from(format!("{algorithm:?}"));
        let policy = policy("10/1s", algorithm);
        let mut at = Vec::new();
        for i in 0..12 {
            let store = &stores[i % 2];
            let d = reserve_one(store, &key, &policy).await;
            assert!(d.is_allowed(), "{algorithm:?} {i}: {d:?}");
            at.push(recorded_at(&d).unwrap());
        }
        let first = at[0];
        let after = |i: usize| at[i].duration_since(first).unwrap();
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
                assert_eq!(
                    at[11].duration_since(at[10]).unwrap(),
                    100 * MS,
                    "one drain apart"
                );
            }
            // The first units leave the window a second after they were logged.
            _ => {
                assert!(after(10) >= Duration::from_secs(1) - MS, "{:?}", after(10));
                assert!(at[11] >= at[10], "in order");
            }
        }
        // Given back before its turn, the last reservation's turn goes to the next caller.
        let last = stores[1]
            .reserve(
                &key,
                &policy,
                ticket(1, Duration::from_secs(5), Duration::ZERO),
            )
            .await
            .unwrap();
        let refund = Settlement::refund(&last, 1).unwrap();
        stores[1].settle(&key, &policy, refund).await.unwrap();
        let next = stores[0]
            .reserve(
                &key,
                &policy,
                ticket(1, Duration::from_secs(5), Duration::ZERO),
            )
            .await
            .unwrap();
        let turn_of = |d: &tower_redis_ratelimit::Decision| recorded_at(d).unwrap();
        assert_eq!(
            turn_of(&next),
            turn_of(&last),
            "{algorithm:?}: the turn given back"
        );
    }
}

/// Four reservations one turn apart (`1/100ms`), and the second leaves the line: the two
/// behind it move up a turn each, in their order, and the place left at the end is given back,
/// so that the next reservation takes it. Turns are read as waits from the store's now; on
/// Redis real time passes between the calls, within `slack`.
async fn leaving_moves_those_behind_up<S: Store>(store: &S, key: &Key, slack: Duration) {
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let key = Key::from(format!("{}-{algorithm:?}", key));
        let policy = policy("1/100ms", algorithm);
        let tickets: Vec<Ticket> = (0..4)
            .map(|_| ticket(1, Duration::from_secs(5), Duration::ZERO))
            .collect();
        for (i, &t) in tickets.iter().enumerate() {
            let d = store.reserve(&key, &policy, t).await.unwrap();
            let expected = 100 * MS * i as u32;
            assert!(
                turn(&d) + slack >= expected && turn(&d) <= expected + MS,
                "{algorithm:?} {i}: {:?}",
                turn(&d)
            );
        }
        let left = store.leave(&key, &policy, tickets[1]).await.unwrap();
        assert!(left.turn.is_some(), "{algorithm:?}: it was in line");
        for (i, expected) in [(2, 100 * MS), (3, 200 * MS)] {
            let stood = store.look(&key, &policy, tickets[i]).await.unwrap();
            let turn = stood.turn.unwrap();
            assert!(
                turn + slack >= expected && turn <= expected,
                "{algorithm:?}: reservation {i} stands at {turn:?}"
            );
        }
        let gone = store.look(&key, &policy, tickets[1]).await.unwrap();
        assert_eq!(gone.turn, None, "{algorithm:?}");
        // Leaving twice frees nothing more.
        let again = store.leave(&key, &policy, tickets[1]).await.unwrap();
        assert_eq!(again.turn, None, "{algorithm:?}");
        let next = reserve_one(store, &key, &policy).await;
        assert!(
            turn(&next) + slack >= 300 * MS && turn(&next) <= 300 * MS,
            "{algorithm:?}: the place given back goes to the next, at {:?}",
            turn(&next)
        );
    }
}

/// A pause: reservations made during it take turns after it, and one in line before it
/// learns it when it looks.
async fn a_pause_holds_back_new_turns<S: Store>(store: &S, key: &Key, slack: Duration) {
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let key = Key::from(format!("{}-{algorithm:?}", key));
        let policy = policy("10/1s", algorithm);
        let first = ticket(1, Duration::from_secs(5), Duration::ZERO);
        let d = store.reserve(&key, &policy, first).await.unwrap();
        assert_eq!(turn(&d), Duration::ZERO);
        let paused = store
            .pause(&key, &policy, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(paused.turn, None);
        assert!(paused.paused + slack >= Duration::from_secs(2));
        let stood = store.look(&key, &policy, first).await.unwrap();
        assert!(
            stood.turn.unwrap() < stood.paused,
            "{algorithm:?}: {stood:?}"
        );
        let after = reserve_one(store, &key, &policy).await;
        assert!(
            turn(&after) + slack >= Duration::from_secs(2),
            "{algorithm:?}: a turn in the pause, {:?}",
            turn(&after)
        );
        // A pause past the most a reservation waits refuses it, recording nothing.
        let short = store
            .reserve(
                &key,
                &policy,
                ticket(1, Duration::from_secs(1), Duration::ZERO),
            )
            .await
            .unwrap();
        assert!(!short.is_allowed(), "{algorithm:?}: {short:?}");
        // A shorter pause leaves the longer one.
        let kept = store.pause(&key, &policy, MS).await.unwrap();
        assert!(kept.paused + slack >= Duration::from_secs(2) - 10 * MS);
    }
}

#[tokio::test]
async fn leaving_the_line_moves_those_behind_up_on_memory() {
    let (store, _) = store();
    leaving_moves_those_behind_up(&store, &Key::from("k"), Duration::ZERO).await;
}

#[tokio::test]
async fn leaving_the_line_moves_those_behind_up_on_redis() {
    let server = crate::support::RedisServer::start();
    let store = server.store().await;
    leaving_moves_those_behind_up(&store, &Key::from("k"), 30 * MS).await;
}

#[tokio::test]
async fn a_pause_holds_back_new_turns_on_memory() {
    let (store, _) = store();
    a_pause_holds_back_new_turns(&store, &Key::from("k"), Duration::ZERO).await;
}

#[tokio::test]
async fn a_pause_holds_back_new_turns_on_redis() {
    let server = crate::support::RedisServer::start();
    let store = server.store().await;
    a_pause_holds_back_new_turns(&store, &Key::from("k"), 30 * MS).await;
}
