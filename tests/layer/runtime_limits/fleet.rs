//! A fleet of instances follows a change of limits within a second, leases included.

use super::*;
use tower_redis_ratelimit::test_util::Engine;

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
    // Everything below within one fixed window: it takes under a second alone, and at least
    // 10 s of the window are left.
    let into = (Time::Real.now().as_micros() % 60_000_000) as u64;
    if into > 50_000_000 {
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
