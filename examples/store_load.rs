//! Decisions per second of the Redis store alone, beside `tower-rate-limit-fred`'s GCRA script
//! on the same Redis: no HTTP, so what remains is each limiter's own client work and Redis work.
//!
//! ```text
//! redis-server --port 7399 --save "" &
//! REDIS_URL=redis://127.0.0.1:7399 cargo run --release --example store_load -- gcra
//! ```
//!
//! The argument picks the limiter: `gcra` or `log` (this crate's `RedisStore`, batching on),
//! `gcra_unbatched` (`max_batch(1)`), `peer` (`tower_rate_limit_fred::rate_limit`). 32 tasks on
//! two worker threads decide for 4 s over 1000 keys, at limits nothing reaches; the output is
//! decisions per second, CPU time per decision of this process (`/proc/self/stat`) and of
//! Redis (`INFO cpu`), and heap allocations per decision in this process (every thread, fred's
//! tasks included; the harness's own `format!` of the key is one of them, for every limiter).
//! Point `REDIS_URL` at a scratch Redis: the keys it writes stay until they expire.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::prelude::*;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

const TASKS: usize = 32;
const KEYS: usize = 1000;
const RUN: Duration = Duration::from_secs(4);

type Error = Box<dyn std::error::Error + Send + Sync>;

#[global_allocator]
static GLOBAL: support::CountingAllocator = support::CountingAllocator;

/// The limiter under test.
#[derive(Clone)]
enum Limiter {
    Ours(RedisStore, Policy),
    Peer(Pool),
}

impl Limiter {
    async fn decide(&self, key: String) -> Result<(), Error> {
        match self {
            Limiter::Ours(store, policy) => {
                store.check(&Key::from(key), policy, 1).await?;
            }
            Limiter::Peer(pool) => {
                let interval = Duration::from_millis(1);
                tower_rate_limit_fred::rate_limit(pool, key, u16::MAX, interval).await?;
            }
        }
        Ok(())
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL to a scratch Redis")?;
    let which = std::env::args().nth(1).unwrap_or_else(|| "gcra".into());
    let limiter = limiter(&url, &which).await?;
    let admin = Client::new(Config::from_url(&url)?, None, None, None);
    admin.init().await?;

    let decided = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (cpu_before, redis_before) = (process_cpu(), redis_cpu(&admin).await?);
    let (allocations_before, bytes_before) = support::CountingAllocator::totals();
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (limiter, decided, stop) = (limiter.clone(), decided.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    i = (i + 7) % KEYS;
                    limiter.decide(format!("c{i}")).await?;
                    decided.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, Error>(())
            })
        })
        .collect();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let (allocations_after, bytes_after) = support::CountingAllocator::totals();
    let (allocations, bytes) = (
        allocations_after - allocations_before,
        bytes_after - bytes_before,
    );
    let n = decided.load(Ordering::Relaxed) as f64;
    let app = process_cpu() - cpu_before;
    let redis = redis_cpu(&admin).await? - redis_before;
    println!(
        "{which}: {:.0} decisions/s, CPU per decision {:.1} µs here and {:.1} µs in Redis, \
         {:.1} allocations ({:.0} bytes) per decision here",
        n / seconds,
        app / n * 1e6,
        redis / n * 1e6,
        allocations as f64 / n,
        bytes as f64 / n
    );
    Ok(())
}

async fn limiter(url: &str, which: &str) -> Result<Limiter, Error> {
    let policy = |algorithm| {
        "1000000/1s"
            .parse::<Policy>()
            .map(|p| p.with_algorithm(algorithm))
    };
    Ok(match which {
        "gcra" => Limiter::Ours(RedisStore::connect(url).await?, policy(Algorithm::Gcra)?),
        "log" => Limiter::Ours(
            RedisStore::connect(url).await?,
            policy(Algorithm::SlidingLog)?,
        ),
        "gcra_unbatched" => {
            let store = RedisStore::builder(url).max_batch(1).connect().await?;
            Limiter::Ours(store, policy(Algorithm::Gcra)?)
        }
        "peer" => {
            // The same pool size as RedisStore's default.
            let pool = fred::types::Builder::from_config(Config::from_url(url)?).build_pool(4)?;
            pool.init().await?;
            Limiter::Peer(pool)
        }
        other => return Err(format!("no limiter named {other:?}").into()),
    })
}

async fn redis_cpu(admin: &Client) -> Result<f64, Error> {
    let info: String = admin.info(Some(fred::types::InfoKind::Cpu)).await?;
    Ok(support::redis_cpu_seconds(&info))
}

/// This process's CPU seconds (0 where `/proc` is missing).
fn process_cpu() -> f64 {
    support::process_cpu_seconds().unwrap_or(0.0)
}
