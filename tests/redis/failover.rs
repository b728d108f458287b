//! The Redis store while a Redis Cluster changes under load: a primary killed, with or without
//! a replica to take over, a slot moved to another primary, or moved twice. While a primary is
//! missing, decisions for its keys fail within the budget, and those for the other primaries'
//! keys go on (unless Redis itself refuses them, with `cluster-require-full-coverage yes`);
//! the lost keys come back once a replica takes over their slots (the store follows the new
//! topology by itself), and limits are exact afterwards. A slot that moves under load fails no
//! decision.

use std::time::Duration;

use crate::support::cluster::RedisCluster;
use crate::support::outage::{self, Counts, Load, RECOVERY};
use tokio::task::block_in_place;
use tokio::time::Instant;
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{Key, Policy, RedisStore, Store};

/// `count` clients, each with the primary that holds its key under `policy`; every primary
/// of the cluster holds some.
fn clients_by_primary(
    cluster: &RedisCluster,
    store: &RedisStore,
    policy: &Policy,
    count: usize,
) -> Vec<(Key, usize)> {
    let keys: Vec<(Key, usize)> = (0..count)
        .map(|i| {
            let key = Key::from(format!("client-{i}"));
            let owner = cluster.owner_of_key(&redis_key(store, &key, policy));
            (key, owner)
        })
        .collect();
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3);
    for p in &primaries {
        assert!(keys.iter().any(|(_, g)| g == p), "no client on primary {p}");
    }
    keys
}

/// Fresh pairs of clients whose keys under the exactness policy live on primary `owner`.
fn pairs_on(
    cluster: &RedisCluster,
    store: &RedisStore,
    owner: usize,
    prefix: &str,
    count: usize,
) -> Vec<[Key; 2]> {
    let policy = outage::exact_policy();
    let mut keys = (0..)
        .map(|i| Key::from(format!("{prefix}-{i}")))
        .filter(|key| cluster.owner_of_key(&redis_key(store, key, &policy)) == owner);
    (0..count)
        .map(|_| [keys.next().unwrap(), keys.next().unwrap()])
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_primary_fails_fast_then_its_promoted_replica_decides_exactly() {
    let cluster = block_in_place(|| RedisCluster::start_with_replicas(3, 1));
    kill_a_primary_with_a_replica(cluster, false).await;
}

/// As above, on a cluster that serves the slots it has (`cluster-require-full-coverage no`):
/// the other primaries' keys do not fail while the killed one's slots fail over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_on_a_partial_cluster_costs_only_the_failed_primarys_keys() {
    let cluster = block_in_place(|| RedisCluster::start_serving_partial(3, 1));
    kill_a_primary_with_a_replica(cluster, true).await;
}

/// Kills a primary with a replica under load, and checks that decisions for its keys fail
/// fast, then come back on the promoted replica, exact. The other primaries' keys fail at
/// most for the time budget plus a second after the kill; on a cluster that requires full
/// coverage (not `partial`), Redis itself refuses every command while a slot has no owner,
/// so there also until the promotion plus that long.
async fn kill_a_primary_with_a_replica(mut cluster: RedisCluster, partial: bool) {
    let store = outage::store(cluster.url()).await;
    let policy: Policy = "1000000/1m".parse().unwrap();

    let keys = clients_by_primary(&cluster, &store, &policy, 30);
    let victim = keys[0].1;
    let victim_slot = cluster.keyslot(&redis_key(&store, &keys[0].0, &policy));
    let on_victim = keys.iter().filter(|(_, g)| *g == victim).count();
    let primaries = cluster.primaries();
    let pairs = pairs_on(&cluster, &store, victim, "fresh", 5);
    eprintln!(
        "{} clients, {on_victim} of them on the primary to kill (port {})",
        keys.len(),
        cluster.nodes[victim].port()
    );

    let load = Load::start(&store, &policy, &keys, 16, Duration::from_millis(5));
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in &primaries {
        assert!(
            load.wait_ok_after(*p, Duration::ZERO, deadline)
                .await
                .is_some(),
            "no decision for the keys of primary {p}"
        );
    }
    load.wait_for_requests(500).await;

    let kill_at = load.elapsed();
    let killed = Instant::now();
    cluster.kill(victim);
    let promoted = block_in_place(|| cluster.wait_for_promotion(victim_slot));
    let promotion = killed.elapsed();
    let first_ok = load.wait_ok_after(victim, kill_at, killed + RECOVERY).await;
    let recovered = killed.elapsed();
    let samples = load.stop_after_failover(first_ok.is_some()).await;

    eprintln!(
        "kill to promotion of port {} seen by every node: {promotion:?}",
        cluster.nodes[promoted].port()
    );
    let Some(first_ok) = first_ok else {
        outage::report_failover(&samples, kill_at, samples.last().unwrap().at, victim);
        panic!("no decision for the killed primary's keys within {RECOVERY:?} of the kill");
    };
    eprintln!(
        "kill to first successful decision on the killed primary's keys: {:?} (seen after {recovered:?})",
        first_ok - kill_at
    );
    let seen = outage::report_failover(&samples, kill_at, first_ok, victim);
    outage::assert_within_budget(&samples);
    let grace = outage::BUDGET + Duration::from_secs(1);
    let bound = match partial {
        true => grace,
        false => promotion + grace,
    };
    eprintln!(
        "other primaries' keys failed {} times, the last +{:?} after the kill (bound {bound:?})",
        seen.others_failed, seen.others_last_failure
    );
    assert!(
        seen.others_last_failure.is_none_or(|last| last <= bound),
        "the other primaries' keys failed too long"
    );
    assert!(
        seen.victim_failed > 0,
        "decisions on the killed primary's keys never failed"
    );
    // Once back, decisions hold.
    outage::assert_holds_after(&samples, first_ok, 1000);

    // Fresh clients on the promoted node: exact limits, from the same store.
    for pair in &pairs {
        for key in pair {
            let redis_key = redis_key(&store, key, &outage::exact_policy());
            assert_eq!(cluster.owner_of_key(&redis_key), promoted);
        }
    }
    let (exact, failed_bursts) = outage::exact_again(&store, &pairs, killed).await;
    eprintln!(
        "kill to exact limits on the promoted node (2 clients x 200 concurrent at 50/10s, \
         50 admitted each): {exact:?}, after {failed_bursts} bursts with errors"
    );
}

/// `count` clients whose keys under `policy` share one hash slot; the slot.
fn clients_in_one_slot(
    cluster: &RedisCluster,
    store: &RedisStore,
    policy: &Policy,
    count: usize,
) -> (Vec<Key>, u16) {
    let key = |i: usize| Key::from(format!("mover-{i}"));
    let slot_of =
        |i: usize| fred::util::redis_keyslot(redis_key(store, &key(i), policy).as_bytes());
    let slot = slot_of(0);
    let clients: Vec<Key> = (0..)
        .filter(|&i| slot_of(i) == slot)
        .take(count)
        .map(key)
        .collect();
    for client in &clients {
        assert_eq!(cluster.keyslot(&redis_key(store, client, policy)), slot);
    }
    (clients, slot)
}

// While the slot moves, a call whose keys have all left the old owner is redirected with
// `ASK`, which the store follows itself (`ask.rs`: fred 10.1 does not), and a call deciding
// several keys that are split between the two nodes is refused with `TRYAGAIN`, after which
// the store decides its requests with one call per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_moved_under_load_loses_no_decision_and_keeps_limits_exact() {
    const LIMIT: usize = 300;
    let cluster = block_in_place(|| RedisCluster::start(3));
    let store = outage::store(cluster.url()).await;
    // The window outlasts the test: each client may be admitted LIMIT times in all.
    let policy: Policy = format!("{LIMIT}/1m").parse().unwrap();
    let (clients, slot) = clients_in_one_slot(&cluster, &store, &policy, 4);
    let from = cluster.owner_of_slot(slot);
    let to = *cluster.primaries().iter().find(|&&p| p != from).unwrap();
    let keys: Vec<(Key, usize)> = clients.iter().cloned().map(|k| (k, 0)).collect();

    // Half of every client's limit is used before the move begins, the rest during it; the
    // clients go on far past their limit, so refusals are decided on moved state too.
    let load = Load::start(&store, &policy, &keys, 8, Duration::from_millis(2));
    load.wait_for_requests(clients.len() * LIMIT / 2).await;
    let begun_at = load.elapsed();
    let begun = Instant::now();
    block_in_place(|| cluster.begin_migration(slot, from, to));
    // One key at a time, with load in between: for a while the clients' keys are split
    // between the two primaries.
    let during = &load;
    let moved = cluster
        .migrate_one_at_a_time(slot, from, to, |moved| {
            eprintln!(
                "key {moved} moved {:?} after the move began",
                during.elapsed() - begun_at
            );
            during.wait_for_requests(200)
        })
        .await;
    block_in_place(|| cluster.finish_migration(slot, from, to));
    let finished_at = load.elapsed();
    let took = begun.elapsed();
    load.wait_for_requests(clients.len() * 2 * LIMIT).await;
    let samples = load.stop().await;

    eprintln!(
        "slot {slot} with {} clients' keys moved from port {} to port {} in {took:?}, \
         {moved} keys one at a time",
        clients.len(),
        cluster.nodes[from].port(),
        cluster.nodes[to].port()
    );
    let during = samples
        .iter()
        .filter(|s| s.at >= begun_at && s.at < finished_at);
    eprintln!("during the move: {}", Counts::of(during));
    eprintln!("whole run: {}", Counts::of(&samples));
    let per_client: Vec<Counts> = (0..clients.len())
        .map(|c| Counts::of(samples.iter().filter(|s| s.client == c)))
        .collect();
    for (c, counts) in per_client.iter().enumerate() {
        eprintln!("  client {c}: {counts}");
    }
    let errors = outage::errors(&samples);
    for (error, n) in &errors {
        // When it was seen, from the beginning of the move (negative: before it).
        let at = |s: &outage::Sample| s.at.as_millis() as i64 - begun_at.as_millis() as i64;
        let mut seen = samples
            .iter()
            .filter(|s| s.result.as_ref().err() == Some(error));
        let first = seen.next().map(at).unwrap_or_default();
        let last = seen.next_back().map(at).unwrap_or(first);
        eprintln!("  error x{n}: {error} (from {first} ms to {last} ms after the move began)");
    }
    outage::assert_within_budget(&samples);
    assert!(
        errors.is_empty(),
        "decisions failed during the move: {errors:?}"
    );
    for (c, counts) in per_client.iter().enumerate() {
        assert!(
            counts.sent >= 2 * LIMIT,
            "client {c} sent only {}",
            counts.sent
        );
        assert_eq!(counts.admitted, LIMIT, "client {c}: {counts}");
    }
    // The state now lives on the new owner.
    assert_eq!(cluster.owner_of_slot(slot), to);
    for client in &clients {
        let redis_key = redis_key(&store, client, &policy);
        assert_eq!(cluster.cli(to, &["exists", &redis_key]).trim(), "1");
    }
}

/// Sends `each` concurrent checks for every client; returns (admitted, failed).
async fn burst(
    store: &RedisStore,
    policy: &Policy,
    clients: &[Key],
    each: usize,
) -> (usize, usize) {
    let checks = clients
        .iter()
        .flat_map(|client| (0..each).map(move |_| store.check(client, policy, 1)));
    let decisions = futures::future::join_all(checks).await;
    let admitted = decisions
        .iter()
        .filter(|d| d.as_ref().is_ok_and(|d| d.is_allowed()))
        .count();
    let failed = decisions.iter().filter(|d| d.is_err()).count();
    (admitted, failed)
}

// A slot that moves while an instance is idle leaves the instance's slot map stale: its next
// call meets `MOVED` from the old owner. If the slot is then moving on to a third node, the
// call must still run on the owner while it holds the keys; sent to the importing node with
// `ASKING` instead (what taking the `MOVED` for an `ASK` did), it would make a fresh copy of
// each key there (clients admitted afresh) and the operator's `MIGRATE` of the real keys would
// fail with `BUSYKEY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_twice_keeps_limits_and_one_copy_of_each_key() {
    const LIMIT: usize = 5;
    let cluster = block_in_place(|| RedisCluster::start(3));
    let store = outage::store(cluster.url()).await;
    let policy: Policy = format!("{LIMIT}/1h").parse().unwrap();
    let (clients, slot) = clients_in_one_slot(&cluster, &store, &policy, 4);
    let a = cluster.owner_of_slot(slot);
    let others: Vec<usize> = cluster
        .primaries()
        .into_iter()
        .filter(|&p| p != a)
        .collect();
    let (b, c) = (others[0], others[1]);
    for client in &clients {
        for _ in 0..LIMIT {
            assert!(store.check(client, &policy, 1).await.unwrap().is_allowed());
        }
    }

    // A to B while this instance is idle, then B starts moving the slot on to C.
    block_in_place(|| cluster.move_slot(slot, a, b, 10));
    block_in_place(|| cluster.begin_migration(slot, b, c));
    let on_b = burst(&store, &policy, &clients, 25).await;
    eprintln!("(admitted, failed) of 100 with the keys on B: {on_b:?}");
    // The operator moves the keys (`migrate_keys` asserts each MIGRATE answers OK), with
    // requests between the batches and after, while the slot is still migrating.
    let (s, p, k) = (&store, &policy, &clients);
    let moved = cluster
        .migrate_one_at_a_time(slot, b, c, move |_| async move {
            burst(s, p, k, 5).await;
        })
        .await;
    let on_c = burst(&store, &policy, &clients, 25).await;
    block_in_place(|| cluster.finish_migration(slot, b, c));
    let after = burst(&store, &policy, &clients, 25).await;
    eprintln!(
        "slot {slot}: ports {} -> {} idle, then -> {} under load ({moved} keys); \
         (admitted, failed) with the keys on B {on_b:?}, on C {on_c:?}, after {after:?}",
        cluster.nodes[a].port(),
        cluster.nodes[b].port(),
        cluster.nodes[c].port()
    );
    assert_eq!(moved, clients.len(), "every client's key was on B");
    assert_eq!(
        (on_b.0, on_c.0, after.0),
        (0, 0, 0),
        "admitted over the limit"
    );
    for client in &clients {
        let key = redis_key(&store, client, &policy);
        let copies: Vec<bool> = [a, b, c]
            .iter()
            .map(|&node| cluster.keys_in_slot(node, slot, 100).contains(&key))
            .collect();
        assert_eq!(copies, [false, false, true], "{key}: one copy, on C");
    }
}

/// A cluster without replicas that serves the slots it still has
/// (`cluster-require-full-coverage no`): one primary killed under load costs only the keys it
/// held. Decisions for the other primaries' keys go on (each primary has connections of its
/// own, and each hash tag a breaker of its own), the lost keys fail rather than start afresh
/// elsewhere, and stores connected after the kill, through a URL that names the dead node
/// first or one that leaves it out, decide for the live primaries' keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_primary_without_a_replica_costs_only_its_own_keys() {
    let mut cluster = block_in_place(|| RedisCluster::start_serving_partial(3, 0));
    let store = outage::store(cluster.url()).await;
    let policy: Policy = "1000000/1m".parse().unwrap();
    let keys = clients_by_primary(&cluster, &store, &policy, 30);
    let victim = keys[0].1;
    // The URL an instance was configured with before the kill, the doomed node first.
    let others: Vec<String> = (0..3)
        .filter(|&i| i != victim)
        .map(|i| format!("node=127.0.0.1:{}", cluster.nodes[i].port()))
        .collect();
    let url_before = format!(
        "redis-cluster://127.0.0.1:{}?{}",
        cluster.nodes[victim].port(),
        others.join("&")
    );

    let load = Load::start(&store, &policy, &keys, 16, Duration::from_millis(5));
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in cluster.primaries() {
        let ok = load.wait_ok_after(p, Duration::ZERO, deadline).await;
        assert!(ok.is_some(), "no decision for the keys of primary {p}");
    }
    load.wait_for_requests(500).await;
    let kill_at = load.elapsed();
    cluster.kill(victim);
    let killed = load.elapsed();
    block_in_place(|| cluster.wait_until_failed(victim));
    let marked = load.elapsed();
    // Load on past the moment the cluster marks the node failed, when every node drops it.
    load.wait_for_requests(1500).await;
    let samples = load.stop().await;

    let settled = kill_at + outage::BUDGET + Duration::from_secs(1);
    let (lost, kept): (Vec<_>, Vec<_>) = samples
        .iter()
        .filter(|s| s.at >= kill_at)
        .partition(|s| s.group == victim);
    let early = kept.iter().copied().filter(|s| s.at < settled);
    let late: Vec<_> = kept.iter().copied().filter(|s| s.at >= settled).collect();
    eprintln!(
        "kill to marked failed by every node: {:?}; the run went on to +{:?}",
        marked - kill_at,
        samples.iter().map(|s| s.at).max().unwrap_or_default() - kill_at
    );
    eprintln!(
        "other primaries' keys, first {:?} after the kill: {}",
        settled - kill_at,
        Counts::of(early)
    );
    let late_counts = Counts::of(late.iter().copied());
    eprintln!("other primaries' keys, after that: {late_counts}");
    eprintln!(
        "lost primary's keys after the kill: {}",
        Counts::of(lost.iter().copied())
    );
    for (error, n) in outage::errors(&samples) {
        eprintln!("  error x{n}: {error}");
    }
    assert!(
        late.len() >= 500,
        "only {} decisions after {settled:?}",
        late.len()
    );
    assert_eq!(
        late_counts.failed, 0,
        "decisions for the live primaries' keys failed once settled"
    );
    let admitted_lost = lost.iter().filter(|s| s.at >= killed && s.result.is_ok());
    assert_eq!(
        admitted_lost.count(),
        0,
        "a lost primary's key was decided elsewhere"
    );

    // Stores that connect now: through the URL that names the dead node first, and through
    // the live nodes only; one that connects in the background too.
    let live_only = cluster.url();
    for url in [url_before.clone(), live_only] {
        let fresh = RedisStore::builder(url.as_str())
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connect through {url} with a primary gone: {e}"));
        for (key, owner) in &keys {
            let decided = fresh.check(key, &policy, 1).await;
            assert_eq!(
                decided.is_ok(),
                *owner != victim,
                "{url}, {key:?} on {owner}: {decided:?}"
            );
        }
    }
    let lazy = RedisStore::builder(url_before).connect_lazy().unwrap();
    let (key, _) = keys.iter().find(|(_, owner)| *owner != victim).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while lazy.check(key, &policy, 1).await.is_err() {
        assert!(Instant::now() < deadline, "a lazy store never decided");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (key, owner) in keys.iter().filter(|(_, owner)| *owner != victim) {
        let decided = lazy.check(key, &policy, 1).await;
        assert!(
            decided.is_ok(),
            "lazy store, {key:?} on {owner}: {decided:?}"
        );
    }
}
