//! What a box refuses and what sets it: a key that hits its limit or a charge that fills it,
//! the layer's and the deny cache's answers, `reset`, blocks and overrides, and a charge that
//! never extends a running box.

use super::*;

#[tokio::test]
async fn a_key_that_hits_its_limit_is_refused_for_the_box_on_memory() {
    for algorithm in ALGORITHMS {
        let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let (policy, key) = (boxed(algorithm), Key::from("mallory"));
        for _ in 0..3 {
            assert!(
                check(&store, &key, &policy).await.is_allowed(),
                "{algorithm:?}"
            );
        }
        let hit = check(&store, &key, &policy).await;
        assert!(
            !hit.is_allowed() && hit.in_penalty_box(),
            "{algorithm:?}: {hit:?}"
        );
        assert_eq!(hit.retry_after(), Some(BOX), "{algorithm:?}");
        // A minute on, the window would admit again; the box still refuses, counting down.
        clock.advance(Duration::from_secs(61));
        let still = check(&store, &key, &policy).await;
        assert!(still.in_penalty_box(), "{algorithm:?}: {still:?}");
        assert_eq!(still.retry_after(), Some(BOX - Duration::from_secs(61)));
        // A look is refused too, and sets nothing.
        assert!(store.peek(&key, &policy, 1).await.unwrap().in_penalty_box());
        clock.advance(BOX - Duration::from_secs(61));
        assert!(
            check(&store, &key, &policy).await.is_allowed(),
            "{algorithm:?}: free"
        );

        reset_clears_the_box(&store, &Key::from("trudy"), &policy).await;

        // Without a box, the same policy refuses only until the window allows.
        let plain = Policy::new("plain", ["3/1m".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let key = Key::from("carol");
        for _ in 0..4 {
            check(&store, &key, &plain).await;
        }
        clock.advance(Duration::from_secs(61));
        assert!(
            check(&store, &key, &plain).await.is_allowed(),
            "{algorithm:?}"
        );
    }
}

/// A charge that leaves the key no unit (a counted failure, a usage charge) boxes it too.
#[tokio::test]
async fn a_charge_that_fills_the_key_boxes_it() {
    for algorithm in ALGORITHMS {
        let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let (policy, key) = (boxed(algorithm), Key::from("eve"));
        let first = check(&store, &key, &policy).await;
        charge(&store, &key, &policy, &first, 1).await;
        assert!(
            !check(&store, &key, &policy).await.in_penalty_box(),
            "{algorithm:?}"
        );
        // 3 of 3 used: the next charge is past the limit and fills it.
        charge(&store, &key, &policy, &first, 1).await;
        // A look, which never sets the box itself, finds it set.
        let boxed = store.peek(&key, &policy, 1).await.unwrap();
        assert!(boxed.in_penalty_box(), "{algorithm:?}: {boxed:?}");
        assert_eq!(boxed.retry_after(), Some(BOX));
    }
}

/// Through the layer: `Retry-After` to the box's end, counting down, and the fields.
#[tokio::test]
async fn the_layer_answers_the_box_with_its_retry_after() {
    let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store)
        .policy(boxed(Algorithm::Gcra))
        .build()
        .unwrap();
    let service = crate::support::http::served(layer);
    let send = || async {
        let response = service.clone().oneshot(keyed("mallory")).await.unwrap();
        let field = |name: &str| {
            let value = response.headers().get(name);
            value.map(|v| v.to_str().unwrap().to_owned())
        };
        (
            response.status().as_u16(),
            field("retry-after"),
            field("ratelimit"),
        )
    };
    for _ in 0..3 {
        assert_eq!(send().await.0, 200);
    }
    assert_eq!(
        send().await,
        (429, Some("900".into()), Some("\"login\";r=0;t=900".into()))
    );
    clock.advance(Duration::from_secs(300));
    assert_eq!(send().await.1, Some("600".into()));
    clock.advance(Duration::from_secs(600));
    assert_eq!(send().await.0, 200);
}

/// On Redis, every algorithm: a box of 2 s over a window of 300 ms. The window has passed
/// long before the box ends, so each answer tells which one refused.
#[tokio::test]
async fn a_key_that_hits_its_limit_is_refused_for_the_box_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let block = Duration::from_secs(2);
    for algorithm in ALGORITHMS {
        let policy = Policy::new("login", ["2/300ms".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm)
            .block_for(block)
            .unwrap();
        let key = Key::from(format!("mallory-{algorithm:?}"));
        for _ in 0..2 {
            assert!(
                check(&store, &key, &policy).await.is_allowed(),
                "{algorithm:?}"
            );
        }
        let boxed_at = Instant::now();
        let hit = check(&store, &key, &policy).await;
        assert!(hit.in_penalty_box(), "{algorithm:?}: {hit:?}");
        assert_eq!(hit.retry_after(), Some(block));
        tokio::time::sleep(Duration::from_millis(700)).await;
        let still = check(&store, &key, &policy).await;
        assert!(still.in_penalty_box(), "{algorithm:?}: {still:?}");
        let left = still.retry_after().unwrap();
        // The box started when Redis ran the call, at most its round trip after `boxed_at`.
        assert!(
            left <= block - boxed_at.elapsed() + Duration::from_millis(150),
            "{algorithm:?}: {left:?} counts down"
        );
        tokio::time::sleep(left + Duration::from_millis(100)).await;
        assert!(
            check(&store, &key, &policy).await.is_allowed(),
            "{algorithm:?}: free"
        );

        let other = Key::from(format!("trudy-{algorithm:?}"));
        reset_clears_the_box(&store, &other, &policy).await;

        // A charge that fills the key boxes it in the same call.
        let filler = Key::from(format!("eve-{algorithm:?}"));
        let first = check(&store, &filler, &policy).await;
        charge(&store, &filler, &policy, &first, 1).await;
        let boxed = store.peek(&filler, &policy, 1).await.unwrap();
        assert!(boxed.in_penalty_box(), "{algorithm:?}: {boxed:?}");
    }
}

/// The deny cache (on for Redis) answers a boxed key locally, a second at a time, with the
/// box's `Retry-After`: here the hour the limit refuses, longer than the box.
#[tokio::test]
async fn the_deny_cache_repeats_the_box() {
    let server = RedisServer::start();
    let store = server.store().await;
    let policy = Policy::new("login", ["1/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(store.clone())
        .policy(policy.clone())
        .build()
        .unwrap();
    let service = crate::support::http::served(layer);
    let send = || async {
        let response = service.clone().oneshot(keyed("k")).await.unwrap();
        let retry = response.headers().get("retry-after").cloned();
        (response.status().as_u16(), retry)
    };
    assert_eq!(send().await.0, 200);
    let admin = crate::support::client(&server.url()).await;
    let before = crate::support::evalsha_calls(&admin).await;
    for _ in 0..5 {
        let (status, retry) = send().await;
        assert_eq!(status, 429);
        assert_eq!(retry.unwrap(), "3600");
    }
    assert_eq!(
        crate::support::evalsha_calls(&admin).await - before,
        1,
        "the first refusal asked Redis; the deny cache answered the rest"
    );
}

/// An operator's reset frees a boxed key on every instance within a second: each one's deny
/// cache repeats the box's refusal for a second at most, not for the box's whole length.
#[tokio::test]
async fn a_reset_frees_a_boxed_key_on_every_instance() {
    let server = RedisServer::start();
    let (instance, operator) = (server.store().await, server.store().await);
    let policy = Policy::new("login", ["1/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let layer = RateLimitLayer::builder()
        .key(api_key())
        .store(instance)
        .policy(policy.clone())
        .build()
        .unwrap();
    let service = crate::support::http::served(layer);
    let status = || async {
        let response = service.clone().oneshot(keyed("mallory")).await.unwrap();
        response.status().as_u16()
    };
    assert_eq!(status().await, 200);
    assert_eq!(status().await, 429);
    assert_eq!(status().await, 429, "repeated from the deny cache");
    operator
        .reset(&Key::from("mallory"), &policy)
        .await
        .unwrap();
    let reset = Instant::now();
    while status().await != 200 {
        assert!(
            reset.elapsed() < Duration::from_secs(2),
            "still refused 2 s after the reset"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("admitted again {:?} after the reset", reset.elapsed());
}

/// Under an override, a charge fills the key at the override's counts, on both stores: a VIP
/// raised from 3 to 10 an hour is not boxed at the policy's 3.
async fn an_override_decides_when_a_charge_fills<St: Store>(
    store: St,
    overrides: tower_redis_ratelimit::store::Overrides,
) {
    use tower_redis_ratelimit::store::{Override, Scope};

    let policy = Policy::new("login", ["3/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let key = Key::from("vip");
    let ten = Override::Limits(vec!["10/1h".parse().unwrap()]);
    overrides
        .set(&policy, &Scope::Key(key.clone()), &ten)
        .await
        .unwrap();
    let first = check(&store, &key, &policy).await;
    for _ in 0..8 {
        charge(&store, &key, &policy, &first, 1).await;
    }
    let nine = store.peek(&key, &policy, 1).await.unwrap();
    assert!(
        nine.is_allowed() && nine.remaining() == 1,
        "9 of 10: {nine:?}"
    );
    charge(&store, &key, &policy, &first, 1).await;
    let full = store.peek(&key, &policy, 1).await.unwrap();
    assert!(full.in_penalty_box(), "10 of 10: {full:?}");
}

#[tokio::test]
async fn an_override_decides_when_a_charge_fills_on_memory() {
    let store = MemoryStore::new();
    an_override_decides_when_a_charge_fills(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn an_override_decides_when_a_charge_fills_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    an_override_decides_when_a_charge_fills(store.clone(), store.overrides()).await;
}

/// A request larger than the limit itself is refused (no wait helps) without boxing the key:
/// the key did not hit its limit. Both stores.
async fn a_request_over_the_limit_itself_does_not_box<St: Store>(store: St) {
    let policy = Policy::new("export", ["5/1m".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    // A key with no state yet, and one with some.
    let (fresh, used) = (Key::from("bulk"), Key::from("bulk-again"));
    assert!(check(&store, &used, &policy).await.is_allowed());
    for key in [fresh, used] {
        let huge = store.check(&key, &policy, 10).await.unwrap();
        assert!(
            !huge.is_allowed() && huge.retry_after().is_none(),
            "{huge:?}"
        );
        assert!(!huge.in_penalty_box());
        assert!(check(&store, &key, &policy).await.is_allowed(), "{key:?}");
    }
}

#[tokio::test]
async fn a_request_over_the_limit_itself_does_not_box_on_memory() {
    a_request_over_the_limit_itself_does_not_box(MemoryStore::new()).await;
}

#[tokio::test]
async fn a_request_over_the_limit_itself_does_not_box_on_redis() {
    let server = RedisServer::start();
    a_request_over_the_limit_itself_does_not_box(server.store().await).await;
}

/// A block set by an operator answers as a block while the key is also boxed, on both stores:
/// the override comes first.
async fn a_block_answers_before_the_box<St: Store>(
    store: St,
    overrides: tower_redis_ratelimit::store::Overrides,
) {
    use tower_redis_ratelimit::store::{Override, Scope};

    let policy = boxed(Algorithm::Gcra);
    let key = Key::from("mallory");
    for _ in 0..3 {
        check(&store, &key, &policy).await;
    }
    assert!(check(&store, &key, &policy).await.in_penalty_box());
    let scope = Scope::Key(key.clone());
    overrides
        .set(&policy, &scope, &Override::Block)
        .await
        .unwrap();
    let blocked = check(&store, &key, &policy).await;
    assert!(
        !blocked.in_penalty_box() && blocked.limit() == 0,
        "{blocked:?}"
    );
    overrides.remove(&policy, &scope).await.unwrap();
    assert!(
        check(&store, &key, &policy).await.in_penalty_box(),
        "the box stays"
    );
}

#[tokio::test]
async fn a_block_answers_before_the_box_on_memory() {
    let store = MemoryStore::new();
    a_block_answers_before_the_box(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn a_block_answers_before_the_box_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    a_block_answers_before_the_box(store.clone(), store.overrides()).await;
}

/// A charge that leaves a boxed key full (a failure counted by outcome that lands late)
/// neither restarts nor extends the box: it ends when its refusal said. `3/300ms`, a box of
/// 1.5 s, and three units charged 500 ms into it; `time` is the store's.
async fn a_charge_does_not_extend_the_box<St: Store>(store: St, time: crate::support::time::Time) {
    let policy = Policy::new("login", ["3/300ms".parse().unwrap()])
        .unwrap()
        .block_for(Duration::from_millis(1500))
        .unwrap();
    let key = Key::from("eve");
    let first = check(&store, &key, &policy).await;
    for _ in 0..2 {
        assert!(check(&store, &key, &policy).await.is_allowed());
    }
    let refusal = check(&store, &key, &policy).await;
    let boxed_at = time.now();
    assert!(refusal.in_penalty_box(), "{refusal:?}");
    let retry = refusal.retry_after().unwrap();
    assert_eq!(
        retry,
        Duration::from_millis(1500),
        "the box outlasts the window"
    );
    let at = |offset: Duration| {
        let time = time.clone();
        async move {
            time.pass((boxed_at + offset).saturating_sub(time.now()))
                .await
        }
    };
    at(Duration::from_millis(500)).await;
    charge(&store, &key, &policy, &first, 3).await;
    let full = store.peek(&key, &policy, 1).await.unwrap();
    assert!(full.in_penalty_box(), "{full:?}");
    let left = full.retry_after().unwrap();
    assert!(
        left <= Duration::from_millis(1001),
        "{left:?} left: the charge restarted the box"
    );
    let margin = time.margin().max(Duration::from_millis(1));
    at(retry - margin).await;
    let early = check(&store, &key, &policy).await;
    assert!(early.in_penalty_box(), "{early:?}");
    at(retry + margin / 3).await;
    let admitted = check(&store, &key, &policy).await;
    assert!(admitted.is_allowed(), "at the box's end: {admitted:?}");
}

#[tokio::test]
async fn a_charge_does_not_extend_the_box_on_memory() {
    let clock = ManualClock::from(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    a_charge_does_not_extend_the_box(store, crate::support::time::Time::Manual(clock)).await;
}

#[tokio::test]
async fn a_charge_does_not_extend_the_box_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    a_charge_does_not_extend_the_box(store, crate::support::time::Time::Real).await;
}

/// Two policies of one name, one with a box and one without, share their state: the box the
/// first sets refuses only its own requests, on both stores alike. `3/300ms`, a box of 60 s;
/// once the window has passed, the unboxed policy admits the key.
async fn a_box_is_its_own_policys<St: Store>(store: St, time: crate::support::time::Time) {
    let window = Duration::from_millis(300);
    let plain = Policy::new(
        "login",
        [format!("3/{}ms", window.as_millis()).parse().unwrap()],
    )
    .unwrap();
    let with_box = plain.clone().block_for(secs(60)).unwrap();
    let key = Key::from("eve");
    for _ in 0..3 {
        assert!(check(&store, &key, &with_box).await.is_allowed());
    }
    assert!(check(&store, &key, &with_box).await.in_penalty_box());
    time.pass(window + time.margin().max(Duration::from_millis(1)))
        .await;
    let unboxed = check(&store, &key, &plain).await;
    assert!(
        unboxed.is_allowed(),
        "the box answered another policy: {unboxed:?}"
    );
}

#[tokio::test]
async fn a_box_is_its_own_policys_on_memory() {
    let clock = ManualClock::from(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    a_box_is_its_own_policys(store, crate::support::time::Time::Manual(clock)).await;
}

#[tokio::test]
async fn a_box_is_its_own_policys_on_redis() {
    let server = RedisServer::start();
    a_box_is_its_own_policys(server.store().await, crate::support::time::Time::Real).await;
}

/// The box's look goes by the limits in force for the key, an override's. A sliding log of 3
/// per 20 units, raised to 5 for the key, with a box of 10 units: five admitted at 0, 1, .., 4
/// units, the sixth refused at 5 units. At 6 units, in the box (to 15), the override's limit
/// admits again once the event at 0 leaves, at 20: 14 units to wait (the policy's own 3 would
/// wait for the event at 2, 16 units). `unit` scales it to each store; `time` is the store's.
async fn the_box_looks_under_the_override<St: Store>(
    store: St,
    overrides: tower_redis_ratelimit::store::Overrides,
    time: crate::support::time::Time,
    unit: Duration,
) {
    use tower_redis_ratelimit::store::{Override, Scope};
    use tower_redis_ratelimit::Limit;

    let window = 20 * unit;
    let limit = |count: u64| Limit::new(count, window).unwrap();
    let policy = Policy::new("login", [limit(3)])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
        .block_for(10 * unit)
        .unwrap();
    let key = Key::from("vip");
    let raised = Override::Limits(vec![limit(5)]);
    overrides
        .set(&policy, &Scope::Key(key.clone()), &raised)
        .await
        .unwrap();
    let start = time.now();
    let at = |units: u32| {
        let time = time.clone();
        async move {
            time.pass((start + units * unit).saturating_sub(time.now()))
                .await
        }
    };
    for k in 0..5 {
        at(k).await;
        assert!(check(&store, &key, &policy).await.is_allowed(), "#{k}");
    }
    at(5).await;
    let refusal = check(&store, &key, &policy).await;
    assert!(refusal.in_penalty_box(), "{refusal:?}");
    at(6).await;
    let looked = check(&store, &key, &policy).await;
    assert!(looked.in_penalty_box(), "{looked:?}");
    assert_eq!(looked.limit(), 5, "{looked:?}");
    let retry = looked.retry_after().unwrap();
    // The events' times are the store's when each was recorded, a little after `start + k`
    // on Redis: the slack goes both ways (its own limits, 3, would say 16 units).
    let (want, slack) = (14 * unit, unit / 2);
    assert!(
        retry.abs_diff(want) <= slack,
        "{retry:?} to wait, not {want:?}"
    );
}

#[tokio::test]
async fn the_box_looks_under_the_override_on_memory() {
    let clock = ManualClock::from(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let time = crate::support::time::Time::Manual(clock);
    the_box_looks_under_the_override(store.clone(), store.overrides(), time, secs(180)).await;
}

#[tokio::test]
async fn the_box_looks_under_the_override_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    let (overrides, unit) = (store.overrides(), Duration::from_millis(200));
    the_box_looks_under_the_override(store, overrides, crate::support::time::Time::Real, unit)
        .await;
}

/// An override changes counts alone: the penalty box is the request's policy's, whatever the
/// policy the override was set through had (an admin tool parsing the policy's limits has none).
async fn the_box_is_the_requests_under_an_override<St: Store>(
    store: St,
    overrides: tower_redis_ratelimit::store::Overrides,
) {
    use tower_redis_ratelimit::store::{Override, Scope};

    for algorithm in ALGORITHMS {
        let plain = Policy::new("login", ["3/1m".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let lowered = Override::Limits(vec!["2/1m".parse().unwrap()]);
        for (set_through, decided_by, boxes) in [
            (plain.clone(), boxed(algorithm), true),
            (boxed(algorithm), plain.clone(), false),
        ] {
            let key = Key::from(format!("{algorithm:?}-{boxes}"));
            let scope = Scope::Key(key.clone());
            overrides.set(&set_through, &scope, &lowered).await.unwrap();
            for k in 0..2 {
                let admitted = check(&store, &key, &decided_by).await;
                assert!(admitted.is_allowed(), "{algorithm:?} #{k}: {admitted:?}");
            }
            let refused = check(&store, &key, &decided_by).await;
            assert!(!refused.is_allowed(), "{algorithm:?}: {refused:?}");
            assert_eq!(
                refused.in_penalty_box(),
                boxes,
                "{algorithm:?}: {refused:?}"
            );
        }
    }
}

#[tokio::test]
async fn the_box_is_the_requests_under_an_override_on_memory() {
    let store = MemoryStore::new();
    the_box_is_the_requests_under_an_override(store.clone(), store.overrides()).await;
}

#[tokio::test]
async fn the_box_is_the_requests_under_an_override_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    the_box_is_the_requests_under_an_override(store.clone(), store.overrides()).await;
}
