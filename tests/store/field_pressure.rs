//! The Redis store under two field conditions: a Redis at its `maxmemory` (each eviction
//! policy, cold keys by the ten thousand, a few hot keys, an override, leases on and off, both
//! tiers), and late replies or an overloaded Redis (calls per decision on the plain tier
//! against the full scripts alone, decisions counted once).
//!
//! Each test prints its figures (`--nocapture`).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::delay::Delay;
use crate::support::monitor::evalsha_seen_at;
use crate::support::{command_calls, RedisServer};
use fred::prelude::*;
use tokio::time::Instant;
use tower_redis_ratelimit::store::{Leases, Override, Scope};
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store, StoreError};

/// A store error's kind, with Redis's own error text cut to its first word or two.
fn kind(e: &StoreError) -> String {
    match e {
        StoreError::Redis(r) => {
            let text = r.details().to_string();
            let head: String = text
                .split_whitespace()
                .take(2)
                .collect::<Vec<_>>()
                .join(" ");
            format!("Redis({:?}: {head})", r.kind())
        }
        StoreError::Timeout(_) => "Timeout".into(),
        StoreError::Unavailable => "Unavailable".into(),
        StoreError::Reply(r) => format!("Reply({})", r.chars().take(40).collect::<String>()),
        other => format!("{other:?}"),
    }
}

/// Errors counted by kind.
#[derive(Default, Clone)]
struct Errors(Arc<Mutex<BTreeMap<String, usize>>>);

impl Errors {
    fn add(&self, e: &StoreError) {
        *self.0.lock().unwrap().entry(kind(e)).or_default() += 1;
    }
    fn total(&self) -> usize {
        self.0.lock().unwrap().values().sum()
    }
    fn show(&self) -> String {
        format!("{:?}", self.0.lock().unwrap())
    }
}

/// The keys of the server behind `client` whose PTTL is -1 (no expiry).
async fn keys_without_ttl(client: &Client) -> Vec<String> {
    let script = "local out = {} for _, k in ipairs(redis.call('KEYS', '*')) do \
                  if redis.call('PTTL', k) == -1 then out[#out + 1] = k end end return out";
    client
        .eval(script, Vec::<String>::new(), Vec::<String>::new())
        .await
        .unwrap()
}

/// `INFO` field `field` of section `section`.
async fn info_field(client: &Client, section: fred::types::InfoKind, field: &str) -> String {
    let info: String = client.info(Some(section)).await.unwrap();
    let prefix = format!("{field}:");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or("?")
        .trim()
        .to_owned()
}

/// One configuration of a memory-pressure run.
#[derive(Clone, Copy, Debug)]
struct Run {
    algorithm: Algorithm,
    plain: bool,
    leases: bool,
}

/// What a memory-pressure run saw.
#[derive(Debug, Default)]
struct Pressure {
    cold: usize,
    cold_errors: usize,
    hot_tries: usize,
    hot_admitted: usize,
    blocked_admitted: usize,
    errors: String,
    evicted: String,
    without_ttl: Vec<String>,
    /// The sliding log's events on the counting key against the admissions seen (and errors).
    counted: Option<(usize, usize, usize)>,
}

/// Drives `cold` cold keys (one decision each, 48 tasks) through a store of `run` on
/// `server`, with, every 200 cold decisions, one decision of a hot key under 10 a minute, one
/// of a key blocked by an override, and one of a counting key under 1 000 000 a minute.
async fn pressure(
    server: &RedisServer,
    run: Run,
    cold: usize,
    tag: &str,
    pace: Duration,
) -> Pressure {
    let mut builder = RedisStore::builder(server.url())
        .plain_scripts(run.plain)
        .timeout(Duration::from_secs(1))
        .retry_interval(Duration::from_millis(100));
    if run.leases {
        builder = builder.leases(Leases::new());
    }
    let store = builder.connect().await.expect("connect");
    let admin = server.client().await;
    let tight = Policy::new(format!("tight-{tag}"), ["10/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(run.algorithm);
    let wide = Policy::new(format!("wide-{tag}"), ["1000000/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(run.algorithm);
    let hot = Key::from(format!("hot-{tag}"));
    let blocked = Key::from(format!("blocked-{tag}"));
    let counting = Key::from(format!("counting-{tag}"));
    store
        .overrides()
        .set(&tight, &Scope::Key(blocked.clone()), &Override::Block)
        .await
        .expect("override");
    let errors = Errors::default();
    let next = Arc::new(AtomicUsize::new(0));
    let cold_errors = Arc::new(AtomicUsize::new(0));
    let hot_tries = Arc::new(AtomicUsize::new(0));
    let hot_admitted = Arc::new(AtomicUsize::new(0));
    let blocked_admitted = Arc::new(AtomicUsize::new(0));
    let counted_admitted = Arc::new(AtomicUsize::new(0));
    let counted_errors = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..48 {
        let (store, errors, next) = (store.clone(), errors.clone(), next.clone());
        let (wide, tight, hot, blocked, counting) = (
            wide.clone(),
            tight.clone(),
            hot.clone(),
            blocked.clone(),
            counting.clone(),
        );
        let (cold_errors, hot_tries, hot_admitted, blocked_admitted) = (
            cold_errors.clone(),
            hot_tries.clone(),
            hot_admitted.clone(),
            blocked_admitted.clone(),
        );
        let (counted_admitted, counted_errors) = (counted_admitted.clone(), counted_errors.clone());
        let tag = tag.to_owned();
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= cold {
                    return;
                }
                let key = Key::from(format!("cold-{tag}-{i}"));
                if let Err(e) = store.check(&key, &wide, 1).await {
                    errors.add(&e);
                    cold_errors.fetch_add(1, Ordering::Relaxed);
                }
                if !pace.is_zero() {
                    tokio::time::sleep(pace).await;
                }
                if i % 200 == 0 {
                    hot_tries.fetch_add(1, Ordering::Relaxed);
                    match store.check(&hot, &tight, 1).await {
                        Ok(d) if d.is_allowed() => {
                            hot_admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => errors.add(&e),
                    }
                    match store.check(&blocked, &tight, 1).await {
                        Ok(d) if d.is_allowed() => {
                            blocked_admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => errors.add(&e),
                    }
                    match store.check(&counting, &wide, 1).await {
                        Ok(d) if d.is_allowed() => {
                            counted_admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => {
                            counted_errors.fetch_add(1, Ordering::Relaxed);
                            errors.add(&e);
                        }
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    if run.leases {
        let _ = store.drain().await;
    }
    let counted = if matches!(run.algorithm, Algorithm::SlidingLog) && !run.leases {
        let name = redis_key(&store, &counting, &wide);
        let events: i64 = admin.zcard(&name).await.unwrap_or(-1);
        Some((
            events.max(0) as usize,
            counted_admitted.load(Ordering::Relaxed),
            counted_errors.load(Ordering::Relaxed),
        ))
    } else {
        None
    };
    Pressure {
        cold,
        cold_errors: cold_errors.load(Ordering::Relaxed),
        hot_tries: hot_tries.load(Ordering::Relaxed),
        hot_admitted: hot_admitted.load(Ordering::Relaxed),
        blocked_admitted: blocked_admitted.load(Ordering::Relaxed),
        errors: errors.show(),
        evicted: info_field(&admin, fred::types::InfoKind::Stats, "evicted_keys").await,
        without_ttl: keys_without_ttl(&admin).await,
        counted,
    }
}

/// The keys a store writes without expiry: the overrides hash, its stamps and the limits
/// version (`docs/operations.md`).
const KEPT: [&str; 3] = [
    "ratelimit:overrides",
    "ratelimit:overrides:stamps",
    "ratelimit:{overrides}:limits",
];

/// The runs of each eviction policy: each algorithm on the plain tier, on the full scripts
/// alone, and with leases.
const RUNS: [Run; 6] = [
    Run {
        algorithm: Algorithm::Gcra,
        plain: true,
        leases: false,
    },
    Run {
        algorithm: Algorithm::SlidingLog,
        plain: true,
        leases: false,
    },
    Run {
        algorithm: Algorithm::Gcra,
        plain: false,
        leases: false,
    },
    Run {
        algorithm: Algorithm::Gcra,
        plain: true,
        leases: true,
    },
    Run {
        algorithm: Algorithm::SlidingLog,
        plain: false,
        leases: false,
    },
    Run {
        algorithm: Algorithm::SlidingLog,
        plain: true,
        leases: true,
    },
];

/// Runs every one of [`RUNS`] on a fresh Redis of `maxmemory` 3 MB under `policy`, 30 000
/// cold keys each, each task pausing `pace` after each cold decision; what each saw, printed.
async fn each_run(policy: &str, pace: Duration) -> Vec<(Run, Pressure)> {
    let mut out = Vec::new();
    for (i, run) in RUNS.into_iter().enumerate() {
        let server = RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", policy]);
        let admin = server.client().await;
        let started = Instant::now();
        let p = pressure(&server, run, 30_000, &format!("{i}"), pace).await;
        eprintln!(
            "{policy} (pace {pace:?}) {run:?} in {:?}: used_memory {} of 3145728, dbsize {}\n  {p:?}",
            started.elapsed(),
            info_field(&admin, fred::types::InfoKind::Memory, "used_memory").await,
            admin.dbsize::<i64>().await.unwrap()
        );
        out.push((run, p));
    }
    out
}

/// What a run broke of what holds without eviction: the hot key admitted past its 10, the
/// blocked key admitted, the counting log's events other than its admissions, errors, keys
/// other than the overrides' without expiry.
fn broken(policy: &str, run: Run, p: &Pressure, errors_allowed: bool) -> Vec<String> {
    let mut broke = Vec::new();
    // The run reached memory pressure: Redis refused or evicted.
    let evicted: u64 = p.evicted.parse().unwrap_or(0);
    let quiet = evicted == 0 && p.cold_errors == 0 && p.errors == "{}";
    if p.hot_tries != p.cold / 200 || quiet {
        broke.push(format!("{policy} {run:?}: no pressure reached: {p:?}"));
    }
    if p.hot_admitted > 10 {
        broke.push(format!(
            "{policy} {run:?}: hot key admitted {} of 10",
            p.hot_admitted
        ));
    }
    if p.blocked_admitted > 0 {
        broke.push(format!(
            "{policy} {run:?}: blocked key admitted {}",
            p.blocked_admitted
        ));
    }
    if let Some((events, admitted, errors)) = p.counted {
        if events != admitted {
            broke.push(format!(
                "{policy} {run:?}: counting log holds {events} events for {admitted} admissions ({errors} errors)"
            ));
        }
    }
    if !errors_allowed && p.errors != "{}" {
        broke.push(format!("{policy} {run:?}: errors {}", p.errors));
    }
    let stray: Vec<_> = p
        .without_ttl
        .iter()
        .filter(|k| !KEPT.contains(&k.as_str()))
        .collect();
    if !stray.is_empty() {
        broke.push(format!("{policy} {run:?}: without expiry {stray:?}"));
    }
    broke
}

/// (1) `noeviction` at 3 MB, 30 000 cold keys and a hot, a blocked and a counting key (each of
/// [`RUNS`]): a decision that needs memory fails with Redis's OOM error (`StoreError::Redis`),
/// nothing else; the hot key is never over its 10, the blocked key
/// never admitted, the counting log holds exactly its admissions (an OOM'd call, re-sent or
/// not, counts nothing twice); only the overrides' keys lack an expiry. Then, behind a layer,
/// a new client is answered 503 under `Closed`, admitted under `Open`, and held to the count by
/// the local store under `Fallback` while Redis is full;
/// with `maxmemory` raised, `Closed` admits again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noeviction_fails_typed_is_never_over_and_recovers() {
    let mut broke = Vec::new();
    for (run, p) in each_run("noeviction", Duration::ZERO).await {
        broke.extend(broken("noeviction", run, &p, true));
        let kinds = p.errors.clone();
        let gcra = matches!(run.algorithm, Algorithm::Gcra);
        // Each kind (`"<kind>": <count>`) is Redis's OOM error.
        let only_oom = kinds.matches("\": ").count() == kinds.matches("OOM command").count();
        if (gcra && !kinds.contains("OOM")) || !only_oom {
            broke.push(format!(
                "noeviction {run:?}: errors {kinds}, expected OOM alone"
            ));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");

    // Behind a layer, GCRA (the sliding log is not held by maxmemory: see the ignored test).
    let server =
        RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
    let admin = server.client().await;
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(1))
        .retry_interval(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let wide = Policy::new("wide", ["1000000/1m".parse().unwrap()]).unwrap();
    // Fill: cold keys until Redis refuses.
    let mut filled = 0;
    for i in 0..40_000 {
        if store
            .check(&Key::from(format!("fill-{i}")), &wide, 1)
            .await
            .is_err()
        {
            break;
        }
        filled += 1;
    }
    let layer = |mode| {
        crate::support::http::served(
            tower_redis_ratelimit::RateLimitLayer::builder()
                .policy(wide.clone())
                .key(crate::support::http::api_key())
                .store(store.clone())
                .failure_mode(mode)
                .build()
                .unwrap(),
        )
    };
    use tower::ServiceExt;
    let status = |mode, key: &'static str| {
        let service = layer(mode);
        async move {
            service
                .oneshot(crate::support::http::keyed(key))
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let closed = status(tower_redis_ratelimit::FailureMode::Closed, "new-1").await;
    let open = status(tower_redis_ratelimit::FailureMode::Open, "new-2").await;
    eprintln!("noeviction: {filled} keys fill 3 MB; a new client: Closed {closed}, Open {open}");
    assert_eq!(
        (closed, open),
        (503, 200),
        "Closed, Open while Redis is full"
    );
    // Fallback: decided by the local store, at the policy's count (3 a minute here).
    let three = Policy::new("three", ["3/1m".parse().unwrap()]).unwrap();
    let fallback = crate::support::http::served(
        tower_redis_ratelimit::RateLimitLayer::builder()
            .policy(three)
            .key(crate::support::http::api_key())
            .store(store.clone())
            .failure_mode(tower_redis_ratelimit::FailureMode::Fallback(
                tower_redis_ratelimit::MemoryStore::new(),
            ))
            .build()
            .unwrap(),
    );
    let local = crate::support::http::admitted(&fallback, "new-4", 6).await;
    eprintln!("noeviction: Fallback admits {local} of 6 requests of a new client under 3 a minute");
    assert_eq!(local, 3);
    let _: String = admin
        .custom(fred::cmd!("CONFIG"), vec!["SET", "maxmemory", "64mb"])
        .await
        .unwrap();
    let raised = Instant::now();
    let mut after = 0;
    while raised.elapsed() < Duration::from_secs(3) {
        after = status(tower_redis_ratelimit::FailureMode::Closed, "new-3").await;
        if after == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "noeviction: maxmemory raised; Closed answers {after} after {:?}",
        raised.elapsed()
    );
    assert_eq!(after, 200);
}

/// (2) `volatile-lru` and `volatile-ttl` at 3 MB: Redis evicts only keys with an expiry, so
/// the overrides hash stays and the blocked key is never admitted, no decision fails, and
/// every state key has an expiry, with leases on the sliding log too (test (7)). (The hot
/// key's own state is evicted: the ignored test (3).)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volatile_policies_keep_overrides_and_expiries() {
    let mut broke = Vec::new();
    for policy in ["volatile-lru", "volatile-ttl"] {
        for (run, p) in each_run(policy, Duration::ZERO).await {
            let evicted: u64 = p.evicted.parse().unwrap_or(0);
            if p.blocked_admitted > 0 || p.errors != "{}" || evicted == 0 {
                broke.push(format!("{policy} {run:?}: {p:?}"));
            }
            let stray: Vec<_> = p
                .without_ttl
                .iter()
                .filter(|k| !KEPT.contains(&k.as_str()))
                .collect();
            if !stray.is_empty() || p.without_ttl.len() < KEPT.len() {
                broke.push(format!(
                    "{policy} {run:?}: without expiry {:?}",
                    p.without_ttl
                ));
            }
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (3) Every evicting policy at 3 MB, 30 000 cold keys in about a second and again paced to
/// about 4 s: is the hot key ever over its 10 a minute, the blocked key admitted, or the
/// counting log short of its admissions? Fast, on every policy: Redis evicts the limiter's
/// state, and under `allkeys-lru` the overrides hash (all keys are one tick old on Redis's
/// LRU clock). Paced, less often: `volatile-ttl` still evicts hot state (a key refused at its
/// count is not written, so its expiry is among the nearest), `allkeys-lru` hot state, the
/// counting log or the override; `volatile-lru` lost nothing in two paced runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "shows evicted state: the hot key admitted past its count (volatile-ttl, and every policy at full speed), the counting log losing events, the override lost under allkeys-lru"]
async fn evicting_policies_keep_every_count() {
    let mut broke = Vec::new();
    // At full speed (30 000 keys in about a second, within one tick of Redis's LRU clock),
    // and paced to about 3 s (the hot key used every 20 ms, seconds more recently than the
    // oldest cold keys).
    for pace in [Duration::ZERO, Duration::from_millis(5)] {
        for policy in ["allkeys-lru", "volatile-lru", "volatile-ttl"] {
            for (run, p) in each_run(policy, pace).await {
                broke.extend(
                    broken(policy, run, &p, false)
                        .into_iter()
                        .map(|b| format!("pace {pace:?} {b}")),
                );
            }
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (4) `noeviction` at 3 MB: Redis holds every algorithm, tier and lease setting to
/// `maxmemory` (within a tenth: a call's writes once under way all land). Redis refuses a
/// script's write for memory only while the script has written nothing yet; the log's trims
/// (`ZREMRANGEBYSCORE`, a write it never refuses) came before the first decision's `ZADD` and
/// let every later write of the call through: 8 130 728 bytes used of 3 145 728, every cold
/// key's decision admitted. The scripts now trim once the call's requests are decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noeviction_holds_every_store_to_maxmemory() {
    let mut broke = Vec::new();
    for run in RUNS {
        let server =
            RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
        let admin = server.client().await;
        let tag = match run.algorithm {
            Algorithm::SlidingLog => "log",
            _ => "gcra",
        };
        let p = pressure(&server, run, 30_000, tag, Duration::ZERO).await;
        let used: u64 = info_field(&admin, fred::types::InfoKind::Memory, "used_memory")
            .await
            .parse()
            .unwrap();
        eprintln!("noeviction {run:?}: used_memory {used} of 3145728; {p:?}");
        if used >= 3_145_728 * 11 / 10 {
            broke.push(format!("{run:?}: used_memory {used}"));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// What one store saw deciding a counting key (sliding log, 1 000 000 a minute) and a tight
/// key (GCRA, 5 a minute) from 8 tasks.
#[derive(Debug, Default)]
struct Late {
    decisions: usize,
    counted_admitted: usize,
    counted_events: i64,
    tight_admitted: usize,
    errors: String,
    error_count: usize,
    evalsha: u64,
}

/// `tasks` tasks, each `rounds` decisions of the counting key and of the tight key
/// (alternating, or until `until` has passed when given), through `store`; Redis behind
/// `admin`.
async fn late_load(
    store: &RedisStore,
    admin: &Client,
    tag: &str,
    (tasks, rounds): (usize, usize),
    until: Option<Duration>,
) -> Late {
    let counting = Policy::new(format!("counting-{tag}"), ["1000000/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let tight = Policy::new(format!("tight-{tag}"), ["5/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let key = Key::from(format!("late-{tag}"));
    let errors = Errors::default();
    let decisions = Arc::new(AtomicUsize::new(0));
    let counted = Arc::new(AtomicUsize::new(0));
    let tight_admitted = Arc::new(AtomicUsize::new(0));
    let before = command_calls(admin, "evalsha").await;
    let origin = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (store, errors, key) = (store.clone(), errors.clone(), key.clone());
        let (counting, tight) = (counting.clone(), tight.clone());
        let (decisions, counted, tight_admitted) =
            (decisions.clone(), counted.clone(), tight_admitted.clone());
        handles.push(tokio::spawn(async move {
            let mut r = 0;
            while until.map_or(r < rounds, |u| origin.elapsed() < u) {
                r += 1;
                for (policy, admitted) in [(&counting, &counted), (&tight, &tight_admitted)] {
                    decisions.fetch_add(1, Ordering::Relaxed);
                    match store.check(&key, policy, 1).await {
                        Ok(d) if d.is_allowed() => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => {
                            errors.add(&e);
                            // A store found unavailable answers at once: do not spin.
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                }
            }
        }));
    }
    for t in handles {
        t.await.unwrap();
    }
    // Late replies land after their requests gave up: let them.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let evalsha = command_calls(admin, "evalsha").await - before;
    let events: i64 = admin
        .zcard(redis_key(store, &key, &counting))
        .await
        .unwrap_or(-1);
    Late {
        decisions: decisions.load(Ordering::Relaxed),
        counted_admitted: counted.load(Ordering::Relaxed),
        counted_events: events,
        tight_admitted: tight_admitted.load(Ordering::Relaxed),
        errors: errors.show(),
        error_count: errors.total(),
        evalsha,
    }
}

/// The confirmation (generation, Redis time in µs) a plain call's arguments carry
/// (`scripts/plain.lua`, `ARGV[2]`).
fn confirmation(call: &[Vec<u8>]) -> Option<(i64, i64)> {
    let keys: usize = std::str::from_utf8(call.get(2)?).ok()?.parse().ok()?;
    let argv2 = call.get(3 + keys + 1)?;
    let ints: Vec<i64> = argv2
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (ints.len() == 2).then(|| (ints[0], ints[1]))
}

/// A store of either tier at `url`, budget 2 s.
async fn tier_store(url: String, plain: bool) -> RedisStore {
    RedisStore::builder(url)
        .plain_scripts(plain)
        .timeout(Duration::from_secs(2))
        .retry_interval(Duration::from_millis(100))
        .connect()
        .await
        .expect("connect")
}

/// (5) Late requests and late replies (50 to 300 ms, one way or the other or both) in front
/// of the plain tier and of the full scripts alone, 96 decisions each: no plain call sent
/// without a confirmation (its lane's ran out while its requests queued for a call permit: it
/// runs the full script instead, where a plain call would answer every request `FULL_PATH`
/// to be sent again), EVALSHA calls per decision (the plain tier's re-sends included) at
/// most twice the full tier's plus one call in ten (measured: up to 1.22 times, one way
/// 150 ms; when such calls were sent, 1 to 9 of them in a run, up to 1.87 times), the
/// counting log holding exactly its admissions (none lost, none counted twice), the tight key
/// never over its 5, no errors within the 2 s budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_requests_and_replies_cost_no_more_calls_and_count_once() {
    let broke = late_requests_and_replies((8, 6), 2.0).await;
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (5b) As (5), one decision at a time (no batching): the full tier alone takes exactly one
/// call a decision, and so does the plain tier (a late confirmation sends the request to the
/// full script at once, not through a `FULL_PATH` re-send).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_requests_and_replies_one_at_a_time_cost_no_more_calls() {
    let broke = late_requests_and_replies((1, 8), 1.0).await;
    assert!(broke.is_empty(), "{broke:#?}");
}

/// Runs the delays of (5) with `load` (tasks, rounds) on both tiers; what broke, the plain
/// tier's calls a decision past `ratio` times the full tier's (plus 0.1 with more than one
/// task) among it.
async fn late_requests_and_replies(load: (usize, usize), ratio: f64) -> Vec<String> {
    let ms = Duration::from_millis;
    let delays = [
        (ms(50), ms(0)),
        (ms(0), ms(50)),
        (ms(150), ms(0)),
        (ms(0), ms(150)),
        (ms(240), ms(0)),
        (ms(0), ms(240)),
        (ms(300), ms(0)),
        (ms(0), ms(300)),
        (ms(150), ms(150)),
    ];
    let mut runs = Vec::new();
    for (up, down) in delays {
        for plain in [true, false] {
            runs.push(tokio::spawn(async move {
                let server = RedisServer::start();
                let admin = server.client().await;
                let delay = Delay::start(server.port(), up, down).await;
                let store = tier_store(delay.url(), plain).await;
                let tag = format!("{}-{}", up.as_millis(), down.as_millis());
                let mut shas = HashSet::new();
                let mut late = Late::default();
                let calls = evalsha_seen_at(server.port(), async {
                    late = late_load(&store, &admin, &tag, load, None).await;
                })
                .await;
                for (_, c) in &calls {
                    shas.insert(c[1].clone());
                }
                (up, down, plain, late, calls, shas)
            }));
        }
    }
    let mut results = Vec::new();
    for r in runs {
        results.push(r.await.unwrap());
    }
    let mut broke = Vec::new();
    for pair in results.chunks(2) {
        let (up, down, _, ref plain, ref plain_calls, _) = pair[0];
        let (_, _, _, ref full, _, ref full_shas) = pair[1];
        let full_script_calls = plain_calls
            .iter()
            .filter(|(_, c)| full_shas.contains(&c[1]))
            .count();
        // Plain calls Redis ran at or after their confirmation's time: every request in them
        // answered FULL_PATH and sent again to the full script.
        let confirmed: Vec<(i64, (i64, i64))> = plain_calls
            .iter()
            .filter(|(_, c)| !full_shas.contains(&c[1]))
            .filter_map(|(at, c)| confirmation(c).map(|k| (*at, k)))
            .collect();
        let run_late = confirmed
            .iter()
            .filter(|(at, (_, until))| at >= until)
            .count();
        // Sent with no confirmation at all (generation -2, until 0): answered `FULL_PATH`
        // whole, whenever Redis ran it.
        let unconfirmed = confirmed
            .iter()
            .filter(|(_, (_, until))| *until == 0)
            .count();
        let per = |l: &Late| l.evalsha as f64 / l.decisions as f64;
        eprintln!(
            "up {up:?} down {down:?}: plain tier {:.3} EVALSHA/decision ({} calls, {full_script_calls} of them full scripts, {} plain calls, {unconfirmed} of them without a confirmation, {run_late} run past it), full tier alone {:.3} ({} calls)\n  plain {plain:?}\n  full  {full:?}",
            per(plain),
            plain.evalsha,
            confirmed.len(),
            per(full),
            full.evalsha,
        );
        if unconfirmed > 0 {
            broke.push(format!(
                "up {up:?} down {down:?}: {unconfirmed} plain calls sent without a confirmation"
            ));
        }
        if plain.evalsha as usize != full_script_calls + confirmed.len() {
            broke.push(format!(
                "up {up:?} down {down:?}: a plain call without a confirmation"
            ));
        }
        for (tier, l) in [("plain", plain), ("full", full)] {
            if l.counted_events != l.counted_admitted as i64
                || l.tight_admitted > 5
                || l.error_count > 0
            {
                broke.push(format!("up {up:?} down {down:?} {tier}: {l:?}"));
            }
        }
        let slack = if load.0 > 1 { 0.1 } else { 0.0 };
        if per(plain) > ratio * per(full) + slack {
            broke.push(format!(
                "up {up:?} down {down:?}: plain {:.3} calls a decision, full {:.3}",
                per(plain),
                per(full)
            ));
        }
    }
    broke
}

/// (6) An overloaded Redis: another client runs `DEBUG SLEEP 0.2` (or 0.4, past the budget)
/// back to back for 3 s while
/// 8 tasks decide through a store of the default 250 ms budget, on each tier. Errors are
/// typed (timeouts, `StoreError::Redis` of kind timeout, unavailable), the tight key is never over its 5, the counting log holds
/// at least its admissions and at most its admissions plus its failed decisions; calls per
/// decision are printed for both tiers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_redis_is_never_over_on_either_tier() {
    let mut broke = Vec::new();
    let mut runs = Vec::new();
    for (plain, stall) in [(true, "0.2"), (false, "0.2"), (true, "0.4"), (false, "0.4")] {
        runs.push(tokio::spawn(async move {
            let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
            let admin = server.client().await;
            let sleeper = server.client().await;
            let store = RedisStore::builder(server.url())
                .plain_scripts(plain)
                .retry_interval(Duration::from_millis(100))
                .connect()
                .await
                .unwrap();
            let run = Duration::from_secs(3);
            let origin = Instant::now();
            let stalls = Arc::new(AtomicU64::new(0));
            let counter = stalls.clone();
            let stalling = tokio::spawn(async move {
                while origin.elapsed() < run {
                    let _: Result<Value, _> = sleeper
                        .custom(fred::cmd!("DEBUG"), vec!["SLEEP", stall])
                        .await;
                    counter.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
            let tag = format!("{plain}-{stall}");
            let late = late_load(&store, &admin, &tag, (8, 0), Some(run)).await;
            stalling.await.unwrap();
            (plain, stall, late, stalls.load(Ordering::Relaxed))
        }));
    }
    for r in runs {
        let (plain, stall, l, stalls) = r.await.unwrap();
        eprintln!(
            "overloaded ({stalls} stalls of {stall} s), plain tier {plain}: {:.3} EVALSHA a decision answered; {l:?}",
            l.evalsha as f64 / (l.decisions - l.error_count).max(1) as f64
        );
        let kinds_ok = l.errors.matches("Redis(").count()
            == l.errors.matches("Redis(Timeout").count()
            && !l.errors.contains("Reply(");
        if l.tight_admitted > 5
            || l.counted_events < l.counted_admitted as i64
            || l.counted_events > (l.counted_admitted + l.error_count) as i64
            || !kinds_ok
        {
            broke.push(format!("plain {plain}, stalls of {stall} s: {l:?}"));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// A sliding-log key's state, as a lease's give-back finds it after the key was lost (evicted,
/// or deleted) and made again by a lease: does every log key keep an expiry after `drain`?
async fn log_key_after_give_back(delete: bool) -> (i64, String, usize) {
    use tower_redis_ratelimit::test_util::leasing_keys;
    let server = RedisServer::start();
    let admin = server.client().await;
    let store = RedisStore::builder(server.url())
        .leases(Leases::new())
        .connect()
        .await
        .unwrap();
    let policy = Policy::new("leased", ["1000/1m".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let key = Key::from("hot");
    let name = redis_key(&store, &key, &policy);
    // Hot: 400 requests, one a millisecond, until the key leases.
    let mut admitted = 0;
    for _ in 0..400 {
        admitted += usize::from(store.check(&key, &policy, 1).await.unwrap().is_allowed());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(leasing_keys(&store), 1, "the hot key leases");
    if delete {
        // As an eviction would: the key goes, and the next lease makes it again.
        let _: i64 = admin.del(&name).await.unwrap();
        for _ in 0..100 {
            admitted += usize::from(store.check(&key, &policy, 1).await.unwrap().is_allowed());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    store.drain().await.unwrap();
    let pttl: i64 = admin.pttl(&name).await.unwrap();
    let members: Vec<String> = admin
        .zrange(&name, 0, -1, None, false, None, false)
        .await
        .unwrap();
    (pttl, members.join(" "), admitted)
}

/// (7) A sliding-log key lost while it leases (deleted here, as `allkeys-*` or `volatile-*`
/// eviction deletes it) and made again by the next lease: after `drain` gives the unspent
/// units back, the key keeps an expiry, with the deletion and without (PTTL about 2 min).
/// The give-back removes the set's only member before it adds it back lighter, and Redis
/// deletes a sorted set left empty, expiry and all (`log_lighten.lua`, `restore_expiry`);
/// without that restore the key is left with PTTL -1, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_key_made_again_by_a_lease_keeps_its_expiry() {
    let mut broke = Vec::new();
    for delete in [false, true] {
        let (pttl, members, admitted) = log_key_after_give_back(delete).await;
        eprintln!(
            "deleted while leasing {delete}: PTTL {pttl}, {admitted} admitted, events {members}"
        );
        if pttl < 0 {
            broke.push(format!(
                "deleted while leasing {delete}: PTTL {pttl}, events {members}"
            ));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}
