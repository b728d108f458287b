//! Listing overrides against real Redis: 100 000 of them, listed page by page while the same
//! store decides requests. Every override is listed once, no decision fails or waits behind the
//! list, and the decisions' breaker stays closed (`Overrides::list`, `store/redis/overrides/list.rs`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use fred::cmd;
use fred::prelude::*;
use futures::StreamExt;
use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::{Key, Policy, RedisStore, Store};

const OVERRIDES: usize = 100_000;

/// The decisions' budget: short, so that a decision stuck behind a long Redis command fails.
const DECISION_TIMEOUT: Duration = Duration::from_millis(100);

/// Key `i` of the seeded overrides; every hundredth has a space, so that the store keeps it
/// hashed.
fn key(i: usize) -> Key {
    match i % 100 {
        0 => Key::from(format!("phone {i}")),
        _ => Key::from(format!("phone-{i}")),
    }
}

/// Copies the one override in the store's overrides hash to the keys `phone-<i>` for each `i`
/// of `ARGV[1]` to `ARGV[2]` not a multiple of 100: its field (the key's Redis key) and its
/// value (which ends with the key) with `ARGV[3]`, the template's key, replaced. One call,
/// about 0.1 s of Redis time, where 100 000 `set`s through the store take about a minute.
/// Returns the number of overrides, less the hash's generation (field `""`), which the
/// writes through the store that follow move on.
const COPY: &str = r#"
local all, field, value = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= '' then
    field, value = all[i], all[i + 1]
  end
end
local template = ARGV[3]
local at = string.find(field, template, 1, true)
local before, after = string.sub(field, 1, at - 1), string.sub(field, at + #template)
local head = string.sub(value, 1, #value - #template)
for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  if i % 100 ~= 0 then
    local key = 'phone-' .. i
    redis.call('HSET', KEYS[1], before .. key .. after, head .. key)
  end
end
return redis.call('HLEN', KEYS[1]) - 1
"#;

/// Seeds `OVERRIDES` key overrides of `sms`: the hashed keys (one in a hundred) through the
/// public API, 64 at a time, the others by copying the first in Redis (`COPY`); then
/// `sms`'s own override, and one of another policy, which its listing must leave out.
async fn seed(server: &RedisServer, sms: &Policy, mail: &Policy) -> Duration {
    let started = Instant::now();
    let overrides = server.store().await.overrides();
    let limits = |n: &str| Override::Limits(vec![n.parse().unwrap()]);
    let template = Scope::Key(key(1));
    overrides
        .set(sms, &template, &limits("3/1h"))
        .await
        .unwrap();
    let client = server.client().await;
    let hashes: Vec<String> = client
        .custom(cmd!("KEYS"), vec!["*overrides"])
        .await
        .unwrap();
    let [hash] = &hashes[..] else {
        panic!("one overrides hash: {hashes:?}");
    };
    let args = vec![
        2.to_string(),
        (OVERRIDES - 1).to_string(),
        key(1).to_string(),
    ];
    let copied: u64 = client.eval(COPY, vec![hash.clone()], args).await.unwrap();
    assert_eq!(copied as usize, OVERRIDES - OVERRIDES / 100);
    let set = |i: usize| {
        let overrides = overrides.clone();
        async move {
            let to = Scope::Key(key(i));
            overrides.set(sms, &to, &Override::Block).await.unwrap();
        }
    };
    let hashed = (0..OVERRIDES).step_by(100).map(set);
    futures::stream::iter(hashed)
        .buffer_unordered(64)
        .collect::<()>()
        .await;
    overrides
        .set(sms, &Scope::All, &limits("7/1h"))
        .await
        .unwrap();
    overrides
        .set(mail, &template, &Override::Block)
        .await
        .unwrap();
    started.elapsed()
}

/// What the decision loop saw: decisions made, failures, the worst latency, and whether the
/// store was healthy after each.
#[derive(Debug, Default)]
struct Seen {
    decisions: usize,
    failures: Vec<String>,
    worst: Duration,
    unhealthy: usize,
}

/// Decides requests of one key, one after the other, until `stop`.
async fn decide_until(store: RedisStore, stop: Arc<AtomicBool>) -> Seen {
    let policy = Policy::new("api", ["1000000/1h".parse().unwrap()]).unwrap();
    let key = Key::from("app-client");
    let mut seen = Seen::default();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let decided = store.check(&key, &policy, 1).await;
        seen.worst = seen.worst.max(started.elapsed());
        seen.decisions += 1;
        if let Err(error) = decided {
            seen.failures.push(error.to_string());
        }
        seen.unhealthy += usize::from(!store.is_healthy());
    }
    seen
}

/// `INFO commandstats` of `command`: (calls, µs of Redis time).
async fn command_stats(client: &Client, command: &str) -> (u64, u64) {
    let info: String = client
        .info(Some(fred::types::InfoKind::CommandStats))
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:");
    let Some(stats) = info.lines().find_map(|l| l.strip_prefix(prefix.as_str())) else {
        return (0, 0);
    };
    let field = |name: &str| -> u64 {
        let value = stats.split(',').find_map(|f| f.strip_prefix(name));
        value.and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    (field("calls="), field("usec="))
}

/// The longest command Redis logged as slow since the log was reset, and its name.
async fn slowest(client: &Client) -> Option<(String, u64)> {
    let entries: Vec<Value> = client
        .custom(cmd!("SLOWLOG"), vec!["GET", "100"])
        .await
        .unwrap();
    let read = |entry: &Value| {
        let Value::Array(fields) = entry else {
            return None;
        };
        let micros = fields.get(2)?.as_u64()?;
        let Value::Array(args) = fields.get(3)? else {
            return None;
        };
        let name = args.first()?.as_string()?.to_ascii_uppercase();
        Some((name, micros))
    };
    entries.iter().filter_map(read).max_by_key(|(_, us)| *us)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_100_000_overrides_neither_fails_nor_stalls_decisions() {
    let server = RedisServer::start();
    let sms = Policy::new("sms", ["5/1h".parse().unwrap()]).unwrap();
    let mail = Policy::new("mail", ["5/1h".parse().unwrap()]).unwrap();
    let seeded = seed(&server, &sms, &mail).await;
    println!("seeded {OVERRIDES} overrides in {seeded:?}");

    let store = RedisStore::builder(server.url())
        .timeout(DECISION_TIMEOUT)
        .connect()
        .await
        .unwrap();
    let client = server.client().await;
    // Every command of 50 ms or more is logged: a page takes a few ms even on a loaded
    // machine; reading all 100 000 at once takes several times that.
    let _: () = client
        .custom(
            cmd!("CONFIG"),
            vec!["SET", "slowlog-log-slower-than", "50000"],
        )
        .await
        .unwrap();
    let _: () = client.custom(cmd!("SLOWLOG"), vec!["RESET"]).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let decisions = tokio::spawn(decide_until(store.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (calls_before, usec_before) = command_stats(&client, "hscan").await;

    let started = Instant::now();
    let listed = store.overrides().list(&sms).await.expect("the list");
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let seen = decisions.await.unwrap();
    let (calls, usec) = command_stats(&client, "hscan").await;
    let (calls, usec) = (calls - calls_before, usec - usec_before);
    let slowest = slowest(&client).await;
    println!(
        "listed {} in {took:?} ({calls} HSCAN, {usec} µs of Redis time); \
         {} decisions meanwhile, worst {:?}; slowest command {slowest:?}",
        listed.len(),
        seen.decisions,
        seen.worst
    );

    assert_eq!(
        listed[0],
        (Scope::All, Override::Limits(vec!["7/1h".parse().unwrap()]))
    );
    let keys: HashSet<&Scope> = listed.iter().map(|(scope, _)| scope).collect();
    assert_eq!(keys.len(), listed.len(), "each override once");
    assert_eq!(
        listed.len(),
        OVERRIDES + 1,
        "every override, no other policy's"
    );
    assert!((0..OVERRIDES).all(|i| keys.contains(&Scope::Key(key(i)))));
    assert!(
        seen.failures.is_empty(),
        "{:?}",
        &seen.failures[..seen.failures.len().min(5)]
    );
    assert_eq!(seen.unhealthy, 0, "the breaker stayed closed");
    assert!(
        seen.decisions >= 10,
        "decisions went on during the list: {seen:?}"
    );
    assert!(slowest.is_none(), "a command of 50 ms or more: {slowest:?}");
    assert!(usec < 1_000_000, "{usec} µs of Redis time for the list");
}

/// Redis stalled longer than the decisions' budget: a page waits on within its own budget,
/// and one that runs past it fails alone, without tripping the decisions' breaker; the next
/// call asks for the same page again.
#[tokio::test]
async fn a_slow_page_has_its_own_budget_and_never_trips_the_breaker() {
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let store = RedisStore::builder(server.url())
        .timeout(DECISION_TIMEOUT)
        .connect()
        .await
        .unwrap();
    let sms = Policy::new("sms", ["5/1h".parse().unwrap()]).unwrap();
    let overrides = store.overrides();
    for i in 0..3 {
        let to = Scope::Key(key(i));
        overrides.set(&sms, &to, &Override::Block).await.unwrap();
    }
    let client = server.client().await;
    let stall = |seconds: &'static str| {
        let client = client.clone();
        tokio::spawn(async move {
            let _: Value = client
                .custom(cmd!("DEBUG"), vec!["SLEEP", seconds])
                .await
                .unwrap();
        })
    };

    let stalled = stall("0.3");
    tokio::time::sleep(Duration::from_millis(30)).await;
    let started = Instant::now();
    let listed = overrides.list(&sms).await;
    assert_eq!(listed.expect("a page within its budget").len(), 3);
    assert!(
        started.elapsed() > DECISION_TIMEOUT,
        "{:?}",
        started.elapsed()
    );
    assert!(store.is_healthy(), "the breaker stayed closed");
    stalled.await.unwrap();

    let stalled = stall("1.5");
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(overrides.list(&sms).await.is_err(), "past its budget");
    assert!(store.is_healthy(), "the breaker stayed closed");
    stalled.await.unwrap();
    assert_eq!(
        overrides.list(&sms).await.unwrap().len(),
        3,
        "listed once Redis answers"
    );
}
