//! Leases that pay for themselves: a key takes leases only while its recent use makes a lease
//! serve several requests, goes back to decisions in Redis when it cools (its units given
//! back, its book entry gone), and a cold key never gets a book entry at all. Counts of script
//! calls come from Redis (`INFO commandstats`), entries from the store's lease book.

use super::*;
use tower_redis_ratelimit::test_util::leasing_keys;

/// Sends `n` requests of `key`, one every `every`, as the layer does; returns those admitted
/// and the script calls Redis ran meanwhile.
async fn paced_calls(
    client: &Client,
    store: &RedisStore,
    (key, policy): (&Key, &Policy),
    n: usize,
    every: Duration,
) -> (u64, u64) {
    let before = evalsha_calls(client).await;
    let admitted = paced(store, key, policy, n, every).await;
    (admitted, evalsha_calls(client).await - before)
}

/// A key at 20 units per lease period takes leases, and Redis runs fewer than one script call
/// per five requests; a key at 2 units per period (the warm key of 20 requests a second) never
/// takes one: every request is one call, no unit is held beyond those admitted, and the lease
/// book stays empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_leases_at_twenty_units_a_period_and_never_at_two() {
    within_one_minute(Duration::from_secs(10)).await;
    let server = RedisServer::start();
    let client = server.client().await;
    let store = tenth_of_a_second(server.url()).await;
    let policy = fixed("1000000/1m");
    let warm = Key::from("warm");
    let mut admitted = 0;
    let before = evalsha_calls(&client).await;
    for _ in 0..40 {
        admitted += u64::from(admit(&store, &warm, &policy, 1).await);
        assert_eq!(leasing_keys(&store), 0, "the warm key has a lease entry");
        assert_eq!(fixed_count(&client, &store, &warm, &policy).await, admitted);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let calls = evalsha_calls(&client).await - before;
    eprintln!("warm key: {admitted} admitted, {calls} script calls");
    assert_eq!((admitted, calls), (40, 40));
    let hot = Key::from("hot");
    let every = Duration::from_millis(5);
    let (admitted, calls) = paced_calls(&client, &store, (&hot, &policy), 400, every).await;
    let per_request = calls as f64 / 400.0;
    eprintln!("hot key: {admitted} admitted, {calls} script calls, {per_request:.3} a request");
    assert_eq!(admitted, 400);
    assert_eq!(leasing_keys(&store), 1, "the hot key leases");
    assert!(per_request < 0.2, "{calls} script calls for 400 requests");
}

/// A hot key that cools to 2 requests a second stops leasing: after its first slow seconds
/// every request is one script call, what it held is back in Redis, and its book entry is
/// gone (so is its leasing bit: the next requests go straight to Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooling_key_gives_its_leases_back_and_goes_to_redis() {
    within_one_minute(Duration::from_secs(12)).await;
    let server = RedisServer::start();
    let client = server.client().await;
    let store = tenth_of_a_second(server.url()).await;
    let (key, policy) = (Key::from("cooling"), fixed("1000000/1m"));
    let every = Duration::from_millis(5);
    let (mut admitted, calls) = paced_calls(&client, &store, (&key, &policy), 200, every).await;
    let held = fixed_count(&client, &store, &key, &policy).await - admitted;
    eprintln!("hot: {admitted} admitted, {calls} script calls, {held} units held");
    assert!(held > 0 && leasing_keys(&store) == 1, "the hot key leases");
    let slow = Duration::from_millis(500);
    let (cooling, _) = paced_calls(&client, &store, (&key, &policy), 2, slow).await;
    admitted += cooling;
    tokio::time::sleep(slow).await;
    let (cold, calls) = paced_calls(&client, &store, (&key, &policy), 4, slow).await;
    admitted += cold;
    let count = fixed_count(&client, &store, &key, &policy).await;
    let entries = leasing_keys(&store);
    eprintln!("cold: {cold} admitted, {calls} script calls; Redis counts {count} of {admitted}");
    assert_eq!(calls, 4, "one call a request: no lease, no give-back");
    assert_eq!(count, admitted, "units held after cooling");
    assert_eq!(entries, 0, "the cooled key keeps its lease entry");
}

/// 10 000 keys at about one request a second each: every request is decided in Redis, and
/// the lease book never holds an entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_keys_leave_the_lease_book_empty() {
    let server = RedisServer::start();
    let store = Arc::new(tenth_of_a_second(server.url()).await);
    let policy = Arc::new(gcra("1000/1s"));
    let mut admitted = 0;
    let mut most = 0;
    for _ in 0..2 {
        let started = tokio::time::Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for worker in 0..50 {
            let (store, policy) = (Arc::clone(&store), Arc::clone(&policy));
            tasks.spawn(async move {
                let mut admitted = 0;
                let mut most = 0;
                for i in (worker..10_000).step_by(50) {
                    let key = Key::from(format!("c{i}"));
                    admitted += u64::from(admit(&store, &key, &policy, 1).await);
                    most = most.max(leasing_keys(&store));
                }
                (admitted, most)
            });
        }
        while let Some(done) = tasks.join_next().await {
            let (one, many) = done.unwrap();
            (admitted, most) = (admitted + one, most.max(many));
        }
        let took = started.elapsed();
        eprintln!("10 000 keys once each in {took:?}");
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(took)).await;
    }
    eprintln!("{admitted} of 20 000 admitted; the lease book held at most {most} keys");
    assert_eq!(admitted, 20_000);
    assert_eq!(most, 0, "cold keys took lease entries");
    assert_eq!(leasing_keys(&store), 0);
}
