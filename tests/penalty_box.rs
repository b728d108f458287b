//! The penalty box (`Policy::block_for`): once a key hits its limit, every request of it is
//! refused for at least the box's length, whatever the windows say, and until its limits admit
//! it again, with a `Retry-After` that is the later of the two (never early); a charge that
//! fills the key sets it too; nothing extends a running box; `reset` clears it; the memory
//! store keeps boxed keys under memory pressure. The memory store on a manual clock, every
//! algorithm; Redis with short durations.

mod common;

use std::time::{Duration, Instant, UNIX_EPOCH};

use common::http::{api_key, keyed};
use common::RedisServer;
use common::ALGORITHMS;
use tower::ServiceExt;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, MemoryStore, Policy, RateLimitLayer, Settlement, Store,
};

const BOX: Duration = Duration::from_secs(15 * 60);

fn boxed(algorithm: Algorithm) -> Policy {
    Policy::new("login", ["3/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
        .block_for(BOX)
        .unwrap()
}

async fn check<St: Store>(store: &St, key: &Key, policy: &Policy) -> Decision {
    store.check(key, policy, 1).await.unwrap()
}

/// Puts `key` in the box by going over `policy`'s first limit, then resets it: free at once.
async fn reset_clears_the_box<St: Store>(store: &St, key: &Key, policy: &Policy) {
    for _ in 0..policy.limits()[0].count() {
        check(store, key, policy).await;
    }
    assert!(check(store, key, policy).await.in_penalty_box(), "{key:?}");
    store.reset(key, policy).await.unwrap();
    assert!(
        check(store, key, policy).await.is_allowed(),
        "{key:?}: reset"
    );
}

#[tokio::test]
async fn a_key_that_hits_its_limit_is_refused_for_the_box_on_memory() {
    for algorithm in ALGORITHMS {
        let clock = ManualClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let (policy, key) = (boxed(algorithm), Key::from("mallory"));
        for _ in 0..3 {
            assert!(
                check(&store, &key, &policy).await.is_allowed(),
                "{algorithm:?}"
            );
        }
        let hit = check(&store, &key, &policy).await;
        assert!(
            !hit.is_allowed() && hit.in_penalty_box(),
            "{algorithm:?}: {hit:?}"
        );
        assert_eq!(hit.retry_after(), Some(BOX), "{algorithm:?}");
        // A minute on, the window would admit again; the box still refuses, counting down.
        clock.advance(Duration::from_secs(61));
        let still = check(&store, &key, &policy).await;
        assert!(still.in_penalty_box(), "{algorithm:?}: {still:?}");
        assert_eq!(still.retry_after(), Some(BOX - Duration::from_secs(61)));
        // A look is refused too, and sets nothing.
        assert!(store.peek(&key, &policy, 1).await.unwrap().in_penalty_box());
        clock.advance(BOX - Duration::from_secs(61));
        assert!(
            check(&store, &key, &policy).await.is_allowed(),
            "{algorithm:?}: free"
        );

        reset_clears_the_box(&store, &Key::from("trudy"), &policy).await;

        // Without a box, the same policy refuses only until the window allows.
        let plain = Policy::new("plain", ["3/1m".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let key = Key::from("carol");
        for _ in 0..4 {
            check(&store, &key, &plain).await;
        }
        clock.advance(Duration::from_secs(61));
        assert!(
            check(&store, &key, &plain).await.is_allowed(),
            "{algorithm:?}"
        );
    }
}

/// A charge that leaves the key no unit (a counted failure, a usage charge) boxes it too.
#[tokio::test]
async fn a_charge_that_fills_the_key_boxes_it() {
    for algorithm in ALGORITHMS {
        let clock = ManualClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let (policy, key) = (boxed(algorithm), Key::from("eve"));
        let first = check(&store, &key, &policy).await;
        let charge = Settlement::charge(&first, 1).unwrap();
        store.settle(&key, &policy, charge).await.unwrap();
        assert!(
            !check(&store, &key, &policy).await.in_penalty_box(),
            "{algorithm:?}"
        );
        // 3 of 3 used: the next charge is past the limit and fills it.
        let charge = Settlement::charge(&first, 1).unwrap();
        store.settle(&key, &policy, charge).await.unwrap();
        // A look, which never sets the box itself, finds it set.
        let boxed = store.peek(&key, &policy, 1).await.unwrap();
        assert!(boxed.in_penalty_box(), "{algorithm:?}: {boxed:?}");
        assert_eq!(boxed.retry_after(), Some(BOX));
    }
}

/// Through the layer: `Retry-After` to the box's end, counting down, and the fields.
#[tokio::test]
async fn the_layer_answers_the_box_with_its_retry_after() {
    let clock = ManualClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .policy(boxed(Algorithm::Gcra))
        .build()
        .unwrap();
    let service = common::http::served(layer);
    let send = || async {
        let response = service.clone().oneshot(keyed("mallory")).await.unwrap();
        let field = |name: &str| {
            let value = response.headers().get(name);
            value.map(|v| v.to_str().unwrap().to_owned())
        };
        (
            response.status().as_u16(),
            field("retry-after"),
            field("ratelimit"),
        )
    };
    for _ in 0..3 {
        assert_eq!(send().await.0, 200);
    }
    assert_eq!(
        send().await,
        (429, Some("900".into()), Some("\"login\";r=0;t=900".into()))
    );
    clock.advance(Duration::from_secs(300));
    assert_eq!(send().await.1, Some("600".into()));
    clock.advance(Duration::from_secs(600));
    assert_eq!(send().await.0, 200);
}

/// On Redis, every algorithm: a box of 2 s over a window of 300 ms. The window has passed
/// long before the box ends, so each answer tells which one refused.
#[tokio::test]
async fn a_key_that_hits_its_limit_is_refused_for_the_box_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let block = Duration::from_secs(2);
    for algorithm in ALGORITHMS {
        let policy = Policy::new("login", ["2/300ms".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm)
            .block_for(block)
            .unwrap();
        let key = Key::from(format!("mallory-{algorithm:?}"));
        for _ in 0..2 {
            assert!(
                check(&store, &key, &policy).await.is_allowed(),
                "{algorithm:?}"
            );
        }
        let boxed_at = Instant::now();
        let hit = check(&store, &key, &policy).await;
        assert!(hit.in_penalty_box(), "{algorithm:?}: {hit:?}");
        assert_eq!(hit.retry_after(), Some(block));
        tokio::time::sleep(Duration::from_millis(700)).await;
        let still = check(&store, &key, &policy).await;
        assert!(still.in_penalty_box(), "{algorithm:?}: {still:?}");
        let left = still.retry_after().unwrap();
        assert!(
            left <= block - boxed_at.elapsed() + Duration::from_millis(5),
            "{algorithm:?}: {left:?} counts down"
        );
        tokio::time::sleep(left + Duration::from_millis(100)).await;
        assert!(
            check(&store, &key, &policy).await.is_allowed(),
            "{algorithm:?}: free"
        );

        let other = Key::from(format!("trudy-{algorithm:?}"));
        reset_clears_the_box(&store, &other, &policy).await;

        // A charge that fills the key boxes it in the same call.
        let filler = Key::from(format!("eve-{algorithm:?}"));
        let first = check(&store, &filler, &policy).await;
        let charge = Settlement::charge(&first, 1).unwrap();
        store.settle(&filler, &policy, charge).await.unwrap();
        let boxed = store.peek(&filler, &policy, 1).await.unwrap();
        assert!(boxed.in_penalty_box(), "{algorithm:?}: {boxed:?}");
    }
}

/// The deny cache (on for Redis) answers a boxed key locally, a second at a time, with the
/// box's `Retry-After`: here the hour the limit refuses, longer than the box.
#[tokio::test]
async fn the_deny_cache_repeats_the_box() {
    let server = RedisServer::start();
    let store = server.store().await;
    let policy = Policy::new("login", ["1/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store.clone())
        .policy(policy.clone())
        .build()
        .unwrap();
    let service = common::http::served(layer);
    let send = || async {
        let response = service.clone().oneshot(keyed("k")).await.unwrap();
        let retry = response.headers().get("retry-after").cloned();
        (response.status().as_u16(), retry)
    };
    assert_eq!(send().await.0, 200);
    let admin = common::client(&server.url()).await;
    let before = common::evalsha_calls(&admin).await;
    for _ in 0..5 {
        let (status, retry) = send().await;
        assert_eq!(status, 429);
        assert_eq!(retry.unwrap(), "3600");
    }
    assert_eq!(
        common::evalsha_calls(&admin).await - before,
        1,
        "the first refusal asked Redis; the deny cache answered the rest"
    );
}

/// An operator's reset frees a boxed key on every instance within a second: each one's deny
/// cache repeats the box's refusal for a second at most, not for the box's whole length.
#[tokio::test]
async fn a_reset_frees_a_boxed_key_on_every_instance() {
    let server = RedisServer::start();
    let (instance, operator) = (server.store().await, server.store().await);
    let policy = Policy::new("login", ["1/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(instance)
        .policy(policy.clone())
        .build()
        .unwrap();
    let service = common::http::served(layer);
    let status = || async {
        let response = service.clone().oneshot(keyed("mallory")).await.unwrap();
        response.status().as_u16()
    };
    assert_eq!(status().await, 200);
    assert_eq!(status().await, 429);
    assert_eq!(status().await, 429, "repeated from the deny cache");
    operator
        .reset(&Key::from("mallory"), &policy)
        .await
        .unwrap();
    let reset = Instant::now();
    while status().await != 200 {
        assert!(
            reset.elapsed() < Duration::from_secs(2),
            "still refused 2 s after the reset"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("admitted again {:?} after the reset", reset.elapsed());
}

/// Under an override, a charge fills the key at the override's counts, on both stores: a VIP
/// raised from 3 to 10 an hour is not boxed at the policy's 3.
async fn an_override_decides_when_a_charge_fills<St: Store>(
    store: St,
    overrides: tower_redis_ratelimit::store::Overrides,
) {
    use tower_redis_ratelimit::store::{Override, Scope};

    let policy = Policy::new("login", ["3/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let key = Key::from("vip");
    let ten = Override::Limits(vec!["10/1h".parse().unwrap()]);
    overrides
        .set(&policy, &Scope::Key(key.clone()), &ten)
        .await
        .unwrap();
    let first = check(&store, &key, &policy).await;
    for _ in 0..8 {
        let charge = Settlement::charge(&first, 1).unwrap();
        store.settle(&key, &policy, charge).await.unwrap();
    }
    let nine = store.peek(&key, &policy, 1).await.unwrap();
    assert!(
        nine.is_allowed() && nine.remaining() == 1,
        "9 of 10: {nine:?}"
    );
    let charge = Settlement::charge(&first, 1).unwrap();
    store.settle(&key, &policy, charge).await.unwrap();
    let full = store.peek(&key, &policy, 1).await.unwrap();
    assert!(full.in_penalty_box(), "10 of 10: {full:?}");
}

#[tokio::test]
async fn an_override_decides_when_a_charge_fills_on_memory() {
    let store = MemoryStore::new();
    an_override_decides_when_a_charge_fills(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn an_override_decides_when_a_charge_fills_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    an_override_decides_when_a_charge_fills(store.clone(), store.overrides()).await;
}

/// A request larger than the limit itself is refused (no wait helps) without boxing the key:
/// the key did not hit its limit. Both stores.
async fn a_request_over_the_limit_itself_does_not_box<St: Store>(store: St) {
    let policy = Policy::new("export", ["5/1m".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    // A key with no state yet, and one with some.
    let (fresh, used) = (Key::from("bulk"), Key::from("bulk-again"));
    assert!(check(&store, &used, &policy).await.is_allowed());
    for key in [fresh, used] {
        let huge = store.check(&key, &policy, 10).await.unwrap();
        assert!(
            !huge.is_allowed() && huge.retry_after().is_none(),
            "{huge:?}"
        );
        assert!(!huge.in_penalty_box());
        assert!(check(&store, &key, &policy).await.is_allowed(), "{key:?}");
    }
}

#[tokio::test]
async fn a_request_over_the_limit_itself_does_not_box_on_memory() {
    a_request_over_the_limit_itself_does_not_box(MemoryStore::new()).await;
}

#[tokio::test]
async fn a_request_over_the_limit_itself_does_not_box_on_redis() {
    let server = RedisServer::start();
    a_request_over_the_limit_itself_does_not_box(server.store().await).await;
}

/// A block set by an operator answers as a block while the key is also boxed, on both stores:
/// the override comes first.
async fn a_block_answers_before_the_box<St: Store>(
    store: St,
    overrides: tower_redis_ratelimit::store::Overrides,
) {
    use tower_redis_ratelimit::store::{Override, Scope};

    let policy = boxed(Algorithm::Gcra);
    let key = Key::from("mallory");
    for _ in 0..3 {
        check(&store, &key, &policy).await;
    }
    assert!(check(&store, &key, &policy).await.in_penalty_box());
    let scope = Scope::Key(key.clone());
    overrides
        .set(&policy, &scope, &Override::Block)
        .await
        .unwrap();
    let blocked = check(&store, &key, &policy).await;
    assert!(
        !blocked.in_penalty_box() && blocked.limit() == 0,
        "{blocked:?}"
    );
    overrides.remove(&policy, &scope).await.unwrap();
    assert!(
        check(&store, &key, &policy).await.in_penalty_box(),
        "the box stays"
    );
}

#[tokio::test]
async fn a_block_answers_before_the_box_on_memory() {
    let store = MemoryStore::new();
    a_block_answers_before_the_box(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn a_block_answers_before_the_box_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    a_block_answers_before_the_box(store.clone(), store.overrides()).await;
}

// The box lasts until the limits admit again: ten an hour, a box of fifteen minutes.

/// A whole hour since the epoch: windows of an hour start here, so that the figures below are
/// those worked out by hand.
const ON_THE_HOUR: u64 = 1_699_999_200;
const SECOND: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// `10/1h` under `algorithm`, with the fifteen-minute box or without one.
fn ten_an_hour(algorithm: Algorithm, with_box: bool) -> Policy {
    let policy = Policy::new("login", ["10/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm);
    match with_box {
        true => policy.block_for(BOX).unwrap(),
        false => policy,
    }
}

/// How a scenario's ten admissions come: at once on the hour, or one every 6 minutes from it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pace {
    Burst,
    Spread,
}

/// On a fresh memory store whose clock starts on the hour: ten admissions of `policy` at
/// `pace`, then (at 55 minutes when spread) requests until one is refused. Returns how many
/// more were admitted and the refusal's `retry_after`, after checking that the same request
/// is refused one second before it, with a second to wait (by the box, for a policy with
/// one: neither that refusal nor the box's own end frees the key early, nor boxes it anew),
/// and 1 µs before it, with 1 µs to wait, and admitted at it.
async fn first_refusal(policy: &Policy, pace: Pace) -> (u32, Duration) {
    let clock = ManualClock::starting_at(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let key = Key::from("mallory");
    let what = format!(
        "{:?} {pace:?}, box {:?}",
        policy.algorithm(),
        policy.block()
    );
    for i in 0..10 {
        if pace == Pace::Spread && i > 0 {
            clock.advance(6 * MINUTE);
        }
        assert!(
            check(&store, &key, policy).await.is_allowed(),
            "{what} #{i}"
        );
    }
    if pace == Pace::Spread {
        clock.advance(MINUTE);
    }
    let mut more = 0;
    let refusal = loop {
        let decision = check(&store, &key, policy).await;
        if !decision.is_allowed() {
            break decision;
        }
        more += 1;
        assert!(more <= 10, "{what}: never refused");
    };
    let boxed = policy.block().is_some();
    assert_eq!(refusal.in_penalty_box(), boxed, "{what}: {refusal:?}");
    let retry = refusal.retry_after().expect("a wait helps");
    assert!(refusal.reset_after() >= retry, "{what}: {refusal:?}");
    clock.advance(retry - SECOND);
    let early = check(&store, &key, policy).await;
    assert!(!early.is_allowed(), "{what}: admitted 1 s early");
    assert_eq!(early.in_penalty_box(), boxed, "{what}: {early:?}");
    assert_eq!(early.retry_after(), Some(SECOND), "{what}: {early:?}");
    // Exact to the microsecond: refused 1 µs before, with 1 µs to wait.
    let micro = Duration::from_micros(1);
    clock.advance(SECOND - micro);
    let just_before = check(&store, &key, policy).await;
    assert!(!just_before.is_allowed(), "{what}: admitted 1 µs early");
    assert_eq!(
        just_before.retry_after(),
        Some(micro),
        "{what}: {just_before:?}"
    );
    clock.advance(micro);
    let admitted = check(&store, &key, policy).await;
    assert!(
        admitted.is_allowed(),
        "{what}: refused at {retry:?}: {admitted:?}"
    );
    // The admission ended the box: the key's next refusal by the limits sets a new one.
    let again = refused(&store, &key, policy).await;
    assert_eq!(again.in_penalty_box(), boxed, "{what}: {again:?}");
    if boxed {
        assert!(again.retry_after() >= Some(BOX), "{what}: {again:?}");
    }
    (more, retry)
}

/// The first refusal of `key` under `policy`, after at most ten admissions.
async fn refused<St: Store>(store: &St, key: &Key, policy: &Policy) -> Decision {
    for _ in 0..=10 {
        let decision = check(store, key, policy).await;
        if !decision.is_allowed() {
            return decision;
        }
    }
    panic!("{key:?} never refused");
}

/// Ten at once on the hour, the eleventh refused: the limit refuses for an hour (the sliding
/// log's first event and the fixed window both leave at 3600 s; the sliding window counter
/// admits once the previous window weighs 9 of 10, at 3600 + 360 s; GCRA, one unit drained,
/// at 360 s), so the box's refusal says the later of that and its 900 s, and holds to it.
#[tokio::test]
async fn a_box_refuses_until_the_limits_admit_after_a_burst_on_memory() {
    let expected = [
        (Algorithm::SlidingLog, 3600, 3600),
        (Algorithm::SlidingWindow, 3960, 3960),
        (Algorithm::FixedWindow, 3600, 3600),
        (Algorithm::Gcra, 360, 900),
    ];
    for (algorithm, limit, boxed) in expected {
        let plain = first_refusal(&ten_an_hour(algorithm, false), Pace::Burst).await;
        assert_eq!(plain, (0, secs(limit)), "{algorithm:?} without a box");
        let with_box = first_refusal(&ten_an_hour(algorithm, true), Pace::Burst).await;
        assert_eq!(with_box, (0, secs(boxed)), "{algorithm:?} with the box");
        assert_eq!(with_box.1, plain.1.max(BOX), "{algorithm:?}");
    }
}

/// Ten spread over the hour (0, 6, .., 54 min), then requests at 55 min: the counters refuse
/// the first (the log and the fixed window until the hour's first event leaves, 300 s; the
/// sliding window counter until 3600 + 360 s, 660 s); GCRA, drained at the rate it was
/// filled, admits nine more and refuses the tenth for 300 s. The box outlasts them all: 900 s.
#[tokio::test]
async fn a_box_outlasts_limits_spread_over_the_hour_on_memory() {
    let expected = [
        (Algorithm::SlidingLog, 0, 300),
        (Algorithm::SlidingWindow, 0, 660),
        (Algorithm::FixedWindow, 0, 300),
        (Algorithm::Gcra, 9, 300),
    ];
    for (algorithm, more, limit) in expected {
        let plain = first_refusal(&ten_an_hour(algorithm, false), Pace::Spread).await;
        assert_eq!(plain, (more, secs(limit)), "{algorithm:?} without a box");
        let with_box = first_refusal(&ten_an_hour(algorithm, true), Pace::Spread).await;
        assert_eq!(with_box, (more, BOX), "{algorithm:?} with the box");
    }
}

/// On Redis, every algorithm at once: `10/4s` with a box of 1 s, ten requests just after a
/// 4 s window starts, the eleventh refused. The limits refuse for about 4 s (the sliding
/// window counter 4.35 s), longer than the box, GCRA for 0.4 s, shorter: the refusal's
/// `retry_after` is the later of the two, and holds: refused 300 ms before it, admitted
/// 100 ms after it.
#[tokio::test]
async fn a_box_refuses_until_the_limits_admit_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let (window, block) = (secs(4), secs(1));
    common::time::Time::Real
        .align(window, Duration::from_millis(50))
        .await;
    let runs = ALGORITHMS.map(|algorithm| {
        let store = store.clone();
        async move {
            let policy = Policy::new("login", ["10/4s".parse().unwrap()])
                .unwrap()
                .with_algorithm(algorithm)
                .block_for(block)
                .unwrap();
            let key = Key::from(format!("mallory-{algorithm:?}"));
            for i in 0..10 {
                let decision = check(&store, &key, &policy).await;
                assert!(decision.is_allowed(), "{algorithm:?} #{i}: {decision:?}");
            }
            let refusal = check(&store, &key, &policy).await;
            let decided = tokio::time::Instant::now();
            assert!(refusal.in_penalty_box(), "{algorithm:?}: {refusal:?}");
            let retry = refusal.retry_after().unwrap();
            assert!(refusal.reset_after() >= retry, "{algorithm:?}: {refusal:?}");
            match algorithm {
                Algorithm::Gcra => assert_eq!(retry, block, "the box outlasts GCRA's 0.4 s"),
                _ => assert!(retry > secs(3), "{algorithm:?}: {retry:?}: the limit's"),
            }
            tokio::time::sleep_until(decided + retry - Duration::from_millis(300)).await;
            let early = check(&store, &key, &policy).await;
            assert!(early.in_penalty_box(), "{algorithm:?}: {early:?}");
            let left = early.retry_after().unwrap();
            assert!(
                left <= Duration::from_millis(301),
                "{algorithm:?}: {left:?} left of {retry:?}"
            );
            tokio::time::sleep_until(decided + retry + Duration::from_millis(100)).await;
            let admitted = check(&store, &key, &policy).await;
            assert!(admitted.is_allowed(), "{algorithm:?}: {admitted:?}");
            // The admission ended the box: the next refusal sets a new one (GCRA's limit
            // alone would refuse for under 0.4 s).
            let again = refused(&store, &key, &policy).await;
            assert!(again.in_penalty_box(), "{algorithm:?}: {again:?}");
            assert!(
                again.retry_after() >= Some(block),
                "{algorithm:?}: {again:?}"
            );
            (algorithm, retry)
        }
    });
    for (algorithm, retry) in futures::future::join_all(runs).await {
        println!("{algorithm:?}: retry after {retry:?}");
    }
}

/// A charge that leaves a boxed key full (a failure counted by outcome that lands late)
/// neither restarts nor extends the box: it ends when its refusal said. `3/300ms`, a box of
/// 1.5 s, and three units charged 500 ms into it; `time` is the store's.
async fn a_charge_does_not_extend_the_box<St: Store>(store: St, time: common::time::Time) {
    let policy = Policy::new("login", ["3/300ms".parse().unwrap()])
        .unwrap()
        .block_for(Duration::from_millis(1500))
        .unwrap();
    let key = Key::from("eve");
    let first = check(&store, &key, &policy).await;
    for _ in 0..2 {
        assert!(check(&store, &key, &policy).await.is_allowed());
    }
    let refusal = check(&store, &key, &policy).await;
    let boxed_at = time.now();
    assert!(refusal.in_penalty_box(), "{refusal:?}");
    let retry = refusal.retry_after().unwrap();
    assert_eq!(
        retry,
        Duration::from_millis(1500),
        "the box outlasts the window"
    );
    let at = |offset: Duration| {
        let time = time.clone();
        async move {
            time.pass((boxed_at + offset).saturating_sub(time.now()))
                .await
        }
    };
    at(Duration::from_millis(500)).await;
    let charge = Settlement::charge(&first, 3).unwrap();
    store.settle(&key, &policy, charge).await.unwrap();
    let full = store.peek(&key, &policy, 1).await.unwrap();
    assert!(full.in_penalty_box(), "{full:?}");
    let left = full.retry_after().unwrap();
    assert!(
        left <= Duration::from_millis(1001),
        "{left:?} left: the charge restarted the box"
    );
    let margin = time.margin().max(Duration::from_millis(1));
    at(retry - margin).await;
    let early = check(&store, &key, &policy).await;
    assert!(early.in_penalty_box(), "{early:?}");
    at(retry + margin / 3).await;
    let admitted = check(&store, &key, &policy).await;
    assert!(admitted.is_allowed(), "at the box's end: {admitted:?}");
}

#[tokio::test]
async fn a_charge_does_not_extend_the_box_on_memory() {
    let clock = ManualClock::starting_at(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    a_charge_does_not_extend_the_box(store, common::time::Time::Manual(clock)).await;
}

#[tokio::test]
async fn a_charge_does_not_extend_the_box_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    a_charge_does_not_extend_the_box(store, common::time::Time::Real).await;
}

/// Two policies of one name, one with a box and one without, share their state: the box the
/// first sets refuses only its own requests, on both stores alike. `3/300ms`, a box of 60 s;
/// once the window has passed, the unboxed policy admits the key.
async fn a_box_is_its_own_policys<St: Store>(store: St, time: common::time::Time) {
    let window = Duration::from_millis(300);
    let plain = Policy::new(
        "login",
        [format!("3/{}ms", window.as_millis()).parse().unwrap()],
    )
    .unwrap();
    let with_box = plain.clone().block_for(secs(60)).unwrap();
    let key = Key::from("eve");
    for _ in 0..3 {
        assert!(check(&store, &key, &with_box).await.is_allowed());
    }
    assert!(check(&store, &key, &with_box).await.in_penalty_box());
    time.pass(window + time.margin().max(Duration::from_millis(1)))
        .await;
    let unboxed = check(&store, &key, &plain).await;
    assert!(
        unboxed.is_allowed(),
        "the box answered another policy: {unboxed:?}"
    );
}

#[tokio::test]
async fn a_box_is_its_own_policys_on_memory() {
    let clock = ManualClock::starting_at(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    a_box_is_its_own_policys(store, common::time::Time::Manual(clock)).await;
}

#[tokio::test]
async fn a_box_is_its_own_policys_on_redis() {
    let server = RedisServer::start();
    a_box_is_its_own_policys(server.store().await, common::time::Time::Real).await;
}

/// Memory pressure: a store of 1 000 keys (4 shards of 250), a boxed key and a key with a
/// request in flight (a concurrency slot), then 100 000 other clients, each admitted twice
/// under the boxed policy (never boxed) and admitted then refused under an hourly one, on a
/// virtual clock that moves 1 µs per client (nothing expires by itself). Both keys are pinned,
/// and the least recently used entries go instead.
#[tokio::test]
async fn a_boxed_key_outlives_a_flood_of_other_keys_on_memory() {
    let clock = ManualClock::starting_at(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder()
        .max_keys(1_000)
        .clock(clock.clone())
        .build();
    let policy = boxed(Algorithm::Gcra);
    let hourly = Policy::new("search", ["1/1h".parse().unwrap()]).unwrap();
    let streams = Policy::new("streams", ["1000/1m".parse().unwrap()])
        .unwrap()
        .concurrency(1)
        .unwrap();
    let (mallory, streamer) = (Key::from("mallory"), Key::from("streamer"));
    for _ in 0..3 {
        check(&store, &mallory, &policy).await;
    }
    assert!(check(&store, &mallory, &policy).await.in_penalty_box());
    assert!(check(&store, &streamer, &streams).await.holds_slot());
    for i in 0..100_000 {
        clock.advance(Duration::from_micros(1));
        let other = Key::from(format!("user-{i}"));
        for _ in 0..2 {
            assert!(check(&store, &other, &policy).await.is_allowed());
        }
        assert!(check(&store, &other, &hourly).await.is_allowed());
        assert!(!check(&store, &other, &hourly).await.is_allowed());
    }
    assert!(store.key_count() <= 1_000, "{} keys", store.key_count());
    let still = check(&store, &mallory, &policy).await;
    assert!(still.in_penalty_box(), "the box was evicted: {still:?}");
    assert_eq!(still.retry_after(), Some(BOX - Duration::from_millis(100)));
    assert_eq!(
        store.slots_in_use(&streamer, &streams),
        1,
        "the slot was evicted"
    );
}

/// Past the box's length, a key its limits still refuse stays locked out: ten failures at
/// once at `10/1h` with a 15-minute box lock it out for the hour, and a flood of other keys
/// 16 minutes in does not evict it into a fresh budget.
#[tokio::test]
async fn a_lockout_outlives_a_flood_of_other_keys_after_the_box_on_memory() {
    let clock = ManualClock::starting_at(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder()
        .max_keys(1_000)
        .clock(clock.clone())
        .build();
    let policy = Policy::new("login", ["10/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let mallory = Key::from("mallory");
    for _ in 0..10 {
        assert!(check(&store, &mallory, &policy).await.is_allowed());
    }
    let locked = check(&store, &mallory, &policy).await;
    assert_eq!(locked.retry_after(), Some(secs(3600)));
    clock.advance(BOX + secs(60));
    for i in 0..3_000 {
        let other = Key::from(format!("user-{i}"));
        assert!(check(&store, &other, &policy).await.is_allowed());
    }
    assert!(store.key_count() <= 1_000, "{} keys", store.key_count());
    let still = check(&store, &mallory, &policy).await;
    assert!(
        !still.is_allowed(),
        "evicted into a fresh budget: {still:?}"
    );
    assert_eq!(still.retry_after(), Some(secs(3600) - BOX - secs(60)));
}

/// A shard full of boxed keys (a store of 8 keys is one shard of 8) still holds at most 8: a
/// ninth key evicts the box that ends soonest, k0's, although k1's was used less recently.
#[tokio::test]
async fn a_store_full_of_boxed_keys_keeps_its_bound_on_memory() {
    let clock = ManualClock::starting_at(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder()
        .max_keys(8)
        .clock(clock.clone())
        .build();
    let policy = Policy::new("login", ["1/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let keys: Vec<Key> = (0..9).map(|i| Key::from(format!("k{i}"))).collect();
    for key in &keys[..8] {
        clock.advance(SECOND);
        assert!(check(&store, key, &policy).await.is_allowed());
        assert!(check(&store, key, &policy).await.in_penalty_box());
    }
    clock.advance(SECOND);
    assert!(check(&store, &keys[0], &policy).await.in_penalty_box());
    clock.advance(SECOND);
    assert!(check(&store, &keys[8], &policy).await.is_allowed());
    assert!(store.key_count() <= 8, "{} keys", store.key_count());
    assert!(check(&store, &keys[8], &policy).await.in_penalty_box());
    for key in &keys[1..8] {
        let decision = check(&store, key, &policy).await;
        assert!(decision.in_penalty_box(), "{key:?}: {decision:?}");
    }
    assert!(
        check(&store, &keys[0], &policy).await.is_allowed(),
        "k0's box, the soonest to end, was evicted and starts afresh"
    );
    assert!(store.key_count() <= 8, "{} keys", store.key_count());
}

/// The box's look goes by the limits in force for the key, an override's. A sliding log of 3
/// per 20 units, raised to 5 for the key, with a box of 10 units: five admitted at 0, 1, .., 4
/// units, the sixth refused at 5 units. At 6 units, in the box (to 15), the override's limit
/// admits again once the event at 0 leaves, at 20: 14 units to wait (the policy's own 3 would
/// wait for the event at 2, 16 units). `unit` scales it to each store; `time` is the store's.
async fn the_box_looks_under_the_override<St: Store>(
    store: St,
    overrides: tower_redis_ratelimit::store::Overrides,
    time: common::time::Time,
    unit: Duration,
) {
    use tower_redis_ratelimit::store::{Override, Scope};
    use tower_redis_ratelimit::Limit;

    let window = 20 * unit;
    let limit = |count: u64| Limit::new(count, window).unwrap();
    let policy = Policy::new("login", [limit(3)])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
        .block_for(10 * unit)
        .unwrap();
    let key = Key::from("vip");
    let raised = Override::Limits(vec![limit(5)]);
    overrides
        .set(&policy, &Scope::Key(key.clone()), &raised)
        .await
        .unwrap();
    let start = time.now();
    let at = |units: u32| {
        let time = time.clone();
        async move {
            time.pass((start + units * unit).saturating_sub(time.now()))
                .await
        }
    };
    for k in 0..5 {
        at(k).await;
        assert!(check(&store, &key, &policy).await.is_allowed(), "#{k}");
    }
    at(5).await;
    let refusal = check(&store, &key, &policy).await;
    assert!(refusal.in_penalty_box(), "{refusal:?}");
    at(6).await;
    let looked = check(&store, &key, &policy).await;
    assert!(looked.in_penalty_box(), "{looked:?}");
    assert_eq!(looked.limit(), 5, "{looked:?}");
    let retry = looked.retry_after().unwrap();
    // The events' times are the store's when each was recorded, a little after `start + k`
    // on Redis: the slack goes both ways (its own limits, 3, would say 16 units).
    let (want, slack) = (14 * unit, unit / 2);
    assert!(
        retry.abs_diff(want) <= slack,
        "{retry:?} to wait, not {want:?}"
    );
}

#[tokio::test]
async fn the_box_looks_under_the_override_on_memory() {
    let clock = ManualClock::starting_at(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let time = common::time::Time::Manual(clock);
    the_box_looks_under_the_override(store.clone(), store.overrides(), time, secs(180)).await;
}

#[tokio::test]
async fn the_box_looks_under_the_override_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let (overrides, unit) = (store.overrides(), Duration::from_millis(200));
    the_box_looks_under_the_override(store, overrides, common::time::Time::Real, unit).await;
}
