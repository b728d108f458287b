//! Fleets of four leasing instances at three times the limit: never over in any window
//! their algorithm keeps, and little less.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_four_never_admits_more_than_the_limit_and_little_less() {
    let server = RedisServer::start();
    let policy = Policy::new("fleet", ["1000/10s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow);
    const WINDOW: u64 = 10_000_000;
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..4).map(|_| leasing(server.url()))).await;
    // Two clients, each sending three times its limit (3000 per 10 s), spread evenly over the
    // four instances: 75 requests per second per instance and client.
    let start = micros_now();
    let first_full = start - start % WINDOW + WINDOW;
    let end = first_full + 2 * WINDOW;
    let admitted = Arc::new(std::sync::Mutex::new(BTreeMap::<(usize, u64), u64>::new()));
    let from_leases = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for store in &stores {
        for client in 0..2usize {
            let (store, policy, admitted) = (store.clone(), policy.clone(), admitted.clone());
            let from_leases = from_leases.clone();
            tasks.push(tokio::spawn(async move {
                let key = Key::from(format!("client-{client}"));
                let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / 75));
                while micros_now() < end {
                    tick.tick().await;
                    let (allowed, leased, window) = decide(&store, &key, &policy, WINDOW).await;
                    if allowed.expect("Redis is up") {
                        *admitted
                            .lock()
                            .unwrap()
                            .entry((client, window))
                            .or_default() += 1;
                        if leased {
                            from_leases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let client = server.client().await;
    let calls = evalsha_calls(&client).await;
    let admitted = admitted.lock().unwrap().clone();
    let total: u64 = admitted.values().sum();
    let leased = from_leases.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "admitted per (client, window): {admitted:?}; {total} admitted, {leased} of them from \
         leases; {calls} EVALSHA in all (refusals included: the layer's deny cache is not used)"
    );
    for (&(client, window), &count) in &admitted {
        assert!(
            count <= 1000,
            "client {client}: {count} admitted in the window at {window}"
        );
    }
    for client in 0..2 {
        for window in [first_full, first_full + WINDOW] {
            let count = admitted.get(&(client, window)).copied().unwrap_or(0);
            assert!(
                count >= 950,
                "client {client}: only {count} of 1000 admitted in the full window at {window}"
            );
        }
    }
    assert!(
        leased as f64 >= 0.8 * total as f64,
        "only {leased} of {total} admitted requests were decided from leases"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_four_keeps_gcra_within_its_bucket() {
    let server = RedisServer::start();
    let policy = gcra("200/2s");
    let (count, window) = (200.0, 2_000_000.0);
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..4).map(|_| leasing(server.url()))).await;
    // Two clients, each sending three times its rate (300 per second), for 6 s.
    let admitted = three_times_the_limit(&stores, &policy, Duration::from_secs(6)).await;
    for (client, times) in admitted.iter().enumerate() {
        // The bucket admits at most c * (t - s + w) / w units in any span [s, t]: a full
        // bucket, then the rate. The times are where units were spent (`spent_at`); 2 units of
        // margin for the lease's units, timed when the call began.
        let mut worst = (f64::NEG_INFINITY, 0, 0);
        for (i, &s) in times.iter().enumerate() {
            for (j, &t) in times.iter().enumerate().skip(i) {
                let units = (j - i + 1) as f64;
                let bound = count * ((t - s) as f64 + window) / window;
                if units - bound > worst.0 {
                    worst = (units - bound, i, j);
                }
            }
        }
        let (excess, i, j) = worst;
        eprintln!(
            "client {client}: {} admitted in 6 s (at most about {} by the rate and a bucket); \
             the closest to the bound: {excess:.1} units over it (under, if negative) in the {} \
             admissions over {} µs",
            times.len(),
            200 + 600,
            j - i + 1,
            times[j] - times[i]
        );
        assert!(
            excess <= 2.0,
            "client {client}: {} admissions within {} µs, {excess:.1} units over \
             c * (t - s + w) / w",
            j - i + 1,
            times[j] - times[i]
        );
    }
}

/// Two clients, each sending 75 requests per second to each of `stores` for `run` (with four
/// stores, 300 per second each); returns, per client, when each admitted unit was spent
/// ([`spent_at`]), in order.
async fn three_times_the_limit(
    stores: &[RedisStore],
    policy: &Policy,
    run: Duration,
) -> [Vec<u64>; 2] {
    let end = micros_now() + run.as_micros() as u64;
    let admitted = Arc::new(std::sync::Mutex::new([Vec::new(), Vec::new()]));
    let mut tasks = Vec::new();
    for store in stores {
        for client in 0..2usize {
            let (store, policy, admitted) = (store.clone(), policy.clone(), admitted.clone());
            tasks.push(tokio::spawn(async move {
                let key = Key::from(format!("client-{client}"));
                let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / 75));
                while micros_now() < end {
                    tick.tick().await;
                    if let Some(at) = spent_at(&store, &key, &policy).await {
                        admitted.lock().unwrap()[client].push(at);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut admitted = admitted.lock().unwrap().clone();
    admitted.iter_mut().for_each(|times| times.sort_unstable());
    admitted
}

/// The fleet: four leasing instances, a sliding log of `1000/10s` with a 150 ms lease
/// period (as 1 s is to a minute), two clients each at three times the limit for 22 s. Every
/// admission is timed where its unit was spent; no window of 10 s ending at any admission
/// holds more than 1000, and in steady state (once the first window plus the headroom has
/// passed) every window holds at least 900.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_four_keeps_the_sliding_log_within_every_window() {
    let server = RedisServer::start();
    let policy = log("1000/10s");
    const WINDOW: u64 = 10_000_000;
    let leases = Leases::new().period(Duration::from_millis(150));
    let timeout = Duration::from_millis(200);
    let stores: Vec<RedisStore> =
        futures::future::join_all((0..4).map(|_| leasing_with(server.url(), leases, timeout)))
            .await;
    let start = micros_now();
    let end = start + 22_000_000;
    let admitted = three_times_the_limit(&stores, &policy, Duration::from_secs(22)).await;
    let calls = evalsha_calls(&server.client().await).await;
    for (client, times) in admitted.iter().enumerate() {
        // The fullest window ends at an admission: (t - w, t] for each admission t.
        let (mut fullest, mut at) = (0, 0);
        for (i, &t) in times.iter().enumerate() {
            let held = i + 1 - times.partition_point(|&s| s + WINDOW <= t);
            if held > fullest {
                (fullest, at) = (held, t - start);
            }
        }
        // Steady state: windows ending every 10 ms from 10.65 s on.
        let in_window = |t: u64| {
            times.partition_point(|&s| s <= t) - times.partition_point(|&s| s + WINDOW <= t)
        };
        let ends = (start + WINDOW + 650_000..end - 50_000).step_by(10_000);
        let (emptiest, when) = ends.map(|t| (in_window(t), t - start)).min().unwrap();
        eprintln!(
            "client {client}: {} admitted in 22 s; the fullest window of 10 s holds {fullest} \
             (ending {at} us in), the emptiest in steady state {emptiest} (ending {when} us in); \
             {calls} EVALSHA in all (refusals included)",
            times.len()
        );
        assert!(
            fullest <= 1000,
            "client {client}: {fullest} admitted in the 10 s ending {at} us in"
        );
        assert!(
            emptiest >= 900,
            "client {client}: only {emptiest} admitted in the 10 s ending {when} us in"
        );
    }
}
