//! Other counts for one policy's state (`Policy::with_limits`): usage carries over, and a
//! named policy keeps its state by name and windows.

use super::*;
use tower_redis_ratelimit::test_util::{identity, redis_key, with_limits};

/// `sms` at 5 per hour: five at once; raised to 8, exactly three more; cut to 3, refused for
/// as long as the eight units take to leave room; back at 5, refused too, for its own wait.
async fn raise_cut_restore<St: Store>(store: &St, time: &Time, algorithm: Algorithm) {
    let sms = Policy::new("sms", [hourly(5)])
        .unwrap()
        .with_algorithm(algorithm);
    let key = Key::from(format!("+44 {algorithm:?}"));
    let start = time.now();
    assert_eq!(
        admitted(store, &key, &sms, 7).await,
        5,
        "{algorithm:?} at 5/1h"
    );

    let raised = with_limits(&sms, [hourly(8)]).unwrap();
    assert_eq!(identity(&raised), identity(&sms));
    assert_eq!(
        admitted(store, &key, &raised, 6).await,
        3,
        "{algorithm:?} raised to 8/1h"
    );

    for count in [3, 5] {
        let policy = with_limits(&sms, [hourly(count)]).unwrap();
        let refused = check(store, &key, &policy).await;
        let since = time.now() - start;
        let into = Duration::from_micros((time.now().as_micros() % HOUR.as_micros()) as u64);
        let expected = expected_wait(algorithm, count, 8, since, into);
        assert_wait(
            time,
            &refused,
            expected,
            &format!("{algorithm:?} at {count}/1h"),
        );
    }

    // Once the policy's own counts leave room, they decide as if nothing had changed.
    let wait = check(store, &key, &sms).await.retry_after().unwrap();
    if let Time::Manual(_) = time {
        time.pass(wait).await;
        assert!(
            check(store, &key, &sms).await.is_allowed(),
            "{algorithm:?} after {wait:?}"
        );
    }
}

#[tokio::test]
async fn other_counts_carry_usage_over_on_memory() {
    for algorithm in ALGORITHMS {
        let (store, time) = memory();
        raise_cut_restore(&store, &time, algorithm).await;
    }
}

#[tokio::test]
async fn other_counts_carry_usage_over_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    for algorithm in ALGORITHMS {
        raise_cut_restore(&store, &Time::Real, algorithm).await;
    }
}

/// Named policies share state by name and windows; unnamed ones by their whole limits.
async fn identities<St: Store>(store: &St) {
    let key = Key::from("client");
    let a: Policy = "2/1m".parse().unwrap();
    let b: Policy = "3/1m".parse().unwrap();
    assert_ne!(identity(&a), identity(&b));
    assert_eq!(admitted(store, &key, &a, 3).await, 2);
    assert_eq!(
        admitted(store, &key, &b, 4).await,
        3,
        "another unnamed policy shares nothing"
    );

    let named_a = a.clone().named("api").unwrap();
    let named_b = b.clone().named("api").unwrap();
    assert_eq!(identity(&named_a), identity(&named_b));
    assert_eq!(admitted(store, &key, &named_a, 3).await, 2);
    assert_eq!(
        admitted(store, &key, &named_b, 3).await,
        1,
        "one named budget"
    );
    let other_window = Policy::new("api", ["3/2m".parse().unwrap()]).unwrap();
    assert_ne!(identity(&other_window), identity(&named_a));
    assert_eq!(
        admitted(store, &key, &other_window, 4).await,
        3,
        "other windows start afresh"
    );
}

#[tokio::test]
async fn identities_on_memory() {
    identities(&memory().0).await;
}

#[tokio::test]
async fn identities_on_redis() {
    let server = RedisServer::start();
    let store = server.store().await;
    identities(&store).await;
    let key = Key::from("client");
    let sms = Policy::new("sms", [hourly(5)]).unwrap();
    let vip = with_limits(&sms, [hourly(50)]).unwrap();
    assert_eq!(redis_key(&store, &key, &sms), redis_key(&store, &key, &vip));
    assert_eq!(
        redis_key(&store, &key, &sms),
        "ratelimit:{sms:client}:log:1h"
    );
}

#[test]
fn other_counts_must_keep_the_windows() {
    let sms = Policy::new("sms", ["1/1m".parse().unwrap(), hourly(5)]).unwrap();
    assert_eq!(
        with_limits(&sms, [hourly(5)]),
        Err(PolicyError::OtherWindows {
            expected: "1m+1h".into()
        })
    );
    let other = with_limits(&sms, ["1/2m".parse().unwrap(), hourly(5)]);
    assert!(matches!(other, Err(PolicyError::OtherWindows { .. })));
    // In any order, like `Policy::new`.
    let vip = with_limits(&sms, [hourly(50), "2/1m".parse().unwrap()]).unwrap();
    assert_eq!(vip.limits()[0].count(), 2);
    assert_eq!(vip.limits()[1].count(), 50);
}

/// A rolling deploy that changes a named policy's counts: old instances run `api` at 10 per
/// hour, new ones at 20 (an hour, so that no window ends during the test). They share one state (the name and window are the same), and each
/// refuses at its own counts: together they never admit more than the larger count, and the
/// old ones stop at theirs, whoever spent the usage.
#[tokio::test]
async fn instances_with_other_counts_for_one_name_share_the_state() {
    let server = RedisServer::start();
    let (old, new): (RedisStore, RedisStore) = (server.store().await, server.store().await);
    let api = |count| Policy::new("api", [hourly(count)]);
    let (ten, twenty) = (api(10).unwrap(), api(20).unwrap());
    assert_eq!(
        redis_key(&old, &Key::from("c"), &ten),
        redis_key(&new, &Key::from("c"), &twenty)
    );
    for algorithm in ALGORITHMS {
        let key = Key::from(format!("client-{algorithm:?}"));
        let (ten, twenty) = (
            ten.clone().with_algorithm(algorithm),
            twenty.clone().with_algorithm(algorithm),
        );
        assert_eq!(admitted(&old, &key, &ten, 6).await, 6, "{algorithm:?}");
        assert_eq!(
            admitted(&new, &key, &twenty, 20).await,
            14,
            "{algorithm:?}: 20 in all"
        );
        assert_eq!(
            admitted(&old, &key, &ten, 5).await,
            0,
            "{algorithm:?}: old at its 10"
        );
    }
}
