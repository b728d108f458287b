//! The memory store keeps boxed keys under memory pressure, and its bound.

use super::*;
use tower_redis_ratelimit::test_util::{holds_slot, key_count, slots_in_use};

/// Memory pressure: a store of 1 000 keys (4 shards of 250), a boxed key and a key with a
/// request in flight (a concurrency slot), then 100 000 other clients, each admitted twice
/// under the boxed policy (never boxed) and admitted then refused under an hourly one, on a
/// virtual clock that moves 1 µs per client (nothing expires by itself). Both keys are pinned,
/// and the least recently used entries go instead.
#[tokio::test]
async fn a_boxed_key_outlives_a_flood_of_other_keys_on_memory() {
    let clock = ManualClock::from(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder()
        .max_keys(1_000)
        .clock(clock.clone())
        .build();
    let policy = boxed(Algorithm::Gcra);
    let hourly = Policy::new("search", ["1/1h".parse().unwrap()]).unwrap();
    let streams = Policy::new("streams", ["1000/1m".parse().unwrap()])
        .unwrap()
        .concurrency(1)
        .unwrap();
    let (mallory, streamer) = (Key::from("mallory"), Key::from("streamer"));
    for _ in 0..3 {
        check(&store, &mallory, &policy).await;
    }
    assert!(check(&store, &mallory, &policy).await.in_penalty_box());
    assert!(holds_slot(&check(&store, &streamer, &streams).await));
    for i in 0..100_000 {
        clock.advance(Duration::from_micros(1));
        let other = Key::from(format!("user-{i}"));
        for _ in 0..2 {
            assert!(check(&store, &other, &policy).await.is_allowed());
        }
        assert!(check(&store, &other, &hourly).await.is_allowed());
        assert!(!check(&store, &other, &hourly).await.is_allowed());
    }
    assert!(key_count(&store) <= 1_000, "{} keys", key_count(&store));
    let still = check(&store, &mallory, &policy).await;
    assert!(still.in_penalty_box(), "the box was evicted: {still:?}");
    assert_eq!(still.retry_after(), Some(BOX - Duration::from_millis(100)));
    assert_eq!(
        slots_in_use(&store, &streamer, &streams),
        1,
        "the slot was evicted"
    );
}

/// Past the box's length, a key its limits still refuse stays locked out: ten failures at
/// once at `10/1h` with a 15-minute box lock it out for the hour, and a flood of other keys
/// 16 minutes in does not evict it into a fresh budget.
#[tokio::test]
async fn a_lockout_outlives_a_flood_of_other_keys_after_the_box_on_memory() {
    let clock = ManualClock::from(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder()
        .max_keys(1_000)
        .clock(clock.clone())
        .build();
    let policy = Policy::new("login", ["10/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let mallory = Key::from("mallory");
    for _ in 0..10 {
        assert!(check(&store, &mallory, &policy).await.is_allowed());
    }
    let locked = check(&store, &mallory, &policy).await;
    assert_eq!(locked.retry_after(), Some(secs(3600)));
    clock.advance(BOX + secs(60));
    for i in 0..3_000 {
        let other = Key::from(format!("user-{i}"));
        assert!(check(&store, &other, &policy).await.is_allowed());
    }
    assert!(key_count(&store) <= 1_000, "{} keys", key_count(&store));
    let still = check(&store, &mallory, &policy).await;
    assert!(
        !still.is_allowed(),
        "evicted into a fresh budget: {still:?}"
    );
    assert_eq!(still.retry_after(), Some(secs(3600) - BOX - secs(60)));
}

/// A shard full of boxed keys (a store of 8 keys is one shard of 8) still holds at most 8: a
/// ninth key evicts the box that ends soonest, k0's, although k1's was used less recently.
#[tokio::test]
async fn a_store_full_of_boxed_keys_keeps_its_bound_on_memory() {
    let clock = ManualClock::from(UNIX_EPOCH + secs(ON_THE_HOUR));
    let store = MemoryStore::builder()
        .max_keys(8)
        .clock(clock.clone())
        .build();
    let policy = Policy::new("login", ["1/1h".parse().unwrap()])
        .unwrap()
        .block_for(BOX)
        .unwrap();
    let keys: Vec<Key> = (0..9).map(|i| Key::from(format!("k{i}"))).collect();
    for key in &keys[..8] {
        clock.advance(SECOND);
        assert!(check(&store, key, &policy).await.is_allowed());
        assert!(check(&store, key, &policy).await.in_penalty_box());
    }
    clock.advance(SECOND);
    assert!(check(&store, &keys[0], &policy).await.in_penalty_box());
    clock.advance(SECOND);
    assert!(check(&store, &keys[8], &policy).await.is_allowed());
    assert!(key_count(&store) <= 8, "{} keys", key_count(&store));
    assert!(check(&store, &keys[8], &policy).await.in_penalty_box());
    for key in &keys[1..8] {
        let decision = check(&store, key, &policy).await;
        assert!(decision.in_penalty_box(), "{key:?}: {decision:?}");
    }
    assert!(
        check(&store, &keys[0], &policy).await.is_allowed(),
        "k0's box, the soonest to end, was evicted and starts afresh"
    );
    assert!(key_count(&store) <= 8, "{} keys", key_count(&store));
}
