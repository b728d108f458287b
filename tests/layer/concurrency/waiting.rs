//! Requests that wait for a slot (`max_wait`): served in arrival order on one instance and
//! across the fleet, and a waiter that leaves, times out or loses its answer leaves the line.

use super::*;

/// `max_wait`: a request refused only for a slot waits for one, and requests of a key get
/// slots in the order they came; past the wait, the refusal.
#[tokio::test(start_paused = true)]
async fn waiting_requests_get_slots_in_arrival_order_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("queue-memory", 1, Duration::from_secs(10));
    let layer = limited_waiting(store.clone(), policy.clone(), Duration::from_secs(5));
    let service = layer.layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // Three wait, in this order; each records when it got its answer.
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for name in ["second", "third", "fourth"] {
        let (service, order) = (service.clone(), Arc::clone(&order));
        waiting.push(tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            order.lock().unwrap().push(name);
            (response.status(), response)
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(order.lock().unwrap().is_empty(), "none got a slot yet");
    drop(first);
    // Woken by the give-back itself, not by its next look 50 ms on.
    let given_back = tokio::time::Instant::now();
    let (status, second) = waiting.remove(0).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(given_back.elapsed(), Duration::ZERO);
    assert_eq!(*order.lock().unwrap(), ["second"]);
    drop(second);
    let (status, third) = waiting.remove(0).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(*order.lock().unwrap(), ["second", "third"]);
    // The fourth waits its 5 s out, then is refused.
    let started = tokio::time::Instant::now();
    let (status, refused) = waiting.remove(0).await.unwrap();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key("retry-after"));
    let waited = started.elapsed();
    assert!(waited > Duration::from_secs(2), "{waited:?}");
    drop(third);
    // A key refused by its rate limit does not wait.
    let tight = Policy::new("tight-memory", ["1/1h".parse().unwrap()])
        .unwrap()
        .concurrency(5)
        .unwrap();
    let rate = limited_waiting(store, tight, Duration::from_secs(5)).layer(endless());
    let _one = rate.clone().oneshot(request("k")).await.unwrap();
    let started = tokio::time::Instant::now();
    let refused = rate.oneshot(request("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(started.elapsed(), Duration::ZERO);
}

#[tokio::test]
async fn a_waiting_request_gets_the_slot_given_back_on_redis() {
    let server = RedisServer::start();
    let policy = streams("queue-redis", 1, Duration::from_secs(10));
    let layer = limited_waiting(server.store().await, policy, Duration::from_secs(3));
    let service = layer.layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let waiter = tokio::spawn({
        let service = service.clone();
        async move {
            let started = tokio::time::Instant::now();
            let response = service.oneshot(request("k")).await.unwrap();
            (response.status(), started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    drop(first);
    let (status, waited) = waiter.await.unwrap();
    println!("waited {waited:?} for a slot given back after 300 ms");
    assert_eq!(status, StatusCode::OK);
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_millis(1_300));
}

/// Slots freed on another instance: only the first in line asks again, so the later request,
/// whose next look comes first, does not overtake it.
#[tokio::test(start_paused = true)]
async fn a_slot_freed_elsewhere_goes_to_the_first_in_line() {
    let store = MemoryStore::new();
    let policy = streams("line-memory", 1, Duration::from_secs(10));
    let instance =
        || limited_waiting(store.clone(), policy.clone(), Duration::from_secs(5)).layer(endless());
    let (elsewhere, here) = (instance(), instance());
    let held = elsewhere.oneshot(request("k")).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for name in ["earlier", "later"] {
        let (service, order) = (here.clone(), Arc::clone(&order));
        waiting.push(tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            order.lock().unwrap().push(name);
            response
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The earlier request looks every 50 ms from its arrival, the later 10 ms after it; the
    // slot frees 5 ms after the earlier one's look (1005 ms after its arrival; 20 ms have
    // passed), so the later one would look first.
    tokio::time::sleep(Duration::from_millis(985)).await;
    drop(held);
    let first = waiting.remove(0).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(*order.lock().unwrap(), ["earlier"]);
    drop(first);
    assert_eq!(waiting.remove(0).await.unwrap().status(), StatusCode::OK);
}

/// A request that arrives while others of its key wait for a slot joins the back of their line
/// rather than taking the slot freed for the first of them.
#[tokio::test(start_paused = true)]
async fn a_new_request_does_not_overtake_the_line() {
    let store = MemoryStore::new();
    let policy = streams("overtake-memory", 1, Duration::from_secs(10));
    let service = limited_waiting(store, policy, Duration::from_secs(5)).layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    let waiting = tokio::spawn(service.clone().oneshot(request("k")));
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(first);
    // Arrives at the very instant the slot is free, before the waiting request has run.
    let mut late = Box::pin(service.clone().oneshot(request("k")));
    assert!(
        futures::poll!(&mut late).is_pending(),
        "the late request took the slot"
    );
    let served = waiting.await.unwrap().unwrap();
    assert_eq!(served.status(), StatusCode::OK);
    drop(served);
    assert_eq!(late.await.unwrap().status(), StatusCode::OK);
}

/// How many pairs of `order` are out of order: the number of inversions.
fn inversions(order: &[usize]) -> usize {
    let pairs = order
        .iter()
        .enumerate()
        .flat_map(|(i, a)| order[i + 1..].iter().map(move |b| (a, b)));
    pairs.filter(|(a, b)| a > b).count()
}

/// Waiters of one key on two instances get its slot in the order they came, whichever
/// instance gives it back: the store keeps their line, and a slot given back is kept for the
/// first in it. Without the line, the instance that gives a slot back wakes its own waiters at
/// once, and the other's, which look every 50 ms, lose it to them.
#[tokio::test]
async fn waiters_on_two_instances_get_slots_in_arrival_order_on_redis() {
    let server = RedisServer::start();
    let policy = streams("fleet-line", 1, Duration::from_secs(10));
    let mut instances = Vec::new();
    for _ in 0..2 {
        let store = server.store().await;
        let layer = limited_waiting(store, policy.clone(), Duration::from_secs(30));
        instances.push(layer.layer(endless()));
    }
    let held = instances[0].clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    // 20 waiters, 40 ms apart, alternating between the instances; each holds its slot 30 ms.
    let start = tokio::time::Instant::now();
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..20 {
        let (service, served) = (instances[i % 2].clone(), Arc::clone(&served));
        waiters.push(tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "waiter {i}");
            let admitted = start.elapsed();
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(response);
            served.lock().unwrap().push((i, admitted, start.elapsed()));
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    drop(held);
    let released = start.elapsed();
    for waiter in waiters {
        waiter.await.unwrap();
    }
    let served = served.lock().unwrap().clone();
    let order: Vec<usize> = served.iter().map(|&(i, _, _)| i).collect();
    // From each give-back to the next admission: the slot free, kept for the first in line.
    let mut ends = vec![released];
    ends.extend(served.iter().map(|&(_, _, ended)| ended));
    let mut gaps: Vec<Duration> = served
        .iter()
        .zip(&ends)
        .map(|(&(_, admitted, _), &ended)| admitted.saturating_sub(ended))
        .collect();
    gaps.sort();
    println!(
        "served {order:?}; gap from give-back to next admission: median {:?}, max {:?}",
        gaps[gaps.len() / 2],
        gaps[gaps.len() - 1]
    );
    assert_eq!(inversions(&order), 0, "{order:?}");
}

/// A waiter whose client goes away leaves the store's line at once: the slot it would have
/// been kept for goes to the next request, not after the waiter's deadline.
#[tokio::test]
async fn a_waiter_whose_client_leaves_gives_up_its_place_on_redis() {
    let server = RedisServer::start();
    let policy = streams("left-line", 1, Duration::from_secs(10));
    let waiting = limited_waiting(
        server.store().await,
        policy.clone(),
        Duration::from_secs(30),
    );
    let waiting = waiting.layer(endless());
    let other = limited(server.store().await, policy).layer(endless());
    let held = other.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let waiter = tokio::spawn(waiting.oneshot(request("k")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    waiter.abort();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(held);
    let took = until_admitted(&other, "k", Duration::from_secs(5)).await;
    println!("admitted {took:?} after the give-back");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// Waiters that stop waiting, on their own or because their client went away, leave the
/// store's line even when one goes with an ask on its way: once every request has ended, the
/// next is admitted at once. Before, an ask that Redis ran after the waiter's leave put it back
/// in line, and the key was refused until that waiter's deadline (until 3.4 s, in 4 of 4 runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_stop_waiting_leave_the_line_on_redis() {
    let server = RedisServer::start();
    let policy = streams("stop-waiting", 1, Duration::from_secs(10));
    let short = limited_waiting(
        server.store().await,
        policy.clone(),
        Duration::from_millis(300),
    );
    let long = limited_waiting(server.store().await, policy.clone(), Duration::from_secs(3));
    let (short, long) = (short.layer(endless()), long.layer(endless()));
    let other = limited(server.store().await, policy).layer(endless());
    let held = other.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let timed_out: Vec<_> = (0..3)
        .map(|_| tokio::spawn(short.clone().oneshot(request("k"))))
        .collect();
    let gone: Vec<_> = (0..3)
        .map(|_| {
            let call = long.clone().oneshot(request("k"));
            tokio::spawn(tokio::time::timeout(Duration::from_millis(200), call))
        })
        .collect();
    for waiter in timed_out {
        let status = waiter.await.unwrap().unwrap().status();
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    }
    for waiter in gone {
        assert!(waiter.await.unwrap().is_err(), "a waiter got the held slot");
    }
    drop(held);
    let took = until_admitted(&other, "k", Duration::from_secs(5)).await;
    println!("admitted {took:?} after the give-back");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// Waiters that lost their place in the store's line to a restart without data join it
/// again, and their instance's line follows the store's: every waiter is served, in arrival
/// order, and the slot never sits free while one waits. Before, the waiter whose place was
/// lost stayed first on its instance, where it alone asked, while the store kept the slot for
/// a later waiter that never asked: the slot sat free for 2.9 s, and that waiter was refused
/// after its whole wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_that_lose_their_place_to_a_restart_are_served_in_order_on_redis() {
    let mut server = RedisServer::start();
    let policy = streams("lost-place", 1, Duration::from_secs(2));
    let wait = Duration::from_secs(4);
    let a = limited_waiting(server.store().await, policy.clone(), wait).layer(endless());
    let b = limited_waiting(server.store().await, policy, wait).layer(endless());
    let held = a.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let start = tokio::time::Instant::now();
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let waiter = |name: &'static str, service: &RateLimit<_, Header, RedisStore>, hold: u64| {
        let (service, served) = (service.clone(), Arc::clone(&served));
        tokio::spawn(async move {
            let response = service.oneshot(request("k")).await.unwrap();
            served
                .lock()
                .unwrap()
                .push((name, response.status(), start.elapsed()));
            tokio::time::sleep(Duration::from_millis(hold)).await;
        })
    };
    let w1 = waiter("W1", &a, 700);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let w2 = waiter("W2", &a, 300);
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::task::block_in_place(|| server.restart());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = waiter("C", &b, 300);
    for task in [w1, w2, c] {
        task.await.unwrap();
    }
    drop(held);
    let served = served.lock().unwrap().clone();
    println!("{served:?}");
    let order: Vec<_> = served
        .iter()
        .map(|&(name, status, _)| (name, status))
        .collect();
    let ok = StatusCode::OK;
    assert_eq!(order, [("W1", ok), ("W2", ok), ("C", ok)]);
    // Each next one within half a second of the slot's give-back.
    assert!(
        served[1].2 < served[0].2 + Duration::from_millis(1_200),
        "{served:?}"
    );
    assert!(
        served[2].2 < served[1].2 + Duration::from_millis(800),
        "{served:?}"
    );
}

/// Waiters decided in one call to Redis share a deadline there: the store orders them by id,
/// and so does their instance, whose first in line is then the store's first. Before, the
/// instance ordered them by arrival of the answers: its first asked again and again behind a
/// waiter that never did, and most were refused after their whole wait with the slot free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_decided_together_are_all_served_on_redis() {
    let server = RedisServer::start();
    let policy = streams("together", 1, Duration::from_secs(10));
    let waiting = limited_waiting(server.store().await, policy, Duration::from_secs(6));
    let service = waiting.layer(endless());
    let held = service.clone().oneshot(request("k")).await.unwrap();
    let waiters: Vec<_> = (0..20)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move {
                let response = service.oneshot(request("k")).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
                response.status()
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = tokio::time::Instant::now();
    drop(held);
    let statuses = join_all(waiters).await;
    let served = statuses
        .iter()
        .filter(|s| *s.as_ref().unwrap() == StatusCode::OK)
        .count();
    println!("{served} of 20 served in {:?}", started.elapsed());
    assert_eq!(served, 20);
}

/// A waiter whose first answer never comes (its decision timed out while Redis slept) may
/// still have been put in line when Redis woke: it leaves the line all the same, so the slot
/// is not kept for it until its deadline.
#[tokio::test]
async fn a_waiter_whose_first_answer_is_lost_leaves_the_line_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("lost-ask", 1, Duration::from_secs(10));
    let plain = closed(&server.url(), policy.clone()).await.layer(endless());
    let waiting = RateLimitLayer::builder()
        .key(api_key())
        .store(server.store().await)
        .policy(policy)
        .failure_mode(FailureMode::Closed)
        .max_wait(Duration::from_secs(8))
        .build()
        .unwrap()
        .layer(endless());
    let held = plain.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    // The layer (and its store) lives on: it sends what its requests leave behind.
    let ask = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiting
            .clone()
            .oneshot(request("k"))
            .await
            .unwrap()
            .status()
    };
    let (_, status) = futures::join!(stop_redis(&server, "sleep", 0.3), ask);
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the decision timed out"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);
    let took = until_admitted(&plain, "k", Duration::from_secs(5)).await;
    println!("admitted {took:?} after the give-back");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// A layer failing open that holds the key's cap answers its waiters' failed asks with a
/// refusal of its own; the asks may still have put them in the store's line (a stalled Redis
/// runs them when it wakes). A waiter that stops leaves the line all the same: `queued`, one
/// whose client left during the outage; `lost`, one whose first ask was held up past its
/// whole wait. The key is free within a second of Redis answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_failing_open_leaves_the_line_it_may_be_in_on_redis() {
    for case in ["queued", "lost"] {
        let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let policy = streams(&format!("open-{case}"), 1, Duration::from_secs(10));
        let plain = closed(&server.url(), policy.clone()).await.layer(endless());
        let wait = match case {
            "queued" => Duration::from_secs(8),
            _ => Duration::from_secs(2),
        };
        let waiting = RateLimitLayer::builder()
            .key(api_key())
            .store(server.store().await)
            .policy(policy)
            .failure_mode(FailureMode::Open)
            .max_wait(wait)
            .build()
            .unwrap()
            .layer(endless());
        // This layer holds the cap, so that failing open it refuses its waiters itself.
        let held = waiting.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(held.status(), StatusCode::OK);
        let stall = match case {
            "queued" => 1.5,
            _ => 3.0,
        };
        let waiter = tokio::spawn({
            let waiting = waiting.clone();
            async move {
                if case == "lost" {
                    // Asked while Redis sleeps: the ask waits for it, past the whole wait.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                waiting.oneshot(request("k")).await.unwrap().status()
            }
        });
        if case == "queued" {
            // In the store's line before the stall.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let outage = tokio::spawn({
            let port = server.port();
            async move {
                tokio::task::spawn_blocking(move || {
                    crate::support::cluster::cli(port, &["DEBUG", "SLEEP", &stall.to_string()]);
                })
                .await
                .unwrap();
            }
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        match case {
            // Its client leaves during the outage.
            "queued" => waiter.abort(),
            // It gives up at its deadline, during the outage.
            _ => assert_eq!(waiter.await.unwrap(), StatusCode::TOO_MANY_REQUESTS),
        }
        drop(held);
        outage.await.unwrap();
        let took = until_admitted(&plain, "k", Duration::from_secs(8)).await;
        println!("{case}: admitted {took:?} after Redis woke");
        assert!(took < Duration::from_secs(1), "{case}: {took:?}");
    }
}
