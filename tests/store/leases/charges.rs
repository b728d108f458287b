//! Charges and refunds under a lease: a charge that fills the key ends the lease, on this
//! instance and the others, and a refund of a leased request frees its unit.

use super::*;
use tower_redis_ratelimit::test_util::Engine;

/// A request of the usage-based layer: a reservation of 1 decided as the layer decides it
/// (`check_now`, else `check`); if admitted, its `usage` beyond the reservation charged with
/// `Store::settle`, as the layer does when the body ends, awaited here so that its reply is
/// read before the next request. Whether it was admitted.
async fn used(store: &RedisStore, key: &Key, policy: &Policy, usage: u64) -> bool {
    let decision = match store.check_now(key, policy, 1) {
        Some(outcome) => outcome,
        None => store.check(key, policy, 1).await,
    };
    let Ok(decision) = decision else {
        return false;
    };
    if !decision.is_allowed() {
        return false;
    }
    if let Some(charge) = Settlement::charge(&decision, usage.saturating_sub(1)) {
        store.settle(key, policy, charge).await.expect("settled");
    }
    true
}

/// Warms `key` on `store` until a lease answers for it, then admits one request from the lease
/// and charges it `usage` in all; returns how many requests the warming admitted.
async fn warm_then_charge(store: &RedisStore, key: &Key, policy: &Policy, usage: u64) -> u64 {
    let warmed = paced(store, key, policy, 100, Duration::from_millis(5)).await;
    let decision = store
        .check_now(key, policy, 1)
        .expect("the busy key holds a lease")
        .expect("the lease answers");
    assert!(decision.is_allowed());
    let charge = Settlement::charge(&decision, usage - 1).unwrap();
    store.settle(key, policy, charge).await.expect("settled");
    warmed + 1
}

/// The case: `1000/1m`, a warm key holding a lease, one request charged 100 000 (the
/// key's remaining drops to 0), then requests of usage 500. Without leases none of them is
/// admitted; the leases must not admit any either, once the charge's reply is read.
async fn a_charge_that_fills_the_key_ends_the_lease(algorithm: Algorithm) {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let policy = named("filled", "1000/1m", algorithm);
    let key = Key::from(format!("filled-{algorithm:?}"));
    // About 1 s from the first request to the last: all of it within one fixed window.
    within_one_minute(Duration::from_secs(10)).await;
    let warmed = warm_then_charge(&store, &key, &policy, 100_000).await;
    let mut admitted = 0;
    for _ in 0..200 {
        admitted += u64::from(used(&store, &key, &policy, 500).await);
    }
    eprintln!(
        "{algorithm:?}: {warmed} admitted warming, the last charged 100 000; then {admitted} \
         of 200 requests of usage 500 admitted ({} units over)",
        admitted * 500
    );
    assert_eq!(
        admitted,
        0,
        "{algorithm:?}: {admitted} requests of usage 500 admitted after a charge filled the key \
         ({} units past the limit)",
        admitted * 500
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_gcra_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::Gcra).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_fixed_window_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::FixedWindow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_sliding_window_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::SlidingWindow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_a_sliding_log_key_ends_the_lease() {
    a_charge_that_fills_the_key_ends_the_lease(Algorithm::SlidingLog).await;
}

/// Two instances hold leases of one key; a charge on the first fills it. The first admits
/// nothing more. The second did not see the charge: it admits from its lease until the reply
/// to its own first charge after the fill comes back, so with four clients each waiting for
/// its request's settlement before the next, at most four requests (one per client). Without
/// the settlement's reply ending its lease, it would spend the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_stops_at_its_own_first_charge_after_the_fill() {
    let server = RedisServer::start();
    let (first, second) = (leasing(server.url()).await, leasing(server.url()).await);
    let policy = gcra("1000/1m");
    let key = Key::from("filled-by-another");
    // Both instances busy (an idle key's lease is given back after a quarter period).
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for _ in 0..100 {
        tick.tick().await;
        admit(&first, &key, &policy, 1).await;
        admit(&second, &key, &policy, 1).await;
    }
    let decision = first
        .check_now(&key, &policy, 1)
        .expect("the first holds a lease");
    assert!(
        second.check_now(&key, &policy, 1).is_some(),
        "the second instance holds a lease"
    );
    let charge = Settlement::charge(&decision.unwrap(), 99_999).unwrap();
    first.settle(&key, &policy, charge).await.expect("settled");
    const CLIENTS: u64 = 4;
    let clients = (0..CLIENTS).map(|_| {
        let (store, key, policy) = (second.clone(), key.clone(), policy.clone());
        tokio::spawn(async move {
            let mut admitted = 0u64;
            for _ in 0..50 {
                admitted += u64::from(used(&store, &key, &policy, 500).await);
            }
            admitted
        })
    });
    let per_client: Vec<u64> = futures::future::join_all(clients)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let admitted_second: u64 = per_client.iter().sum();
    let mut admitted_first = 0;
    for _ in 0..50 {
        admitted_first += u64::from(used(&first, &key, &policy, 500).await);
    }
    eprintln!(
        "after the first instance's charge filled the key: {admitted_first} of 50 admitted by \
         it, {admitted_second} of 200 by the second instance ({per_client:?} per client)"
    );
    assert_eq!(admitted_first, 0, "the instance that saw the fill admitted");
    assert!(
        admitted_second <= CLIENTS,
        "the second instance admitted {admitted_second} requests of usage 500 after the fill; \
         at most {CLIENTS}, one per client waiting for its settlement"
    );
}

/// The charge lands while a lease fetch is on its way: Redis is stalled, each key's lease is
/// spent, which sends its next fetch, and the charge is sent behind it. Whichever reply is read
/// first, no unit granted before the charge is spent after its reply: a fetch that ran before
/// the charge and lands after its reply lands into a key already marked full, and one that ran
/// after it found no room. Thirty keys, to meet both orders of the replies. (The order that
/// needs `Entry::granted` to check the fill is met in some runs only; `book.rs` pins it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_landing_during_a_lease_fetch_ends_that_lease_too() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    // A budget well over the stall, so that nothing times out.
    let store = leasing_with(server.url(), Leases::new(), Duration::from_secs(1)).await;
    let policy = gcra("1000/1m");
    let keys: Vec<Key> = (0..30)
        .map(|i| Key::from(format!("fetch-in-flight-{i}")))
        .collect();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for _ in 0..100 {
        tick.tick().await;
        for key in &keys {
            admit(&store, key, &policy, 1).await;
        }
    }
    let sleeper = server.client().await;
    let stalled = tokio::spawn(async move { stall(&sleeper, 0.1).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut charges = Vec::new();
    for key in &keys {
        let last = store
            .check_now(key, &policy, 1)
            .expect("the busy key holds a lease")
            .unwrap();
        // Spending the lease sends the next fetch, which waits behind the stall.
        while store.check_now(key, &policy, 1).is_some() {}
        charges.push(Settlement::charge(&last, 99_999).unwrap());
    }
    // The fetches go first; the charges queue behind them.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let settled = keys.iter().zip(charges).map(|(key, charge)| {
        let (store, key, policy) = (store.clone(), key.clone(), policy.clone());
        async move { store.settle(&key, &policy, charge).await }
    });
    for result in futures::future::join_all(settled).await {
        result.expect("settled");
    }
    stalled.await.unwrap();
    let mut after = Vec::new();
    for key in &keys {
        let mut admitted = 0;
        for _ in 0..20 {
            admitted += u64::from(used(&store, key, &policy, 500).await);
        }
        after.push(admitted);
    }
    eprintln!("admitted after the charge's reply, per key: {after:?}");
    assert!(
        after.iter().all(|&n| n == 0),
        "requests admitted from leases after a charge filled the key, per key: {after:?}"
    );
}

/// A refund of a request admitted from a lease (the layer's outcome counting, a usage
/// reservation not used) takes its unit off the lease's event: the log holds one unit less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_of_a_leased_request_frees_its_unit_on_the_log() {
    let server = RedisServer::start();
    let client = server.client().await;
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("refund"), log("1000/1m"));
    paced(&store, &key, &policy, 100, Duration::from_millis(5)).await;
    let decision = store
        .check_now(&key, &policy, 1)
        .expect("the busy key holds a lease")
        .unwrap();
    assert!(decision.is_allowed());
    let refund = Settlement::refund(&decision, 1).unwrap();
    // The lease's event: the time the decision says it was recorded at.
    let at = recorded_micros(&decision);
    assert!(at.is_some(), "{decision:?}");
    let before = logged(&client, &store, &key, &policy, at).await;
    store.settle(&key, &policy, refund).await.unwrap();
    let after = logged(&client, &store, &key, &policy, at).await;
    assert_eq!(
        after + 1,
        before,
        "the lease's event weighed {before} units, {after} after the refund"
    );
}

/// A settlement's reply reads the log's longer window too, so that a charge that fills the key
/// in the window decisions read ends the lease, even while the shorter window still has room.
/// An event of 500 units logged 8.9 s back (a leasing store takes event times up to `w − h`
/// back: 9 s for `1000/10s` and `h` = 1 s), 1.2 s later in `(now − w − h, now]`, not in
/// `(now − w, now]`; a key warmed until it holds a lease, then a charge of what a peek says is
/// left: the lease is spent no more (with the reply read in windows of `w`, 500 units still
/// looked free and the lease went on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_that_fills_the_longer_window_ends_the_lease() {
    let server = RedisServer::start();
    let store = leasing(server.url()).await;
    let (key, policy) = (Key::from("longer"), log("1000/10s"));
    let old = SystemTime::now() - Duration::from_millis(8_900);
    assert!(store
        .check_at(&key, &policy, 500, old)
        .await
        .unwrap()
        .is_allowed());
    // The event leaves `(now − w, now]` 1.1 s after it was logged; the warming and the charge
    // take well under the 0.9 s it then stays in the longer window.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    paced(&store, &key, &policy, 30, Duration::from_millis(5)).await;
    let decision = store
        .check_now(&key, &policy, 1)
        .expect("the busy key holds a lease")
        .unwrap();
    let left = store.peek(&key, &policy, 1).await.unwrap().remaining();
    let charge = Settlement::charge(&decision, left + 1).unwrap();
    store.settle(&key, &policy, charge).await.unwrap();
    let after = store.check_now(&key, &policy, 1);
    assert!(
        after.is_none(),
        "charged one unit past the {left} left, and the lease still answers: {after:?}"
    );
}
