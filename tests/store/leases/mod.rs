//! Leases against a real Redis: a fleet of leasing instances never admits more than the limit
//! and little less; idle keys and `drain()` give their units back; with Redis gone, leases
//! are served until they expire, then the failure mode applies within the time budget.

mod charges;
mod fleet;
mod give_back;
mod heat;
mod heat_field;
mod policies;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::http::{api_key, passes, served, LayerBody};
use crate::support::{evalsha_calls, RedisServer};
use fred::prelude::*;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::test_util::redis_key;
use tower_redis_ratelimit::test_util::Engine;
use tower_redis_ratelimit::{
    Algorithm, BuildError, Key, Policy, RateLimitLayer, RedisStore, Settlement, Store, StoreError,
};

async fn leasing(url: String) -> RedisStore {
    leasing_with(url, Leases::new(), Duration::from_millis(200)).await
}

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn fixed(limit: &str) -> Policy {
    named("idle", limit, Algorithm::FixedWindow)
}

fn named(name: &str, limit: &str, algorithm: Algorithm) -> Policy {
    Policy::new(name, [limit.parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm)
}

const MINUTE: u64 = 60_000_000;

/// The body of the requests and responses of the layered test service.
type Body = LayerBody;

/// Sleeps, if needed, until at least `need` is left in the current fixed 1-minute window
/// (windows start at multiples of a minute since the Unix epoch), so that a test that must stay
/// within one window does.
async fn within_one_minute(need: Duration) {
    let now = micros_now();
    let left = MINUTE - now % MINUTE;
    if left < need.as_micros() as u64 {
        tokio::time::sleep(Duration::from_micros(left + 50_000)).await;
    }
}

/// Asks as the layer does (`check_now`, else `check`); whether the request was admitted.
async fn admit(store: &RedisStore, key: &Key, policy: &Policy, cost: u32) -> bool {
    let outcome = match store.check_now(key, policy, cost) {
        Some(outcome) => outcome,
        None => store.check(key, policy, cost).await,
    };
    matches!(outcome, Ok(d) if d.is_allowed())
}

/// A leasing store with these settings and time budget.
async fn leasing_with(url: String, leases: Leases, timeout: Duration) -> RedisStore {
    RedisStore::builder(url)
        .leases(leases)
        .timeout(timeout)
        .connect()
        .await
        .unwrap()
}

/// A store with leases of a 100 ms period (20 requests a period is 200 a second).
async fn tenth_of_a_second(url: String) -> RedisStore {
    let leases = Leases::new().period(Duration::from_millis(100));
    leasing_with(url, leases, Duration::from_secs(1)).await
}

/// The count of the fixed window now in Redis for `key` (0 when none).
async fn fixed_count(client: &Client, store: &RedisStore, key: &Key, policy: &Policy) -> u64 {
    let raw: Option<Vec<u8>> = client.get(redis_key(store, key, policy)).await.unwrap();
    raw.map_or(0, |raw| u64::from_le_bytes(raw[8..16].try_into().unwrap()))
}

/// Blocks the Redis behind `client` for `seconds` (`DEBUG SLEEP`, which needs a server started
/// with `--enable-debug-command local`); returns when it answers again.
async fn stall(client: &Client, seconds: f64) {
    let debug = fred::types::CustomCommand::new_static("DEBUG", None, false);
    let _: fred::types::Value = client
        .custom(debug, vec!["SLEEP".to_owned(), seconds.to_string()])
        .await
        .expect("DEBUG SLEEP (is the debug command enabled?)");
}

/// Sends `n` requests with an `x-api-key` header of `key` through `service`; returns how many
/// were answered 200.
async fn through_layer<S, B>(service: &S, key: &'static str, n: usize) -> usize
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    let mut admitted = 0;
    for _ in 0..n {
        admitted += usize::from(passes(service, key).await);
    }
    admitted
}

fn gcra(limit: &str) -> Policy {
    named("gcra", limit, Algorithm::Gcra)
}

fn log(limit: &str) -> Policy {
    named("log", limit, Algorithm::SlidingLog)
}

/// Asks as the layer does: from the lease if it can, else through Redis. Returns the decision,
/// whether the lease answered, and the window (its start, µs since the epoch) it was counted in: for a lease, the local
/// time it was spent; for Redis, the window whose end the decision reports (`reset_after` of
/// a fixed window is the time to its end, on Redis's clock).
async fn decide(
    store: &RedisStore,
    key: &Key,
    policy: &Policy,
    window: u64,
) -> (Result<bool, StoreError>, bool, u64) {
    let before = micros_now();
    if let Some(outcome) = store.check_now(key, policy, 1) {
        return (
            outcome.map(|d| d.is_allowed()),
            true,
            before - before % window,
        );
    }
    match store.check(key, policy, 1).await {
        Ok(d) => {
            let end = before + d.reset_after().as_micros() as u64;
            let end = (end + window / 2) / window * window;
            (Ok(d.is_allowed()), false, end - window)
        }
        Err(e) => (Err(e), false, 0),
    }
}

/// A request of 1 decided as the layer decides it; when admitted, when its unit was spent:
/// the local time for a unit of a lease (logged earlier, at the lease's grant), the Redis
/// time Redis logged it at for one that Redis decided (one host, one clock).
async fn spent_at(store: &RedisStore, key: &Key, policy: &Policy) -> Option<u64> {
    let before = micros_now();
    let decision = match store.check_now(key, policy, 1) {
        Some(outcome) => outcome,
        None => store.check(key, policy, 1).await,
    };
    let decision = decision.ok().filter(|d| d.is_allowed())?;
    let logged = u64::try_from(recorded_micros(&decision)?).ok()?;
    // Logged before this call began: a lease's unit, spent now.
    Some(if logged < before { before } else { logged })
}

/// Sends `n` requests through `store`, one every `every`; returns those admitted.
async fn paced(store: &RedisStore, key: &Key, policy: &Policy, n: usize, every: Duration) -> u64 {
    let mut admitted = 0;
    let mut tick = tokio::time::interval(every);
    for _ in 0..n {
        tick.tick().await;
        admitted += u64::from(admit(store, key, policy, 1).await);
    }
    admitted
}

/// The units the sliding log of `key` holds in Redis in events of time `at` (all events for
/// `None`): the sum of their weights (members "<time>:<total>:<weight>").
async fn logged(
    client: &Client,
    store: &RedisStore,
    key: &Key,
    policy: &Policy,
    at: Option<i64>,
) -> u64 {
    let members: Vec<String> = client
        .zrange(
            redis_key(store, key, policy),
            0,
            -1,
            None,
            false,
            None,
            false,
        )
        .await
        .unwrap();
    let field = |m: &String, i: usize| m.split(':').nth(i).unwrap().parse::<i64>().unwrap();
    let at_time = |m: &&String| at.is_none_or(|t| field(m, 0) == t);
    members
        .iter()
        .filter(at_time)
        .map(|m| field(m, 2) as u64)
        .sum()
}

/// When the store recorded `decision` (µs since the UNIX epoch, Redis `TIME`), if it did.
fn recorded_micros(decision: &tower_redis_ratelimit::Decision) -> Option<i64> {
    let at = tower_redis_ratelimit::test_util::recorded_at(decision)?;
    i64::try_from(at.duration_since(std::time::UNIX_EPOCH).ok()?.as_micros()).ok()
}
