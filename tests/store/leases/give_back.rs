//! Units come back: an idle key and `drain()` give theirs back; with Redis gone, leases are
//! served until they expire; a reset, a restart or a stall never lets an old give-back free new
//! units, and units stranded by stalls come back.

use super::*;
use tower_redis_ratelimit::test_util::Engine;
use tower_redis_ratelimit::test_util::{pool, redis_key};

/// The count of the fixed window now in Redis for `key` (0 when none).
async fn counted(client: &Client, store: &RedisStore, key: &Key, policy: &Policy) -> i64 {
    let raw: Option<Vec<u8>> = client.get(redis_key(store, key, policy)).await.unwrap();
    raw.map_or(0, |raw| i64::from_le_bytes(raw[8..16].try_into().unwrap()))
}

/// Sends `n` requests at 200 per second, so that the key leases; returns those admitted.
async fn busy(store: &RedisStore, key: &Key, policy: &Policy, n: usize) -> i64 {
    let mut admitted = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for _ in 0..n {
        tick.tick().await;
        if decide(store, key, policy, 60_000_000).await.0.unwrap() {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_key_gives_its_units_back_within_one_period() {
    let server = RedisServer::start();
    let client = server.client().await;
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("idle"), fixed("10000/1m"));
    let admitted = busy(&store, &key, &policy, 100).await;
    let held = counted(&client, &store, &key, &policy).await - admitted;
    assert!(held > 0, "the busy key holds a lease ({held} units)");
    let idle_since = tokio::time::Instant::now();
    loop {
        if counted(&client, &store, &key, &policy).await == admitted {
            break;
        }
        assert!(
            idle_since.elapsed() < Leases::DEFAULT_PERIOD + Duration::from_millis(300),
            "{held} leased units not back after {:?}",
            idle_since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "{held} units back {:?} after the last request",
        idle_since.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_gives_back_every_unit_and_takes_no_more() {
    let server = RedisServer::start();
    let client = server.client().await;
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("drain"), fixed("10000/1m"));
    let admitted = busy(&store, &key, &policy, 100).await;
    let held = counted(&client, &store, &key, &policy).await - admitted;
    assert!(held > 0, "the busy key holds a lease");
    assert_eq!(store.drain().await.unwrap(), held as u64);
    assert_eq!(counted(&client, &store, &key, &policy).await, admitted);
    // Afterwards every request is counted in Redis as it is decided.
    let more = busy(&store, &key, &policy, 20).await;
    assert_eq!(
        counted(&client, &store, &key, &policy).await,
        admitted + more
    );
    assert_eq!(store.drain().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_leases_are_served_until_they_expire_then_the_failure_mode() {
    let mut server = RedisServer::start();
    let store = leasing(server.url()).await;
    let policy = Policy::new("outage", ["100000/10s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let key = Key::from("outage");
    busy(&store, &key, &policy, 300).await;
    tokio::task::spawn_blocking(move || {
        server.kill();
        server
    });
    // Redis may take a moment to be gone: count from when the kill was asked.
    let killed = tokio::time::Instant::now();
    let (mut served, mut failed, mut served_late) = (0, 0, 0);
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    while killed.elapsed() < Duration::from_secs(3) {
        tick.tick().await;
        let asked = tokio::time::Instant::now();
        let (outcome, _, _) = decide(&store, &key, &policy, 1).await;
        let took = asked.elapsed();
        assert!(
            took <= Duration::from_millis(200 + 300),
            "a decision took {took:?}"
        );
        match outcome {
            Ok(true) => {
                served += 1;
                if asked - killed > Leases::DEFAULT_PERIOD + Duration::from_millis(100) {
                    served_late += 1;
                }
            }
            Ok(false) => panic!("refused far below the limit"),
            Err(_) => failed += 1,
        }
    }
    eprintln!("after the kill: {served} served from leases, {failed} failed");
    // Served until 250 ms after the last answered read of the limits version, which is sent
    // every 125 ms: at least 125 ms of 5 ms ticks.
    assert!(served > 15, "leased units are served while Redis is gone");
    assert_eq!(served_late, 0, "nothing is served once the leases expired");
    assert!(
        failed > 100,
        "then decisions fail and the failure mode applies"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_does_not_let_old_give_backs_free_new_units() {
    a_reset_does_not_let_old_give_backs_free(fixed("100/1m")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_does_not_let_old_give_backs_free_new_units_on_the_log() {
    a_reset_does_not_let_old_give_backs_free(log("100/1m")).await;
}

/// The units `key` holds in Redis under `policy`: a fixed window's count, or the log's.
async fn units_held(client: &Client, store: &RedisStore, key: &Key, policy: &Policy) -> i64 {
    match policy.algorithm() {
        Algorithm::SlidingLog => logged(client, store, key, policy, None).await as i64,
        _ => counted(client, store, key, policy).await,
    }
}

async fn a_reset_does_not_let_old_give_backs_free(policy: Policy) {
    let server = RedisServer::start();
    let client = server.client().await;
    let (a, b) = (leasing(server.url()).await, leasing(server.url()).await);
    let key = Key::from("reset");
    within_one_minute(Duration::from_secs(20)).await;
    // A serves the key until it holds a lease.
    let warm = paced(&a, &key, &policy, 30, Duration::from_millis(5)).await;
    let leased = a.check_now(&key, &policy, 1);
    assert!(
        matches!(leased, Some(Ok(ref d)) if d.is_allowed()),
        "A holds a lease after {warm} admitted: {leased:?}"
    );
    let held = units_held(&client, &a, &key, &policy).await - warm as i64 - 1;
    a.reset(&key, &policy).await.unwrap();
    // Only B serves now, 200 requests over 2 s: A's sweeper gives its idle key's units back
    // (after a quarter period, 250 ms) in between.
    let after = paced(&b, &key, &policy, 200, Duration::from_millis(10)).await;
    eprintln!(
        "A: {warm} + 1 admitted, {held} units held at the reset; after the reset B admitted \
         {after} of 200 under 100/1m"
    );
    assert!(
        after <= 100,
        "B admitted {after} under 100/1m after the reset (A held {held} units when it reset)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_does_not_let_old_give_backs_free_new_units() {
    a_restart_does_not_let_old_give_backs_free(fixed("100/1m")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_does_not_let_old_give_backs_free_new_units_on_the_log() {
    a_restart_does_not_let_old_give_backs_free(log("100/1m")).await;
}

async fn a_restart_does_not_let_old_give_backs_free(policy: Policy) {
    let mut server = RedisServer::start();
    // A 2 s period: an idle key gives its units back after 500 ms, well after the restart
    // is over (which leaves old give-backs to land on the new state, the case at hand).
    let leases = Leases::new().period(Duration::from_secs(2));
    let timeout = Duration::from_millis(200);
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..3).map(|_| leasing_with(server.url(), leases, timeout)))
            .await;
    let key = Key::from("restart");
    within_one_minute(Duration::from_secs(20)).await;
    // The first two serve the key until each holds a lease.
    let warm = futures::future::join_all(
        stores[..2]
            .iter()
            .map(|s| paced(s, &key, &policy, 30, Duration::from_millis(5))),
    )
    .await;
    let client = server.client().await;
    let held =
        units_held(&client, &stores[0], &key, &policy).await - warm.iter().sum::<u64>() as i64;
    drop(client);
    let asked = tokio::time::Instant::now();
    let mut server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    // Until every connection of every store answers again (without a decision, which would
    // trip a store's breaker).
    for store in &stores {
        for connection in pool(store).clients() {
            loop {
                let ping = connection.ping::<String>(None);
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(100), ping).await {
                    break;
                }
                assert!(asked.elapsed() < Duration::from_secs(10), "no reconnection");
            }
        }
    }
    let back = asked.elapsed();
    // Only the third serves: 200 requests over 2 s.
    let after = paced(&stores[2], &key, &policy, 200, Duration::from_millis(10)).await;
    eprintln!(
        "warm: {warm:?} admitted, {held} units held; restarted and reconnected in {back:?}; \
         then the third store admitted {after} of 200 under 100/1m"
    );
    assert!(
        after <= 100,
        "the third store admitted {after} under 100/1m after the restart ({held} units were \
         held in leases when Redis restarted)"
    );
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_a_fetch_in_flight() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let client = server.client().await;
    // A budget well over the stall, so that the fetch is answered rather than timed out.
    let store = leasing_with(server.url(), Leases::new(), Duration::from_secs(1)).await;
    let (key, policy) = (Key::from("drain-in-flight"), fixed("1000/1m"));
    within_one_minute(Duration::from_secs(20)).await;
    let mut admitted = paced(&store, &key, &policy, 100, Duration::from_millis(5)).await;
    let held = counted(&client, &store, &key, &policy).await - admitted as i64;
    assert!(held > 0, "the busy key holds a lease");
    // Redis sleeps for 150 ms; meanwhile the lease is spent, which fetches the next one, and a
    // request that the lease cannot answer goes to Redis.
    let sleeper = server.client().await;
    let stalled = tokio::spawn(async move { stall(&sleeper, 0.15).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut from_lease = 0;
    while let Some(outcome) = store.check_now(&key, &policy, 1) {
        from_lease += 1;
        admitted += u64::from(outcome.unwrap().is_allowed());
        assert!(from_lease <= 1000, "the lease never ran out");
    }
    let asking = {
        let (store, key, policy) = (store.clone(), key.clone(), policy.clone());
        tokio::spawn(async move { store.check(&key, &policy, 1).await })
    };
    tokio::task::yield_now().await;
    let drained = store.drain().await;
    let asked = asking.await.unwrap();
    stalled.await.unwrap();
    admitted += u64::from(matches!(asked, Ok(ref d) if d.is_allowed()));
    // Whatever fetch the spending started in the background has landed by now (Redis answers
    // at once after the stall); the sweeper would give an idle key's units back only 250 ms
    // after its last request, well after this.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let count = counted(&client, &store, &key, &policy).await;
    let after = store.check_now(&key, &policy, 1);
    eprintln!(
        "{held} units held before the stall, {from_lease} spent from leases during it; drain \
         answered {drained:?}; the request sent during the stall: {asked:?}; {admitted} \
         admitted, {count} counted in Redis; check_now after the drain: {after:?}"
    );
    assert_eq!(
        count,
        admitted as i64,
        "after drain() and every request answered, Redis counts {count} units for {admitted} \
         admitted ({} units leased and never given back; drain answered {drained:?})",
        count - admitted as i64
    );
    assert!(
        after.is_none(),
        "after drain(), check_now still decides from a lease: {after:?}"
    );
    // The lease ran out before the drain, so every unit it gives back is the fetch's: drain()
    // waited for it rather than leave it to land on its own.
    assert!(
        matches!(drained, Ok(units) if units > 0),
        "drain() answered {drained:?} while a lease was on its way"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_stranded_by_stalls_come_back() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let client = server.client().await;
    let stores: Vec<RedisStore> = futures::future::join_all(
        (0..4).map(|_| leasing_with(server.url(), Leases::new(), Duration::from_millis(200))),
    )
    .await;
    let (key, policy) = (Key::from("stalls"), fixed("6000/1m"));
    // About 12 s from the first request to the count: all of it within one fixed window.
    within_one_minute(Duration::from_secs(20)).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for store in &stores {
        let (store, key, policy, stop) = (store.clone(), key.clone(), policy.clone(), stop.clone());
        // 100 requests per second per instance.
        load.push(tokio::spawn(async move {
            let (mut sent, mut admitted) = (0u64, 0u64);
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tick.tick().await;
                sent += 1;
                admitted += u64::from(admit(&store, &key, &policy, 1).await);
            }
            (sent, admitted)
        }));
    }
    // Four stalls of 1.2 s, a second apart.
    let sleeper = server.client().await;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        stall(&sleeper, 1.2).await;
    }
    let last_stall_ended = tokio::time::Instant::now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut per_store = Vec::new();
    for task in load {
        per_store.push(task.await.unwrap());
    }
    // One lease period and a margin after the last stall and the last request: every lease
    // has expired or gone idle, and its unspent units are back.
    tokio::time::sleep_until(
        last_stall_ended + Leases::DEFAULT_PERIOD + Duration::from_millis(700),
    )
    .await;
    let admitted: u64 = per_store.iter().map(|&(_, a)| a).sum();
    let count = counted(&client, &stores[0], &key, &policy).await;
    let stranded = count - admitted as i64;
    eprintln!(
        "(sent, admitted) per instance: {per_store:?}; {admitted} admitted, {count} counted in \
         Redis: {stranded} units counted and never admitted"
    );
    // Never the other way: a give-back applied twice (one whose reply was lost, sent again)
    // would leave Redis counting less than the fleet admitted.
    assert!(
        stranded >= 0,
        "Redis counts {count} units for {admitted} admitted: {} admitted units are not counted",
        -stranded
    );
    assert!(
        stranded <= 60,
        "{stranded} units counted in Redis and never admitted ({count} counted, {admitted} \
         admitted) 1.7 s after four 1.2 s stalls; at most 60 (1 % of 6000/1m) may stay"
    );
}
