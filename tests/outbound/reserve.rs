//! Reservations on the memory store, on a manual clock: turns in reservation order, a wait
//! past `max_wait` refused without recording, a reservation given back frees its place, and
//! the policies that cannot reserve say so.

use std::time::{Duration, UNIX_EPOCH};

use tower_redis_ratelimit::store::{ManualClock, Override, Scope};
use tower_redis_ratelimit::test_util::turn;
use tower_redis_ratelimit::test_util::{recorded_at, redis_key, Reserve, Ticket, MAX_ID, MAX_LATE};
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, MemoryStore, Policy, RedisStore, Settlement, Store, StoreError,
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

/// A ticket of one unit with the layer's settings (`late` 50 ms, `notice` 150 ms: a look every
/// 100 ms), that waits up to `max_wait`.
fn layer_ticket(max_wait: Duration) -> Ticket {
    Ticket {
        notice: 150 * MS,
        ..ticket(1, max_wait, 50 * MS)
    }
}

/// Every command the server behind `client` has run, by name (`INFO commandstats`).
async fn commands(client: &fred::clients::Client) -> std::collections::BTreeMap<String, u64> {
    use fred::prelude::*;
    let info: String = client
        .info(Some(fred::types::InfoKind::CommandStats))
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(":calls=")?;
            Some((name.to_owned(), rest.split(',').next()?.parse().ok()?))
        })
        .collect()
}

/// What ran between two `INFO commandstats`, by name.
fn ran(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    after
        .iter()
        .map(|(name, &n)| (name.clone(), n - before.get(name).copied().unwrap_or(0)))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// A cancellation storm: 1 000 reservations at `50/1s` (turns over 20 s), then every one
/// leaves, from the front. Each leave moves everyone behind up one place, yet costs Redis a
/// constant number of commands: at most 2 `EVALSHA` (the line's, and the give-back's), at
/// most one `ZADD` and 25 commands in all per cancellation. The places are given back: a
/// reservation after the storm has its turn at once (on GCRA after the few left within the
/// notice of now), and the line holds it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_storm_costs_a_constant_number_of_commands_per_cancellation() {
    const CALLS: usize = 1000;
    let server = crate::support::RedisServer::start();
    let store = server.store().await;
    let client = server.client().await;
    for algorithm in [Algorithm::SlidingLog, Algorithm::Gcra] {
        let key = Key::from(format!("storm-{algorithm:?}"));
        let policy = policy("50/1s", algorithm);
        let tickets: Vec<Ticket> = (0..CALLS)
            .map(|_| layer_ticket(Duration::from_secs(60)))
            .collect();
        for &t in &tickets {
            let d = store.reserve(&key, &policy, t).await.unwrap();
            assert!(d.is_allowed(), "{algorithm:?}: {d:?}");
        }
        let before = commands(&client).await;
        let started = std::time::Instant::now();
        for &t in &tickets {
            let left = store.leave(&key, &policy, t).await.unwrap();
            assert!(left.turn.is_some(), "{algorithm:?}: it was in line");
        }
        let took = started.elapsed();
        let ran = ran(&before, &commands(&client).await);
        let per = |name: &str| ran.get(name).copied().unwrap_or(0) as f64 / CALLS as f64;
        let all = ran
            .iter()
            .filter(|(n, _)| *n != "info")
            .map(|(_, &n)| n)
            .sum::<u64>();
        let all = all as f64 / CALLS as f64;
        eprintln!(
            "{algorithm:?}: {CALLS} cancellations in {took:?}; per cancellation {:.2} EVALSHA, \
             {:.2} ZADD, {all:.2} commands in all; {ran:?}",
            per("evalsha"),
            per("zadd"),
        );
        // The first leave loads the line's script: one more `EVALSHA` in all.
        assert!(per("evalsha") <= 2.01, "{algorithm:?}: {ran:?}");
        assert!(per("zadd") <= 1.0, "{algorithm:?}: {ran:?}");
        assert!(
            all <= 25.0,
            "{algorithm:?}: {all:.2} commands per cancellation"
        );
        // The places were given back: on the log each leave's, on GCRA the last one each
        // time (those behind moved up into the others), but for the first few, left within
        // the notice (150 ms) of now with others behind them, which stay recorded on GCRA.
        let next = store
            .reserve(&key, &policy, layer_ticket(Duration::from_secs(60)))
            .await
            .unwrap();
        let most = match algorithm {
            Algorithm::Gcra => 250 * MS,
            _ => 100 * MS,
        };
        assert!(turn(&next) < most, "{algorithm:?}: {:?}", turn(&next));
        let line = format!("{}:line", redis_key(&store, &key, &policy));
        let places = format!("{}:places", redis_key(&store, &key, &policy));
        for (set, left) in [(&line, "1"), (&places, "1")] {
            let held = crate::support::cluster::cli(server.port(), &["ZCARD", set]);
            assert_eq!(held.trim(), left, "{algorithm:?}: {set}");
        }
    }
}

/// A look at 200 reservations of a key is one `EVALSHA`, answers each where it stands (in
/// order: the turns one drain apart), and takes none out.
#[tokio::test]
async fn a_look_at_many_reservations_is_one_call_on_redis() {
    let server = crate::support::RedisServer::start();
    let store = server.store().await;
    let client = server.client().await;
    let key = Key::from("many");
    let policy = policy("10/1s", Algorithm::Gcra);
    let tickets: Vec<Ticket> = (0..300)
        .map(|_| ticket(1, Duration::from_secs(60), Duration::ZERO))
        .collect();
    for &t in &tickets {
        assert!(store.reserve(&key, &policy, t).await.unwrap().is_allowed());
    }
    let looked: Vec<Ticket> = tickets[100..].to_vec();
    // Loads the line's script, which a first call would load on its way.
    store.look(&key, &policy, tickets[0]).await.unwrap();
    let before = crate::support::evalsha_calls(&client).await;
    let stood = store
        .look_many(&key, &policy, looked.clone())
        .await
        .unwrap();
    let calls = crate::support::evalsha_calls(&client).await - before;
    assert_eq!(calls, 1, "one call for {} tickets", looked.len());
    assert_eq!(stood.len(), 200);
    // Where each stands from Redis's now (µs; below zero: past its turn).
    let at = |s: &tower_redis_ratelimit::test_util::InLine| {
        s.turn.unwrap().as_micros() as i64 - s.past.as_micros() as i64
    };
    for pair in stood.windows(2) {
        assert_eq!(
            at(&pair[1]) - at(&pair[0]),
            100_000,
            "one drain apart: {pair:?}"
        );
    }
    // Nothing was taken out: each stands where it stood.
    let again = store.look_many(&key, &policy, looked).await.unwrap();
    assert!(again.iter().all(|s| s.turn.is_some()));
    // A reservation not in line is answered as such, in its place.
    let stranger = layer_ticket(Duration::from_secs(1));
    let mixed = store
        .look_many(&key, &policy, vec![tickets[299], stranger])
        .await
        .unwrap();
    assert!(
        mixed[0].turn.is_some() && mixed[1].turn.is_none(),
        "{mixed:?}"
    );
}

/// A look takes a reservation out, used, once its turn is at most its `late` ahead: its caller
/// sleeps the rest and goes. Before, it stays; past its turn, the look says how far past.
/// A look at many takes nothing out, on the memory store as on Redis.
#[tokio::test]
async fn a_look_takes_a_reservation_out_once_its_turn_is_within_its_late() {
    let (store, clock) = store();
    let key = Key::from("k");
    // The log reads its window 30 ms longer: turns 130 ms apart.
    let policy = policy("1/100ms", Algorithm::SlidingLog);
    let tickets: Vec<Ticket> = (0..3)
        .map(|_| ticket(1, Duration::from_secs(5), 30 * MS))
        .collect();
    let mut turns = Vec::new();
    for &t in &tickets {
        turns.push(turn(&store.reserve(&key, &policy, t).await.unwrap()));
    }
    assert_eq!(turns, [Duration::ZERO, 130 * MS, 260 * MS]);
    // 130 ms ahead, more than its late of 30 ms: it stays.
    let stood = store.look(&key, &policy, tickets[1]).await.unwrap();
    assert_eq!((stood.turn, stood.past), (Some(130 * MS), Duration::ZERO));
    clock.advance(90 * MS);
    // A look at many takes nothing out, not even the first, whose turn has come.
    let many = store
        .look_many(&key, &policy, tickets.to_vec())
        .await
        .unwrap();
    let stand: Vec<_> = many.iter().map(|s| (s.turn, s.past)).collect();
    let zero = Duration::ZERO;
    let expected = [
        (Some(zero), 90 * MS),
        (Some(40 * MS), zero),
        (Some(170 * MS), zero),
    ];
    assert_eq!(stand, expected, "{many:?}");
    // 40 ms ahead: it stays; 30 ms ahead: taken out, used.
    let stood = store.look(&key, &policy, tickets[1]).await.unwrap();
    assert_eq!(stood.turn, Some(40 * MS));
    clock.advance(10 * MS);
    let stood = store.look(&key, &policy, tickets[1]).await.unwrap();
    assert_eq!(stood.turn, Some(30 * MS));
    let gone = store.look(&key, &policy, tickets[1]).await.unwrap();
    assert_eq!(gone.turn, None, "taken out, used");
    // Its place was used: the one behind keeps its own turn, and a leave of the one taken
    // out moves nobody.
    assert_eq!(
        store.leave(&key, &policy, tickets[1]).await.unwrap().turn,
        None
    );
    let behind = store.look(&key, &policy, tickets[2]).await.unwrap();
    assert_eq!(behind.turn, Some(160 * MS));
    // Looked at 20 ms past its turn: it goes, and the look says how far past.
    clock.advance(180 * MS);
    let past = store.look(&key, &policy, tickets[2]).await.unwrap();
    assert_eq!((past.turn, past.past), (Some(zero), 20 * MS));
    assert_eq!(
        store.look(&key, &policy, tickets[2]).await.unwrap().turn,
        None
    );
}

/// Tickets the stores cannot keep are refused with a clear error, on both stores: an id at
/// or above 2^52 (Redis's numbers are exact below 2^53; `u64::MAX` was once stored as a
/// negative member that no leave found), and a cost of 0. An id just below is kept and
/// leaves. A cost above a count is refused with no turn (no wait helps).
async fn tickets_out_of_range_are_refused<S: Store>(store: &S) {
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let key = Key::from(format!("range-{algorithm:?}"));
        let policy = policy("10/1s", algorithm);
        let wait = Duration::from_secs(5);
        for id in [u64::MAX, MAX_ID] {
            let far = Ticket::new(id, wait);
            let got = store.reserve(&key, &policy, far).await;
            assert!(
                matches!(&got, Err(StoreError::Unsupported(m)) if m.contains("2^52")),
                "{algorithm:?} id {id}: {got:?}"
            );
            let left = store.leave(&key, &policy, far).await;
            assert!(left.is_err(), "{algorithm:?} id {id}: {left:?}");
        }
        let nothing = Ticket {
            cost: 0,
            ..Ticket::new(7, wait)
        };
        let got = store.reserve(&key, &policy, nothing).await;
        assert!(
            matches!(&got, Err(StoreError::Unsupported(m)) if m.contains("at least one unit")),
            "{algorithm:?}: {got:?}"
        );
        let highest = Ticket::new(MAX_ID - 1, wait);
        assert!(store
            .reserve(&key, &policy, highest)
            .await
            .unwrap()
            .is_allowed());
        let left = store.leave(&key, &policy, highest).await.unwrap();
        assert!(left.turn.is_some(), "{algorithm:?}: the highest id leaves");
        let over = store
            .reserve(&key, &policy, ticket(11, wait, Duration::ZERO))
            .await
            .unwrap();
        assert!(
            !over.is_allowed() && over.retry_after().is_none(),
            "{algorithm:?}: a cost of 11 under 10/1s must be refused with no turn: {over:?}"
        );
    }
}

#[tokio::test]
async fn tickets_out_of_range_are_refused_on_memory() {
    tickets_out_of_range_are_refused(&store().0).await;
}

#[tokio::test]
async fn tickets_out_of_range_are_refused_on_redis() {
    let server = crate::support::RedisServer::start();
    tickets_out_of_range_are_refused(&server.store().await).await;
}

/// A store whose time budget is past the longest it reads a reply (10 s) reserves.
#[tokio::test]
async fn a_store_with_a_budget_past_ten_seconds_reserves() {
    let server = crate::support::RedisServer::start();
    let store = tower_redis_ratelimit::RedisStore::builder(server.url())
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap();
    let policy = policy("10/1s", Algorithm::SlidingLog);
    let reserved = store.reserve(
        &Key::from("k"),
        &policy,
        layer_ticket(Duration::from_secs(5)),
    );
    assert!(reserved.await.unwrap().is_allowed());
}

/// A reservation waits for Redis past the decisions' time budget (250 ms), up to its own
/// `max_wait`: with Redis busy for 600 ms (`DEBUG SLEEP` on another connection) it gets its
/// turn, where a decision fails. A Redis that is gone still fails it, with the store's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_waits_out_a_busy_redis_but_not_a_dead_one() {
    let mut server = crate::support::RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = server.store().await;
    let key = Key::from("busy");
    let policy = policy("10/1s", Algorithm::SlidingLog);
    let port = server.port();
    let stall = std::thread::spawn(move || {
        crate::support::cluster::cli(port, &["DEBUG", "SLEEP", "0.6"]);
    });
    tokio::time::sleep(50 * MS).await;
    let started = std::time::Instant::now();
    let (reserved, decided) = tokio::join!(
        store.reserve(&key, &policy, layer_ticket(Duration::from_secs(5))),
        store.check(&Key::from("other"), &policy, 1),
    );
    let took = started.elapsed();
    stall.join().unwrap();
    eprintln!("reserved {reserved:?} after {took:?}; a decision meanwhile: {decided:?}");
    let reserved = reserved.unwrap();
    assert!(reserved.is_allowed(), "{reserved:?}");
    assert!(
        took >= 400 * MS,
        "answered after {took:?}: Redis was asleep"
    );
    assert!(decided.is_err(), "a decision keeps its 250 ms: {decided:?}");
    // The breaker the decision tripped lets the next reservation try again soon; Redis gone,
    // it fails with the store's error rather than waiting for ever.
    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = std::time::Instant::now();
    let gone = store
        .reserve(&key, &policy, layer_ticket(Duration::from_secs(5)))
        .await;
    eprintln!("with Redis gone: {gone:?} after {:?}", started.elapsed());
    assert!(gone.is_err(), "{gone:?}");
    assert!(started.elapsed() <= Duration::from_secs(6));
}

/// A forwarder on a free loopback port to `127.0.0.1:<target>` that holds what the client
/// sends for `delay` before passing it on (a Redis that far away, one way), in order; the
/// replies come back at once. Stops with the test's runtime.
async fn delayed(target: u16, delay: Duration) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(("127.0.0.1", target)).await;
            let Ok(server) = server else { continue };
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            let (held, mut due) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(async move {
                let mut chunk = vec![0; 64 * 1024];
                while let Ok(n @ 1..) = client_read.read(&mut chunk).await {
                    let at = tokio::time::Instant::now() + delay;
                    if held.send((at, chunk[..n].to_vec())).is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                while let Some((at, bytes)) = due.recv().await {
                    tokio::time::sleep_until(at).await;
                    if server_write.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
            });
        }
    });
    port
}

/// Load: 20 000 reservations over 10 000 keys sent within 3 s by one store, to a Redis 25 ms
/// away (`1/1s` each key: every turn within a second). A call of decisions carries at most 32,
/// two at a time, so a reservation in those batches would wait for hundreds of calls; each is
/// answered with its turn instead, none failing with the decisions' 250 ms budget ("no
/// decision within 250ms") or with "store unavailable" (the breaker such timeouts trip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_under_load_wait_rather_than_fail() {
    const KEYS: usize = 10_000;
    const CALLS: usize = 20_000;
    let server = crate::support::RedisServer::start();
    let port = delayed(server.port(), 25 * MS).await;
    let url = format!("redis://127.0.0.1:{port}");
    let store = std::sync::Arc::new(RedisStore::connect(&url).await.unwrap());
    let policy = policy("1/1s", Algorithm::SlidingLog);
    let started = std::time::Instant::now();
    let mut calls = Vec::with_capacity(CALLS);
    for i in 0..CALLS {
        let (store, policy) = (store.clone(), policy.clone());
        let key = Key::from(format!("load-{}", i % KEYS));
        calls.push(tokio::spawn(async move {
            let ticket = layer_ticket(Duration::from_secs(30));
            store.reserve(&key, &policy, ticket).await
        }));
        if i % 1000 == 999 {
            // Spread over about 2 s.
            tokio::time::sleep(100 * MS).await;
        }
    }
    let sent = started.elapsed();
    let mut failed = std::collections::BTreeMap::<String, usize>::new();
    let mut refused = 0;
    for call in calls {
        match call.await.unwrap() {
            Ok(d) if d.is_allowed() => {}
            Ok(_) => refused += 1,
            Err(error) => *failed.entry(error.to_string()).or_default() += 1,
        }
    }
    eprintln!(
        "{CALLS} reservations over {KEYS} keys sent within {sent:?}, answered within {:?}: \
         {refused} refused, failed: {failed:?}",
        started.elapsed()
    );
    assert!(sent <= Duration::from_secs(3), "sent within {sent:?}");
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(refused, 0);
}

/// The line's keys on Redis expire 10 s after its last turn, all four together; the longest
/// late (`:late`) its `max_wait` plus the window plus itself after the last reservation; a reset
/// of the key deletes them, and the reservations it held leave nothing.
#[tokio::test]
async fn the_line_keys_expire_after_the_last_turn_and_a_reset_takes_them() {
    let server = crate::support::RedisServer::start();
    let store = server.store().await;
    let key = Key::from("kept");
    let policy = policy("1/1s", Algorithm::SlidingLog);
    let tickets: Vec<Ticket> = (0..3)
        .map(|_| layer_ticket(Duration::from_secs(5)))
        .collect();
    for &t in &tickets {
        assert!(store.reserve(&key, &policy, t).await.unwrap().is_allowed());
    }
    let state = redis_key(&store, &key, &policy);
    let names = ["line", "places", "notices", "costs"].map(|n| format!("{state}:{n}"));
    for name in &names {
        let ttl: i64 = crate::support::cluster::cli(server.port(), &["PTTL", name])
            .trim()
            .parse()
            .unwrap();
        // The last turn is 2 s away.
        assert!((11_000..=12_100).contains(&ttl), "{name}: {ttl} ms");
    }
    let late = format!("{state}:late");
    let cli = |args: &[&str]| crate::support::cluster::cli(server.port(), args);
    assert_eq!(cli(&["GET", &late]).trim(), "50000");
    let ttl: i64 = cli(&["PTTL", &late]).trim().parse().unwrap();
    // 5 s of wait, the 1 s window and the 50 ms late.
    assert!((5_900..=6_050).contains(&ttl), "{late}: {ttl} ms");
    store.reset(&key, &policy).await.unwrap();
    for name in names.iter().chain([&late]) {
        let there = crate::support::cluster::cli(server.port(), &["EXISTS", name]);
        assert_eq!(there.trim(), "0", "{name} after the reset");
    }
    let stood = store
        .look_many(&key, &policy, tickets.clone())
        .await
        .unwrap();
    assert!(stood.iter().all(|s| s.turn.is_none()), "{stood:?}");
    let left = store.leave(&key, &policy, tickets[0]).await.unwrap();
    assert_eq!(left.turn, None);
}
