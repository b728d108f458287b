//! The sliding-window log in the embedded store, on tokio's paused (virtual) clock.

use std::time::Duration;

use crate::support::scenarios::{self, check};
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::test_util::{events, key_count};
use tower_redis_ratelimit::{Key, MemoryStore, Policy};

#[tokio::test(start_paused = true)]
async fn multi_limit_policy() {
    scenarios::multi_limit(MemoryStore::new(), Duration::ZERO).await;
}

#[tokio::test(start_paused = true)]
async fn concurrent_handles_admit_exactly_the_limit() {
    let store = MemoryStore::new();
    scenarios::concurrent_exact(&[store.clone(), store], 200, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_admit_exactly_the_limit() {
    let store = MemoryStore::new();
    let policy: Policy = "50/10s".parse().unwrap();
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (store, policy) = (store.clone(), policy.clone());
            tokio::spawn(async move { check(&store, "crowd", &policy).await.is_allowed() })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    assert_eq!(admitted, 50);
}

#[tokio::test(start_paused = true)]
async fn retrying_client_is_not_locked_out() {
    scenarios::retrying_client_is_not_locked_out(MemoryStore::new(), Duration::ZERO).await;
}

#[tokio::test(start_paused = true)]
async fn cost_and_keys() {
    scenarios::cost_and_keys(MemoryStore::new()).await;
}

#[tokio::test(start_paused = true)]
async fn one_event_per_admitted_request_and_none_per_denied() {
    let store = MemoryStore::new();
    let policy = Policy::new("burst", ["100/10s".parse().unwrap()]).unwrap();
    scenarios::concurrent_exact(std::slice::from_ref(&store), 150, 100).await;
    assert_eq!(events(&store, &Key::from("crowd"), &policy), 100);
    for _ in 0..20 {
        assert!(!check(&store, "crowd", &policy).await.is_allowed());
    }
    assert_eq!(events(&store, &Key::from("crowd"), &policy), 100);
}

#[test]
fn injected_clock_drives_the_windows() {
    let clock = ManualClock::default();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy: Policy = "1/1m".parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(check(&store, "k", &policy).await.is_allowed());
        clock.advance(Duration::from_secs(59));
        let d = check(&store, "k", &policy).await;
        assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
        clock.advance(Duration::from_secs(1));
        assert!(check(&store, "k", &policy).await.is_allowed());
    });
}

/// Idle keys leave the store once twice their longest window has passed (event times up to a
/// window back read a window further), on the store's clock.
#[tokio::test(start_paused = true)]
async fn idle_keys_are_evicted() {
    let store = MemoryStore::builder().max_keys(1_000).build();
    let policy: Policy = "5/100ms".parse().unwrap();
    for i in 0..100 {
        check(&store, &format!("client-{i}"), &policy).await;
    }
    assert_eq!(key_count(&store), 100);
    assert_eq!(events(&store, &Key::from("client-7"), &policy), 1);
    tokio::time::advance(Duration::from_millis(199)).await;
    check(&store, "client-7", &policy).await;
    tokio::time::advance(Duration::from_millis(2)).await;
    assert_eq!(key_count(&store), 1, "only client-7 was used within 200ms");
    assert_eq!(events(&store, &Key::from("client-7"), &policy), 1);
    tokio::time::advance(Duration::from_millis(200)).await;
    assert_eq!(key_count(&store), 0);
}

/// A flood of new keys past the bound evicts the keys idle the longest, never the one in use.
#[tokio::test(start_paused = true)]
async fn key_count_is_bounded_and_busy_keys_stay() {
    let store = MemoryStore::builder().max_keys(1_000).build();
    let policy: Policy = "5/1h".parse().unwrap();
    for _ in 0..5 {
        assert!(check(&store, "busy", &policy).await.is_allowed());
    }
    for i in 0..20_000 {
        tokio::time::advance(Duration::from_millis(1)).await;
        check(&store, &format!("client-{i}"), &policy).await;
        if i % 100 == 0 {
            // The busy client keeps asking and keeps being refused: its state survives.
            assert!(!check(&store, "busy", &policy).await.is_allowed(), "at {i}");
        }
        if i % 100 == 50 {
            assert!(key_count(&store) <= 1_000, "{} keys", key_count(&store));
        }
    }
    assert!(key_count(&store) <= 1_000, "{} keys", key_count(&store));
}

/// A scheduled event far ahead keeps its key beyond the window after now.
#[tokio::test(start_paused = true)]
async fn future_events_keep_their_key() {
    let store = MemoryStore::new();
    let policy: Policy = "1/1m".parse().unwrap();
    let key = Key::from("scheduled");
    let in_an_hour = std::time::SystemTime::now() + Duration::from_secs(3600);
    let at = |offset: u64| in_an_hour + Duration::from_secs(offset);
    use tower_redis_ratelimit::Store;
    assert!(store
        .check_at(&key, &policy, 1, at(0))
        .await
        .unwrap()
        .is_allowed());
    tokio::time::advance(Duration::from_secs(600)).await;
    assert_eq!(key_count(&store), 1);
    assert!(!store
        .check_at(&key, &policy, 1, at(30))
        .await
        .unwrap()
        .is_allowed());
}

/// A request keeps one event whatever its cost, and the log still counts every unit: after
/// 100 requests of cost 1 000 under 100 000 per minute nothing is left, and each retry is when
/// enough of the oldest requests' units have aged out.
#[test]
fn one_event_per_request_whatever_its_cost() {
    use tower_redis_ratelimit::Store;
    let clock = ManualClock::default();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy: Policy = "100000/1m".parse().unwrap();
    let key = Key::from("usage");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let ms = Duration::from_millis;
    rt.block_on(async {
        let d = store.check(&key, &policy, 1_000).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 99_000);
        assert_eq!(events(&store, &key, &policy), 1);
        for i in 2..=100u64 {
            clock.advance(ms(10));
            let d = store.check(&key, &policy, 1_000).await.unwrap();
            assert!(d.is_allowed());
            assert_eq!(d.remaining(), 100_000 - i * 1_000);
        }
        assert_eq!(events(&store, &key, &policy), 100);

        // 1 s after the first request, which leaves at 60 s.
        clock.advance(ms(10));
        let d = store.check(&key, &policy, 1).await.unwrap();
        assert!(!d.is_allowed());
        assert_eq!((d.remaining(), d.retry_after()), (0, Some(ms(59_000))));
        assert_eq!(d.reset_after(), ms(59_000));
        // 1 001 units: the second request must leave too (at 60.01 s); 2 500: the third.
        let d = store.check(&key, &policy, 1_001).await.unwrap();
        assert_eq!(d.retry_after(), Some(ms(59_010)));
        let d = store.peek(&key, &policy, 2_500).await.unwrap();
        assert_eq!(d.retry_after(), Some(ms(59_020)));
        assert_eq!(events(&store, &key, &policy), 100, "refusals add nothing");

        clock.advance(ms(59_000));
        let d = store.check(&key, &policy, 1_000).await.unwrap();
        assert!(d.is_allowed());
        assert_eq!(d.remaining(), 0);
        assert!(!store.check(&key, &policy, 1).await.unwrap().is_allowed());
        // The first left the window, but is kept a window more (event times up to a window
        // back read it).
        assert_eq!(events(&store, &key, &policy), 101, "one came");
    });
}

/// Two policies that share a name (both parsed from strings are `default`) but not their
/// limits or algorithm keep apart on one store: state is kept under the policy's identity.
#[tokio::test]
async fn same_named_policies_keep_apart() {
    use tower_redis_ratelimit::{Algorithm, Store};
    let store = MemoryStore::new();
    let key = Key::from("client");
    let login: Policy = "3/1m".parse().unwrap();
    let search: Policy = "10/1m".parse().unwrap();
    let search_gcra = search.clone().with_algorithm(Algorithm::Gcra);
    assert_eq!((login.name(), search.name()), ("default", "default"));
    let mut admitted = [0; 3];
    for _ in 0..12 {
        for (i, policy) in [&login, &search, &search_gcra].into_iter().enumerate() {
            let decision = store.check(&key, policy, 1).await.unwrap();
            admitted[i] += usize::from(decision.is_allowed());
        }
    }
    assert_eq!(
        admitted,
        [3, 10, 10],
        "login 3/1m, search 10/1m (log), search 10/1m (GCRA)"
    );
}
