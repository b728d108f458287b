//! Slots: taken at admission, given back when a response ends, fails or is dropped,
//! renewed while it streams, expired when nobody renews them, and kept apart from the rate.

use super::*;
use tower_redis_ratelimit::store::{Override, Overrides, Scope};
use tower_redis_ratelimit::test_util::{
    holds_slot, key_count, limit_index, redis_key, renew, slots_in_use,
};

#[tokio::test(start_paused = true)]
async fn a_fleet_on_one_memory_store_never_streams_more_than_the_limit() {
    let store = MemoryStore::new();
    let policy = streams("fleet-memory", 2, Duration::from_secs(10));
    let seen = Arc::new(InFlight::default());
    let layers: Vec<_> = (0..4)
        .map(|_| limited(store.clone(), policy.clone()))
        .collect();
    let services: Vec<_> = layers
        .iter()
        .map(|l| l.layer(streaming(Arc::clone(&seen), Duration::from_millis(50))))
        .collect();
    // Twice: the slots of the first round all came back.
    for round in 0..2 {
        let statuses = fire(&services, "k", 200).await;
        check_fleet(&statuses, &seen, 2, &format!("memory, round {round}"));
        assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 0);
    }
}

#[tokio::test(start_paused = true)]
async fn a_dropped_body_frees_its_slot_at_once_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("drop-memory", 2, Duration::from_secs(10));
    let layer = limited(store.clone(), policy.clone());
    let service = layer.layer(endless());
    let [first, second, refused] = fill_two(&service).await;
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 2);
    // Another key has its own slots.
    let other = service.clone().oneshot(request("other")).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    // The client goes away mid-stream: its body is dropped, and its slot is free at once.
    drop(first);
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 1);
    let third = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    // A body read to its end gives its slot back then, though it is not dropped yet.
    let seen = Arc::new(InFlight::default());
    let short = layer.layer(streaming(seen, Duration::from_millis(10)));
    let mut ended = short.oneshot(request("ended")).await.unwrap();
    assert_eq!(slots_in_use(&store, &Key::from("ended"), &policy), 1);
    while let Some(frame) = ended.body_mut().frame().await {
        frame.unwrap();
    }
    assert_eq!(slots_in_use(&store, &Key::from("ended"), &policy), 0);
    drop(ended);
    drop((second, third, other));
    assert_eq!(layer.settled(Duration::from_secs(1)).await, 0);
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_longer_than_the_slot_lifetime_keeps_its_slot_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("long-memory", 1, Duration::from_secs(3));
    let layer = limited(store.clone(), policy);
    let service = layer.layer(endless());
    let long = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    // Ten lifetimes later, renewed all along, it still holds the only slot.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    drop(long);
    let next = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
}

/// A layer's renewal task goes idle once it has held no slot for a few ticks; the next slot
/// taken must wake it, or a long request begun after a quiet spell would lose its slot.
#[tokio::test(start_paused = true)]
async fn a_slot_taken_after_a_quiet_spell_is_renewed_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("quiet-memory", 1, Duration::from_secs(3));
    let layer = limited(store.clone(), policy.clone());
    let service = layer.layer(endless());
    let short = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(short.status(), StatusCode::OK);
    drop(short);
    // Ten lifetimes with nothing held.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let long = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    for second in 1..=30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        let status = refused.status();
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "after {second} s");
    }
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 1);
    drop(long);
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slot_nobody_renews_expires_after_its_lifetime_on_memory() {
    // An instance that died: it took two slots, then neither gave them back nor renewed them.
    let store = MemoryStore::new();
    let policy = streams("crash-memory", 2, Duration::from_secs(5));
    for _ in 0..2 {
        let taken = store.check(&Key::from("k"), &policy, 1).await.unwrap();
        assert!(holds_slot(&taken));
    }
    let refused = store.check(&Key::from("k"), &policy, 1).await.unwrap();
    assert!(refused.is_concurrency_limit() && !refused.is_allowed());
    assert_eq!(refused.limit(), 2);
    assert_eq!(limit_index(&refused), 1);
    assert_eq!(refused.retry_after(), Some(Duration::from_secs(5)));
    tokio::time::advance(Duration::from_millis(4_999)).await;
    assert!(!store
        .check(&Key::from("k"), &policy, 1)
        .await
        .unwrap()
        .is_allowed());
    tokio::time::advance(Duration::from_millis(1)).await;
    let back = store.check(&Key::from("k"), &policy, 1).await.unwrap();
    assert!(back.is_allowed() && holds_slot(&back));
    // A release gives it back; a renewal of it afterwards does not take it again.
    let release = Settlement::release(&back).unwrap();
    store
        .settle(&Key::from("k"), &policy, release)
        .await
        .unwrap();
    let renew = renew(&back).unwrap();
    let gone = store.settle(&Key::from("k"), &policy, renew).await;
    assert!(matches!(gone, Err(StoreError::SlotGone)), "{gone:?}");
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 0);
}

#[tokio::test(start_paused = true)]
async fn a_rate_refusal_takes_no_slot_and_a_slot_refusal_records_no_rate() {
    let store = MemoryStore::new();
    let policy = Policy::new("both", ["3/1m".parse().unwrap()])
        .unwrap()
        .concurrency(1)
        .unwrap();
    let key = Key::from("k");
    let first = store.check(&key, &policy, 1).await.unwrap();
    assert!(first.is_allowed() && holds_slot(&first));
    // Refused for the slot: the rate limit records nothing.
    let refused = store.check(&key, &policy, 1).await.unwrap();
    assert!(refused.is_concurrency_limit());
    assert_eq!(store.peek(&key, &policy, 1).await.unwrap().remaining(), 2);
    store
        .settle(&key, &policy, Settlement::release(&first).unwrap())
        .await
        .unwrap();
    for _ in 0..2 {
        let d = store.check(&key, &policy, 1).await.unwrap();
        assert!(d.is_allowed());
        store
            .settle(&key, &policy, Settlement::release(&d).unwrap())
            .await
            .unwrap();
    }
    // Refused by the rate limit: no slot taken, and the decision says which limit.
    let rate = store.check(&key, &policy, 1).await.unwrap();
    assert!(!rate.is_allowed() && !rate.is_concurrency_limit() && !holds_slot(&rate));
    assert_eq!(slots_in_use(&store, &key, &policy), 0);
}

#[tokio::test]
async fn a_fleet_of_four_redis_stores_never_streams_more_than_the_limit() {
    let server = RedisServer::start();
    let policy = streams("fleet-redis", 2, Duration::from_secs(10));
    let seen = Arc::new(InFlight::default());
    let mut layers = Vec::new();
    for _ in 0..4 {
        let layer = limited(server.store().await, policy.clone());
        layers.push(layer);
    }
    let services: Vec<_> = layers
        .iter()
        .map(|l| l.layer(streaming(Arc::clone(&seen), Duration::from_millis(20))))
        .collect();
    let statuses = fire(&services, "k", 200).await;
    for layer in &layers {
        assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    }
    check_fleet(&statuses, &seen, 2, "redis, at once");
    // Then 40 clients that keep asking until 60 streams have run: slots given back on one
    // instance are taken on another, and the limit holds throughout.
    let statuses = keep_asking(&services, "k", 40, 60, Duration::from_millis(5)).await;
    for layer in &layers {
        assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    }
    check_fleet(&statuses, &seen, 2, "redis, clients that keep asking");
    assert_eq!(slots_held(&server, "k", &policy).await, 0, "slots left");
}

#[tokio::test]
async fn a_client_that_drops_mid_stream_frees_its_slot_within_a_second_on_redis() {
    let server = RedisServer::start();
    let policy = streams("drop-redis", 2, Duration::from_secs(10));
    let layer = limited(server.store().await, policy);
    let service = layer.layer(endless());
    let [first, second, refused] = fill_two(&service).await;
    let fields = refused.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(
        fields.starts_with("\"drop-redis-concurrency\";r=0;t="),
        "{fields}"
    );
    drop(first);
    let took = until_admitted(&service, "k", Duration::from_secs(1)).await;
    println!("a dropped stream's slot was taken again after {took:?}");
    drop(second);
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_body_that_fails_gives_its_slot_back_at_the_error_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("fails-memory", 1, Duration::from_secs(10));
    let layer = limited(store.clone(), policy.clone());
    let failing = service_fn(|_: Request<()>| async {
        let frames = futures::stream::iter([
            Ok(http_body::Frame::data(Bytes::from_static(b"partial"))),
            Err(std::io::Error::other("the model crashed")),
        ]);
        Ok::<_, Infallible>(Response::new(StreamBody::new(frames)))
    });
    let mut response = layer.layer(failing).oneshot(request("k")).await.unwrap();
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 1);
    assert!(response.body_mut().frame().await.unwrap().is_ok());
    assert!(response.body_mut().frame().await.unwrap().is_err());
    // Freed at the error, while the body is still held.
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 0);
    drop(response);
}

#[tokio::test]
async fn a_request_longer_than_the_slot_lifetime_keeps_its_slot_on_redis() {
    let server = RedisServer::start();
    let policy = streams("long-redis", 1, Duration::from_millis(600));
    let layer = limited(server.store().await, policy);
    let service = layer.layer(endless());
    let long = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    // Four lifetimes, renewed every 150 to 300 ms: every other request is refused all along.
    let until = tokio::time::Instant::now() + Duration::from_millis(2_400);
    let mut probes = 0;
    while tokio::time::Instant::now() < until {
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        probes += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(probes > 10);
    drop(long);
    until_admitted(&service, "k", Duration::from_secs(1)).await;
}

/// An instance killed while it holds two slots: they come back within their stored lifetime,
/// `1.5 L + 2 B` after their last renewal (3.5 s at `L` = 2 s and the default 250 ms budget),
/// while the live instance's slot is kept.
#[test]
fn a_killed_instances_slots_come_back_within_the_stored_lifetime_on_redis() {
    let server = RedisServer::start();
    let url = server.url();
    let expiry = Duration::from_secs(2);
    let stored = expiry + expiry / 2 + Duration::from_millis(500);
    let policy = streams("crash-redis", 3, expiry);
    let layer = |url: String, policy: Policy| async move {
        let layer = limited(RedisStore::connect(&url).await.unwrap(), policy);
        layer.layer(endless())
    };
    // The instance that lives holds one stream all along, renewing its slot: the key's set of
    // slots never expires as a whole, so only the dead instance's own slots can expire.
    let survivor = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (service, held) = survivor.block_on(async {
        let service = layer(url.clone(), policy.clone()).await;
        let held = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(held.status(), StatusCode::OK);
        (service, held)
    });
    // The instance that dies runs on a runtime of its own: its connections, its renewal task
    // and its requests end with it. Its bodies are forgotten, as a killed process runs no
    // destructors: nothing is given back.
    let doomed = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let taken_at = doomed.block_on(async {
        let service = layer(url.clone(), policy.clone()).await;
        for _ in 0..2 {
            let response = service.clone().oneshot(request("k")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            std::mem::forget(response);
        }
        let taken_at = tokio::time::Instant::now();
        // Renewed at least twice before the crash: held past their first expiry.
        tokio::time::sleep(expiry + expiry / 2).await;
        std::mem::forget(service);
        taken_at
    });
    doomed.shutdown_background();
    let crashed = tokio::time::Instant::now();
    survivor.block_on(async move {
        let refused = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let took = until_admitted(&service, "k", stored + Duration::from_secs(1)).await;
        let since_crash = crashed.elapsed();
        println!(
            "slot lifetime {expiry:?}: admitted again {since_crash:?} after the crash \
             ({took:?} of polling; slots taken {:?} before the crash)",
            crashed - taken_at
        );
        assert!(since_crash <= stored + Duration::from_secs(1));
        // The live instance's slot was renewed all along: it still counts, two more fit.
        let two: Vec<_> = join_all([(); 2].map(|_| service.clone().oneshot(request("k"))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert!(two.iter().all(|r| r.status() == StatusCode::OK));
        let over = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
        drop((two, held));
    });
}

#[tokio::test]
async fn the_handler_sees_which_limit_decided_and_the_fields_list_the_concurrency_limit() {
    let store = MemoryStore::new();
    let policy = streams("seen", 1, Duration::from_secs(10));
    let layer = limited(store, policy);
    let service = layer.layer(service_fn(|request: Request<()>| async move {
        let decisions = request.extensions().get::<Decisions>().cloned().unwrap();
        let decision = *decisions.get("seen").unwrap();
        assert!(decision.is_allowed() && holds_slot(&decision));
        assert!(!decision.is_concurrency_limit());
        Ok::<_, Infallible>(Response::new(BodyExt::boxed(http_body_util::Full::new(
            Bytes::from_static(b"ok"),
        ))))
    }));
    let response = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let policy_field = response.headers()["ratelimit-policy"].to_str().unwrap();
    assert_eq!(
        policy_field,
        "\"seen\";q=100000;w=60, \"seen-concurrency\";q=1;qu=\"concurrent-requests\""
    );
}

/// A layer that counts by outcome takes slots as well: an attempt holds its slot until its
/// body ends and its unit from its admission, kept when its head matches.
#[tokio::test]
async fn a_layer_that_counts_by_outcome_takes_slots_as_well() {
    let store = MemoryStore::new();
    let policy = Policy::new("outcomes", ["2/1m".parse().unwrap()])
        .unwrap()
        .concurrency(1)
        .unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store.clone())
        .policy(policy.clone())
        .count_when(|response| response.status == StatusCode::OK)
        .build()
        .unwrap();
    let service = layer.layer(endless());
    let first = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 1);
    let second = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(
        second.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the slot is taken"
    );
    drop(first);
    assert_eq!(slots_in_use(&store, &Key::from("k"), &policy), 0);
    let third = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    drop(third);
    let fourth = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(fourth.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(fourth.headers()["ratelimit"], "\"outcomes\";r=0;t=60");
}

/// A layer first used from a runtime that then shut down (a warm-up, a health check at start)
/// still renews the slots it takes later on another runtime.
#[test]
fn slots_are_renewed_after_the_first_runtime_is_gone() {
    let store = MemoryStore::new();
    let policy = streams("runtimes", 1, Duration::from_millis(400));
    let layer = limited(store.clone(), policy);
    let service = layer.layer(endless());
    let warm_up = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    warm_up.block_on(async {
        let response = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    });
    drop(warm_up);
    let serving = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    serving.block_on(async {
        let long = service.clone().oneshot(request("k")).await.unwrap();
        assert_eq!(long.status(), StatusCode::OK);
        // Three lifetimes: renewed every 100 to 200 ms, the slot never expires.
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let refused = service.clone().oneshot(request("k")).await.unwrap();
            assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        }
        drop(long);
    });
}

/// A slot the store loses (here Redis flushed) is reported once, and renewed no more; slots
/// given back as a renewal of theirs is on its way are not reported.
#[tokio::test]
async fn a_lost_slot_is_reported_once_and_a_returned_one_never() {
    let captured = crate::support::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let server = RedisServer::start();
    let policy = streams("lost", 50, Duration::from_millis(400));
    let layer = limited(server.store().await, policy);
    let seen = Arc::new(InFlight::default());
    let short = layer.layer(streaming(Arc::clone(&seen), Duration::from_millis(40)));
    // Streams of 120 ms, one starting every 10 ms, over a 100 ms renewal tick: many end
    // while their renewal is on its way.
    let streams = (0..60).map(|i| {
        let short = short.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(10 * i)).await;
            let response = short.oneshot(request("k")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            response.into_body().collect().await.unwrap();
        }
    });
    join_all(streams).await;
    assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    let lost = "was gone at its renewal";
    assert_eq!(
        captured.text().matches(lost).count(),
        0,
        "{}",
        captured.text()
    );
    let long = layer.layer(endless()).oneshot(request("k")).await.unwrap();
    assert_eq!(long.status(), StatusCode::OK);
    crate::support::cluster::cli(server.port(), &["FLUSHALL"]);
    // Several ticks later: reported once.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        captured.text().matches(lost).count(),
        1,
        "{}",
        captured.text()
    );
    drop(long);
}

/// Memory pressure on the memory store: `max_keys(10_000)`, a key holding both its slots with
/// two streams, then 20 000 other clients decided: the key's slots stay (its entry is pinned
/// while it holds slots), so a third stream of the key is refused and at most 2 are in flight
/// (before, its slots were evicted and a third was admitted: 3 in flight at cap 2).
#[tokio::test]
async fn a_flood_of_other_keys_never_evicts_slots_in_use_on_memory() {
    let store = MemoryStore::builder().max_keys(10_000).build();
    let layer = limited(store.clone(), streams("evict", 2, Duration::from_secs(10)));
    let service = layer.layer(endless());
    let [first, second, refused] = fill_two(&service).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let others = Policy::new("others", ["5/1m".parse().unwrap()]).unwrap();
    for i in 0..20_000 {
        let key = Key::from(format!("client-{i}"));
        assert!(store.check(&key, &others, 1).await.unwrap().is_allowed());
    }
    assert!(key_count(&store) <= 10_000, "{} keys", key_count(&store));
    let third = service.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(
        third.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a third in flight"
    );
    drop((first, second));
}

/// The `Retry-After` of a refusal for a slot says how long the key's slots are typically held
/// across the fleet, as the store keeps it, even on an instance that never held one.
#[tokio::test]
async fn a_slot_refusal_says_the_fleets_hold_time_on_redis() {
    let server = RedisServer::start();
    let policy = streams("fleet-hold", 2, Duration::from_secs(20));
    let holder = limited(server.store().await, policy.clone()).layer(endless());
    let fresh = limited(server.store().await, policy).layer(endless());
    refused_after_holds(
        &holder,
        &fresh,
        Duration::from_millis(2_500),
        tokio::time::sleep,
    )
    .await;
}

/// The same on one memory store shared by two layers.
#[tokio::test(start_paused = true)]
async fn a_slot_refusal_says_the_fleets_hold_time_on_memory() {
    let store = MemoryStore::new();
    let policy = streams("fleet-hold-memory", 2, Duration::from_secs(60));
    let holder = limited(store.clone(), policy.clone()).layer(endless());
    let fresh = limited(store, policy).layer(endless());
    refused_after_holds(&holder, &fresh, Duration::from_secs(7), tokio::time::sleep).await;
}

/// `holder` takes the key's two slots and keeps them `held`, twice; then, with both held
/// again, `fresh` (which has held none) is refused with a `Retry-After` of `held`, rounded up.
async fn refused_after_holds<S, F, Fut>(holder: &S, fresh: &S, held: Duration, sleep: F)
where
    S: Service<Request<()>, Response = Response<tower_redis_ratelimit::body::ResponseBody<Body>>>
        + Clone,
    S::Error: std::fmt::Debug,
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = ()>,
{
    for _ in 0..2 {
        let both = join_all((0..2).map(|_| holder.clone().oneshot(request("k")))).await;
        assert!(both
            .iter()
            .all(|r| r.as_ref().unwrap().status() == StatusCode::OK));
        sleep(held).await;
        drop(both);
        // The give-backs are on their way (at once on the memory store).
        sleep(Duration::from_millis(200)).await;
    }
    let _both = join_all((0..2).map(|_| holder.clone().oneshot(request("k")))).await;
    let refused = fresh.clone().oneshot(request("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .to_owned();
    let expected = held.as_secs_f64().ceil() as u64;
    assert_eq!(retry, expected.to_string(), "held {held:?}");
}

/// A policy without rate limits: its concurrency limit alone decides, on both stores, across a
/// fleet; nothing is recorded but the slots (on Redis, no state key at all), and an admitted
/// response names the concurrency quota without counting a rate.
#[tokio::test]
async fn a_policy_without_rate_limits_is_decided_by_its_slots_alone() {
    let memory = MemoryStore::new();
    let policy = bare("bare-memory");
    let layers: Vec<_> = (0..4)
        .map(|_| limited(memory.clone(), policy.clone()))
        .collect();
    fleet_without_rate_limits("memory", &layers).await;
    assert_eq!(slots_in_use(&memory, &Key::from("k"), &policy), 0);

    let server = RedisServer::start();
    let policy = bare("bare-redis");
    let mut layers = Vec::new();
    for _ in 0..4 {
        layers.push(limited(server.store().await, policy.clone()));
    }
    fleet_without_rate_limits("redis", &layers).await;
    let state = redis_key(&server.store().await, &Key::from("k"), &policy);
    let client = server.client().await;
    let kept: u64 = fred::interfaces::KeysInterface::exists(&client, &state)
        .await
        .unwrap();
    assert_eq!(kept, 0, "no rate state in {state}");
    assert_eq!(slots_held(&server, "k", &policy).await, 0, "slots left");
}

/// A key blocked by an override, under a policy without rate limits, is refused as blocked on
/// both stores: at once, with no `Retry-After` (no wait lets it in), and not as full slots
/// that a request with `max_wait` would wait for.
#[tokio::test]
async fn a_block_without_rate_limits_is_refused_at_once_on_both_stores() {
    let memory = MemoryStore::new();
    let overrides = memory.overrides();
    refused_as_blocked("memory", memory, overrides, bare("blocked-memory")).await;
    let server = RedisServer::start();
    let redis = server.store().await;
    let overrides = redis.overrides();
    refused_as_blocked("redis", redis, overrides, bare("blocked-redis")).await;
}

async fn refused_as_blocked<St: Store>(
    label: &str,
    store: St,
    overrides: Overrides,
    policy: Policy,
) {
    let key = Key::from("k");
    overrides
        .set(&policy, &Scope::Key(key.clone()), &Override::Block)
        .await
        .unwrap();
    let decision = store.check(&key, &policy, 1).await.unwrap();
    assert!(!decision.is_allowed(), "{label}: {decision:?}");
    assert!(!decision.is_concurrency_limit(), "{label}: {decision:?}");
    assert_eq!(decision.retry_after(), None, "{label}: {decision:?}");
    let service = limited_waiting(store, policy, Duration::from_secs(30)).layer(endless());
    let started = std::time::Instant::now();
    let refused = service.oneshot(request("k")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS, "{label}");
    assert!(refused.headers().get("retry-after").is_none(), "{label}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{label}: waited {:?} for a slot",
        started.elapsed()
    );
}

/// 2 in flight per key, and no rate limit.
fn bare(name: &str) -> Policy {
    Policy::new(name, [])
        .unwrap()
        .concurrency(2)
        .unwrap()
        .slot_expiry(Duration::from_secs(10))
        .unwrap()
}

/// 200 streams at once on key `k` through `layers`: never more than 2 in flight, and the first
/// admitted response's fields name the concurrency quota alone.
async fn fleet_without_rate_limits<St: Store>(label: &str, layers: &[RateLimitLayer<Header, St>]) {
    let seen = Arc::new(InFlight::default());
    let services: Vec<_> = layers
        .iter()
        .map(|l| l.layer(streaming(Arc::clone(&seen), Duration::from_millis(20))))
        .collect();
    let first = services[0].clone().oneshot(request("k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK, "{label}");
    let named = first.headers()["ratelimit-policy"].to_str().unwrap();
    assert!(named.contains("concurrent-requests"), "{label}: {named}");
    assert!(first.headers().get("ratelimit").is_none(), "{label}");
    first.into_body().collect().await.unwrap();
    let statuses = fire(&services, "k", 200).await;
    for layer in layers {
        assert_eq!(layer.settled(Duration::from_secs(5)).await, 0);
    }
    check_fleet(&statuses, &seen, 2, &format!("{label}, no rate limit"));
}
