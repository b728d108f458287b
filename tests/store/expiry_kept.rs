//! Rounded expiries that busy keys keep (`expiry.lua`, `expires_at`), against a real Redis and
//! the store's own scripts on Redis's own clock (Redis TIME, as in production).
//!
//! What a key must keep, read after every step with one script (`GET` or the newest event,
//! `PEXPIRETIME` and Redis TIME at one instant):
//! - GCRA: the key exists until its backlog has drained: its expiry (ms) is at least the
//!   state's stamp plus the drain of its backlog under the counts it was written under; and
//!   the invariant every writer keeps, an expiry at least `expires_at(stamp + W, W)`.
//! - The sliding log: the key exists until twice the policy's longest window W after its
//!   newest event (`expires_at(e + 2 W, W)`).
//!
//! And what it must not keep: an idle key is gone an eighth of its window after what it
//! needs.
//!
//! Each test prints its figures (`--nocapture`).

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use crate::support::seeded::Lcg;
use crate::support::time::micros;
use crate::support::RedisServer;
use bytes::Bytes;
use fred::prelude::*;
use tokio::time::Instant;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::test_util::{redis_key, with_limits, Reserve, Ticket};
use tower_redis_ratelimit::{
    Algorithm, Decision, Key, Limit, Policy, RedisStore, Settlement, Store, StoreError,
};

/// `expiry.lua`'s `expires_at`: `until_us` rounded up to an eighth of `window` (whole ms, at
/// least 1 ms), in ms.
fn expires_at(until_us: i64, window: i64) -> i64 {
    let quantum = ((window - window % 8000) / 8).max(1000);
    let x = until_us + quantum - 1;
    (x - x % quantum) / 1000
}

/// A key's GCRA state, read at one instant: stamp, backlog and weight of its first limit
/// (`None`: no key), its expiry (`PEXPIRETIME`) and Redis TIME (µs).
struct GcraRead {
    state: Option<(i64, i64, i64)>,
    /// Backlog and weight of every limit, shortest window first.
    limits: Vec<(i64, i64)>,
    expires: i64,
    now: i64,
}

async fn read_gcra(client: &Client, key: &str) -> GcraRead {
    let script = "local v = redis.call('GET', KEYS[1]) or '' \
        local e = redis.call('PEXPIRETIME', KEYS[1]) \
        local t = redis.call('TIME') \
        return {v, e, t[1] * 1000000 + t[2]}";
    let reply: Vec<Value> = client.eval(script, vec![key], ()).await.unwrap();
    let bytes = match &reply[0] {
        Value::Bytes(b) => b.clone(),
        Value::String(s) => Bytes::from(s.to_string()),
        _ => Bytes::new(),
    };
    let int = |i: usize| i64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().unwrap());
    let state = (bytes.len() >= 24).then(|| (int(0), int(1), int(2)));
    let n = bytes.len().saturating_sub(16) / 24;
    let limits = (0..n).map(|i| (int(3 * i + 1), int(3 * i + 2))).collect();
    GcraRead {
        state,
        limits,
        expires: reply[1].as_i64().unwrap(),
        now: reply[2].as_i64().unwrap(),
    }
}

/// A sliding log's newest event (µs; `None`: no key), its expiry and Redis TIME (µs).
async fn read_log(client: &Client, key: &str) -> (Option<i64>, i64, i64) {
    let script = "local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES') \
        local e = redis.call('PEXPIRETIME', KEYS[1]) \
        local t = redis.call('TIME') \
        return {top[2] or '-1', e, t[1] * 1000000 + t[2]}";
    let reply: Vec<Value> = client.eval(script, vec![key], ()).await.unwrap();
    let newest = reply[0]
        .as_string()
        .and_then(|s| s.parse::<f64>().ok())
        .map(|s| s as i64)
        .filter(|s| *s >= 0);
    (
        newest,
        reply[1].as_i64().unwrap(),
        reply[2].as_i64().unwrap(),
    )
}

/// µs the backlog `b` of weight `u` takes to drain under `count` per `window` µs (`gcra.rs`:
/// `d = count / g`, `u = window / g`).
fn drain(b: i64, u: i64, count: i64, window: i64) -> i64 {
    let (num, den) = (b as i128 * window as i128, u as i128 * count as i128);
    ((num + den - 1) / den) as i64
}

fn limit(text: &str) -> Limit {
    text.parse().unwrap()
}

/// The four kinds of store on one server: plain tier on or off, leasing (100 ms period, the
/// headroom, and up to half a count per lease) or not.
async fn four_stores(server: &RedisServer) -> Vec<(&'static str, RedisStore)> {
    let mut stores = Vec::new();
    for (name, plain, leased) in [
        ("plain", true, false),
        ("full", false, false),
        ("plain leased", true, true),
        ("full leased", false, true),
    ] {
        let mut builder = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .plain_scripts(plain);
        if leased {
            // A share of half the count, so that a busy key of these tests' counts leases.
            let leases = Leases::new()
                .period(Duration::from_millis(100))
                .max_share(0.5);
            builder = builder.leases(leases);
        }
        stores.push((name, builder.connect().await.unwrap()));
    }
    stores
}

/// (1) A GCRA write sets its expiry with PSETEX for the ms from the time its script read
/// (Redis TIME) to `expires_at(now + W)`; the key expires no sooner only where Redis counts
/// PSETEX from a time no earlier than that TIME. Redis 7.0 counts it from when PSETEX runs,
/// after TIME; Redis 7.2 and later fix both at the call's start (TIME in a script answers
/// that time). Shown three ways: a bare script that spins on TIME for 1.5 ms (where TIME
/// moves) and then sets PSETEX 1000 (the premise, 20 times); 1 000 fresh keys of `10/1s` per
/// tier (the invariant `expires_at(stamp + W, W)`); and 1 000 fresh keys of `15/15ms` filled
/// in one request per tier (quantum 1 ms: a key short of its invariant expires before its
/// backlog drains). Keys set a ms later than `expires_at` (PSETEX after the ms ticked) are
/// counted as off the quantum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_keys_expire_no_sooner_than_their_stamp_plus_the_window() {
    let server = RedisServer::start();
    let client = server.client().await;
    // The mechanism: TIME read 1 ms after the call started, then PSETEX 1000.
    let probe = "local s = redis.call('TIME') \
        local start = s[1] * 1000000 + s[2] \
        local t = start \
        local i = 0 \
        while t < start + 1500 and i < 300000 do \
          local x = redis.call('TIME') t = x[1] * 1000000 + x[2] i = i + 1 \
        end \
        redis.call('PSETEX', KEYS[1], 1000, 'x') \
        return {t, redis.call('PEXPIRETIME', KEYS[1])}";
    let mut probe_short = 0;
    for i in 0..20 {
        let reply: Vec<i64> = client
            .eval(probe, vec![format!("probe-{i}")], ())
            .await
            .unwrap();
        if reply[1] < reply[0] / 1000 + 1000 {
            probe_short += 1;
        }
    }
    eprintln!("probe: {probe_short}/20 PSETEX 1000 after TIME expire sooner than TIME + 1000 ms");
    let mut broke = Vec::new();
    if probe_short > 0 {
        broke.push(format!(
            "{probe_short}/20: PSETEX in a script counts from before its TIME"
        ));
    }

    let stores = [
        ("plain", server.store().await),
        ("full", server.full_scripts_store().await),
    ];
    for (name, store) in &stores {
        for (text, cost, n) in [("10/1s", 1u32, 1000), ("15/15ms", 15, 1000)] {
            let policy = Policy::new("fresh", [limit(text)])
                .unwrap()
                .with_algorithm(Algorithm::Gcra);
            let window = policy_window(text);
            let count: i64 = text.split('/').next().unwrap().parse().unwrap();
            let (mut short, mut worst, mut need_short, mut gone, mut misaligned) = (0, 0, 0, 0, 0);
            for i in 0..n {
                let key = Key::from(format!("fresh-{name}-{text}-{i}"));
                let d = store.check(&key, &policy, cost).await.unwrap();
                assert!(d.is_allowed());
                let read = read_gcra(&client, &redis_key(store, &key, &policy)).await;
                let Some((stamp, b, u)) = read.state else {
                    gone += 1;
                    continue;
                };
                let least = expires_at(stamp + window, window);
                if read.expires < least {
                    short += 1;
                    worst = worst.max(least - read.expires);
                }
                if read.expires * 1000 < stamp + drain(b, u, count, window) {
                    need_short += 1;
                }
                let quantum = ((window - window % 8000) / 8).max(1000);
                if (read.expires * 1000) % quantum != 0 {
                    misaligned += 1;
                }
            }
            eprintln!(
                "{name} {text}: {n} fresh keys, {short} expire before expires_at(stamp + W) (worst by {worst} ms), {need_short} before their backlog drains, {misaligned} off the quantum, {gone} gone before read"
            );
            if short > 0 || need_short > 0 {
                broke.push(format!("{name} {text}: {short} short (worst {worst} ms), {need_short} before the drain"));
            }
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// The window of the one-limit policy `text` (`c/Nms` or `c/Ns` or `c/Nd`), µs.
fn policy_window(text: &str) -> i64 {
    let w = text.split('/').nth(1).unwrap();
    let (n, unit) = w.split_at(w.find(|c: char| !c.is_ascii_digit()).unwrap());
    let n: i64 = if n.is_empty() { 1 } else { n.parse().unwrap() };
    n * match unit {
        "ms" => 1000,
        "s" => 1_000_000,
        "h" => 3_600_000_000,
        "d" => 86_400_000_000,
        _ => panic!("unit {unit}"),
    }
}

/// Settles the last admitted decision `last` of a sequence (the store that made it, its policy
/// and the decision) on `key`: a charge or a refund of `units`. Returns whether a settlement
/// was sent, and what the step did.
async fn settle_last(
    key: &Key,
    last: Option<(&(&'static str, RedisStore), &Policy, &Decision)>,
    charge: bool,
    units: u64,
) -> (bool, String) {
    let Some(((name, store), policy, d)) = last else {
        return (false, "nothing to settle".into());
    };
    let settlement = if charge {
        Settlement::charge(d, units)
    } else {
        Settlement::refund(d, units)
    };
    let sent = settlement.is_some();
    if let Some(settlement) = settlement {
        store.settle(key, policy, settlement).await.unwrap();
    }
    let kind = if charge { "charge" } else { "refund" };
    (sent, format!("{name}: settle {kind} {units}"))
}

/// Resets `key` through `store` one time in three: what the step did, or `None`.
async fn reset_sometimes(
    rng: &mut Lcg,
    (name, store): (&str, &RedisStore),
    key: &Key,
    policy: &Policy,
) -> Option<String> {
    if rng.next(3) != 0 {
        return None;
    }
    store.reset(key, policy).await.unwrap();
    Some(format!("{name}: reset"))
}

/// A pause of 50 to 200 ms between a sequence's steps.
async fn pause(rng: &mut Lcg) -> String {
    let ms = 50 + rng.next(150);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    format!("pause {ms} ms")
}

/// Waits until 30 ms before `needed` (µs of Redis time; `now` the last read of it), then
/// whether `redis` still exists, and whether there was time to wait at all.
async fn exists_before(client: &Client, redis: &str, needed: i64, now: i64) -> (bool, bool) {
    let wait = needed - 30_000 - now;
    if wait > 0 {
        tokio::time::sleep(Duration::from_micros(wait as u64)).await;
    }
    let exists: i64 = client.exists(redis).await.unwrap();
    (exists == 1, wait > 0)
}

/// (2) One GCRA key through all four stores (plain and full tier, leasing and not) in a
/// seeded sequence of 90 steps: admissions of 1 to 3 units under the policy's counts, under
/// raised counts (twice, `Policy::with_limits`) and lowered ones (half), charges (up to past
/// the bucket) and refunds of admitted requests (`Store::settle`), reservations
/// (`Reserve::reserve`, recorded past the bucket), bursts of 12 (a leasing store leases, and
/// gives back what it left), resets, and pauses of up to 200 ms. After every step the key
/// exists until every limit's backlog drains under the counts it was written under, and no
/// sooner than `expires_at(stamp + W)`. Then, on the key reset, 8 admissions through the
/// plain tier 150 ms apart (the last of 5 units) keep it too, and time passes to 30 ms
/// before the drain, and the key is still there. One limit (`20/1s`: `gcra_plain.lua`'s
/// one-limit path), and two (`10/250ms` and `20/1s`: its loop, `write`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_key_lives_until_its_backlog_drains_through_mixed_stores_and_steps() {
    let one = [&["20/1s"][..], &["40/1s"], &["10/1s"]];
    gcra_sequence("gcra-seq", one, 53).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_key_of_two_limits_lives_until_both_backlogs_drain() {
    let two = [
        &["10/250ms", "20/1s"][..],
        &["20/250ms", "40/1s"],
        &["5/250ms", "10/1s"],
    ];
    gcra_sequence("gcra-seq-two", two, 54).await;
}

/// Test (2) on `key` with the policy's limits, raised and lowered (`sets`, each shortest
/// window first, the same windows), from `seed`.
async fn gcra_sequence(name: &str, sets: [&[&str]; 3], seed: u64) {
    let server = RedisServer::start();
    let client = server.client().await;
    let stores = four_stores(&server).await;
    let limits = |set: &[&str]| set.iter().map(|l| limit(l)).collect::<Vec<_>>();
    let base = Policy::new("seq", limits(sets[0]))
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let policies = [
        (sets[0].join("+"), base.clone()),
        (
            sets[1].join("+"),
            with_limits(&base, limits(sets[1])).unwrap(),
        ),
        (
            sets[2].join("+"),
            with_limits(&base, limits(sets[2])).unwrap(),
        ),
    ];
    let windows: Vec<i64> = sets[0].iter().map(|l| policy_window(l)).collect();
    let window = *windows.last().unwrap();
    // The count a limit's weight was written under (u = w / gcd(c, w)), by window and weight.
    let mut counts = HashMap::new();
    for set in sets {
        for l in set {
            let (c, w): (i64, i64) = (
                l.split('/').next().unwrap().parse().unwrap(),
                policy_window(l),
            );
            let g = (1..=c).rev().find(|g| c % g == 0 && w % g == 0).unwrap();
            counts.insert((w, w / g), c);
        }
    }
    let key = Key::from(name);
    let redis = redis_key(&stores[0].1, &key, &base);
    let mut rng = Lcg(seed);
    let mut last: Option<(usize, usize, Decision)> = None;
    let (mut admitted, mut refused, mut settled, mut resets, mut kept) = (0, 0, 0, 0, 0);
    let mut reserved = 0;
    let mut previous = -2;
    let mut broke = Vec::new();
    // When the state read drains: its stamp plus the longest drain of its limits.
    let drained = |read: &GcraRead| {
        let (stamp, _, _) = read.state?;
        let mut longest = 0;
        for (i, &(b, u)) in read.limits.iter().enumerate() {
            let c = counts[&(windows[i], u)];
            longest = longest.max(drain(b, u, c, windows[i]));
        }
        Some((stamp, stamp + longest))
    };
    for step in 0..90u64 {
        let s = rng.next(4) as usize;
        let (name, store) = (&stores[s].0, &stores[s].1);
        let op = rng.next(14);
        let what = match op {
            13 => {
                // A burst: a leasing store takes a lease, and gives back what it left unused.
                let mut took = 0;
                for _ in 0..12 {
                    let d = store.check(&key, &base, 1).await.unwrap();
                    took += i32::from(d.is_allowed());
                }
                admitted += took;
                format!("{name}: burst of 12, {took} admitted")
            }
            0..=6 => {
                let p = [0, 0, 0, 1, 2][rng.next(5) as usize];
                let cost = 1 + rng.next(3) as u32;
                let d = store.check(&key, &policies[p].1, cost).await.unwrap();
                if d.is_allowed() {
                    admitted += 1;
                    last = Some((s, p, d));
                } else {
                    refused += 1;
                }
                format!("{name}: check {cost} under {}", policies[p].0)
            }
            7 | 8 => {
                // Up to past the bucket: a charge that overfills it.
                let units = 1 + rng.next(30);
                let last = last
                    .as_ref()
                    .map(|(s, p, d)| (&stores[*s], &policies[*p].1, d));
                let (done, what) = settle_last(&key, last, op == 7, units).await;
                settled += usize::from(done);
                what
            }
            9 => {
                let what = reset_sometimes(&mut rng, (name, store), &key, &base).await;
                if what.is_some() {
                    resets += 1;
                    last = None;
                }
                what.unwrap_or_else(|| "no reset".into())
            }
            10 => {
                // A reservation: recorded past the bucket (the backlog is the line).
                let cost = 1 + rng.next(6) as u32;
                let ticket = Ticket {
                    cost,
                    ..Ticket::new(step, Duration::from_secs(2))
                };
                let d = Reserve::reserve(store, &key, &base, ticket).await;
                reserved += usize::from(d.as_ref().is_ok_and(|d| d.is_allowed()));
                format!("{name}: reserve {cost}: {:?}", d.map(|d| d.is_allowed()))
            }
            _ => pause(&mut rng).await,
        };
        tokio::time::sleep(Duration::from_millis(rng.next(30))).await;
        let read = read_gcra(&client, &redis).await;
        if let Some((stamp, needed)) = drained(&read) {
            let least = expires_at(stamp + window, window);
            if read.expires * 1000 < needed || read.expires < least || read.expires < 0 {
                broke.push(format!(
                    "step {step} ({what}): stamp {stamp}, backlogs and weights {:?}: expires at {} ms, needs {} (invariant {least})",
                    read.limits,
                    read.expires,
                    (needed + 999) / 1000
                ));
            }
            if read.expires == previous {
                kept += 1;
            }
            previous = read.expires;
        }
    }
    // Then the plain tier alone on a fresh key (a reset), admissions 150 ms apart (over a
    // quantum of 125 ms): each moves the expiry it needs past the one the stamp before it
    // guarantees.
    stores[0].1.reset(&key, &base).await.unwrap();
    for step in 0..8 {
        // The last one of 5 units, whose drain the key must outlive (below).
        let cost = if step == 7 { 5 } else { 1 };
        let d = stores[0].1.check(&key, &base, cost).await.unwrap();
        let read = read_gcra(&client, &redis).await;
        let (stamp, _) = drained(&read).expect("state");
        let least = expires_at(stamp + window, window);
        if !d.is_allowed() || read.expires < least {
            broke.push(format!(
                "plain step {step}: admitted {}, stamp {stamp}: expires at {} ms, invariant {least}",
                d.is_allowed(),
                read.expires
            ));
        }
        if step < 7 {
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    }
    // The last state: still there 30 ms before its backlog has drained.
    let read = read_gcra(&client, &redis).await;
    let mut tail = String::from("no state at the end");
    if let Some((_, needed)) = drained(&read) {
        let (exists, waited) = exists_before(&client, &redis, needed, read.now).await;
        tail = format!(
            "drains {} ms after the last step; exists 30 ms before: {exists}",
            (needed - read.now) / 1000
        );
        if waited && !exists {
            broke.push(format!("gone before its backlog drained: {tail}"));
        }
    }
    eprintln!(
        "{name}: {admitted} admitted, {refused} refused, {reserved} reserved, {settled} settled, {resets} resets; {kept} reads saw the expiry the read before did; {tail}"
    );
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (3) One sliding-log key of `20/1s` through all four stores in a seeded sequence of 90
/// steps: admissions now, at event times up to 900 ms back and up to 300 ms ahead
/// (`Store::check_at`, the full tier's scheduled events), charges and refunds, resets and
/// pauses. After every step the key expires no sooner than `expires_at(e + 2 W, W)` for its
/// newest event e (`sliding_log_plain.lua`, "Expiry"); how many reads were short of
/// `e + 2 L` (L with the leasing stores' headroom) is printed. Then 8 admissions now through
/// the plain tier, 150 ms apart, keep it too; and time passes to 30 ms before `e + 2 W` and
/// the key is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_key_lives_twice_the_window_after_its_newest_event_through_mixed_stores() {
    let server = RedisServer::start();
    let client = server.client().await;
    let stores = four_stores(&server).await;
    let window = 1_000_000i64;
    let policy = Policy::new("logseq", [limit("20/1s")]).unwrap();
    let key = Key::from("log-seq");
    let redis = redis_key(&stores[0].1, &key, &policy);
    let mut rng = Lcg(55);
    let mut last: Option<(usize, Decision)> = None;
    let (mut admitted, mut refused, mut settled, mut resets, mut short_of_2l, mut kept) =
        (0, 0, 0, 0, 0, 0);
    let mut previous = -2;
    let mut broke = Vec::new();
    for step in 0..90 {
        let s = rng.next(4) as usize;
        let (name, store) = (&stores[s].0, &stores[s].1);
        let op = rng.next(14);
        let what = match op {
            0..=7 => {
                let cost = 1 + rng.next(2) as u32;
                let (d, at) = match op {
                    0..=3 => (store.check(&key, &policy, cost).await, "now".to_string()),
                    4..=5 => {
                        let back = rng.next(900);
                        let at = SystemTime::now() - Duration::from_millis(back);
                        (
                            store.check_at(&key, &policy, cost, at).await,
                            format!("{back} ms back"),
                        )
                    }
                    _ => {
                        let ahead = rng.next(300);
                        let at = SystemTime::now() + Duration::from_millis(ahead);
                        (
                            store.check_at(&key, &policy, cost, at).await,
                            format!("{ahead} ms ahead"),
                        )
                    }
                };
                match d {
                    Ok(d) if d.is_allowed() => {
                        admitted += 1;
                        last = Some((s, d));
                    }
                    Ok(_) => refused += 1,
                    Err(e) => eprintln!("step {step}: {name} at {at}: {e}"),
                }
                format!("{name}: check {cost} {at}")
            }
            8 | 9 => {
                let units = 1 + rng.next(3);
                let last = last.as_ref().map(|(s, d)| (&stores[*s], &policy, d));
                let (done, what) = settle_last(&key, last, op == 8, units).await;
                settled += usize::from(done);
                what
            }
            10 => {
                let what = reset_sometimes(&mut rng, (name, store), &key, &policy).await;
                if what.is_some() {
                    resets += 1;
                    last = None;
                }
                what.unwrap_or_else(|| "no reset".into())
            }
            _ => pause(&mut rng).await,
        };
        tokio::time::sleep(Duration::from_millis(rng.next(30))).await;
        let (newest, expires, _) = read_log(&client, &redis).await;
        if let Some(e) = newest {
            let least = expires_at(e + 2 * window, window);
            if expires < least {
                broke.push(format!(
                    "step {step} ({what}): newest event {e}: expires at {expires} ms, invariant {least}"
                ));
            }
            if expires * 1000 < e + 2 * (window + 100_000) {
                short_of_2l += 1;
            }
            if expires == previous {
                kept += 1;
            }
            previous = expires;
        }
    }
    // Then the plain tier alone, admissions now 150 ms apart (over a quantum of 125 ms), once
    // the events ahead of now have passed: each moves the expiry it needs past the one the
    // event before it guarantees.
    tokio::time::sleep(Duration::from_millis(400)).await;
    for step in 0..8 {
        let d = stores[0].1.check(&key, &policy, 1).await.unwrap();
        let (newest, expires, _) = read_log(&client, &redis).await;
        let e = newest.expect("an event");
        let least = expires_at(e + 2 * window, window);
        if !d.is_allowed() || expires < least {
            broke.push(format!(
                "plain step {step}: admitted {}, newest event {e}: expires at {expires} ms, invariant {least}",
                d.is_allowed()
            ));
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let (newest, _, now) = read_log(&client, &redis).await;
    let mut tail = String::from("no events at the end");
    if let Some(e) = newest {
        let needed = e + 2 * window;
        let (exists, waited) = exists_before(&client, &redis, needed, now).await;
        tail = format!(
            "newest event + 2 W is {} ms after the last step; exists 30 ms before: {exists}",
            (needed - now) / 1000
        );
        if waited && !exists {
            broke.push(format!("gone before newest + 2 W: {tail}"));
        }
    }
    eprintln!(
        "log sequence: {admitted} admitted, {refused} refused, {settled} settled, {resets} resets; {kept} reads saw the expiry the read before did; {short_of_2l} reads short of newest + 2 L (L = W + 100 ms); {tail}"
    );
    assert!(broke.is_empty(), "{broke:#?}");
}

/// The weights of a log key's events (`<time>:<total>:<weight>`), by time (µs): a give-back
/// rewrites the members of its event and of every later one (their totals), so an event is
/// known by its time, and the latest read of a time replaces the earlier ones (give-backs
/// only make events lighter); times no longer held (trimmed, expired) keep their last read.
async fn log_events(client: &Client, key: &str, into: &mut HashMap<i64, Vec<i64>>) {
    let members: Vec<String> = client
        .zrange(key, 0, -1, None, false, None, false)
        .await
        .unwrap();
    let mut read: HashMap<i64, Vec<i64>> = HashMap::new();
    for m in members {
        let mut parts = m.split(':');
        let time: i64 = parts.next().unwrap().parse().unwrap();
        let weight: i64 = parts.nth(1).map_or(1, |w| w.parse().unwrap());
        read.entry(time).or_default().push(weight);
    }
    into.extend(read);
}

/// (4) Never over while most writes keep their expiry: 12 clients over all four stores on one
/// sliding-log key of `30/200ms` (quantum 25 ms) for 1.5 s, 60 quanta. Every event the key
/// held (read every 30 ms, and kept even once trimmed or expired) is counted in the window
/// that ends at it: at most 30 units, which a key that expired while its events mattered
/// would break (it starts over empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_key_never_admits_past_its_count_while_writes_keep_its_expiry() {
    let server = RedisServer::start();
    let client = server.client().await;
    let stores = four_stores(&server).await;
    let (count, window) = (30i64, 200_000i64);
    let policy = Policy::new("loghot", [limit("30/200ms")]).unwrap();
    let key = Key::from("log-hot");
    let redis = redis_key(&stores[0].1, &key, &policy);
    let origin = Instant::now();
    let run = Duration::from_millis(1500);
    let mut handles = Vec::new();
    for task in 0..12 {
        let store = stores[task % 4].1.clone();
        let (key, policy) = (key.clone(), policy.clone());
        handles.push(tokio::spawn(async move {
            let (mut admitted, mut decided) = (0u64, 0u64);
            while origin.elapsed() < run {
                if let Ok(d) = store.check(&key, &policy, 1).await {
                    decided += 1;
                    admitted += u64::from(d.is_allowed());
                }
            }
            (admitted, decided)
        }));
    }
    let mut events = HashMap::new();
    let (mut seen, mut gone) = (false, 0);
    while origin.elapsed() < run + Duration::from_millis(50) {
        log_events(&client, &redis, &mut events).await;
        let exists: i64 = client.exists(&redis).await.unwrap();
        seen |= exists == 1;
        gone += usize::from(seen && exists == 0);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let (mut admitted, mut decided) = (0, 0);
    for h in handles {
        let (a, d) = h.await.unwrap();
        admitted += a;
        decided += d;
    }
    let mut times: Vec<(i64, i64)> = events
        .iter()
        .map(|(t, weights)| (*t, weights.iter().sum()))
        .collect();
    times.sort();
    let mut worst = 0;
    for (j, &(t, _)) in times.iter().enumerate() {
        let held: i64 = times[..=j]
            .iter()
            .filter(|(e, _)| *e > t - window)
            .map(|(_, w)| w)
            .sum();
        worst = worst.max(held);
    }
    eprintln!(
        "log hot: {decided} decisions, {admitted} admitted by clients, {} events recorded, most units in one window {worst} (count {count}); key absent at {gone} reads",
        times.len()
    );
    assert!(
        worst <= count && gone == 0,
        "most in a window {worst} > {count}, absent {gone}"
    );
}

/// (5) Windows at the quantum's edges, on both tiers: under 8 ms (`5/5ms`, quantum 1 ms),
/// not a multiple of 8 ms (`7/1001ms`, quantum 125 ms) and a day (`10/1d`, quantum 3 h).
/// After each of two admissions on a fresh key: GCRA expires at `expires_at(stamp + W)`
/// (PSETEX counts from when it runs: up to 5 ms later), the log at `expires_at(e + 2 W)`,
/// no later (a key kept no more than an eighth of its window longer). A second admission right after keeps the day's expiry (same quantum).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiries_round_to_an_eighth_of_tiny_odd_and_day_long_windows() {
    let server = RedisServer::start();
    let client = server.client().await;
    let stores = [
        ("plain", server.store().await),
        ("full", server.full_scripts_store().await),
    ];
    let mut broke = Vec::new();
    for (name, store) in &stores {
        for text in ["5/5ms", "7/1001ms", "10/1d"] {
            let window = policy_window(text);
            for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog] {
                let policy = Policy::new("edge", [limit(text)])
                    .unwrap()
                    .with_algorithm(algorithm);
                let key = Key::from(format!("edge-{name}-{text}"));
                let redis = redis_key(store, &key, &policy);
                let mut expiries = Vec::new();
                for _ in 0..2 {
                    let d = store.check(&key, &policy, 1).await.unwrap();
                    let (at, expires) = if algorithm == Algorithm::Gcra {
                        let read = read_gcra(&client, &redis).await;
                        (read.state.map(|s| s.0), read.expires)
                    } else {
                        let (newest, expires, _) = read_log(&client, &redis).await;
                        (newest, expires)
                    };
                    let Some(at) = at else {
                        // A 5 ms window may be over before the read.
                        expiries.push((-2, -2));
                        continue;
                    };
                    let span = if algorithm == Algorithm::Gcra {
                        window
                    } else {
                        2 * window
                    };
                    let exact = expires_at(at + span, window);
                    expiries.push((expires, exact));
                    // GCRA's PSETEX counts from Redis's time when it runs, after the script read
                    // TIME (a ms later at times, more on a busy machine); the log's PEXPIREAT is
                    // the ms itself. Whether it may land sooner is test 1's to show.
                    let late = if algorithm == Algorithm::Gcra { 5 } else { 0 };
                    if !d.is_allowed() || expires < exact || expires > exact + late {
                        broke.push(format!(
                            "{name} {text} {algorithm:?}: event/stamp {at}: expires at {expires} ms, expires_at {exact}"
                        ));
                    }
                }
                eprintln!("{name} {text} {algorithm:?}: (expiry, expires_at) after two admissions {expiries:?}");
                if text == "10/1d" && expiries[0].0 != expiries[1].0 {
                    broke.push(format!("{name} {text} {algorithm:?}: second admission moved the expiry {expiries:?}"));
                }
            }
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (6) Idle keys vanish: 50 000 GCRA keys and 50 000 sliding-log keys of `1/3s`, each
/// admitted once (alternate writers on the plain and the full tier), all expire: none is
/// kept later than W + W/8 (GCRA) or 2 W + W/8 (the log) after the last write, none lacks an
/// expiry, and `DBSIZE` reaches 0 soon after the last of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_cold_keys_leave_nothing() {
    let server = RedisServer::start();
    let client = server.client().await;
    let mut stores = Vec::new();
    for plain in [true, false] {
        // A generous time budget: a busy machine answers late.
        let builder = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(10))
            .plain_scripts(plain);
        stores.push(builder.connect().await.unwrap());
    }
    let gcra = Policy::new("cold", [limit("1/3s")])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let log = Policy::new("cold", [limit("1/3s")]).unwrap();
    let started = Instant::now();
    let mut tasks = Vec::new();
    let per = 2000;
    for task in 0..50usize {
        let store = stores[task % 2].clone();
        let policy = if task < 25 { gcra.clone() } else { log.clone() };
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                let key = Key::from(format!("cold-{task}-{i}"));
                let d = store.check(&key, &policy, 1).await.unwrap();
                assert!(d.is_allowed());
            }
            micros(SystemTime::now())
        }));
    }
    let mut last_write = 0;
    for t in tasks {
        last_write = last_write.max(t.await.unwrap());
    }
    let written = started.elapsed();
    let size: i64 = client.dbsize().await.unwrap();
    // The latest expiry of the keys left, by type (GCRA: strings, the log: sorted sets), and
    // how many have none, in one script (no key expires while it runs).
    let scan = "local c, g, l, n, never = '0', 0, 0, 0, 0 \
        repeat \
          local r = redis.call('SCAN', c, 'COUNT', 5000) \
          c = r[1] \
          for _, k in ipairs(r[2]) do \
            n = n + 1 \
            local e = redis.call('PEXPIRETIME', k) \
            if e < 0 then never = never + 1 end \
            if redis.call('TYPE', k)['ok'] == 'zset' then \
              if e > l then l = e end \
            elseif e > g then g = e end \
          end \
        until c == '0' \
        return {g, l, n, never}";
    let latest: Vec<i64> = client.eval(scan, Vec::<String>::new(), ()).await.unwrap();
    let (latest_gcra, latest_log) = (latest[0], latest[1]);
    let left_at = Instant::now();
    let mut left = size;
    while left > 0 && left_at.elapsed() < Duration::from_secs(12) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = client.dbsize().await.unwrap();
    }
    let emptied = left_at.elapsed();
    eprintln!(
        "cold keys: 100 000 written in {written:?}, DBSIZE {size} then; {} left at the scan, {} without expiry; latest expiry {} ms (GCRA) and {} ms (log) after the last write; DBSIZE {left} {emptied:?} after the scan",
        latest[2],
        latest[3],
        latest_gcra - last_write / 1000,
        latest_log - last_write / 1000,
    );
    // W + W/8 after the last write for GCRA, 2 W + W/8 for the log, and 5 ms for the time
    // between a write and the client's reading of its clock.
    assert_eq!(latest[3], 0, "keys without expiry");
    assert!(latest[2] > 0, "no keys at the scan");
    assert_eq!(left, 0, "keys left {emptied:?} after they expired");
    assert!(
        latest_gcra - last_write / 1000 <= 3000 + 375 + 5,
        "GCRA kept {latest_gcra}"
    );
    assert!(
        latest_log - last_write / 1000 <= 6000 + 375 + 5,
        "log kept {latest_log}"
    );
}

/// (7) A sliding-log key whose newest event e an unleased store wrote expires at
/// `expires_at(e + 2 W)`, and a leasing store (period 100 ms, the headroom h with `max_share`
/// 0.5) reads every window `W + h` long. 20 ms after that expiry, an event time
/// t = now - (W + h) + 40 ms, whose bare window (t - W, t] holds e, would read a window the
/// key no longer holds, and admit the whole count again: twice the count in one window of W.
/// The leasing store takes event times only up to `W - h` back (`sliding_log.lua`, "Event
/// times"), so it answers `EventTooOld`, whoever wrote the key; an event time 40 ms inside
/// that bound is decided. (With the bound at `W + h`, as it was, the key the unleased store
/// wrote admitted the count again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leasing_store_takes_event_times_only_as_far_back_as_every_writer_keeps_the_log() {
    let server = RedisServer::start();
    let client = server.client().await;
    let unleased = server.store().await;
    let leasing = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .leases(
            Leases::new()
                .period(Duration::from_millis(100))
                .max_share(0.5),
        )
        .connect()
        .await
        .unwrap();
    // The headroom: the period, at most max_share of the shortest window.
    let (window, lease) = (200_000i64, 100_000i64);
    let policy = Policy::new("mixed", [limit("5/200ms")]).unwrap();
    let mut broke = Vec::new();
    for (writer, name) in [(&leasing, "leasing"), (&unleased, "unleased")] {
        let key = Key::from(format!("mixed-{name}"));
        let redis = redis_key(&leasing, &key, &policy);
        let first = writer.check(&key, &policy, 5).await.unwrap();
        assert!(first.is_allowed(), "{first:?}");
        let (newest, expires, now) = read_log(&client, &redis).await;
        let e = newest.expect("the first event");
        // 20 ms after the key the unleased writer wrote has expired, on both keys.
        let expiry = expires_at(e + 2 * window, window);
        let wait = expiry * 1000 + 20_000 - now;
        tokio::time::sleep(Duration::from_micros(wait.max(0) as u64)).await;
        let now = SystemTime::now();
        let far = now - Duration::from_micros((window + lease - 40_000) as u64);
        let near = now - Duration::from_micros((window - lease - 40_000) as u64);
        let exists: i64 = client.exists(&redis).await.unwrap();
        let old = leasing.check_at(&key, &policy, 5, far).await;
        let inside = leasing.check_at(&key, &policy, 1, near).await;
        let at = micros(far);
        eprintln!(
            "{name} writer: e {e}, key expires at {expires} ms; event time {at} (e + {} ms), \
             the key exists {exists}: {old:?}; {} ms back: {inside:?}",
            (at - e) / 1000,
            (micros(now) - micros(near)) / 1000
        );
        // e lies in (t - W, t]: a second admission of 5 puts 10 in that window.
        assert!(at - window < e && e <= at);
        if !matches!(old, Err(StoreError::EventTooOld)) {
            broke.push(format!(
                "{name} writer: {old:?} at {at}, within W of e {e}, key exists {exists}"
            ));
        }
        if !inside.as_ref().is_ok_and(|d| d.is_allowed()) {
            broke.push(format!("{name} writer: {inside:?} inside the bound"));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (8) A lease give-back (`return.lua`) restamps GCRA state at its own time, later than the
/// grant: a leasing store (period 100 ms, the headroom) takes a lease on a busy key of
/// `40/400ms` (quantum 50 ms), and gives back what it left unspent (when the lease expires,
/// or at `RedisStore::drain` 180 ms after the burst). The key must then expire no sooner than
/// `expires_at(stamp + W)` for the new stamp, and an unleased store's admission right after
/// (whose write keeps that expiry) must leave a key that lives until its backlog drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_give_back_keeps_the_key_a_window_after_its_new_stamp() {
    let server = RedisServer::start();
    let client = server.client().await;
    let leasing = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .leases(
            Leases::new()
                .period(Duration::from_millis(100))
                .max_share(0.5),
        )
        .connect()
        .await
        .unwrap();
    let unleased = server.store().await;
    let (count, window) = (40i64, 400_000i64);
    let policy = Policy::new("giveback", [limit("40/400ms")])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let key = Key::from("give-back");
    let redis = redis_key(&leasing, &key, &policy);
    let mut admitted = 0;
    for _ in 0..12 {
        admitted += u32::from(leasing.check(&key, &policy, 1).await.unwrap().is_allowed());
    }
    let leased = tower_redis_ratelimit::test_util::leasing_keys(&leasing);
    let granted = read_gcra(&client, &redis).await;
    tokio::time::sleep(Duration::from_millis(180)).await;
    let given = leasing.drain().await.unwrap();
    let back = read_gcra(&client, &redis).await;
    let after = unleased.check(&key, &policy, 1).await.unwrap();
    let last = read_gcra(&client, &redis).await;
    let mut broke = Vec::new();
    for (what, read) in [
        ("granted", &granted),
        ("given back", &back),
        ("then admitted", &last),
    ] {
        let Some((stamp, b, u)) = read.state else {
            broke.push(format!("{what}: no state"));
            continue;
        };
        let least = expires_at(stamp + window, window);
        let needed = stamp + drain(b, u, count, window);
        eprintln!(
            "{what}: stamp {stamp}, backlog {b}: expires at {} ms, invariant {least}, drains at {} ms",
            read.expires,
            (needed + 999) / 1000
        );
        if read.expires < least || read.expires * 1000 < needed {
            broke.push(format!(
                "{what}: expires at {} < {least} or drain {needed}",
                read.expires
            ));
        }
    }
    eprintln!(
        "{admitted} of 12 admitted, {leased} keys leasing, {given} units given back at drain, then admitted {}",
        after.is_allowed()
    );
    // A give-back happened: the state's stamp moved past the grant's.
    let moved = back.state.map(|s| s.0) > granted.state.map(|s| s.0);
    assert!(
        leased == 1 && moved,
        "no lease given back: leasing {leased}, stamp moved {moved}"
    );
    assert!(broke.is_empty(), "{broke:#?}");
}

/// (9) An override that raises a key's counts, then is removed: a GCRA key of `10/1s` filled
/// to `30/1s` (an override for the key) holds a backlog that drains in 3 s under the
/// policy's own counts, which every write under the override keeps it for (`stretch_num`:
/// it always sets the expiry), on the plain and the full tier. After each admission, and
/// after the override is removed and a request is refused, the key expires no sooner than
/// that drain; 30 ms before it, the key is still there, and a request of the whole count is
/// still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_key_filled_under_raised_counts_lives_until_it_drains_under_the_policys() {
    use tower_redis_ratelimit::store::{Override, Scope};
    let server = RedisServer::start();
    let client = server.client().await;
    let (count, window) = (10i64, 1_000_000i64);
    let policy = Policy::new("stretch", [limit("10/1s")])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let mut broke = Vec::new();
    for (name, store) in [
        ("plain", server.store().await),
        ("full", server.full_scripts_store().await),
    ] {
        let key = Key::from(format!("stretch-{name}"));
        let redis = redis_key(&store, &key, &policy);
        let scope = Scope::Key(key.clone());
        let raise = Override::Limits(vec![limit("30/1s")]);
        store
            .overrides()
            .set(&policy, &scope, &raise)
            .await
            .unwrap();
        let mut steps = Vec::new();
        for _ in 0..6 {
            let d = store.check(&key, &policy, 5).await.unwrap();
            steps.push((
                format!("admitted {} under 30/1s", d.is_allowed()),
                read_gcra(&client, &redis).await,
            ));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        store.overrides().remove(&policy, &scope).await.unwrap();
        let d = store.check(&key, &policy, 1).await.unwrap();
        steps.push((
            format!("admitted {} under 10/1s", d.is_allowed()),
            read_gcra(&client, &redis).await,
        ));
        let mut needed = 0;
        for (what, read) in &steps {
            let Some((stamp, b, u)) = read.state else {
                broke.push(format!("{name} {what}: no state"));
                continue;
            };
            // Under the policy's own counts.
            needed = stamp + drain(b, u, count, window);
            if read.expires * 1000 < needed {
                broke.push(format!(
                    "{name} {what}: expires at {} ms before its drain under 10/1s at {} ms",
                    read.expires,
                    (needed + 999) / 1000
                ));
            }
        }
        let now = steps.last().unwrap().1.now;
        let wait = needed - 30_000 - now;
        if wait > 0 {
            tokio::time::sleep(Duration::from_micros(wait as u64)).await;
        }
        let exists: i64 = client.exists(&redis).await.unwrap();
        // The whole count fits only once the backlog has drained.
        let late = store.check(&key, &policy, 10).await.unwrap();
        eprintln!(
            "{name}: {:?}; drains {} ms after the last step: 30 ms before, exists {exists}, admitted {}",
            steps.iter().map(|(w, r)| (w.clone(), r.expires)).collect::<Vec<_>>(),
            (needed - now) / 1000,
            late.is_allowed()
        );
        if exists != 1 || late.is_allowed() {
            broke.push(format!(
                "{name}: 30 ms before the drain: exists {exists}, admitted {}",
                late.is_allowed()
            ));
        }
    }
    assert!(broke.is_empty(), "{broke:#?}");
}

/// A log whose every event is ahead of a request (bookings ahead, then a request now): the
/// full script moves the totals of the later events up (`log_lighten.lua`, `shift`), which
/// removes every member before it adds them back, and Redis deletes a sorted set left empty,
/// expiry and all. The key keeps an expiry through it, no sooner than twice the window after
/// its newest event, and is gone after that.
#[tokio::test]
async fn a_log_whose_events_are_all_ahead_keeps_its_expiry_when_an_earlier_one_comes() {
    let server = RedisServer::start();
    let client = server.client().await;
    let store = server.store().await;
    let window = 200_000i64;
    let policy = Policy::new("ahead", [limit("10/200ms")])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let key = Key::from("booked-ahead");
    let redis = redis_key(&store, &key, &policy);
    let now = SystemTime::now();
    for ahead in [150, 100] {
        let at = now + Duration::from_millis(ahead);
        let booked = store.check_at(&key, &policy, 1, at).await.unwrap();
        assert!(booked.is_allowed(), "{booked:?}");
    }
    let d = store.check(&key, &policy, 1).await.unwrap();
    assert!(d.is_allowed(), "{d:?}");
    let (newest, expiry, redis_now) = read_log(&client, &redis).await;
    let newest = newest.expect("the log holds its events");
    eprintln!(
        "newest event {} ms ahead of Redis, expiry {} ms ahead",
        (newest - redis_now) / 1000,
        expiry - redis_now / 1000
    );
    assert!(
        expiry >= expires_at(newest + 2 * window, window),
        "the key expires at {expiry} ms, before twice the window after its newest event ({} us)",
        newest
    );
    // Gone once that has passed: an expiry, not a key left for ever.
    tokio::time::sleep(Duration::from_millis(
        (expiry - redis_now / 1000 + 100) as u64,
    ))
    .await;
    let exists: i64 = client.exists(&redis).await.unwrap();
    assert_eq!(exists, 0, "the key outlived its expiry");
}
