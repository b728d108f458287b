//! Which policies lease and how: the sliding log (boxed or not), every limit of a policy,
//! costs, policies that share a name, settings that leave no burst, and what GCRA's headroom
//! promises.

use super::*;
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::test_util::Engine;

/// The sliding log is leased (its windows read longer, `docs/leases.md`); a GCRA policy whose
/// headroom would starve the bucket is still refused (`impossible_lease_settings_fail_to_build`).
#[tokio::test]
async fn a_leasing_store_takes_the_sliding_log() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let built = RateLimitLayer::builder()
        .policy(
            "100/1m"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(Algorithm::SlidingLog),
        )
        .store(store.clone())
        .build();
    assert!(built.is_ok(), "{:?}", built.err());
    let key = Key::from("log");
    assert_eq!(
        paced(&store, &key, &log("100/1m"), 40, Duration::from_millis(5)).await,
        40
    );
    assert!(
        store.check_now(&key, &log("100/1m"), 1).is_some(),
        "a busy key of the log holds a lease"
    );
}

/// A policy with a penalty box (or a concurrency limit) is never leased, so a leasing store
/// takes it whatever its algorithm, the sliding log included, and decides each request in
/// Redis, the box with it.
#[tokio::test]
async fn a_leasing_store_takes_a_boxed_sliding_log() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let sliding_log = |limit: &str| {
        Policy::new("login", [limit.parse().unwrap()])
            .unwrap()
            .with_algorithm(Algorithm::SlidingLog)
    };
    let boxed = sliding_log("2/300ms")
        .block_for(Duration::from_secs(1))
        .unwrap();
    let streams = sliding_log("100/1m").named("streams").unwrap();
    let streams = streams.concurrency(2).unwrap();
    assert!(store.supports(&boxed).is_ok() && store.supports(&streams).is_ok());
    let layer = RateLimitLayer::builder()
        .policy(boxed.clone())
        .key(api_key())
        .store(store.clone())
        .build();
    let layer = layer.expect("a boxed sliding log builds on a leasing store");
    let service = served(layer);
    let admin = server.client().await;
    let before = evalsha_calls(&admin).await;
    assert!(passes(&service, "mallory").await);
    assert!(passes(&service, "mallory").await);
    assert!(!passes(&service, "mallory").await);
    assert_eq!(
        evalsha_calls(&admin).await - before,
        3,
        "each decided in Redis"
    );
    let key = Key::from("mallory");
    let boxed_now = store.peek(&key, &boxed, 1).await.unwrap();
    assert!(boxed_now.in_penalty_box(), "{boxed_now:?}");
    let left = boxed_now.retry_after().unwrap();
    assert!(left <= Duration::from_secs(1), "{left:?}");
    tokio::time::sleep(left + Duration::from_millis(100)).await;
    assert!(passes(&service, "mallory").await, "free after the box");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_covers_every_limit_of_a_policy_and_costs() {
    let server = RedisServer::start();
    let client = server.client().await;
    let stores = [leasing(server.url()).await, leasing(server.url()).await];
    // Hour and day windows: no window ends during the test.
    let policy = Policy::new(
        "multi",
        ["40/1h".parse().unwrap(), "100/1d".parse().unwrap()],
    )
    .unwrap()
    .with_algorithm(Algorithm::FixedWindow);
    let key = Key::from("multi");
    let (mut admitted_units, mut from_leases) = (0, 0);
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for i in 0..200 {
        tick.tick().await;
        let store = &stores[i % 2];
        let (decision, leased) = match store.check_now(&key, &policy, 2) {
            Some(decision) => (decision, true),
            None => (store.check(&key, &policy, 2).await, false),
        };
        if decision.unwrap().is_allowed() {
            admitted_units += 2;
            from_leases += u64::from(leased);
        }
    }
    assert!(from_leases > 0, "no request was admitted from a lease");
    assert!(
        admitted_units <= 40,
        "{admitted_units} units admitted under 40/1h"
    );
    assert!(
        admitted_units >= 30,
        "only {admitted_units} of 40 units admitted"
    );
    for store in &stores {
        store.drain().await.unwrap();
    }
    // Both limits count exactly the units admitted, once the leases are back.
    let raw: Vec<u8> = client
        .get(redis_key(&stores[0], &key, &policy))
        .await
        .unwrap();
    let field = |i: usize| i64::from_le_bytes(raw[8 * i..8 * i + 8].try_into().unwrap());
    assert_eq!((field(1), field(3)), (admitted_units, admitted_units));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_named_policies_never_spend_each_others_leases() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    // Both cases need the 20/1m fixed window to stay within one window.
    within_one_minute(Duration::from_secs(20)).await;

    // Case A: two policies parsed from text, so both named "default", of different algorithms.
    let wide = RateLimitLayer::builder()
        .policy(
            "1000/1m"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(Algorithm::Gcra),
        )
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let narrow = RateLimitLayer::builder()
        .policy(
            "20/1m"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(Algorithm::FixedWindow),
        )
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let (wide, narrow) = (served(wide), served(narrow));
    let first = through_layer(&wide, "key-a", 300).await;
    let second = through_layer(&narrow, "key-a", 60).await;
    eprintln!(
        "case A (\"default\", GCRA 1000/1m then fixed 20/1m): {first} of 300, then {second} of 60"
    );
    let case_a = (first, second);

    // Case B: both named "api", same algorithm and window, different counts: one state (a
    // named policy's counts may change, `Policy::identity`), but leases apart.
    let api = |limit: &str| {
        Policy::new("api", [limit.parse().unwrap()])
            .unwrap()
            .with_algorithm(Algorithm::FixedWindow)
    };
    let wide = RateLimitLayer::builder()
        .policy(api("1000/1m"))
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let narrow = RateLimitLayer::builder()
        .policy(api("20/1m"))
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    let (wide, narrow) = (served(wide), served(narrow));
    let first = through_layer(&wide, "key-b", 300).await;
    let second = through_layer(&narrow, "key-b", 60).await;
    let case_b = (first, second);
    eprintln!(
        "case B (\"api\", fixed 1000/1m then fixed 20/1m): {first} of 300, then {second} of 60"
    );
    // Both cases are measured before either is judged, so that a failure shows both.
    let (first, second) = case_a;
    assert_eq!(first, 300, "GCRA 1000/1m admits 300 of 300");
    assert_eq!(
        second, 20,
        "the fixed-window 20/1m policy admitted {second} of 60 after 300 requests under the \
         GCRA 1000/1m policy of the same name on the same key (leases of one were spent by the \
         other)"
    );
    let (first, second) = case_b;
    assert_eq!(first, 300, "1000/1m admits 300 of 300");
    assert_eq!(
        second, 0,
        "the 20/1m policy named \"api\" admitted {second} of 60 after the 300 requests that \
         the 1000/1m policy of the same name recorded in their shared state (leases of one \
         were spent by the other)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impossible_lease_settings_fail_to_build() {
    let server = RedisServer::start();
    // GCRA's headroom would be the whole window: a burst of 10 * (1 - 1 s / 1 s) = 0.
    let leases = Leases::new().max_share(1.0);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let policy = gcra("10/1s");
    let supported = store.supports(&policy);
    let built = RateLimitLayer::builder()
        .policy(policy.clone())
        .key(api_key())
        .store(store.clone())
        .build();
    let mut what_it_admits = String::new();
    if built.is_ok() || supported.is_ok() {
        let key = Key::from("impossible");
        let mut admitted = 0;
        for _ in 0..20 {
            admitted += u32::from(admit(&store, &key, &policy, 1).await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        what_it_admits = format!("; the store admits {admitted} of 20 requests over 200 ms");
    }
    eprintln!(
        "supports: {supported:?}; build: {:?}{what_it_admits}",
        built.as_ref().map(|_| "Ok")
    );
    match &built {
        Err(BuildError::Unsupported { policy, why }) => {
            assert_eq!(policy, "gcra");
            assert!(
                why.contains("max_share"),
                "the error names the setting: {why}"
            );
        }
        Err(other) => panic!("expected BuildError::Unsupported, got {other:?}"),
        Ok(_) => {
            panic!("a layer with GCRA 10/1s over leases of max_share 1.0 built{what_it_admits}")
        }
    }
    assert!(
        supported.is_err(),
        "supports(GCRA 10/1s) with max_share 1.0: {supported:?}{what_it_admits}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_over_the_leasing_burst_says_it_never_passes() {
    let server = RedisServer::start();
    // The headroom is 0.5 s of 1 s: the burst is 50.
    let leases = Leases::new().max_share(0.5);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let (key, policy) = (Key::from("heavy"), gcra("100/1s"));
    let decision = store.check(&key, &policy, 60).await.unwrap();
    eprintln!("a request of cost 60 on a fresh key: {decision:?}");
    assert!(
        !decision.is_allowed(),
        "a cost of 60 admitted where the burst is 50: {decision:?}"
    );
    assert_eq!(
        decision.retry_after(),
        None,
        "a cost of 60 can never pass under a burst of 50, yet retry_after says when: \
         {decision:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_and_remaining_agree_with_check_under_the_headroom() {
    let server = RedisServer::start();
    // The headroom is 0.25 s of 1 s: the burst is 75.
    let leases = Leases::new().max_share(0.25);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let (key, policy) = (Key::from("agree"), gcra("100/1s"));
    // A burst as the layer sends it, as fast as it goes: 200 requests (a unit drips back every
    // 10 ms). After each of the first refusals, a peek.
    let mut decisions = Vec::new();
    let mut peeks = Vec::new();
    let started = tokio::time::Instant::now();
    for _ in 0..200 {
        let sent = tokio::time::Instant::now();
        let decision = match store.check_now(&key, &policy, 1) {
            Some(outcome) => outcome.unwrap(),
            None => store.check(&key, &policy, 1).await.unwrap(),
        };
        if !decision.is_allowed() && peeks.len() < 5 {
            let peeked = store.peek(&key, &policy, 1).await.unwrap();
            // Redis ran the refusal after `sent` and the peek before now: if less than the
            // refusal's retry-after lies between, nothing has dripped back that could admit.
            let between = sent.elapsed();
            peeks.push((decisions.len(), decision.retry_after(), between, peeked));
        }
        decisions.push((decision.is_allowed(), decision.remaining()));
    }
    let took = started.elapsed();
    let admitted = decisions.iter().filter(|d| d.0).count();
    let first_refusal = decisions.iter().position(|d| !d.0);
    eprintln!(
        "{admitted} of 200 admitted in {took:?}, the first refusal at request {first_refusal:?}; \
         (allowed, remaining) per request: {decisions:?}"
    );
    for (at, retry_after, between, peeked) in &peeks {
        eprintln!(
            "refusal at request {}: retry_after {retry_after:?}; a peek {between:?} after it was \
             sent: allowed {} remaining {}",
            at + 1,
            peeked.is_allowed(),
            peeked.remaining()
        );
    }
    assert!(
        first_refusal.is_some(),
        "200 requests against a burst of 75"
    );
    for (i, &(allowed, remaining)) in decisions.iter().enumerate() {
        assert!(
            allowed || remaining == 0,
            "request {} was refused while reporting remaining {remaining}",
            i + 1
        );
    }
    let mut judged = 0;
    for (at, retry_after, between, peeked) in &peeks {
        if retry_after.is_some_and(|r| *between < r) {
            judged += 1;
            assert!(
                !peeked.is_allowed(),
                "request {} was refused (retry after {retry_after:?}), but a peek {between:?} \
                 later says allowed with remaining {}",
                at + 1,
                peeked.remaining()
            );
        }
    }
    assert!(
        judged > 0,
        "no peek came within a refusal's retry-after: {peeks:?}"
    );
    // A remaining of r promises r more admissions at that instant; the later requests of the
    // burst (within a few ms, which only drips more in) were admitted at least that often.
    for (i, &(allowed, remaining)) in decisions.iter().enumerate() {
        let later = decisions[i + 1..].iter().filter(|d| d.0).count() as u64;
        assert!(
            !allowed || remaining <= later,
            "request {} was admitted reporting remaining {remaining}, but only {later} of the \
             {} requests after it were admitted",
            i + 1,
            decisions.len() - i - 1
        );
    }
}

/// Event times on a leasing store read the same longer window as its decisions: an event of
/// the whole limit at `t0` refuses one at `t0 + w + h / 2`, which a window of `w` alone would
/// admit, with the wait to `t0 + w + h`; at `t0 + w + h` it is admitted.
#[tokio::test]
async fn a_leasing_store_reads_event_times_in_the_longer_window() {
    let server = RedisServer::start();
    // A share of 0.5 (5 units of 10, leased), h = min(period, 0.5 * 2 s) = 200 ms.
    let leases = Leases::new()
        .period(Duration::from_millis(200))
        .max_share(0.5);
    let store = leasing_with(server.url(), leases, Duration::from_millis(200)).await;
    let (key, policy) = (Key::from("events"), log("10/2s"));
    let h = Duration::from_millis(200);
    let t0 = SystemTime::now();
    let first = store.check_at(&key, &policy, 10, t0).await.unwrap();
    assert!(first.is_allowed(), "{first:?}");
    let w = Duration::from_secs(2);
    let inside = store
        .check_at(&key, &policy, 1, t0 + w + h / 2)
        .await
        .unwrap();
    assert!(
        !inside.is_allowed(),
        "admitted within w + h of t0: {inside:?}"
    );
    assert_eq!(inside.retry_after(), Some(h / 2), "{inside:?}");
    let after = store.check_at(&key, &policy, 1, t0 + w + h).await.unwrap();
    assert!(after.is_allowed(), "{after:?}");
}

/// A policy that is never leased (here a count whose share is under two units) shares the log
/// of a leased policy of its name and windows: it reads the same longer window, so that the
/// leased policy's units, spent up to `h` after they were logged, count in every window it
/// decides. `api` `1000/1s` is busy for 300 ms from leases (`h` = 100 ms), then `api`
/// `10/1s` asks every 2 ms from 0.9 s after the last unit spent: no window of 1 s ending at
/// one of its admissions holds more than its 10 (18 to 25 when it read windows of 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_not_leased_reads_the_longer_window_of_a_leased_one_of_its_name() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let big = named("api", "1000/1s", Algorithm::SlidingLog);
    let small = named("api", "10/1s", Algorithm::SlidingLog);
    let key = Key::from("shared");
    let mut spent = Vec::new();
    let stop = micros_now() + 300_000;
    while micros_now() < stop {
        spent.extend(spent_at(&store, &key, &big).await);
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let last = *spent.iter().max().expect("the big policy admitted");
    let from = last + 900_000;
    tokio::time::sleep(Duration::from_micros(from.saturating_sub(micros_now()))).await;
    let mut small_spent = Vec::new();
    while micros_now() < from + 400_000 {
        small_spent.extend(spent_at(&store, &key, &small).await);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    spent.extend(&small_spent);
    let in_window = |t: u64| {
        spent
            .iter()
            .filter(|&&s| s <= t && s + 1_000_000 > t)
            .count()
    };
    let fullest = small_spent.iter().map(|&t| in_window(t)).max().unwrap_or(0);
    eprintln!(
        "the small policy admitted {}; the fullest second ending at one of them holds {fullest}",
        small_spent.len()
    );
    assert!(
        fullest <= 10,
        "{fullest} units in a second of a 10/1s policy"
    );
}
