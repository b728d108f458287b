//! The box lasts until the limits admit again: ten an hour, a box of fifteen minutes.

use super::*;
use tower_redis_ratelimit::test_util::box_and_slots;

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
    let clock = ManualClock::from(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let key = Key::from("mallory");
    let what = format!(
        "{:?} {pace:?}, box {:?}",
        policy.algorithm(),
        box_and_slots(policy).0
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
    let boxed = box_and_slots(policy).0.is_some();
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
    crate::support::time::Time::Real
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
