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
//! Uses `REDIS_URL` if set; otherwise starts its own `redis-server` on a free loopback port.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fred::prelude::*;
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{Algorithm, Key, Limit, Policy, RedisStore, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

const ALGORITHMS: [(Algorithm, &str); 4] = [
    (Algorithm::SlidingLog, "sliding log"),
    (Algorithm::SlidingWindow, "sliding window counter"),
    (Algorithm::FixedWindow, "fixed window"),
    (Algorithm::Gcra, "GCRA"),
];

#[tokio::main]
async fn main() -> Result<(), Error> {
    let (url, mut server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let (url, child) = start_redis()?;
            (url, Some(child))
        }
    };
    let result = measure(&url).await;
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
