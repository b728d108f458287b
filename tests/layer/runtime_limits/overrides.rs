//! The store's overrides for a key, a plan or a whole policy: raise, cut, block, restore;
//! the last write of a scope governs, and the limits version never goes back.

use super::*;

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

/// Two instances on one Redis: what one sets, the other decides by, reading it back as set.
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
    // Past the bound on following an override (see below).
    tokio::time::sleep(FOLLOW).await;
    assert_eq!(admitted(&b, &phone, &sms, 6).await, 3);
    assert_eq!(
        b.overrides().get(&sms, &Scope::Key(phone)).await.unwrap(),
        Some(eight)
    );
}

/// The bound on following an override (`docs/promises.md`).
const FOLLOW: Duration = Duration::from_millis(250);

/// Two instances on one Redis. B decides a key every millisecond, on the plain scripts (which
/// read no override: B reads the hash about once per 250 ms, not once per call), while A
/// blocks the key. Every decision B starts 250 ms or more after A's `set` returned is refused:
/// B follows within the bound, whether its next read of the limits version or the end of its
/// lane's confirmation comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_deciding_on_the_plain_scripts_follows_an_override_within_250_ms() {
    let server = RedisServer::start();
    let (a, b): (RedisStore, RedisStore) = (server.store().await, server.store().await);
    let redis = server.client().await;
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let sms = Policy::new("sms", [hourly(1_000_000)])
            .unwrap()
            .with_algorithm(algorithm);
        let phone = Key::from(format!("+44770090{algorithm:?}"));
        // B on the plain scripts: far fewer reads of the overrides than decisions.
        let reads = command_calls(&redis, "hlen").await;
        let started = tokio::time::Instant::now();
        for _ in 0..100 {
            assert!(check(&b, &phone, &sms).await.is_allowed());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let reads = command_calls(&redis, "hlen").await - reads;
        let most = started.elapsed().as_millis() / FOLLOW.as_millis() + 2;
        assert!(reads as u128 <= most, "{algorithm:?}: {reads} reads");

        a.overrides()
            .set(&sms, &Scope::Key(phone.clone()), &Override::Block)
            .await
            .unwrap();
        let returned = tokio::time::Instant::now();
        let (last_admitted, first_refused) = follow(&b, &phone, &sms, returned).await;
        assert!(
            last_admitted.is_none_or(|start| start < FOLLOW),
            "{algorithm:?}: admitted a decision started {last_admitted:?} after the block \
             (first refused {first_refused:?})"
        );
        assert!(first_refused.is_some(), "{algorithm:?}");
    }
}

/// Decisions of `key` under `policy` through `store`, each timed from before it starts
/// (since `from`), until 3 × [`FOLLOW`] after `from`: the start of the last one admitted and
/// of the first one refused.
async fn follow(
    store: &RedisStore,
    key: &Key,
    policy: &Policy,
    from: tokio::time::Instant,
) -> (Option<Duration>, Option<Duration>) {
    let (mut last_admitted, mut first_refused) = (None, None);
    while from.elapsed() < 3 * FOLLOW {
        let start = from.elapsed();
        match check(store, key, policy).await.is_allowed() {
            true => last_admitted = Some(start),
            false => first_refused = first_refused.or(Some(start)),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    (last_admitted, first_refused)
}

/// Copies the one override in the hash of overrides to `scratch`: the hash's name, the
/// field and the value.
const KEEP: &str = "for _, k in ipairs(redis.call('KEYS', '*')) do
  if redis.call('TYPE', k).ok == 'hash' and redis.call('HEXISTS', k, '') == 1 then
    local all = redis.call('HGETALL', k)
    for i = 1, #all, 2 do
      if all[i] ~= '' then
        redis.call('HSET', KEYS[1], 'hash', k, 'field', all[i], 'value', all[i + 1])
        return 1
      end
    end
  end
end
return 0";

/// Writes the override kept by [`KEEP`] back, and moves the hash's generation, as a write
/// does, but raises no limits version: what a Redis Cluster's writer that died between its
/// hash writes and its raise leaves behind.
const UNANNOUNCED: &str = "local kept = redis.call('HMGET', KEYS[1], 'hash', 'field', 'value')
redis.call('HSET', kept[1], kept[2], kept[3])
local t = redis.call('TIME')
redis.call('HSET', kept[1], '', string.format('%d', tonumber(t[1]) * 1000000 + tonumber(t[2])))
return 1";

/// An override written without its announcement (the limits version unchanged, as a Redis
/// Cluster writer that died between its hash writes and its raise leaves it): an instance
/// deciding on the plain scripts still follows it within 250 ms, once the full call that
/// confirmed its lane is that old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_written_without_its_announcement_is_followed_within_250_ms() {
    use fred::interfaces::LuaInterface;

    let server = RedisServer::start();
    let (a, b): (RedisStore, RedisStore) = (server.store().await, server.store().await);
    let redis = server.client().await;
    let sms = Policy::new("sms", [hourly(1_000_000)]).unwrap();
    let (phone, scope) = (
        Key::from("+447700900999"),
        Scope::Key(Key::from("+447700900999")),
    );
    // The block's field and value, kept aside; then no override at all.
    let overrides = a.overrides();
    overrides.set(&sms, &scope, &Override::Block).await.unwrap();
    let kept: i64 = redis.eval(KEEP, vec!["scratch"], ()).await.unwrap();
    assert_eq!(kept, 1);
    assert!(overrides.remove(&sms, &scope).await.unwrap());
    let removed = tokio::time::Instant::now();
    let (admitted, _) = follow(&b, &phone, &sms, removed).await;
    assert!(admitted.is_some_and(|start| start >= 2 * FOLLOW));

    let _: i64 = redis.eval(UNANNOUNCED, vec!["scratch"], ()).await.unwrap();
    let written = tokio::time::Instant::now();
    let (last_admitted, first_refused) = follow(&b, &phone, &sms, written).await;
    assert!(
        last_admitted.is_none_or(|start| start < FOLLOW),
        "admitted a decision started {last_admitted:?} after the write (first refused \
         {first_refused:?})"
    );
    assert!(first_refused.is_some());
}

#[tokio::test]
async fn overrides_must_keep_the_windows() {
    let store = MemoryStore::new();
    let sms = Policy::new("sms", ["1/1m".parse().unwrap(), hourly(5)]).unwrap();
    // A window the policy does not have is refused, nothing written.
    let wrong = Override::Limits(vec!["50/2h".parse().unwrap()]);
    let error = store
        .overrides()
        .set(&sms, &Scope::All, &wrong)
        .await
        .unwrap_err();
    let cause = std::error::Error::source(&error).map(ToString::to_string);
    assert!(cause.is_some_and(|c| c.contains("1m+1h")), "{error:?}");
    assert_eq!(store.overrides().list(&sms).await.unwrap(), vec![]);
    // Some of its windows: the others keep the policy's counts; read back as set.
    let partial = Override::Limits(vec![hourly(50)]);
    store
        .overrides()
        .set(&sms, &Scope::All, &partial)
        .await
        .unwrap();
    let listed = store.overrides().list(&sms).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].1.to_string(), "50/1h");
    store.overrides().remove(&sms, &Scope::All).await.unwrap();
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
    let admin = crate::support::client(&server.url()).await;
    let script = [
        include_str!("../../../src/store/redis/scripts/limits_version.lua"),
        include_str!("../../../src/store/redis/scripts/limits_bump.lua"),
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
        (
            Scope::Plan("free".into()),
            tower_redis_ratelimit::test_util::on_plan(api.clone(), "free"),
            "p",
        ),
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
    let admin = crate::support::client(&server.url()).await;
    let script = [
        include_str!("../../../src/store/redis/scripts/limits_version.lua"),
        include_str!("../../../src/store/redis/scripts/override_write.lua"),
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
