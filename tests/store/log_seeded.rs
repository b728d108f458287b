//! Seeded sequences on the sliding log, on Redis and on the memory store in lockstep: checks at
//! now and at event times (back up to the window, ahead up to three), charges (some of the
//! largest) and refunds, idle gaps of up to three windows (so that calls meet sets whose
//! members are older than twice the window but which have not expired yet), and one to four
//! requests of a key in one call. Both stores must decide alike, and the log must stay sound.
//!
//! Redis runs on its own time; the memory store's clock is set to the grid time each step is
//! due at, and Redis decides a little (`ε`) after it. The times keep every window edge away
//! from every member by more than `ε` could reach: steps at multiples of 100 ms, event times at
//! 20 ms past one, windows of 430 ms, 230 ms and 1030 ms (edges at 70 and 40 ms past a
//! multiple for members at now, at 90 and 60 ms for members at event times).

use std::time::{Duration, UNIX_EPOCH};

use crate::support::log::{members, unsound, Log};
use crate::support::seeded::Lcg;
use crate::support::time::redis_now;
use crate::support::RedisServer;
use fred::prelude::*;
use futures::future::join_all;
use tower_redis_ratelimit::store::{Clock, ManualClock};
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, MemoryStore, Policy, RedisStore, Settlement, Store,
};

/// Steps fall on multiples of this (ms after the start).
const STEP_MS: u64 = 100;
/// Steps in a run (20 s).
const STEPS: u64 = 200;
/// Keys, each with its own seeded sequence, stepped together.
const KEYS: u64 = 24;
/// How far Redis's `retry_after` may be from the memory store's (Redis decides `ε` later).
const TOLERANCE: Duration = Duration::from_millis(25);

/// The policy of key `k` and its longest window in ms.
fn policy(k: u64) -> (Policy, u64) {
    let (text, longest) = if k.is_multiple_of(2) {
        ("10/430ms", 430)
    } else {
        ("3/230ms + 5/1030ms", 1030)
    };
    let policy = text
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    (policy, longest)
}

/// One request of a call.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// A check at now.
    Now { cost: u32 },
    /// A check at `offset` ms from the step's time (20 ms past a multiple of 100).
    At { cost: u32, offset: i64 },
}

/// What is done with an admitted request's decision after its call.
#[derive(Clone, Copy, Debug)]
enum After {
    Nothing,
    Charge(u64),
    Refund(u64),
}

/// One key's step: its requests, leaving in one call, then their settlements.
#[derive(Clone, Debug)]
struct Step {
    ops: Vec<Op>,
    after: Vec<After>,
}

/// The steps of key `k` under `seed`: (step index, step), with idle gaps of 0 to 3 windows.
/// Unless `mixed`, a step's requests are all at now or all at event times.
fn plan(seed: u64, k: u64, mixed: bool) -> Vec<(u64, Step)> {
    let mut rng = Lcg(seed.wrapping_mul(1_000_003).wrapping_add(k * 7919 + 1));
    let (_, longest) = policy(k);
    let mut steps = Vec::new();
    let mut at = 1 + rng.next(3);
    while at < STEPS {
        let n = 1 + rng.next(4) as usize;
        // Unless mixed: 0, all at now; 1, all at event times.
        let kind = rng.next(2);
        let mut ops = Vec::new();
        let mut after = Vec::new();
        for _ in 0..n {
            let cost = 1 + rng.next(3) as u32;
            let draw = rng.next(2);
            ops.push(if (if mixed { draw } else { kind }) == 0 {
                Op::Now { cost }
            } else if rng.next(2) == 0 {
                // Back: 80, 180, ... ms, up to the longest window.
                let back = 80 + 100 * rng.next((longest - 80) / 100 + 1) as i64;
                Op::At {
                    cost,
                    offset: -back,
                }
            } else {
                // Ahead: 20, 120, ... ms, up to three windows.
                let ahead = 20 + 100 * rng.next(3 * longest / 100) as i64;
                Op::At {
                    cost,
                    offset: ahead,
                }
            });
            after.push(match rng.next(20) {
                0 => After::Charge(u64::MAX),
                1..=5 => After::Charge(1 + rng.next(6)),
                6..=8 => After::Refund(1 + rng.next(3)),
                _ => After::Nothing,
            });
        }
        steps.push((at, Step { ops, after }));
        // Idle: often the next step, else up to three windows (past twice the window).
        at += if rng.next(2) == 0 {
            1
        } else {
            1 + rng.next(3 * longest / STEP_MS + 2)
        };
    }
    steps
}

/// A decision as the user sees it.
fn seen(d: &Decision) -> (bool, u64, Option<Duration>) {
    (d.is_allowed(), d.remaining(), d.retry_after())
}

/// What a run counted.
#[derive(Debug, Default)]
struct Tally {
    calls_of_key: u64,
    several_in_one_call: u64,
    met_stale_unexpired: u64,
    requests: u64,
    admitted: u64,
    refused: u64,
    charges: u64,
    largest_charges: u64,
    refunds: u64,
    max_retry_gap_us: u128,
    script_calls: u64,
    mismatches: Vec<String>,
    unsound: Vec<String>,
    invariant: Vec<String>,
}

/// Runs `seed` on `store` (Redis) and a memory store in lockstep; what it counted.
async fn run(server: &RedisServer, store: &RedisStore, seed: u64, mixed: bool) -> Tally {
    let client = server.client().await;
    let plans: Vec<Vec<(u64, Step)>> = (0..KEYS).map(|k| plan(seed, k, mixed)).collect();
    let keys: Vec<Key> = (0..KEYS)
        .map(|k| Key::from(format!("seeded-{seed}-{k}")))
        .collect();
    let policies: Vec<(Policy, u64)> = (0..KEYS).map(policy).collect();
    let rkeys: Vec<String> = (0..KEYS as usize)
        .map(|k| redis_key(store, &keys[k], &policies[k].0))
        .collect();
    // Start at a multiple of 100 ms of Redis time, 200 ms ahead.
    let now = redis_now(&client).await;
    let start = now - now % 100_000 + 200_000;
    let clock = ManualClock::from(UNIX_EPOCH + Duration::from_micros(start as u64));
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let mut tally = Tally::default();
    // Per key: the log after its last step and when the key then expired (Redis us).
    let mut last: Vec<(Log, i64)> = vec![(Vec::new(), 0); KEYS as usize];
    let other = Key::from(format!("blocker-{seed}"));
    // The store learns what the plain tier needs from the full script's first replies.
    for _ in 0..3 {
        store.check(&other, &policies[0].0, 1).await.unwrap();
    }
    let calls_before = crate::support::evalsha_calls(&client).await;
    for step in 0..STEPS {
        let due: Vec<(usize, &Step)> = plans
            .iter()
            .enumerate()
            .filter_map(|(k, p)| p.iter().find(|(at, _)| *at == step).map(|(_, s)| (k, s)))
            .collect();
        if due.is_empty() {
            continue;
        }
        let ms = step * STEP_MS;
        let t_us = start + ms as i64 * 1000;
        loop {
            let left = t_us - redis_now(&client).await;
            if left <= 0 {
                break;
            }
            tokio::time::sleep(Duration::from_micros(left as u64)).await;
        }
        clock.advance(Duration::from_micros(t_us as u64).saturating_sub(clock.now()));
        let event = |offset: i64| {
            let us = t_us + offset * 1000;
            UNIX_EPOCH + Duration::from_micros(us as u64)
        };
        // Memory first, in the order the Redis requests are queued.
        let mut queue: Vec<(usize, usize)> = Vec::new();
        for (i, &(k, s)) in due.iter().enumerate() {
            let (log, expires) = &last[k];
            let cutoff = t_us - 2 * policies[k].1 as i64 * 1000;
            if *expires > t_us + 2_000 && log.iter().any(|m| m.0 <= cutoff) {
                tally.met_stale_unexpired += 1;
            }
            tally.calls_of_key += 1;
            if s.ops.len() > 1 {
                tally.several_in_one_call += 1;
            }
            queue.extend((0..s.ops.len()).map(|j| (i, j)));
        }
        let mut expected: Vec<Vec<Option<Result<Decision, _>>>> = due
            .iter()
            .map(|(_, s)| s.ops.iter().map(|_| None).collect())
            .collect();
        for (i, j) in queue {
            let k = due[i].0;
            let policy = &policies[k].0;
            expected[i][j] = Some(match due[i].1.ops[j] {
                Op::Now { cost } => memory.check(&keys[k], policy, cost).await,
                Op::At { cost, offset } => {
                    memory.check_at(&keys[k], policy, cost, event(offset)).await
                }
            });
        }
        // Redis: a blocker on another key holds the one call in flight; the requests that
        // arrive meanwhile leave together, in order.
        let mut futs: Vec<futures::future::BoxFuture<'_, _>> = Vec::new();
        let blocker_policy = &policies[0].0;
        futs.push(Box::pin(store.check(&other, blocker_policy, 1)));
        for &(k, s) in &due {
            let policy = &policies[k].0;
            for op in &s.ops {
                futs.push(match *op {
                    Op::Now { cost } => Box::pin(store.check(&keys[k], policy, cost)),
                    Op::At { cost, offset } => {
                        Box::pin(store.check_at(&keys[k], policy, cost, event(offset)))
                    }
                });
            }
        }
        let mut got = join_all(futs).await.into_iter().skip(1);
        for (i, &(k, s)) in due.iter().enumerate() {
            let policy = &policies[k].0;
            for (j, op) in s.ops.iter().enumerate() {
                let r = got.next().unwrap();
                let m = expected[i][j].as_ref().unwrap();
                tally.requests += 1;
                let place = format!("seed {seed} key {k} step {step} ({ms} ms) op {j} {op:?}");
                let (r, m) = match (r, m) {
                    (Ok(r), Ok(m)) => (r, m),
                    (r, m) => {
                        if format!("{r:?}") != format!("{m:?}") {
                            tally
                                .mismatches
                                .push(format!("{place}: redis {r:?}, memory {m:?}"));
                        }
                        continue;
                    }
                };
                let (ra, rr, rt) = seen(&r);
                let (ma, mr, mt) = seen(m);
                if ra {
                    tally.admitted += 1;
                } else {
                    tally.refused += 1;
                    if rt.is_none_or(|d| d.is_zero()) {
                        tally
                            .invariant
                            .push(format!("{place}: refused with retry_after {rt:?}"));
                    }
                }
                let gap = match (rt, mt) {
                    (Some(a), Some(b)) => Some(a.abs_diff(b)),
                    (None, None) => Some(Duration::ZERO),
                    _ => None,
                };
                if let Some(g) = gap {
                    tally.max_retry_gap_us = tally.max_retry_gap_us.max(g.as_micros());
                }
                if ra != ma || rr != mr || gap.is_none_or(|g| g > TOLERANCE) {
                    tally.mismatches.push(format!(
                        "{place}: redis {:?}, memory {:?}",
                        (ra, rr, rt),
                        (ma, mr, mt)
                    ));
                }
                // Settle both alike (only where both admitted).
                if !(ra && ma) {
                    continue;
                }
                let pair = match s.after[j] {
                    After::Nothing => None,
                    After::Charge(u) => {
                        tally.charges += 1;
                        if u == u64::MAX {
                            tally.largest_charges += 1;
                        }
                        Some((
                            Settlement::charge(&r, u).unwrap(),
                            Settlement::charge(m, u).unwrap(),
                        ))
                    }
                    After::Refund(u) => {
                        tally.refunds += 1;
                        Some((
                            Settlement::refund(&r, u).unwrap(),
                            Settlement::refund(m, u).unwrap(),
                        ))
                    }
                };
                if let Some((rs, ms_)) = pair {
                    store.settle(&keys[k], policy, rs).await.unwrap();
                    memory.settle(&keys[k], policy, ms_).await.unwrap();
                }
            }
        }
        for &(k, _) in &due {
            let log = members(&client, &rkeys[k]).await;
            let pttl: i64 = client.pttl(&rkeys[k]).await.unwrap();
            let read = redis_now(&client).await;
            let bad = unsound(&log);
            if !bad.is_empty() {
                tally
                    .unsound
                    .push(format!("seed {seed} key {k} step {step}: {bad:?}"));
            }
            last[k] = (log, read + pttl.max(0) * 1000);
        }
    }
    tally.script_calls = crate::support::evalsha_calls(&client).await - calls_before;
    tally
}

/// Runs `seeds` on `store`, prints what each counted, and asserts alike decisions, sound logs
/// and refusals that say when to come back.
async fn compare(server: &RedisServer, store: &RedisStore, name: &str, seeds: &[u64], mixed: bool) {
    let mut tallies = Vec::new();
    for &seed in seeds {
        tallies.push(run(server, store, seed, mixed).await);
    }
    let mut failed = Vec::new();
    for (seed, t) in seeds.iter().zip(&tallies) {
        eprintln!(
            "{name} seed {seed}: {} calls of a key ({} with 2-4 requests, {} meeting members \
             past 2L in an unexpired set), {} requests, {} admitted, {} refused, {} charges \
             ({} of u64::MAX), {} refunds, {} script calls, largest retry_after gap {} us, \
             {} mismatches, {} unsound logs, {} refusals without a wait",
            t.calls_of_key,
            t.several_in_one_call,
            t.met_stale_unexpired,
            t.requests,
            t.admitted,
            t.refused,
            t.charges,
            t.largest_charges,
            t.refunds,
            t.script_calls,
            t.max_retry_gap_us,
            t.mismatches.len(),
            t.unsound.len(),
            t.invariant.len()
        );
        for line in t
            .mismatches
            .iter()
            .chain(&t.unsound)
            .chain(&t.invariant)
            .take(10)
        {
            eprintln!("  {line}");
            failed.push(line.clone());
        }
    }
    assert!(failed.is_empty(), "{name}: {failed:#?}");
}

/// A store on `server` with one call in flight at a time, so that requests queued meanwhile
/// leave together; the plain tier on or off.
async fn one_call_at_a_time(server: &RedisServer, plain: bool) -> RedisStore {
    RedisStore::builder(server.url())
        .plain_scripts(plain)
        .max_in_flight(1)
        .connect()
        .await
        .unwrap()
}

/// The full scripts alone, one call in flight at a time.
#[tokio::test]
async fn seeded_sequences_decide_alike_on_redis_full_scripts_and_memory() {
    let server = RedisServer::start();
    let store = one_call_at_a_time(&server, false).await;
    compare(&server, &store, "full", &[1], true).await;
}

/// The default store (the plain tier for checks at now), one call in flight at a time; a
/// key's requests of one call are all at now or all at event times (see the next test).
#[tokio::test]
async fn seeded_sequences_decide_alike_on_redis_plain_tier_and_memory() {
    let server = RedisServer::start();
    let store = one_call_at_a_time(&server, true).await;
    compare(&server, &store, "plain", &[3], false).await;
}

/// The same with checks at now and at event times of one key in one call: the plain tier
/// sends them in two calls, one per script (`transport::batch::groups`), and whether a check
/// at now goes plain depends on how fresh the last full reply is (`plain_ok`, 250 ms), so
/// Redis decides them in an order other than queued, and the memory store, deciding them as
/// queued, sees other decisions. Allowed by `docs/promises.md` ("in the order the store
/// decided them"); kept to show it.
#[tokio::test]
#[ignore = "plain tier: a key's checks at now and at event times in one call are decided per \
            script, not as queued (seed 3: 315 of 2119 decisions differed from the memory \
            store's in queued order); run: cargo test --all-features --test store \
            log_seeded::seeded_sequences_mixed -- --ignored --nocapture"]
async fn seeded_sequences_mixed_in_one_call_on_redis_plain_tier_and_memory() {
    let server = RedisServer::start();
    let store = one_call_at_a_time(&server, true).await;
    compare(&server, &store, "plain mixed", &[3], true).await;
}
