//! The plain scripts' fast paths against a real Redis: GCRA's request of one limit, decided in
//! locals (`gcra_plain.lua`, `n == 1`), and the sliding log's events read by arithmetic
//! (`log_events.lua`, `event`). Each must decide, write and expire as the full scripts do and
//! as the plain scripts did before (the same sources with the fast path taken out: GCRA's one
//! limit through the loop of several, an event's digits and Redis TIME read with `tonumber`).
//!
//! The scripts are the crate's own files, loaded here as the store loads them, on a clock of
//! the test's own: Redis TIME is read from a hash the test sets to Redis's time before each
//! request, so that every script of one request runs at the same microsecond and their
//! states can be compared byte for byte.
//!
//! Each test prints its figures (`--nocapture`).

use std::time::Duration;

use crate::support::seeded::Lcg;
use crate::support::time::redis_now;
use crate::support::{command_calls, RedisServer};
use bytes::Bytes;
use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use tokio::time::Instant;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::test_util::{plain_args, redis_key};
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

const EXPIRY: &str = include_str!("../../src/store/redis/scripts/expiry.lua");
const EXACT: &str = include_str!("../../src/store/redis/scripts/exact.lua");
const PRELUDE: &str = include_str!("../../src/store/redis/scripts/prelude.lua");
const PLAIN: &str = include_str!("../../src/store/redis/scripts/plain.lua");
const GCRA: &str = include_str!("../../src/store/redis/scripts/gcra.lua");
const GCRA_PLAIN: &str = include_str!("../../src/store/redis/scripts/gcra_plain.lua");
const LOG_EVENTS: &str = include_str!("../../src/store/redis/scripts/log_events.lua");
const LOG_LIGHTEN: &str = include_str!("../../src/store/redis/scripts/log_lighten.lua");
const LOG: &str = include_str!("../../src/store/redis/scripts/sliding_log.lua");
const LOG_PLAIN: &str = include_str!("../../src/store/redis/scripts/sliding_log_plain.lua");
const RETURN: &str = include_str!("../../src/store/redis/scripts/return.lua");

/// The hash the scripts read their time from (see the module's docs).
const CLOCK: &str = "fast:clock";

/// The modes (`prelude.lua`, "Modes").
const LOOK: i64 = 0;
const ADMIT: i64 = 1;
const LEASE: i64 = 2;
/// The limit index of a request a plain script does not decide (`plain.lua`).
const FULL_PATH: i64 = -4;

/// `source` with `from` replaced by `to`, which must occur exactly once.
fn once(source: &str, from: &str, to: &str) -> String {
    assert_eq!(source.matches(from).count(), 1, "{from:?} once");
    source.replacen(from, to, 1)
}

/// `source` reading Redis TIME from [`CLOCK`].
fn on_clock(source: &str) -> String {
    once(
        source,
        "redis.call('TIME')",
        "redis.call('HMGET', 'fast:clock', 's', 'us')",
    )
}

/// `source` as before the event digits and TIME were read by arithmetic: `tonumber`.
fn with_tonumber(source: &str) -> String {
    // `event`'s body, whatever it is now, replaced by the earlier version's.
    let head = "local function event(member)\n";
    let source = match source.find(head) {
        Some(at) => {
            let body = at + head.len();
            let end = body + source[body..].find("\nend\n").expect("event's end");
            format!(
                "{}{}{}",
                &source[..body],
                "  local a = find(member, ':', 1, true)\n  return tonumber(sub(member, 1, a - 1)), tonumber(sub(member, a + 1, a + 16)) or 0,\n    tonumber(sub(member, a + 18)) or 0",
                &source[end..]
            )
        }
        None => source.to_string(),
    };
    once(
        &source,
        "local now = time[1] * 1000000 + time[2]",
        "local now = tonumber(time[1]) * 1000000 + tonumber(time[2])",
    )
}

/// The GCRA scripts: the plain one (one limit in locals), the plain one with that branch taken
/// out (one limit through the loop, as before), and the full one.
fn gcra_sources() -> [String; 3] {
    let fast = format!("{EXPIRY}{EXACT}{PLAIN}{GCRA_PLAIN}");
    let looped = once(&fast, "elseif n == 1 then", "elseif false then");
    let full = format!("{EXPIRY}{EXACT}{PRELUDE}{GCRA}");
    [on_clock(&fast), on_clock(&looped), on_clock(&full)]
}

/// The GCRA script names, in [`gcra_sources`]' order.
const GCRA_NAMES: [&str; 3] = ["plain (one limit in locals)", "plain (loop)", "full"];

/// Loads `sources`; their SHA-1s.
async fn load(client: &Client, sources: &[String]) -> Vec<String> {
    let mut shas = Vec::new();
    for source in sources {
        shas.push(client.script_load(source.as_str()).await.unwrap());
    }
    shas
}

/// Sets the scripts' clock ([`CLOCK`]) to `now` (µs).
async fn set_clock(client: &Client, now: i64) {
    let _: () = client
        .hset(
            CLOCK,
            [
                ("s", (now / 1_000_000).to_string()),
                ("us", (now % 1_000_000).to_string()),
            ],
        )
        .await
        .unwrap();
}

/// One request's arguments (`prelude.lua`, ARGV[1]).
#[derive(Debug, Clone)]
struct Request {
    /// Count and window (µs) of each limit, shortest window first.
    limits: Vec<(i64, i64)>,
    cost: i64,
    mode: i64,
    /// Event time, µs (-1: now).
    t: i64,
    /// A lease's most units (a look's: the cost).
    want: i64,
    /// Headroom, µs (looks and leases).
    h: i64,
    /// An override's count per limit (0: the limit's own), where one applies.
    counts: Option<Vec<i64>>,
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Request {
    /// The arguments, known at generation 0 (the hash of overrides does not exist, which both
    /// tiers trust), with kind COUNTS where `counts` is set, else NONE.
    fn encode(&self) -> Vec<u8> {
        let kind = if self.counts.is_some() { -2 } else { 0 };
        let mut ints = vec![
            self.limits.len() as i64,
            self.cost,
            self.mode,
            self.t,
            0,
            0,
            0,
            0,
            0,
            kind,
            0,
        ];
        if self.mode == LOOK || self.mode == LEASE {
            ints.extend([self.want, self.h]);
        }
        for &(c, w) in &self.limits {
            ints.extend([c, w, gcd(c, w)]);
        }
        if let Some(counts) = &self.counts {
            for (&c, &(_, w)) in counts.iter().zip(&self.limits) {
                ints.extend([c, if c > 0 { gcd(c, w) } else { 0 }]);
            }
        }
        ints.iter().flat_map(|i| i.to_le_bytes()).collect()
    }
}

/// Runs script `sha` on `key` with `args`: the plain tier confirmed at generation 0 for ever,
/// the full one reading the (absent) hash of overrides.
async fn run(
    client: &Client,
    sha: &str,
    full: bool,
    key: &str,
    args: Vec<u8>,
) -> Result<Bytes, String> {
    // A plain script is sent what the store sends it of the request, confirmed at the
    // request's generation (0) for ever.
    let (args, second) = if full {
        (args, Value::from("fast:overrides"))
    } else {
        let confirmation = [0i64.to_le_bytes(), i64::MAX.to_le_bytes()].concat();
        (
            plain_args(&args, 0),
            Value::Bytes(Bytes::from(confirmation)),
        )
    };
    let evalsha = CustomCommand::new_static("EVALSHA", ClusterHash::FirstKey, false);
    let values = vec![
        Value::from(sha),
        Value::from(1),
        Value::from(key),
        Value::Bytes(Bytes::from(args)),
        second,
        Value::Bytes(Bytes::new()),
    ];
    client
        .custom::<Bytes, _>(evalsha, values)
        .await
        .map_err(|e| e.details().to_string())
}

/// The `i`-th integer of a reply.
fn int(reply: &[u8], i: usize) -> i64 {
    i64::from_le_bytes(reply[8 * i..8 * i + 8].try_into().unwrap())
}

/// A reply's six decision integers.
fn six(reply: &[u8]) -> [i64; 6] {
    std::array::from_fn(|i| int(reply, i))
}

/// A key's value (`GET`; none: `None`) and when it expires (`PEXPIRETIME`, ms since the
/// epoch; -1: never, -2: no key). The scripts of one request run a few ms apart in real time,
/// which their expiries differ by.
async fn state(client: &Client, key: &str) -> (Option<Bytes>, i64) {
    let value: Option<Bytes> = client.get(key).await.unwrap();
    (value, expiry(client, key).await)
}

/// When a key of any type expires (`PEXPIRETIME`, as [`state`]).
async fn expiry(client: &Client, key: &str) -> i64 {
    let expires = CustomCommand::new_static("PEXPIRETIME", ClusterHash::FirstKey, false);
    client
        .custom(expires, vec![Value::from(key)])
        .await
        .unwrap()
}

/// What a differential run covered.
#[derive(Default, Debug)]
struct Covered {
    requests: usize,
    admitted: usize,
    refused: usize,
    no_wait_helps: usize,
    leases: usize,
    looks: usize,
    overridden: usize,
    two_limits: usize,
    errors: usize,
    expiry_extended: usize,
}

/// (1) GCRA, one limit, three scripts side by side on three keys that start from the same
/// bytes: the plain script (one limit in locals), the plain script with that branch taken out
/// (the loop, as before it), and the full script. Random requests at the edges the fast path
/// meets: event times a day in the past to ten years in the future, now (-1), costs up to
/// twice the count and `u32::MAX`, headroom up to past the window, looks, admissions and
/// leases, an override's counts above and below the policy's (a backlog reweighed, or the same
/// weight draining slower), a request of two limits on the same key (a state of another
/// length) now and then, buckets near the largest GCRA keeps and one past it (an error).
/// After every request: the six decision integers, the value (`GET`) and the expiry
/// (`PEXPIRETIME`, within the real time the three runs took) are the same on the three keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_limit_gcra_decides_writes_and_expires_as_the_loop_and_the_full_script() {
    let server = RedisServer::start();
    let client = server.client().await;
    let shas = load(&client, &gcra_sources()).await;
    // Count, window (µs): 10/1s (weight 1e5), 30/1s, 7/3s (weight 3e6), 1000/1min, a bucket
    // near MAX_BUCKET (1e15 units, coprime), and one past it.
    let shapes: [(i64, i64); 6] = [
        (10, 1_000_000),
        (30, 1_000_000),
        (7, 3_000_000),
        (1000, 60_000_000),
        (1_000_003, 1_000_000_000),
        (2_000_003, 1_000_000_000),
    ];
    let mut rng = Lcg(53);
    let mut covered = Covered::default();
    let mut differ: Vec<String> = Vec::new();
    let mut slack = 0;
    let mut most_apart = 0;
    for (s, &(c, w)) in shapes.iter().enumerate() {
        let keys: Vec<String> = (0..3).map(|j| format!("{{fast}}:g{s}-{j}")).collect();
        for _ in 0..300 {
            let now = redis_now(&client).await;
            set_clock(&client, now).await;
            let two = rng.next(12) == 0;
            let limits = if two {
                vec![(c, w), (c * 6, w * 60)]
            } else {
                vec![(c, w)]
            };
            let mode = rng.pick(&[LOOK, ADMIT, ADMIT, LEASE]);
            let cost = match rng.next(10) {
                0 => c + 1,
                1 => 2 * c,
                2 => i64::from(u32::MAX),
                3 => c,
                n => (n as i64 - 3).min(c),
            };
            let t = match rng.next(10) {
                0 => -1,
                1 => now - 86_400_000_000,
                2 => now + 315_360_000_000_000,
                3 => now + 3_600_000_000,
                4 => now - rng.next(2 * w as u64) as i64,
                5 => now + rng.next(2 * w as u64) as i64,
                _ => now + rng.next(w as u64 / 10) as i64,
            };
            let h = if mode == ADMIT {
                0
            } else {
                rng.pick(&[0, 0, w / 10, w / 2, w - 1, w + 1])
            };
            let want = if mode == LEASE {
                cost + rng.next(3 * c as u64) as i64
            } else {
                cost
            };
            let counts = match rng.next(6) {
                0 => Some(vec![c * 3; limits.len()]),
                1 => Some(vec![(c / 3).max(1); limits.len()]),
                2 => Some(vec![c * 2 + 1; limits.len()]),
                3 => Some(vec![0; limits.len()]),
                _ => None,
            };
            let request = Request {
                limits,
                cost,
                mode,
                t,
                want,
                h,
                counts,
            };
            let args = request.encode();
            let mut replies = Vec::new();
            let mut states = Vec::new();
            let mut state_before = Vec::new();
            for key in &keys {
                state_before.push(state(&client, key).await.0);
            }
            // The expiries of one request's keys may be as far apart as the real time between
            // the scripts' runs (each sets its expiry from Redis's own clock when it runs),
            // and a few ms more: each is whole ms, from the ms clock Redis read for the call.
            // A request that leaves the expiries as they were keeps an earlier request's
            // difference, so the bound is the longest such time so far.
            let started = redis_now(&client).await;
            for (j, sha) in shas.iter().enumerate() {
                let before = state(&client, &keys[j]).await.1;
                replies.push(run(&client, sha, j == 2, &keys[j], args.clone()).await);
                let after = state(&client, &keys[j]).await;
                let value_kept = after.0 == state_before[j];
                if j == 0 && after.1 > before && before >= 0 && value_kept {
                    if let Ok(r) = &replies[0] {
                        if r[..8] == 0i64.to_le_bytes() {
                            covered.expiry_extended += 1;
                        }
                    }
                }
                states.push(after);
            }
            covered.requests += 1;
            covered.two_limits += usize::from(two);
            covered.overridden += usize::from(request.counts.is_some());
            covered.looks += usize::from(mode == LOOK);
            match &replies[0] {
                Ok(r) => {
                    let d = six(r);
                    if d[0] > 0 {
                        covered.admitted += 1;
                        covered.leases += usize::from(mode == LEASE);
                    } else {
                        covered.refused += 1;
                        covered.no_wait_helps += usize::from(d[4] == -2);
                    }
                }
                Err(_) => covered.errors += 1,
            }
            let decided: Vec<Result<[i64; 6], String>> = replies
                .iter()
                .map(|r| r.as_ref().map(|r| six(r)).map_err(|e| e.clone()))
                .collect();
            // Errors compare by their message, less the script's SHA-1 and line.
            let message = |r: &Result<[i64; 6], String>| match r {
                Ok(d) => format!("{d:?}"),
                Err(e) => {
                    let e = e.split(" script: ").next().unwrap_or(e);
                    let e = e.rsplit("user_script:").next().unwrap_or(e);
                    e.split_once(": ").map_or(e, |(_, m)| m).to_string()
                }
            };
            slack = slack.max((redis_now(&client).await - started) / 1000 + 5);
            let values_alike = states.iter().all(|s| s.0 == states[0].0);
            let apart = states
                .iter()
                .map(|s| (s.1 - states[0].1).abs())
                .max()
                .unwrap();
            let ttls_alike = apart <= slack || states.iter().all(|s| s.1 == states[0].1);
            if states.iter().all(|s| s.1 >= 0) {
                most_apart = most_apart.max(apart);
            }
            let decisions_alike = decided.iter().all(|d| message(d) == message(&decided[0]));
            if !(values_alike && ttls_alike && decisions_alike) {
                differ.push(format!(
                    "{request:?} at now {now}: decisions {:?}; values {:?}; PTTLs {:?}",
                    decided.iter().map(message).collect::<Vec<_>>(),
                    states
                        .iter()
                        .map(|s| s.0.as_ref().map(|v| v.to_vec()))
                        .collect::<Vec<_>>(),
                    states.iter().map(|s| s.1).collect::<Vec<_>>()
                ));
                // Start the three keys again from the fast path's state.
                for key in &keys[1..] {
                    let _: i64 = client
                        .eval(
                            "return redis.call('COPY', KEYS[1], KEYS[2], 'REPLACE')",
                            vec![keys[0].clone(), key.clone()],
                            (),
                        )
                        .await
                        .unwrap();
                }
            }
        }
    }
    eprintln!("{covered:?}; expiries at most {most_apart} ms apart");
    eprintln!(
        "{} of {} requests differ between {GCRA_NAMES:?}; first: {:#?}",
        differ.len(),
        covered.requests,
        differ.iter().take(3).collect::<Vec<_>>()
    );
    assert!(covered.refused > 100 && covered.admitted > 100 && covered.errors > 0);
    assert!(differ.is_empty(), "{} differ", differ.len());
}

/// (2) Never over: four stores on one GCRA key of `50/1s` (plain tier on and off, with and
/// without leases), 16 tasks deciding as fast as they can for 2 s, in three rounds: the
/// unleased stores, the leasing ones, and all four. A GCRA bucket of c admits at most
/// c + c x span / window units over any span (here: from the first decision's start to the
/// last one's end; leased units count when Redis grants them, within the span too).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stores_on_both_tiers_leased_or_not_never_admit_past_the_bucket() {
    let server = RedisServer::start();
    let leases = || Leases::new().period(Duration::from_millis(100));
    let mut stores = Vec::new();
    for (plain, leased) in [(true, false), (false, false), (true, true), (false, true)] {
        // A generous time budget: a busy machine answers late, and a decision that ran out of
        // it would count as neither admitted nor refused here.
        let mut builder = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .plain_scripts(plain);
        if leased {
            builder = builder.leases(leases());
        }
        stores.push(builder.connect().await.unwrap());
    }
    let (count, window) = (50u64, Duration::from_secs(1));
    let policy = Policy::new("hot", [format!("{count}/1s").parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let mut broke = Vec::new();
    for (round, which) in [
        ("unleased", vec![0, 1]),
        ("leased", vec![2, 3]),
        ("all", vec![0, 1, 2, 3]),
    ] {
        let key = Key::from(format!("never-over-{round}"));
        let origin = Instant::now();
        let run = Duration::from_secs(2);
        let mut handles = Vec::new();
        for task in 0..16 {
            let store = stores[which[task % which.len()]].clone();
            let (key, policy) = (key.clone(), policy.clone());
            handles.push(tokio::spawn(async move {
                let (mut admitted, mut decided, mut errors, mut last_end) = (0u64, 0u64, 0u64, 0);
                while origin.elapsed() < run {
                    match store.check(&key, &policy, 1).await {
                        Ok(d) => {
                            decided += 1;
                            admitted += u64::from(d.is_allowed());
                        }
                        Err(_) => errors += 1,
                    }
                    last_end = origin.elapsed().as_micros() as u64;
                }
                (admitted, decided, errors, last_end)
            }));
        }
        let (mut admitted, mut decided, mut errors, mut span) = (0, 0, 0, 0);
        for h in handles {
            let (a, d, e, end) = h.await.unwrap();
            admitted += a;
            decided += d;
            errors += e;
            span = span.max(end);
        }
        let bound = count + count * span / window.as_micros() as u64;
        eprintln!(
            "{round}: {decided} decisions, {admitted} admitted over {span} us (bound {bound}), {errors} errors"
        );
        if admitted > bound || errors > 0 || admitted < count {
            broke.push(format!(
                "{round}: {admitted} admitted, bound {bound}, {errors} errors"
            ));
        }
    }
    assert!(broke.is_empty(), "{broke:?}");
}

/// (3) Expiry at the bucket's edge, on each of the three GCRA scripts: a key filled to its
/// bucket under `c/1s`, then refused under an override's lower count, lives until its backlog
/// drains under that count (its expiry at least the refusal's reset after from when the
/// refusal was sent, less 2 ms): the same
/// weight draining slower (30/1s read as 10/1s: 3 s; 90/1s as 10/1s: 9 s) and another weight
/// (10/1s read as 7/1s, reweighed: about 1.43 s). Then a key with no traffic vanishes after its
/// window (rounded up to an eighth of it): one admission of `5/300ms` on each script, and of
/// `3/300ms` through a store on each tier, leave nothing 450 ms later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_live_until_their_backlog_drains_and_vanish_when_idle() {
    let server = RedisServer::start();
    let client = server.client().await;
    let sources: Vec<String> = gcra_sources()
        .iter()
        .map(|s| {
            once(
                s,
                "redis.call('HMGET', 'fast:clock', 's', 'us')",
                "redis.call('TIME')",
            )
        })
        .collect();
    let shas = load(&client, &sources).await;
    let mut broke = Vec::new();
    for (c, lower) in [(30, 10), (90, 10), (10, 7)] {
        for (j, sha) in shas.iter().enumerate() {
            let key = format!("{{fast}}:edge-{c}-{lower}-{j}");
            let request = |cost, counts| Request {
                limits: vec![(c, 1_000_000)],
                cost,
                mode: ADMIT,
                t: -1,
                want: cost,
                h: 0,
                counts,
            };
            let filled = run(&client, sha, j == 2, &key, request(c, None).encode())
                .await
                .unwrap();
            // The refusal runs after `before`, so its key must expire no sooner than `before`
            // plus the drain it reports, whenever the expiry is read.
            let before = redis_now(&client).await / 1000;
            let refused = run(
                &client,
                sha,
                j == 2,
                &key,
                request(1, Some(vec![lower])).encode(),
            )
            .await
            .unwrap();
            let pttl = state(&client, &key).await.1 - before;
            let drain_ms = (six(&refused)[3] + 999) / 1000;
            eprintln!(
                "{c}/1s filled ({:?}), refused under {lower}/1s ({:?}) on {}: expires {pttl} ms after it was sent, drain {drain_ms} ms",
                six(&filled),
                six(&refused),
                GCRA_NAMES[j]
            );
            if six(&refused)[0] != 0 || pttl < drain_ms - 2 {
                broke.push(format!(
                    "{c}->{lower} on {}: expires {pttl} ms after < drain {drain_ms}",
                    GCRA_NAMES[j]
                ));
            }
        }
    }
    // No traffic: nothing left after the window.
    let mut idle = Vec::new();
    for (j, sha) in shas.iter().enumerate() {
        let key = format!("{{fast}}:idle-{j}");
        let request = Request {
            limits: vec![(5, 300_000)],
            cost: 1,
            mode: ADMIT,
            t: -1,
            want: 1,
            h: 0,
            counts: None,
        };
        run(&client, sha, j == 2, &key, request.encode())
            .await
            .unwrap();
        idle.push(key);
    }
    let policy = Policy::new("idle", ["3/300ms".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    for store in [server.store().await, server.full_scripts_store().await] {
        let key = Key::from("idle");
        // Twice, so that the plain store's second decision is on its plain tier.
        store.check(&key, &policy, 1).await.unwrap();
        store.check(&key, &policy, 1).await.unwrap();
        idle.push(redis_key(&store, &key, &policy));
        let _: () = client.del(redis_key(&store, &key, &policy)).await.unwrap();
        store.check(&key, &policy, 1).await.unwrap();
    }
    let mut ttls = Vec::new();
    for key in &idle {
        ttls.push(client.pttl::<i64, _>(key).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(450)).await;
    let mut left = Vec::new();
    for key in &idle {
        let exists: i64 = client.exists(key).await.unwrap();
        left.push(exists);
    }
    eprintln!(
        "idle keys {idle:?}: PTTL after one admission {ttls:?} ms; left 450 ms later {left:?}"
    );
    // -2: gone already, as a busy machine may read it; -1 would be a key kept for ever. A
    // write's expiry is rounded up to an eighth of the window (`expiry.lua`, `expires_at`):
    // 37 ms of 300.
    if left.iter().any(|e| *e != 0) || ttls.iter().any(|t| *t == -1 || *t > 300 + 37) {
        broke.push(format!("idle: PTTLs {ttls:?}, left {left:?}"));
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// Admits `request` on `key` with script `sha` (`full`: the full tier's arguments) 60 times,
/// 10 ms apart, each on Redis's time: after each, the key must expire no sooner than `span` µs
/// after the admission's time, and no later than `span` after the expiry was read, rounded up
/// to an eighth of the window (`expiry.lua`, `expires_at`: 100 ms of 800), and 2 ms. The script
/// sets the expiry with `command` (`INFO commandstats`) as many times as the expiry moved, and
/// at least 5 of the admissions must keep it. Pushes what broke onto `broke`.
async fn admit_and_read_expiries(
    client: &Client,
    (sha, full, name): (&str, bool, &str),
    key: &str,
    request: &Request,
    (span, command): (i64, &str),
    broke: &mut Vec<String>,
) {
    let (mut kept, mut set, mut last) = (0, 0, -2);
    let calls = command_calls(client, command).await;
    for _ in 0..60 {
        let now = redis_now(client).await;
        set_clock(client, now).await;
        let reply = run(client, sha, full, key, request.encode()).await;
        let expires = expiry(client, key).await;
        let read = redis_now(client).await;
        let (least, most) = ((now + span + 999) / 1000, (read + span) / 1000 + 100 + 2);
        let admitted = reply.as_ref().is_ok_and(|r| six(r)[0] == 1);
        if !admitted || expires < least || expires > most {
            broke.push(format!(
                "{name}: {reply:?} at {now}: expires at {expires} ms, not in {least}..={most}"
            ));
        }
        if expires == last {
            kept += 1;
        } else {
            set += 1;
        }
        last = expires;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let calls = command_calls(client, command).await - calls;
    eprintln!("{name}: {kept} admissions kept the expiry, {set} moved it with {calls} {command}");
    if kept < 5 || set < 3 || calls != set as u64 {
        broke.push(format!(
            "{name}: kept {kept}, moved {set}, {calls} {command}"
        ));
    }
}

/// (5) The expiry writes keep (`expiry.lua`, `expires_at`): a key of `100/800ms` admitted every
/// 10 ms, 60 times, on each of the three GCRA scripts (expiring the window after each
/// admission) and on both sliding-log scripts (twice the window), with the expiry read after
/// each (`admit_and_read_expiries`): most admissions keep the expiry the one before set (SET
/// KEEPTTL, no PEXPIREAT), and every eighth of the window one sets it (PSETEX, PEXPIREAT).
/// Then a give-back (`return.lua`) 250 ms after a GCRA lease, which stamps the state at its
/// own time, moves the key's expiry to the window after it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_keep_an_expiry_that_covers_the_window_after_them() {
    let server = RedisServer::start();
    let client = server.client().await;
    let gcra = load(&client, &gcra_sources()).await;
    let log = load(&client, &log_sources()[..2]).await;
    let window = 800_000i64;
    let request = |mode| Request {
        limits: vec![(100, window)],
        cost: 1,
        mode,
        t: -1,
        want: 5,
        h: 0,
        counts: None,
    };
    let mut broke = Vec::new();
    for (j, sha) in gcra.iter().enumerate() {
        let script = (sha.as_str(), j == 2, GCRA_NAMES[j]);
        let key = format!("{{fast}}:kept-{j}");
        let expiry = (window, "psetex");
        admit_and_read_expiries(&client, script, &key, &request(ADMIT), expiry, &mut broke).await;
    }
    for (j, name) in ["log plain", "log full"].into_iter().enumerate() {
        let script = (log[j].as_str(), j == 1, name);
        let key = format!("{{fast}}:kept-log{j}");
        let expiry = (2 * window, "pexpireat");
        admit_and_read_expiries(&client, script, &key, &request(ADMIT), expiry, &mut broke).await;
    }
    let give_back = load(
        &client,
        &[on_clock(&format!(
            "{EXPIRY}{EXACT}{LOG_EVENTS}{LOG_LIGHTEN}{RETURN}"
        ))],
    )
    .await;
    let key = "{fast}:kept-lease";
    let granted = redis_now(&client).await;
    set_clock(&client, granted).await;
    let lease = run(&client, &gcra[0], false, key, request(LEASE).encode()).await;
    assert!(lease.as_ref().is_ok_and(|r| six(r)[0] > 1), "{lease:?}");
    tokio::time::sleep(Duration::from_millis(250)).await;
    let now = redis_now(&client).await;
    set_clock(&client, now).await;
    let ints = [3i64, 1, 2, granted, 100, window, gcd(100, window)];
    let args: Vec<u8> = ints.iter().flat_map(|i| i.to_le_bytes()).collect();
    let changed: i64 = client
        .evalsha(&give_back[0], vec![key], Value::Bytes(Bytes::from(args)))
        .await
        .unwrap();
    let expires = state(&client, key).await.1;
    let least = (now + window + 999) / 1000;
    eprintln!("give-back at {now}: changed {changed}, expires at {expires} ms, at least {least}");
    if changed != 1 || expires < least {
        broke.push(format!(
            "give-back: changed {changed}, expires {expires} < {least}"
        ));
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// The sliding-log scripts on the clock: plain, full and give-back, as they are and as before
/// (`with_tonumber`).
fn log_sources() -> [String; 6] {
    let plain = format!("{EXPIRY}{PLAIN}{LOG_EVENTS}{LOG_PLAIN}");
    let full = format!("{EXPIRY}{EXACT}{PRELUDE}{LOG_EVENTS}{LOG_LIGHTEN}{LOG}");
    let give_back = format!("{EXPIRY}{EXACT}{LOG_EVENTS}{LOG_LIGHTEN}{RETURN}");
    [
        on_clock(&plain),
        on_clock(&full),
        on_clock(&give_back),
        on_clock(&with_tonumber(&plain)),
        on_clock(&with_tonumber(&full)),
        on_clock(&with_tonumber(&give_back)),
    ]
}

/// A sorted set's members with their scores.
type Events = Vec<(String, f64)>;

/// (4) The log's events of an earlier version, "<time>:<n>" (one member per unit), seeded in a
/// set of `10/10s`, with a few of today's ("<time>:<total>:<weight>") after them, and an
/// earlier version's member of 18 digits: decisions (looks, admissions of cost 1 to 3, leases)
/// on the plain tier (sent on to the full script where it answers FULL_PATH, as the store
/// does) and on the full script alone, and the give-back of a lease's units (`return.lua`),
/// each with the scripts as they are and as before (`tonumber`), on keys that start from the
/// same set: the same replies, members and scores after every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_log_members_read_as_before_by_decisions_and_give_backs() {
    let server = RedisServer::start();
    let client = server.client().await;
    let shas = load(&client, &log_sources()).await;
    let window = 10_000_000i64;
    let mut broke = Vec::new();
    let mut plain_decided = 0;
    let mut sent_on = 0;
    let mut admitted = 0;
    let mut given_back = 0;
    for (round, newer) in [(0, false), (1, true), (2, true)] {
        let now = redis_now(&client).await;
        set_clock(&client, now).await;
        // Keys: [plain then full now, full now, plain then full before, full before].
        let keys: Vec<String> = (0..4).map(|j| format!("{{fast}}:log{round}-{j}")).collect();
        for key in &keys {
            let mut members: Vec<(f64, String)> = Vec::new();
            for i in 0..4i64 {
                let at = now - 6_000_000 + i * 1_000_000;
                members.push((at as f64, format!("{at}:{}", i + 1)));
            }
            if round == 2 {
                let at = now - 5_500_000;
                members.push((at as f64, format!("{at}:123456789012345678")));
            }
            if newer {
                let at = now - 1_000_000;
                members.push((at as f64, format!("{at}:{:016}:{}", 6, 2)));
            }
            let _: i64 = client
                .zadd(key, None, None, false, false, members)
                .await
                .unwrap();
            let _: bool = client.pexpire(key, 30_000, None).await.unwrap();
        }
        let rng = Lcg(round + 1);
        let mut lease_at: Option<(i64, i64)> = None;
        for step in 0..12 {
            let now = redis_now(&client).await;
            set_clock(&client, now).await;
            let give_back = step == 11;
            let mut replies: Vec<Result<Bytes, String>> = Vec::new();
            for (j, key) in keys.iter().enumerate() {
                let before = j >= 2;
                let (plain, full, ret) = if before {
                    (&shas[3], &shas[4], &shas[5])
                } else {
                    (&shas[0], &shas[1], &shas[2])
                };
                if give_back {
                    let Some((granted, units)) = lease_at else {
                        break;
                    };
                    let ints = [4i64, 1, units, granted, 10, window, gcd(10, window)];
                    let args: Vec<u8> = ints.iter().flat_map(|i| i.to_le_bytes()).collect();
                    let r: Result<i64, _> = client
                        .evalsha(
                            ret.as_str(),
                            vec![key.clone()],
                            Value::Bytes(Bytes::from(args)),
                        )
                        .await;
                    replies.push(
                        r.map(|n| Bytes::from(n.to_le_bytes().to_vec()))
                            .map_err(|e| e.details().to_string()),
                    );
                    continue;
                }
                let mut r = rng.for_step(step);
                let mode = r.pick(&[LOOK, ADMIT, ADMIT, LEASE]);
                let cost = 1 + r.next(3) as i64;
                let request = Request {
                    limits: vec![(10, window)],
                    cost,
                    mode,
                    t: -1,
                    want: if mode == LEASE { cost + 2 } else { cost },
                    h: if mode == ADMIT { 0 } else { 100_000 },
                    counts: None,
                };
                let args = request.encode();
                let mut reply = if j % 2 == 0 {
                    run(&client, plain, false, key, args.clone()).await
                } else {
                    run(&client, full, true, key, args.clone()).await
                };
                if j % 2 == 0 {
                    if reply.as_ref().is_ok_and(|r| int(r, 1) == FULL_PATH) {
                        sent_on += 1;
                        reply = run(&client, full, true, key, args).await;
                    } else {
                        plain_decided += 1;
                    }
                }
                if j == 0 {
                    if let Ok(r) = &reply {
                        if int(r, 0) > 0 {
                            admitted += 1;
                            if mode == LEASE {
                                lease_at = Some((now, cost + 2));
                            }
                        }
                    }
                }
                replies.push(reply);
            }
            if give_back && lease_at.is_some() {
                given_back += 1;
            }
            let mut sets: Vec<Events> = Vec::new();
            for key in &keys {
                sets.push(
                    client
                        .zrange(key, 0, -1, None, false, None, true)
                        .await
                        .unwrap(),
                );
            }
            let decided: Vec<Result<Vec<i64>, String>> = replies
                .iter()
                .map(|r| {
                    r.as_ref()
                        .map(|r| (0..r.len().min(48) / 8).map(|i| int(r, i)).collect())
                        .map_err(|e| e.clone())
                })
                .collect();
            if decided.iter().any(|d| d != &decided[0]) || sets.iter().any(|s| s != &sets[0]) {
                broke.push(format!(
                    "round {round} step {step}: replies {decided:?}; sets {sets:?}"
                ));
                break;
            }
        }
    }
    eprintln!(
        "old members: {plain_decided} decided on the plain tier, {sent_on} sent on to the full script, {admitted} admitted, {given_back} give-backs; {} differ: {:#?}",
        broke.len(),
        broke.iter().take(2).collect::<Vec<_>>()
    );
    assert!(sent_on > 0 && admitted > 0);
    assert!(broke.is_empty(), "{broke:#?}");
}

impl Lcg {
    /// The generator of step `step`: every key of a step gets the same request.
    fn for_step(&self, step: u64) -> Lcg {
        Lcg(self.0 ^ (step + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}
