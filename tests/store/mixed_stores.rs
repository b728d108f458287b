//! Stores of different settings writing one key: the plain and full tiers, leasing stores of
//! different lease periods, and stores without leases.
//! - GCRA: the write that keeps a key's expiry overwrites its state with `SETRANGE key 0`
//!   (`expiry.lua`, `write_gcra`), which would keep stale trailing bytes over a longer value and
//!   make a key without expiry where the key is missing: every key keeps `24n + 16` bytes and
//!   an expiry through mixed steps, and what a key costs written once and again.
//! - The sliding log: a leasing store's bound on event times, `W − h` back (`docs/leases.md`,
//!   "Event times"), at its edges and on keys with state; windows as units are spent, under one
//!   lease setting, beside stores without leases deciding event times, and under mixed lease
//!   settings, which `docs/leases.md` asks not to run (ignored tests show what they admit).
//!
//! Each test prints its figures (`--nocapture`).

use std::time::{Duration, SystemTime};

use crate::support::seeded::Lcg;
use crate::support::time::micros;
use crate::support::RedisServer;
use fred::prelude::*;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::test_util::{recorded_at, redis_key, with_limits, Reserve, Ticket};
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, Limit, Policy, RedisStore, Settlement, Store, StoreError,
};

fn limit(text: &str) -> Limit {
    text.parse().unwrap()
}

/// A store on `server`: plain tier on or off, and leases of `period` ms and `share` where given.
async fn store(server: &RedisServer, plain: bool, leases: Option<(u64, f64)>) -> RedisStore {
    let mut builder = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .plain_scripts(plain);
    if let Some((period, share)) = leases {
        builder = builder.leases(
            Leases::new()
                .period(Duration::from_millis(period))
                .max_share(share),
        );
    }
    builder.connect().await.unwrap()
}

/// Stores without leases and with leases of 100 ms and a share of 0.5, on both tiers.
async fn four_stores(server: &RedisServer) -> Vec<(&'static str, RedisStore)> {
    vec![
        ("plain", store(server, true, None).await),
        ("full", store(server, false, None).await),
        ("plain leased", store(server, true, Some((100, 0.5))).await),
        ("full leased", store(server, false, Some((100, 0.5))).await),
    ]
}

/// A key's `EXISTS`, `STRLEN` and `PTTL`, read at one instant.
async fn shape(client: &Client, key: &str) -> (i64, i64, i64) {
    let script = "return {redis.call('EXISTS', KEYS[1]), redis.call('STRLEN', KEYS[1]), \
        redis.call('PTTL', KEYS[1])}";
    let reply: Vec<i64> = client.eval(script, vec![key], ()).await.unwrap();
    (reply[0], reply[1], reply[2])
}

/// (A) GCRA state through every kind of step from the four stores, on policies of one and of
/// two limits (windows not multiples of 8 ms among them), with the counts changed at run
/// time (`with_limits`): after each step the key is absent, or holds `24 n + 16` bytes and
/// has an expiry (`PTTL > 0`). Then give-backs (refunds of leased and plain decisions) after
/// a reset and after the key expired: the key stays absent (a `SETRANGE` on a missing key would
/// create it without expiry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_keys_keep_their_length_and_an_expiry_through_mixed_steps() {
    let server = RedisServer::start();
    let client = server.client().await;
    let stores = four_stores(&server).await;
    let mut broke = Vec::new();
    let mut tally = Vec::new();
    for (name, sets, seed) in [
        ("one", [&["10/1s"][..], &["30/1s"], &["4/1s"]], 5u64),
        (
            "two",
            [
                &["3/100ms", "12/1s"][..],
                &["6/100ms", "40/1s"],
                &["2/100ms", "5/1s"],
            ],
            11,
        ),
        (
            "odd",
            [
                &["3/101ms", "9/203ms"][..],
                &["5/101ms", "20/203ms"],
                &["1/101ms", "3/203ms"],
            ],
            23,
        ),
    ] {
        let limits = |set: &[&str]| set.iter().map(|l| limit(l)).collect::<Vec<_>>();
        let base = Policy::new(format!("a56-{name}"), limits(sets[0]))
            .unwrap()
            .with_algorithm(Algorithm::Gcra);
        let policies = [
            base.clone(),
            with_limits(&base, limits(sets[1])).unwrap(),
            with_limits(&base, limits(sets[2])).unwrap(),
        ];
        let n = sets[0].len() as i64;
        let key = Key::from(format!("a56-{name}"));
        let redis = redis_key(&stores[0].1, &key, &base);
        let mut rng = Lcg(seed);
        let mut last: Option<(usize, usize, Decision)> = None;
        let (mut steps, mut absent, mut lengths) = (0, 0, std::collections::BTreeMap::new());
        let mut least_pttl = i64::MAX;
        for step in 0..70u64 {
            let s = rng.next(4) as usize;
            let (who, st) = (stores[s].0, &stores[s].1);
            let p = [0, 0, 0, 1, 2][rng.next(5) as usize];
            let op = rng.next(12);
            let what = match op {
                0..=5 => {
                    let cost = 1 + rng.next(3) as u32;
                    let d = st.check(&key, &policies[p], cost).await.unwrap();
                    let done = format!("{who}: check {cost} under {p}: {}", d.is_allowed());
                    if d.is_allowed() {
                        last = Some((s, p, d));
                    }
                    done
                }
                6 => {
                    let mut took = 0;
                    for _ in 0..8 {
                        let d = st.check(&key, &policies[p], 1).await.unwrap();
                        if d.is_allowed() {
                            took += 1;
                            last = Some((s, p, d));
                        }
                    }
                    format!("{who}: burst of 8 under {p}: {took}")
                }
                7 | 8 => match &last {
                    Some((ls, lp, d)) => {
                        let units = 1 + rng.next(20);
                        let settlement = if op == 7 {
                            Settlement::refund(d, units)
                        } else {
                            Settlement::charge(d, units)
                        };
                        if let Some(settlement) = settlement {
                            stores[*ls]
                                .1
                                .settle(&key, &policies[*lp], settlement)
                                .await
                                .unwrap();
                        }
                        format!("{}: settle {op} {units}", stores[*ls].0)
                    }
                    None => "nothing to settle".into(),
                },
                9 => {
                    st.reset(&key, &base).await.unwrap();
                    format!("{who}: reset")
                }
                10 => {
                    let cost = 1 + rng.next(4) as u32;
                    let ticket = Ticket {
                        cost,
                        ..Ticket::new(step, Duration::from_millis(300))
                    };
                    let d = Reserve::reserve(st, &key, &policies[p], ticket).await;
                    format!("{who}: reserve {cost}: {:?}", d.map(|d| d.is_allowed()))
                }
                _ => {
                    let ms = rng.next(120);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    format!("pause {ms} ms")
                }
            };
            tokio::time::sleep(Duration::from_millis(rng.next(15))).await;
            let (exists, len, pttl) = shape(&client, &redis).await;
            steps += 1;
            if exists == 0 {
                absent += 1;
            } else {
                *lengths.entry(len).or_insert(0) += 1;
                least_pttl = least_pttl.min(pttl);
                if len != 24 * n + 16 || pttl <= 0 {
                    broke.push(format!(
                        "{name} step {step} ({what}): STRLEN {len}, PTTL {pttl}"
                    ));
                }
            }
        }
        // Give-backs where the state is gone: after a reset, and after the key expired.
        let leased = &stores[2].1;
        let mut got = Vec::new();
        for _ in 0..10 {
            let d = leased.check(&key, &base, 1).await.unwrap();
            if d.is_allowed() {
                got.push(d);
            }
        }
        leased.reset(&key, &base).await.unwrap();
        for d in got.iter().take(3) {
            leased
                .settle(&key, &base, Settlement::refund(d, 1).unwrap())
                .await
                .unwrap();
        }
        let after_reset = shape(&client, &redis).await;
        let d = stores[1].1.check(&key, &base, 1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let before = shape(&client, &redis).await;
        if let Some(s) = Settlement::refund(&d, 1) {
            stores[1].1.settle(&key, &base, s).await.unwrap();
        }
        for d in got.iter().skip(3) {
            leased
                .settle(&key, &base, Settlement::refund(d, 1).unwrap())
                .await
                .unwrap();
        }
        let after_expiry = shape(&client, &redis).await;
        eprintln!(
            "{name}: {steps} steps, key absent after {absent}, STRLEN seen {lengths:?}, least PTTL {least_pttl} ms; \
             refunds after a reset: {after_reset:?}; before expiry wait end {before:?}, refunds after expiry: {after_expiry:?} (EXISTS, STRLEN, PTTL)"
        );
        tally.push(steps);
        for (when, (exists, len, pttl)) in [("reset", after_reset), ("expiry", after_expiry)] {
            if exists != 0 && (len != 24 * n + 16 || pttl <= 0) {
                broke.push(format!(
                    "{name}: give-back after {when}: STRLEN {len}, PTTL {pttl}"
                ));
            }
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// `INFO memory` used_memory.
async fn used_memory(client: &Client) -> i64 {
    let info: String = client
        .eval(
            "return redis.call('INFO', 'memory')",
            Vec::<String>::new(),
            (),
        )
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// (A, memory) A GCRA key of one limit (40 bytes) written once (PSETEX from a script: an
/// embstr) and again (SETRANGE: made raw): `MEMORY USAGE` and `OBJECT ENCODING` after each,
/// through the store; then 10 000 keys in scripts, written once and then again with SETRANGE
/// (this change) or with `SET KEEPTTL` (its parent), `used_memory` per key after each. Prints
/// the figures; asserts that a key's second write costs it at most 32 bytes more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_key_memory_written_once_and_again() {
    let server = RedisServer::start();
    let client = server.client().await;
    let plain = store(&server, true, None).await;
    let full = store(&server, false, None).await;
    let mut figures = Vec::new();
    for (name, st, text) in [("plain", &plain, "10/1s"), ("full", &full, "10/1s")] {
        for n in [1usize, 2] {
            let limits: Vec<Limit> = if n == 1 {
                vec![limit(text)]
            } else {
                vec![limit("3/100ms"), limit(text)]
            };
            let policy = Policy::new(format!("mem-{name}-{n}"), limits)
                .unwrap()
                .with_algorithm(Algorithm::Gcra);
            let key = Key::from("mem");
            let redis = redis_key(st, &key, &policy);
            let mut row = format!("{name} n={n}:");
            for write in 0..3 {
                st.check(&key, &policy, 1).await.unwrap();
                let usage: i64 = client
                    .eval(
                        "return redis.call('MEMORY', 'USAGE', KEYS[1])",
                        vec![&redis],
                        (),
                    )
                    .await
                    .unwrap();
                let encoding: String = client
                    .eval(
                        "return redis.call('OBJECT', 'ENCODING', KEYS[1])",
                        vec![&redis],
                        (),
                    )
                    .await
                    .unwrap();
                let (_, len, pttl) = shape(&client, &redis).await;
                row += &format!(" write {write}: {usage} B {encoding} STRLEN {len} PTTL {pttl};");
            }
            figures.push(row);
        }
    }
    // 10 000 keys of 40 bytes, as the scripts write them.
    let mut per_key = Vec::new();
    for (second, command) in [
        ("SETRANGE", "redis.call('SETRANGE', 'k' .. i, '0', v)"),
        ("SET KEEPTTL", "redis.call('SET', 'k' .. i, v, 'KEEPTTL')"),
    ] {
        let _: () = client.flushall(false).await.unwrap();
        let empty = used_memory(&client).await;
        let first = "local v = string.rep('x', 40) for i = 1, 10000 do \
            redis.call('PSETEX', 'k' .. i, '60000', v) end return 0";
        let _: i64 = client.eval(first, Vec::<String>::new(), ()).await.unwrap();
        let once = used_memory(&client).await;
        let again =
            format!("local v = string.rep('y', 40) for i = 1, 10000 do {command} end return 0");
        let _: i64 = client.eval(again, Vec::<String>::new(), ()).await.unwrap();
        let twice = used_memory(&client).await;
        let usage: i64 = client
            .eval(
                "return redis.call('MEMORY', 'USAGE', 'k1')",
                Vec::<String>::new(),
                (),
            )
            .await
            .unwrap();
        per_key.push((
            second,
            (once - empty) / 10_000,
            (twice - empty) / 10_000,
            usage,
        ));
        figures.push(format!(
            "10 000 keys, second write {second}: used_memory {empty} empty, {once} once \
             ({} B/key), {twice} again ({} B/key); MEMORY USAGE k1 {usage}",
            (once - empty) / 10_000,
            (twice - empty) / 10_000
        ));
    }
    eprintln!("{figures:#?}");
    for (second, once, twice, _) in per_key {
        assert!(twice - once <= 32, "{second}: {once} -> {twice} B/key");
    }
}

/// A case of the bound: its name, limits, lease settings (period ms, share) and headroom (ms).
type EdgeCase = (
    &'static str,
    &'static [&'static str],
    Option<(u64, f64)>,
    i64,
);

/// An event time `offset_ms` from the host's now (the clock Redis reads on this machine).
fn from_now(offset_ms: i64) -> SystemTime {
    let now = SystemTime::now();
    if offset_ms >= 0 {
        now + Duration::from_millis(offset_ms as u64)
    } else {
        now - Duration::from_millis((-offset_ms) as u64)
    }
}

/// (B) The event-time bound at its edges, both tiers: a leasing store takes `W − h` back and
/// refuses 1 ms further (the time only gets older by the call's latency, so −1 ms is exact
/// on that side; the accepted side is given 5 ms for the latency); a store without leases
/// takes `W`. Policies: `5/200ms` (h = 100 ms), `5/203ms` (not a multiple of 8 ms),
/// `1/100ms + 5/1s` (h = 50 ms from the shortest window, W = 1 s), and `max_share` 1 with a
/// period of 300 ms on `5/203ms` (h = W: no time in the past, a time 3 ms ahead taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_time_bound_at_its_edges() {
    let server = RedisServer::start();
    let mut broke = Vec::new();
    let mut seen = Vec::new();
    let cases: [EdgeCase; 5] = [
        ("5/200ms h100", &["5/200ms"], Some((100, 0.5)), 100),
        ("5/203ms h100", &["5/203ms"], Some((100, 0.5)), 100),
        (
            "1/100ms+5/1s h50",
            &["1/100ms", "5/1s"],
            Some((100, 0.5)),
            50,
        ),
        ("5/203ms h=W", &["5/203ms"], Some((300, 1.0)), 203),
        ("5/203ms unleased", &["5/203ms"], None, 0),
    ];
    for (i, (name, limits, leases, h)) in cases.into_iter().enumerate() {
        let limits: Vec<Limit> = limits.iter().map(|l| limit(l)).collect();
        let w = (limits.last().unwrap().window().as_micros() / 1000) as i64;
        let policy = Policy::new(format!("edge{i}"), limits)
            .unwrap()
            .with_algorithm(Algorithm::SlidingLog);
        for plain in [true, false] {
            let st = store(&server, plain, leases).await;
            let bound = w - h;
            let key = Key::from(format!("edge-{plain}"));
            // Inside the bound by 5 ms (or 3 ms ahead where the bound is now).
            let inside = if bound == 0 { 3 } else { -(bound - 5) };
            let ok = st.check_at(&key, &policy, 1, from_now(inside)).await;
            let out = st.check_at(&key, &policy, 1, from_now(-(bound + 1))).await;
            let far = st.check_at(&key, &policy, 1, from_now(-(w + h - 5))).await;
            let got = format!(
                "{name} plain {plain}: at -{bound}+5 ms ({inside}): {:?}; at -{} ms: {:?}; at -(W+h-5) {}: {:?}",
                ok.as_ref().map(|d| d.is_allowed()),
                bound + 1,
                out.as_ref().map(|d| d.is_allowed()),
                w + h - 5,
                far.as_ref().map(|d| d.is_allowed())
            );
            if !ok.as_ref().is_ok_and(|d| d.is_allowed())
                || !matches!(out, Err(StoreError::EventTooOld))
                || (h > 5 && !matches!(far, Err(StoreError::EventTooOld)))
            {
                broke.push(got.clone());
            }
            seen.push(got);
        }
    }
    eprintln!("{seen:#?}");
    assert!(broke.is_empty(), "{broke:#?}");
}

/// One admission as spent: the earliest and latest it may have been spent (µs; the host's
/// clock around the call, or its event time), its cost, and the span of resets it belongs to.
struct Spent {
    lo: i64,
    hi: i64,
    cost: i64,
    era: usize,
    who: &'static str,
    refunded: bool,
}

/// The most units certainly spent in one window of `w` µs (a window `(a, a + w]` that
/// contains an admission's whole interval), per era; and a description of that window.
fn most_in_a_window(spent: &[Spent], w: i64) -> (i64, String) {
    let mut best = (0, String::new());
    for s in spent.iter().filter(|s| !s.refunded) {
        // Windows starting just before this admission's earliest time.
        let a = s.lo - 1;
        let members: Vec<&Spent> = spent
            .iter()
            .filter(|x| !x.refunded && x.era == s.era && x.lo > a && x.hi <= a + w)
            .collect();
        let total: i64 = members.iter().map(|x| x.cost).sum();
        if total > best.0 {
            let who: Vec<String> = members
                .iter()
                .map(|x| format!("{}@{}+{}", x.who, (x.lo - a) / 1000, x.cost))
                .collect();
            best = (total, format!("window from {a}: {who:?}"));
        }
    }
    best
}

/// A mixed fleet on one log key of `limits`: steps of checks (bursts that lease), event times
/// in the past (down to the bound) and the future, refunds and rare resets, from the stores
/// named; every window of every limit checked for the units certainly spent in it.
async fn mixed_log(
    name: &str,
    stores: &[(&'static str, RedisStore)],
    limits: &[&str],
    seed: u64,
    steps: u64,
) -> (Vec<String>, String) {
    mixed_log_of(name, stores, &[], limits, seed, steps).await
}

/// As `mixed_log`, where the stores whose index is in `events_only` decide only event times
/// (`Store::check_at`, never from a lease).
async fn mixed_log_of(
    name: &str,
    stores: &[(&'static str, RedisStore)],
    events_only: &[usize],
    limits: &[&str],
    seed: u64,
    steps: u64,
) -> (Vec<String>, String) {
    let policy = Policy::new(
        format!("mix-{name}"),
        limits.iter().map(|l| limit(l)).collect::<Vec<_>>(),
    )
    .unwrap()
    .with_algorithm(Algorithm::SlidingLog);
    let windows: Vec<(i64, i64)> = policy
        .limits()
        .iter()
        .map(|l| (l.count() as i64, l.window().as_micros() as i64))
        .collect();
    let longest = windows.last().unwrap().1 / 1000;
    let key = Key::from(format!("mix-{name}"));
    let mut rng = Lcg(seed);
    let mut spent: Vec<Spent> = Vec::new();
    let mut decisions: Vec<(usize, usize, Decision)> = Vec::new();
    let (mut too_old, mut refunds, mut late, mut at_calls) = (0, 0, 0, 0);
    // Each admission's time logged in Redis (the lease's, for a leased unit), and each
    // reset's call (before, after): an admission belongs to the span of resets it was logged
    // in, since a reset forgets what was logged before it (leases held go on being spent).
    let mut logged: Vec<i64> = Vec::new();
    let mut resets: Vec<(i64, i64)> = Vec::new();
    let era = 0;
    for _ in 0..steps {
        let s = rng.next(stores.len() as u64) as usize;
        let (who, st) = (stores[s].0, &stores[s].1);
        let mut op = rng.next(20);
        if events_only.contains(&s) && op <= 10 {
            op = 11;
        }
        match op {
            0..=10 => {
                let burst = 1 + rng.next(12);
                for _ in 0..burst {
                    let lo = micros(SystemTime::now());
                    let d = st.check(&key, &policy, 1).await.unwrap();
                    let hi = micros(SystemTime::now());
                    if d.is_allowed() {
                        if recorded_at(&d).is_some_and(|r| micros(r) < lo) {
                            late += 1;
                        }
                        logged.push(recorded_at(&d).map_or(lo, micros));
                        decisions.push((s, spent.len(), d));
                        spent.push(Spent {
                            lo,
                            hi,
                            cost: 1,
                            era,
                            who,
                            refunded: false,
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(rng.next(8))).await;
                }
            }
            11..=14 => {
                // Past (to just beyond the longest window) or future (to half of it).
                let back = rng.next(longest as u64 + 20) as i64;
                let offset = if rng.next(4) == 0 { back / 2 } else { -back };
                let at = from_now(offset);
                let called = micros(SystemTime::now());
                at_calls += 1;
                match st.check_at(&key, &policy, 1, at).await {
                    Ok(d) if d.is_allowed() => {
                        let t = micros(at);
                        logged.push(called);
                        decisions.push((s, spent.len(), d));
                        spent.push(Spent {
                            lo: t,
                            hi: t,
                            cost: 1,
                            era,
                            who,
                            refunded: false,
                        });
                    }
                    Ok(_) => {}
                    Err(StoreError::EventTooOld) => too_old += 1,
                    Err(e) => panic!("{e:?}"),
                }
            }
            15 | 16 => {
                if let Some((ds, i, d)) = decisions.pop() {
                    if let Some(settlement) = Settlement::refund(&d, 1) {
                        stores[ds]
                            .1
                            .settle(&key, &policy, settlement)
                            .await
                            .unwrap();
                        spent[i].refunded = true;
                        refunds += 1;
                    }
                }
            }
            17 if rng.next(3) == 0 => {
                let before = micros(SystemTime::now());
                st.reset(&key, &policy).await.unwrap();
                resets.push((before, micros(SystemTime::now())));
                decisions.clear();
            }
            _ => {
                tokio::time::sleep(Duration::from_millis(rng.next(longest as u64 / 2))).await;
            }
        }
    }
    let mut unsure = 0;
    for (x, at) in spent.iter_mut().zip(&logged) {
        if resets
            .iter()
            .any(|(b, a)| b - 2_000 <= *at && *at <= a + 2_000)
        {
            // Logged around a reset: left out.
            x.refunded = true;
            unsure += 1;
        }
        x.era = resets.iter().filter(|(_, a)| a < at).count();
    }
    let mut broke = Vec::new();
    let mut summary = format!(
        "{name}: {} admitted ({late} spent after logged), {at_calls} event times ({too_old} EventTooOld), {refunds} refunds, {} resets ({unsure} admissions logged within 2 ms of one left out);",
        spent.len(),
        resets.len()
    );
    for (c, w) in &windows {
        let (most, window) = most_in_a_window(&spent, *w);
        summary += &format!(" {c}/{}ms: most {most} in a window;", w / 1000);
        if most > *c {
            broke.push(format!(
                "{name} {c}/{}ms: {most} units in {window}",
                w / 1000
            ));
        }
    }
    (broke, summary)
}

/// [`mixed_log`] on two keys of `stores`, `steps` each, named and seeded by `cases`: one of
/// `20/203ms`, one of `10/101ms` and `30/403ms`. Prints each summary; returns what went over.
async fn windows_as_spent(
    stores: &[(&'static str, RedisStore)],
    cases: [(&str, u64); 2],
    steps: u64,
) -> Vec<String> {
    let mut broke = Vec::new();
    let shapes: [&[&str]; 2] = [&["20/203ms"], &["10/101ms", "30/403ms"]];
    for ((name, seed), limits) in cases.into_iter().zip(shapes) {
        let (b, summary) = mixed_log(name, stores, limits, seed, steps).await;
        eprintln!("{summary}");
        broke.extend(b);
    }
    broke
}

/// (B) Stores of the same lease settings, both tiers, on one log key, with event times down to
/// the bound, refunds and resets: never more than a limit's count in any window, as spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_key_of_leasing_stores_of_one_setting_stays_within_every_window() {
    let server = RedisServer::start();
    let stores = vec![
        ("plain leased", store(&server, true, Some((100, 0.5))).await),
        ("full leased", store(&server, false, Some((100, 0.5))).await),
    ];
    let cases = [("same-one", 3), ("same-two", 7)];
    let broke = windows_as_spent(&stores, cases, 120).await;
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (B) Stores without leases, with leases of another period, and with leases, on one log key:
/// a leased unit spent up to `h` after it was logged is not in the windows of `w` a store
/// without leases (or a shorter headroom) reads, so such a fleet can put more than the count in
/// one window as spent. `docs/leases.md` asks every instance to use the same lease settings
/// (the log's event times stay exact whoever shares the key, but not the units leases spend
/// late): this measures what the mix admits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "over: a store without leases (or of a shorter headroom) on a leasing store's log key admits past the count in a window, as spent"]
async fn a_log_key_of_mixed_lease_settings_stays_within_every_window() {
    let server = RedisServer::start();
    let mut stores = four_stores(&server).await;
    stores.push(("short leased", store(&server, true, Some((20, 0.5))).await));
    let cases = [("mixed-one", 3), ("mixed-two", 7)];
    let broke = windows_as_spent(&stores, cases, 160).await;
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (B) Two leasing stores of other periods (headroom 100 ms and 20 ms), no store without
/// leases, on one log key, random steps: the one of the shorter headroom reads windows of
/// `w + 20 ms`, so a unit the other spends up to 100 ms after it was logged can fall outside
/// them; these steps did not put more than the count in a window in the runs seen (the
/// targeted `a_late_spent_lease_then_a_store_of_a_shorter_period_stays_within_the_count`
/// does, in some runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_key_of_two_lease_periods_stays_within_every_window() {
    let server = RedisServer::start();
    let stores = vec![
        ("plain leased", store(&server, true, Some((100, 0.5))).await),
        ("full leased", store(&server, false, Some((100, 0.5))).await),
        ("short leased", store(&server, true, Some((20, 0.5))).await),
    ];
    let cases = [("periods-one", 5), ("periods-two", 9)];
    let broke = windows_as_spent(&stores, cases, 160).await;
    assert!(broke.is_empty(), "{broke:#?}");
}

/// The premises of the `SETRANGE` write (expiry.lua, `write_gcra`): over a value of the same
/// length it replaces every byte and keeps the expiry; over a longer one it leaves the old
/// tail; on a missing key it makes one without expiry. So every caller must pass `kept` only
/// for a key it has just read at the new value's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setrange_keeps_the_expiry_only_over_a_value_of_its_length() {
    let server = RedisServer::start();
    let client = server.client().await;
    let script = "redis.call('PSETEX', 'same', '60000', string.rep('a', 40)) \
        redis.call('SETRANGE', 'same', '0', string.rep('b', 40)) \
        redis.call('PSETEX', 'longer', '60000', string.rep('a', 64)) \
        redis.call('SETRANGE', 'longer', '0', string.rep('b', 40)) \
        redis.call('SETRANGE', 'missing', '0', string.rep('b', 40)) \
        return {redis.call('GET', 'same'), redis.call('PTTL', 'same'), \
          redis.call('STRLEN', 'longer'), redis.call('PTTL', 'missing')}";
    let reply: Vec<Value> = client.eval(script, Vec::<String>::new(), ()).await.unwrap();
    let same = reply[0].as_string().unwrap();
    let (same_pttl, longer, missing) = (
        reply[1].as_i64().unwrap(),
        reply[2].as_i64().unwrap(),
        reply[3].as_i64().unwrap(),
    );
    eprintln!(
        "same length: {same} PTTL {same_pttl}; longer: STRLEN {longer}; missing: PTTL {missing}"
    );
    assert_eq!(same, "b".repeat(40));
    assert!(same_pttl > 59_000);
    assert_eq!(longer, 64);
    assert_eq!(missing, -1);
}

/// A leasing store (period 100 ms, share 0.5: h = 100 ms) heats a `20/203ms` log key and
/// spends its leased units over 90 ms; once the window `other` reads (`w` and its headroom)
/// after the earliest lease logged has passed it (5 ms on), `other` asks for 20 units one by
/// one. Returns what broke (units
/// certainly spent in one window past the count) and a summary.
async fn late_spender_then(
    server: &RedisServer,
    name: &str,
    other: (&'static str, RedisStore),
    other_headroom_ms: i64,
) -> (Vec<String>, String) {
    let leasing = store(server, true, Some((100, 0.5))).await;
    let policy = Policy::new(format!("late-{name}"), vec![limit("20/203ms")])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let key = Key::from(format!("late-{name}"));
    let mut spent = Vec::new();
    let mut earliest: Option<i64> = None;
    for _ in 0..12 {
        let lo = micros(SystemTime::now());
        let d = leasing.check(&key, &policy, 1).await.unwrap();
        let hi = micros(SystemTime::now());
        if d.is_allowed() {
            if let Some(r) = recorded_at(&d).map(micros).filter(|r| *r < lo) {
                earliest = Some(earliest.map_or(r, |e: i64| e.min(r)));
            }
            spent.push(Spent {
                lo,
                hi,
                cost: 1,
                era: 0,
                who: "leasing",
                refunded: false,
            });
        }
        tokio::time::sleep(Duration::from_millis(8)).await;
    }
    let leased = spent.len();
    let late = earliest.map(|r| micros(SystemTime::now()) - r);
    if let Some(r) = earliest {
        let wait = r + (203 + other_headroom_ms + 5) * 1000 - micros(SystemTime::now());
        tokio::time::sleep(Duration::from_micros(wait.max(0) as u64)).await;
    }
    let mut admitted = 0;
    for _ in 0..20 {
        let lo = micros(SystemTime::now());
        let d = other.1.check(&key, &policy, 1).await.unwrap();
        let hi = micros(SystemTime::now());
        if d.is_allowed() {
            admitted += 1;
            spent.push(Spent {
                lo,
                hi,
                cost: 1,
                era: 0,
                who: other.0,
                refunded: false,
            });
        }
    }
    let (most, window) = most_in_a_window(&spent, 203_000);
    let summary = format!(
        "{name}: leasing store admitted {leased} (earliest lease logged {late:?} us before its last spend), \
         then {} admitted {admitted} of 20; most {most} in a window of 203 ms",
        other.0
    );
    let broke = if most > 20 {
        vec![format!("{name}: {most} units in {window}")]
    } else {
        Vec::new()
    };
    (broke, summary)
}

/// (B) Control for the two below: the other store has the same lease settings (full tier).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_spent_lease_then_a_store_of_the_same_settings_stays_within_the_count() {
    let server = RedisServer::start();
    let other = ("full leased", store(&server, false, Some((100, 0.5))).await);
    let (broke, summary) = late_spender_then(&server, "same", other, 0).await;
    eprintln!("{summary}");
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (B) The other store has no leases: it reads windows of `w` and misses the lease logged
/// before them but spent in them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "over: a store without leases admits the count beside a leasing store's units spent late in the same window"]
async fn a_late_spent_lease_then_a_store_without_leases_stays_within_the_count() {
    let server = RedisServer::start();
    let other = ("plain unleased", store(&server, true, None).await);
    let (broke, summary) = late_spender_then(&server, "unleased", other, 0).await;
    eprintln!("{summary}");
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (B) The other store leases with a period of 20 ms (h = 20 ms): it reads windows of
/// `w + 20 ms` and misses a lease logged before them but spent up to 100 ms later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "over in some runs (21 units in a window of 20/203ms): a store of a shorter lease period beside a leasing store's units spent late"]
async fn a_late_spent_lease_then_a_store_of_a_shorter_period_stays_within_the_count() {
    let server = RedisServer::start();
    let other = (
        "plain short leased",
        store(&server, true, Some((20, 0.5))).await,
    );
    let (broke, summary) = late_spender_then(&server, "short", other, 20).await;
    eprintln!("{summary}");
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (B) The bound on a key with state: a leasing store's event time 150 ms back on `20/203ms`
/// (h = 100 ms: the bound is 103 ms) after 0, 1 and 12 admissions now (the last heats the
/// key, which leases), on both tiers: `EventTooOld` each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_time_bound_on_a_key_with_state() {
    let server = RedisServer::start();
    let mut broke = Vec::new();
    let mut seen = Vec::new();
    for text in [
        "2/203ms", "4/203ms", "5/203ms", "6/203ms", "8/203ms", "20/203ms",
    ] {
        let policy = Policy::new(
            format!("state-{}", text.replace('/', "-")),
            vec![limit(text)],
        )
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
        for plain in [true, false] {
            let st = store(&server, plain, Some((100, 0.5))).await;
            for before in [0, 1, 12] {
                let key = Key::from(format!("state-{text}-{plain}-{before}"));
                for _ in 0..before {
                    st.check(&key, &policy, 1).await.unwrap();
                }
                let mut row = format!("{text} plain {plain}, {before} admissions before:");
                for back in [98, 104, 120, 150, 98, 150] {
                    let got = st.check_at(&key, &policy, 1, from_now(-back)).await;
                    row += &format!(" -{back} ms {:?};", got.as_ref().map(|d| d.is_allowed()));
                    let old = matches!(got, Err(StoreError::EventTooOld));
                    if (back > 103) != old {
                        broke.push(format!(
                            "plain {plain}, {before} before: -{back} ms: {got:?}"
                        ));
                    }
                }
                seen.push(row);
            }
        }
    }
    eprintln!("{seen:#?}");
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (B) Stores without leases deciding now and at event times, and leasing stores (both tiers)
/// deciding only event times (never from a lease, so every unit is spent when logged, and
/// the windows as logged are the windows as spent), on one log key: never more than a
/// limit's count in any window. This is the mix the event-time bound of `W − h` is for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasing_event_times_beside_stores_without_leases_stay_within_every_window() {
    let server = RedisServer::start();
    let stores = four_stores(&server).await;
    let mut broke = Vec::new();
    for (name, limits, seed) in [
        ("events-one", &["20/203ms"][..], 13u64),
        ("events-two", &["10/101ms", "30/403ms"][..], 17),
    ] {
        let (b, summary) = mixed_log_of(name, &stores, &[2, 3], limits, seed, 120).await;
        eprintln!("{summary}");
        broke.extend(b);
    }
    assert!(broke.is_empty(), "{broke:#?}");
}
