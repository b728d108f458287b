//! Limits that change at run time, on both stores and all four algorithms: other counts for
//! one policy's state (`Policy::with_limits`), and the store's overrides for a key or a whole
//! policy. Usage carries over, so a raise admits exactly the difference, a cut refuses with
//! the wait the algorithm's own state gives, and going back restores the policy's own
//! answers. A named policy keeps its state by name and windows; unnamed policies with other
//! limits never share one.

mod common;

use std::time::{Duration, UNIX_EPOCH};

use common::http::{api_key, instance, keyed, passes, served, LayerBody};
use common::time::Time;
use common::RedisServer;
use common::ALGORITHMS;
use tower_redis_ratelimit::store::{ManualClock, Override, OverrideError, Overrides, Scope};
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, Limit, MemoryStore, Policy, PolicyError, RedisStore, Store,
};

const HOUR: Duration = Duration::from_secs(3600);

fn memory() -> (MemoryStore, Time) {
    // 14 minutes into an hour, so that the fixed windows' end is not the sliding log's.
    let clock = ManualClock::starting_at(UNIX_EPOCH + Duration::from_secs(1_700_000_040));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    (store, Time::Manual(clock))
}

fn hourly(count: u64) -> Limit {
    Limit::new(count, HOUR).unwrap()
}

async fn check<St: Store>(store: &St, key: &Key, policy: &Policy) -> Decision {
    store.check(key, policy, 1).await.unwrap()
}

async fn admitted<St: Store>(store: &St, key: &Key, policy: &Policy, tries: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..tries {
        admitted += usize::from(check(store, key, policy).await.is_allowed());
    }
    admitted
}

/// How long a key that holds `used` units, all taken `since` ago (`into` the current hour),
/// is refused one more under `count` per hour.
fn expected_wait(
    algorithm: Algorithm,
    count: u64,
    used: u64,
    since: Duration,
    into: Duration,
) -> Duration {
    let to_next_hour = HOUR - into;
    match algorithm {
        // Every entry is in the window until an hour after it.
        Algorithm::SlidingLog => HOUR - since,
        // This hour's counter is full until the hour ends.
        Algorithm::FixedWindow => to_next_hour,
        // Next hour, the `used` units weigh `used * (1 - e / 1h)` until that leaves room for one:
        // e = 1h * (1 - (count - 1) / used).
        Algorithm::SlidingWindow => {
            to_next_hour + HOUR.mul_f64(1.0 - (count - 1) as f64 / used as f64)
        }
        // `used` units drain `count` per hour until `count - 1` are left.
        _ => HOUR.mul_f64((used - (count - 1)) as f64 / count as f64) - since,
    }
}

/// `sms` at 5 per hour: five at once; raised to 8, exactly three more; cut to 3, refused for
/// as long as the eight units take to leave room; back at 5, refused too, for its own wait.
async fn raise_cut_restore<St: Store>(store: &St, time: &Time, algorithm: Algorithm) {
    let sms = Policy::new("sms", [hourly(5)])
        .unwrap()
        .with_algorithm(algorithm);
    let key = Key::from(format!("+44 {algorithm:?}"));
    let start = time.now();
    assert_eq!(
        admitted(store, &key, &sms, 7).await,
        5,
        "{algorithm:?} at 5/1h"
    );

    let raised = sms.with_limits([hourly(8)]).unwrap();
    assert_eq!(raised.identity(), sms.identity());
    assert_eq!(
        admitted(store, &key, &raised, 6).await,
        3,
        "{algorithm:?} raised to 8/1h"
    );

    for count in [3, 5] {
        let policy = sms.with_limits([hourly(count)]).unwrap();
        let refused = check(store, &key, &policy).await;
        let since = time.now() - start;
        let into = Duration::from_micros((time.now().as_micros() % HOUR.as_micros()) as u64);
        let expected = expected_wait(algorithm, count, 8, since, into);
        assert_wait(
            time,
            &refused,
            expected,
            &format!("{algorithm:?} at {count}/1h"),
        );
    }

    // Once the policy's own counts leave room, they decide as if nothing had changed.
    let wait = check(store, &key, &sms).await.retry_after().unwrap();
    if let Time::Manual(_) = time {
        time.pass(wait).await;
        assert!(
            check(store, &key, &sms).await.is_allowed(),
            "{algorithm:?} after {wait:?}"
        );
    }
}

#[tokio::test]
async fn other_counts_carry_usage_over_on_memory() {
    for algorithm in ALGORITHMS {
        let (store, time) = memory();
        raise_cut_restore(&store, &time, algorithm).await;
    }
}

#[tokio::test]
async fn other_counts_carry_usage_over_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    for algorithm in ALGORITHMS {
        raise_cut_restore(&store, &Time::Real, algorithm).await;
    }
}

/// Named policies share state by name and windows; unnamed ones by their whole limits.
async fn identities<St: Store>(store: &St) {
    let key = Key::from("client");
    let a: Policy = "2/1m".parse().unwrap();
    let b: Policy = "3/1m".parse().unwrap();
    assert_ne!(a.identity(), b.identity());
    assert_eq!(admitted(store, &key, &a, 3).await, 2);
    assert_eq!(
        admitted(store, &key, &b, 4).await,
        3,
        "another unnamed policy shares nothing"
    );

    let named_a = a.clone().named("api").unwrap();
    let named_b = b.clone().named("api").unwrap();
    assert_eq!(named_a.identity(), named_b.identity());
    assert_eq!(admitted(store, &key, &named_a, 3).await, 2);
    assert_eq!(
        admitted(store, &key, &named_b, 3).await,
        1,
        "one named budget"
    );
    let other_window = Policy::new("api", ["3/2m".parse().unwrap()]).unwrap();
    assert_ne!(other_window.identity(), named_a.identity());
    assert_eq!(
        admitted(store, &key, &other_window, 4).await,
        3,
        "other windows start afresh"
    );
}

#[tokio::test]
async fn identities_on_memory() {
    identities(&memory().0).await;
}

#[tokio::test]
async fn identities_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    identities(&store).await;
    let key = Key::from("client");
    let sms = Policy::new("sms", [hourly(5)]).unwrap();
    let vip = sms.with_limits([hourly(50)]).unwrap();
    assert_eq!(store.redis_key(&key, &sms), store.redis_key(&key, &vip));
    assert_eq!(store.redis_key(&key, &sms), "ratelimit:{sms:client}:log:1h");
}

#[test]
fn other_counts_must_keep_the_windows() {
    let sms = Policy::new("sms", ["1/1m".parse().unwrap(), hourly(5)]).unwrap();
    assert_eq!(
        sms.with_limits([hourly(5)]),
        Err(PolicyError::OtherWindows {
            expected: "1m+1h".into()
        })
    );
    let other = sms.with_limits(["1/2m".parse().unwrap(), hourly(5)]);
    assert!(matches!(other, Err(PolicyError::OtherWindows { .. })));
    // In any order, like `Policy::new`.
    let vip = sms
        .with_limits([hourly(50), "2/1m".parse().unwrap()])
        .unwrap();
    assert_eq!(vip.limits()[0].count(), 2);
    assert_eq!(vip.limits()[1].count(), 50);
}

/// Checks that `decision` refuses with the wait `expected`, to the µs on the memory store and
/// to the second on Redis (real time passes between the requests and the reading).
fn assert_wait(time: &Time, decision: &Decision, expected: Duration, what: &str) {
    assert!(!decision.is_allowed(), "{what}: {decision:?}");
    let got = decision.retry_after().expect("a wait that helps");
    let slack = match time {
        Time::Manual(_) => Duration::from_micros(2),
        Time::Real => Duration::from_secs(1),
    };
    assert!(
        got.abs_diff(expected) <= slack,
        "{what}: retry after {got:?}, expected {expected:?}"
    );
}

/// The store's overrides of `sms` (5 per hour) for one phone and for every phone, as an
/// operator sets them: a raise admits exactly the difference and reports the new limit, a cut
/// refuses for as long as the usage takes to leave room, a block refuses everything, the
/// key's own override wins over the policy's, and removing them restores the policy's own
/// counts. Other phones keep theirs throughout.
async fn overrides<St: Store>(
    store: &St,
    overrides: &Overrides,
    time: &Time,
    algorithm: Algorithm,
) {
    let sms = Policy::new("sms", [hourly(5)])
        .unwrap()
        .with_algorithm(algorithm);
    let (vip, other) = (
        Key::from(format!("vip-{algorithm:?}")),
        Key::from(format!("other-{algorithm:?}")),
    );
    let (vip_scope, limits) = (Scope::Key(vip.clone()), |n| {
        Override::Limits(vec![hourly(n)])
    });
    let start = time.now();
    assert_eq!(
        admitted(store, &vip, &sms, 6).await,
        5,
        "{algorithm:?} at 5/1h"
    );

    overrides.set(&sms, &vip_scope, &limits(8)).await.unwrap();
    let first = check(store, &vip, &sms).await;
    assert!(
        first.is_allowed() && first.limit() == 8,
        "{algorithm:?}: {first:?}"
    );
    assert_eq!(
        admitted(store, &vip, &sms, 4).await,
        2,
        "{algorithm:?} raised to 8/1h"
    );
    assert_eq!(
        admitted(store, &other, &sms, 6).await,
        5,
        "{algorithm:?}: another phone"
    );

    overrides.set(&sms, &vip_scope, &limits(3)).await.unwrap();
    let refused = check(store, &vip, &sms).await;
    assert_eq!(refused.limit(), 3);
    let into = Duration::from_micros((time.now().as_micros() % HOUR.as_micros()) as u64);
    let expected = expected_wait(algorithm, 3, 8, time.now() - start, into);
    assert_wait(
        time,
        &refused,
        expected,
        &format!("{algorithm:?} cut to 3/1h"),
    );

    overrides
        .set(&sms, &vip_scope, &Override::Block)
        .await
        .unwrap();
    let blocked = check(store, &vip, &sms).await;
    assert!(!blocked.is_allowed(), "{algorithm:?} blocked: {blocked:?}");
    assert_eq!((blocked.limit(), blocked.retry_after()), (0, None));

    // The policy's own override governs every phone without one of its own.
    overrides.set(&sms, &Scope::All, &limits(7)).await.unwrap();
    assert_eq!(
        admitted(store, &other, &sms, 4).await,
        2,
        "{algorithm:?}: 7/1h for all"
    );
    assert!(
        !check(store, &vip, &sms).await.is_allowed(),
        "the key's own block wins"
    );
    let listed = overrides.list(&sms).await.unwrap();
    assert_eq!(
        listed,
        vec![
            (Scope::All, limits(7)),
            (vip_scope.clone(), Override::Block)
        ]
    );
    assert_eq!(
        overrides.get(&sms, &vip_scope).await.unwrap(),
        Some(Override::Block)
    );

    assert!(overrides.remove(&sms, &vip_scope).await.unwrap());
    assert!(
        !overrides.remove(&sms, &vip_scope).await.unwrap(),
        "removed already"
    );
    let seven = check(store, &vip, &sms).await;
    assert_eq!(
        (seven.is_allowed(), seven.limit()),
        (false, 7),
        "{algorithm:?}"
    );
    assert!(overrides.remove(&sms, &Scope::All).await.unwrap());
    let own = check(store, &vip, &sms).await;
    assert_eq!(
        (own.is_allowed(), own.limit()),
        (false, 5),
        "{algorithm:?} restored"
    );
    assert_eq!(overrides.list(&sms).await.unwrap(), vec![]);
}

#[tokio::test]
async fn overrides_on_memory() {
    for algorithm in ALGORITHMS {
        let (store, time) = memory();
        overrides(&store, &store.overrides(), &time, algorithm).await;
    }
}

#[tokio::test]
async fn overrides_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    for algorithm in ALGORITHMS {
        overrides(&store, &store.overrides(), &Time::Real, algorithm).await;
    }
}

/// Two instances on one Redis: what one sets, the other decides by at once (the override is
/// read in the decision's own script call).
#[tokio::test]
async fn an_override_set_by_one_instance_governs_the_others() {
    let server = RedisServer::start();
    let (a, b): (RedisStore, RedisStore) = (server.store().await, server.store().await);
    let sms = Policy::new("sms", [hourly(5)]).unwrap();
    let phone = Key::from("+447700900123");
    assert_eq!(admitted(&b, &phone, &sms, 6).await, 5);
    let eight = Override::Limits(vec![hourly(8)]);
    a.overrides()
        .set(&sms, &Scope::Key(phone.clone()), &eight)
        .await
        .unwrap();
    assert_eq!(admitted(&b, &phone, &sms, 6).await, 3);
    assert_eq!(
        b.overrides().get(&sms, &Scope::Key(phone)).await.unwrap(),
        Some(eight)
    );
}

#[tokio::test]
async fn overrides_must_keep_the_windows() {
    let store = MemoryStore::new();
    let sms = Policy::new("sms", ["1/1m".parse().unwrap(), hourly(5)]).unwrap();
    let wrong = Override::Limits(vec![hourly(50)]);
    let error = store
        .overrides()
        .set(&sms, &Scope::All, &wrong)
        .await
        .unwrap_err();
    assert!(error.to_string().contains("1m+1h"), "{error}");
    assert_eq!(store.overrides().list(&sms).await.unwrap(), vec![]);
    // Counts the algorithm cannot decide exactly are refused, as a policy of them would be.
    let month = Duration::from_secs(30 * 86_400);
    let budget = Policy::new("tokens", [Limit::new(5_000_000, month).unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let odd = Override::Limits(vec![Limit::new(1_000_003, month).unwrap()]);
    let error = store
        .overrides()
        .set(&budget, &Scope::All, &odd)
        .await
        .unwrap_err();
    assert!(matches!(error, OverrideError::OutOfRange(_)), "{error}");
}

type Body = LayerBody;

/// Sends requests for `key` through `service`, 5 ms apart, until one gets `admitted`; how long
/// that took, or `None` after `within`.
async fn until<S, B>(service: &S, key: &str, admitted: bool, within: Duration) -> Option<Duration>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    let start = tokio::time::Instant::now();
    while start.elapsed() < within {
        if passes(service, key).await == admitted {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

/// Three instances on one Redis, each with its deny cache and leases. After a raise set by one
/// of them, every instance admits again within a second (no cached refusal is repeated), and
/// together they admit exactly the difference; after a cut, no instance admits anything once
/// its store has read the change (a quarter of a second), leases included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_follows_a_change_within_a_second() {
    use tower_redis_ratelimit::store::Leases;

    let server = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::builder(server.url())
            .leases(Leases::new())
            .connect()
            .await
            .unwrap();
        stores.push(store);
    }
    let api = Policy::new("api", ["100/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow);
    let fleet: Vec<_> = stores.iter().map(|s| instance(s.clone(), &api)).collect();
    // Everything below within one fixed window.
    let into = (Time::Real.now().as_micros() % 60_000_000) as u64;
    if into > 20_000_000 {
        tokio::time::sleep(Duration::from_micros(60_050_000 - into)).await;
    }

    // The key's 100 used up through all three; each has now cached a refusal.
    let mut admitted = 0;
    for round in 0..60 {
        for service in &fleet {
            admitted += usize::from(passes(service, "k").await);
        }
        let _ = round;
    }
    assert_eq!(admitted, 100);
    for service in &fleet {
        assert!(!passes(service, "k").await, "refused (and cached)");
    }

    let raise = Override::Limits(vec!["160/1m".parse().unwrap()]);
    stores[0]
        .overrides()
        .set(&api, &Scope::Key(Key::from("k")), &raise)
        .await
        .unwrap();
    for (i, service) in fleet.iter().enumerate() {
        let after = until(service, "k", true, Duration::from_secs(3)).await;
        eprintln!("instance {i} admitted again {after:?} after the raise");
        assert!(
            after.is_some_and(|t| t <= Duration::from_secs(1)),
            "instance {i}: {after:?}"
        );
    }
    let mut more = 3;
    for _ in 0..40 {
        for service in &fleet {
            more += usize::from(passes(service, "k").await);
        }
    }
    assert_eq!(more, 60, "exactly the difference, over the fleet");

    // Another key spent on every instance, which then hold leases of it; cut below its usage.
    let mut spent = 0;
    for _ in 0..10 {
        for service in &fleet {
            spent += usize::from(passes(service, "m").await);
        }
    }
    assert_eq!(spent, 30);
    let seen = cut_to_twenty(&stores, &api, &Key::from("m")).await;
    eprintln!("every instance saw the cut within {seen:?}");
    let mut late = 0;
    for _ in 0..20 {
        for service in &fleet {
            late += usize::from(passes(service, "m").await);
        }
    }
    assert_eq!(late, 0, "admitted after the cut was followed");
}

/// Cuts `key` of `api` to `20/1m` through the second of `stores`, then waits until every store
/// has seen the change (its watch reads the limits version every 250 ms; from then on the
/// leases it holds are spent no more); returns how long that took.
async fn cut_to_twenty(stores: &[RedisStore], api: &Policy, key: &Key) -> Duration {
    let cut = Override::Limits(vec!["20/1m".parse().unwrap()]);
    let before: Vec<u64> = stores.iter().map(|s| s.limits_version()).collect();
    let scope = Scope::Key(key.clone());
    stores[1].overrides().set(api, &scope, &cut).await.unwrap();
    let set = tokio::time::Instant::now();
    for (i, store) in stores.iter().enumerate() {
        while store.limits_version() == before[i] {
            let waited = set.elapsed();
            assert!(
                waited < Duration::from_secs(3),
                "instance {i} never saw the cut"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    set.elapsed()
}

/// The same cut on the sliding log, whose leases are events of the log: once every instance has
/// seen the cut, nothing more is admitted from the leases they held, nor by Redis, which reads
/// the 30 units spent under the cut's 20 (in the window a leasing store reads, a lease period
/// longer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_on_the_sliding_log_follows_a_cut_of_its_leases() {
    use tower_redis_ratelimit::store::Leases;

    let server = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::builder(server.url()).leases(Leases::new());
        stores.push(store.connect().await.unwrap());
    }
    let api = Policy::new("api", ["100/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let fleet: Vec<_> = stores.iter().map(|s| instance(s.clone(), &api)).collect();
    let mut spent = 0;
    for _ in 0..10 {
        for service in &fleet {
            spent += usize::from(passes(service, "m").await);
        }
    }
    assert_eq!(spent, 30);
    let key = Key::from("m");
    let leased = stores
        .iter()
        .filter(|s| s.check_now(&key, &api, 0).is_some());
    eprintln!("{} of 3 instances hold a lease of the key", leased.count());
    cut_to_twenty(&stores, &api, &key).await;
    let mut late = 0;
    for _ in 0..20 {
        for service in &fleet {
            late += usize::from(passes(service, "m").await);
        }
    }
    assert_eq!(late, 0, "admitted after the cut was followed");
}

/// A blocked key through the layer: 429 with `RateLimit-Limit`-style limit 0, no `Retry-After`
/// (no wait helps), and a body that says so; other keys pass.
#[tokio::test]
async fn a_blocked_key_is_answered_429_without_retry_after() {
    use tower::ServiceExt;

    let store = MemoryStore::new();
    let api = Policy::new("api", ["5/1m".parse().unwrap()]).unwrap();
    let layer = tower_redis_ratelimit::RateLimitLayer::builder()
        .policy(api.clone())
        .key(api_key())
        .store(store.clone())
        .build()
        .unwrap();
    // Its own service rather than `served`: the test reads the refusal's body.
    let service = tower::ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: http::Request<Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::default()))
        }));
    let block = Scope::Key(Key::from("abuser"));
    store
        .overrides()
        .set(&api, &block, &Override::Block)
        .await
        .unwrap();
    let refused = service.clone().oneshot(keyed("abuser")).await.unwrap();
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().get("retry-after").is_none());
    let body = http_body_util::BodyExt::collect(refused.into_body())
        .await
        .unwrap();
    assert_eq!(body.to_bytes(), "Too Many Requests: blocked\n");
    assert!(passes(&service, "someone").await);
    store.overrides().remove(&api, &block).await.unwrap();
    assert!(passes(&service, "abuser").await);
}

/// A rolling deploy that changes a named policy's counts: old instances run `api` at 10 per
/// hour, new ones at 20 (an hour, so that no window ends during the test). They share one state (the name and window are the same), and each
/// refuses at its own counts: together they never admit more than the larger count, and the
/// old ones stop at theirs, whoever spent the usage.
#[tokio::test]
async fn instances_with_other_counts_for_one_name_share_the_state() {
    let server = RedisServer::start();
    let (old, new): (RedisStore, RedisStore) = (server.store().await, server.store().await);
    let api = |count| Policy::new("api", [hourly(count)]);
    let (ten, twenty) = (api(10).unwrap(), api(20).unwrap());
    assert_eq!(
        old.redis_key(&Key::from("c"), &ten),
        new.redis_key(&Key::from("c"), &twenty)
    );
    for algorithm in ALGORITHMS {
        let key = Key::from(format!("client-{algorithm:?}"));
        let (ten, twenty) = (
            ten.clone().with_algorithm(algorithm),
            twenty.clone().with_algorithm(algorithm),
        );
        assert_eq!(admitted(&old, &key, &ten, 6).await, 6, "{algorithm:?}");
        assert_eq!(
            admitted(&new, &key, &twenty, 20).await,
            14,
            "{algorithm:?}: 20 in all"
        );
        assert_eq!(
            admitted(&old, &key, &ten, 5).await,
            0,
            "{algorithm:?}: old at its 10"
        );
    }
}

/// A client key over 128 bytes (an API key in a header, say) is kept hashed by the layer's
/// extractor; an override set for the key as the operator knows it governs that client, and
/// only that client.
async fn long_key<St: Store>(store: St, overrides: Overrides) {
    let api = Policy::new("api", ["5/1h".parse().unwrap()]).unwrap();
    let layer = tower_redis_ratelimit::RateLimitLayer::builder()
        .policy(api.clone())
        .key(api_key())
        .store(store)
        .build()
        .unwrap();
    let service = served(layer);
    let long = format!("sk_live_{}", "x".repeat(300));
    let neighbour = format!("sk_live_{}y", "x".repeat(299));
    let scope = Scope::Key(Key::from(long.as_str()));
    overrides.set(&api, &scope, &Override::Block).await.unwrap();
    assert!(!passes(&service, &long).await, "the blocked client");
    assert!(passes(&service, &neighbour).await, "another long key");
    assert!(overrides.remove(&api, &scope).await.unwrap());
    assert!(passes(&service, &long).await);
}

#[tokio::test]
async fn an_override_for_a_key_over_128_bytes_governs_that_client_on_memory() {
    let store = MemoryStore::new();
    long_key(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn an_override_for_a_key_over_128_bytes_governs_that_client_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    long_key(store.clone(), store.overrides()).await;
}

/// The limits version never goes back: after a failover to a replica whose clock is behind,
/// or a clock step, a change still gets a later version than the last one, which the lanes'
/// stamps may hold, so a write is not taken for an earlier one and dropped, and the epoch
/// stays. The bump script run as the store runs it, with the version an hour ahead of Redis'
/// clock.
#[tokio::test]
async fn the_limits_version_never_goes_back() {
    use fred::prelude::*;

    let server = RedisServer::start();
    let admin = common::client(&server.url()).await;
    let script = [
        include_str!("../src/store/redis/scripts/limits_version.lua"),
        include_str!("../src/store/redis/scripts/limits_bump.lua"),
    ]
    .concat();
    let ahead = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
        + 3_600_000_000;
    let key = "t:{overrides}:limits";
    let _: () = admin
        .hset(
            key,
            [("version", ahead.to_string()), ("epoch", "1.2".to_owned())],
        )
        .await
        .unwrap();
    let mut versions = Vec::new();
    for _ in 0..3 {
        let reply: (u64, String) = admin.eval(script.as_str(), vec![key], ()).await.unwrap();
        versions.push(reply);
    }
    let epoch = || "1.2".to_owned();
    assert_eq!(
        versions,
        [
            (ahead + 1, epoch()),
            (ahead + 2, epoch()),
            (ahead + 3, epoch())
        ]
    );
}

/// One scope holds one override, for a key, a plan and the whole policy: counts set after a
/// block replace it and a block set after counts replaces them; the last one governs, and
/// `get` shows it.
async fn last_write_governs<St: Store>(store: &St, overrides: &Overrides) {
    let api = Policy::new("api", [hourly(5)]).unwrap();
    let cases = [
        (Scope::Key(Key::from("k")), api.clone(), "k"),
        (Scope::Plan("free".into()), api.clone().on_plan("free"), "p"),
        (Scope::All, api.clone(), "a"),
    ];
    let counts = |n| Override::Limits(vec![hourly(n)]);
    for (scope, policy, key) in cases {
        let key = Key::from(key);
        let steps = [
            (Override::Block, 3, 0),
            (counts(8), 10, 8),
            (Override::Block, 2, 0),
            (counts(9), 3, 1),
        ];
        for (to, tries, expected) in steps {
            overrides.set(&api, &scope, &to).await.unwrap();
            let got = overrides.get(&policy, &scope).await.unwrap();
            assert_eq!(got.as_ref(), Some(&to), "{scope}");
            let passed = admitted(store, &key, &policy, tries).await;
            assert_eq!(passed, expected, "{scope} after {to:?}");
        }
        assert!(overrides.remove(&api, &scope).await.unwrap());
    }
}

#[tokio::test]
async fn the_last_override_of_a_scope_governs_on_memory() {
    let (store, _) = memory();
    last_write_governs(&store, &store.overrides()).await;
}

#[tokio::test]
async fn the_last_override_of_a_scope_governs_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    last_write_governs(&store, &store.overrides()).await;
}

/// A write that lands after one stamped later changes nothing: an operator told that a write
/// may have landed (`OverrideError::Unconfirmed`), who then sets or removes the override
/// again, is never undone by the first write arriving late. The write script run as the store
/// runs it on a single Redis, with the stamps the store takes before sending (before, the
/// stamp was taken when the script ran, so the late write always looked newest).
#[tokio::test]
async fn a_write_stamped_earlier_never_undoes_one_stamped_later() {
    use fred::prelude::*;

    let server = RedisServer::start();
    let admin = common::client(&server.url()).await;
    let script = [
        include_str!("../src/store/redis/scripts/limits_version.lua"),
        include_str!("../src/store/redis/scripts/override_write.lua"),
    ]
    .concat();
    let keys = vec!["t:overrides", "t:overrides:stamps", "t:{overrides}:limits"];
    let write = |value: &'static str, stamp: u64| {
        let (admin, script, keys) = (admin.clone(), script.clone(), keys.clone());
        async move {
            let args = vec![
                "t:{api:k}:fw:1h".to_owned(),
                value.to_owned(),
                stamp.to_string(),
            ];
            let (changed, _, _): (i64, u64, String) =
                admin.eval(script.as_str(), keys, args).await.unwrap();
            let now: Option<String> = admin.hget("t:overrides", "t:{api:k}:fw:1h").await.unwrap();
            (changed, now)
        }
    };
    // The second operator's write (stamp 20) lands first; the first one's (stamp 10) late.
    assert_eq!(
        write("ninety-nine", 20).await,
        (1, Some("ninety-nine".into()))
    );
    assert_eq!(write("eleven", 10).await, (-1, Some("ninety-nine".into())));
    // A removal stamped later than a write that lands after it: the write is refused too.
    assert_eq!(write("", 30).await, (1, None));
    assert_eq!(write("eleven", 25).await, (-1, None));
}
