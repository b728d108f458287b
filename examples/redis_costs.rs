//! What each feature a policy can use costs Redis per decision, for GCRA and the sliding log:
//! a plain policy on the plain scripts, the same on the full scripts, and the full scripts with
//! an override, a penalty box, a concurrency limit (slots), requests counted by outcome
//! (attempts) or an outbound line (reservations), each in calls of up to 8 requests and of 1.
//!
//! ```text
//! cargo run --release --all-features --example redis_costs -- --rounds 3
//! cargo run --release --all-features --example redis_costs -- --rounds 3 --callgrind
//! cargo run --release --all-features --example redis_costs -- --rounds 3 --callgrind --limit 1000000/10s
//! cargo run --release --all-features --example redis_costs -- --lua-ops
//! ```
//!
//! Each row starts from an empty Redis (`FLUSHALL`) and a store of its own, decides each of
//! 1 000 keys once (so that every key has its state and, with overrides, its override), then
//! has 32 tasks make a fixed number of decisions round the keys under `1000000/1s` (`--limit`
//! for another), which none reaches. Under callgrind Redis runs tens of times slower, and each
//! key sees a decision every few hundred ms: a window of 10 s or more (`--limit 1000000/10s`)
//! keeps them as busy, against an eighth of the window, as they are at native speed, where the
//! scripts keep a busy key's expiry (`expiry.lua`, `expires_at`). What Redis did in between (`CONFIG RESETSTAT` before, `INFO commandstats` and
//! `INFO cpu` after) is divided by the decisions:
//!
//! - `calls`: `EVALSHA` calls (one round trip each): how many requests share a call;
//! - `commands`: the Redis commands the scripts ran (every command but `EVALSHA`, `INFO` and
//!   `CONFIG`);
//! - `script µs`: `cmdstat_evalsha` `usec`, the time Redis spent inside the scripts;
//! - `Redis CPU µs`: `used_cpu_user + used_cpu_sys`, which adds reading, parsing and replying.
//!
//! The figures are medians over `--rounds` (default 3) runs of every row, the rows of a round
//! one after the other. A second table lists each row's commands by name, per decision.
//!
//! A decision of each feature is what a user of it pays for one request: for slots, a request
//! through a `RateLimitLayer` (the take in its decision, the release after its response); for
//! attempts, a request through a `RateLimitLayer` with `count_when` (a `401` counts; the route
//! answers `200`, so each attempt's settle is a refund); for a line, the reservation
//! (`Reserve::reserve`) and the look at its turn that takes it out of the line.
//!
//! Two rows set each algorithm's figures beside what no script can go under and beside the
//! peer the performance targets name:
//!
//! - `floor`: a script that makes the commands of the plain tier's admission for each of its
//!   keys and nothing else (`support/floor_gcra.lua`, `support/floor_log.lua`: no arguments
//!   read, no decision, nothing packed), in calls of 8 keys and of 1;
//! - `peer`: `tower-rate-limit-fred` 2.1 (GCRA in a script of `TIME`, `GET` and `SET … PX`,
//!   one call per decision, pipelined by `fred`), at capacity 65 535 and 1 per ms, as
//!   `http_load`'s `fred_peer`; the same row under both algorithms.
//!
//! With `--callgrind`, the same rows run a second time on a `redis-server` under
//! `valgrind --tool=callgrind` (fewer decisions: it runs about 50 times slower), and each row
//! gets redis-server's instructions per decision, counted between `callgrind_control -z` and
//! `-d`. Instruction counts do not move with the load of the machine, where times do by
//! 10-20 %. One ratio turns them into µs: the sum of the rows' Redis CPU µs per decision of the
//! first pass over the sum of their instructions per decision (both passes in one run).
//!
//! With `--lua-ops` instead, it prints what single Lua operations cost `redis-server` in
//! instructions under callgrind (`support/lua_op.lua`): `tonumber` of a time's digits, the same
//! made a number by arithmetic, `string.sub`, `string.find`, `string.format('%d')`,
//! `struct.pack` and `struct.unpack` of three integers, a table write and a new table. These
//! say what a decision's Lua work costs beside its commands (`docs/performance.md`).
//!
//! It starts its own `redis-server` (`$REDIS_SERVER` or `redis-server` from `PATH`; with
//! `--callgrind`, `valgrind` and `callgrind_control` from `PATH` too) on free loopback ports.

// The load examples' helpers, of which this one uses the scratch server and the CPU reading.
#[allow(dead_code)]
mod support;

use std::convert::Infallible;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::{Client, ClientLike, Config};
use fred::types::scripts::Script;
use fred::types::InfoKind;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_redis_ratelimit::key::Header;
use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::test_util::{Reserve, Ticket};
use tower_redis_ratelimit::{Algorithm, Key, Policy, RateLimitLayer, RedisStore, Store};

type Error = Box<dyn std::error::Error + Send + Sync>;

const KEYS: usize = 1000;
const TASKS: usize = 32;
/// Decisions per row, natively and under callgrind.
const DECISIONS: usize = 32_000;
const CALLGRIND_DECISIONS: usize = 4_000;
/// The limit of every row's policy: `--limit`, else `1000000/1s`.
static LIMIT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn limit() -> &'static str {
    LIMIT.get().map_or("1000000/1s", String::as_str)
}
/// The most requests of a script call: batched, and one.
const BATCHES: [usize; 2] = [8, 1];

/// What the policy uses, beside its limit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Feature {
    /// Nothing, on the plain scripts.
    Plain,
    /// Nothing, on the full scripts (the store's plain scripts off).
    Full,
    /// An override of its own for every key (a count out of reach).
    Override,
    /// A penalty box of a minute.
    PenaltyBox,
    /// A concurrency limit: each request takes a slot and releases it.
    Slots,
    /// Requests counted by outcome: each admission is an attempt, settled after its response.
    Attempts,
    /// An outbound line: each request reserves its turn, then looks at it and leaves.
    Line,
    /// The floor: a script that makes the plain tier's commands for each key and decides
    /// nothing (`support/floor_gcra.lua`, `support/floor_log.lua`), in calls of a batch of keys.
    Floor,
    /// The peer, `tower-rate-limit-fred` (GCRA): its script, a call per decision.
    Peer,
}

const FEATURES: [(Feature, &str); 9] = [
    (Feature::Plain, "plain policy, plain scripts"),
    (Feature::Full, "plain policy, full scripts"),
    (Feature::Override, "+ an override"),
    (Feature::PenaltyBox, "+ a penalty box (never set)"),
    (Feature::Slots, "+ slots (take and release)"),
    (Feature::Attempts, "+ attempts (count_when)"),
    (Feature::Line, "+ a line (reserve and look)"),
    (Feature::Floor, "floor: the commands alone"),
    (Feature::Peer, "peer: tower-rate-limit-fred (GCRA)"),
];

/// Whether a row is measured: the peer makes a call per decision, and has one row.
fn has_row(feature: Feature, batch: usize) -> bool {
    feature != Feature::Peer || batch == 1
}

const ALGORITHMS: [(Algorithm, &str); 2] = [
    (Algorithm::Gcra, "GCRA"),
    (Algorithm::SlidingLog, "sliding log"),
];

/// What Redis did for one row, per decision.
#[derive(Clone, Default)]
struct Costs {
    calls: f64,
    commands: f64,
    script_micros: f64,
    cpu_micros: f64,
    instructions: Option<f64>,
    /// `EVALSHA` calls per decision under callgrind, where Redis runs slower and batches may
    /// fill otherwise.
    callgrind_calls: Option<f64>,
    /// Each command the scripts ran, by name, per decision.
    each: Vec<(String, f64)>,
}

impl Costs {
    /// The median of each figure over `rounds` (at least one), the commands by name of the
    /// last.
    fn median(rounds: &[Costs]) -> Costs {
        let median = |figure: fn(&Costs) -> f64| {
            let mut values: Vec<f64> = rounds.iter().map(figure).collect();
            values.sort_by(f64::total_cmp);
            values[values.len() / 2]
        };
        Costs {
            calls: median(|c| c.calls),
            commands: median(|c| c.commands),
            script_micros: median(|c| c.script_micros),
            cpu_micros: median(|c| c.cpu_micros),
            instructions: None,
            callgrind_calls: None,
            each: rounds.last().map(|c| c.each.clone()).unwrap_or_default(),
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let (rounds, callgrind, ops) = flags(std::env::args().skip(1))?;
    if ops {
        return lua_ops().await;
    }
    let mut measured: Vec<Vec<Costs>> = Vec::new();
    {
        let scratch = support::redis::Scratch::start(0)?;
        let redis = Redis::connect(&scratch.url(), None).await?;
        for _ in 0..rounds {
            let mut row = 0;
            for (algorithm, _) in ALGORITHMS {
                for (feature, _) in FEATURES {
                    for batch in BATCHES.into_iter().filter(|&b| has_row(feature, b)) {
                        let costs = measure(&redis, algorithm, feature, batch, DECISIONS).await?;
                        match measured.get_mut(row) {
                            Some(rounds) => rounds.push(costs),
                            None => measured.push(vec![costs]),
                        }
                        row += 1;
                    }
                }
            }
        }
    }
    let mut rows: Vec<Costs> = measured.iter().map(|r| Costs::median(r)).collect();
    let mut ratio = None;
    if callgrind {
        let server = Callgrind::start()?;
        let redis = Redis::connect(&server.url(), Some(&server)).await?;
        let mut row = rows.iter_mut();
        for (algorithm, _) in ALGORITHMS {
            for (feature, _) in FEATURES {
                for batch in BATCHES.into_iter().filter(|&b| has_row(feature, b)) {
                    let decisions = CALLGRIND_DECISIONS;
                    let costs = measure(&redis, algorithm, feature, batch, decisions).await?;
                    let into = row.next().ok_or("a row more under callgrind")?;
                    into.instructions = costs.instructions;
                    into.callgrind_calls = Some(costs.calls);
                }
            }
        }
        let cpu: f64 = rows.iter().map(|r| r.cpu_micros).sum();
        let instructions: f64 = rows.iter().filter_map(|r| r.instructions).sum();
        ratio = Some(cpu / instructions);
    }
    print_table(&rows, rounds, ratio);
    print_commands(&rows);
    Ok(())
}

/// `--rounds R` (default 3), `--callgrind`, `--lua-ops` and `--limit <count/window>` (which
/// sets [`LIMIT`]).
fn flags(mut args: impl Iterator<Item = String>) -> Result<(usize, bool, bool), Error> {
    let (mut rounds, mut callgrind, mut ops) = (3, false, false);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--callgrind" => callgrind = true,
            "--lua-ops" => ops = true,
            "--limit" => {
                let text = args
                    .next()
                    .ok_or("--limit takes a limit, such as 1000000/10s")?;
                text.parse::<tower_redis_ratelimit::Limit>()
                    .map_err(|e| format!("--limit {text:?}: {e}"))?;
                LIMIT.set(text).map_err(|_| "--limit given twice")?;
            }
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .filter(|&n| n > 0)
                    .ok_or("--rounds takes a number above 0")?;
            }
            other => return Err(format!("unknown flag {other:?}; see the example's doc").into()),
        }
    }
    Ok((rounds, callgrind, ops))
}

/// The Lua operations of `--lua-ops`, each a statement of `support/lua_op.lua`'s loop.
const LUA_OPS: [(&str, &str); 9] = [
    ("a loop pass, nothing else", "local x = i"),
    ("tonumber(digits)", "local x = tonumber(digits)"),
    ("digits + 0", "local x = digits + 0"),
    ("string.sub (16 bytes)", "local x = sub(member, 18, 33)"),
    (
        "string.find (plain)",
        "local x = find(member, ':', 1, true)",
    ),
    (
        "string.format('%d', ...)",
        "local x = format('%d', 1795900542147172 + i)",
    ),
    (
        "struct.pack('<lll', ...)",
        "local x = spack('<lll', i, 2, 3)",
    ),
    (
        "struct.unpack('<lll', ...)",
        "local a, b, c = sunpack('<lll', packed)",
    ),
    ("a table write, a new table", "t[i] = {}"),
];

/// `--lua-ops`: each of [`LUA_OPS`] run 0 and 2 000 times in a call, 5 calls each, on a
/// `redis-server` under callgrind; prints the instructions per run.
async fn lua_ops() -> Result<(), Error> {
    const RUNS: u32 = 2_000;
    let server = Callgrind::start()?;
    let redis = Redis::connect(&server.url(), Some(&server)).await?;
    println!("| Lua operation | redis-server instructions per run |\n|---|---|");
    for (name, op) in LUA_OPS {
        let script = Script::from_lua(include_str!("support/lua_op.lua").replace("{{op}}", op));
        let mut counted = [0.0; 2];
        for (runs, into) in [0, RUNS].into_iter().zip(&mut counted) {
            redis.reset().await?;
            for _ in 0..5 {
                let _: i64 = script.evalsha_with_reload(&redis.client, (), runs).await?;
            }
            *into = redis.instructions()?.ok_or("no count")? / 5.0;
        }
        println!(
            "| `{name}` | {:.0} |",
            (counted[1] - counted[0]) / f64::from(RUNS)
        );
    }
    Ok(())
}

/// Every row's name, in the order of the measurement.
fn row_names() -> Vec<(&'static str, &'static str, usize)> {
    let mut names = Vec::new();
    for (_, algorithm) in ALGORITHMS {
        for (kind, feature) in FEATURES {
            for batch in BATCHES.into_iter().filter(|&b| has_row(kind, b)) {
                names.push((algorithm, feature, batch));
            }
        }
    }
    names
}

/// The commands of each row by name, per decision (those of at least 0.0005).
fn print_commands(rows: &[Costs]) {
    println!("\n| algorithm | policy | batch | commands per decision |");
    println!("|---|---|---|---|");
    for ((algorithm, feature, batch), costs) in row_names().into_iter().zip(rows) {
        let each: Vec<String> = costs
            .each
            .iter()
            .filter(|(_, n)| *n >= 0.0005)
            .map(|(name, n)| format!("{} {n:.3}", name.to_uppercase()))
            .collect();
        println!(
            "| {algorithm} | {feature} | {batch} | {} |",
            each.join(", ")
        );
    }
}

fn print_table(rows: &[Costs], rounds: usize, ratio: Option<f64>) {
    println!(
        "Redis per decision, {KEYS} keys decided once first, {DECISIONS} decisions a row, \
         medians of {rounds} round(s) ({CALLGRIND_DECISIONS} decisions, one round, under \
         callgrind), {TASKS} tasks, limit {}\n",
        limit()
    );
    println!(
        "| algorithm | policy | batch | calls | commands | script µs | Redis CPU µs | \
         instructions (calls under callgrind) | µs from instructions |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for ((algorithm, feature, batch), costs) in row_names().into_iter().zip(rows) {
        let (instructions, micros) = match (costs.instructions, costs.callgrind_calls, ratio) {
            (Some(ir), Some(calls), Some(ratio)) => (
                format!("{ir:.0} ({calls:.3} calls)"),
                format!("{:.2}", ir * ratio),
            ),
            _ => ("–".to_owned(), "–".to_owned()),
        };
        println!(
            "| {algorithm} | {feature} | {batch} | {:.3} | {:.2} | {:.2} | {:.2} | \
             {instructions} | {micros} |",
            costs.calls, costs.commands, costs.script_micros, costs.cpu_micros
        );
    }
    if let Some(ratio) = ratio {
        println!(
            "\nµs from instructions: instructions × {:.3} ns, the sum of the rows' Redis CPU \
             µs over the sum of their instructions ({:.0} instructions per µs)",
            ratio * 1e3,
            1.0 / ratio
        );
    }
}

/// One row: a fresh store and Redis, `KEYS` keys decided once, then `decisions` decisions.
async fn measure(
    redis: &Redis<'_>,
    algorithm: Algorithm,
    feature: Feature,
    batch: usize,
    decisions: usize,
) -> Result<Costs, Error> {
    redis.client.flushall::<()>(false).await?;
    // A generous time budget: a busy machine or callgrind's Redis may answer late.
    let store = RedisStore::builder(&redis.url)
        .timeout(Duration::from_secs(5))
        .max_batch(batch)
        .plain_scripts(feature == Feature::Plain)
        .connect()
        .await?;
    let decider = Decider::new(store, redis.client.clone(), algorithm, feature, batch).await?;
    decider.run(0, KEYS, 1).await?;
    redis.reset().await?;
    let before = redis.cpu_seconds().await?;
    let started = Instant::now();
    decider.run(KEYS, decisions, TASKS).await?;
    // Slots and attempts are settled after their responses: let the last settles land.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cpu = redis.cpu_seconds().await? - before;
    let instructions = redis.instructions()?;
    let (calls, script, each) = redis.commandstats().await?;
    let n = decisions as f64;
    eprintln!(
        "{algorithm:?} batch {batch}: {n} decisions in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(Costs {
        calls: calls / n,
        commands: each.iter().map(|(_, calls)| calls).sum::<f64>() / n,
        script_micros: script / n,
        cpu_micros: cpu * 1e6 / n,
        instructions: instructions.map(|ir| ir / n),
        callgrind_calls: None,
        each: each
            .into_iter()
            .map(|(name, calls)| (name, calls / n))
            .collect(),
    })
}

/// Makes decisions of one feature: through the store, or through a layer for attempts.
#[derive(Clone)]
struct Decider {
    store: RedisStore,
    policy: Policy,
    feature: Feature,
    layer: Option<RateLimitLayer<Header, RedisStore>>,
    /// The client of the floor's and the peer's calls.
    client: Client,
    /// The floor's script, and the keys of each of its calls.
    floor: Option<Script>,
    batch: usize,
}

impl Decider {
    async fn new(
        store: RedisStore,
        client: Client,
        algorithm: Algorithm,
        feature: Feature,
        batch: usize,
    ) -> Result<Self, Error> {
        let mut policy = Policy::new("costs", [limit().parse()?])?.with_algorithm(algorithm);
        match feature {
            Feature::PenaltyBox => policy = policy.block_for(Duration::from_secs(60))?,
            Feature::Slots => policy = policy.concurrency(1_000)?,
            _ => {}
        }
        if feature == Feature::Override {
            // Twice the limit's count, over the same window.
            let own: tower_redis_ratelimit::Limit = limit().parse()?;
            let far = Override::Limits(vec![tower_redis_ratelimit::Limit::new(
                own.count() * 2,
                own.window(),
            )?]);
            for i in 0..KEYS {
                let key = Scope::Key(Key::from(format!("c{i}")));
                store.overrides().set(&policy, &key, &far).await?;
            }
        }
        // Slots and attempts through a layer, which settles them after each response as a
        // service does (a release joins the store's next call).
        let builder = || {
            RateLimitLayer::builder()
                .key(Header::new(HeaderName::from_static("x-client")))
                .store(store.clone())
                .policy(policy.clone())
        };
        let layer = match feature {
            Feature::Slots => Some(builder().build()?),
            Feature::Attempts => Some(
                builder()
                    .count_when(|response| response.status == http::StatusCode::UNAUTHORIZED)
                    .build()?,
            ),
            _ => None,
        };
        let floor = (feature == Feature::Floor).then(|| match algorithm {
            Algorithm::SlidingLog => Script::from_lua(include_str!("support/floor_log.lua")),
            _ => Script::from_lua(include_str!("support/floor_gcra.lua")),
        });
        Ok(Decider {
            store,
            policy,
            feature,
            layer,
            client,
            floor,
            batch,
        })
    }

    /// `decisions` decisions by `tasks` tasks, each going round the keys; ticket ids from
    /// `first` on. The floor's calls take `batch` keys each.
    async fn run(&self, first: usize, decisions: usize, tasks: usize) -> Result<(), Error> {
        let mut running = Vec::new();
        let each = if self.floor.is_some() { self.batch } else { 1 };
        for t in 0..tasks {
            let decider = self.clone();
            running.push(tokio::spawn(async move {
                for n in (t * each..decisions).step_by(tasks * each) {
                    match &decider.floor {
                        Some(script) => decider.floor(script, n..decisions.min(n + each)).await?,
                        None => decider.decide(n % KEYS, (first + n) as u64).await?,
                    }
                }
                Ok::<_, Error>(())
            }));
        }
        for task in running {
            task.await??;
        }
        Ok(())
    }

    async fn decide(&self, key: usize, id: u64) -> Result<(), Error> {
        let (store, policy) = (&self.store, &self.policy);
        let name = format!("c{key}");
        match (self.feature, &self.layer) {
            (_, Some(layer)) => {
                let service = layer.clone().layer(service_fn(|_: Request<()>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                }));
                let mut request = Request::new(());
                request
                    .headers_mut()
                    .insert("x-client", HeaderValue::from_str(&name)?);
                let response = service.oneshot(request).await?;
                assert!(response.status().is_success(), "{}", response.status());
                response.into_body().collect().await?;
            }
            (Feature::Line, _) => {
                let key = Key::from(name);
                let ticket = Ticket::new(id, Duration::from_secs(1));
                let decision = store.reserve(&key, policy, ticket).await?;
                assert!(decision.is_allowed());
                store.look(&key, policy, ticket).await?;
            }
            (Feature::Peer, _) => {
                let every = Duration::from_millis(1);
                let refused = tower_rate_limit_fred::rate_limit(&self.client, name, 65_535, every);
                assert!(refused.await?.is_none());
            }
            _ => {
                let decision = store.check(&Key::from(name), policy, 1).await?;
                assert!(decision.is_allowed());
            }
        }
        Ok(())
    }

    /// One call of the floor's script over the keys of decisions `range`.
    async fn floor(&self, script: &Script, range: std::ops::Range<usize>) -> Result<(), Error> {
        let keys: Vec<String> = range.map(|n| format!("c{}", n % KEYS)).collect();
        let n = keys.len();
        let reply: Bytes = script.evalsha_with_reload(&self.client, keys, ()).await?;
        assert_eq!(reply.len(), 48 * n + 16);
        Ok(())
    }
}

/// The Redis of the measurement, and under callgrind the server to count instructions of.
struct Redis<'a> {
    url: String,
    client: Client,
    callgrind: Option<&'a Callgrind>,
}

impl<'a> Redis<'a> {
    async fn connect(url: &str, callgrind: Option<&'a Callgrind>) -> Result<Redis<'a>, Error> {
        let client = Client::new(Config::from_url(url)?, None, None, None);
        client.init().await?;
        Ok(Redis {
            url: url.to_owned(),
            client,
            callgrind,
        })
    }

    /// Zeroes the command statistics, and the instruction count under callgrind.
    async fn reset(&self) -> Result<(), Error> {
        let _: () = self
            .client
            .custom(fred::cmd!("CONFIG"), vec!["RESETSTAT"])
            .await?;
        if let Some(server) = self.callgrind {
            server.control("-z")?;
        }
        Ok(())
    }

    async fn cpu_seconds(&self) -> Result<f64, Error> {
        let info: String = self.client.info(Some(InfoKind::Cpu)).await?;
        Ok(support::redis_cpu_seconds(&info))
    }

    /// Instructions since [`reset`](Self::reset), under callgrind.
    fn instructions(&self) -> Result<Option<f64>, Error> {
        self.callgrind.map(Callgrind::instructions).transpose()
    }

    /// `EVALSHA` calls, the scripts' µs, and the other commands (but `INFO` and `CONFIG`) by
    /// name, most called first, since [`reset`](Self::reset).
    async fn commandstats(&self) -> Result<(f64, f64, Vec<(String, f64)>), Error> {
        let info: String = self.client.info(Some(InfoKind::CommandStats)).await?;
        let (mut calls, mut micros, mut each) = (0.0, 0.0, Vec::new());
        for line in info.lines() {
            let stat = line.trim().strip_prefix("cmdstat_");
            let Some((command, fields)) = stat.and_then(|s| s.split_once(':')) else {
                continue;
            };
            let field = |name: &str| {
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix(name))
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            match command {
                "info" | "config|resetstat" => {}
                "evalsha" | "eval" => {
                    calls += field("calls=");
                    micros += field("usec=");
                }
                _ => each.push((command.to_owned(), field("calls="))),
            }
        }
        each.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok((calls, micros, each))
    }
}

/// A `redis-server` under `valgrind --tool=callgrind`, its counting driven by
/// `callgrind_control`; killed and its files removed when dropped.
struct Callgrind {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Callgrind {
    fn start() -> Result<Callgrind, Error> {
        let dir = std::env::temp_dir().join(format!("rl-costs-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let out = dir.join("callgrind.out");
        let mut child = Command::new("valgrind")
            .args(["--tool=callgrind", "--collect-atstart=yes"])
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start valgrind: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline || child.try_wait()?.is_some() {
                let _ = child.kill();
                return Err("redis-server under callgrind did not come up".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Callgrind { child, port, dir })
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn control(&self, what: &str) -> Result<(), Error> {
        let status = Command::new("callgrind_control")
            .args([what, &self.child.id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        match status.success() {
            true => Ok(()),
            false => Err(format!("callgrind_control {what} failed").into()),
        }
    }

    /// Dumps the counts since the last zero and reads their total.
    fn instructions(&self) -> Result<f64, Error> {
        let before = dumps(&self.dir)?.len();
        self.control("-d")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let files = dumps(&self.dir)?;
            if files.len() > before {
                let newest = files.last().ok_or("no dump")?;
                if let Some(total) = total_of(newest)? {
                    return Ok(total);
                }
            }
            if Instant::now() > deadline {
                return Err("callgrind wrote no dump".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Callgrind {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Callgrind's dumps in `dir` (`callgrind.out.<n>`), oldest first.
fn dumps(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let n = path.extension()?.to_str()?.parse().ok()?;
            Some((n, path))
        })
        .collect();
    files.sort();
    Ok(files.into_iter().map(|(_, path)| path).collect())
}

/// The `totals:` (or `summary:`) line of a finished dump.
fn total_of(path: &Path) -> Result<Option<f64>, Error> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .find_map(|line| {
            line.strip_prefix("totals:")
                .or_else(|| line.strip_prefix("summary:"))
        })
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok()))
}
