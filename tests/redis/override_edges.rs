//! Overrides at the edges of Redis: a write whose reply is lost, a restart that loses the
//! overrides, an instance whose connection stalls. Each instance must follow every change
//! within the stated bound (`docs/operations.md`, "Run-time limits"): a change is announced
//! with the write itself, the limits version carries an epoch, and an instance that has not
//! read the version for a quarter of a second stops deciding by its leases and cached refusals.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::http::{instance, passes};
use crate::support::proxy::Proxy;
use crate::support::{Captured, RedisServer};
use tokio::time::Instant;
use tower_redis_ratelimit::store::{Leases, Override, OverrideError, Overrides, Scope};
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

/// How old an instance's view of the overrides may be (`docs/operations.md`).
const BOUND: Duration = Duration::from_millis(250);

async fn leasing(url: String, period: Duration) -> RedisStore {
    RedisStore::builder(url)
        .leases(Leases::new().period(period))
        .connect()
        .await
        .unwrap()
}

/// The text of the script that writes an override, which the proxy stops in front of Redis.
const WRITE: &[u8] = b"Writes one override";

/// A raise set through one instance whose write (not its stamp) is held up for a second on
/// the way to Redis: `set` cannot confirm it and says the change may have landed; it lands,
/// and every instance follows it once it has, cached refusals included (before, a write that
/// landed after its reply was given up raised no version, and the deny caches repeated an
/// hour's refusal: 0 of 50 admitted for 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_reply_is_lost_is_still_followed_by_every_instance() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let mut stores = Vec::new();
    for url in [server.url(), server.url(), proxy.url()] {
        stores.push(leasing(url, Duration::from_secs(1)).await);
    }
    let api = Policy::new("api", ["10/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow);
    let fleet: Vec<_> = stores.iter().map(|s| instance(s.clone(), &api)).collect();
    let mut admitted = 0;
    for _ in 0..6 {
        for service in &fleet {
            admitted += usize::from(passes(service, "vip").await);
        }
    }
    assert_eq!(admitted, 10);
    for service in &fleet {
        assert!(!passes(service, "vip").await, "refused, and cached");
    }

    proxy.pause_at(WRITE);
    let raise = Override::Limits(vec!["30/1h".parse().unwrap()]);
    let vip = Scope::Key(Key::from("vip"));
    let set = stores[2].overrides().set(&api, &vip, &raise).await;
    assert!(proxy.is_paused(), "the write was held up");
    assert!(
        matches!(set, Err(OverrideError::Unconfirmed(_))),
        "a write sent and not confirmed says it may have landed: {set:?}"
    );
    // Clients go on asking while the write is held up: refused, and cached again under the
    // version the stamp raised.
    for _ in 0..20 {
        for service in &fleet[..2] {
            assert!(!passes(service, "vip").await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stores[0].overrides().get(&api, &vip).await.unwrap(), None);
    proxy.resume();
    let resumed = Instant::now();
    while stores[0]
        .overrides()
        .get(&api, &vip)
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            resumed.elapsed() < Duration::from_secs(1),
            "it never landed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Within the bound of the write landing, every instance has read the change.
    tokio::time::sleep(BOUND + Duration::from_millis(100)).await;
    let mut more = 0;
    for (i, service) in fleet.iter().enumerate() {
        let mine = usize::from(passes(service, "vip").await);
        assert_eq!(mine, 1, "instance {i} follows the raise");
        more += mine;
    }
    for _ in 0..10 {
        for service in &fleet {
            more += usize::from(passes(service, "vip").await);
        }
    }
    assert_eq!(more, 20, "exactly the raise, over the fleet");
}

/// An operator told that a write may have landed sets the override again through another
/// instance, and is confirmed; the first write, held up on its way, lands after it and
/// changes nothing: every write carries a stamp taken before it is sent (before, the late
/// write replaced the confirmed one 2.3 s after it).
#[tokio::test]
async fn a_write_that_lands_late_never_undoes_a_later_one() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let (slow, other) = (
        RedisStore::connect(&proxy.url()).await.unwrap(),
        RedisStore::connect(&server.url()).await.unwrap(),
    );
    let api = Policy::new("api", ["10/1h".parse().unwrap()]).unwrap();
    let limits = |n: &str| Override::Limits(vec![n.parse().unwrap()]);
    for scope in [Scope::Key(Key::from("vip")), Scope::All] {
        proxy.pause_at(WRITE);
        let first = slow.overrides().set(&api, &scope, &limits("11/1h")).await;
        assert!(
            matches!(first, Err(OverrideError::Unconfirmed(_))),
            "{first:?}"
        );
        other
            .overrides()
            .set(&api, &scope, &limits("99/1h"))
            .await
            .unwrap();
        proxy.resume();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            other.overrides().get(&api, &scope).await.unwrap(),
            Some(limits("99/1h")),
            "{scope:?}: the confirmed write stays"
        );
    }
}

/// Sends a request of `key` through `store` every `every` until `stop` (five times as slowly
/// from `slower`), each on its own task; the times (since `origin`) at which one was admitted.
fn load(
    store: RedisStore,
    policy: Policy,
    key: &'static str,
    (every, slower): (Duration, Instant),
    origin: Instant,
    stop: Instant,
) -> tokio::task::JoinHandle<Vec<Duration>> {
    tokio::spawn(async move {
        let admitted = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        while Instant::now() < stop {
            let (store, policy, admitted) = (store.clone(), policy.clone(), admitted.clone());
            tasks.push(tokio::spawn(async move {
                if let Ok(decision) = store.check(&Key::from(key), &policy, 1).await {
                    if decision.is_allowed() {
                        admitted.lock().unwrap().push(origin.elapsed());
                    }
                }
            }));
            match Instant::now() < slower {
                true => tokio::time::sleep(every).await,
                false => tokio::time::sleep(every * 5).await,
            }
        }
        for task in tasks {
            task.await.unwrap();
        }
        let mut admitted = admitted.lock().unwrap().clone();
        admitted.sort();
        admitted
    })
}

/// Four leasing instances (3 s leases), one of them behind a proxy that stops its traffic for
/// two seconds; a block written through another meanwhile. The stalled instance cannot read
/// the version, so it spends its leases no more once its last read is older than the bound:
/// nothing is admitted there later than the bound after the write (before, it went on
/// admitting from its leases, the last 427 ms after the write with 1 s leases, and for as
/// long as they last with longer ones). Once its traffic flows again it refuses the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_instance_admits_nothing_past_the_bound_after_a_block() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await;
    let period = Duration::from_secs(3);
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(leasing(server.url(), period).await);
    }
    let stalled = leasing(proxy.url(), period).await;
    let api = Policy::new("api", ["100000/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow);
    let origin = Instant::now();
    let stop = origin + Duration::from_secs(4);
    // The stalled instance's traffic slows down with the stall, so that its leases, sized by
    // what it used, would last well past the bound.
    let pause = origin + Duration::from_millis(1200);
    let every = Duration::from_millis(5);
    let mut loads = vec![load(
        stalled.clone(),
        api.clone(),
        "k",
        (every, pause),
        origin,
        stop,
    )];
    for store in &stores {
        loads.push(load(
            store.clone(),
            api.clone(),
            "k",
            (every, stop),
            origin,
            stop,
        ));
    }
    // Leases taken and in use everywhere; then the stall, and the block a little later.
    tokio::time::sleep_until(pause).await;
    proxy.pause();
    let paused = origin.elapsed();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let blocked = origin.elapsed();
    stores[0]
        .overrides()
        .set(&api, &Scope::Key(Key::from("k")), &Override::Block)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.resume();
    let resumed = origin.elapsed();
    let mut admitted = Vec::new();
    for load in loads {
        admitted.push(load.await.unwrap());
    }
    let before = admitted[0].iter().filter(|&&t| t < paused).count();
    let after: Vec<Duration> = admitted[0]
        .iter()
        .filter(|&&t| t > blocked)
        .copied()
        .collect();
    eprintln!(
        "stalled instance: {before} admitted before the stall, {} after the block: {:?}",
        after.len(),
        after.iter().map(|t| *t - blocked).collect::<Vec<_>>()
    );
    assert!(before > 100, "the stalled instance was admitting: {before}");
    // The stall began before the block, so the bound counts from the stall.
    if let Some(last) = after.last() {
        assert!(
            *last <= paused + BOUND + Duration::from_millis(50),
            "admitted {:?} after the block",
            *last - blocked
        );
    }
    assert!(
        after.iter().all(|&t| t < resumed),
        "nothing admitted once the stalled instance reads the block"
    );
    for (i, others) in admitted[1..].iter().enumerate() {
        let late: Vec<_> = others.iter().filter(|&&t| t > blocked + BOUND).collect();
        assert!(late.is_empty(), "instance {i} admitted {late:?}");
    }
}

/// A restart without persistence loses the overrides; every instance says so at ERROR, and a
/// block written right after the restart is followed by every instance within the bound: the
/// limits version carries an epoch and is taken from Redis' clock, so a counter that starts
/// again is never taken for one already seen (before, a block set right after a restart let
/// 16 of 58 requests through, the last 772 ms after the write).
#[tokio::test]
async fn after_a_restart_the_loss_is_logged_and_a_new_block_is_followed() {
    let captured = Captured::default();
    let _guard = tracing::subscriber::set_default(captured.subscriber());
    let mut server = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(leasing(server.url(), Duration::from_secs(1)).await);
    }
    let api = Policy::new("api", ["100/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow);
    let fleet: Vec<_> = stores.iter().map(|s| instance(s.clone(), &api)).collect();
    let overrides = stores[0].overrides();
    let raise = Override::Limits(vec!["1000/1m".parse().unwrap()]);
    for key in ["a", "b", "c"] {
        let scope = Scope::Key(Key::from(key));
        overrides.set(&api, &scope, &raise).await.unwrap();
    }
    for service in &fleet {
        for _ in 0..20 {
            assert!(passes(service, "k").await);
        }
    }
    tokio::time::sleep(BOUND).await;
    assert!(!captured.text().contains("ERROR"), "{}", captured.text());

    server.restart();
    // The stores reconnect; the first write after the restart makes a new epoch.
    let written = loop {
        let k = Scope::Key(Key::from("k"));
        if overrides.set(&api, &k, &Override::Block).await.is_ok() {
            break Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut last = None;
    while written.elapsed() < Duration::from_secs(2) {
        for service in &fleet {
            if passes(service, "k").await {
                last = Some(written.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        last.is_none_or(|t| t <= BOUND),
        "admitted {last:?} after the block"
    );
    // Each instance logs the loss once it reads the new epoch: within a few polls of the
    // limits version, later on a loaded machine, where the reconnection takes longer.
    let lost = |logs: &str| {
        logs.lines()
            .filter(|l| l.contains("ERROR") && l.contains("overrides in Redis were lost"))
            .count()
    };
    while lost(&captured.text()) < 3 && written.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = captured.text();
    assert_eq!(lost(&logs), 3, "one ERROR per instance: {logs}");
}

/// Stores `a`, which writes, and `b`, which decides, on one Redis: `b` has just decided `key`
/// (so it knows the key's override fields); after each change through `a`, `b`'s very next
/// decisions go by the change. Returns what `b` admitted of `tries` after each change.
async fn followed_at_once(a: &RedisStore, b: &RedisStore, api: &Policy, key: &str) -> Vec<usize> {
    let (overrides, key) = (a.overrides(), Key::from(key));
    let scope = Scope::Key(key.clone());
    let three = Override::Limits(vec!["3/1h".parse().unwrap()]);
    let admitted = |tries: usize| {
        let key = key.clone();
        async move {
            let mut n = 0;
            for _ in 0..tries {
                n += usize::from(b.check(&key, api, 1).await.unwrap().is_allowed());
            }
            n
        }
    };
    let mut seen = vec![admitted(2).await];
    overrides.set(api, &scope, &three).await.unwrap();
    // 2 used: 1 more under 3/1h, then refused from what `b` knows (decided twice: known).
    seen.push(admitted(3).await);
    overrides.remove(api, &scope).await.unwrap();
    seen.push(admitted(2).await);
    overrides
        .set(api, &Scope::All, &Override::Block)
        .await
        .unwrap();
    seen.push(admitted(2).await);
    overrides.remove(api, &Scope::All).await.unwrap();
    seen.push(admitted(2).await);
    overrides.set(api, &scope, &Override::Block).await.unwrap();
    seen.push(admitted(2).await);
    seen
}

/// Each store keeps the override fields its calls read, and sends the override that applies
/// with later decisions, so that the script need not read them (`overrides/known.rs`); the
/// script uses it only while the hash of overrides is unchanged. An instance that knows a
/// key's fields follows, at its next decision, counts, a removal, a policy-wide block and its
/// removal, and a key's block, each written through another instance, on every algorithm
/// (without the script's check of the generation, it went on deciding by what it had read:
/// `[2, 1, 1, 1, 1, 1]` admitted where the changes allow `[2, 1, 2, 0, 2, 0]`). That is the
/// full scripts' check, so `b` runs them alone here: the plain ones read no hash, and follow
/// within 250 ms instead (`tests/layer/runtime_limits/overrides.rs`).
#[tokio::test]
async fn an_instance_never_decides_by_an_override_that_changed_since_it_read_it() {
    let server = RedisServer::start();
    let a = server.store().await;
    let b = server.full_scripts_store().await;
    for algorithm in crate::support::ALGORITHMS {
        let api = Policy::new("api", ["100/1h".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let seen = followed_at_once(&a, &b, &api, &format!("{algorithm:?}")).await;
        assert_eq!(seen, [2, 1, 2, 0, 2, 0], "{algorithm:?}");
    }
}

/// What an instance read before Redis lost its data is never taken for what the hash holds
/// after: a hash's generation is Redis's time of the change, not a count of changes that starts
/// again, so the same number of writes after a flush never brings back a generation an
/// instance read at (with a count, `b` kept deciding by the 5/1h it had read: 3 of 3 admitted
/// where the 1/1h written after the flush allowed 1). `b` runs the full scripts alone, whose
/// check of the generation this is (the plain ones follow within 250 ms).
#[tokio::test]
async fn after_a_flush_an_instance_never_decides_by_what_it_read_before() {
    let server = RedisServer::start();
    let a = server.store().await;
    let b = server.full_scripts_store().await;
    let api = Policy::new("api", ["100/1h".parse().unwrap()]).unwrap();
    let (vip, scope) = (Key::from("vip"), Scope::Key(Key::from("vip")));
    let five = Override::Limits(vec!["5/1h".parse().unwrap()]);
    a.overrides().set(&api, &scope, &five).await.unwrap();
    for _ in 0..2 {
        assert!(b.check(&vip, &api, 1).await.unwrap().is_allowed());
    }
    crate::support::cluster::cli(server.port(), &["FLUSHALL"]);
    let one = Override::Limits(vec!["1/1h".parse().unwrap()]);
    a.overrides().set(&api, &scope, &one).await.unwrap();
    let mut admitted = 0;
    for _ in 0..3 {
        admitted += usize::from(b.check(&vip, &api, 1).await.unwrap().is_allowed());
    }
    assert_eq!(admitted, 1);
}

/// Once its last override is removed, a store's decisions read no override field again, as in
/// a store that never had one (the removal deletes the hash, generation and all: while the
/// generation stayed, each key not decided since read its fields, 201 `HMGET`s for 200 keys).
#[tokio::test]
async fn after_the_last_override_is_removed_decisions_read_no_field() {
    let server = RedisServer::start();
    let store = server.store().await;
    let api = Policy::new("api", ["100/1h".parse().unwrap()]).unwrap();
    let scope = Scope::Key(Key::from("vip"));
    store
        .overrides()
        .set(&api, &scope, &Override::Block)
        .await
        .unwrap();
    assert!(store.overrides().remove(&api, &scope).await.unwrap());
    let admin = server.client().await;
    let before = crate::support::command_calls(&admin, "hmget").await;
    let started = std::time::Instant::now();
    for i in 0..200 {
        let key = Key::from(format!("k{i}"));
        assert!(store.check(&key, &api, 1).await.unwrap().is_allowed());
    }
    let hmgets = crate::support::command_calls(&admin, "hmget").await - before;
    // The only `HMGET`s left are the limits version's own reads, one every 125 ms
    // (`docs/operations.md`), which a busy machine makes room for during the 200 decisions.
    let version_reads = started.elapsed().as_millis() as u64 / 125 + 1;
    assert!(
        hmgets <= version_reads,
        "{hmgets} HMGETs in {:?}, at most {version_reads} of them the version's",
        started.elapsed()
    );
}

/// A hash of overrides without its generation (restored in part, or its field `""` deleted by
/// hand) is read in every call: its block holds (before, such a hash was taken for none).
#[tokio::test]
async fn a_hash_without_its_generation_is_still_read() {
    let server = RedisServer::start();
    let (a, b) = (server.store().await, server.store().await);
    let api = Policy::new("api", ["100/1h".parse().unwrap()]).unwrap();
    let vip = Key::from("vip");
    let scope = Scope::Key(vip.clone());
    a.overrides()
        .set(&api, &scope, &Override::Block)
        .await
        .unwrap();
    assert!(!b.check(&vip, &api, 1).await.unwrap().is_allowed());
    crate::support::cluster::cli(server.port(), &["HDEL", "ratelimit:overrides", ""]);
    for store in [&a, &b, &server.store().await] {
        assert!(!store.check(&vip, &api, 1).await.unwrap().is_allowed());
    }
}

/// A test of `$case` (a function of a store, its overrides and a way to wait) on the memory
/// store under tokio's paused clock, and one on a real Redis.
macro_rules! on_both_stores {
    ($case:ident, $memory:ident, $redis:ident) => {
        #[tokio::test(start_paused = true)]
        async fn $memory() {
            let store = tower_redis_ratelimit::MemoryStore::new();
            let overrides = store.overrides();
            $case(&store, overrides, async |d| tokio::time::sleep(d).await).await;
        }

        #[tokio::test]
        async fn $redis() {
            let server = RedisServer::start();
            let store = server.store().await;
            let overrides = store.overrides();
            $case(&store, overrides, async |d| tokio::time::sleep(d).await).await;
        }
    };
}

/// A GCRA key that spent an override's raise keeps its backlog once the override is removed:
/// its units weigh more under the policy's own counts, and the key's state is kept until they
/// have drained under those too (before, it expired a window after the last request, and the
/// key started afresh with units still owed).
async fn gcra_usage_outlives_a_removed_raise<St: Store>(
    store: &St,
    overrides: Overrides,
    wait: impl AsyncFn(Duration),
) {
    let policy = Policy::new("gcra-raise", ["2/1s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let (key, scope) = (Key::from("raised"), Scope::Key(Key::from("raised")));
    let raise = Override::Limits(vec!["4/1s".parse().unwrap()]);
    overrides.set(&policy, &scope, &raise).await.unwrap();
    for _ in 0..4 {
        assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
    }
    overrides.remove(&policy, &scope).await.unwrap();
    // Four units at 0.5 s each under 2/1s: a backlog of 2 s; one more fits once it is down to
    // 0.5 s, at 1.5 s. At 1.2 s the state has outlived its window, and the key is still full.
    wait(Duration::from_millis(1_200)).await;
    let refused = store.check(&key, &policy, 1).await.unwrap();
    assert!(
        !refused.is_allowed(),
        "the units spent under the raise were forgotten"
    );
    let retry = refused.retry_after().unwrap();
    assert!(
        retry > Duration::from_millis(100) && retry <= Duration::from_millis(300),
        "{retry:?}"
    );
}

on_both_stores!(
    gcra_usage_outlives_a_removed_raise,
    gcra_usage_outlives_a_removed_raise_on_memory,
    gcra_usage_outlives_a_removed_raise_on_redis
);

/// Admits `count` requests of `key`, cuts its counts to `1/1s` by an override, and returns the
/// refusal of the next request.
async fn spend_then_cut<St: Store>(
    store: &St,
    overrides: &Overrides,
    policy: &Policy,
    key: &Key,
    count: u64,
) -> tower_redis_ratelimit::Decision {
    for _ in 0..count {
        assert!(store.check(key, policy, 1).await.unwrap().is_allowed());
    }
    let cut = Override::Limits(vec!["1/1s".parse().unwrap()]);
    let scope = Scope::Key(key.clone());
    overrides.set(policy, &scope, &cut).await.unwrap();
    let refused = store.check(key, policy, 1).await.unwrap();
    assert!(!refused.is_allowed());
    refused
}

/// A GCRA key refused under an override that cuts its counts stays refused for the whole
/// `Retry-After` it was given: its backlog weighs more under the cut than when it was written,
/// and outlives the expiry that write set (before, the state expired a window after it, and
/// the key was let in a second before its `Retry-After`).
async fn gcra_backlog_outlives_its_expiry_under_a_cut<St: Store>(
    store: &St,
    overrides: Overrides,
    wait: impl AsyncFn(Duration),
) {
    // 2/1s and 1/1s weigh a unit of cost differently in GCRA units (gcd 2 and 1); 3/1s and
    // 1/1s alike, and drain at other rates all the same.
    for count in [2u64, 3] {
        let policy = Policy::new(
            format!("gcra-cut-{count}"),
            [format!("{count}/1s").parse().unwrap()],
        )
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
        // Written under count/1s, the state expires in 1 s. Under 1/1s its units are a backlog
        // of `count` s, and one more fits once it is down to 0.
        let key = Key::from("cut");
        let refused = spend_then_cut(store, &overrides, &policy, &key, count).await;
        let retry = refused.retry_after().unwrap();
        assert!(
            retry > Duration::from_millis(count * 1_000 - 200),
            "{retry:?}"
        );
        // Past the write's expiry, before the retry: still refused, for what is left of it.
        wait(Duration::from_millis(1_300)).await;
        let again = store.check(&key, &policy, 1).await.unwrap();
        assert!(
            !again.is_allowed(),
            "{count}/1s cut to 1/1s: let in {:?} before the Retry-After it was given",
            retry - Duration::from_millis(1_300)
        );
        let left = again.retry_after().unwrap();
        assert!(left <= retry - Duration::from_millis(1_200), "{left:?}");
    }
}

/// A GCRA key in a penalty box under a cut: the box holds as long as the backlog it was set
/// on, so that a lone client that retries a second before its `Retry-After` is refused by the
/// box without a new one, and admitted at it. Before, on the memory store, the box held only
/// until the expiry the last write had set, and the early retry started a new box that
/// refused the on-time one (told 4 s, refused at 4 s).
async fn a_box_under_a_cut_holds_its_retry<St: Store>(
    store: &St,
    overrides: Overrides,
    wait: impl AsyncFn(Duration),
) {
    let policy = Policy::new("gcra-box-cut", ["4/1s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra)
        .block_for(Duration::from_secs(2))
        .unwrap();
    let key = Key::from("boxed");
    let refused = spend_then_cut(store, &overrides, &policy, &key, 4).await;
    // The header's whole seconds, rounded up.
    let retry = refused.retry_after().unwrap();
    let told = Duration::from_secs(retry.as_secs_f64().ceil() as u64);
    wait(told - Duration::from_secs(1)).await;
    let early = store.check(&key, &policy, 1).await.unwrap();
    assert!(!early.is_allowed(), "admitted a second before {told:?}");
    wait(Duration::from_secs(1)).await;
    let on_time = store.check(&key, &policy, 1).await.unwrap();
    assert!(
        on_time.is_allowed(),
        "refused at the Retry-After it was given ({told:?}), told {:?} more",
        on_time.retry_after()
    );
}

on_both_stores!(
    a_box_under_a_cut_holds_its_retry,
    a_box_under_a_cut_holds_its_retry_on_memory,
    a_box_under_a_cut_holds_its_retry_on_redis
);

on_both_stores!(
    gcra_backlog_outlives_its_expiry_under_a_cut,
    gcra_backlog_outlives_its_expiry_under_a_cut_on_memory,
    gcra_backlog_outlives_its_expiry_under_a_cut_on_redis
);
