//! Redis memory per key for each algorithm, at limits 100 and 10 000: the key is filled to its
//! limit (the most state it ever holds) and measured with `MEMORY USAGE key SAMPLES 0`.
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
    let redis = store.pool().next();
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
            let decision = store.check(&key, &policy, count).await?;
            assert!(decision.is_allowed() && decision.remaining() == 0);
            let bytes: u64 = redis
                .memory_usage(store.redis_key(&key, &policy), Some(0))
                .await?;
            row.push_str(&format!(" {bytes} |"));
        }
        println!("{row}");
    }
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
