//! Slots while Redis stalls or is gone: a stall shorter than the slot lifetime loses no slot,
//! give-backs are sent once Redis answers, and failing open keeps each instance's own cap.

use super::*;

/// How many of the requests sent every 50 ms for `period` were admitted (the others were
/// refused, 429, or failed closed, 503).
async fn admitted_during<S>(service: &S, key: &str, period: Duration) -> usize
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let (started, mut admitted) = (tokio::time::Instant::now(), 0);
    while started.elapsed() < period {
        let response = service.clone().oneshot(request(key)).await.unwrap();
        admitted += usize::from(response.status() == StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    admitted
}

/// Two streams hold both slots of a key (`slot_expiry` 2 s, `FailureMode::Closed`) while Redis
/// answers nothing for 1.9 s, by `DEBUG SLEEP` and by `SIGSTOP`: no slot is lost, so nothing
/// else is admitted during the stall nor in the 3 s after it, past the lifetime, until a
/// stream ends. A slot lives in Redis for 1.5 lifetimes and twice the time budget after its
/// last renewal (with the lifetime alone, both were lost to either stall and a third stream
/// was admitted: 4 in flight at cap 2 with two instances, in the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_shorter_than_the_slot_lifetime_loses_no_slot_on_redis() {
    for how in ["sleep", "stop"] {
        let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let policy = streams("stall", 2, Duration::from_secs(2));
        let service = closed(&server.url(), policy).await.layer(endless());
        let [first, second, _] = fill_two(&service).await;
        // Past a renewal, so that the stall starts with a slot renewed some time before.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let stalled = async { admitted_during(&service, "k", Duration::from_millis(1900)).await };
        let (during, ()) = futures::join!(stalled, stop_redis(&server, how, 1.9));
        let after = admitted_during(&service, "k", Duration::from_secs(3)).await;
        assert_eq!((during, after), (0, 0), "{how}: admitted past the cap");
        drop((first, second));
        let freed = both_slots_free(&service, "k", Duration::from_secs(1)).await;
        assert!(
            freed.is_some(),
            "{how}: the slots given back were not free within a second"
        );
    }
}

/// Two streams end while Redis sleeps 0.4 s, past the time budget, with the breaker open:
/// their give-backs wait and are sent as soon as Redis answers, so the key admits again
/// within a second of that (before, they were dropped as "store unavailable" and the key was
/// refused for the slots' lifetime: 8.3 s in the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn give_backs_during_a_blip_are_sent_once_redis_answers_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("blip", 2, Duration::from_secs(10));
    let service = closed(&server.url(), policy).await.layer(endless());
    let [first, second, _] = fill_two(&service).await;
    let blip = stop_redis(&server, "sleep", 0.4);
    let ends = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        // A decision that outlasts the budget opens the breaker.
        let tripped = service.clone().oneshot(request("other")).await.unwrap();
        assert_eq!(tripped.status(), StatusCode::SERVICE_UNAVAILABLE);
        drop((first, second));
    };
    futures::join!(blip, ends);
    let woke = tokio::time::Instant::now();
    loop {
        let response = service.clone().oneshot(request("k")).await.unwrap();
        if response.status() == StatusCode::OK {
            break;
        }
        let late = woke.elapsed();
        assert!(
            late < Duration::from_secs(1),
            "still refused {late:?} after Redis woke"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends requests of `key` every 20 ms until two are admitted and held at once; how long that
/// took, or `None` past `within`.
async fn both_slots_free<S>(service: &S, key: &str, within: Duration) -> Option<Duration>
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
{
    let started = tokio::time::Instant::now();
    let mut held = Vec::new();
    while started.elapsed() < within {
        let response = service.clone().oneshot(request(key)).await.unwrap();
        if response.status() == StatusCode::OK {
            held.push(response);
            if held.len() == 2 {
                return Some(started.elapsed());
            }
        } else {
            held.clear();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    None
}

/// Twelve clients that leave 20 to 23 ms after sending, while their decisions wait on a Redis
/// that sleeps 0.2 s: Redis runs the decisions when it wakes and the first two take the key's
/// slots, which nobody holds; the instance chose their ids and gives them back, so both slots
/// are free again within a second (before, the key was refused for the slots' lifetime with
/// nothing in flight: 9.6 s in the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_leave_during_their_decision_leave_no_slot_taken_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("leaving", 2, Duration::from_secs(10));
    let service = closed(&server.url(), policy).await.layer(endless());
    let leaving = (0..12u64).map(|i| {
        let service = service.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let wait = Duration::from_millis(20 + i % 4);
            let left = tokio::time::timeout(wait, service.oneshot(request("k"))).await;
            assert!(left.is_err(), "answered before the client left");
        }
    });
    futures::join!(stop_redis(&server, "sleep", 0.2), join_all(leaving));
    let took = both_slots_free(&service, "k", Duration::from_secs(1)).await;
    assert!(
        took.is_some(),
        "the key's slots were not free within a second"
    );
}

/// Decisions answered 503 while Redis sleeps 1 s (`FailureMode::Closed`) are run by Redis when
/// it wakes and take the key's slots; the instance gives them back, so both slots are free
/// again within a second of Redis answering (before, they blocked the key for a lifetime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_answered_503_during_a_stall_leave_no_slot_taken_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let policy = streams("stalled", 2, Duration::from_secs(10));
    let service = closed(&server.url(), policy).await.layer(endless());
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let asks = (0..6).map(|_| service.clone().oneshot(request("k")));
        let statuses: Vec<_> = join_all(asks)
            .await
            .into_iter()
            .map(|r| r.unwrap().status())
            .collect();
        assert!(
            statuses
                .iter()
                .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
            "{statuses:?}"
        );
    };
    futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    let took = both_slots_free(&service, "k", Duration::from_secs(1)).await;
    assert!(
        took.is_some(),
        "the key's slots were not free within a second of Redis waking"
    );
}

/// Under `FailureMode::Open` (the default), a concurrency limit holds on each instance alone
/// while Redis is out of reach: with one stream of the key held and Redis asleep 1 s, one more
/// request of the key is admitted (2 in flight here, the cap) and the others are refused for a
/// slot (before, each was admitted without a slot: 10 in flight at cap 2 in the attack).
/// Once Redis answers again, the slot held alone still counts on this instance until its
/// request ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_open_keeps_the_cap_on_each_instance_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let layer = limited(store, streams("open", 2, Duration::from_secs(10)));
    let service = layer.layer(endless());
    let held = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut responses = Vec::new();
        for _ in 0..4 {
            responses.push(service.clone().oneshot(request("k")).await.unwrap());
        }
        responses
    };
    let ((), responses) = futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    let statuses: Vec<_> = responses.iter().map(|r| r.status()).collect();
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 1, "{statuses:?}");
    assert!(statuses
        .iter()
        .all(|s| *s == StatusCode::OK || *s == StatusCode::TOO_MANY_REQUESTS));
    // Redis answers again (past the breaker's retry interval), and does not know the slot
    // held alone: the layer counts it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(
        after.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "past the cap after the outage"
    );
    // Its slot given back (the refused one's Redis slot too, on its way): admitted again.
    drop(responses);
    until_admitted(&service, "k", Duration::from_secs(1)).await;
    drop(held);
}

/// A request waiting for a slot (`max_wait`) while Redis sleeps is not let in by the outage
/// under `FailureMode::Open`: the instance holds the key's cap, so the waiter waits out its
/// time and is refused (before, the first store error let it in: 12 in flight at cap 2 in
/// the attack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_does_not_let_waiters_in_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = streams("waiters", 2, Duration::from_secs(10));
    let layer = limited_waiting(store, policy, Duration::from_millis(1500));
    let service = layer.layer(endless());
    let [first, second, _] = fill_two(&service).await;
    let waiter = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let asked = tokio::time::Instant::now();
        let status = service
            .clone()
            .oneshot(request("k"))
            .await
            .unwrap()
            .status();
        (status, asked.elapsed())
    };
    let ((), (status, waited)) = futures::join!(stop_redis(&server, "sleep", 1.0), waiter);
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        waited >= Duration::from_millis(1400),
        "refused after {waited:?}, not waiting"
    );
    drop((first, second));
}

/// Two rules of one layer that share a policy (and so its slots in Redis) share its cap while
/// Redis is out of reach too (before, each rule kept the cap on its own: 4 in flight at cap 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_sharing_a_policy_share_its_cap_while_failing_open_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = streams("shared", 2, Duration::from_secs(10));
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .rule(Rule::new(policy.clone()).path("/a"))
        .rule(Rule::new(policy).path("/b"))
        .build()
        .unwrap();
    let service = layer.layer(endless());
    let to = |path: &str| {
        Request::builder()
            .uri(path)
            .header("x-api-key", "k")
            .body(())
            .unwrap()
    };
    let held = service.clone().oneshot(to("/a")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut responses = Vec::new();
        for path in ["/a", "/b", "/a", "/b"] {
            responses.push(service.clone().oneshot(to(path)).await.unwrap());
        }
        responses
    };
    let ((), responses) = futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    let statuses: Vec<_> = responses.iter().map(|r| r.status()).collect();
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 1, "{statuses:?}");
    drop((held, responses));
}

/// One stalled connection of the store's pool holds up a decision for 1.2 s while other
/// requests keep the breaker closed: the decision is answered 503, and its call lands late and
/// takes a slot nobody holds. The instance's give-back of that slot, sent again while it finds
/// nothing (at most 0.8 s apart), removes it soon after: both slots are free within 1.5 s of
/// the connection going on (before, the give-back stopped after 3 tries 100 ms apart, and the
/// slot blocked the key for its stored lifetime: 10 of 10 trials, 3.5 s at `L` = 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_held_up_on_one_stalled_connection_leaves_no_slot_taken_on_redis() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let store = RedisStore::connect(&proxy.url()).await.unwrap();
    let layer = |policy: Policy, mode: FailureMode| {
        RateLimitLayer::builder()
            .key(api_key())
            .store(store.clone())
            .policy(policy)
            .failure_mode(mode)
            .build()
            .unwrap()
            .layer(endless())
    };
    let service = layer(
        streams("one-stalled", 2, Duration::from_secs(2)),
        FailureMode::Closed,
    );
    let others = layer(
        Policy::new("others", ["1000000/1m".parse().unwrap()]).unwrap(),
        FailureMode::Open,
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            for i in 0u64.. {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let (others, key) = (others.clone(), format!("other-{}", i % 50));
                tokio::spawn(async move { drop(others.oneshot(request(&key)).await) });
                tokio::time::sleep(Duration::from_millis(7)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.pause_connection_at(b"victim");
    let held_up = service.clone().oneshot(request("victim")).await.unwrap();
    assert_eq!(held_up.status(), StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    proxy.resume();
    let took = both_slots_free(&service, "victim", Duration::from_millis(1500)).await;
    stop.store(true, Ordering::SeqCst);
    traffic.await.unwrap();
    assert!(
        took.is_some(),
        "the slot taken late was not given back within 1.5 s"
    );
}

/// A shadow layer passes requests on at the cap while Redis is out of reach, as it does over a
/// limit (before, failing open refused them for a slot: a shadow layer enforced the cap
/// during an outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_layer_refuses_nothing_while_failing_open_on_redis() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(RedisStore::connect(&server.url()).await.unwrap())
        .policy(streams("shadow", 1, Duration::from_secs(10)))
        .shadow(true)
        .build()
        .unwrap();
    let service = layer.layer(endless());
    let held = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let asks = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(
                service
                    .clone()
                    .oneshot(request("k"))
                    .await
                    .unwrap()
                    .status(),
            );
        }
        statuses
    };
    let ((), statuses) = futures::join!(stop_redis(&server, "sleep", 1.0), asks);
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    drop(held);
}
