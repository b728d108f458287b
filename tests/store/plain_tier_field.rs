//! The plain tier of the Redis store in the field: a Redis Cluster (overrides followed on
//! every slot, never over with both tiers), a stalled connection around an override's write
//! (a plain call Redis runs late decides nothing by old counts), an overrides hash restored to
//! older content, a failover that loses the last write, two policies of one name and other
//! counts on one key (one decided by the full scripts, one by the plain ones), and the state
//! both tiers leave for the same requests.
//!
//! Each test prints its figures (`--nocapture`): decisions, admissions over the count, and the
//! latest time after an override's write at which old counts were used.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::cluster::RedisCluster;
use crate::support::monitor::evalsha_seen;
use crate::support::proxy::Proxy;
use crate::support::time::redis_now;
use crate::support::{command_calls, RedisServer};
use bytes::Bytes;
use fred::prelude::*;
use tokio::task::block_in_place;
use tokio::time::Instant;
use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::test_util::{plain_args, redis_key};
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

/// The bound on following an override (`docs/promises.md`).
const FOLLOW: Duration = Duration::from_millis(250);

/// One decision seen from the caller: when it started and ended (since an origin), admitted.
#[derive(Debug, Clone, Copy)]
struct Seen {
    start: Duration,
    end: Duration,
    allowed: bool,
    /// 0 or 1: which of two policies decided it.
    policy: usize,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// A sorted set's members with their scores.
type Events = Vec<(String, f64)>;

/// When a decision started (since an origin), and whether it admitted or why it failed.
type Outcome = (Duration, Result<bool, String>);

/// The most admissions that certainly lie in one window of `window` before and at an
/// admission of policy `policy`: for each such admission X, 1 + those Y that ended before X
/// started and started after X ended less `window` (so Redis ran Y in X's window).
fn most_in_window(seen: &[Seen], policy: Option<usize>, window: Duration) -> usize {
    let admitted: Vec<&Seen> = seen.iter().filter(|s| s.allowed).collect();
    admitted
        .iter()
        .filter(|x| policy.is_none_or(|p| x.policy == p))
        .map(|x| {
            1 + admitted
                .iter()
                .filter(|y| y.end <= x.start && y.start + window > x.end)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// `tasks` tasks deciding `key` through `stores` (task t on store t % n, under `policies[t %
/// policies.len()]`) for `run`, pausing `pause` between decisions; what each saw, and errors.
async fn hammer(
    stores: &[RedisStore],
    policies: &[Policy],
    key: &Key,
    tasks: usize,
    run: Duration,
    pause: Duration,
) -> (Vec<Seen>, Vec<String>) {
    let log: Log = Arc::default();
    let errors = Arc::new(Mutex::new(Vec::new()));
    let origin = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let store = stores[t % stores.len()].clone();
        let which = t % policies.len();
        let policy = policies[which].clone();
        let (key, log, errors) = (key.clone(), log.clone(), errors.clone());
        handles.push(tokio::spawn(async move {
            while origin.elapsed() < run {
                let start = origin.elapsed();
                match store.check(&key, &policy, 1).await {
                    Ok(d) => log.lock().unwrap().push(Seen {
                        start,
                        end: origin.elapsed(),
                        allowed: d.is_allowed(),
                        policy: which,
                    }),
                    Err(e) => errors.lock().unwrap().push(e.to_string()),
                }
                tokio::time::sleep(pause).await;
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let seen = log.lock().unwrap().clone();
    let errors = errors.lock().unwrap().clone();
    (seen, errors)
}

/// Decisions of `keys` through `store`, one task per key, from `from` for `watch`; the start
/// (since `from`) of every admission.
async fn admissions_after(
    store: &RedisStore,
    keys: &[Key],
    policy: &Policy,
    from: Instant,
    watch: Duration,
) -> Vec<Duration> {
    let mut handles = Vec::new();
    for key in keys {
        let (store, key, policy) = (store.clone(), key.clone(), policy.clone());
        handles.push(tokio::spawn(async move {
            let mut admitted = Vec::new();
            while from.elapsed() < watch {
                let start = from.elapsed();
                if let Ok(d) = store.check(&key, &policy, 1).await {
                    if d.is_allowed() {
                        admitted.push(start);
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            admitted
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    all.sort();
    all
}

/// (1) A three-primary Redis Cluster. B decides keys on every primary (plain tier) while A
/// writes a policy-wide block, then removes it, then blocks one key whose slot is on another
/// primary than the version's; no decision B starts 250 ms or more after a write goes by the
/// old counts. Then three stores decide one key under a policy with a penalty box (full
/// tier) and without (plain tier): never over the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_follows_overrides_on_every_slot_and_is_never_over() {
    let cluster = block_in_place(|| RedisCluster::start(3));
    let a = RedisStore::connect(&cluster.url()).await.unwrap();
    let b = RedisStore::connect(&cluster.url()).await.unwrap();
    let c = RedisStore::connect(&cluster.url()).await.unwrap();
    let mut broke = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let api = Policy::new("api", ["1000000/1h".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let keys: Vec<Key> = (0..12)
            .map(|i| Key::from(format!("cl-{algorithm:?}-{i}")))
            .collect();
        let owners: Vec<usize> = keys
            .iter()
            .map(|k| block_in_place(|| cluster.owner_of_key(&redis_key(&b, k, &api))))
            .collect();
        let version_owner = block_in_place(|| cluster.owner_of_key("{overrides}"));
        eprintln!("{algorithm:?}: key owners {owners:?}, the version on {version_owner}");
        let o = a.overrides();
        // Warm: B's lanes confirmed, decisions plain.
        admissions_after(&b, &keys, &api, Instant::now(), Duration::from_millis(400)).await;
        // A policy-wide block.
        o.set(&api, &Scope::All, &Override::Block).await.unwrap();
        let w = Instant::now();
        let after = admissions_after(&b, &keys, &api, w, 3 * FOLLOW).await;
        let late: Vec<_> = after.iter().filter(|s| **s >= FOLLOW).collect();
        eprintln!(
            "{algorithm:?} policy-wide block: {} admissions started after the write, last {:?}, {} at 250 ms or later",
            after.len(),
            after.last(),
            late.len()
        );
        if !late.is_empty() {
            broke.push(format!("{algorithm:?} all-block: {late:?}"));
        }
        // Removed: admits again within the bound.
        o.remove(&api, &Scope::All).await.unwrap();
        let w = Instant::now();
        let after = admissions_after(&b, &keys, &api, w, 3 * FOLLOW).await;
        let first = after.first().copied();
        eprintln!("{algorithm:?} removal: first admission at {first:?}");
        if first.is_none_or(|f| f > FOLLOW + Duration::from_millis(30)) {
            broke.push(format!("{algorithm:?} removal: first {first:?}"));
        }
        // One key's block, for a key on a primary other than the version's.
        let (i, _) = owners
            .iter()
            .enumerate()
            .find(|(_, o)| **o != version_owner)
            .expect("a key off the version's primary");
        let one = keys[i].clone();
        admissions_after(&b, &keys, &api, Instant::now(), Duration::from_millis(300)).await;
        o.set(&api, &Scope::Key(one.clone()), &Override::Block)
            .await
            .unwrap();
        let w = Instant::now();
        let after = admissions_after(&b, std::slice::from_ref(&one), &api, w, 3 * FOLLOW).await;
        let late: Vec<_> = after.iter().filter(|s| **s >= FOLLOW).collect();
        eprintln!(
            "{algorithm:?} key block (owner {}): {} admissions after, last {:?}",
            owners[i],
            after.len(),
            after.last()
        );
        if !late.is_empty() {
            broke.push(format!("{algorithm:?} key-block: {late:?}"));
        }
        o.remove(&api, &Scope::Key(one)).await.unwrap();
    }
    // Never over, both tiers, three stores.
    let stores = [a.clone(), b.clone(), c.clone()];
    for algorithm in [Algorithm::SlidingLog, Algorithm::Gcra] {
        let plain = Policy::new("hot", ["100/1s".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let boxed = plain.clone().block_for(Duration::from_millis(1)).unwrap();
        let key = Key::from(format!("hot-{algorithm:?}"));
        let (seen, errors) = hammer(
            &stores,
            &[plain, boxed],
            &key,
            18,
            Duration::from_millis(2500),
            Duration::from_micros(300),
        )
        .await;
        let admitted = seen.iter().filter(|s| s.allowed).count();
        let worst = most_in_window(&seen, None, Duration::from_secs(1));
        let bound = match algorithm {
            Algorithm::SlidingLog => 100,
            _ => 200,
        };
        eprintln!(
            "cluster {algorithm:?}: {} decisions, {admitted} admitted, most certainly in 1 s {worst} (bound {bound}), {} errors",
            seen.len(),
            errors.len()
        );
        if worst > bound || !errors.is_empty() {
            broke.push(format!(
                "cluster {algorithm:?}: {worst} > {bound} or errors {:?}",
                errors.first()
            ));
        }
    }
    assert!(broke.is_empty(), "{broke:?}");
}

/// (2) A stalled connection around an override's write. Three stores behind their own
/// proxies decide one key each of one sliding-log policy, one decision started every 2 ms:
/// B on the plain tier with a 3 s budget, F on the full scripts alone with the same budget, D
/// on the plain tier with the default budget (250 ms). In each of four rounds the proxies stop
/// passing traffic; 2 ms later A (direct) blocks the policy; 1 s after the block they pass
/// traffic again; then the block is removed. Every event Redis recorded after the block was
/// admitted by the old counts (no override): the latest such event, and the latest such
/// admission a caller was given, are measured against the write.
///
/// No event is recorded by old counts 250 ms or more after the write (`docs/operations.md`,
/// "The bound, for every instance"), though plain calls started before their confirmation
/// ran out are held in the stalled connection for a second: Redis runs them past the Redis
/// time their confirmation carries, and the plain script sends them to the full one, which
/// reads the block. (Without that check: 7 events 250 ms or more after the write, the latest
/// 1 003 ms.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_connection_decides_nothing_by_old_counts_after_the_bound() {
    let server = RedisServer::start();
    let budget = Duration::from_secs(3);
    let mut stores = Vec::new();
    for (name, timeout, plain) in [
        ("B plain 3s", Some(budget), true),
        ("F full 3s", Some(budget), false),
        ("D plain 250ms", None, true),
    ] {
        stores.push((name, stalled_store(&server, timeout, plain).await));
    }
    let broke = stall_rounds(&server, &stores, -2, Duration::from_millis(1000)).await;
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (2b) As (2) at the default budget, the stall shorter than it: the proxies stop 100 ms
/// after the block and pass traffic again 240 ms later. E (plain tier) and G (full scripts
/// alone) both at the default 250 ms budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_stall_at_the_default_budget_decides_nothing_by_old_counts_after_the_bound() {
    let server = RedisServer::start();
    let mut stores = Vec::new();
    for (name, plain) in [("E plain 250ms", true), ("G full 250ms", false)] {
        stores.push((name, stalled_store(&server, None, plain).await));
    }
    let broke = stall_rounds(&server, &stores, 100, Duration::from_millis(240)).await;
    assert!(broke.is_empty(), "{broke:#?}");
}

/// A store behind a proxy of its own to `server`, with budget `timeout` (the default where
/// `None`) and the plain tier on or off.
async fn stalled_store(
    server: &RedisServer,
    timeout: Option<Duration>,
    plain: bool,
) -> (RedisStore, Proxy) {
    let proxy = Proxy::start(server.port()).await;
    let mut builder = RedisStore::builder(proxy.url()).plain_scripts(plain);
    if let Some(timeout) = timeout {
        builder = builder.timeout(timeout);
    }
    (builder.connect().await.unwrap(), proxy)
}

/// Four rounds: each store decides a key of its own (one decision started every 2 ms) while
/// the proxies stop passing traffic `pause_at` ms from the block's write (negative: before
/// it) for `stall`; the block is removed 400 ms after they pass traffic again. Prints, per
/// store, the admissions returned and the events Redis recorded after the block (all by the
/// old counts); returns what broke the bound.
async fn stall_rounds(
    server: &RedisServer,
    stores: &[(&str, (RedisStore, Proxy))],
    pause_at: i64,
    stall: Duration,
) -> Vec<String> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let a = server.store().await;
    let admin = server.client().await;
    let api = Policy::new("api", ["1000000/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let key = |n: usize, round: usize| Key::from(format!("k{n}-{round}"));
    let origin = Instant::now();
    type Entry = (usize, usize, Duration, Duration, Result<bool, String>);
    let log: Arc<Mutex<Vec<Entry>>> = Arc::default();
    let (stop, round) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let mut handles = Vec::new();
    for (n, (_, (store, _))) in stores.iter().enumerate() {
        let (store, api, log, stop, round) = (
            store.clone(),
            api.clone(),
            log.clone(),
            stop.clone(),
            round.clone(),
        );
        handles.push(tokio::spawn(async move {
            let mut inner = Vec::new();
            while !stop.load(Relaxed) {
                let r = round.load(Relaxed);
                let (store, key, api, log) = (store.clone(), key(n, r), api.clone(), log.clone());
                inner.push(tokio::spawn(async move {
                    let start = origin.elapsed();
                    let d = store.check(&key, &api, 1).await;
                    let d = d.map(|d| d.is_allowed()).map_err(|e| e.to_string());
                    log.lock().unwrap().push((n, r, start, origin.elapsed(), d));
                }));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            for h in inner {
                h.await.unwrap();
            }
        }));
    }
    let pause = |on: bool| {
        for (_, (_, proxy)) in stores {
            match on {
                true => proxy.pause(),
                false => proxy.resume(),
            }
        }
    };
    let gap = Duration::from_millis(pause_at.unsigned_abs());
    let mut writes = Vec::new();
    for r in 0..4 {
        round.store(r, Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        if pause_at < 0 {
            pause(true);
            tokio::time::sleep(gap).await;
        }
        a.overrides()
            .set(&api, &Scope::All, &Override::Block)
            .await
            .unwrap();
        let w = origin.elapsed();
        let w_redis = redis_now(&admin).await;
        if pause_at >= 0 {
            tokio::time::sleep(gap.saturating_sub(origin.elapsed() - w)).await;
            pause(true);
        }
        tokio::time::sleep(stall).await;
        pause(false);
        tokio::time::sleep(Duration::from_millis(400)).await;
        // Up to the removal: what is admitted after it goes by no override.
        let (until, until_redis) = (origin.elapsed(), redis_now(&admin).await);
        writes.push((w, w_redis, until, until_redis));
        a.overrides().remove(&api, &Scope::All).await.unwrap();
    }
    stop.store(true, Relaxed);
    for h in handles {
        h.await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    let mut broke = Vec::new();
    for (n, (name, (store, _))) in stores.iter().enumerate() {
        let (mut decisions, mut errors, mut returned, mut recorded) =
            (0, 0, Vec::new(), Vec::new());
        let (mut started_after, mut late_start) = (0, 0);
        for (r, (w, w_redis, until, until_redis)) in writes.iter().enumerate() {
            let mine: Vec<_> = log.iter().filter(|e| e.0 == n && e.1 == r).collect();
            decisions += mine.len();
            errors += mine.iter().filter(|e| e.4.is_err()).count();
            // Admissions returned after the block: (round, start, end) since it, in ms.
            for e in mine
                .iter()
                .filter(|e| e.4 == Ok(true) && e.3 > *w && e.2 < *until)
            {
                let since = |t: Duration| t.as_millis() as i64 - w.as_millis() as i64;
                returned.push((r, since(e.2), since(e.3)));
                started_after += usize::from(e.2 >= *w);
                late_start += usize::from(e.2 >= *w + FOLLOW);
            }
            let rkey = redis_key(store, &key(n, r), &api);
            let events: Vec<(String, f64)> = admin
                .zrangebyscore(&rkey, *w_redis as f64, *until_redis as f64, true, None)
                .await
                .unwrap();
            recorded.extend(
                events
                    .iter()
                    .map(|(_, s)| (r, (*s as i64 - w_redis) / 1000)),
            );
        }
        let bound = FOLLOW.as_millis() as i64;
        let late_returned = returned.iter().filter(|e| e.2 >= bound).count();
        let late_recorded = recorded.iter().filter(|e| e.1 >= bound).count();
        let last_start = returned.iter().map(|e| e.1).max();
        let last_end = returned.iter().map(|e| e.2).max();
        let latest = recorded.iter().map(|e| e.1).max();
        eprintln!(
            "{name}: {decisions} decisions, {errors} errors; {} admitted and returned after the block (latest start {last_start:?} ms, latest return {last_end:?} ms after it; {started_after} started after the block, {late_start} 250 ms or more after it, {late_returned} returned 250 ms or more after it); Redis recorded {} events after the block, {late_recorded} of them 250 ms or more after it, the latest {latest:?} ms after it; per round {:?}",
            returned.len(),
            recorded.len(),
            (0..writes.len()).map(|r| recorded.iter().filter(|e| e.0 == r).count()).collect::<Vec<_>>()
        );
        if late_start > 0 {
            broke.push(format!(
                "{name}: {late_start} admissions started 250 ms or more after the block"
            ));
        }
        // A reply held in the proxy is returned late for a decision Redis made before the
        // write (on either tier): only what Redis decided 250 ms or more after it counts.
        if late_recorded > 0 {
            broke.push(format!(
                "{name}: {late_returned} admissions returned and {late_recorded} recorded by Redis 250 ms or more after the block, by the old counts (latest recorded {latest:?} ms after it, returned {last_end:?})"
            ));
        }
    }
    broke
}

/// `KEYS pattern`.
async fn keys(client: &Client, pattern: &str) -> Vec<String> {
    client
        .eval(
            "return redis.call('KEYS', ARGV[1])",
            Vec::<String>::new(),
            vec![pattern],
        )
        .await
        .unwrap()
}

/// The name of the one hash of overrides on `client`'s server (a hash with a `""` field).
async fn overrides_hash(client: &Client) -> String {
    let keys: Vec<String> = keys(client, "*").await;
    for k in keys {
        let t: String = client.r#type(&k).await.unwrap();
        if t == "hash" {
            let g: bool = client.hexists(&k, "").await.unwrap();
            if g {
                return k;
            }
        }
    }
    panic!("no hash of overrides");
}

/// (3) The hash of overrides (and the limits version) restored to older content with
/// `RESTORE ... REPLACE` of a `DUMP`: its generation goes back. B, deciding one key on the
/// plain tier, goes by the restored content for every decision started 250 ms or more after
/// the restore, in both directions (a block restored over a raise, a raise over a block),
/// with the version restored too or left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_restored_to_older_content_are_followed() {
    let server = RedisServer::start();
    let a = server.store().await;
    let b = server.store().await;
    let admin = server.client().await;
    let mut broke = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        for with_version in [false, true] {
            let api = Policy::new("api", ["100000/1h".parse().unwrap()])
                .unwrap()
                .with_algorithm(algorithm);
            let key = Key::from(format!("r-{algorithm:?}-{with_version}"));
            let scope = Scope::Key(key.clone());
            let other = Scope::Key(Key::from("keeps-the-hash"));
            let o = a.overrides();
            let raise = Override::Limits(vec!["1000000/1h".parse().unwrap()]);
            o.set(&api, &other, &raise).await.unwrap();
            // Block first: the content to restore.
            o.set(&api, &scope, &Override::Block).await.unwrap();
            let hash = overrides_hash(&admin).await;
            let version = keys(&admin, "*{overrides}:limits").await.remove(0);
            let blocked_hash: Bytes = admin.dump(&hash).await.unwrap();
            let blocked_version: Bytes = admin.dump(&version).await.unwrap();
            // Then a raise: B admits, plain.
            o.set(&api, &scope, &raise).await.unwrap();
            let w = Instant::now();
            let after = admissions_after(
                &b,
                std::slice::from_ref(&key),
                &api,
                w,
                Duration::from_millis(600),
            )
            .await;
            assert!(after.first().is_some_and(|f| *f <= FOLLOW), "{after:?}");
            let raised_hash: Bytes = admin.dump(&hash).await.unwrap();
            let raised_version: Bytes = admin.dump(&version).await.unwrap();
            // Restore the block.
            let restore = |k: String, v: Bytes| {
                let admin = admin.clone();
                async move {
                    let _: () = admin
                        .restore(k, 0, Value::Bytes(v), true, false, None, None)
                        .await
                        .unwrap();
                }
            };
            restore(hash.clone(), blocked_hash.clone()).await;
            if with_version {
                restore(version.clone(), blocked_version.clone()).await;
            }
            let r = Instant::now();
            let after = admissions_after(&b, std::slice::from_ref(&key), &api, r, 3 * FOLLOW).await;
            let late: Vec<_> = after.iter().filter(|s| **s >= FOLLOW).collect();
            eprintln!(
                "{algorithm:?} (version restored {with_version}) block restored over a raise: {} admissions after, last {:?}, {} at 250 ms or later",
                after.len(),
                after.last(),
                late.len()
            );
            if !late.is_empty() {
                broke.push(format!(
                    "{algorithm:?} {with_version} block restored: last admission {:?}",
                    after.last()
                ));
            }
            // And back: the raise restored over the block.
            restore(hash.clone(), raised_hash).await;
            if with_version {
                restore(version.clone(), raised_version).await;
            }
            let r = Instant::now();
            let after = admissions_after(&b, std::slice::from_ref(&key), &api, r, 3 * FOLLOW).await;
            eprintln!("{algorithm:?} ({with_version}) raise restored over the block: first admission {:?}", after.first());
            if after
                .first()
                .is_none_or(|f| *f > FOLLOW + Duration::from_millis(30))
            {
                broke.push(format!(
                    "{algorithm:?} {with_version} raise restored: first {:?}",
                    after.first()
                ));
            }
            o.remove(&api, &scope).await.unwrap();
            o.remove(&api, &other).await.unwrap();
        }
    }
    assert!(broke.is_empty(), "{broke:?}");
}

/// (4) Two policies of one name and other counts share one key's state (one prefix, one
/// store): "api" 100/1s with a penalty box (full scripts) and "api" 50/1s without (plain
/// scripts), three stores, both on the same keys. No admission under either policy finds
/// more than its count in the window before it (the log), or twice it (GCRA); no error
/// (each tier reads the state the other wrote).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_policies_of_one_name_on_both_tiers_are_never_over() {
    let server = RedisServer::start();
    let admin = server.client().await;
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(server.store().await);
    }
    let mut broke = Vec::new();
    for algorithm in [Algorithm::SlidingLog, Algorithm::Gcra] {
        let full = Policy::new("api", ["100/1s".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm)
            .block_for(Duration::from_millis(1))
            .unwrap();
        let plain = Policy::new("api", ["50/1s".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let key = Key::from(format!("two-{algorithm:?}"));
        let (kf, kp) = (
            redis_key(&stores[0], &key, &full),
            redis_key(&stores[0], &key, &plain),
        );
        eprintln!(
            "{algorithm:?}: state keys {kf} / {kp} (shared: {})",
            kf == kp
        );
        let (reads0, calls0) = (
            command_calls(&admin, "hlen").await,
            command_calls(&admin, "evalsha").await,
        );
        let (seen, errors) = hammer(
            &stores,
            &[full, plain],
            &key,
            18,
            Duration::from_millis(2500),
            Duration::from_micros(300),
        )
        .await;
        let (reads, calls) = (
            command_calls(&admin, "hlen").await - reads0,
            command_calls(&admin, "evalsha").await - calls0,
        );
        eprintln!(
            "{algorithm:?}: {calls} script calls, {reads} of them full ({} plain)",
            calls - reads
        );
        let factor = match algorithm {
            Algorithm::SlidingLog => 1,
            _ => 2,
        };
        let (w100, w50) = (
            most_in_window(&seen, Some(0), Duration::from_secs(1)),
            most_in_window(&seen, Some(1), Duration::from_secs(1)),
        );
        let (n0, n1) = (
            seen.iter().filter(|s| s.allowed && s.policy == 0).count(),
            seen.iter().filter(|s| s.allowed && s.policy == 1).count(),
        );
        eprintln!(
            "{algorithm:?}: {} decisions, admitted {n0} under 100/1s (full) and {n1} under 50/1s (plain); most certainly in 1 s before an admission: {w100} (100/1s), {w50} (50/1s); {} errors {:?}",
            seen.len(),
            errors.len(),
            errors.first()
        );
        if w100 > 100 * factor || w50 > 50 * factor || !errors.is_empty() {
            broke.push(format!(
                "{algorithm:?}: {w100} / {w50}, errors {}",
                errors.len()
            ));
        }
    }
    assert!(broke.is_empty(), "{broke:?}");
}

/// (5) The same requests, at Redis's own time, through the plain tier (a store with it on)
/// and the full scripts (a store with it off), each request on one key then the other: the
/// same decisions, and states that differ only by the µs between the two calls. The log: the
/// same events (sequence and weight), each logged within 5 ms on both keys. GCRA, whose state
/// holds Redis time: the same units, and backlogs that differ by exactly the drain between the
/// two keys' times (the bucket never empties here, so the backlog at any time is the units
/// admitted less the drain since the state was made). One clock for both is (5b).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_full_leave_the_same_state() {
    let server = RedisServer::start();
    let admin = server.client().await;
    let plain = server.store().await;
    let full = server.full_scripts_store().await;
    let mut broke = Vec::new();
    let mut x: u64 = 99991;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for algorithm in [Algorithm::SlidingLog, Algorithm::Gcra] {
        let policy = Policy::new(
            "same",
            ["30/10s".parse().unwrap(), "100/1m".parse().unwrap()],
        )
        .unwrap()
        .with_algorithm(algorithm);
        let (kp, kf) = (
            Key::from(format!("p-{algorithm:?}")),
            Key::from(format!("f-{algorithm:?}")),
        );
        let (reads0, calls0) = (
            command_calls(&admin, "hlen").await,
            command_calls(&admin, "evalsha").await,
        );
        let mut differ = 0;
        for i in 0..200u64 {
            let cost = (rand() % 3 + 1) as u32;
            let (p, f) = (
                plain.check(&kp, &policy, cost).await.unwrap(),
                full.check(&kf, &policy, cost).await.unwrap(),
            );
            if p.is_allowed() != f.is_allowed() || p.remaining() != f.remaining() {
                differ += 1;
            }
            if i % 20 == 0 {
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
        }
        let (reads, calls) = (
            command_calls(&admin, "hlen").await - reads0,
            command_calls(&admin, "evalsha").await - calls0,
        );
        // The full store reads the hash in each of its 200 calls; the rest are the plain store's.
        let plain_full = reads.saturating_sub(200);
        let (rp, rf) = (
            redis_key(&plain, &kp, &policy),
            redis_key(&full, &kf, &policy),
        );
        let alike = match algorithm {
            Algorithm::SlidingLog => {
                let zp: Events = admin
                    .zrange(&rp, 0, -1, None, false, None, true)
                    .await
                    .unwrap();
                let zf: Events = admin
                    .zrange(&rf, 0, -1, None, false, None, true)
                    .await
                    .unwrap();
                let tail = |m: &str| m.split_once(':').map(|(_, t)| t.to_owned());
                let same = zp.len() == zf.len()
                    && zp.iter().zip(&zf).all(|((mp, sp), (mf, sf))| {
                        tail(mp) == tail(mf) && (sp - sf).abs() < 5_000.0
                    });
                eprintln!(
                    "log: {} / {} events; first {:?} / {:?}",
                    zp.len(),
                    zf.len(),
                    zp.first(),
                    zf.first()
                );
                same
            }
            _ => {
                let (sp, sf): (Bytes, Bytes) =
                    (admin.get(&rp).await.unwrap(), admin.get(&rf).await.unwrap());
                let ints = |b: &Bytes| -> Vec<i128> {
                    b.chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as i128)
                        .collect()
                };
                let (ip, iff) = (ints(&sp), ints(&sf));
                eprintln!("gcra: state plain {ip:?}\n      full  {iff:?}");
                // t b u per limit, then created-at and last lease.
                let limits = [(30i128, 10_000_000i128), (100, 60_000_000)];
                ip.len() == 8
                    && iff.len() == 8
                    && limits.iter().enumerate().all(|(i, (count, window))| {
                        let (tp, bp, up) = (ip[3 * i], ip[3 * i + 1], ip[3 * i + 2]);
                        let (tf, bf, uf) = (iff[3 * i], iff[3 * i + 1], iff[3 * i + 2]);
                        let drain = ((tf - tp) - (iff[6] - ip[6])) * count * up / window;
                        eprintln!("      limit {i}: backlog plain - full {}, drain between the keys' times {drain}", bp - bf);
                        up == uf && (bp - bf - drain).abs() <= 2
                    })
            }
        };
        eprintln!(
            "{algorithm:?}: 400 decisions in {calls} script calls, {plain_full} of the plain store's 200 on the full scripts; {differ} decisions differ; states alike: {alike}"
        );
        if differ > 0 || !alike {
            broke.push(format!("{algorithm:?}: {differ} differ, alike {alike}"));
        }
    }
    assert!(broke.is_empty(), "{broke:?}");
}

/// (5b) One clock for both tiers: the full call a store made, as `MONITOR` saw it, is
/// replayed with `EVALSHA` (on the plain script as the store sends a request there, and on the
/// full script) on two keys that start from the same bytes (`COPY`), each request with the
/// same event time and cost: the two keys' values are byte for byte the same after every
/// request (GCRA: `GET`; the log: `ZRANGE ... WITHSCORES` and `DUMP`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_tiers_under_one_clock_leave_the_same_bytes() {
    let server = RedisServer::start();
    let admin = server.client().await;
    let plain = server.store().await;
    let full = server.full_scripts_store().await;
    let mut broke = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let policy = Policy::new("one", ["20/10s".parse().unwrap(), "60/1m".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let key = Key::from(format!("clock-{algorithm:?}"));
        let (p, f, k) = (plain.clone(), full.clone(), key.clone());
        let pol = policy.clone();
        let calls = evalsha_seen(server.port(), async move {
            f.check(&k, &pol, 1).await.unwrap();
            for _ in 0..5 {
                p.check(&k, &pol, 1).await.unwrap();
            }
        })
        .await;
        let full_sha = calls[0][1].clone();
        let Some(plain_call) = calls.iter().find(|c| c[1] != full_sha).cloned() else {
            broke.push(format!(
                "{algorithm:?}: no plain call among {} calls",
                calls.len()
            ));
            continue;
        };
        let int = |a: &[u8], i: usize| i64::from_le_bytes(a[8 * i..8 * i + 8].try_into().unwrap());
        eprintln!(
            "{algorithm:?}: {} calls seen, full sha {}, plain sha {}; the full call's first ints {:?}",
            calls.len(),
            String::from_utf8_lossy(&full_sha),
            String::from_utf8_lossy(&plain_call[1]),
            (0..11).map(|i| int(&calls[0][4], i)).collect::<Vec<_>>()
        );
        let (x, y) = (
            format!("{{clock}}:x-{algorithm:?}"),
            format!("{{clock}}:y-{algorithm:?}"),
        );
        // The full call's request, at each event time and cost, sent to the full script with
        // its second argument (the hash's name), and to the plain script as the store sends it
        // there (`test_util::plain_args`) with a confirmation made to last (the generation the
        // request was resolved at, for ever), since the replay runs past the one the plain call
        // carried.
        let hash_name = calls[0][5].clone();
        let generation = int(&calls[0][4], 8);
        let for_ever = [generation.to_le_bytes(), i64::MAX.to_le_bytes()].concat();
        let run = |sha: Vec<u8>, target: String, at: i64, cost: i64| {
            let mut args: Vec<Value> = calls[0][4..]
                .iter()
                .map(|a| Value::Bytes(Bytes::from(a.clone())))
                .collect();
            let mut first = calls[0][4].clone();
            first[8..16].copy_from_slice(&cost.to_le_bytes());
            first[24..32].copy_from_slice(&at.to_le_bytes());
            let (first, second) = match sha == full_sha {
                true => (first, hash_name.clone()),
                false => (plain_args(&first, generation), for_ever.clone()),
            };
            args[0] = Value::Bytes(Bytes::from(first));
            args[1] = Value::Bytes(Bytes::from(second));
            let admin = admin.clone();
            async move {
                let sha = String::from_utf8(sha).unwrap();
                let reply: Bytes = admin.evalsha(sha, vec![target], args).await.unwrap();
                reply
            }
        };
        // Event times from a second from now on, every 150 ms, costs 1 to 3.
        let base = redis_now(&admin).await + 1_000_000;
        let mut seed: u64 = 7;
        let mut differ = Vec::new();
        let mut admitted = 0;
        for i in 0..120i64 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (at, cost) = (base + i * 150_000, (seed >> 33) as i64 % 3 + 1);
            let rp = run(plain_call[1].clone(), x.clone(), at, cost).await;
            if i == 0 {
                let _: i64 = admin
                    .eval(
                        "return redis.call('COPY', KEYS[1], KEYS[2], 'REPLACE')",
                        vec![x.clone(), y.clone()],
                        (),
                    )
                    .await
                    .unwrap();
                continue;
            }
            let rf = run(full_sha.clone(), y.clone(), at, cost).await;
            admitted += usize::from(int(&rp, 0) > 0);
            // The six decision integers alike; then the states.
            if rp[..48] != rf[..48] {
                differ.push(format!(
                    "#{i} replies {:?} / {:?}",
                    (0..6).map(|j| int(&rp, j)).collect::<Vec<_>>(),
                    (0..6).map(|j| int(&rf, j)).collect::<Vec<_>>()
                ));
            }
            let same = match algorithm {
                Algorithm::SlidingLog => {
                    let (zx, zy): (Events, Events) = (
                        admin
                            .zrange(&x, 0, -1, None, false, None, true)
                            .await
                            .unwrap(),
                        admin
                            .zrange(&y, 0, -1, None, false, None, true)
                            .await
                            .unwrap(),
                    );
                    let (dx, dy): (Bytes, Bytes) =
                        (admin.dump(&x).await.unwrap(), admin.dump(&y).await.unwrap());
                    zx == zy && dx == dy
                }
                _ => {
                    let (gx, gy): (Bytes, Bytes) =
                        (admin.get(&x).await.unwrap(), admin.get(&y).await.unwrap());
                    gx == gy
                }
            };
            if !same {
                differ.push(format!("#{i} state differs"));
            }
        }
        eprintln!("{algorithm:?}: 119 requests replayed on each tier, {admitted} admitted; {} differences {:?}", differ.len(), differ.iter().take(5).collect::<Vec<_>>());
        if !differ.is_empty() {
            broke.push(format!("{algorithm:?}: {differ:?}"));
        }
    }
    assert!(broke.is_empty(), "{broke:?}");
}

/// (1b, 3b) A failover that loses the last override write. A three-primary cluster with a
/// replica each; A blocks key k (replicated), then, with k's primary's replica stopped, removes
/// the block (the primary alone has the removal); B follows the removal. The primary is
/// killed and the replica, which missed the removal, promoted: the hash of overrides goes back
/// to the block, its generation back too. B, deciding k all along, is admitted by no decision
/// that starts 250 ms or more after the promotion is seen (the removal it read is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_that_loses_the_last_write_is_followed() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let mut cluster = block_in_place(|| RedisCluster::start_with_replicas(3, 1));
    let a = RedisStore::builder(cluster.url())
        .timeout(Duration::from_millis(500))
        .retry_interval(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let b = RedisStore::builder(cluster.url())
        .retry_interval(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let api = Policy::new("api", ["1000000/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let key = Key::from("lost");
    let rkey = redis_key(&b, &key, &api);
    let slot = block_in_place(|| cluster.keyslot(&rkey));
    let primary = block_in_place(|| cluster.owner_of_slot(slot));
    let primary_id = block_in_place(|| cluster.id(primary));
    let replica = block_in_place(|| {
        cluster
            .nodes_seen_by(primary)
            .into_iter()
            .find(|n| n.primary.as_deref() == Some(primary_id.as_str()))
            .map(|n| cluster.index_of_port(n.port))
            .expect("a replica of k's primary")
    });
    let scope = Scope::Key(key.clone());
    let o = a.overrides();
    o.set(&api, &scope, &Override::Block).await.unwrap();
    let replicated = block_in_place(|| cluster.cli(primary, &["wait", "1", "2000"]));
    eprintln!("the block reached {} replica(s)", replicated.trim());
    // B decides k every ms from now on: (start since the origin, admitted or error).
    let origin = Instant::now();
    let seen: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (b, key, api, seen, stop) = (
            b.clone(),
            key.clone(),
            api.clone(),
            seen.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            while !stop.load(Relaxed) {
                let start = origin.elapsed();
                let d = b
                    .check(&key, &api, 1)
                    .await
                    .map(|d| d.is_allowed())
                    .map_err(|e| e.to_string());
                seen.lock().unwrap().push((start, d));
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The replica stopped and its link closed by the primary: the removal reaches only the
    // primary (a stopped replica would still read what was sent to its socket).
    block_in_place(|| cluster.signal(replica, "-STOP"));
    let unlinked = block_in_place(|| cluster.cli(primary, &["client", "kill", "type", "replica"]));
    o.remove(&api, &scope).await.unwrap();
    let removed = origin.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    block_in_place(|| cluster.kill(primary));
    let killed = origin.elapsed();
    block_in_place(|| cluster.signal(replica, "-CONT"));
    let promoted_to = block_in_place(|| cluster.wait_for_promotion(slot));
    let promoted = origin.elapsed();
    eprintln!("replica links closed: {}", unlinked.trim());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Relaxed);
    watcher.await.unwrap();
    let hash_back = block_in_place(|| cluster.cli(promoted_to, &["keys", "*"]));
    let seen = seen.lock().unwrap().clone();
    let admitted = |from: Duration, to: Duration| {
        seen.iter()
            .filter(|(s, d)| *s >= from && *s < to && *d == Ok(true))
            .count()
    };
    let refused_after = seen
        .iter()
        .filter(|(s, d)| *s >= promoted && *d == Ok(false))
        .count();
    let errors = seen.iter().filter(|(_, d)| d.is_err()).count();
    let last_admitted = seen
        .iter()
        .filter(|(s, d)| *s >= promoted && *d == Ok(true))
        .map(|(s, _)| s.as_millis() as i64 - promoted.as_millis() as i64)
        .max();
    eprintln!(
        "removed at {removed:?}, primary {primary} killed at {killed:?}, replica {replica} (now {promoted_to}) promoted and seen at {promoted:?}; {} decisions, {errors} errors; admitted between removal and kill {}, after the promotion {} (last started {last_admitted:?} ms after it), refused after it {refused_after}; keys on the new primary {:?}",
        seen.len(),
        admitted(removed, killed),
        admitted(promoted, Duration::MAX),
        hash_back.lines().collect::<Vec<_>>()
    );
    assert!(
        admitted(removed, killed) > 0,
        "B never followed the removal"
    );
    assert!(
        last_admitted.is_none_or(|ms| ms < FOLLOW.as_millis() as i64),
        "admitted {last_admitted:?} ms after the promotion by the lost removal"
    );
    assert!(refused_after > 0, "no decision after the promotion");
}
