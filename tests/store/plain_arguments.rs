//! The plain tier's own arguments: a plain call carries of each request only what the plain
//! scripts read (n, cost, mode, event time, kind, a look's or a lease's want and headroom, the
//! limits, an override's counts), and a request the plain tier must not decide is sent to be
//! answered `FULL_PATH`. Checked by: calls of several requests of every mode and kind (counts
//! on some limits only, 0 keeping a limit's own) replayed on both tiers under one clock,
//! which leave the same bytes; a store deciding keys of every kind of override in batches of
//! eight, which follows each change of override within the bound (`docs/promises.md`); plain
//! calls held in a stalled connection, and requests queued behind one, which decide nothing
//! by old counts and nothing twice; a lane mixing requests of both tiers, which answers as
//! the full scripts alone; and a Redis Cluster slot moved under plain calls of every kind.
//!
//! Each test prints its figures (`--nocapture`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::monitor::evalsha_seen;
use crate::support::time::redis_now;
use crate::support::RedisServer;
use bytes::Bytes;
use fred::prelude::*;
use tokio::time::Instant;
use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::test_util::plain_args;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore, Store};

/// The bound on following an override (`docs/promises.md`).
const FOLLOW: Duration = Duration::from_millis(250);

/// A sorted set's members with their scores.
type Events = Vec<(String, f64)>;

/// One decision's record: key number, round, and whether it was admitted (or its error).
type Entry = (usize, usize, Result<bool, String>);

/// Tasks checking keys `0..keys` of a policy through a store, one decision of cost 1 started
/// every `every` per key, each on the key of the round at hand (`key(n, round)`), until
/// stopped; every answer is recorded.
struct Checks {
    log: Arc<Mutex<Vec<Entry>>>,
    stop: Arc<AtomicBool>,
    round: Arc<AtomicUsize>,
    handles: Vec<tokio::task::JoinHandle<()>>,
}

impl Checks {
    fn start(
        store: &RedisStore,
        policy: &Policy,
        keys: usize,
        every: Duration,
        key: fn(usize, usize) -> Key,
    ) -> Checks {
        let log: Arc<Mutex<Vec<Entry>>> = Arc::default();
        let (stop, round) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        let mut handles = Vec::new();
        for n in 0..keys {
            let (store, policy) = (store.clone(), policy.clone());
            let (log, stop, round) = (Arc::clone(&log), Arc::clone(&stop), Arc::clone(&round));
            handles.push(tokio::spawn(async move {
                let mut inner = Vec::new();
                while !stop.load(Relaxed) {
                    let r = round.load(Relaxed);
                    let (store, k, policy) = (store.clone(), key(n, r), policy.clone());
                    let log = Arc::clone(&log);
                    inner.push(tokio::spawn(async move {
                        let got = store.check(&k, &policy, 1).await;
                        let got = got.map(|g| g.is_allowed()).map_err(|e| e.to_string());
                        log.lock().unwrap().push((n, r, got));
                    }));
                    tokio::time::sleep(every).await;
                }
                for h in inner {
                    h.await.unwrap();
                }
            }));
        }
        Checks {
            log,
            stop,
            round,
            handles,
        }
    }

    /// Moves the checks on to round `r`'s keys.
    fn round(&self, r: usize) {
        self.round.store(r, Relaxed);
    }

    /// Stops the checks, waits for every decision started, and answers the record.
    async fn stop(self) -> Vec<Entry> {
        self.stop.store(true, Relaxed);
        for h in self.handles {
            h.await.unwrap();
        }
        let log = self.log.lock().unwrap();
        log.clone()
    }
}

/// Store D of the stall tests: the plain tier, batches of at most eight and a 3 s budget,
/// behind a proxy of its own to `server`, with at most `in_flight` calls under way where given.
async fn behind_proxy(
    server: &RedisServer,
    in_flight: Option<usize>,
) -> (RedisStore, crate::support::proxy::Proxy) {
    let proxy = crate::support::proxy::Proxy::start(server.port()).await;
    let mut builder = RedisStore::builder(proxy.url())
        .max_batch(8)
        .timeout(Duration::from_secs(3));
    if let Some(in_flight) = in_flight {
        builder = builder.max_in_flight(in_flight);
    }
    (builder.connect().await.unwrap(), proxy)
}

fn ints(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn to_bytes(ints: &[i64]) -> Vec<u8> {
    ints.iter().flat_map(|i| i.to_le_bytes()).collect()
}

fn gcd(mut a: i64, mut b: i64) -> i64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

/// One request of a replayed call: the full arguments' fields this test varies.
#[derive(Debug, Clone)]
struct Request {
    cost: i64,
    /// 0 LOOK, 1 ADMIT, 2 LEASE.
    mode: i64,
    want: i64,
    headroom: i64,
    /// 0 NONE, -1 BLOCK, -2 COUNTS.
    kind: i64,
    /// An override's count of each limit (0: the limit's own), where kind is COUNTS.
    counts: Vec<i64>,
    /// The generation the request was resolved at (0: the call's).
    known: i64,
    attempt: i64,
}

impl Request {
    /// Whether the plain tier must send it to the full one: resolved at another generation,
    /// or an attempt.
    fn full_path(&self) -> bool {
        self.known != 0 || self.attempt != 0
    }

    /// Its full arguments (`prelude.lua`, ARGV[1]) at event time `at`, from a captured
    /// request's head `head` and limits `limits` (count, window, scale each).
    fn full(&self, head: &[i64], limits: &[[i64; 3]], at: i64) -> Vec<u8> {
        let n = limits.len() as i64;
        let mut out = vec![
            n,
            self.cost,
            self.mode,
            at,
            head[4],
            head[5],
            head[6],
            head[7],
            self.known,
            self.kind,
            self.attempt,
        ];
        if self.mode != 1 {
            out.extend([self.want, self.headroom]);
        }
        for l in limits {
            out.extend(l);
        }
        if self.kind == -2 {
            for (c, l) in self.counts.iter().zip(limits) {
                out.extend([*c, if *c > 0 { gcd(*c, l[1]) } else { 0 }]);
            }
        }
        to_bytes(&out)
    }
}

/// (1) Calls of six requests each, on six keys, mixing every mode the plain tier decides
/// (a look, an admission, a lease with want and headroom), every kind of override (none, a
/// block, counts on some of three limits only, 0 keeping the limit's own, one above the
/// policy's), and requests it must not decide (resolved at another generation; an attempt),
/// at one event time per call. Each call is sent to the plain script as the store sends it
/// (each request's plain arguments one after the other), and each request alone to the full
/// script on a twin key; a request answered `FULL_PATH` is then sent to the full script on
/// its own key, as the store does. After every call the six replies and the twelve keys'
/// bytes are alike, pair by pair, and `FULL_PATH` answers exactly the requests it must.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_of_every_mode_and_kind_leave_the_same_bytes_on_both_tiers() {
    let server = RedisServer::start();
    let admin = server.client().await;
    let plain = server.store().await;
    let full = server.full_scripts_store().await;
    let mut broke = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let policy = Policy::new(
            "mix",
            [
                "6/1s".parse().unwrap(),
                "20/10s".parse().unwrap(),
                "60/1m".parse().unwrap(),
            ],
        )
        .unwrap()
        .with_algorithm(algorithm);
        let key = Key::from(format!("mix-{algorithm:?}"));
        let (p, f, k, pol) = (plain.clone(), full.clone(), key.clone(), policy.clone());
        let calls = evalsha_seen(server.port(), async move {
            f.check(&k, &pol, 1).await.unwrap();
            for _ in 0..3 {
                p.check(&k, &pol, 1).await.unwrap();
            }
        })
        .await;
        let full_sha = calls[0][1].clone();
        let Some(plain_sha) = calls.iter().map(|c| c[1].clone()).find(|s| *s != full_sha) else {
            broke.push(format!(
                "{algorithm:?}: no plain call among {}",
                calls.len()
            ));
            continue;
        };
        let captured = ints(&calls[0][4]);
        let head = &captured[..11];
        let limits: Vec<[i64; 3]> = captured[11..11 + 9]
            .chunks_exact(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect();
        let (hash_name, heads) = (calls[0][5].clone(), calls[0][6].clone());
        eprintln!("{algorithm:?}: captured head {head:?}, limits {limits:?}");
        let for_ever = to_bytes(&[0, i64::MAX]);
        let evalsha = |sha: Vec<u8>, keys: Vec<String>, argv: Vec<Vec<u8>>| {
            let admin = admin.clone();
            async move {
                let args: Vec<Value> = argv
                    .into_iter()
                    .map(|a| Value::Bytes(Bytes::from(a)))
                    .collect();
                let sha = String::from_utf8(sha).unwrap();
                let reply: Result<Bytes, _> = admin.evalsha(sha, keys, args).await;
                reply
            }
        };
        let x = |i: usize| format!("{{mix}}:x{i}-{algorithm:?}");
        let y = |i: usize| format!("{{mix}}:y{i}-{algorithm:?}");
        let base = redis_now(&admin).await + 1_000_000;
        let mut seed: u64 = 11;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        let (mut differ, mut admitted, mut full_paths, mut leased) =
            (Vec::<String>::new(), 0, 0, 0);
        let mut lease_times_apart = 0;
        // A key's GCRA state keeps its creation time (Redis time): each twin starts as a copy
        // of the key's first state.
        let mut seeded = [false; 6];
        let count_sets = [
            vec![3, 0, 0],
            vec![0, 0, 7],
            vec![2, 30, 0],
            vec![0, 0, 0],
            vec![12, 0, 90],
        ];
        for round in 0..80i64 {
            let at = base + round * 120_000;
            let requests: Vec<Request> = (0..6)
                .map(|i| {
                    let cost = next(3) as i64 + 1;
                    let mode = [1, 1, 2, 0][next(4) as usize];
                    let kind = match (i + round as usize) % 6 {
                        0 | 1 => 0,
                        2 => -1,
                        _ => -2,
                    };
                    let odd = next(16);
                    Request {
                        cost,
                        mode,
                        want: cost + if mode == 2 { next(5) as i64 } else { 0 },
                        headroom: [0, 0, 40_000, 250_000][next(4) as usize],
                        kind,
                        counts: count_sets[next(count_sets.len() as u64) as usize].clone(),
                        known: if odd == 0 { 7 } else { 0 },
                        attempt: if odd == 1 && mode == 1 { 3 } else { 0 },
                    }
                })
                .collect();
            let fulls: Vec<Vec<u8>> = requests.iter().map(|r| r.full(head, &limits, at)).collect();
            // The plain call: each request's plain arguments, in a call confirmed at 0.
            let plain_argv: Vec<u8> = fulls.iter().flat_map(|a| plain_args(a, 0)).collect();
            let keys: Vec<String> = (0..6).map(x).collect();
            let rp = match evalsha(
                plain_sha.clone(),
                keys,
                vec![plain_argv, for_ever.clone(), heads.clone()],
            )
            .await
            {
                Ok(r) => r,
                Err(e) => {
                    broke.push(format!("{algorithm:?} #{round}: plain call failed: {e}"));
                    break;
                }
            };
            for (i, (r, args)) in requests.iter().zip(&fulls).enumerate() {
                let mut answer_p = rp[48 * i..48 * i + 48].to_vec();
                let is_full_path = ints(&answer_p)[1] == -4;
                if is_full_path != r.full_path() {
                    differ.push(format!(
                        "#{round}.{i} FULL_PATH {is_full_path}, expected {}: {r:?}",
                        r.full_path()
                    ));
                }
                if is_full_path {
                    full_paths += 1;
                    let again = evalsha(
                        full_sha.clone(),
                        vec![x(i)],
                        vec![args.clone(), hash_name.clone(), heads.clone()],
                    )
                    .await
                    .unwrap();
                    answer_p = again[..48].to_vec();
                }
                let rf = evalsha(
                    full_sha.clone(),
                    vec![y(i)],
                    vec![args.clone(), hash_name.clone(), heads.clone()],
                )
                .await
                .unwrap();
                if !seeded[i] {
                    let made: i64 = admin.exists(x(i)).await.unwrap();
                    if made > 0 {
                        let _: i64 = admin
                            .eval(
                                "return redis.call('COPY', KEYS[1], KEYS[2], 'REPLACE')",
                                vec![x(i), y(i)],
                                (),
                            )
                            .await
                            .unwrap();
                        seeded[i] = true;
                    }
                }
                let (ip, iff) = (ints(&answer_p), ints(&rf[..48]));
                admitted += usize::from(ip[0] > 0);
                leased += usize::from(ip[0] > 1);
                if ip != iff {
                    differ.push(format!("#{round}.{i} replies {ip:?} / {iff:?}: {r:?}"));
                }
                let same = match algorithm {
                    Algorithm::SlidingLog => {
                        let (zx, zy): (Events, Events) = (
                            admin
                                .zrange(x(i), 0, -1, None, false, None, true)
                                .await
                                .unwrap(),
                            admin
                                .zrange(y(i), 0, -1, None, false, None, true)
                                .await
                                .unwrap(),
                        );
                        zx == zy
                    }
                    _ => {
                        let (gx, gy): (Option<Bytes>, Option<Bytes>) = (
                            admin.get(x(i)).await.unwrap(),
                            admin.get(y(i)).await.unwrap(),
                        );
                        // The last lease's time is Redis's time of the call, not the event
                        // time: the twins' calls run apart, so it is compared by its presence.
                        let cut = |g: &Option<Bytes>| {
                            g.as_deref().map(|g| {
                                let mut v = ints(g);
                                v.pop();
                                v
                            })
                        };
                        lease_times_apart += usize::from(gx != gy);
                        cut(&gx) == cut(&gy)
                    }
                };
                if !same {
                    differ.push(format!("#{round}.{i} state differs after {r:?}"));
                }
            }
        }
        eprintln!(
            "{algorithm:?}: 480 requests in 80 plain calls of 6; {admitted} admitted ({leased} leased beyond the cost), {full_paths} FULL_PATH; {lease_times_apart} states apart by the last lease's time alone; {} differences {:#?}",
            differ.len(),
            differ.iter().take(5).collect::<Vec<_>>()
        );
        if !differ.is_empty() || admitted == 0 || full_paths == 0 || leased == 0 {
            broke.push(format!("{algorithm:?}: {} differ, {admitted} admitted, {full_paths} full paths, {leased} leased", differ.len()));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// The sha of the full script among `calls` (a call whose first request's arguments are the
/// full ones: eleven integers, the mode at the third, the kind at the tenth), if any.
fn a_full_sha(calls: &[Vec<Vec<u8>>]) -> Option<Vec<u8>> {
    calls.iter().find_map(|c| {
        let keys: usize = std::str::from_utf8(&c[2]).ok()?.parse().ok()?;
        let argv = ints(c.get(3 + keys)?);
        let n = usize::try_from(*argv.first()?).ok()?;
        // A full request is 11 + the mode's own + 3n (+ 2n) integers; a plain one 5 + ...
        let full_len = 11 + [2, 0, 2][usize::try_from(argv[2]).ok()?.min(2)] + 3 * n;
        (keys == 1 && (argv.len() == full_len || argv.len() == full_len + 2 * n))
            .then(|| c[1].clone())
    })
}

/// The kinds of override of the requests a plain call `call` (its `EVALSHA` arguments)
/// carries, as `scripts/plain.lua` reads them (a request sent full reads as kind 0, n -1).
fn plain_kinds(call: &[Vec<u8>]) -> Vec<i64> {
    let keys: usize = std::str::from_utf8(&call[2]).unwrap().parse().unwrap();
    let argv = ints(&call[3 + keys]);
    let (mut kinds, mut at) = (Vec::new(), 0);
    while at + 5 <= argv.len() {
        let (n, mode, kind) = (argv[at], argv[at + 2], argv[at + 4]);
        at += 5;
        if n < 0 {
            kinds.push(-9);
            continue;
        }
        let n = n as usize;
        at += if mode == 0 || mode == 2 { 2 } else { 0 } + 3 * n;
        at += if kind == -2 { 2 * n } else { 0 };
        kinds.push(kind);
    }
    kinds
}

/// What one key's decisions saw: (start since the origin, admitted), errors apart.
type Seen = Arc<Mutex<Vec<(Duration, Result<bool, String>)>>>;

/// (2) Twelve keys of one two-limit policy decided by B (plain tier, batches of at most
/// eight) as fast as one task per key goes, so that calls mix requests of every kind: four
/// keys with no override, four blocked, four under counts set on the hour's limit alone (3,
/// the day's kept). Then A changes every key's override, one after the other: two free keys
/// blocked, two lowered to 2 an hour (each already far past it), the blocks removed, and the
/// counts raised to 500. For each key: no decision B started 250 ms or more after its write
/// goes by the old value (an admission of a key blocked or lowered, a refusal of a key
/// unblocked or raised), and before the change the blocked keys admit nothing and the counted
/// ones at most 3 each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_override_in_one_batch_is_followed() {
    let server = RedisServer::start();
    let a = server.store().await;
    let b = RedisStore::builder(server.url())
        .max_batch(8)
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let mut broke = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let api = Policy::new(
            "mixed",
            ["1000/1h".parse().unwrap(), "100000/1d".parse().unwrap()],
        )
        .unwrap()
        .with_algorithm(algorithm);
        let keys: Vec<Key> = (0..12)
            .map(|i| Key::from(format!("kinds-{algorithm:?}-{i}")))
            .collect();
        let o = a.overrides();
        let hour_count = |n: u64| Override::Limits(vec![format!("{n}/1h").parse().unwrap()]);
        for key in &keys[4..8] {
            o.set(&api, &Scope::Key(key.clone()), &Override::Block)
                .await
                .unwrap();
        }
        for key in &keys[8..12] {
            o.set(&api, &Scope::Key(key.clone()), &hour_count(3))
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let origin = Instant::now();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let logs: Vec<Seen> = keys.iter().map(|_| Seen::default()).collect();
        let mut handles = Vec::new();
        for (key, log) in keys.iter().zip(&logs) {
            let (b, key, api, log, stop) = (
                b.clone(),
                key.clone(),
                api.clone(),
                log.clone(),
                stop.clone(),
            );
            handles.push(tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let start = origin.elapsed();
                    let d = b.check(&key, &api, 1).await;
                    let d = d.map(|d| d.is_allowed()).map_err(|e| e.to_string());
                    log.lock().unwrap().push((start, d));
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
            }));
        }
        // What B's plain calls carried meanwhile: calls of several requests of several kinds.
        let calls = evalsha_seen(server.port(), async {
            tokio::time::sleep(Duration::from_millis(200)).await;
        })
        .await;
        let full_sha = a_full_sha(&calls);
        let plain_calls: Vec<Vec<i64>> = calls
            .iter()
            .filter(|c| Some(&c[1]) != full_sha.as_ref())
            .map(|c| plain_kinds(c))
            .collect();
        let mixed = plain_calls
            .iter()
            .filter(|kinds| kinds.iter().any(|k| *k != kinds[0]))
            .count();
        let most = plain_calls.iter().map(Vec::len).max().unwrap_or(0);
        eprintln!(
            "{algorithm:?}: {} calls seen in 200 ms, {} plain ones, {mixed} of them of requests of several kinds, the largest of {most} requests",
            calls.len(),
            plain_calls.len()
        );
        if mixed == 0 {
            broke.push(format!("{algorithm:?}: no plain call mixed kinds"));
        }
        // The changes, one key after the other: (key, when written, whether it now admits).
        let mut writes: Vec<(usize, Duration, Duration, bool)> = Vec::new();
        let plan: Vec<(usize, Option<Override>, bool)> = vec![
            (0, Some(Override::Block), false),
            (1, Some(Override::Block), false),
            (2, Some(hour_count(2)), false),
            (3, Some(hour_count(2)), false),
            (4, None, true),
            (5, None, true),
            (6, None, true),
            (7, None, true),
            (8, Some(hour_count(500)), true),
            (9, Some(hour_count(500)), true),
            (10, Some(hour_count(500)), true),
            (11, Some(hour_count(500)), true),
        ];
        for (i, value, admits) in plan {
            let scope = Scope::Key(keys[i].clone());
            let before = origin.elapsed();
            match value {
                Some(v) => o.set(&api, &scope, &v).await.unwrap(),
                None => {
                    o.remove(&api, &scope).await.unwrap();
                }
            }
            writes.push((i, before, origin.elapsed(), admits));
            tokio::time::sleep(Duration::from_millis(7)).await;
        }
        tokio::time::sleep(3 * FOLLOW).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for h in handles {
            h.await.unwrap();
        }
        let (mut decisions, mut errors, mut worst) = (0, 0, Duration::ZERO);
        let mut firsts = Vec::new();
        for (i, begun, written, admits) in &writes {
            let log = logs[*i].lock().unwrap().clone();
            decisions += log.len();
            errors += log.iter().filter(|(_, d)| d.is_err()).count();
            let before: Vec<bool> = log
                .iter()
                .filter(|(s, _)| *s < *begun)
                .filter_map(|(_, d)| d.clone().ok())
                .collect();
            let admitted_before = before.iter().filter(|a| **a).count();
            let expected_before = match i {
                0..=3 => before.len(),
                4..=7 => 0,
                _ => before.len().min(3),
            };
            if admitted_before != expected_before {
                broke.push(format!(
                    "{algorithm:?} key {i}: {admitted_before} of {} admitted before its change, expected {expected_before}",
                    before.len()
                ));
            }
            // The last decision that went by the old value, and the first by the new one,
            // since the write returned.
            let old: Vec<Duration> = log
                .iter()
                .filter(|(s, d)| *s >= *begun && *d == Ok(!admits))
                .map(|(s, _)| s.saturating_sub(*written))
                .collect();
            let last_old = old.iter().max().copied().unwrap_or_default();
            let first_new = log
                .iter()
                .filter(|(s, d)| *s >= *begun && *d == Ok(*admits))
                .map(|(s, _)| s.saturating_sub(*written))
                .min();
            worst = worst.max(last_old);
            firsts.push(first_new.map(|f| f.as_millis()));
            let after = log.iter().filter(|(s, _)| *s >= *written + FOLLOW).count();
            if last_old >= FOLLOW || after == 0 {
                broke.push(format!(
                    "{algorithm:?} key {i}: old value used {last_old:?} after its write, {after} decisions started 250 ms or more after it"
                ));
            }
        }
        eprintln!(
            "{algorithm:?}: {decisions} decisions, {errors} errors; latest decision by an old value {worst:?} after its write; first by the new one (ms) per key {firsts:?}"
        );
        if errors > 0 {
            broke.push(format!("{algorithm:?}: {errors} errors"));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (3) A stalled connection around overrides of every kind. Store D (plain tier, batches of
/// at most eight, a 3 s budget) behind a proxy decides six keys of one two-limit sliding-log
/// policy, one decision started every 2 ms per key: two keys with no override, two with
/// counts set on the hour's limit alone, two on both limits, all far above what the run
/// takes. In each of three rounds (fresh keys) the proxy stops passing traffic; 2 ms later A
/// (direct) lowers every key to 1 an hour (each far past it); 1 s later the proxy passes
/// traffic again. The plain calls held in the proxy carry the old counts (or none): Redis
/// runs them past their confirmation's time, so they decide nothing; no event is recorded
/// 250 ms or more after a key's write. And nothing is counted twice: every key holds exactly
/// as many events as D was told admissions (no decision fails within the budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_around_overrides_of_every_kind_decides_nothing_by_old_counts() {
    use tower_redis_ratelimit::test_util::redis_key;
    let server = RedisServer::start();
    let admin = server.client().await;
    let a = server.store().await;
    let (d, proxy) = behind_proxy(&server, None).await;
    let api = Policy::new(
        "stalled",
        [
            "1000000/1h".parse().unwrap(),
            "10000000/1d".parse().unwrap(),
        ],
    )
    .unwrap()
    .with_algorithm(Algorithm::SlidingLog);
    let key = |n: usize, round: usize| Key::from(format!("st{n}-{round}"));
    let o = a.overrides();
    let limits =
        |text: &str| Override::Limits(text.split('+').map(|l| l.parse().unwrap()).collect());
    let rounds = 3;
    for r in 0..rounds {
        for n in 2..4 {
            o.set(&api, &Scope::Key(key(n, r)), &limits("900000/1h"))
                .await
                .unwrap();
        }
        for n in 4..6 {
            o.set(
                &api,
                &Scope::Key(key(n, r)),
                &limits("800000/1h+9000000/1d"),
            )
            .await
            .unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let checks = Checks::start(&d, &api, 6, Duration::from_millis(2), key);
    // Each key's write: (round, key, Redis time just after it).
    let mut writes = Vec::new();
    for r in 0..rounds {
        checks.round(r);
        tokio::time::sleep(Duration::from_millis(400)).await;
        proxy.pause();
        tokio::time::sleep(Duration::from_millis(2)).await;
        for n in 0..6 {
            o.set(&api, &Scope::Key(key(n, r)), &limits("1/1h"))
                .await
                .unwrap();
            writes.push((r, n, redis_now(&admin).await));
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
        proxy.resume();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let log = checks.stop().await;
    let errors = log.iter().filter(|e| e.2.is_err()).count();
    let (mut late, mut after, mut latest, mut twice) = (0, 0, None::<i64>, Vec::new());
    let mut per_kind = [0usize; 3];
    for (r, n, w_redis) in &writes {
        let rkey = redis_key(&d, &key(*n, *r), &api);
        let events: Events = admin
            .zrangebyscore(&rkey, *w_redis as f64, f64::INFINITY, true, None)
            .await
            .unwrap();
        for (_, score) in &events {
            let since = (*score as i64 - w_redis) / 1000;
            after += 1;
            per_kind[n / 2] += 1;
            latest = latest.max(Some(since));
            late += usize::from(since >= FOLLOW.as_millis() as i64);
        }
        let all: i64 = admin.zcard(&rkey).await.unwrap();
        let told = log
            .iter()
            .filter(|e| e.0 == *n && e.1 == *r && e.2 == Ok(true))
            .count();
        if all as usize != told {
            twice.push(format!(
                "round {r} key {n}: {all} events, {told} admissions"
            ));
        }
    }
    eprintln!(
        "{} decisions, {errors} errors; {after} events recorded after a key's write by the old counts (none, hour, both: {per_kind:?}), {late} of them 250 ms or more after it, the latest {latest:?} ms after it; events vs admissions told apart: {twice:?}",
        log.len()
    );
    assert!(errors == 0 && late == 0 && twice.is_empty());
}

/// What one key's operations were answered: (admitted, limit, remaining, boxed) each.
type Answers = Vec<Result<(bool, u64, u64, bool), String>>;

/// The answers of `store` to sixteen keys' operations, the keys run at once (so that a store
/// with batches mixes them in its calls), each key's operations one after the other: a key
/// `i` goes under `policies[i % 4]` and does checks of cost 1 or 2, peeks, and, under a
/// sliding log, events at fixed times (`events_at` on).
async fn answers_of(
    store: &RedisStore,
    policies: &[Policy; 4],
    algorithm: Algorithm,
    events_at: std::time::SystemTime,
) -> Vec<Answers> {
    let mut handles = Vec::new();
    for i in 0..16usize {
        let (store, policy) = (store.clone(), policies[i % 4].clone());
        let key = Key::from(format!("ref-{algorithm:?}-{i}"));
        handles.push(tokio::spawn(async move {
            let mut out = Answers::new();
            let mut seed = i as u64 * 7919 + 1;
            for op in 0..24u64 {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let cost = (seed >> 33) as u32 % 2 + 1;
                let got = match (seed >> 40) % 5 {
                    0 => store.peek(&key, &policy, cost).await,
                    1 if algorithm == Algorithm::SlidingLog => {
                        let at = events_at + Duration::from_millis(op * 10);
                        store.check_at(&key, &policy, cost, at).await
                    }
                    _ => store.check(&key, &policy, cost).await,
                };
                out.push(
                    got.map(|d| (d.is_allowed(), d.limit(), d.remaining(), d.in_penalty_box()))
                        .map_err(|e| e.to_string()),
                );
            }
            out
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.push(h.await.unwrap());
    }
    all
}

/// (4) One lane's calls mixing what the plain tier decides and what it must not: sixteen keys
/// at once through P (plain tier, batches of at most eight), under four policies of two
/// limits (10 an hour, 50 a day): none overridden; counts of 4 set on the hour alone; a
/// penalty box (full tier, refused keys boxed for a minute); blocked. Each key checks (cost 1
/// or 2) and peeks, and under a sliding log also decides events at fixed times (full tier),
/// 24 operations one after the other. R, on a Redis of its own with the same overrides,
/// runs the full scripts alone. Every answer (admitted, limit, remaining, boxed) is R's, and
/// no key admits more units than its count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_mixing_both_tiers_answers_as_the_full_scripts_alone() {
    let (ps, rs) = (RedisServer::start(), RedisServer::start());
    let p = RedisStore::builder(ps.url())
        .max_batch(8)
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let r = RedisStore::builder(rs.url())
        .plain_scripts(false)
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let events_at = std::time::SystemTime::now() + Duration::from_secs(5);
    let mut broke = Vec::new();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
        let policy = |name: &str| {
            Policy::new(name, ["10/1h".parse().unwrap(), "50/1d".parse().unwrap()])
                .unwrap()
                .with_algorithm(algorithm)
        };
        let policies = [
            policy("free"),
            policy("counted"),
            policy("boxed").block_for(Duration::from_secs(60)).unwrap(),
            policy("blocked"),
        ];
        for store in [&p, &r] {
            for i in 0..16usize {
                let key = Key::from(format!("ref-{algorithm:?}-{i}"));
                let o = store.overrides();
                match i % 4 {
                    1 => o
                        .set(
                            &policies[1],
                            &Scope::Key(key),
                            &Override::Limits(vec!["4/1h".parse().unwrap()]),
                        )
                        .await
                        .unwrap(),
                    3 => o
                        .set(&policies[3], &Scope::Key(key), &Override::Block)
                        .await
                        .unwrap(),
                    _ => {}
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        // P's lane confirmed: its requests go plain from the first.
        let warm = Key::from(format!("warm-{algorithm:?}"));
        p.check(&warm, &policies[0], 1).await.unwrap();
        let (got, want) = (
            answers_of(&p, &policies, algorithm, events_at).await,
            answers_of(&r, &policies, algorithm, events_at).await,
        );
        let (mut differ, mut admitted, mut over) = (Vec::new(), 0, Vec::new());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            for (op, (a, b)) in g.iter().zip(w).enumerate() {
                if a != b {
                    differ.push(format!("key {i} op {op}: {a:?} / {b:?}"));
                }
            }
            let units: u64 = g.iter().filter(|a| matches!(a, Ok((true, ..)))).count() as u64;
            admitted += units;
            let count = match i % 4 {
                1 => 4,
                3 => 0,
                _ => 10,
            };
            // Admissions of cost 1 or 2 (peeks too), so at most the count admissions.
            if units > count * 2 {
                over.push(format!("key {i}: {units}"));
            }
        }
        eprintln!(
            "{algorithm:?}: 16 keys x 24 operations; {admitted} admitted through P; {} answers differ from R's {:#?}; over {over:?}",
            differ.len(),
            differ.iter().take(5).collect::<Vec<_>>()
        );
        if !differ.is_empty() || !over.is_empty() || admitted == 0 {
            broke.push(format!(
                "{algorithm:?}: {} differ, over {over:?}",
                differ.len()
            ));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (5) Requests queued behind a stalled call. Store D (plain tier, one call under way at a
/// time, batches of at most eight, a 3 s budget) behind a proxy decides four keys of a
/// sliding-log policy, one decision started every ms per key. The proxy stops passing
/// traffic; 2 ms later A (direct) blocks the policy; 1 s later the proxy passes traffic
/// again. Meanwhile about a thousand requests queue in D's lane behind the held call, those
/// of the stall's first 250 ms resolved (no override) while the old generation was
/// confirmed and sent to the plain tier. No event is recorded 250 ms or more after the block
/// and before its removal 600 ms after the proxy passes traffic again (three rounds, fresh
/// keys each), and every key holds exactly as many events as D was told
/// admissions (nothing decided twice on its way from the plain tier to the full one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_stall_are_not_decided_by_their_old_resolution() {
    use tower_redis_ratelimit::test_util::redis_key;
    let server = RedisServer::start();
    let admin = server.client().await;
    let a = server.store().await;
    let (d, proxy) = behind_proxy(&server, Some(1)).await;
    let api = Policy::new("queued", ["1000000/1h".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let key = |n: usize, round: usize| Key::from(format!("q{n}-{round}"));
    let checks = Checks::start(&d, &api, 4, Duration::from_millis(1), key);
    let rounds = 3;
    let mut writes = Vec::new();
    for r in 0..rounds {
        checks.round(r);
        tokio::time::sleep(Duration::from_millis(400)).await;
        proxy.pause();
        tokio::time::sleep(Duration::from_millis(2)).await;
        a.overrides()
            .set(&api, &Scope::All, &Override::Block)
            .await
            .unwrap();
        writes.push((redis_now(&admin).await, i64::MAX));
        tokio::time::sleep(Duration::from_millis(1000)).await;
        proxy.resume();
        tokio::time::sleep(Duration::from_millis(600)).await;
        // Events from here on may be admitted again: the block is being removed.
        let removing = redis_now(&admin).await;
        a.overrides().remove(&api, &Scope::All).await.unwrap();
        writes.last_mut().unwrap().1 = removing;
    }
    let log = checks.stop().await;
    let errors = log.iter().filter(|e| e.2.is_err()).count();
    let (mut after, mut late, mut latest, mut apart) = (0, 0, None::<i64>, Vec::new());
    for (r, &(w_redis, removing)) in writes.iter().enumerate() {
        for n in 0..4 {
            let rkey = redis_key(&d, &key(n, r), &api);
            let events: Events = admin
                .zrangebyscore(&rkey, w_redis as f64, (removing - 1) as f64, true, None)
                .await
                .unwrap();
            for (_, score) in &events {
                let since = (*score as i64 - w_redis) / 1000;
                after += 1;
                latest = latest.max(Some(since));
                late += usize::from(since >= FOLLOW.as_millis() as i64);
            }
            let all: i64 = admin.zcard(&rkey).await.unwrap();
            let told = log
                .iter()
                .filter(|e| e.0 == n && e.1 == r && e.2 == Ok(true))
                .count();
            if all as usize != told {
                apart.push(format!(
                    "round {r} key {n}: {all} events, {told} admissions"
                ));
            }
        }
    }
    eprintln!(
        "{} decisions, {errors} errors; {after} events recorded after the block, {late} of them 250 ms or more after it, the latest {latest:?} ms after it; events vs admissions told apart: {apart:?}",
        log.len()
    );
    assert!(errors == 0 && late == 0 && apart.is_empty());
}

/// (6) A hash slot moved, one key at a time, under load on the plain tier. A three-primary
/// Redis Cluster; five clients whose keys share one hash slot, of one policy of 300 an hour:
/// two with no override, two with counts of 150 set, one blocked, so that a plain call
/// carries requests of every kind. B (plain tier, batches of at most eight, 2 s budget)
/// checks them from 8 tasks while the slot moves to another primary: calls whose keys are
/// split between the two nodes are refused with `TRYAGAIN` and laid out again, one key
/// each. No decision fails; no client is admitted past the policy's own count (the sliding
/// log: the two free ones exactly 300), nor past its override's before the move; the blocked
/// one nothing after it. While the slot moves, a call that finds the hash of overrides on the
/// other node decides by the policy's own counts (`docs/operations.md`, "Overrides"): the
/// admissions of the overridden clients during the move are printed, not bounded by their
/// override.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_under_plain_calls_of_every_kind_keeps_the_policys_count() {
    use crate::support::cluster::RedisCluster;
    use crate::support::outage::{Counts, Load};
    use tokio::task::block_in_place;
    use tower_redis_ratelimit::test_util::redis_key;
    let cluster = block_in_place(|| RedisCluster::start(3));
    let b = RedisStore::builder(cluster.url())
        .max_batch(8)
        .timeout(Duration::from_secs(2))
        .retry_interval(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let mut broke = Vec::new();
    for algorithm in [Algorithm::SlidingLog, Algorithm::Gcra] {
        let policy = Policy::new("moved", ["300/1h".parse().unwrap()])
            .unwrap()
            .with_algorithm(algorithm);
        let key = |i: usize| Key::from(format!("mv-{algorithm:?}-{i}"));
        let slot_of =
            |i: usize| fred::util::redis_keyslot(redis_key(&b, &key(i), &policy).as_bytes());
        let slot = slot_of(0);
        let clients: Vec<Key> = (0..)
            .filter(|&i| slot_of(i) == slot)
            .take(5)
            .map(key)
            .collect();
        let o = b.overrides();
        for client in &clients[2..4] {
            o.set(
                &policy,
                &Scope::Key(client.clone()),
                &Override::Limits(vec!["150/1h".parse().unwrap()]),
            )
            .await
            .unwrap();
        }
        o.set(&policy, &Scope::Key(clients[4].clone()), &Override::Block)
            .await
            .unwrap();
        let counts = [300, 300, 150, 150, 0];
        tokio::time::sleep(Duration::from_millis(300)).await;
        let from = block_in_place(|| cluster.owner_of_slot(slot));
        let to = *cluster.primaries().iter().find(|&&p| p != from).unwrap();
        let keys: Vec<(Key, usize)> = clients.iter().cloned().map(|k| (k, 0)).collect();
        let load = Load::start(&b, &policy, &keys, 8, Duration::from_millis(2));
        load.wait_for_requests(600).await;
        let begun = load.elapsed();
        block_in_place(|| cluster.begin_migration(slot, from, to));
        let moved = cluster
            .migrate_one_at_a_time(slot, from, to, |_| load.wait_for_requests(150))
            .await;
        block_in_place(|| cluster.finish_migration(slot, from, to));
        let finished = load.elapsed();
        load.wait_for_requests(5 * 2 * 300).await;
        let span = load.elapsed();
        let samples = load.stop().await;
        let errors = samples.iter().filter(|s| s.result.is_err()).count();
        let during = samples.iter().filter(|s| s.at >= begun && s.at < finished);
        eprintln!(
            "{algorithm:?}: slot {slot} moved ({moved} keys one at a time) in {:?}; during the move {}; {errors} errors",
            finished - begun,
            Counts::of(during)
        );
        // GCRA drains 300 an hour: one more every 12 s of the run.
        let drained = match algorithm {
            Algorithm::SlidingLog => 0,
            _ => (span.as_secs() / 12) as usize + 1,
        };
        for (c, count) in counts.iter().enumerate() {
            let mine = || samples.iter().filter(move |s| s.client == c);
            let got = Counts::of(mine());
            let admitted = |from: Duration, to: Duration| {
                mine()
                    .filter(|s| s.at >= from && s.at < to && s.result == Ok(true))
                    .count()
            };
            let (before, moving, after) = (
                admitted(Duration::ZERO, begun),
                admitted(begun, finished + FOLLOW),
                admitted(finished + FOLLOW, Duration::MAX),
            );
            eprintln!(
                "  client {c} (count {count}): {got}; admitted before the move {before}, during it (and 250 ms after) {moving}, after {after}"
            );
            // The policy's own count bounds every client; the override's, outside the move.
            let own_exact =
                algorithm != Algorithm::SlidingLog || *count < 300 || got.admitted == 300;
            if got.admitted > 300 + drained
                || !own_exact
                || before > *count + drained
                || (*count == 0 && after > 0)
            {
                broke.push(format!(
                    "{algorithm:?} client {c} (count {count}): {got}; before {before}, during {moving}, after {after}"
                ));
            }
        }
        if errors > 0 {
            broke.push(format!("{algorithm:?}: {errors} errors"));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}
