//! The sliding log's trims, made once every request of a call is decided: the decisions of a
//! call that still sees members older than twice the longest window (trimmed at its end) are
//! those of a log without them, and the log it leaves is sound (every member's total less its
//! weight is the total of the member before it).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::log::{members, unsound};
use crate::support::time::redis_now;
use crate::support::RedisServer;
use fred::prelude::*;
use tower_redis_ratelimit::store::{Clock, ManualClock};
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, MemoryStore, Policy, RedisStore, Settlement, Store,
};

const MAX_UNITS: u64 = 1 << 52;
const COUNT: u64 = 1 << 50;

/// One limit of the largest count, a 2 s window: four charges take the log's totals to the
/// edge of `MAX_UNITS`, where the next event makes the script rebase them.
fn log_policy() -> Policy {
    format!("{COUNT}/2s")
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

/// Where a scenario is in time: the memory store's virtual clock, or Redis's own (`TIME`),
/// both counted from a start.
enum Timeline {
    Manual(ManualClock, Duration),
    Redis(Client, i64),
}

impl Timeline {
    /// Waits (or moves the clock) until `ms` after the start.
    async fn reach(&self, ms: u64) {
        match self {
            Timeline::Manual(clock, start) => {
                let target = *start + Duration::from_millis(ms);
                clock.advance(target.saturating_sub(clock.now()));
            }
            Timeline::Redis(client, start) => loop {
                let left = start + ms as i64 * 1000 - redis_now(client).await;
                if left <= 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_micros(left as u64)).await;
            },
        }
    }

    /// The time `ms` after the start.
    fn at(&self, ms: u64) -> SystemTime {
        let start = match self {
            Timeline::Manual(_, start) => *start,
            Timeline::Redis(_, start) => Duration::from_micros(*start as u64),
        };
        UNIX_EPOCH + start + Duration::from_millis(ms)
    }
}

/// What the scenario saw: the decision of the event that rebases, the remaining units after
/// the event at now, and the decision after a charge of the whole count.
#[derive(Debug, PartialEq)]
struct Seen {
    rebased: bool,
    remaining: u64,
    after_charge: bool,
    after_charge_remaining: u64,
}

async fn check<St: Store>(store: &St, key: &Key, policy: &Policy, cost: u32) -> Decision {
    store.check(key, policy, cost).await.unwrap()
}

async fn charge<St: Store>(store: &St, key: &Key, policy: &Policy, d: &Decision, units: u64) {
    let settlement = Settlement::charge(d, units).unwrap();
    store.settle(key, policy, settlement).await.unwrap();
}

/// How the event before a later member comes about, in the call that rebases the totals.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// At 3.2 s an event of 1 at now; at 4.3 s an event of 2 at the past event time 2.8 s.
    PastEvent,
    /// At 0 a booking of 1 at 4.6 s (an event time ahead); at 4.3 s an event of 2 at now.
    BookingAhead,
}

/// At 0: an event of 1 and charges to a total of `MAX_UNITS - 2` with the event of 3.2 s or
/// 4.6 s (`Shape`). At 4.3 s, when the members of 0 are older than twice the window (trimmed
/// at the call's end), an event of 2 before that one, which finds no member in its window and
/// makes the script rebase the totals. Then, at 4.7 s, an event of 1 at now: its window holds
/// 4 units; then a charge of 2^50 + 1 (the largest count and one): 1 more is refused.
/// `total` reads the log's total units after the charges at 0.
async fn scenario<St: Store>(
    store: &St,
    time: &Timeline,
    key: &Key,
    shape: Shape,
    total: impl AsyncFn() -> u64,
) -> Seen {
    let policy = log_policy();
    time.reach(0).await;
    let d = check(store, key, &policy, 1).await;
    assert!(d.is_allowed());
    for _ in 0..3 {
        charge(store, key, &policy, &d, u64::MAX).await;
    }
    let held = total().await;
    charge(store, key, &policy, &d, MAX_UNITS - 2 - held).await;
    assert_eq!(total().await, MAX_UNITS - 2);
    let rebased = match shape {
        Shape::PastEvent => {
            time.reach(3200).await;
            assert!(check(store, key, &policy, 1).await.is_allowed());
            time.reach(4300).await;
            store
                .check_at(key, &policy, 2, time.at(2800))
                .await
                .unwrap()
        }
        Shape::BookingAhead => {
            let booked = store
                .check_at(key, &policy, 1, time.at(4600))
                .await
                .unwrap();
            assert!(booked.is_allowed(), "{booked:?}");
            time.reach(4300).await;
            check(store, key, &policy, 2).await
        }
    };
    time.reach(4700).await;
    let now = check(store, key, &policy, 1).await;
    assert!(now.is_allowed(), "{now:?}");
    charge(store, key, &policy, &now, u64::MAX).await;
    let after = check(store, key, &policy, 1).await;
    Seen {
        rebased: rebased.is_allowed(),
        remaining: now.remaining(),
        after_charge: after.is_allowed(),
        after_charge_remaining: after.remaining(),
    }
}

/// What the definition says: 2 + 1 + 1 units in the window after the event of 4.7 s; after a
/// charge of 2^50 + 1 (the largest count and one), nothing more fits.
const EXPECTED: Seen = Seen {
    rebased: true,
    remaining: COUNT - 4,
    after_charge: false,
    after_charge_remaining: 0,
};

#[tokio::test]
async fn a_rebase_beside_members_due_for_trimming_keeps_counts_on_memory() {
    for shape in [Shape::PastEvent, Shape::BookingAhead] {
        let start = Duration::from_secs(1_700_000_000);
        let clock = ManualClock::from(UNIX_EPOCH + start);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let time = Timeline::Manual(clock, start);
        let key = Key::from("rebase");
        // The memory store's totals are not visible: the charges at 0 are those Redis needs
        // (three of 2^50 + 1 after an event of 1, then the rest to MAX_UNITS - 2).
        let reads = std::cell::Cell::new(0);
        let total = async || {
            reads.set(reads.get() + 1);
            if reads.get() == 1 {
                3 * (COUNT + 1) + 1
            } else {
                MAX_UNITS - 2
            }
        };
        let seen = scenario(&store, &time, &key, shape, total).await;
        eprintln!("memory store, {shape:?}: {seen:?}");
        assert_eq!(seen, EXPECTED, "{shape:?}");
    }
}

/// The scenario of `shape` on `store`; what it saw, the log after, and its unsound members.
async fn on_redis(
    store: &RedisStore,
    server: &RedisServer,
    name: &str,
    shape: Shape,
) -> (Seen, Vec<(i64, u64, u64)>, Vec<String>) {
    let client = server.client().await;
    let key = Key::from(format!("{name}-{shape:?}"));
    let rkey = redis_key(store, &key, &log_policy());
    let time = Timeline::Redis(client.clone(), redis_now(&client).await);
    let total = async || members(&client, &rkey).await.last().map_or(0, |m| m.1);
    let seen = scenario(store, &time, &key, shape, total).await;
    let log = members(&client, &rkey).await;
    let bad = unsound(&log);
    eprintln!(
        "{name}, {shape:?}: {seen:?}\n  log (us, total, weight): {log:?}\n  unsound: {bad:?}"
    );
    (seen, log, bad)
}

/// Both shapes at once on `store`: as the definition says, on a sound log.
async fn both_shapes(store: &RedisStore, server: &RedisServer, name: &str) {
    let (past, ahead) = tokio::join!(
        on_redis(store, server, name, Shape::PastEvent),
        on_redis(store, server, name, Shape::BookingAhead),
    );
    for (shape, (seen, log, bad)) in [(Shape::PastEvent, past), (Shape::BookingAhead, ahead)] {
        assert_eq!(
            seen, EXPECTED,
            "{name}, {shape:?}: log {log:?}, unsound {bad:?}"
        );
        assert!(bad.is_empty(), "{name}, {shape:?}: {bad:?}");
    }
}

/// The full script: the event of 2 finds no member in its window, reads the total before it
/// with the members of 0 still there, and must not take theirs (not rebased) for its own
/// (`sliding_log.lua`, `total_through` bounded by the cutoff; unbounded, the window read
/// negative units and admitted past the count).
#[tokio::test]
async fn a_rebase_beside_members_due_for_trimming_keeps_counts_on_redis() {
    let server = RedisServer::start();
    let store = server.full_scripts_store().await;
    both_shapes(&store, &server, "full").await;
}

/// The same on a store with the plain tier (event times and settlements go to the full
/// script).
#[tokio::test]
async fn a_rebase_beside_members_due_for_trimming_keeps_counts_on_redis_with_plain_tier() {
    let server = RedisServer::start();
    let store = server.store().await;
    both_shapes(&store, &server, "plain").await;
}

/// `10/4s`: a window of 4 s, whose key expires twice that after its newest event rounded up to
/// 500 ms (an eighth of the window).
fn small_policy() -> Policy {
    "10/4s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

/// The 1-unit requests at now admitted until one is refused (at most 40).
async fn admitted_until_refused<St: Store>(store: &St, key: &Key, policy: &Policy) -> usize {
    let mut admitted = 0;
    while admitted < 40 && check(store, key, policy, 1).await.is_allowed() {
        admitted += 1;
    }
    admitted
}

/// A key whose every member is older than twice the window (8 s) but which has not expired
/// yet (its expiry is rounded up), written by two requests of one call: A at an event time
/// 1 s back, then B 3 s back, before A's event. A decides as on an empty set; B finds no
/// member in its window and reads the total before its event while the old members (an event
/// of 1 and a charge of 11, total 12) are still there. Then (4.5 s, 8.5 s] holds 2 units, and
/// 8 more requests of 1 are admitted.
#[tokio::test]
async fn two_events_in_one_call_on_a_log_due_for_trimming_count_alike_on_memory() {
    let start = Duration::from_secs(1_700_000_000) + Duration::from_millis(10);
    let clock = ManualClock::from(UNIX_EPOCH + start);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let time = Timeline::Manual(clock, start);
    let (key, policy) = (Key::from("old"), small_policy());
    let d = check(&store, &key, &policy, 1).await;
    charge(&store, &key, &policy, &d, u64::MAX).await;
    time.reach(8200).await;
    let a = store
        .check_at(&key, &policy, 1, time.at(7200))
        .await
        .unwrap();
    let b = store
        .check_at(&key, &policy, 1, time.at(5200))
        .await
        .unwrap();
    assert!(a.is_allowed() && b.is_allowed(), "{a:?} {b:?}");
    time.reach(8500).await;
    let admitted = admitted_until_refused(&store, &key, &policy).await;
    eprintln!("memory store: {admitted} admitted after the call");
    assert_eq!(admitted, 8);
}

#[tokio::test]
async fn two_events_in_one_call_on_a_log_due_for_trimming_count_alike_on_redis() {
    let server = RedisServer::start();
    let client = server.client().await;
    // One call under way at a time: requests that arrive meanwhile leave together, in order.
    let store = RedisStore::builder(server.url())
        .max_in_flight(1)
        .connect()
        .await
        .unwrap();
    let (key, policy) = (Key::from("old"), small_policy());
    let rkey = redis_key(&store, &key, &policy);
    // 10 ms after a multiple of 500 ms of Redis time: the key, whose newest member is then,
    // expires 8.49 s later, and the call at 8.2 s finds it with every member older than 8 s.
    let now = redis_now(&client).await;
    let start = now - now % 500_000 + 510_000;
    let time = Timeline::Redis(client.clone(), start);
    time.reach(0).await;
    let d = check(&store, &key, &policy, 1).await;
    charge(&store, &key, &policy, &d, u64::MAX).await;
    let old = members(&client, &rkey).await;
    time.reach(8200).await;
    let calls = crate::support::evalsha_calls(&client).await;
    let other = Key::from("other");
    let (_, a, b) = tokio::join!(
        check(&store, &other, &policy, 1),
        store.check_at(&key, &policy, 1, time.at(7200)),
        store.check_at(&key, &policy, 1, time.at(5200)),
    );
    let calls = crate::support::evalsha_calls(&client).await - calls;
    let (a, b) = (a.unwrap(), b.unwrap());
    let log = members(&client, &rkey).await;
    let bad = unsound(&log);
    time.reach(8500).await;
    let admitted = admitted_until_refused(&store, &key, &policy).await;
    eprintln!(
        "redis: members before {old:?}; {calls} script calls for the three requests; A {} B {}; \
         log after (us, total, weight) {log:?}, unsound {bad:?}; {admitted} admitted after",
        a.is_allowed(),
        b.is_allowed()
    );
    assert!(a.is_allowed() && b.is_allowed(), "{a:?} {b:?}");
    assert_eq!(admitted, 8, "log after the call {log:?}, unsound {bad:?}");
    assert!(bad.is_empty(), "{bad:?}");
}

/// The trims a reservation's call makes, one per decision as before they moved to the call's
/// end: twelve reservations of 1 on `2/1s`, each waiting for the one before it (its call looks
/// at the newest event's time, then at the retry, then logs there), on the full script.
#[tokio::test]
async fn a_reservation_trims_once_per_decision() {
    use tower_redis_ratelimit::test_util::{Reserve, Ticket};
    let server = RedisServer::start();
    let client = server.client().await;
    let store = server.full_scripts_store().await;
    let (key, policy) = (
        Key::from("reserved"),
        "2/1s"
            .parse::<Policy>()
            .unwrap()
            .with_algorithm(Algorithm::SlidingLog),
    );
    let mut per_call = Vec::new();
    for id in 1..=12u64 {
        let before = crate::support::command_calls(&client, "zremrangebyscore").await;
        let calls = crate::support::evalsha_calls(&client).await;
        let ticket = Ticket {
            cost: 1,
            ..Ticket::new(id, Duration::from_secs(10))
        };
        let d = store.reserve(&key, &policy, ticket).await.unwrap();
        assert!(d.is_allowed(), "{d:?}");
        let trims = crate::support::command_calls(&client, "zremrangebyscore").await - before;
        assert_eq!(crate::support::evalsha_calls(&client).await - calls, 1);
        per_call.push(trims);
    }
    eprintln!("ZREMRANGEBYSCORE per reservation call: {per_call:?}");
    // The first two fit at once (a look, then the admission); the others look at the newest
    // event's time, are refused, look again at the retry and log there.
    assert!(per_call[..2].iter().all(|&n| n == 2), "{per_call:?}");
    assert!(per_call[2..].iter().all(|&n| n <= 3), "{per_call:?}");
}
