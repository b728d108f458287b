//! Unique clients per policy, counted in Redis HyperLogLogs by minute, hour and day.
//!
//! The classic unique-visitor recipe: every request's key goes into a HyperLogLog for its
//! minute, its hour and its day (`PFADD`), and a question about a span merges the fewest
//! buckets that cover it (`PFCOUNT` of several keys). "The last 24 hours" reads the last 60
//! minute buckets and the 23 whole hours before the current one: 83 keys rather than 1 440,
//! covering from 23 to 24 hours depending on how far the current hour has gone.
//! Each HyperLogLog takes at most 12 KiB, whatever the number of clients, and answers within
//! about 0.81 % (its standard error).
//!
//! Recording never delays a response: the layer hands each key to a queue, and a task drains it
//! into one pipelined round of `PFADD` and `PEXPIRE` per batch. Failed writes are logged and
//! dropped, and while Redis is unreachable at most 65 536 keys wait; later ones go uncounted.
//! Buckets are named after this process's clock when the batch is written, so an instance
//! whose clock is off by seconds, or a backlog, files a few requests under the neighbouring
//! minute; spans of minutes or more do not notice.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fred::clients::Pool;
use fred::interfaces::{HyperloglogInterface, KeysInterface};
use tokio::sync::{mpsc, oneshot};

use crate::{Key, RedisStore, StoreError};

/// The longest span each kind of bucket answers for, and how long it is kept.
const MINUTES_KEPT: u64 = 120;
const HOURS_KEPT: u64 = 48;
const DAYS_KEPT: u64 = 32;
/// The most queued keys written in one round.
const BATCH: usize = 4096;
/// The most keys waiting to be written; past that (Redis down or too slow) new ones are
/// dropped rather than held.
const QUEUE: usize = 65_536;

/// Which requests a count covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clients {
    /// Every decided request.
    All,
    /// Refused requests only (shadow-mode refusals included).
    Denied,
}

/// A span of time ending now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Span {
    /// The last `n` minutes, 1 to 120.
    Minutes(u32),
    /// The last `n` hours, 1 to 24, as the hour buckets allow: the last 60 minutes, and for
    /// `n` ≥ 2 the `n - 1` whole hours before the current one, so from `n - 1` to `n` hours
    /// (the current hour counts only so far). `Hours(24)` merges 60 minute buckets and 23
    /// hour buckets.
    Hours(u32),
    /// The last `n` days, 1 to 31: `Hours(24)`, and for `n` ≥ 2 the `n - 1` whole days (UTC)
    /// before the current one, so from `n - 1` to `n` days.
    Days(u32),
}

/// Records each decided request's key per policy, and answers how many unique clients a
/// policy saw over a span. Clones share one queue.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redis_ratelimit::unique::{Clients, Span, UniqueClients};
/// use tower_redis_ratelimit::{RateLimitLayer, RedisStore};
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let unique = UniqueClients::new(&store);
/// let layer = RateLimitLayer::builder()
///     .policy("100/1m")
///     .store(store)
///     .unique_clients(unique.clone())
///     .build()?;
/// // Later, e.g. from an admin endpoint:
/// let last_day = unique.count("default", Span::Days(1), Clients::All).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct UniqueClients {
    shared: Arc<Shared>,
}

struct Shared {
    pool: Pool,
    prefix: String,
    queue: mpsc::Sender<Message>,
    dropped: std::sync::atomic::AtomicU64,
}

enum Message {
    Seen {
        policy: Arc<str>,
        key: String,
        denied: bool,
    },
    /// Answered with whether every write since the previous flush succeeded.
    Flush(oneshot::Sender<bool>),
}

impl std::fmt::Debug for UniqueClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniqueClients")
            .field("prefix", &self.shared.prefix)
            .finish_non_exhaustive()
    }
}

impl UniqueClients {
    /// Counts in the Redis of `store`, under its key prefix. Starts the writing task on the
    /// current tokio runtime; the task ends when the last clone is dropped.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime, as `tokio::spawn` does.
    pub fn new(store: &RedisStore) -> Self {
        let (queue, messages) = mpsc::channel(QUEUE);
        let shared = Arc::new(Shared {
            pool: store.pool().clone(),
            prefix: store.prefix().to_owned(),
            queue,
            dropped: Default::default(),
        });
        // The task holds no sender: it ends once every clone of this recorder is dropped.
        tokio::spawn(write(messages, shared.pool.clone(), shared.prefix.clone()));
        UniqueClients { shared }
    }

    /// Queues a decided request; returns at once.
    pub(crate) fn record(&self, policy: Arc<str>, key: &Key, denied: bool) {
        let seen = Message::Seen {
            policy,
            key: key.as_str().to_owned(),
            denied,
        };
        // Fails when the queue is full or the writing task is gone: the count then misses
        // this request rather than delay it or hold memory without bound.
        if self.shared.queue.try_send(seen).is_err() {
            let dropped = &self.shared.dropped;
            dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// How many requests went uncounted because the queue was full (Redis unreachable or too
    /// slow).
    #[cfg(feature = "test-util")]
    pub(crate) fn dropped(&self) -> u64 {
        self.shared
            .dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until every request queued before this call has been sent to Redis; `true` if
    /// every write since the previous flush succeeded.
    pub(crate) async fn flush(&self) -> bool {
        let (done, written) = oneshot::channel();
        if self.shared.queue.send(Message::Flush(done)).await.is_err() {
            return false;
        }
        written.await.unwrap_or(false)
    }

    /// The number of unique keys `policy` decided for over `span` (an estimate within about
    /// 1 %), on every instance that shares the Redis: this instance's requests queued before
    /// the call are written first, so that it counts them.
    pub async fn count(
        &self,
        policy: &str,
        span: Span,
        clients: Clients,
    ) -> Result<u64, StoreError> {
        // A failed write leaves its requests out of the count, as for any instance's.
        let _written = self.flush().await;
        let keys = span_keys(&self.shared.prefix, policy, clients, span, now_secs())?;
        let count: u64 = self.shared.pool.next().pfcount(keys).await?;
        Ok(count)
    }
}

/// The bucket keys that cover `span` ending at `now` (seconds since the epoch).
fn span_keys(
    prefix: &str,
    policy: &str,
    clients: Clients,
    span: Span,
    now: u64,
) -> Result<Vec<String>, StoreError> {
    let key = |unit: Unit, index: u64| bucket(prefix, policy, clients, unit, index);
    // The last `n` buckets up to the current one, and the `n` whole ones before it.
    let last = |unit: Unit, n: u64| {
        let current = now / unit.seconds();
        (current + 1 - n.min(current + 1)..=current).map(move |i| key(unit, i))
    };
    let before = |unit: Unit, n: u64| {
        let current = now / unit.seconds();
        (current - n.min(current)..current).map(move |i| key(unit, i))
    };
    let keys = match span {
        Span::Minutes(n @ 1..) if u64::from(n) <= MINUTES_KEPT => {
            last(Unit::Minute, n.into()).collect()
        }
        Span::Hours(n @ 1..=24) => last(Unit::Minute, 60)
            .chain(before(Unit::Hour, u64::from(n) - 1))
            .collect(),
        Span::Days(n @ 1..) if u64::from(n) < DAYS_KEPT => last(Unit::Minute, 60)
            .chain(before(Unit::Hour, 23))
            .chain(before(Unit::Day, u64::from(n) - 1))
            .collect(),
        _ => {
            return Err(StoreError::Config(format!(
                "span {span:?} is outside what the buckets keep"
            )))
        }
    };
    Ok(keys)
}

#[derive(Debug, Clone, Copy)]
enum Unit {
    Minute,
    Hour,
    Day,
}

impl Unit {
    const ALL: [Unit; 3] = [Unit::Minute, Unit::Hour, Unit::Day];

    fn seconds(self) -> u64 {
        match self {
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => 86_400,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Unit::Minute => "m",
            Unit::Hour => "h",
            Unit::Day => "d",
        }
    }

    /// How long a bucket is kept: the longest span it serves, and one more bucket.
    fn kept(self) -> Duration {
        let buckets = match self {
            Unit::Minute => MINUTES_KEPT,
            Unit::Hour => HOURS_KEPT,
            Unit::Day => DAYS_KEPT,
        };
        Duration::from_secs((buckets + 1) * self.seconds())
    }
}

/// `<prefix>:{uv:<policy>}:<all|denied>:<m|h|d>:<bucket>`: one hash slot per policy, so that
/// `PFCOUNT` can merge any of its buckets in Redis Cluster too.
fn bucket(prefix: &str, policy: &str, clients: Clients, unit: Unit, index: u64) -> String {
    let which = match clients {
        Clients::All => "all",
        Clients::Denied => "denied",
    };
    format!("{prefix}:{{uv:{policy}}}:{which}:{}:{index}", unit.tag())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// Drains the queue: each round groups the keys by policy and kind, and writes every bucket
/// of the current minute, hour and day in one pipeline.
async fn write(mut messages: mpsc::Receiver<Message>, pool: Pool, prefix: String) {
    let mut failed = false;
    while let Some(first) = messages.recv().await {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match messages.try_recv() {
                Ok(message) => batch.push(message),
                Err(_) => break,
            }
        }
        let mut groups: Vec<(Arc<str>, Clients, Vec<String>)> = Vec::new();
        let mut flushed = Vec::new();
        for message in batch {
            match message {
                Message::Seen {
                    policy,
                    key,
                    denied,
                } => {
                    let mut add = |kind: Clients, element: String| match groups
                        .iter_mut()
                        .find(|(p, c, _)| *p == policy && *c == kind)
                    {
                        Some((_, _, keys)) => keys.push(element),
                        None => groups.push((Arc::clone(&policy), kind, vec![element])),
                    };
                    if denied {
                        add(Clients::Denied, key.clone());
                    }
                    add(Clients::All, key);
                }
                Message::Flush(done) => flushed.push(done),
            }
        }
        if let Err(error) = write_groups(&pool, &prefix, groups).await {
            failed = true;
            tracing::warn!(target: "tower_redis_ratelimit", %error, "unique-client counts not written");
        }
        for done in flushed {
            let _ = done.send(!failed);
            failed = false;
        }
    }
}

async fn write_groups(
    pool: &Pool,
    prefix: &str,
    groups: Vec<(Arc<str>, Clients, Vec<String>)>,
) -> Result<(), fred::error::Error> {
    if groups.is_empty() {
        return Ok(());
    }
    let now = now_secs();
    let pipeline = pool.next().pipeline();
    for (policy, clients, keys) in groups {
        // Converted once: the three buckets share the elements' bytes.
        let elements: Vec<fred::types::Value> = keys.into_iter().map(Into::into).collect();
        for unit in Unit::ALL {
            let bucket = bucket(prefix, &policy, clients, unit, now / unit.seconds());
            let _: () = pipeline.pfadd(bucket.as_str(), elements.clone()).await?;
            let ttl = unit.kept().as_millis() as i64;
            let _: () = pipeline.pexpire(bucket.as_str(), ttl, None).await?;
        }
    }
    let _: () = pipeline.all().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_795_306_687; // 2026-11-22T00:58:07Z

    #[test]
    fn spans_merge_the_fewest_buckets() {
        let keys = |span| span_keys("rl", "api", Clients::All, span, NOW).unwrap();
        let count = |keys: &[String], unit: &str| {
            keys.iter()
                .filter(|k| k.split(':').nth(4) == Some(unit))
                .count()
        };
        let hour = keys(Span::Hours(1));
        assert_eq!((count(&hour, "m"), hour.len()), (60, 60));
        let day = keys(Span::Hours(24));
        assert_eq!(
            (count(&day, "m"), count(&day, "h"), day.len()),
            (60, 23, 83)
        );
        let week = keys(Span::Days(7));
        assert_eq!(
            (count(&week, "h"), count(&week, "d"), week.len()),
            (23, 6, 89)
        );
        assert_eq!(keys(Span::Minutes(5)).len(), 5);
        // The newest minute is the current one; the hours stop before the current hour.
        assert_eq!(day[59], format!("rl:{{uv:api}}:all:m:{}", NOW / 60));
        assert_eq!(day[82], format!("rl:{{uv:api}}:all:h:{}", NOW / 3600 - 1));
        assert!(span_keys("rl", "api", Clients::All, Span::Hours(25), NOW).is_err());
        assert!(span_keys("rl", "api", Clients::All, Span::Minutes(0), NOW).is_err());
    }
}
