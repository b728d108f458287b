//! What a rate limiter costs an HTTP service: the same axum hello-world route, bare and behind
//! each limiter, under the same keep-alive load, all in one run.
//!
//! ```text
//! cargo run --release --example http_load -- --duration 5 --rounds 3
//! ```
//!
//! Configurations (`--only` takes a comma-separated list of these names):
//!
//! | name | limiter |
//! |---|---|
//! | `bare` | none |
//! | `memory` | this crate, the default `MemoryStore` (sliding log), `1000000/1s` per key |
//! | `memory_gcra` | the same with GCRA and no rate-limit headers on admitted answers, which is what `tower_governor` does |
//! | `tower_governor` | `tower_governor`, 1 000 000 per second per key |
//! | `redis_log` | this crate, `RedisStore`, sliding log, `100000/1s` per key |
//! | `redis_log_lean` | the same without rate-limit headers on admitted answers, which is what `tower-rate-limit-fred` does |
//! | `redis_gcra` | this crate, `RedisStore`, GCRA, `1000000/1s` per key |
//! | `redis_gcra_lean` | the same without rate-limit headers on admitted answers |
//! | `redis_gcra_overrides` | `redis_gcra_lean` with 1 000 overrides in Redis, one per key of the load (`2000000/1s`): every decision goes by its key's override (the store sends it once it has read it; the script reads the hash's generation) |
//! | `redis_gcra_concurrency` | `redis_gcra_lean` with a concurrency limit of 1 000 per key (`Policy::concurrency`), far above the load's concurrency: each request takes a slot in its decision's script call and gives it back when its response ends |
//! | `redis_gcra_lease` | `redis_gcra_lean` with leases (`RedisStoreBuilder::leases`, the defaults), `60000000/1m` per key: the same rate over a minute, so that GCRA's headroom allows a full lease period |
//! | `redis_fw_lease` | the same with the fixed window counter |
//! | `redis_log_lease` | `redis_log` with leases (the defaults) and `60000000/1m` per key, rate-limit headers on admitted answers as `memory`: the exact sliding log, shared through Redis, decided in process |
//! | `fred_peer` | `tower-rate-limit-fred` (GCRA in Redis), capacity 65 535, 1 per ms |
//! | `flood_nocache` | this crate, `RedisStore`, every request on one key already over `1/1h`, no deny cache |
//! | `flood_cache` | the same flood with the default deny cache |
//! | `instant_store` | this crate, GCRA, with a store that answers at once from a task of its own: the cost of waiting for any store elsewhere, without the store's work; the ceiling of the Redis configurations |
//! | `upload_cost` | this crate, the default `MemoryStore`, `1000000000000/1h` per key, each request costing its `Content-Length` (1 without one), decided once before the body is read |
//! | `upload_metered` | the same limit over the bytes of request bodies (`request_bytes(RequestBytes::new())`): a declared length is reserved whole, a chunked body is decided 64 KiB at a time as it streams |
//!
//! The two upload rows run only when `--only` names them.
//!
//! Every request carries `x-client: c<n>`, `n` cycling over `--keys` values (one key for the
//! floods), and every limit is high enough that no request of the other configurations is
//! refused; the run counts the answers other than 200 to show it. Each worker of the load
//! keeps one HTTP/1.1 connection and sends its next request when the previous one is answered.
//! Requests are `GET /`, or with `--upload BYTES` a `POST /` of that many bytes, sent with a
//! `Content-Length` or, with `--chunked`, chunked; the route answers a `POST` with the length
//! of its body, read frame by frame. Compare the two upload configurations with, e.g.:
//!
//! ```text
//! cargo run --release --example http_load -- --only upload_cost,upload_metered --upload 1048576 --chunked
//! ```
//!
//! The harness starts its own `redis-server` (`$REDIS_SERVER` or `redis-server` from `PATH`)
//! on a free loopback port and stops it on exit, unless `REDIS_URL` is set; it sends `FLUSHALL`
//! before each configuration (to every primary of a cluster), so point `REDIS_URL` only at a
//! scratch Redis. Redis commands per request come from `INFO commandstats` (summed over every
//! primary of a cluster) read before and after the measured phase (the `INFO` calls themselves left out). Redis counts the
//! commands a Lua script runs as well as the `EVALSHA` that runs it, so `cmds/req` is
//! the work Redis does and `evals/req` the round trips (every store here only sends scripts).
//! `cpu app` and `cpu redis` are the cores this process and Redis kept busy, `cpu µs/req` the
//! CPU time both spent per request (on a machine it keeps fully busy, a configuration's
//! throughput is inversely proportional to it), `redis µs/req` Redis's part of it; `allocs/req` the
//! heap allocations of this process (server, load and limiter) per request, counted by a
//! global allocator that each thread counts in separately.
//!
//! `--distribution hot,cold,zipf[:S]` (any of them, comma-separated) runs every configuration on
//! each key distribution, named by the rate a key sees (`examples/support/keys.rs`, which
//! `store_load` shares), and names its rows `config/hot`, ...:
//!
//! - `hot`: round-robin over `--keys` (default 100), few enough that each key sees at least 10
//!   requests per lease period (1 s, the default); the table shows the busiest key's requests
//!   per lease period and marks a hot row under 10 "not hot";
//! - `cold`: round-robin over `--keys` (default `auto`: ten times the configuration's warm-up
//!   throughput, rounded up to a power of ten, so that each key sees at most 0.1 request per
//!   second; the warm-up runs on keys of its own, `w<n>`, which the measured phase never sends);
//! - `zipf` (`zipf:S` for an exponent other than 1.1): over `--keys` (default 100 000), key `n`
//!   (from 1) drawn with a probability proportional to `n^-S`, each worker with a random
//!   generator of its own, seeded by its index, so every run draws the same keys.
//!
//! Without `--distribution`, keys go round-robin over `--keys` (default 1000) as above. The
//! table shows each row's key count, the busiest key's rate, and the share of requests whose
//! key saw at least 10 per lease period (where a lease would serve several requests).
//!
//! ```text
//! cargo run --release --example http_load -- --only bare,memory,redis_gcra_lean,redis_gcra_lease,fred_peer --distribution hot,cold,zipf
//! ```
//!
//! Configurations run interleaved (round 1 runs each once, then round 2, ...); the table shows
//! each one's median over rounds, and its throughput ratios to the bare route and to its rival
//! of the same round and distribution (medians of the per-round ratios; the rival is `tower_governor` for the
//! memory store and `fred_peer` for the Redis store, the comparisons the performance targets
//! name, and `upload_cost` for `upload_metered`).
//!
//! Flags: `--duration SECS` (measured time per configuration and round, default 5),
//! `--warmup SECS` (default 1), `--concurrency N` (default 32), `--keys N|auto` (above),
//! `--distribution` (above),
//! `--rounds R` (default 3), `--pool N` (Redis connections of each Redis limiter, default 4),
//! `--cluster N` (start a Redis Cluster of `N` primaries instead of one server; `REDIS_URL` may
//! also name one, `redis-cluster://...`), `--cluster-tags N` and `--in-flight N` (this crate's
//! `RedisStoreBuilder::cluster_tags` and `max_in_flight`), `--redis-nice N` (run the scratch
//! Redis at niceness `N`, e.g. -10, with `renice`, which needs the right to raise a priority:
//! where the load, the app and Redis share a few cores, the app's threads otherwise preempt
//! Redis in the middle of its calls, and every request of those calls waits, as it would not
//! for a Redis on cores of its own; configurations that give Redis more work per request lose
//! more to it), `--upload BYTES` and `--chunked` (above), `--out DIR` (default
//! `target/http_load`), `--only a,b`.
//!
//! Writes `DIR/results.csv` (one row per configuration and round), `DIR/summary.csv` (the
//! medians) and `DIR/throughput.svg` (throughput relative to bare, and p99 latency).

mod support;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use fred::clients::Pool;
use fred::prelude::{ClientLike, Config as FredConfig};
use fred::types::{Builder as FredBuilder, InfoKind};
use governor::middleware::NoOpMiddleware;
use hdrhistogram::Histogram;
use http::header::{HOST, TRANSFER_ENCODING};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use support::keys::{Distribution, KeyCount, AUTO_WARMUP_KEYS, HOT_PER_PERIOD, LEASE_PERIOD};
use support::redis::{Admin, Scratch};
use support::{process_cpu_seconds, redis_cpu_seconds, CountingAllocator};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;
use tower_governor::{GovernorError, GovernorLayer};
use tower_rate_limit_fred::KeyResolver;
use tower_redis_ratelimit::metered::RequestBytes;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::test_util::FaultyStore;
use tower_redis_ratelimit::{
    Algorithm, Header, Key, MemoryStore, Policy, RateLimitLayer, RedisStore, RequestHead,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The keys of a load, as header values.
type KeySet = support::keys::KeySet<HeaderValue>;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// The header every request is keyed by.
const CLIENT_HEADER: &str = "x-client";
/// High enough that no key of the load is ever refused.
const HIGH_LIMIT: &str = "1000000/1s";
/// The sliding log keeps one entry per admitted request: a short window bounds its memory.
const LOG_LIMIT: &str = "100000/1s";
/// The rate of `HIGH_LIMIT` over a minute, for the leasing configurations: a leasing store keeps
/// GCRA's lease period (1 s) free in every bucket, which a one-second window could not spare.
const LEASE_LIMIT: &str = "60000000/1m";
/// The flood's key is over this limit after its first request.
const FLOOD_LIMIT: &str = "1/1h";
/// The one key of the floods.
const FLOOD_KEY: &str = "flood";
/// A terabyte an hour per key: bytes no upload of the load comes near.
const UPLOAD_LIMIT: &str = "1000000000000/1h";

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args = Args::parse(std::env::args().skip(1))?;
    tokio::select! {
        result = run(args) => result,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    }
}

/// Runs every round, then reports; a `redis-server` started here stops when this returns.
async fn run(args: Args) -> Result<(), Error> {
    let redis = match args.only.iter().any(|s| s.uses_redis()) {
        true => Some(RedisBackend::start(&args).await?),
        false => None,
    };
    println!("{}", args.describe(redis.as_ref()));
    let mut results = Vec::new();
    for round in 1..=args.rounds {
        for &distribution in &args.distributions {
            let mut this_round = Vec::new();
            for &scenario in &args.only {
                let run = (scenario, distribution, round);
                let measurement = measure(run, &args, redis.as_ref()).await?;
                eprintln!("{}", measurement.progress_line());
                this_round.push(measurement);
            }
            // Ratios within one distribution and round.
            set_ratios(&mut this_round);
            results.extend(this_round);
        }
    }
    let summaries: Vec<Summary> = args
        .distributions
        .iter()
        .flat_map(|&d| args.only.iter().map(move |&s| (s, d)))
        .map(|(s, d)| Summary::of(s, d, &results))
        .collect();
    println!("\n{}", table(&summaries));
    write_outputs(&args.out, &results, &summaries)
}

// ---------------------------------------------------------------------------------------------
// Flags

struct Args {
    duration: Duration,
    warmup: Duration,
    concurrency: usize,
    /// `--keys`, or `None` for each distribution's own default.
    keys: Option<KeyCount>,
    /// `--distribution`: each configuration runs on each of these, in each round.
    distributions: Vec<Distribution>,
    rounds: usize,
    pool: usize,
    /// Primaries of the scratch Redis Cluster; 0 for a single server.
    cluster: usize,
    /// `RedisStoreBuilder::cluster_tags` of this crate's stores.
    cluster_tags: usize,
    /// `RedisStoreBuilder::max_in_flight` of this crate's stores, if set.
    in_flight: Option<usize>,
    /// The niceness of the scratch Redis's processes, if set.
    redis_nice: Option<i32>,
    /// The body of every request, if they are uploads.
    upload: Option<Upload>,
    out: PathBuf,
    only: Vec<Scenario>,
}

impl Args {
    fn parse(mut flags: impl Iterator<Item = String>) -> Result<Args, Error> {
        let mut args = Args {
            duration: Duration::from_secs(5),
            warmup: Duration::from_secs(1),
            concurrency: 32,
            keys: None,
            distributions: vec![Distribution::Uniform],
            rounds: 3,
            pool: 4,
            cluster: 0,
            cluster_tags: RedisStore::DEFAULT_CLUSTER_TAGS,
            in_flight: None,
            redis_nice: None,
            upload: None,
            out: PathBuf::from("target/http_load"),
            // The upload rows are named with `--only`: the default run keeps its GET rows.
            only: Scenario::ALL
                .into_iter()
                .filter(|s| !s.is_upload())
                .collect(),
        };
        let (mut upload, mut chunked) = (None, false);
        while let Some(flag) = flags.next() {
            let mut value = || flags.next().ok_or(format!("{flag} needs a value"));
            match flag.as_str() {
                "--duration" => args.duration = seconds(&value()?)?,
                "--warmup" => args.warmup = seconds(&value()?)?,
                "--concurrency" => args.concurrency = positive(&flag, &value()?)?,
                "--keys" => args.keys = Some(KeyCount::parse(&value()?)?),
                "--distribution" => args.distributions = Distribution::parse_list(&value()?)?,
                "--rounds" => args.rounds = positive(&flag, &value()?)?,
                "--pool" => args.pool = positive(&flag, &value()?)?,
                "--cluster" => args.cluster = positive(&flag, &value()?)?,
                "--cluster-tags" => args.cluster_tags = positive(&flag, &value()?)?,
                "--in-flight" => args.in_flight = Some(positive(&flag, &value()?)?),
                "--redis-nice" => {
                    let nice = value()?;
                    let nice = nice.parse().map_err(|_| format!("--redis-nice {nice:?}"))?;
                    args.redis_nice = Some(nice);
                }
                "--upload" => upload = Some(positive(&flag, &value()?)?),
                "--chunked" => chunked = true,
                "--out" => args.out = PathBuf::from(value()?),
                "--only" => {
                    args.only = value()?
                        .split(',')
                        .map(str::parse)
                        .collect::<Result<_, _>>()?
                }
                other => {
                    return Err(format!("unknown flag {other:?}; see the example's doc").into())
                }
            }
        }
        args.upload = match (upload, chunked) {
            (Some(bytes), _) => Some(Upload {
                body: Bytes::from(vec![b'x'; bytes]),
                chunked,
            }),
            (None, true) => return Err("--chunked needs --upload".into()),
            (None, false) => None,
        };
        Ok(args)
    }

    fn describe(&self, redis: Option<&RedisBackend>) -> String {
        let redis = redis.map_or("no Redis".to_owned(), |r| {
            let servers = r.admin.servers();
            let nice = match self.redis_nice {
                Some(nice) => format!(", niceness {nice}"),
                None => String::new(),
            };
            format!(
                "Redis at {} ({servers} primaries, pool {} each{nice})",
                r.url, self.pool
            )
        });
        let requests = match &self.upload {
            Some(upload) => format!(
                "POST of {} bytes ({})",
                upload.body.len(),
                match upload.chunked {
                    true => "chunked",
                    false => "Content-Length",
                }
            ),
            None => "GET".to_owned(),
        };
        let keys: Vec<String> = self
            .distributions
            .iter()
            .map(|&d| d.describe(self.keys_of(d)))
            .collect();
        format!(
            "{} workers, {}, {requests}, {} round(s) of {:.1} s per configuration after {:.1} s of warm-up; {redis}",
            self.concurrency,
            keys.join("; "),
            self.rounds,
            self.duration.as_secs_f64(),
            self.warmup.as_secs_f64(),
        )
    }
}

impl Args {
    /// How many keys a load of `distribution` spreads over: `--keys`, or its default.
    fn keys_of(&self, distribution: Distribution) -> KeyCount {
        self.keys.unwrap_or(distribution.default_keys())
    }
}

fn seconds(text: &str) -> Result<Duration, Error> {
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{text:?} is not seconds").into())
}

fn positive(flag: &str, text: &str) -> Result<usize, Error> {
    match text.parse() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{flag} takes a whole number above 0, not {text:?}").into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Configurations

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Bare,
    Memory,
    MemoryGcra,
    TowerGovernor,
    RedisLog,
    RedisLogLean,
    RedisGcra,
    RedisGcraLean,
    RedisGcraOverrides,
    RedisGcraConcurrency,
    RedisGcraLease,
    RedisFwLease,
    RedisLogLease,
    FredPeer,
    FloodNocache,
    FloodCache,
    InstantStore,
    UploadCost,
    UploadMetered,
}

impl Scenario {
    const ALL: [Scenario; 19] = [
        Scenario::Bare,
        Scenario::Memory,
        Scenario::MemoryGcra,
        Scenario::TowerGovernor,
        Scenario::InstantStore,
        Scenario::UploadCost,
        Scenario::UploadMetered,
        Scenario::RedisLog,
        Scenario::RedisLogLean,
        Scenario::RedisGcra,
        Scenario::RedisGcraLean,
        Scenario::RedisGcraOverrides,
        Scenario::RedisGcraConcurrency,
        Scenario::RedisGcraLease,
        Scenario::RedisFwLease,
        Scenario::RedisLogLease,
        Scenario::FredPeer,
        Scenario::FloodNocache,
        Scenario::FloodCache,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::Bare => "bare",
            Scenario::Memory => "memory",
            Scenario::MemoryGcra => "memory_gcra",
            Scenario::TowerGovernor => "tower_governor",
            Scenario::RedisLog => "redis_log",
            Scenario::RedisLogLean => "redis_log_lean",
            Scenario::RedisGcra => "redis_gcra",
            Scenario::RedisGcraLean => "redis_gcra_lean",
            Scenario::RedisGcraOverrides => "redis_gcra_overrides",
            Scenario::RedisGcraConcurrency => "redis_gcra_concurrency",
            Scenario::RedisGcraLease => "redis_gcra_lease",
            Scenario::RedisFwLease => "redis_fw_lease",
            Scenario::RedisLogLease => "redis_log_lease",
            Scenario::FredPeer => "fred_peer",
            Scenario::FloodNocache => "flood_nocache",
            Scenario::FloodCache => "flood_cache",
            Scenario::InstantStore => "instant_store",
            Scenario::UploadCost => "upload_cost",
            Scenario::UploadMetered => "upload_metered",
        }
    }

    fn uses_redis(self) -> bool {
        !matches!(
            self,
            Scenario::Bare
                | Scenario::Memory
                | Scenario::MemoryGcra
                | Scenario::TowerGovernor
                | Scenario::InstantStore
                | Scenario::UploadCost
                | Scenario::UploadMetered
        )
    }

    /// What the issue's targets compare this configuration with: `tower_governor` for the
    /// memory store, `tower-rate-limit-fred` for the Redis store.
    fn rival(self) -> Option<Scenario> {
        match self {
            Scenario::Memory | Scenario::MemoryGcra => Some(Scenario::TowerGovernor),
            Scenario::RedisLog
            | Scenario::RedisLogLean
            | Scenario::RedisGcra
            | Scenario::RedisGcraLean => Some(Scenario::FredPeer),
            // What overrides and concurrency slots cost: the same configuration without them.
            Scenario::RedisGcraOverrides | Scenario::RedisGcraConcurrency => {
                Some(Scenario::RedisGcraLean)
            }
            // What leases are for: in-process speed with a limit shared through Redis.
            Scenario::RedisGcraLease | Scenario::RedisFwLease => Some(Scenario::MemoryGcra),
            Scenario::RedisLogLease => Some(Scenario::Memory),
            // What metering bodies costs over one decision from the declared length.
            Scenario::UploadMetered => Some(Scenario::UploadCost),
            _ => None,
        }
    }

    fn is_flood(self) -> bool {
        matches!(self, Scenario::FloodNocache | Scenario::FloodCache)
    }

    /// The hello-world route (and the upload one) behind this configuration's limiter, with
    /// fresh limiter state.
    fn app(self, redis: Option<&RedisBackend>) -> Result<Router, Error> {
        let route = Router::new().route("/", get(|| async { "hello" }).post(body_length));
        let redis = || redis.ok_or("this configuration needs Redis");
        let ours = || RateLimitLayer::builder().key(client_key());
        let ours_on_redis = || Ok::<_, &str>(ours().store(redis()?.store.clone()));
        Ok(match self {
            Scenario::Bare => route,
            Scenario::Memory => route.layer(ours().policy(HIGH_LIMIT).build()?),
            Scenario::MemoryGcra => {
                let ours = ours().headers_on_allowed(false);
                route.layer(ours.policy(policy(HIGH_LIMIT, Algorithm::Gcra)?).build()?)
            }
            Scenario::TowerGovernor => route.layer(governor_layer()?),
            Scenario::RedisLog | Scenario::RedisLogLean => {
                let ours = ours_on_redis()?.headers_on_allowed(self == Scenario::RedisLog);
                route.layer(
                    ours.policy(policy(LOG_LIMIT, Algorithm::SlidingLog)?)
                        .build()?,
                )
            }
            Scenario::RedisGcra | Scenario::RedisGcraLean | Scenario::RedisGcraOverrides => {
                let ours = ours_on_redis()?.headers_on_allowed(self == Scenario::RedisGcra);
                route.layer(ours.policy(policy(HIGH_LIMIT, Algorithm::Gcra)?).build()?)
            }
            Scenario::RedisGcraConcurrency => {
                let ours = ours_on_redis()?.headers_on_allowed(false);
                let policy = policy(HIGH_LIMIT, Algorithm::Gcra)?.concurrency(1000)?;
                route.layer(ours.policy(policy).build()?)
            }
            Scenario::RedisGcraLease | Scenario::RedisFwLease | Scenario::RedisLogLease => {
                // A store of its own, so that no lease outlives its configuration.
                let backend = redis()?;
                let store = RedisStore::builder(&backend.url)
                    .pool_size(backend.pool)
                    .cluster_tags(backend.tags)
                    .leases(Leases::new())
                    .connect_lazy()?;
                let algorithm = match self {
                    Scenario::RedisGcraLease => Algorithm::Gcra,
                    Scenario::RedisLogLease => Algorithm::SlidingLog,
                    _ => Algorithm::FixedWindow,
                };
                let ours = ours().store(store);
                let headers = self == Scenario::RedisLogLease;
                route.layer(
                    ours.headers_on_allowed(headers)
                        .policy(policy(LEASE_LIMIT, algorithm)?)
                        .build()?,
                )
            }
            Scenario::FredPeer => route.layer(peer_layer(redis()?.peer_pool.clone())),
            Scenario::FloodNocache => {
                let ours = ours_on_redis()?.deny_cache(0);
                route.layer(ours.policy(FLOOD_LIMIT).build()?)
            }
            Scenario::FloodCache => route.layer(ours_on_redis()?.policy(FLOOD_LIMIT).build()?),
            Scenario::InstantStore => {
                // The memory store answering from a task of its own: what any store that
                // answers from elsewhere costs the service (the request waits, a message goes
                // each way), without the store's own work. The ceiling of every Redis
                // configuration.
                let ours = ours().store(FaultyStore::new(MemoryStore::new()).remote());
                route.layer(ours.policy(policy(HIGH_LIMIT, Algorithm::Gcra)?).build()?)
            }
            Scenario::UploadCost => {
                route.layer(ours().policy(UPLOAD_LIMIT).cost(declared_length).build()?)
            }
            Scenario::UploadMetered => {
                let ours = ours().request_bytes(RequestBytes::new());
                route.layer(ours.policy(UPLOAD_LIMIT).build()?)
            }
        })
    }
}

/// The upload route: reads the body frame by frame, keeping none of it, and answers its length.
async fn body_length(mut body: Body) -> Result<String, StatusCode> {
    let mut length = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| StatusCode::BAD_REQUEST)?;
        length += frame.data_ref().map_or(0, Bytes::len);
    }
    Ok(length.to_string())
}

/// A request's `Content-Length` as its cost, 1 when it declares none (or one past `u32`).
fn declared_length(head: &RequestHead<'_>) -> u32 {
    let length = head.headers.get(http::header::CONTENT_LENGTH);
    let length = length.and_then(|value| value.to_str().ok()?.parse().ok());
    length.unwrap_or(1)
}

impl Scenario {
    /// Whether the row limits uploads (`--upload`), run only when named with `--only`.
    fn is_upload(self) -> bool {
        matches!(self, Scenario::UploadCost | Scenario::UploadMetered)
    }
}

impl FromStr for Scenario {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self, Error> {
        Scenario::ALL
            .into_iter()
            .find(|s| s.name() == name.trim())
            .ok_or_else(|| format!("no configuration named {name:?}").into())
    }
}

/// `limits` decided by `algorithm`.
fn policy(limits: &str, algorithm: Algorithm) -> Result<Policy, Error> {
    Ok(limits.parse::<Policy>()?.with_algorithm(algorithm))
}

fn client_key() -> Header {
    Header::new(HeaderName::from_static(CLIENT_HEADER))
}

/// `tower_governor` keyed by the same header: one element per microsecond, bursts of a million.
fn governor_layer() -> Result<GovernorLayer<GovernorHeader, NoOpMiddleware, Body>, Error> {
    let config = GovernorConfigBuilder::default()
        .key_extractor(GovernorHeader)
        .period(Duration::from_micros(1))
        .burst_size(1_000_000)
        .finish()
        .ok_or("tower_governor refused the configuration")?;
    Ok(GovernorLayer::new(config))
}

#[derive(Debug, Clone, Copy)]
struct GovernorHeader;

impl KeyExtractor for GovernorHeader {
    type Key = HeaderValue;

    fn extract<T>(&self, request: &Request<T>) -> Result<HeaderValue, GovernorError> {
        let value = request.headers().get(CLIENT_HEADER);
        value.cloned().ok_or(GovernorError::UnableToExtractKey)
    }
}

/// `tower-rate-limit-fred` keyed by the same header: bursts of 65 535, then one per ms.
fn peer_layer(pool: Pool) -> tower_rate_limit_fred::RateLimitLayer<Pool, PeerHeader> {
    tower_rate_limit_fred::RateLimitLayer::builder()
        .conn(pool)
        .key_resolver(PeerHeader)
        .capacity(u16::MAX)
        .emission_interval(Duration::from_millis(1))
        .build()
}

#[derive(Debug, Clone, Copy)]
struct PeerHeader;

impl KeyResolver for PeerHeader {
    type ErrorBody = Body;

    fn key<T>(&self, request: &Request<T>) -> Result<Option<fred::types::Key>, Response<Body>> {
        match request.headers().get(CLIENT_HEADER) {
            Some(value) => Ok(Some(value.as_bytes().into())),
            None => Err(StatusCode::BAD_REQUEST.into_response()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Redis

/// The Redis every Redis limiter shares, and what the harness uses to inspect it.
struct RedisBackend {
    url: String,
    /// Connections of each Redis limiter.
    pool: usize,
    /// Hash tags of this crate's stores in a cluster.
    tags: usize,
    /// Our store; clones share its pool.
    store: RedisStore,
    /// `tower-rate-limit-fred`'s connections, as many as ours.
    peer_pool: Pool,
    /// A separate client for `FLUSHALL` and `INFO`, on every primary of a cluster.
    admin: Admin,
    /// Our own `redis-server` (or cluster), stopped when dropped; `None` under `REDIS_URL`.
    _scratch: Option<Scratch>,
}

impl RedisBackend {
    async fn start(args: &Args) -> Result<RedisBackend, Error> {
        let (pool, primaries, tags) = (args.pool, args.cluster, args.cluster_tags);
        let (in_flight, nice) = (args.in_flight, args.redis_nice);
        let (url, scratch) = match std::env::var("REDIS_URL") {
            Ok(url) => (url, None),
            Err(_) => {
                let start = move || {
                    let scratch = Scratch::start(primaries)?;
                    if let Some(nice) = nice {
                        scratch.renice(nice)?;
                    }
                    Ok::<_, Error>(scratch)
                };
                let scratch = tokio::task::spawn_blocking(start).await??;
                (scratch.url(), Some(scratch))
            }
        };
        let mut store = RedisStore::builder(&url).pool_size(pool).cluster_tags(tags);
        if let Some(calls) = in_flight {
            store = store.max_in_flight(calls);
        }
        let store = store.connect().await?;
        let peer_pool = FredBuilder::from_config(FredConfig::from_url(&url)?)
            .with_performance_config(|config| {
                // What tower-rate-limit-fred advises; ours times out after 250 ms by default.
                config.default_command_timeout = Duration::from_millis(300);
            })
            .build_pool(pool)?;
        peer_pool.init().await?;
        let admin = Admin::connect(&url).await?;
        Ok(RedisBackend {
            url,
            pool,
            tags,
            store,
            peer_pool,
            admin,
            _scratch: scratch,
        })
    }

    async fn flush(&self) -> Result<(), Error> {
        self.admin.flush().await
    }

    /// Commands Redis has run so far, and the CPU time it has used, summed over every primary.
    async fn counters(&self) -> Result<RedisCounters, Error> {
        let stats = self.admin.info(InfoKind::CommandStats).await?;
        let cpu = self.admin.info(InfoKind::Cpu).await?;
        let mut sum = RedisCounters::default();
        for (stats, cpu) in stats.iter().zip(&cpu) {
            let one = RedisCounters::parse(stats, cpu);
            sum.commands += one.commands;
            sum.evals += one.evals;
            sum.cpu_seconds += one.cpu_seconds;
        }
        Ok(sum)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct RedisCounters {
    /// Every command but `INFO`, including those Lua scripts run.
    commands: u64,
    /// `EVAL` and `EVALSHA`: one round trip each.
    evals: u64,
    cpu_seconds: f64,
}

impl RedisCounters {
    fn parse(commandstats: &str, cpu: &str) -> RedisCounters {
        let mut counters = RedisCounters::default();
        for line in commandstats.lines() {
            let Some(stat) = line.trim().strip_prefix("cmdstat_") else {
                continue;
            };
            let Some((command, fields)) = stat.split_once(':') else {
                continue;
            };
            let calls = fields
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))
                .and_then(|calls| calls.parse::<u64>().ok())
                .unwrap_or(0);
            match command {
                "info" => {}
                "eval" | "evalsha" => {
                    counters.commands += calls;
                    counters.evals += calls;
                }
                _ => counters.commands += calls,
            }
        }
        counters.cpu_seconds = redis_cpu_seconds(cpu);
        counters
    }
}

// ---------------------------------------------------------------------------------------------
// One measurement

/// Serves `scenario`, loads it for the warm-up and the measured phase, and stops it.
/// An override for each of the first `n` keys of the load, at a count no request reaches.
async fn set_overrides(redis: &RedisBackend, n: usize) -> Result<(), Error> {
    let policy = HIGH_LIMIT
        .parse::<Policy>()?
        .with_algorithm(Algorithm::Gcra);
    let far = Override::Limits(vec!["2000000/1s".parse()?]);
    let overrides = redis.store.overrides();
    for i in 0..n {
        let key = Scope::Key(Key::from(format!("c{i}")));
        overrides.set(&policy, &key, &far).await?;
    }
    Ok(())
}

async fn measure(
    (scenario, distribution, round): (Scenario, Distribution, usize),
    args: &Args,
    redis: Option<&RedisBackend>,
) -> Result<Measurement, Error> {
    if let Some(redis) = redis {
        redis.flush().await?;
    }
    if let (Scenario::RedisGcraOverrides, Some(redis)) = (scenario, redis) {
        let keys = match args.keys_of(distribution) {
            KeyCount::Fixed(n) => n.min(1000),
            KeyCount::Auto => 1000,
        };
        set_overrides(redis, keys).await?;
    }
    let server = Server::start(scenario.app(redis)?).await?;
    let (keys, window) = prepare_load(scenario, distribution, args, server.addr).await?;
    let workers = spawn_workers(server.addr, &keys, args, window);

    let inspected = redis.filter(|_| scenario.uses_redis());
    tokio::time::sleep_until(window.start).await;
    let before = Counters::read(inspected).await?;
    let mut load = Load::default();
    for worker in workers {
        load.add(worker.await??);
    }
    let after = Counters::read(inspected).await?;
    server.stop().await;
    let measurement = Measurement::new(scenario, round, args.duration, load, before, after);
    Ok(measurement.with_spread(distribution, &keys))
}

/// The keys of `scenario`'s load on `distribution`, and when its measured phase runs: after a
/// warm-up by the workers that go on to measure, or with `--keys auto` after a warm-up of its
/// own, on other keys, whose throughput sizes the key set.
async fn prepare_load(
    scenario: Scenario,
    distribution: Distribution,
    args: &Args,
    addr: SocketAddr,
) -> Result<(KeySet, Window), Error> {
    let window = |warmup: Duration| {
        let start = Instant::now() + warmup;
        let end = start + args.duration;
        Window { start, end }
    };
    if scenario.is_flood() {
        let keys = KeySet::one(HeaderValue::from_static(FLOOD_KEY));
        // The first request is admitted and puts the key over its limit.
        let mut connection = Connection::open(addr).await?;
        connection.send(&keys.values[0], None).await?;
        return Ok((keys, window(args.warmup)));
    }
    let (count, warmup) = match args.keys_of(distribution) {
        KeyCount::Fixed(n) => (n, args.warmup),
        KeyCount::Auto => {
            let rps = warm_up(addr, args).await?;
            // Time for the measuring workers to connect.
            (KeyCount::auto(rps), Duration::from_millis(100))
        }
    };
    let keys = KeySet::named("c", count, distribution)?;
    Ok((keys, window(warmup)))
}

/// Loads `addr` for `--warmup` on keys of its own, round-robin, and answers its throughput.
async fn warm_up(addr: SocketAddr, args: &Args) -> Result<f64, Error> {
    let keys = KeySet::named("w", AUTO_WARMUP_KEYS, Distribution::Uniform)?;
    let start = Instant::now();
    let window = Window {
        start,
        end: start + args.warmup,
    };
    let mut load = Load::default();
    for worker in spawn_workers(addr, &keys, args, window) {
        load.add(worker.await??);
    }
    Ok(load.requests as f64 / args.warmup.as_secs_f64().max(1e-3))
}

/// When requests count: those sent in `start..end`.
#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    end: Instant,
}

/// The hello-world app on a free loopback port.
struct Server {
    addr: SocketAddr,
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(app: Router) -> Result<Server, Error> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (shutdown, stopped) = oneshot::channel();
        let serve = axum::serve(listener, app).with_graceful_shutdown(async {
            let _ = stopped.await;
        });
        let task = tokio::spawn(async move { serve.await });
        Ok(Server {
            addr,
            shutdown,
            task,
        })
    }

    /// Stops accepting, and returns once the connections the load opened are closed.
    async fn stop(self) {
        let _ = self.shutdown.send(());
        let _ = self.task.await;
    }
}

/// The body of every request of an upload load.
#[derive(Clone)]
struct Upload {
    body: Bytes,
    /// Sent chunked rather than with a `Content-Length`.
    chunked: bool,
}

/// One keep-alive HTTP/1.1 connection.
struct Connection {
    sender: SendRequest<Full<Bytes>>,
}

impl Connection {
    async fn open(addr: SocketAddr) -> Result<Connection, Error> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        Ok(Connection { sender })
    }

    /// `GET /` as client `key`, or `POST /` of `upload`; reads the whole answer.
    async fn send(
        &mut self,
        key: &HeaderValue,
        upload: Option<&Upload>,
    ) -> Result<StatusCode, Error> {
        let request = Request::builder()
            .header(HOST, "127.0.0.1")
            .header(CLIENT_HEADER, key);
        let request = match upload {
            // hyper sends a body of known size with a `Content-Length`, unless told to chunk it.
            Some(Upload { body, chunked }) => {
                let request = request.method(http::Method::POST).uri("/");
                let request = match chunked {
                    true => request.header(TRANSFER_ENCODING, "chunked"),
                    false => request,
                };
                request.body(Full::new(body.clone()))?
            }
            None => request.uri("/").body(Full::default())?,
        };
        self.sender.ready().await?;
        let response = self.sender.send_request(request).await?;
        let status = response.status();
        response.into_body().collect().await?;
        Ok(status)
    }
}

/// `concurrency` workers, each on its own connection, each picking its keys as
/// [`KeySet::picker`] says.
fn spawn_workers(
    addr: SocketAddr,
    keys: &KeySet,
    args: &Args,
    window: Window,
) -> Vec<JoinHandle<Result<Load, Error>>> {
    let concurrency = args.concurrency;
    (0..concurrency)
        .map(|worker| {
            let mut picker = keys.picker(worker, concurrency);
            let keys = Arc::clone(&keys.values);
            let upload = args.upload.clone();
            tokio::spawn(async move {
                let mut connection = Connection::open(addr).await?;
                let mut load = Load::default();
                loop {
                    let sent = Instant::now();
                    if sent >= window.end {
                        break;
                    }
                    let key = &keys[picker.next(keys.len())];
                    let status = connection.send(key, upload.as_ref()).await?;
                    if sent >= window.start {
                        load.record(status, sent.elapsed());
                    }
                }
                Ok(load)
            })
        })
        .collect()
}

/// What the measured phase sent and got back.
struct Load {
    requests: u64,
    non_ok: u64,
    too_many: u64,
    /// Microseconds.
    latency: Histogram<u64>,
}

impl Default for Load {
    fn default() -> Self {
        Load {
            requests: 0,
            non_ok: 0,
            too_many: 0,
            latency: Histogram::new_with_bounds(1, 60_000_000, 3)
                .expect("1 µs to 60 s at 3 digits is a valid histogram"),
        }
    }
}

impl Load {
    fn record(&mut self, status: StatusCode, latency: Duration) {
        self.requests += 1;
        self.non_ok += u64::from(status != StatusCode::OK);
        self.too_many += u64::from(status == StatusCode::TOO_MANY_REQUESTS);
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latency.saturating_record(micros.max(1));
    }

    fn add(&mut self, other: Load) {
        self.requests += other.requests;
        self.non_ok += other.non_ok;
        self.too_many += other.too_many;
        self.latency
            .add(other.latency)
            .expect("histograms of the same bounds add up");
    }
}

/// CPU time and allocations of this process and, for the Redis configurations, Redis's
/// counters.
struct Counters {
    app_cpu_seconds: Option<f64>,
    allocations: u64,
    redis: Option<RedisCounters>,
}

impl Counters {
    async fn read(redis: Option<&RedisBackend>) -> Result<Counters, Error> {
        let redis = match redis {
            Some(redis) => Some(redis.counters().await?),
            None => None,
        };
        Ok(Counters {
            app_cpu_seconds: process_cpu_seconds(),
            allocations: CountingAllocator::totals().0,
            redis,
        })
    }
}

/// One configuration in one round.
struct Measurement {
    scenario: Scenario,
    round: usize,
    spread: Spread,
    requests: u64,
    non_ok: u64,
    too_many: u64,
    seconds: f64,
    rps: f64,
    p50_us: u64,
    p99_us: u64,
    redis_per_request: Option<RedisPerRequest>,
    app_cores: Option<f64>,
    redis_cores: Option<f64>,
    ratio_to_bare: Option<f64>,
    /// Throughput over the same round's [`Scenario::rival`]'s, when both ran.
    ratio_to_rival: Option<f64>,
    /// Heap allocations in this process (server, load and limiter) per request.
    allocations_per_request: f64,
    /// CPU time per request, of this process and Redis together, in µs.
    cpu_us_per_request: Option<f64>,
    /// Redis's CPU time per request, in µs.
    redis_us_per_request: Option<f64>,
}

impl Measurement {
    fn new(
        scenario: Scenario,
        round: usize,
        duration: Duration,
        load: Load,
        before: Counters,
        after: Counters,
    ) -> Measurement {
        let seconds = duration.as_secs_f64();
        let requests = load.requests.max(1) as f64;
        let redis = before.redis.zip(after.redis);
        let app_cpu = before
            .app_cpu_seconds
            .zip(after.app_cpu_seconds)
            .map(|(b, a)| a - b);
        let redis_cpu = redis.map_or(0.0, |(b, a)| a.cpu_seconds - b.cpu_seconds);
        Measurement {
            scenario,
            round,
            spread: Spread {
                distribution: Distribution::Uniform,
                keys: 0,
                busiest_key_rps: 0.0,
                hot_share: 0.0,
            },
            requests: load.requests,
            non_ok: load.non_ok,
            too_many: load.too_many,
            seconds,
            rps: load.requests as f64 / seconds,
            p50_us: load.latency.value_at_quantile(0.5),
            p99_us: load.latency.value_at_quantile(0.99),
            redis_per_request: redis.map(|(b, a)| RedisPerRequest {
                commands: a.commands.saturating_sub(b.commands) as f64 / requests,
                evals: a.evals.saturating_sub(b.evals) as f64 / requests,
            }),
            app_cores: app_cpu.map(|cpu| cpu / seconds),
            redis_cores: redis.map(|(b, a)| (a.cpu_seconds - b.cpu_seconds) / seconds),
            ratio_to_bare: None,
            ratio_to_rival: None,
            allocations_per_request: after.allocations.saturating_sub(before.allocations) as f64
                / requests,
            cpu_us_per_request: app_cpu.map(|cpu| (cpu + redis_cpu) * 1e6 / requests),
            redis_us_per_request: redis.map(|_| redis_cpu * 1e6 / requests),
        }
    }

    /// The same, with how its load spread over `keys`.
    fn with_spread(mut self, distribution: Distribution, keys: &KeySet) -> Measurement {
        self.spread = Spread {
            distribution,
            keys: keys.values.len(),
            busiest_key_rps: self.rps * keys.top_share(),
            hot_share: keys.hot_share(self.rps),
        };
        self
    }

    fn label(&self) -> String {
        label(self.scenario, self.spread.distribution)
    }

    fn progress_line(&self) -> String {
        format!(
            "round {} {:<20} {:>9.0} req/s  p50 {:>6} µs  p99 {:>6} µs  non-200 {}  keys {}",
            self.round,
            self.label(),
            self.rps,
            self.p50_us,
            self.p99_us,
            self.non_ok,
            self.spread.keys,
        )
    }
}

/// How a measured load spread over its keys.
#[derive(Debug, Clone, Copy)]
struct Spread {
    distribution: Distribution,
    keys: usize,
    /// Requests per second of the busiest key (every key's, round-robin).
    busiest_key_rps: f64,
    /// The share of the requests whose key saw at least `HOT_PER_PERIOD` per lease period.
    hot_share: f64,
}

/// A row's name: the configuration's, and the distribution's after a `/`.
fn label(scenario: Scenario, distribution: Distribution) -> String {
    format!("{}{}", scenario.name(), distribution.suffix())
}

/// What Redis did per request sent.
#[derive(Debug, Clone, Copy)]
struct RedisPerRequest {
    /// Every command, including those the limiter's Lua script ran.
    commands: f64,
    /// `EVAL`/`EVALSHA` calls: round trips.
    evals: f64,
}

/// Each measurement's throughput over the same round's bare route's and rival's, when they ran.
fn set_ratios(round: &mut [Measurement]) {
    let rps_of = |scenario: Scenario| round.iter().find(|m| m.scenario == scenario).map(|m| m.rps);
    let bare = rps_of(Scenario::Bare);
    let rivals: Vec<Option<f64>> = round
        .iter()
        .map(|m| m.scenario.rival().and_then(rps_of))
        .collect();
    for (measurement, rival) in round.iter_mut().zip(rivals) {
        measurement.ratio_to_bare = bare.map(|bare| measurement.rps / bare);
        measurement.ratio_to_rival = rival.map(|rival| measurement.rps / rival);
    }
}

// ---------------------------------------------------------------------------------------------
// Reporting

/// A configuration's medians over rounds; answer counts are totals.
struct Summary {
    scenario: Scenario,
    distribution: Distribution,
    rounds: usize,
    requests: u64,
    non_ok: u64,
    too_many: u64,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    ratio_to_bare: Option<f64>,
    ratio_to_rival: Option<f64>,
    redis_cmds_per_req: Option<f64>,
    redis_evals_per_req: Option<f64>,
    app_cores: Option<f64>,
    redis_cores: Option<f64>,
    allocations_per_request: f64,
    cpu_us_per_request: Option<f64>,
    redis_us_per_request: Option<f64>,
    /// Medians of the rounds' [`Spread`].
    keys: f64,
    busiest_key_rps: f64,
    hot_share: f64,
}

impl Summary {
    fn of(scenario: Scenario, distribution: Distribution, results: &[Measurement]) -> Summary {
        let rounds: Vec<&Measurement> = results
            .iter()
            .filter(|m| m.scenario == scenario && m.spread.distribution == distribution)
            .collect();
        let median_of = |f: &dyn Fn(&Measurement) -> Option<f64>| {
            median(rounds.iter().filter_map(|m| f(m)).collect())
        };
        Summary {
            scenario,
            distribution,
            keys: median_of(&|m| Some(m.spread.keys as f64)).unwrap_or(0.0),
            busiest_key_rps: median_of(&|m| Some(m.spread.busiest_key_rps)).unwrap_or(0.0),
            hot_share: median_of(&|m| Some(m.spread.hot_share)).unwrap_or(0.0),
            rounds: rounds.len(),
            requests: rounds.iter().map(|m| m.requests).sum(),
            non_ok: rounds.iter().map(|m| m.non_ok).sum(),
            too_many: rounds.iter().map(|m| m.too_many).sum(),
            rps: median_of(&|m| Some(m.rps)).unwrap_or(0.0),
            p50_us: median_of(&|m| Some(m.p50_us as f64)).unwrap_or(0.0),
            p99_us: median_of(&|m| Some(m.p99_us as f64)).unwrap_or(0.0),
            ratio_to_bare: median_of(&|m| m.ratio_to_bare),
            ratio_to_rival: median_of(&|m| m.ratio_to_rival),
            redis_cmds_per_req: median_of(&|m| m.redis_per_request.map(|r| r.commands)),
            redis_evals_per_req: median_of(&|m| m.redis_per_request.map(|r| r.evals)),
            app_cores: median_of(&|m| m.app_cores),
            redis_cores: median_of(&|m| m.redis_cores),
            allocations_per_request: median_of(&|m| Some(m.allocations_per_request)).unwrap_or(0.0),
            cpu_us_per_request: median_of(&|m| m.cpu_us_per_request),
            redis_us_per_request: median_of(&|m| m.redis_us_per_request),
        }
    }

    fn label(&self) -> String {
        label(self.scenario, self.distribution)
    }

    /// The busiest key's requests per lease period, marked when a hot load's keys are not.
    fn per_period(&self) -> String {
        let per_period = self.busiest_key_rps * LEASE_PERIOD.as_secs_f64();
        match self.distribution == Distribution::Hot && per_period < HOT_PER_PERIOD {
            true => format!("{per_period:.2} not hot"),
            false => format!("{per_period:.2}"),
        }
    }

    /// Share of answers that were 429, in percent.
    fn too_many_percent(&self) -> f64 {
        100.0 * self.too_many as f64 / self.requests.max(1) as f64
    }
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    match values.len() {
        0 => None,
        n if n % 2 == 1 => Some(values[mid]),
        _ => Some((values[mid - 1] + values[mid]) / 2.0),
    }
}

/// `value` with `digits` decimals, or `-` when there is none.
fn or_dash(value: Option<f64>, digits: usize) -> String {
    value.map_or("-".to_owned(), |v| format!("{v:.digits$}"))
}

fn table(summaries: &[Summary]) -> String {
    let mut out = format!(
        "{:<22} {:>9} {:>6} {:>6} {:>8} {:>8} {:>8} {:>6} {:>8} {:>9} {:>7} {:>9} {:>10} {:>12} {:>10} {:>8} {:>10} {:>14} {:>6}\n",
        "config",
        "req/s",
        "×bare",
        "×rival",
        "p50 µs",
        "p99 µs",
        "non-200",
        "429 %",
        "cmds/req",
        "evals/req",
        "cpu app",
        "cpu redis",
        "cpu µs/req",
        "redis µs/req",
        "allocs/req",
        "keys",
        "key req/s",
        "key req/period",
        "hot %"
    );
    for s in summaries {
        let _ = writeln!(
            out,
            "{:<22} {:>9.0} {:>6} {:>6} {:>8.0} {:>8.0} {:>8} {:>6.1} {:>8} {:>9} {:>7} {:>9} {:>10} {:>12} {:>10.1} {:>8.0} {:>10.3} {:>14} {:>6.0}",
            s.label(),
            s.rps,
            or_dash(s.ratio_to_bare, 2),
            or_dash(s.ratio_to_rival, 2),
            s.p50_us,
            s.p99_us,
            s.non_ok,
            s.too_many_percent(),
            or_dash(s.redis_cmds_per_req, 2),
            or_dash(s.redis_evals_per_req, 2),
            or_dash(s.app_cores, 2),
            or_dash(s.redis_cores, 2),
            or_dash(s.cpu_us_per_request, 1),
            or_dash(s.redis_us_per_request, 2),
            s.allocations_per_request,
            s.keys,
            s.busiest_key_rps,
            s.per_period(),
            s.hot_share * 100.0,
        );
    }
    out.push_str(
        "\nMedians over rounds; non-200 and 429 % over all rounds. ×bare and ×rival are medians of \
         per-round ratios,\n×rival to tower_governor (memory store) or fred_peer (Redis store). \
         cmds/req counts the commands\nLua scripts run, evals/req the EVALSHA round trips; cpu: \
         cores busy (app: this process, server and\nload together); cpu µs/req: CPU time of both per request (redis µs/req: of Redis); allocs/req: heap allocations of\nthis process per request. Rows `name/dist` ran on that key distribution, ratios within it.\nkey req/s: the busiest key's rate (every key's, round-robin); key req/period: that times the\nlease period (1 s), \"not hot\" on a hot row under 10; hot %: requests whose key saw 10 or more\nper lease period.\n",
    );
    out
}

fn write_outputs(dir: &Path, results: &[Measurement], summaries: &[Summary]) -> Result<(), Error> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("results.csv"), results_csv(results))?;
    std::fs::write(dir.join("summary.csv"), summary_csv(summaries))?;
    chart(&dir.join("throughput.svg"), summaries)?;
    println!(
        "wrote {}/{{results.csv,summary.csv,throughput.svg}}",
        dir.display()
    );
    Ok(())
}

fn results_csv(results: &[Measurement]) -> String {
    let mut csv = "config,round,requests,non_ok,seconds,rps,p50_us,p99_us,redis_cmds_per_req,\
                   ratio_to_bare,status_429,redis_evals_per_req,app_cores,redis_cores,ratio_to_rival,\
                   allocs_per_req,cpu_us_per_req,keys,busiest_key_rps,hot_share,redis_us_per_req\n"
        .to_owned();
    for m in results {
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.3},{:.1},{},{},{},{},{},{},{},{},{},{:.2},{},{},{:.3},{:.4},{}",
            m.label(),
            m.round,
            m.requests,
            m.non_ok,
            m.seconds,
            m.rps,
            m.p50_us,
            m.p99_us,
            or_empty(m.redis_per_request.map(|r| r.commands), 4),
            or_empty(m.ratio_to_bare, 4),
            m.too_many,
            or_empty(m.redis_per_request.map(|r| r.evals), 4),
            or_empty(m.app_cores, 3),
            or_empty(m.redis_cores, 3),
            or_empty(m.ratio_to_rival, 4),
            m.allocations_per_request,
            or_empty(m.cpu_us_per_request, 2),
            m.spread.keys,
            m.spread.busiest_key_rps,
            m.spread.hot_share,
            or_empty(m.redis_us_per_request, 3),
        );
    }
    csv
}

fn summary_csv(summaries: &[Summary]) -> String {
    let mut csv = "config,rounds,requests,non_ok,status_429,rps,p50_us,p99_us,\
                   redis_cmds_per_req,ratio_to_bare,redis_evals_per_req,app_cores,redis_cores,\
                   ratio_to_rival,allocs_per_req,cpu_us_per_req,keys,busiest_key_rps,hot_share,redis_us_per_req\n"
        .to_owned();
    for s in summaries {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{:.1},{:.0},{:.0},{},{},{},{},{},{},{:.2},{},{:.0},{:.3},{:.4},{}",
            s.label(),
            s.rounds,
            s.requests,
            s.non_ok,
            s.too_many,
            s.rps,
            s.p50_us,
            s.p99_us,
            or_empty(s.redis_cmds_per_req, 4),
            or_empty(s.ratio_to_bare, 4),
            or_empty(s.redis_evals_per_req, 4),
            or_empty(s.app_cores, 3),
            or_empty(s.redis_cores, 3),
            or_empty(s.ratio_to_rival, 4),
            s.allocations_per_request,
            or_empty(s.cpu_us_per_request, 2),
            s.keys,
            s.busiest_key_rps,
            s.hot_share,
            or_empty(s.redis_us_per_request, 3),
        );
    }
    csv
}

/// `value` with `digits` decimals, or nothing (an empty CSV field).
fn or_empty(value: Option<f64>, digits: usize) -> String {
    value.map_or(String::new(), |v| format!("{v:.digits$}"))
}

/// Two horizontal bar charts, one above the other: median throughput relative to bare (or in
/// req/s when bare did not run), and median p99 latency.
fn chart(path: &Path, summaries: &[Summary]) -> Result<(), Error> {
    let height = 200 + 80 * summaries.len() as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(height / 2);
    let labels: Vec<String> = summaries.iter().map(Summary::label).collect();
    let names = || labels.iter().map(String::as_str);
    let relative = summaries.iter().all(|s| s.ratio_to_bare.is_some());
    let throughput = match relative {
        true => Bars {
            title: "Throughput relative to bare (median over rounds)",
            rows: names()
                .zip(summaries.iter().filter_map(|s| s.ratio_to_bare))
                .collect(),
            label: |v| format!("{v:.2}×"),
            axis_digits: 1,
            reference: Some(1.0),
            color: BLUE.mix(0.7),
        },
        false => Bars {
            title: "Throughput, req/s (median over rounds)",
            rows: names().zip(summaries.iter().map(|s| s.rps)).collect(),
            label: |v| format!("{v:.0}"),
            axis_digits: 0,
            reference: None,
            color: BLUE.mix(0.7),
        },
    };
    throughput.draw(&top)?;
    let p99 = Bars {
        title: "p99 latency, µs (median over rounds)",
        rows: names().zip(summaries.iter().map(|s| s.p99_us)).collect(),
        label: |v| format!("{v:.0} µs"),
        axis_digits: 0,
        reference: None,
        color: RED.mix(0.7),
    };
    p99.draw(&bottom)?;
    root.present()?;
    Ok(())
}

/// A horizontal bar chart: one bar per row, top to bottom, each labelled with its value.
struct Bars<'a> {
    title: &'a str,
    rows: Vec<(&'a str, f64)>,
    label: fn(f64) -> String,
    axis_digits: usize,
    /// Where to draw a vertical line, e.g. at 1 for ratios.
    reference: Option<f64>,
    color: RGBAColor,
}

impl Bars<'_> {
    fn draw<DB>(&self, area: &DrawingArea<DB, plotters::coord::Shift>) -> Result<(), Error>
    where
        DB: DrawingBackend,
        DB::ErrorType: 'static,
    {
        let count = self.rows.len() as i32;
        // Row 0 is the top segment; one row still gets an empty one above it.
        let y = |row: usize| count - 1 - row as i32;
        let max = self.rows.iter().map(|&(_, v)| v).fold(0.0, f64::max);
        let max = max
            .max(self.reference.unwrap_or(0.0))
            .max(f64::MIN_POSITIVE);
        let name = |segment: &SegmentValue<i32>| match *segment {
            SegmentValue::CenterOf(s) => usize::try_from(count - 1 - s)
                .ok()
                .and_then(|row| self.rows.get(row))
                .map_or(String::new(), |&(name, _)| name.to_owned()),
            _ => String::new(),
        };
        let axis = |v: &f64| format!("{v:.digits$}", digits = self.axis_digits);
        let mut chart = ChartBuilder::on(area)
            .caption(self.title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(130)
            .build_cartesian_2d(0.0..max * 1.2, (0..(count - 1).max(1)).into_segmented())?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .label_style(("sans-serif", 13))
            .y_labels(self.rows.len())
            .y_label_formatter(&name)
            .x_label_formatter(&axis)
            .draw()?;
        chart.draw_series(self.rows.iter().enumerate().map(|(row, &(_, value))| {
            let (bottom, top) = (SegmentValue::Exact(y(row)), SegmentValue::Exact(y(row) + 1));
            let mut bar = Rectangle::new([(0.0, bottom), (value, top)], self.color.filled());
            bar.set_margin(6, 6, 0, 0);
            bar
        }))?;
        let style =
            TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        chart.draw_series(self.rows.iter().enumerate().map(|(row, &(_, value))| {
            let at = (value, SegmentValue::CenterOf(y(row)));
            EmptyElement::at(at) + Text::new((self.label)(value), (5, 0), style.clone())
        }))?;
        if let Some(x) = self.reference {
            let line = [(x, SegmentValue::Exact(0)), (x, SegmentValue::Exact(count))];
            chart.draw_series([PathElement::new(line, BLACK.stroke_width(1))])?;
        }
        Ok(())
    }
}
