//! A blocklist of keys (IPs, API keys) refused with 403 before any limit is consulted, kept in
//! Redis as a Bloom filter backed by an exact set (feature `redis`).
//!
//! The filter answers "certainly not blocked" for almost every client without further work;
//! a "maybe" is confirmed with `SISMEMBER` against the exact set, so a false positive costs one
//! Redis call and never refuses an innocent client. Every instance keeps a local copy of the
//! filter's bits, refreshed from Redis at an interval, so the common path needs no Redis call
//! at all. Entries are added and removed at run time:
//! - `add` puts the key in the set and sets its bits, in Redis and in the local copy;
//! - `remove` takes the key out of the set. Its bits stay, as a Bloom filter cannot clear
//!   bits, so the key becomes a "maybe" that the set answers "no" for.
//!
//! Another instance sees an added key after its next refresh (default 1 s). Each refresh reads
//! the whole bit array (about 1.2 bytes per expected item at 1 %: 120 KiB for 100 000), within
//! the store's time budget; a failed refresh keeps the previous copy and logs a warning.
//! While Redis is unreachable, "maybe"s pass (the blocklist fails open), so blocked clients get
//! through during an outage. Confirmations share the store's breaker: once a decision or a
//! confirmation has found Redis unreachable, the next ones pass at once for the store's
//! `retry_interval` instead of each waiting out its timeout.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{routing::get, Router};
//! use tower_redis_ratelimit::blocklist::{Blocklist, BlocklistLayer};
//! use tower_redis_ratelimit::{Key, PeerIp, RateLimitLayer, RedisStore};
//!
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let blocklist = Blocklist::builder(&store).expected_items(100_000).build().await?;
//! blocklist.add(&[Key::from("203.0.113.9")]).await?;
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::builder().policy("100/1m").store(store).build()?)
//!     // Outermost, so it runs first: a blocked client never reaches the limiter.
//!     .layer(BlocklistLayer::new(blocklist, PeerIp));
//! # Ok(()) }
//! ```

mod filter;
mod layer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use fred::interfaces::{ClientLike, HashesInterface, KeysInterface, SetsInterface};
use fred::types::CustomCommand;

use filter::Shape;
pub use layer::{BlocklistFuture, BlocklistLayer, BlocklistService};

use crate::{Key, RedisStore, StoreError};

/// A blocklist in Redis; clones share one local copy of the filter.
#[derive(Clone)]
pub struct Blocklist {
    shared: Arc<Shared>,
}

struct Shared {
    /// Whose Redis (pool, key prefix, breaker) the blocklist uses.
    store: RedisStore,
    shape: Shape,
    bits_key: String,
    set_key: String,
    /// The filter's bits as last read from Redis, plus what this instance added since.
    local: RwLock<Vec<u8>>,
    stats: Counters,
}

#[derive(Default)]
struct Counters {
    screened: AtomicU64,
    maybe: AtomicU64,
    blocked: AtomicU64,
}

/// What the blocklist has answered so far, on this instance (read with
/// `test_util::blocklist_stats`, feature `test-util`).
#[cfg(feature = "test-util")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlocklistStats {
    /// Keys screened.
    pub screened: u64,
    /// Of those, keys the filter could not clear ("maybe"), each confirmed against the set.
    pub maybe: u64,
    /// Of those, keys the set confirmed: refused.
    pub blocked: u64,
}

/// The filter's answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Screen {
    /// Certainly not blocked.
    Clear,
    /// Maybe blocked: ask the exact set.
    Maybe,
}

impl std::fmt::Debug for Blocklist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocklist")
            .field("set", &self.shared.set_key)
            .field("bits", &self.shared.shape.bits)
            .field("hashes", &self.shared.shape.hashes)
            .finish_non_exhaustive()
    }
}

impl Blocklist {
    /// Configures a blocklist in the Redis of `store`, under its key prefix.
    pub fn builder(store: &RedisStore) -> BlocklistBuilder {
        BlocklistBuilder {
            store: store.clone(),
            name: "default".into(),
            expected_items: 100_000,
            false_positive_rate: 0.01,
            refresh: Duration::from_secs(1),
        }
    }

    /// Blocks `keys`: adds them to the exact set and sets their bits, in Redis and locally; per
    /// 500 keys, one `SADD` and one `BITFIELD` that sets all their bits.
    pub async fn add(&self, keys: &[Key]) -> Result<(), StoreError> {
        let shared = &self.shared;
        for chunk in keys.chunks(500) {
            let positions: Vec<u64> = chunk
                .iter()
                .flat_map(|key| shared.shape.positions(key))
                .collect();
            let mut bitfield = Vec::with_capacity(1 + 4 * positions.len());
            bitfield.push(shared.bits_key.clone());
            for o in &positions {
                bitfield.extend([
                    "SET".to_owned(),
                    "u1".to_owned(),
                    o.to_string(),
                    "1".to_owned(),
                ]);
            }
            let members: Vec<&str> = chunk.iter().map(Key::as_str).collect();
            let pipeline = shared.store.pool().next().pipeline();
            let _: () = pipeline.sadd(shared.set_key.as_str(), members).await?;
            // fred has no BITFIELD method; the command is sent as it is.
            let command = CustomCommand::new_static("BITFIELD", None, false);
            let _: () = pipeline.custom(command, bitfield).await?;
            let _: () = pipeline.all().await?;
            let mut local = shared.local.write().unwrap_or_else(|p| p.into_inner());
            for o in positions {
                filter::set(&mut local, o);
            }
        }
        Ok(())
    }

    /// Unblocks `key`: takes it out of the exact set. Its filter bits stay set, so it is
    /// confirmed against the set from now on.
    pub async fn remove(&self, key: &Key) -> Result<(), StoreError> {
        let _: () = self
            .shared
            .store
            .pool()
            .next()
            .srem(self.shared.set_key.as_str(), key.as_str())
            .await?;
        Ok(())
    }

    /// Whether `key` is blocked: the local filter first, the exact set for a "maybe".
    pub async fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        match self.screen(key) {
            Screen::Clear => Ok(false),
            Screen::Maybe => self.confirm(key.as_str().to_owned()).await,
        }
    }

    /// What this instance's blocklist has answered so far.
    #[cfg(feature = "test-util")]
    pub(crate) fn stats(&self) -> BlocklistStats {
        let stats = &self.shared.stats;
        BlocklistStats {
            screened: stats.screened.load(Ordering::Relaxed),
            maybe: stats.maybe.load(Ordering::Relaxed),
            blocked: stats.blocked.load(Ordering::Relaxed),
        }
    }

    /// The local filter's answer; no Redis call.
    pub(crate) fn screen(&self, key: &Key) -> Screen {
        let shared = &self.shared;
        shared.stats.screened.fetch_add(1, Ordering::Relaxed);
        let local = shared.local.read().unwrap_or_else(|p| p.into_inner());
        if shared.shape.maybe_contains(&local, key) {
            shared.stats.maybe.fetch_add(1, Ordering::Relaxed);
            Screen::Maybe
        } else {
            Screen::Clear
        }
    }

    /// Asks the exact set about a "maybe", behind the store's breaker: while Redis is found
    /// unreachable, the answer is an error at once instead of after the time budget.
    pub(crate) fn confirm(
        &self,
        key: String,
    ) -> impl std::future::Future<Output = Result<bool, StoreError>> + Send + 'static {
        let shared = Arc::clone(&self.shared);
        async move {
            let ask = shared
                .store
                .pool()
                .next()
                .sismember::<bool, _, _>(shared.set_key.as_str(), key);
            let member = shared.store.guarded(&shared.set_key, ask).await?;
            if member {
                shared.stats.blocked.fetch_add(1, Ordering::Relaxed);
            }
            Ok(member)
        }
    }
}

impl Shared {
    /// Merges the bits in Redis into the local copy. Bits only ever go from 0 to 1, so the
    /// merge is an OR: a read that raced with a local `add` cannot undo it.
    async fn refresh(&self) -> Result<(), StoreError> {
        let bits: Option<Vec<u8>> = self.store.pool().next().get(self.bits_key.as_str()).await?;
        let bits = bits.unwrap_or_default();
        let mut local = self.local.write().unwrap_or_else(|p| p.into_inner());
        if local.len() < bits.len() {
            local.resize(bits.len(), 0);
        }
        for (mine, theirs) in local.iter_mut().zip(bits) {
            *mine |= theirs;
        }
        Ok(())
    }
}

/// Configures a [`Blocklist`].
#[derive(Debug, Clone)]
pub struct BlocklistBuilder {
    store: RedisStore,
    name: String,
    expected_items: u64,
    false_positive_rate: f64,
    refresh: Duration,
}

impl BlocklistBuilder {
    /// The blocklist's name (default `default`), to keep several apart.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// How many keys the filter is sized for (default 100 000). Beyond that its false-positive
    /// rate rises, and with it the share of requests confirmed against Redis.
    pub fn expected_items(mut self, items: u64) -> Self {
        self.expected_items = items;
        self
    }

    /// The share of clients that are not blocked but that the filter cannot clear at the
    /// expected size (default 0.01); each costs one `SISMEMBER`.
    pub fn false_positive_rate(mut self, rate: f64) -> Self {
        self.false_positive_rate = rate;
        self
    }

    /// How often the local copy of the filter is read from Redis (default 1 s).
    pub fn refresh(mut self, interval: Duration) -> Self {
        self.refresh = interval;
        self
    }

    /// Checks the settings, records the filter's shape in Redis (or checks it against the
    /// shape other instances recorded), reads the filter and starts refreshing it on the
    /// current tokio runtime.
    pub async fn build(self) -> Result<Blocklist, StoreError> {
        let name_ok = !self.name.is_empty() && !self.name.contains(['{', '}']);
        if !name_ok {
            return Err(StoreError::Config(format!(
                "blocklist name {:?} must be non-empty and free of braces",
                self.name
            )));
        }
        if self.expected_items == 0 {
            return Err(StoreError::Config(
                "expected_items must be at least 1".into(),
            ));
        }
        if !(self.false_positive_rate > 0.0 && self.false_positive_rate < 1.0) {
            return Err(StoreError::Config(format!(
                "false_positive_rate {} must be between 0 and 1",
                self.false_positive_rate
            )));
        }
        if self.refresh.is_zero() {
            return Err(StoreError::Config(
                "refresh interval must be above zero".into(),
            ));
        }
        let shape = Shape::for_items(self.expected_items, self.false_positive_rate);
        if shape.bits > 1 << 32 {
            return Err(StoreError::Config(format!(
                "a filter of {} bits is over Redis's 2^32-bit strings; expect fewer items or a \
                 higher rate",
                shape.bits
            )));
        }
        // One hash slot for the three keys: `{bl:<name>}`.
        let base = format!("{}:{{bl:{}}}", self.store.prefix(), self.name);
        let shape_key = format!("{base}:shape");
        // The first instance records the shape; every later one must match it. HSETNX keeps
        // two instances starting at once from both writing theirs.
        let client = self.store.pool().next();
        let _: () = client
            .hsetnx(shape_key.as_str(), "bits", shape.bits)
            .await?;
        let _: () = client
            .hsetnx(shape_key.as_str(), "hashes", shape.hashes)
            .await?;
        let (bits, hashes): (Option<u64>, Option<u32>) = client
            .hmget(shape_key.as_str(), vec!["bits", "hashes"])
            .await?;
        if (bits, hashes) != (Some(shape.bits), Some(shape.hashes)) {
            return Err(StoreError::Config(format!(
                "blocklist {:?} exists with {bits:?} bits and {hashes:?} hashes; this one would \
                 have {} and {}",
                self.name, shape.bits, shape.hashes
            )));
        }
        let shared = Arc::new(Shared {
            store: self.store,
            shape,
            bits_key: format!("{base}:bits"),
            set_key: format!("{base}:set"),
            local: RwLock::new(Vec::new()),
            stats: Counters::default(),
        });
        shared.refresh().await?;
        tokio::spawn(refresh_every(Arc::downgrade(&shared), self.refresh));
        Ok(Blocklist { shared })
    }
}

/// Reads the filter at every interval until the blocklist is dropped. A failed read keeps the
/// previous copy.
async fn refresh_every(shared: std::sync::Weak<Shared>, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Err(error) = shared.refresh().await {
            let error = crate::chain::Chain(&error);
            tracing::warn!(target: "tower_redis_ratelimit", %error, "blocklist refresh failed");
        }
    }
}
