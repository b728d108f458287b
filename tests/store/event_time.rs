//! Event times in any order, decided by both stores exactly as the definition says: an event
//! is admitted iff every window `(a, a + w]` of each limit that contains it would hold at most
//! the limit's count.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::RedisServer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::test_util::{limit_index, tokio_clock_at};
use tower_redis_ratelimit::{Key, MemoryStore, Policy, RedisStore, Store, StoreError};

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
/// costs at event times in any order, in the past (up to the longest window back) or ahead.
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
    // Ahead, and from 50 s back (the longest window is a minute) over the next 5 minutes.
    for base in [now + 86_400_000, now - 50_000] {
        let redis = server.store().await;
        weighted_schedules(&MemoryStore::new(), &redis, base).await;
    }
}

const S: Duration = Duration::from_secs(1);

/// The paused clock's start, for the memory store.
fn epoch() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

fn memory() -> MemoryStore {
    MemoryStore::builder()
        .clock(tokio_clock_at(epoch()))
        .build()
}

/// The wall clock now, in whole microseconds (what the stores keep).
fn wall_now() -> SystemTime {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros();
    UNIX_EPOCH + Duration::from_micros(micros as u64)
}

async fn leasing(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .leases(Leases::new())
        .connect()
        .await
        .unwrap()
}

/// `1/1m + 5/1h + 10/1d`, an event booked 30 s ahead, then a request now: refused, and told
/// 90 s (when the booking has left the minute), not "no wait helps"; the event moved to its
/// `retry_at` is admitted there and refused a second before. `now` is the caller's now; the
/// store decides a moment later on Redis, within `slack`.
async fn a_booking_ahead_leaves_a_wait<St: Store>(store: &St, now: SystemTime, slack: Duration) {
    let policy: Policy = "1/1m + 5/1h + 10/1d".parse().unwrap();
    let key = Key::from("booked-ahead");
    let booked = store
        .check_at(&key, &policy, 1, now + 30 * S)
        .await
        .unwrap();
    assert!(booked.is_allowed());
    let d = store.check(&key, &policy, 1).await.unwrap();
    assert!(!d.is_allowed() && !d.in_penalty_box(), "{d:?}");
    let retry = d
        .retry_after()
        .expect("a wait helps: cost 1 fits every count");
    assert!(retry <= 90 * S && retry + slack >= 90 * S, "told {retry:?}");
    let at = d.retry_at().expect("an instant");
    assert_eq!(at, now + 90 * S, "the booking leaves the minute at +90 s");
    let early = store.check_at(&key, &policy, 1, at - S).await.unwrap();
    assert!(!early.is_allowed(), "a second early");
    assert!(store
        .check_at(&key, &policy, 1, at)
        .await
        .unwrap()
        .is_allowed());
}

#[tokio::test(start_paused = true)]
async fn a_booking_ahead_leaves_a_wait_on_memory() {
    a_booking_ahead_leaves_a_wait(&memory(), epoch(), Duration::ZERO).await;
}

#[tokio::test]
async fn a_booking_ahead_leaves_a_wait_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    a_booking_ahead_leaves_a_wait(&store, wall_now(), 5 * S).await;
}

/// `1/4s`, a scheduler's bookings at -1 s and +3 s on the key a layer limits: a request now is
/// refused until +7 s (clear of both), not +3 s (where the second booking is).
async fn a_retry_clears_every_booking<St: Store>(store: &St, now: SystemTime, slack: Duration) {
    let policy: Policy = "1/4s".parse().unwrap();
    let key = Key::from("shared");
    for at in [now - S, now + 3 * S] {
        assert!(store
            .check_at(&key, &policy, 1, at)
            .await
            .unwrap()
            .is_allowed());
    }
    let d = store.check(&key, &policy, 1).await.unwrap();
    assert!(!d.is_allowed());
    let retry = d.retry_after().expect("a wait helps");
    assert!(retry <= 7 * S && retry + slack >= 7 * S, "told {retry:?}");
    assert_eq!(d.retry_at(), Some(now + 7 * S));
    let early = store.check_at(&key, &policy, 1, now + 6 * S).await.unwrap();
    assert!(
        !early.is_allowed() && early.retry_after() == Some(S),
        "{early:?}"
    );
    let moved = store.check_at(&key, &policy, 1, now + 7 * S).await.unwrap();
    assert!(moved.is_allowed());
}

#[tokio::test(start_paused = true)]
async fn a_retry_clears_every_booking_on_memory() {
    a_retry_clears_every_booking(&memory(), epoch(), Duration::ZERO).await;
}

/// The same through time on the memory store: the client retrying when told is admitted, a
/// second before it is not.
#[tokio::test(start_paused = true)]
async fn a_client_retrying_when_told_is_admitted_on_memory() {
    let store = memory();
    let policy: Policy = "1/4s".parse().unwrap();
    let key = Key::from("shared");
    for at in [epoch() - S, epoch() + 3 * S] {
        assert!(store
            .check_at(&key, &policy, 1, at)
            .await
            .unwrap()
            .is_allowed());
    }
    let retry = store.check(&key, &policy, 1).await.unwrap().retry_after();
    assert_eq!(retry, Some(7 * S));
    tokio::time::sleep(6 * S).await;
    assert!(!store.peek(&key, &policy, 1).await.unwrap().is_allowed());
    tokio::time::sleep(S).await;
    assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn a_retry_clears_every_booking_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    a_retry_clears_every_booking(&store, wall_now(), 5 * S).await;
}

/// A refused event time leaves the requests of now alone: no penalty box, and a request now
/// is refused by the limits with the wait that helps.
async fn a_refused_event_sets_no_box<St: Store>(store: &St, now: SystemTime, slack: Duration) {
    let policy: Policy = "1/1m".parse().unwrap();
    let policy = policy.block_for(600 * S).unwrap();
    let key = Key::from("scheduled-and-boxed");
    assert!(store
        .check_at(&key, &policy, 1, now + 30 * S)
        .await
        .unwrap()
        .is_allowed());
    let refused = store
        .check_at(&key, &policy, 1, now + 40 * S)
        .await
        .unwrap();
    assert!(
        !refused.is_allowed() && !refused.in_penalty_box(),
        "{refused:?}"
    );
    assert_eq!(
        refused.retry_after(),
        Some(50 * S),
        "relative to the event's time"
    );
    assert_eq!(refused.retry_at(), Some(now + 90 * S));
    let looked = store.peek(&key, &policy, 1).await.unwrap();
    assert!(
        !looked.in_penalty_box(),
        "the event's refusal boxed the key: {looked:?}"
    );
    let retry = looked.retry_after().expect("a wait helps");
    assert!(retry <= 90 * S && retry + slack >= 90 * S, "told {retry:?}");
}

#[tokio::test(start_paused = true)]
async fn a_refused_event_sets_no_box_on_memory() {
    a_refused_event_sets_no_box(&memory(), epoch(), Duration::ZERO).await;
}

#[tokio::test]
async fn a_refused_event_sets_no_box_on_redis() {
    let server = RedisServer::start();
    a_refused_event_sets_no_box(&server.store().await, wall_now(), 5 * S).await;
}

/// An event time further back than the longest window is refused with a typed error; one
/// within it is decided.
async fn too_far_back_is_an_error<St: Store>(store: &St, now: SystemTime, name: &str) {
    let policy: Policy = "1/1m".parse().unwrap();
    let policy = policy.named(name).unwrap();
    let key = Key::from("far-back");
    let old = store.check_at(&key, &policy, 1, now - 62 * S).await;
    assert!(matches!(old, Err(StoreError::EventTooOld)), "{old:?}");
    let recent = store.check_at(&key, &policy, 1, now - 50 * S).await;
    assert!(recent.unwrap().is_allowed());
}

#[tokio::test(start_paused = true)]
async fn too_far_back_is_an_error_on_memory() {
    too_far_back_is_an_error(&memory(), epoch(), "minute").await;
}

#[tokio::test]
async fn too_far_back_is_an_error_on_redis() {
    let server = RedisServer::start();
    too_far_back_is_an_error(&server.store().await, wall_now(), "minute").await;
    too_far_back_is_an_error(&leasing(&server).await, wall_now(), "leased").await;
}

/// `w` filled at `t0`, one decision `1.2 w` later, then ten events at `t0 + w / 2`: the window
/// `(t0 - w / 2, t0 + w / 2]` already holds the count, so none is admitted (a log trimmed to
/// the decision's window admitted 9).
async fn past_events_read_the_log_as_it_was<St: Store>(
    store: &St,
    policy: &Policy,
    t0: SystemTime,
) {
    let key = Key::from("past");
    let w = policy.limits()[0].window();
    for _ in 0..10 {
        assert!(store
            .check_at(&key, policy, 1, t0)
            .await
            .unwrap()
            .is_allowed());
    }
    tokio::time::sleep(w * 6 / 5).await;
    let now = t0 + w * 6 / 5;
    assert!(store
        .check_at(&key, policy, 1, now)
        .await
        .unwrap()
        .is_allowed());
    let mut admitted = 0;
    for _ in 0..10 {
        let d = store.check_at(&key, policy, 1, t0 + w / 2).await.unwrap();
        admitted += usize::from(d.is_allowed());
    }
    assert_eq!(
        admitted, 0,
        "events at t0 + w/2 admitted past a full window"
    );
}

#[tokio::test(start_paused = true)]
async fn past_events_read_the_log_as_it_was_on_memory() {
    let policy: Policy = "10/1s".parse().unwrap();
    past_events_read_the_log_as_it_was(&memory(), &policy, epoch()).await;
}

#[tokio::test]
async fn past_events_read_the_log_as_it_was_on_redis() {
    let server = RedisServer::start();
    let policy: Policy = "10/2s".parse().unwrap();
    past_events_read_the_log_as_it_was(&server.store().await, &policy, wall_now()).await;
    let leased = policy.named("leased").unwrap();
    past_events_read_the_log_as_it_was(&leasing(&server).await, &leased, wall_now()).await;
}

/// A key holding a booking ahead is pinned as a boxed key is: a flood of other keys past
/// `max_keys` does not evict it, and the booked time is not booked twice.
#[tokio::test(start_paused = true)]
async fn a_key_with_bookings_ahead_outlives_a_flood() {
    let store = MemoryStore::builder()
        .clock(tokio_clock_at(epoch()))
        .max_keys(16)
        .build();
    let policy: Policy = "1/1m".parse().unwrap();
    let key = Key::from("booked");
    let at = epoch() + 1800 * S;
    assert!(store
        .check_at(&key, &policy, 1, at)
        .await
        .unwrap()
        .is_allowed());
    for i in 0..64 {
        let other = Key::from(format!("flood-{i}"));
        store.check(&other, &policy, 1).await.unwrap();
    }
    let again = store.check_at(&key, &policy, 1, at).await.unwrap();
    assert!(
        !again.is_allowed(),
        "the booking was evicted and made twice"
    );
}

/// The brute-force model of the log: admitted events `(time in s, cost)`; does an event of
/// `cost` at `t` fit every window `(a, a + w]` containing it (whole seconds cover them all).
fn fits(admitted: &[(i64, u64)], t: i64, limits: &[(u64, i64)], cost: u64) -> bool {
    limits.iter().all(|&(count, w)| {
        (t - w..t).all(|a| {
            let held: u64 = admitted
                .iter()
                .filter(|&&(e, _)| a < e && e <= a + w)
                .map(|&(_, c)| c)
                .sum();
            held + cost <= count
        })
    })
}

/// What the oracle counted: admissions and refusals it disagrees with, and the refusals'
/// retries: `None` where a wait helps, early, late, and right.
#[derive(Debug, Default)]
struct Tally {
    over_admitted: u32,
    over_refused: u32,
    wrong_none: u32,
    early: u32,
    late: u32,
    right: u32,
}

impl Tally {
    /// Compares a decision of `cost` at `t` (s from the round's base) with the model, and
    /// records the event when the store admitted it.
    fn decide(
        &mut self,
        admitted: &mut Vec<(i64, u64)>,
        t: i64,
        cost: u64,
        allowed: bool,
        retry: Option<Duration>,
    ) {
        let limits = [(1, 10), (3, 30)];
        let expected = fits(admitted, t, &limits, cost);
        match (allowed, expected) {
            (true, false) => self.over_admitted += 1,
            (false, true) => self.over_refused += 1,
            _ => {}
        }
        if allowed {
            admitted.push((t, cost));
            return;
        }
        // The earliest whole second it fits: every event time is one, and so is every edge.
        let earliest = (t + 1..t + 200).find(|&at| fits(admitted, at, &limits, cost));
        let truth = earliest.map(|at| Duration::from_secs((at - t) as u64));
        match (retry, truth) {
            (None, Some(_)) => self.wrong_none += 1,
            (Some(r), Some(s)) if r < s => self.early += 1,
            (Some(r), Some(s)) if r > s => self.late += 1,
            _ => self.right += 1,
        }
    }

    fn assert_exact(&self, cases: &str) {
        println!("{cases}: {self:?}");
        assert_eq!(
            (
                self.over_admitted,
                self.over_refused,
                self.wrong_none,
                self.early,
                self.late
            ),
            (0, 0, 0, 0, 0),
            "{cases}: {self:?}"
        );
    }
}

/// 300 random sequences at `1/10s + 3/30s` on the memory store's paused clock: requests now
/// and events from 20 s back to 20 s ahead, the clock moving 0 to 3 s between them; every
/// admission and every retry as the brute-force model says.
#[tokio::test(start_paused = true)]
async fn random_event_times_are_decided_and_told_exactly_on_memory() {
    let store = memory();
    let policy: Policy = "1/10s + 3/30s".parse().unwrap();
    let mut rng = StdRng::seed_from_u64(50);
    let mut tally = Tally::default();
    let mut clock = 0i64;
    for round in 0..300 {
        let key = Key::from(format!("oracle-{round}"));
        // Each round starts past what the last one left (twice the longest window).
        clock += 100;
        tokio::time::sleep(100 * S).await;
        let mut admitted = Vec::new();
        for _ in 0..20 {
            let gap = rng.random_range(0..=3i64);
            clock += gap;
            tokio::time::sleep(gap as u32 * S).await;
            let now = clock;
            let (t, d) = match rng.random_bool(0.3) {
                true => (now, store.check(&key, &policy, 1).await.unwrap()),
                false => {
                    let t = now + rng.random_range(-20..=20i64);
                    let at = epoch() + Duration::from_secs(t as u64);
                    (t, store.check_at(&key, &policy, 1, at).await.unwrap())
                }
            };
            tally.decide(&mut admitted, t, 1, d.is_allowed(), d.retry_after());
        }
    }
    tally.assert_exact("memory, 300 sequences of 20");
}

/// The same on Redis, event times only (a request now lands between whole seconds): 30
/// sequences from 20 s back to 20 s ahead of the wall clock, each on a key of its own.
#[tokio::test]
async fn random_event_times_are_decided_and_told_exactly_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let policy: Policy = "1/10s + 3/30s".parse().unwrap();
    let mut rng = StdRng::seed_from_u64(51);
    let mut tally = Tally::default();
    for round in 0..30 {
        let key = Key::from(format!("oracle-{round}"));
        let base = wall_now();
        let mut admitted = Vec::new();
        for _ in 0..20 {
            let t = rng.random_range(-20..=20i64);
            let at = match t < 0 {
                true => base - Duration::from_secs(t.unsigned_abs()),
                false => base + Duration::from_secs(t as u64),
            };
            let d = store.check_at(&key, &policy, 1, at).await.unwrap();
            tally.decide(&mut admitted, t, 1, d.is_allowed(), d.retry_after());
        }
    }
    tally.assert_exact("redis, 30 sequences of 20");
}

/// `1/10s` with 100 events booked 10 s apart from +5 s, more than the joint search reads: a
/// request now is told the time the newest has left its window, a true wait (admitted there),
/// on both stores alike. With fewer bookings the wait is the earliest (tests above).
async fn many_bookings_ahead<St: Store>(store: &St, now: SystemTime) {
    let policy: Policy = "1/10s".parse().unwrap();
    let key = Key::from("many-ahead");
    for k in 0..100 {
        let at = now + 5 * S + 10 * k * S;
        assert!(store
            .check_at(&key, &policy, 1, at)
            .await
            .unwrap()
            .is_allowed());
    }
    let d = store.check_at(&key, &policy, 1, now).await.unwrap();
    assert!(!d.is_allowed(), "{d:?}");
    let at = d.retry_at().expect("a wait helps");
    assert_eq!(
        at,
        now + 5 * S + 990 * S + 10 * S,
        "past the newest booking's window"
    );
    assert!(store
        .check_at(&key, &policy, 1, at)
        .await
        .unwrap()
        .is_allowed());
}

#[tokio::test(start_paused = true)]
async fn many_bookings_ahead_on_memory() {
    many_bookings_ahead(&memory(), epoch()).await;
}

#[tokio::test]
async fn many_bookings_ahead_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    many_bookings_ahead(&store, wall_now()).await;
}

/// Event times past the range every store decides exactly (2^53 µs, the year 2255) are an
/// error, not a panic nor a decision rounded in Lua's doubles.
#[tokio::test]
async fn event_times_past_the_range_are_an_error() {
    let server = RedisServer::start();
    let redis = server.store().await;
    let policy: Policy = "2/1s".parse().unwrap();
    let key = Key::from("far");
    for at in [
        UNIX_EPOCH + Duration::from_micros(1 << 53),
        UNIX_EPOCH + Duration::from_micros(u64::MAX),
    ] {
        let memory = MemoryStore::new().check_at(&key, &policy, 1, at).await;
        assert!(
            matches!(memory, Err(StoreError::Unsupported(_))),
            "{memory:?}"
        );
        let on_redis = redis.check_at(&key, &policy, 1, at).await;
        assert!(
            matches!(on_redis, Err(StoreError::Unsupported(_))),
            "{on_redis:?}"
        );
    }
}

/// A refusal among many bookings costs Redis a bounded number of reads: with 200 events
/// booked in a day's window, one refusal of `1/10s + 5000/1d` reads the set a few hundred
/// times, not once per booking per candidate time (32 × 200 and more).
#[tokio::test]
async fn a_refusal_among_many_bookings_reads_little_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let client = server.client().await;
    let policy: Policy = "1/10s + 5000/1d".parse().unwrap();
    let key = Key::from("many-in-a-day");
    let now = wall_now();
    for k in 0..200 {
        let at = now + 5 * S + 10 * k * S;
        assert!(store
            .check_at(&key, &policy, 1, at)
            .await
            .unwrap()
            .is_allowed());
    }
    let before = crate::support::command_calls(&client, "zrangebyscore").await;
    let d = store.check_at(&key, &policy, 1, now).await.unwrap();
    let reads = crate::support::command_calls(&client, "zrangebyscore").await - before;
    assert!(!d.is_allowed() && d.retry_at().is_some(), "{d:?}");
    assert!(reads < 1_000, "{reads} reads for one refusal");
}
