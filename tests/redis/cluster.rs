//! The Redis store against a real three-primary Redis Cluster.

use std::time::Duration;

use crate::support::cluster::RedisCluster;
use crate::support::conformance::{self, SCENARIOS};
use crate::support::evalsha_calls;
use crate::support::scenarios::{self, MARGIN};
use fred::prelude::*;
use futures::future::join_all;
use tower_redis_ratelimit::test_util::{holds_slot, redis_key, renew};
use tower_redis_ratelimit::{Algorithm, Key, Limit, Policy, RedisStore, Store, StoreError};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_exact_for_keys_on_every_primary() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    let policy: Policy = "5/10s".parse().unwrap();
    let keys: Vec<Key> = (0..60).map(|i| Key::from(format!("client-{i}"))).collect();
    let admitted = join_all(keys.iter().map(|key| {
        let (store, policy) = (store.clone(), policy.clone());
        async move {
            let decisions = join_all((0..15).map(|_| store.check(key, &policy, 1))).await;
            decisions
                .into_iter()
                .filter(|d| d.as_ref().unwrap().is_allowed())
                .count()
        }
    }))
    .await;
    assert!(admitted.iter().all(|&n| n == 5), "{admitted:?}");

    // The keys really are spread over all three primaries.
    for node in &cluster.nodes {
        let keys: u64 = node.client().await.dbsize().await.unwrap();
        assert!(keys > 0, "node {} holds no key", node.port());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_and_the_multi_limit_work_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::Gcra,
    ] {
        conformance::peek_and_reset(&store, algorithm).await;
    }
    let table = join_all(
        SCENARIOS
            .iter()
            .map(|scenario| conformance::run(&store, scenario, Duration::from_millis(60))),
    );
    let multi = scenarios::multi_limit(store.clone(), MARGIN);
    tokio::join!(table, multi);
}

#[tokio::test]
async fn scripts_are_reloaded_on_every_primary() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    for node in &cluster.nodes {
        let _: () = node.client().await.script_flush(false).await.unwrap();
    }
    let policy: Policy = "3/10s".parse().unwrap();
    for i in 0..30 {
        let key = Key::from(format!("after-flush-{i}"));
        assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_for_many_clients_share_script_calls_on_a_cluster() {
    const CLIENTS: usize = 200;
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    let policy: Policy = "3/10s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let keys: Vec<Key> = (0..CLIENTS).map(|i| Key::from(format!("c{i}"))).collect();
    let mut admins = Vec::new();
    for node in &cluster.nodes {
        admins.push(node.client().await);
    }
    let mut before = 0;
    for admin in &admins {
        before += evalsha_calls(admin).await;
    }
    let decisions = join_all((0..5).flat_map(|_| keys.iter()).map(|key| {
        let (store, policy) = (&store, &policy);
        async move { (key, store.check(key, policy, 1).await.unwrap()) }
    }))
    .await;
    let mut calls = 0;
    for admin in &admins {
        calls += evalsha_calls(admin).await;
    }
    calls -= before;
    for key in &keys {
        let admitted = decisions
            .iter()
            .filter(|(k, d)| *k == key && d.is_allowed())
            .count();
        assert_eq!(admitted, 3, "{key}");
    }
    // One call per client would be 1000, as it was when every client had a slot of its own.
    println!("{calls} script calls for {} decisions", 5 * CLIENTS);
    assert!(calls <= (5 * CLIENTS / 10) as u64, "{calls} calls");
}

#[tokio::test]
async fn keys_share_one_tag_per_primary_by_default() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    let policy: Policy = "5/10s".parse().unwrap();
    let mut slots = std::collections::BTreeSet::new();
    for i in 0..300 {
        let key = redis_key(&store, &Key::from(format!("client-{i}")), &policy);
        slots.insert(fred::util::redis_keyslot(key.as_bytes()));
    }
    // Three tags, one in each third of the slots, which is what each primary holds.
    let thirds: Vec<u16> = slots.iter().map(|slot| slot / (16_384 / 3 + 1)).collect();
    assert_eq!(thirds, [0, 1, 2], "slots {slots:?}");
}

/// Instances with different `cluster_tags` would keep a client's state under different keys
/// and admit it once per layout: the first to connect records its number in the cluster, and
/// another number is refused at `connect` (or logged as an ERROR by `connect_lazy`). On one
/// thread, so that the logs of the lazy store's task are captured.
#[tokio::test]
async fn instances_with_other_cluster_tags_are_refused() {
    let cluster = RedisCluster::start(3);
    let builder = |tags| RedisStore::builder(cluster.url()).cluster_tags(tags);
    builder(3).connect().await.expect("the first records 3");
    let refused = builder(4).connect().await;
    let why = match refused {
        Err(StoreError::Config(why)) => why,
        other => panic!("another number of tags was not refused: {other:?}"),
    };
    assert!(why.contains("cluster_tags is 4 here but 3"), "{why}");
    builder(3)
        .connect()
        .await
        .expect("the same number is welcome");
    // Another prefix is another set of keys, with a layout of its own.
    let other_prefix = builder(4).prefix("other").connect().await;
    other_prefix.expect("another prefix records its own number");

    let captured = crate::support::Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let lazy = builder(5).connect_lazy().expect("built");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !captured.text().contains("cluster_tags is 5 here but 3") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            captured.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(captured.text().contains("ERROR"), "{}", captured.text());
    drop(lazy);
}

/// Overrides on a cluster: a key's lives in its key's slot, a policy's in every tag's, and
/// the decisions of keys on every primary follow them (a call whose keys spanned slots would
/// fail with `CROSSSLOT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_govern_keys_on_every_primary() {
    use tower_redis_ratelimit::store::{Override, Scope};

    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    let policy = Policy::new("sms", ["5/1h".parse().unwrap()]).unwrap();
    let keys: Vec<Key> = (0..12).map(|i| Key::from(format!("phone-{i}"))).collect();
    let owners: std::collections::BTreeSet<usize> = keys
        .iter()
        .map(|key| cluster.owner_of_key(&redis_key(&store, key, &policy)))
        .collect();
    assert_eq!(owners.len(), 3, "keys on every primary");
    let admitted = |key: Key, tries: usize| {
        let (store, policy) = (store.clone(), policy.clone());
        async move {
            let mut admitted = 0;
            for _ in 0..tries {
                admitted += usize::from(store.check(&key, &policy, 1).await.unwrap().is_allowed());
            }
            admitted
        }
    };
    let limits = |n: &str| Override::Limits(vec![n.parse().unwrap()]);
    let overrides = store.overrides();
    overrides
        .set(&policy, &Scope::All, &limits("7/1h"))
        .await
        .unwrap();
    overrides
        .set(&policy, &Scope::Key(keys[0].clone()), &limits("2/1h"))
        .await
        .unwrap();
    let counts = join_all(keys.iter().map(|key| admitted(key.clone(), 9))).await;
    assert_eq!(counts[0], 2, "the key's own override");
    assert!(counts[1..].iter().all(|&n| n == 7), "{counts:?}");
    assert_eq!(overrides.list(&policy).await.unwrap().len(), 2);
    assert!(overrides.remove(&policy, &Scope::All).await.unwrap());
    let fresh = Key::from("phone-fresh");
    assert_eq!(admitted(fresh, 9).await, 5, "the policy's own counts again");
}

/// Two operators set a policy's override at once, round after round: a policy's override is
/// one write per primary's hash, and every primary must end with the same operator's value,
/// the one `get` reads, so that the whole policy is decided by one set of counts.
#[tokio::test]
async fn concurrent_writers_of_a_policys_override_leave_one_value_everywhere() {
    use tower_redis_ratelimit::store::{Override, Scope};

    let cluster = RedisCluster::start(3);
    let (a, b) = (
        RedisStore::connect(&cluster.url()).await.unwrap(),
        RedisStore::connect(&cluster.url()).await.unwrap(),
    );
    let policy = Policy::new("sms", ["5/1h".parse().unwrap()]).unwrap();
    let keys: Vec<Key> = (0..12).map(|i| Key::from(format!("phone-{i}"))).collect();
    let owners: std::collections::BTreeSet<usize> = keys
        .iter()
        .map(|key| cluster.owner_of_key(&redis_key(&a, key, &policy)))
        .collect();
    assert_eq!(owners.len(), 3, "keys on every primary");
    let limits = |n: u64| Override::Limits(vec![Limit::new(n, Duration::from_secs(3600)).unwrap()]);
    for round in 0..40u64 {
        let (first, second) = (100 + 2 * round, 101 + 2 * round);
        let (set_a, set_b) = (limits(first), limits(second));
        let (oa, ob) = (a.overrides(), b.overrides());
        let (ra, rb) = tokio::join!(
            oa.set(&policy, &Scope::All, &set_a),
            ob.set(&policy, &Scope::All, &set_b),
        );
        ra.unwrap();
        rb.unwrap();
        // The counts each primary decides by, read through a decision of a key it holds.
        let decided: Vec<u64> = join_all(keys.iter().map(|key| a.check(key, &policy, 0)))
            .await
            .into_iter()
            .map(|d| d.unwrap().limit())
            .collect();
        let got = match oa.get(&policy, &Scope::All).await.unwrap() {
            Some(Override::Limits(limits)) => limits[0].count(),
            other => panic!("round {round}: {other:?}"),
        };
        assert!(got == first || got == second, "round {round}: {got}");
        assert!(
            decided.iter().all(|&n| n == got),
            "round {round}: get says {got}, primaries decide by {decided:?}"
        );
    }
}

/// The penalty box on a cluster: its key sits beside the state, in the state's hash slot, so
/// that the decision's one call reads and sets it on the state's primary, whichever it is.
#[tokio::test]
async fn the_penalty_box_holds_on_every_primary() {
    let cluster = RedisCluster::start(3);
    let store = RedisStore::connect(&cluster.url()).await.unwrap();
    let policy = Policy::new("login", ["2/1h".parse().unwrap()])
        .unwrap()
        .block_for(Duration::from_secs(900))
        .unwrap();
    let keys: Vec<Key> = (0..12).map(|i| Key::from(format!("user-{i}"))).collect();
    let owners: std::collections::BTreeSet<usize> = keys
        .iter()
        .map(|key| cluster.owner_of_key(&redis_key(&store, key, &policy)))
        .collect();
    assert_eq!(owners.len(), 3, "keys on every primary");
    for key in &keys {
        for _ in 0..3 {
            store.check(key, &policy, 1).await.unwrap();
        }
        let boxed = store.check(key, &policy, 1).await.unwrap();
        assert!(boxed.in_penalty_box(), "{key:?}: {boxed:?}");
        assert!(boxed.retry_after().unwrap() > Duration::from_secs(890));
        store.reset(key, &policy).await.unwrap();
        assert!(store.check(key, &policy, 1).await.unwrap().is_allowed());
    }
}

/// Concurrency slots on a cluster: each key's set of slots sits beside its state, in its hash
/// slot, so that the decision's one call counts and takes them on the state's primary, and a
/// give-back or renewal finds them there; two instances share them.
#[tokio::test]
async fn concurrency_slots_hold_on_every_primary() {
    use tower_redis_ratelimit::Settlement;
    let cluster = RedisCluster::start(3);
    let (one, two) = (
        RedisStore::connect(&cluster.url()).await.unwrap(),
        RedisStore::connect(&cluster.url()).await.unwrap(),
    );
    let policy = Policy::new("streams", ["1000/1h".parse().unwrap()])
        .unwrap()
        .concurrency(2)
        .unwrap();
    let keys: Vec<Key> = (0..12).map(|i| Key::from(format!("key-{i}"))).collect();
    let owners: std::collections::BTreeSet<usize> = keys
        .iter()
        .map(|key| cluster.owner_of_key(&redis_key(&one, key, &policy)))
        .collect();
    assert_eq!(owners.len(), 3, "keys on every primary");
    for key in &keys {
        let first = one.check(key, &policy, 1).await.unwrap();
        let second = two.check(key, &policy, 1).await.unwrap();
        assert!(holds_slot(&first) && holds_slot(&second), "{key:?}");
        let refused = one.check(key, &policy, 1).await.unwrap();
        assert!(refused.is_concurrency_limit(), "{key:?}: {refused:?}");
        // A renewal keeps the slot; a give-back frees it, for the other instance too.
        let renewal = renew(&first).unwrap();
        one.settle(key, &policy, renewal).await.unwrap();
        let release = Settlement::release(&first).unwrap();
        one.settle(key, &policy, release).await.unwrap();
        let late = one.settle(key, &policy, renew(&first).unwrap()).await;
        assert!(
            matches!(late, Err(tower_redis_ratelimit::StoreError::SlotGone)),
            "{key:?}: a renewal after the give-back: {late:?}"
        );
        let third = two.check(key, &policy, 1).await.unwrap();
        assert!(holds_slot(&third), "{key:?}: {third:?}");
        let slots = format!("{}:slots", redis_key(&one, key, &policy));
        let owner = cluster.owner_of_key(&slots);
        assert_eq!(owner, cluster.owner_of_key(&redis_key(&one, key, &policy)));
        let held = cluster.cli(owner, &["ZCARD", &slots]);
        assert_eq!(held.trim(), "2", "{slots}");
    }
}

/// In a Cluster an override and the limits version live in different hash slots. A key's
/// override written while its primary is stopped: `set` says it may have landed; once the
/// primary goes on, the store writes it again under the same stamp and raises the version
/// after it, so every instance follows the change however late it landed (without the retry,
/// the version stayed at the stamp taken before the write).
#[tokio::test]
async fn a_write_whose_reply_is_lost_is_announced_once_its_primary_answers() {
    use tower_redis_ratelimit::store::{Override, OverrideError, Scope};

    let cluster = RedisCluster::start(3);
    let store = RedisStore::builder(cluster.url())
        .timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let policy = Policy::new("sms", ["5/1h".parse().unwrap()]).unwrap();
    let version_key = format!("{}:{{overrides}}:limits", RedisStore::DEFAULT_PREFIX);
    let version_node = cluster.owner_of_key(&version_key);
    let key = (0..100)
        .map(|i| Key::from(format!("phone-{i}")))
        .find(|key| cluster.owner_of_key(&redis_key(&store, key, &policy)) != version_node)
        .unwrap();
    let node = cluster.owner_of_key(&redis_key(&store, &key, &policy));
    let version = || {
        let v = cluster.cli(version_node, &["HGET", &version_key, "version"]);
        v.trim().parse::<u64>().unwrap_or(0)
    };

    cluster.signal(node, "-STOP");
    let raise = Override::Limits(vec!["50/1h".parse().unwrap()]);
    let set = store
        .overrides()
        .set(&policy, &Scope::Key(key.clone()), &raise)
        .await;
    assert!(
        matches!(set, Err(OverrideError::Unconfirmed(_))),
        "sent, not confirmed: {set:?}"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let stamped = version();
    assert!(stamped > 0, "the stamp was taken before the write");
    cluster.signal(node, "-CONT");
    let resumed = tokio::time::Instant::now();
    while version() == stamped {
        assert!(
            resumed.elapsed() < Duration::from_secs(3),
            "the version was never raised after the write"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "version raised {:?} after the primary went on",
        resumed.elapsed()
    );
    let got = store.overrides().get(&policy, &Scope::Key(key)).await;
    assert_eq!(got.unwrap(), Some(raise));
}

/// A policy-wide block is written to every tag's hash, one primary each. With one primary
/// stopped, the others take it at once and refuse their keys within the bound; the stopped
/// one's keys follow once it answers again (before, the writes stopped at the first failing
/// tag, and every tag after it went on admitting for as long as the primary was stopped).
#[tokio::test]
async fn a_policy_block_reaches_the_primaries_that_answer_while_one_is_stopped() {
    use tower_redis_ratelimit::store::{Override, OverrideError, Scope};

    let cluster = RedisCluster::start(3);
    let writer = RedisStore::connect(&cluster.url()).await.unwrap();
    let observer = RedisStore::connect(&cluster.url()).await.unwrap();
    let version_node = cluster.owner_of_key(&format!(
        "{}:{{overrides}}:limits",
        RedisStore::DEFAULT_PREFIX
    ));
    // Each primary but the version's, stopped in turn while a block of its own policy is set.
    for stopped in cluster
        .primaries()
        .into_iter()
        .filter(|&p| p != version_node)
    {
        let api = Policy::new(format!("api-{stopped}"), ["100000/1h".parse().unwrap()]).unwrap();
        let mut by_owner = std::collections::BTreeMap::<usize, Vec<Key>>::new();
        for i in 0..200 {
            let key = Key::from(format!("c-{i}"));
            let owner = cluster.owner_of_key(&redis_key(&observer, &key, &api));
            by_owner.entry(owner).or_default().push(key);
        }
        assert_eq!(by_owner.len(), 3, "keys on every primary");
        cluster.signal(stopped, "-STOP");
        let written = tokio::time::Instant::now();
        let set = writer
            .overrides()
            .set(&api, &Scope::All, &Override::Block)
            .await;
        assert!(
            matches!(set, Err(OverrideError::Unconfirmed(_))),
            "one tag unconfirmed: {set:?}"
        );
        tokio::time::sleep(Duration::from_millis(500).saturating_sub(written.elapsed())).await;
        let mut admitted = 0;
        for (_, keys) in by_owner.iter().filter(|(&owner, _)| owner != stopped) {
            for key in keys {
                admitted += usize::from(observer.check(key, &api, 1).await.unwrap().is_allowed());
            }
        }
        assert_eq!(
            admitted, 0,
            "primary {stopped} stopped: the others follow the block"
        );
        cluster.signal(stopped, "-CONT");
        let resumed = tokio::time::Instant::now();
        let keys = &by_owner[&stopped];
        loop {
            let mut refused = 0;
            for key in keys {
                if let Ok(decision) = observer.check(key, &api, 1).await {
                    refused += usize::from(!decision.is_allowed());
                }
            }
            if refused == keys.len() {
                break;
            }
            assert!(
                resumed.elapsed() < Duration::from_secs(3),
                "the stopped primary's keys never followed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!(
            "primary {stopped} stopped: its keys refused {:?} after it went on",
            resumed.elapsed()
        );
    }
}
