//! Redis memory per key for each algorithm, at limits 100 and 10 000: the key is filled to its
//! limit (the most state it ever holds: for the sliding log, by requests of cost 1) and
//! measured with `MEMORY USAGE key SAMPLES 0`.
//!
//! Then a sliding log under `100000/1m` holding 100 requests of cost 1 000: as this crate
//! keeps it (one member per request, carrying its cost), and, for comparison, the same 100 000
//! units written with plain `ZADD` as one member per unit (`<time>:<n>`, the layout of a log
//! that stores units instead of events).
//!
//! ```text
//! cargo run --release --example redis_memory
//! ```
//!
//! With `--cold N`, it measures instead what `N` cold keys cost, each decided once (most
//! production keys: a request now and then), for each algorithm, with and without leases:
//!
//! 1. `FLUSHALL`, `MEMORY PURGE`, one decision by each of 32 tasks (so that the scripts are
//!    loaded and the connections busy, as they are later), then `used_memory` from `INFO memory`;
//! 2. `N` distinct keys decided once each under `1000/1m` (none expires meanwhile), by the 32
//!    tasks;
//! 3. `used_memory` and `DBSIZE` again (`DBSIZE` counts the 32 keys of step 1): bytes per key =
//!    the growth of `used_memory` / `N` (the key's name, value, dict entry and expiry entry,
//!    and the allocator's rounding), and `MEMORY USAGE key SAMPLES 0` of one of them;
//! 4. the same under `1000/1s`, then a wait of `2 × (window + lease period) + 1 s` (5 s): what
//!    is left after every key expired: `DBSIZE`, and `used_memory` less its value after a
//!    further `FLUSHALL` and `MEMORY PURGE` (both read with the clients idle).
//!
//! ```text
//! cargo run --release --all-features --example redis_memory -- --cold 100000
//! ```
//!
//! Uses `REDIS_URL` if set (it sends `FLUSHALL`: point it only at a scratch Redis); otherwise
//! starts its own `redis-server` on a free loopback port.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fred::prelude::*;
use fred::types::InfoKind;
use tokio::task::JoinSet;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{Algorithm, Key, Limit, Policy, RedisStore, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

const ALGORITHMS: [(Algorithm, &str); 4] = [
    (Algorithm::SlidingLog, "sliding log"),
    (Algorithm::SlidingWindow, "sliding window counter"),
    (Algorithm::FixedWindow, "fixed window"),
    (Algorithm::Gcra, "GCRA"),
];

/// Tasks deciding the cold keys at once.
const COLD_TASKS: usize = 32;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let cold = cold_keys(std::env::args().skip(1))?;
    let (url, mut server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let (url, child) = start_redis()?;
            (url, Some(child))
        }
    };
    let result = match cold {
        Some(keys) => measure_cold(&url, keys).await,
        None => measure(&url).await,
    };
    if let Some(child) = server.as_mut() {
        child.kill()?;
        child.wait()?;
    }
    result
}

async fn measure(url: &str) -> Result<(), Error> {
    let store = RedisStore::connect(url).await?;
    let redis = Builder::from_config(Config::from_url(url)?).build()?;
    redis.init().await?;
    let version: String = redis
        .info::<String>(Some(fred::types::InfoKind::Server))
        .await?
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:").map(str::to_owned))
        .unwrap_or_default();
    println!(
        "Redis {version}: bytes per key (MEMORY USAGE ... SAMPLES 0), key filled to its limit\n"
    );
    println!("| algorithm | limit 100/1m | limit 10000/1m |");
    println!("|---|---|---|");
    for (algorithm, name) in ALGORITHMS {
        let mut row = format!("| {name} |");
        for count in [100u32, 10_000] {
            let limit = Limit::new(u64::from(count), Duration::from_secs(60))?;
            let policy = Policy::new("mem", [limit])?.with_algorithm(algorithm);
            let key = Key::from("203.0.113.7");
            store.reset(&key, &policy).await?;
            // The log keeps one member per request: its fullest is `count` requests of cost
            // 1. The others keep the same state whatever the costs.
            let requests = match algorithm {
                Algorithm::SlidingLog => vec![1; count as usize],
                _ => vec![count],
            };
            for cost in requests {
                assert!(store.check(&key, &policy, cost).await?.is_allowed());
            }
            let decision = store.peek(&key, &policy, 0).await?;
            assert_eq!(decision.remaining(), 0);
            let bytes: u64 = redis
                .memory_usage(redis_key(&store, &key, &policy), Some(0))
                .await?;
            row.push_str(&format!(" {bytes} |"));
        }
        println!("{row}");
    }
    weighted_log(&store, &redis).await
}

/// A sliding log under `100000/1m` holding 100 requests of cost 1 000, as events and as units.
async fn weighted_log(store: &RedisStore, redis: &Client) -> Result<(), Error> {
    let policy = Policy::new("usage", ["100000/1m".parse::<Limit>()?])?;
    let key = Key::from("203.0.113.8");
    store.reset(&key, &policy).await?;
    for i in 1..=100u64 {
        let decision = store.check(&key, &policy, 1_000).await?;
        assert!(decision.is_allowed() && decision.remaining() == 100_000 - i * 1_000);
    }
    let events_key = redis_key(store, &key, &policy);
    let members: u64 = redis.zcard(&events_key).await?;
    let events: u64 = redis.memory_usage(&events_key, Some(0)).await?;

    // The same units as one member per unit, written directly.
    let units_key = format!("{events_key}:per-unit");
    let start = 1_700_000_000_000_000u64;
    for request in 0..100u64 {
        let at = start + request;
        let batch: Vec<(f64, String)> = (0..1_000)
            .map(|n| (at as f64, format!("{at}:{n}")))
            .collect();
        let _: () = redis
            .zadd(&units_key, None, None, false, false, batch)
            .await?;
    }
    let unit_members: u64 = redis.zcard(&units_key).await?;
    let units: u64 = redis.memory_usage(&units_key, Some(0)).await?;
    let _: () = redis.del(&units_key).await?;

    println!("\nsliding log, 100000/1m, 100 requests of cost 1000 (MEMORY USAGE ... SAMPLES 0):");
    println!("  one member per request (this crate): {members} members, {events} bytes");
    println!(
        "  one member per unit (plain ZADD, for comparison): {unit_members} members, {units} bytes"
    );
    println!("  ratio: {:.0}x", units as f64 / events as f64);
    Ok(())
}

/// `--cold N`, if given.
fn cold_keys(mut args: impl Iterator<Item = String>) -> Result<Option<usize>, Error> {
    match (args.next().as_deref(), args.next()) {
        (None, _) => Ok(None),
        (Some("--cold"), Some(n)) => match n.parse() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!("--cold takes a number of keys above 0, not {n:?}").into()),
        },
        _ => Err("the only flag is --cold N; see the example's doc".into()),
    }
}

/// What `keys` cold keys cost Redis, per algorithm, with and without leases.
async fn measure_cold(url: &str, keys: usize) -> Result<(), Error> {
    let redis = Builder::from_config(Config::from_url(url)?).build()?;
    redis.init().await?;
    println!("{keys} cold keys, each decided once (INFO memory used_memory, MEMORY USAGE)\n");
    println!("| algorithm | leases | DBSIZE (with 32 warm-up keys) | used_memory Δ / key | MEMORY USAGE of one key | after expiry (1s window): DBSIZE | used_memory Δ |");
    println!("|---|---|---|---|---|---|---|");
    for (algorithm, name) in ALGORITHMS {
        for leases in [false, true] {
            let mut store = RedisStore::builder(url);
            if leases {
                store = store.leases(Leases::new());
            }
            let store = store.connect().await?;
            let live = cold_fill(&redis, &store, keys, algorithm, "1000/1m").await?;
            cold_fill(&redis, &store, keys, algorithm, "1000/1s").await?;
            let wait =
                2 * (Duration::from_secs(1) + Leases::DEFAULT_PERIOD) + Duration::from_secs(1);
            tokio::time::sleep(wait).await;
            let left: u64 = redis.dbsize().await?;
            let after = used_memory(&redis).await?;
            let _: () = redis.flushall(false).await?;
            redis.memory_purge().await?;
            let after = after as i64 - used_memory(&redis).await? as i64;
            println!(
                "| {name} | {} | {} | {:.0} B | {} B | {left} | {after:+} B |",
                if leases { "yes" } else { "no" },
                live.dbsize,
                live.growth as f64 / keys as f64,
                live.one_key,
            );
        }
    }
    Ok(())
}

/// What Redis held after `keys` distinct keys were decided once each under `limit`.
struct Filled {
    /// `used_memory` after the keys, less before them.
    growth: i64,
    dbsize: u64,
    /// `MEMORY USAGE ... SAMPLES 0` of the first key.
    one_key: u64,
}

/// Empties Redis, warms it up, then decides `keys` distinct keys once each under `limit`.
async fn cold_fill(
    redis: &Client,
    store: &RedisStore,
    keys: usize,
    algorithm: Algorithm,
    limit: &str,
) -> Result<Filled, Error> {
    let policy = Policy::new("cold", [limit.parse::<Limit>()?])?.with_algorithm(algorithm);
    let _: () = redis.flushall(false).await?;
    redis.memory_purge().await?;
    decide_each(store, &policy, "warm-", COLD_TASKS).await?;
    let before = used_memory(redis).await?;
    decide_each(store, &policy, "198.51.", keys).await?;
    let growth = used_memory(redis).await? as i64 - before as i64;
    let one = redis_key(store, &Key::from("198.51.0"), &policy);
    Ok(Filled {
        growth,
        dbsize: redis.dbsize().await?,
        one_key: redis.memory_usage(one, Some(0)).await?,
    })
}

/// Decides keys `<prefix>0` to `<prefix><keys - 1>` once each, by `COLD_TASKS` tasks at once
/// (so that the store batches their calls).
async fn decide_each(
    store: &RedisStore,
    policy: &Policy,
    prefix: &str,
    keys: usize,
) -> Result<(), Error> {
    let mut tasks = JoinSet::new();
    for first in 0..COLD_TASKS {
        let (store, policy, prefix) = (store.clone(), policy.clone(), prefix.to_owned());
        tasks.spawn(async move {
            for n in (first..keys).step_by(COLD_TASKS) {
                let key = Key::from(format!("{prefix}{n}"));
                assert!(store.check(&key, &policy, 1).await?.is_allowed());
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(task) = tasks.join_next().await {
        task??;
    }
    Ok(())
}

/// `used_memory` from `INFO memory`.
async fn used_memory(redis: &Client) -> Result<u64, Error> {
    let info: String = redis.info(Some(InfoKind::Memory)).await?;
    let used = info
        .lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|bytes| bytes.trim().parse().ok());
    used.ok_or_else(|| "INFO memory has no used_memory".into())
}

fn start_redis() -> Result<(String, Child), Error> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .stdout(Stdio::null())
        .spawn()?;
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok((format!("redis://127.0.0.1:{port}"), child));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err("redis-server did not start".into())
}
