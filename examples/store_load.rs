//! Decisions per second of the Redis store alone, beside `tower-rate-limit-fred`'s GCRA script
//! on the same Redis: no HTTP, so what remains is each limiter's own client work and Redis work.
//!
//! ```text
//! cargo run --release --example store_load -- gcra
//! cargo run --release --example store_load -- gcra --cluster 3
//! cargo run --release --example store_load -- gcra --overrides 1000
//! cargo run --release --example store_load -- gcra --distribution cold
//! ```
//!
//! It starts its own `redis-server` on a free loopback port (`$REDIS_SERVER` or
//! `redis-server` from `PATH`), or with `--cluster N` a Redis Cluster of `N` primaries, and
//! stops it on exit; with `REDIS_URL` set it uses that Redis instead (`redis-cluster://` for a
//! cluster) and sends it `FLUSHALL` first, so point it only at a scratch Redis. Redis readings
//! (CPU, `EVALSHA` calls) are summed over every primary.
//!
//! The argument picks the limiter: `gcra` or `log` (this crate's `RedisStore`, batching on),
//! `gcra_unbatched` (`max_batch(1)`), `peer` (`tower_rate_limit_fred::rate_limit`). 32 tasks on
//! two worker threads decide for 4 s over 1000 keys round-robin (task `t` sends keys `t`,
//! `t + 32`, ...), at limits nothing reaches; the output is
//! decisions per second, CPU time per decision of this process (`/proc/self/stat`) and of
//! Redis (`INFO cpu`), and heap allocations per decision in this process (every thread, fred's
//! tasks included; the harness's own `format!` of the key is one of them, for every limiter).
//! With `--overrides N`, the first `N` keys each have an override of their own (a count as
//! far out of reach), which every decision of theirs goes by. Each key is decided once before
//! the measurement starts (stderr says when), so that it measures the steady state.
//!
//! `--distribution hot|cold|zipf[:S]` and `--keys N|auto` spread the decisions as `http_load`'s
//! flags of the same names do (`examples/support/keys.rs`): `hot`, 100 keys round-robin;
//! `cold`, round-robin over ten times the throughput of a 1 s warm-up on keys of its own
//! (`w<n>`), rounded up to a power of ten, so that each key sees at most 0.1 decision a second
//! and every decision measured is its key's first (no key is decided before); `zipf`, 100 000
//! keys drawn by Zipf's law with exponent `S` (default 1.1), each task with its own seeded
//! generator. The output then names the distribution, the keys and the busiest key's rate.
//!
//! With `STORE_LOAD_DECISIONS=n` the measured phase makes exactly `n` decisions instead of
//! running 4 s, for counting this process's instructions: the difference between two counts
//! (`valgrind --tool=callgrind`, which does not follow the `redis-server` it starts), over the
//! difference of their `n`, is the app side's instructions per decision:
//!
//! ```text
//! for n in 20000 60000; do
//!   STORE_LOAD_DECISIONS=$n valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/store_load gcra --distribution cold
//! done
//! ```

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::prelude::*;
use support::keys::{Distribution, KeyCount, Spread, AUTO_WARMUP_KEYS};
use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

const TASKS: usize = 32;
const RUN: Duration = Duration::from_secs(4);
/// The warm-up whose throughput sizes `--keys auto`.
const WARMUP: Duration = Duration::from_secs(1);

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
    let Flags {
        which,
        primaries,
        overrides,
        distribution,
        keys,
    } = Flags::parse(std::env::args().skip(1))?;
    // Our own Redis (or cluster) unless `REDIS_URL` names one; stopped when this returns.
    let scratch = match std::env::var("REDIS_URL") {
        Ok(_) => None,
        Err(_) => Some(support::redis::Scratch::start(primaries)?),
    };
    let url = match &scratch {
        Some(scratch) => scratch.url(),
        None => std::env::var("REDIS_URL")?,
    };
    let admin = support::redis::Admin::connect(&url).await?;
    admin.flush().await?;
    let limiter = limiter(&url, &which).await?;
    let keys = key_set(&limiter, distribution, keys).await?;
    if let Limiter::Ours(store, policy) = &limiter {
        let far = Override::Limits(vec!["2000000/1s".parse()?]);
        for i in 0..overrides.min(keys.count) {
            let key = Scope::Key(Key::from(format!("c{i}")));
            // A write whose reply came late may have landed: setting it again is safe.
            let mut tries = 0;
            while let Err(error) = store.overrides().set(policy, &key, &far).await {
                tries += 1;
                if tries == 5 {
                    return Err(error.into());
                }
            }
        }
    }

    // Every key decided once before the clock starts, so that what follows is the steady
    // state (the store learns each key's override fields at its first decision); cold keys
    // are not, every decision of theirs being their first.
    if distribution != Distribution::Cold {
        decide_each(&limiter, &keys).await?;
    }
    eprintln!("warmed up: measuring");
    let (cpu_before, redis_before) = (process_cpu(), redis_cpu(&admin).await?);
    let evals_before = evalsha_calls(&admin).await?;
    let (allocations_before, bytes_before) = support::CountingAllocator::totals();
    let started = Instant::now();
    let length = match std::env::var("STORE_LOAD_DECISIONS") {
        Ok(n) => Length::Decisions(n.parse().map_err(|_| "STORE_LOAD_DECISIONS=<n>")?),
        Err(_) => Length::For(RUN),
    };
    let (_, n) = decide_for(&limiter, ("c", &keys), length).await?;
    let seconds = started.elapsed().as_secs_f64();
    let (allocations_after, bytes_after) = support::CountingAllocator::totals();
    let (allocations, bytes) = (
        allocations_after - allocations_before,
        bytes_after - bytes_before,
    );
    let n = n as f64;
    let app = process_cpu() - cpu_before;
    let redis = redis_cpu(&admin).await? - redis_before;
    let evals = (evalsha_calls(&admin).await? - evals_before) as f64;
    let mut which = match overrides {
        0 => which,
        n => format!("{which} with {n} overrides"),
    };
    if distribution != Distribution::Uniform {
        which = format!(
            "{which}, {} over {} keys (busiest {:.3} decisions/s)",
            distribution.suffix().trim_start_matches('/'),
            keys.count,
            n / seconds * keys.top_share()
        );
    }
    println!(
        "{which}: {:.0} decisions/s, CPU per decision {:.1} µs here and {:.1} µs in Redis \
         ({} server(s)), {:.3} EVALSHA per decision, {:.1} allocations ({:.0} bytes) per \
         decision here",
        n / seconds,
        app / n * 1e6,
        redis / n * 1e6,
        admin.servers(),
        evals / n,
        allocations as f64 / n,
        bytes as f64 / n
    );
    Ok(())
}

/// The command line: the limiter, then its flags.
struct Flags {
    which: String,
    primaries: usize,
    overrides: usize,
    distribution: Distribution,
    keys: Option<KeyCount>,
}

impl Flags {
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Flags, Error> {
        let mut flags = Flags {
            which: args.next().unwrap_or_else(|| "gcra".into()),
            primaries: 0,
            overrides: 0,
            distribution: Distribution::Uniform,
            keys: None,
        };
        while let Some(flag) = args.next() {
            let value = args.next().ok_or(format!("{flag} takes a value"))?;
            let number = || value.parse::<usize>().map_err(|_| format!("{flag} N"));
            match flag.as_str() {
                "--cluster" => flags.primaries = number()?,
                "--overrides" => flags.overrides = number()?,
                "--distribution" => flags.distribution = Distribution::parse(&value)?,
                "--keys" => flags.keys = Some(KeyCount::parse(&value)?),
                other => return Err(format!("unknown argument {other:?}").into()),
            }
        }
        Ok(flags)
    }
}

/// The keys of the measurement: `--keys` or the distribution's default, where `auto` is sized
/// by a warm-up of `limiter` on keys of its own.
async fn key_set(
    limiter: &Limiter,
    distribution: Distribution,
    keys: Option<KeyCount>,
) -> Result<Spread, Error> {
    let count = match keys.unwrap_or(distribution.default_keys()) {
        KeyCount::Fixed(n) => n,
        KeyCount::Auto => {
            let warmup = Spread::new(AUTO_WARMUP_KEYS, Distribution::Uniform);
            let length = Length::For(WARMUP);
            KeyCount::auto(decide_for(limiter, ("w", &warmup), length).await?.0)
        }
    };
    Ok(Spread::new(count, distribution))
}

/// How long a load runs.
#[derive(Clone, Copy)]
enum Length {
    For(Duration),
    /// Exactly this many decisions, however long they take (`STORE_LOAD_DECISIONS`).
    Decisions(u64),
}

/// Decides by `TASKS` tasks for `length`, each picking keys `<prefix><n>` as
/// [`Spread::picker`] says; answers the decisions per second and the decisions made.
async fn decide_for(
    limiter: &Limiter,
    (prefix, keys): (&str, &Spread),
    length: Length,
) -> Result<(f64, u64), Error> {
    let decided = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS as u64)
        .map(|t| {
            let (limiter, decided, stop) = (limiter.clone(), decided.clone(), stop.clone());
            let (mut picker, count) = (keys.picker(t as usize, TASKS), keys.count);
            let prefix = prefix.to_owned();
            // The task's share of a fixed number of decisions.
            let quota = match length {
                Length::For(_) => u64::MAX,
                Length::Decisions(n) => n / TASKS as u64 + u64::from(t < n % TASKS as u64),
            };
            tokio::spawn(async move {
                for _ in 0..quota {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let key = format!("{prefix}{}", picker.next(count));
                    limiter.decide(key).await?;
                    decided.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, Error>(())
            })
        })
        .collect();
    if let Length::For(run) = length {
        tokio::time::sleep(run).await;
        stop.store(true, Ordering::Relaxed);
    }
    for task in tasks {
        task.await??;
    }
    let n = decided.load(Ordering::Relaxed);
    Ok((n as f64 / started.elapsed().as_secs_f64(), n))
}

/// Decides every key `c<n>` of `keys` once, by `TASKS` tasks.
async fn decide_each(limiter: &Limiter, keys: &Spread) -> Result<(), Error> {
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (limiter, count) = (limiter.clone(), keys.count);
            tokio::spawn(async move {
                for n in (t..count).step_by(TASKS) {
                    limiter.decide(format!("c{n}")).await?;
                }
                Ok::<_, Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
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

/// Redis's CPU seconds, summed over every primary of a cluster.
async fn redis_cpu(admin: &support::redis::Admin) -> Result<f64, Error> {
    let infos = admin.info(fred::types::InfoKind::Cpu).await?;
    Ok(infos
        .iter()
        .map(|info| support::redis_cpu_seconds(info))
        .sum())
}

/// `EVAL` and `EVALSHA` calls so far, summed over every primary of a cluster.
async fn evalsha_calls(admin: &support::redis::Admin) -> Result<u64, Error> {
    let infos = admin.info(fred::types::InfoKind::CommandStats).await?;
    let calls = infos
        .iter()
        .flat_map(|info| info.lines())
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("cmdstat_evalsha:calls=")
                .or_else(|| line.strip_prefix("cmdstat_eval:calls="))?;
            rest.split(',').next()?.parse::<u64>().ok()
        });
    Ok(calls.sum())
}

/// This process's CPU seconds (0 where `/proc` is missing).
fn process_cpu() -> f64 {
    support::process_cpu_seconds().unwrap_or(0.0)
}
