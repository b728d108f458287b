//! The Redis store, over the `fred` client.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fred::clients::Pool;
use fred::prelude::{ClientLike, Config, KeysInterface, ReconnectPolicy};
use fred::types::config::ReconnectError;
use fred::types::scripts::Script;
use fred::types::Builder;

mod ask;
mod batch;
#[cfg(test)]
mod differential;
mod health;
mod layout;
mod lease;
mod nodes;
mod overrides;
mod placement;

pub use lease::Leases;

use batch::{Answer, Batcher, Record, SlotOp};
use health::{is_outage, Breaker};
use nodes::Nodes;
use placement::{Place, Placement};

use super::{OnSettled, Store, StoreError};
use crate::algorithm::{Algorithm, Outcome};
use crate::{Decision, Key, Policy, Settlement};

/// Scheduler passes a cluster lane waits for more requests before it sends a batch (see
/// `batch::gather`): with three primaries on two cores, four took `EVALSHA` per request from
/// 0.25 to 0.15 (one pass: 0.18), near a single Redis's 0.14; `docs/performance.md`.
const CLUSTER_GATHER_PASSES: usize = 4;

/// A script: exact arithmetic past 2^53, the shared prelude (arguments, reply, `TIME`), then,
/// for the algorithms that use it, the driver that combines limits, then the algorithm's own
/// file.
macro_rules! script {
    ($file:literal) => {
        concat!(
            include_str!("scripts/exact.lua"),
            include_str!("scripts/prelude.lua"),
            include_str!($file)
        )
    };
    (driver, $file:literal) => {
        concat!(
            include_str!("scripts/exact.lua"),
            include_str!("scripts/prelude.lua"),
            include_str!("scripts/common.lua"),
            include_str!($file)
        )
    };
}

/// Each algorithm's script, as the store holds them.
type Scripts = Vec<(Algorithm, Script)>;

const SCRIPTS: [(Algorithm, &str); 4] = [
    // GCRA and the sliding log do without the driver, for speed (their headers say why).
    (Algorithm::SlidingLog, script!("scripts/sliding_log.lua")),
    (
        Algorithm::SlidingWindow,
        script!(driver, "scripts/sliding_window.lua"),
    ),
    (
        Algorithm::FixedWindow,
        script!(driver, "scripts/fixed_window.lua"),
    ),
    (Algorithm::Gcra, script!("scripts/gcra.lua")),
];

/// Rate-limit state in Redis, shared by every instance of a service.
///
/// Decisions run the algorithm's Lua script (`EVALSHA`; under load one call decides a batch,
/// see [`RedisStoreBuilder::max_batch`]): the script reads the time
/// from Redis `TIME` (so that app servers whose clocks disagree still share one timeline),
/// trims, counts and records in one atomic step. If Redis has lost the script (`SCRIPT FLUSH`,
/// a restart, a failover) it is loaded again and the call retried once.
///
/// Keys are `<prefix>:{<policy>:<key>}:<algorithm>:<limits>` (algorithm `log`, `sw`, `fw`,
/// `gcra`; limits as in [`Policy::identity`]) on a single Redis. On a Redis Cluster (a
/// `redis-cluster://` URL) they are `<prefix>:{<tag>}:<policy>:<key>:<algorithm>:<limits>`,
/// where the hash tag is one of a fixed set
/// ([`RedisStoreBuilder::cluster_tags`]) spread evenly over the slots: requests for many
/// clients then share a slot, and so a script call. Either way, all the state of one decision
/// is in one slot. Each key expires once its state no longer matters: the longest window
/// after the last admitted request (twice that for the sliding window counter).
///
/// Clones share one connection pool.
///
/// ```no_run
/// # async fn run() -> Result<(), tower_redis_ratelimit::StoreError> {
/// use tower_redis_ratelimit::RedisStore;
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: fred::clients::Pool,
    prefix: String,
    placement: Placement,
    batcher: Batcher,
    timeout: Duration,
    /// A breaker per batching lane: one on a single Redis; in a Redis Cluster one per hash
    /// tag, so that a primary that is gone cuts off only the tags it serves (each primary
    /// has connections of its own, see `nodes.rs`).
    breakers: Vec<Breaker>,
    /// Set when the store leases ([`RedisStoreBuilder::leases`]).
    leases: Option<lease::State>,
    /// The limits version last seen in Redis (`overrides.rs`).
    limits_version: AtomicU64,
    /// The id of the next concurrency slot taken: from a random start per store, so that
    /// instances sharing Redis take different ids, below 2^52 (exact in Lua's doubles).
    next_slot: AtomicU64,
}

impl Inner {
    /// Records the limits version `version` read from Redis; when it is another, the leases
    /// held now are spent no more (`lease::limits_changed`).
    fn limits_seen(&self, version: u64) {
        if self.limits_version.swap(version, Ordering::AcqRel) != version {
            lease::limits_changed(self);
        }
    }

    /// Where the state of `key` under `policy` lives.
    fn place(&self, key: &Key, policy: &Policy) -> Place {
        self.placement.place(&self.prefix, key, policy)
    }

    /// Runs the policy's script for one request at `place`, behind the breaker and within
    /// the time budget; `at` is an event time in µs since the epoch (`-1`: now).
    async fn decide(
        &self,
        place: Place,
        policy: &Policy,
        cost: u64,
        at: i64,
        record: Record,
    ) -> Result<Answer, StoreError> {
        super::in_range(policy)?;
        let args = batch::encode_for(policy, cost, record, at);
        // The budget covers the whole decision: the queue, the call and a script reload.
        let lane = place.lane;
        let decision = self.batcher.decide(place, policy.algorithm(), args);
        self.guarded(lane, decision).await
    }

    /// A new concurrency slot id.
    fn next_slot(&self) -> u64 {
        self.next_slot.fetch_add(1, Ordering::Relaxed) & ((1 << 52) - 1)
    }

    /// The breaker of batching lane `lane`.
    fn breaker(&self, lane: usize) -> &Breaker {
        &self.breakers[lane % self.breakers.len()]
    }

    /// The lane whose breaker guards calls on `redis_key`, which may be a key of the store's
    /// own placement or another (a blocklist's, a give-back's): in a cluster, the tag whose
    /// range of slots holds its slot (the tags divide the slots in equal ranges).
    fn lane_of(&self, redis_key: &str) -> usize {
        let lanes = self.breakers.len();
        match self.batcher.is_clustered() {
            true => usize::from(fred::util::redis_keyslot(redis_key.as_bytes())) * lanes / 16_384,
            false => 0,
        }
    }

    /// Runs `call` within the time budget, behind lane `lane`'s breaker: fails at once while
    /// it is open; a failure that shows Redis unreachable or too slow trips it, a success
    /// closes it.
    async fn guarded<T>(
        &self,
        lane: usize,
        call: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, StoreError> {
        if self.breaker(lane).is_open() {
            return Err(StoreError::Unavailable);
        }
        let started = self.breaker(lane).now();
        let reply = tokio::time::timeout(self.timeout, call).await.ok();
        self.judge(lane, started, reply)
    }

    /// Waits within the time budget for a reply that a task of its own reads from Redis, so
    /// that a reply later than the budget is still read there; judged as [`guarded`] judges
    /// its call. The caller checks the breaker before it starts the task.
    ///
    /// [`guarded`]: Self::guarded
    async fn within_budget<T>(
        &self,
        lane: usize,
        mut reply: tokio::sync::oneshot::Receiver<Result<T, fred::error::Error>>,
    ) -> Result<T, StoreError> {
        let started = self.breaker(lane).now();
        let ended = || {
            let message = "the call's task ended without a reply";
            Err(fred::error::Error::new(
                fred::error::ErrorKind::Canceled,
                message,
            ))
        };
        let reply = match tokio::time::timeout(self.timeout, &mut reply).await {
            Ok(reply) => Some(reply.unwrap_or_else(|_| ended())),
            // A reply sent as the budget ran out is taken, not left unread: once the channel
            // is closed, the task sees that nobody took it and books it itself.
            Err(_) => {
                reply.close();
                reply.try_recv().ok()
            }
        };
        self.judge(lane, started, reply)
    }

    /// The outcome of slot operation `op` sent on `lane` at `started` (the breaker's clock):
    /// a renewal of a slot no longer held is [`StoreError::SlotGone`].
    fn slot_kept(
        &self,
        lane: usize,
        started: u64,
        op: SlotOp,
        reply: batch::Reply,
    ) -> Result<(), StoreError> {
        let answer = self.judge(lane, started, Some(reply))?;
        match (op.lifetime, answer.ints[0]) {
            (1.., 0) => Err(StoreError::SlotGone),
            _ => Ok(()),
        }
    }

    /// Lane `lane`'s breaker's verdict on a call started at `started`: its reply, or `None`
    /// when it took longer than the budget.
    fn judge<T>(
        &self,
        lane: usize,
        started: u64,
        reply: Option<Result<T, fred::error::Error>>,
    ) -> Result<T, StoreError> {
        let breaker = self.breaker(lane);
        match reply {
            Some(Ok(value)) => {
                breaker.close();
                Ok(value)
            }
            Some(Err(error)) => {
                if is_outage(&error) {
                    breaker.trip(started);
                }
                Err(error.into())
            }
            None => {
                breaker.trip(started);
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("pool_size", &self.inner.pool.size())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Key prefix used unless another is set.
    pub const DEFAULT_PREFIX: &'static str = "ratelimit";

    /// The most requests one script call decides unless told otherwise.
    pub const DEFAULT_MAX_BATCH: usize = 32;

    /// The hash tags keys are spread over in a Redis Cluster unless told otherwise.
    pub const DEFAULT_CLUSTER_TAGS: usize = 3;

    /// The most script calls under way at once unless told otherwise, on a single Redis.
    pub const DEFAULT_MAX_IN_FLIGHT: usize = 2;

    /// The most script calls under way at once per hash tag unless told otherwise, on a Redis
    /// Cluster.
    pub const DEFAULT_CLUSTER_IN_FLIGHT: usize = 1;

    /// How long a decision may take unless told otherwise.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

    /// Connects to the Redis at `url` with the default settings of [`RedisStoreBuilder`]:
    /// `redis://[user:password@]host:port[/db]` (`rediss://` for TLS) for one server,
    /// `redis-cluster://host:port?node=host2:port2&...` for a Redis Cluster, or
    /// `redis-sentinel://sentinel1:26379?sentinelServiceName=<name>&node=sentinel2:26379&...`
    /// for the primary that Redis Sentinel names, followed through failovers. The repository's
    /// `docs/operations.md` covers clusters and Sentinel.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        RedisStore::builder(url).connect().await
    }

    /// Configures a store for the Redis at `url`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            pool_size: 4,
            max_batch: Self::DEFAULT_MAX_BATCH,
            max_in_flight: None,
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            timeout: Self::DEFAULT_TIMEOUT,
            retry_interval: Duration::from_millis(500),
            leases: None,
            cluster_tags: Self::DEFAULT_CLUSTER_TAGS,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// The Redis key holding the state of `key` under `policy`.
    ///
    /// Useful to inspect or clear state by hand.
    pub fn redis_key(&self, key: &Key, policy: &Policy) -> String {
        self.inner.place(key, policy).key
    }

    /// Runs the policy's script; `at` is an event time in µs since the epoch (`-1`: now).
    fn run(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        at: i64,
        record: Record,
    ) -> <Self as Store>::Future {
        let inner = Arc::clone(&self.inner);
        let place = inner.place(key, policy);
        let policy = policy.clone();
        Box::pin(async move {
            let answer = inner
                .decide(place, &policy, cost.into(), at, record)
                .await?;
            let decision = parse_reply(&answer.ints, &policy)?.decision(&policy);
            // The script records at the event time, or at the call's `TIME`.
            let recorded = |d: Decision| {
                d.recorded_at(Some(if at < 0 { answer.time } else { at }), cost.into())
            };
            Ok(match record {
                Record::Yes => recorded(decision),
                Record::Take { id, .. } => recorded(decision).with_slot(id),
                _ => decision,
            })
        })
    }

    /// Gives back every unit this instance holds in leases and takes no more: decisions go to
    /// Redis one by one from now on. Call it on graceful shutdown, after the server stopped
    /// taking requests, so that other instances can use the units at once instead of after
    /// the leases expire. Leases being fetched are waited for (within the time budget) and
    /// given back too; one that lands later is given back as it lands. From the call on,
    /// nothing is spent from leases. The give-back waits for Redis's reply up to 10 s, since
    /// one whose reply is lost cannot be sent again safely. Returns the units given back;
    /// without leases, 0.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_redis_ratelimit::StoreError> {
    /// use tower_redis_ratelimit::{store::Leases, RedisStore};
    ///
    /// let store = RedisStore::builder("redis://127.0.0.1:6379")
    ///     .leases(Leases::new())
    ///     .connect()
    ///     .await?;
    /// // ... serve until a shutdown signal, then:
    /// let units = store.drain().await?;
    /// # let _ = units;
    /// # Ok(()) }
    /// ```
    pub async fn drain(&self) -> Result<u64, StoreError> {
        lease::stop(&self.inner).await;
        lease::give_back(self, true).await
    }

    /// Runs `call` on `redis_key` behind the store's breaker for that key and within its
    /// time budget, as a decision does, for other features that use this Redis (the
    /// blocklist).
    pub(crate) async fn guarded<T>(
        &self,
        redis_key: &str,
        call: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, StoreError> {
        let lane = self.inner.lane_of(redis_key);
        self.inner.guarded(lane, call).await
    }

    /// The prefix of every key this store writes.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The fred connection pool, e.g. to inspect keys in tests. On a Redis Cluster this is
    /// fred's cluster client, which the scripts do not use (they run on the store's own
    /// connections to each primary): it holds every command while any primary is gone.
    pub fn pool(&self) -> &fred::clients::Pool {
        &self.inner.pool
    }

    /// Whether Redis answered the last decision. `false` after a decision found Redis
    /// unreachable or slower than the timeout, until a later one reaches it again; in between,
    /// decisions fail at once (see [`RedisStoreBuilder::retry_interval`]) and the layer
    /// follows its [`FailureMode`](crate::FailureMode). In a Redis Cluster each hash tag
    /// has its own breaker, and the store is healthy while any tag's last decision reached
    /// Redis: a primary that is gone costs only the keys it holds.
    pub fn is_healthy(&self) -> bool {
        !self.inner.breakers.iter().all(Breaker::is_down)
    }
}

/// Configures a [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    pool_size: usize,
    max_batch: usize,
    max_in_flight: Option<usize>,
    prefix: String,
    timeout: Duration,
    retry_interval: Duration,
    leases: Option<Leases>,
    cluster_tags: usize,
    #[cfg(feature = "tls")]
    tls: Option<fred::types::config::TlsConnector>,
}

impl RedisStoreBuilder {
    /// Takes shares of each busy key's budget from Redis ahead of need (leases) and decides
    /// requests from them in this process: Redis sees one call per lease instead of one per
    /// request, and the fleet still never admits more than the limit. Off by default.
    ///
    /// Applies to GCRA and the fixed and sliding window counters; a layer with a sliding-log
    /// policy over a leasing store fails to build. [`RedisStore::drain`] gives the units back
    /// on shutdown. What it costs (under-admission while another instance holds units, GCRA's
    /// smaller burst) is in [`Leases`] and the README.
    pub fn leases(mut self, leases: Leases) -> Self {
        self.leases = Some(leases);
        self
    }

    /// In a Redis Cluster, how many hash tags the clients' keys are spread over (default
    /// [`RedisStore::DEFAULT_CLUSTER_TAGS`], 3; at most 16 384, the number of slots). No
    /// effect on a single Redis.
    ///
    /// One script call decides requests of one hash slot only, so the batching that saves
    /// Redis and this process a command per request needs many requests per tag: a batch holds
    /// at most the requests under way divided by the tags. The tags' slots are spread evenly,
    /// so a cluster whose primaries hold equal ranges of slots (as `redis-cli --cluster create`
    /// assigns them) gets an equal share of the tags when its number of primaries divides this
    /// one. Set it to the number of primaries, or a small multiple of it where each instance
    /// has many requests under way: the default suits the usual three primaries, and leaves a
    /// fourth primary without limiter keys. Every instance must use the same number: changing
    /// it moves every key, which starts every client's limits afresh. The first instance to
    /// connect records its number in the cluster (`<prefix>:{layout}:cluster_tags`), and
    /// [`connect`](Self::connect) refuses another number with [`StoreError::Config`]
    /// ([`connect_lazy`](Self::connect_lazy) logs it as an ERROR once connected); to change
    /// it on purpose, delete that key once every instance uses the new one.
    pub fn cluster_tags(mut self, tags: usize) -> Self {
        self.cluster_tags = tags;
        self
    }

    /// Connections in the pool (default 4). Commands are pipelined on each connection, so a
    /// few connections carry many concurrent requests.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// The most requests decided by one script call (default
    /// [`RedisStore::DEFAULT_MAX_BATCH`]). At most [`max_in_flight`](Self::max_in_flight)
    /// calls are under way at once; requests that arrive meanwhile leave together when a call
    /// returns, which saves Redis and the client a command's fixed cost per request. A lone
    /// request is sent at once. `1` sends every request in its own call, at once, with no
    /// limit on the calls under way.
    pub fn max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    /// The most script calls under way at once (default
    /// [`RedisStore::DEFAULT_MAX_IN_FLIGHT`]), when batching; on a Redis Cluster, per hash
    /// tag (default [`RedisStore::DEFAULT_CLUSTER_IN_FLIGHT`], see
    /// [`cluster_tags`](Self::cluster_tags)), so that a slow or failed primary holds up only
    /// the requests of its own tags. Fewer calls under way make larger batches, which cost
    /// Redis and this process less per request; more let a request leave sooner while Redis
    /// is busy with a call. `docs/performance.md` has the measurements behind the defaults.
    pub fn max_in_flight(mut self, calls: usize) -> Self {
        self.max_in_flight = Some(calls);
        self
    }

    /// The first part of every key (default [`RedisStore::DEFAULT_PREFIX`]), to keep several
    /// applications apart on one Redis.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The time budget of one decision (default [`RedisStore::DEFAULT_TIMEOUT`], 250 ms),
    /// including a script reload. A decision that takes longer fails with
    /// [`StoreError::Timeout`], and the layer follows its [`FailureMode`](crate::FailureMode).
    /// fred itself would wait forever.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// After Redis was found unreachable or too slow, decisions fail at once for this long
    /// (default 500 ms) instead of each waiting out the timeout; then the next decision tries
    /// Redis again. Meanwhile fred reconnects in the background, with exponential backoff.
    pub fn retry_interval(mut self, interval: Duration) -> Self {
        self.retry_interval = interval;
        self
    }

    /// TLS with this connector, e.g. one built from a rustls `ClientConfig` that trusts a
    /// private CA (`TlsConnector::from(config)`). A `rediss://` URL alone uses TLS with the
    /// system's root certificates. Feature `tls`.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls(mut self, connector: fred::types::config::TlsConnector) -> Self {
        self.tls = Some(connector);
        self
    }

    /// Connects the pool and loads the scripts. Fails if Redis cannot be reached now; see
    /// [`connect_lazy`](Self::connect_lazy) for a service that must start without it.
    ///
    /// On a Redis Cluster it also records [`cluster_tags`](Self::cluster_tags) in the
    /// cluster, or checks it against the number the instances already running recorded, and
    /// fails with [`StoreError::Config`] if they differ.
    ///
    /// On a Redis Cluster it succeeds while any node of the URL answers `CLUSTER SLOTS`,
    /// even with a primary gone: the scripts run on connections of the store's own to each
    /// primary, which fail only the calls for their own slots.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let (builder, pool, scripts) = self.pool(true)?;
        if !pool.next().is_clustered() {
            pool.init().await?;
            for (_, script) in &scripts {
                script.load(pool.next()).await?;
            }
            return Ok(self.store(pool, None, scripts));
        }
        let nodes = Nodes::new(builder, self.pool_size, self.patience());
        nodes.refresh().await?;
        // fred's own cluster client (`RedisStore::pool`) connects to every primary at once,
        // and one that is gone would hold it up: it connects in the background.
        drop(pool.connect_pool());
        match layout::check(&nodes, &self.prefix, self.cluster_tags).await {
            Err(error @ StoreError::Config(_)) => return Err(error),
            Err(error) => {
                tracing::warn!(target: "tower_redis_ratelimit", %error, "cluster_tags not checked yet");
                layout::check_later(Arc::downgrade(&nodes), &self.prefix, self.cluster_tags);
            }
            Ok(()) => {}
        }
        Ok(self.store(pool, Some(nodes), scripts))
    }

    /// How long to wait for a node's slot map: the time budget, at least a second.
    fn patience(&self) -> Duration {
        self.timeout.max(Duration::from_secs(1))
    }

    /// Returns the store at once and connects in the background, retrying until Redis
    /// answers; call it within a tokio runtime. Until then, decisions fail within the
    /// [`timeout`](Self::timeout) and the layer follows its
    /// [`FailureMode`](crate::FailureMode), as it does when Redis goes away later. The scripts
    /// load with the first decisions. A wrong URL shows only as failing decisions (and
    /// [`RedisStore::is_healthy`]), where [`connect`](Self::connect) would report it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_redis_ratelimit::StoreError> {
    /// use tower_redis_ratelimit::RedisStore;
    ///
    /// // Nothing needs to listen there yet.
    /// let store = RedisStore::builder("redis://127.0.0.1:1").connect_lazy()?;
    /// # drop(store);
    /// # Ok(()) }
    /// ```
    pub fn connect_lazy(self) -> Result<RedisStore, StoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StoreError::Config(
                "connect_lazy must be called within a tokio runtime".into(),
            ));
        }
        let (builder, pool, scripts) = self.pool(false)?;
        // The connection tasks run on; reconnecting is the pool's policy.
        drop(pool.connect_pool());
        if !pool.next().is_clustered() {
            return Ok(self.store(pool, None, scripts));
        }
        let nodes = Nodes::new(builder, self.pool_size, self.patience());
        let (weak, retry) = (Arc::downgrade(&nodes), self.retry_interval);
        let (prefix, tags) = (self.prefix.clone(), self.cluster_tags);
        tokio::spawn(async move {
            Nodes::refresh_until_known(weak.clone(), retry).await;
            layout::check_later(weak, &prefix, tags);
        });
        Ok(self.store(pool, Some(nodes), scripts))
    }

    /// Validates the settings and builds the pool, not yet connected, with the fred builder
    /// that made it. `fail_fast`: whether the first connection's failure is returned rather
    /// than retried.
    fn pool(&self, fail_fast: bool) -> Result<(Builder, Pool, Scripts), StoreError> {
        if !(1..=16_384).contains(&self.cluster_tags) {
            return Err(StoreError::Config(format!(
                "{} cluster tags: there must be 1 to 16 384, one per hash slot at most",
                self.cluster_tags
            )));
        }
        if self.pool_size == 0 {
            return Err(StoreError::Config("pool size must be at least 1".into()));
        }
        if self.max_batch == 0 {
            return Err(StoreError::Config(
                "batches need room for one request".into(),
            ));
        }
        if self.max_in_flight == Some(0) {
            return Err(StoreError::Config(
                "at least one call must be allowed under way".into(),
            ));
        }
        if let Some(leases) = &self.leases {
            leases.validate()?;
        }
        if self.prefix.is_empty() || self.prefix.contains(['{', '}']) {
            return Err(StoreError::Config(format!(
                "key prefix {:?} must be non-empty and free of braces",
                self.prefix
            )));
        }
        let mut config = Config::from_url(&self.url)?;
        config.fail_fast = fail_fast;
        #[cfg(feature = "tls")]
        if let Some(connector) = self.tls.clone() {
            config.tls = Some(connector.into());
        }
        let mut builder = Builder::from_config(config);
        builder
            .with_performance_config(|p| p.default_command_timeout = self.timeout)
            .with_connection_config(|c| {
                c.connection_timeout = self.timeout.max(Duration::from_secs(1));
                // fred 10.1 follows `ASK` wrongly (it re-sends the command to the old node),
                // and past two redirections of one command it stops the client for good. With
                // none allowed it answers `Too many redirections.` instead: fred's cluster
                // client (`RedisStore::pool`) fails a command on a moving slot rather than
                // stopping. The scripts follow redirections themselves, on the store's own
                // connections to each primary (`nodes.rs`).
                c.max_redirections = 0;
                // A primary that was demoted (`READONLY`), or that refuses writes because its
                // replicas are gone (`NOREPLICAS`, with `min-replicas-to-write`), is no longer
                // the one to decide on: reconnect at once, which under Sentinel asks the
                // sentinels for the primary now (see `docs/operations.md`, "Redis Sentinel").
                c.reconnect_errors = vec![ReconnectError::ReadOnly, ReconnectError::NoReplicas];
            })
            // Reconnect soon after a failover: at most half a second between attempts.
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 500, 2));
        let pool = builder.build_pool(self.pool_size)?;
        let scripts = SCRIPTS
            .into_iter()
            .map(|(algorithm, lua)| (algorithm, Script::from_lua(lua)))
            .collect();
        Ok((builder, pool, scripts))
    }

    /// The store over `pool`, or in a Redis Cluster over `nodes` for its scripts, its
    /// batching tasks started.
    fn store(self, pool: Pool, nodes: Option<Arc<Nodes>>, scripts: Scripts) -> RedisStore {
        let placement = match nodes {
            Some(_) => Placement::tagged(self.cluster_tags),
            None => Placement::PerClient,
        };
        let lanes = placement.lanes();
        let batcher = Batcher::spawn(
            lanes,
            batch::Settings {
                overrides: (0..lanes)
                    .map(|lane| {
                        fred::types::Value::from(placement.overrides_key(&self.prefix, lane))
                    })
                    .collect(),
                redis: match nodes {
                    Some(nodes) => batch::Redis::Cluster(nodes),
                    None => batch::Redis::Single(pool.clone()),
                },
                scripts,
                release: Script::from_lua(concat!(
                    include_str!("scripts/exact.lua"),
                    include_str!("scripts/release.lua")
                )),
                max_batch: self.max_batch,
                // Without batching, waiting for a slot gains nothing: send everything at once, as
                // fred pipelines it.
                in_flight: match (self.max_batch, self.max_in_flight, &placement) {
                    (1, _, _) => tokio::sync::Semaphore::MAX_PERMITS,
                    (_, Some(calls), _) => calls,
                    (_, None, Placement::PerClient) => RedisStore::DEFAULT_MAX_IN_FLIGHT,
                    (_, None, Placement::Tagged(_)) => RedisStore::DEFAULT_CLUSTER_IN_FLIGHT,
                },
                // Cluster lanes batch small (see `batch::gather`); a single Redis's two calls
                // under way batch well without the wait.
                gather: match placement {
                    Placement::PerClient => 0,
                    Placement::Tagged(_) => CLUSTER_GATHER_PASSES,
                },
                timeout: self.timeout,
            },
        );
        let inner = Arc::new(Inner {
            pool,
            prefix: self.prefix,
            placement,
            batcher,
            timeout: self.timeout,
            breakers: (0..lanes)
                .map(|_| Breaker::new(self.retry_interval))
                .collect(),
            leases: self.leases.map(lease::State::new),
            limits_version: AtomicU64::new(0),
            next_slot: AtomicU64::new(random_start()),
        });
        overrides::spawn_watch(Arc::downgrade(&inner));
        if let Some(leases) = &self.leases {
            lease::spawn_sweeper(Arc::downgrade(&inner), leases.period_length());
        }
        RedisStore { inner }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;

impl Store for RedisStore {
    type Future = BoxFuture<Decision>;
    type ResetFuture = BoxFuture<()>;

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        if let Some(cap) = policy.concurrency_limit() {
            let id = self.inner.next_slot();
            let ttl = policy.slot_micros();
            return self.run(key, policy, cost, -1, Record::Take { cap, id, ttl });
        }
        if let Some(plan) = lease::plan(&self.inner, policy) {
            let (inner, key, policy) = (Arc::clone(&self.inner), key.clone(), policy.clone());
            return Box::pin(lease::check(inner, plan, key, policy, cost));
        }
        self.run(key, policy, cost, -1, Record::Yes)
    }

    fn check_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        lease::check_now(&self.inner, key, policy, cost)
    }

    fn supports(&self, policy: &Policy) -> Result<(), StoreError> {
        super::in_range(policy)?;
        lease::supports(&self.inner, policy)
    }

    fn limits_version(&self) -> u64 {
        self.inner.limits_version.load(Ordering::Acquire)
    }

    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future {
        if policy.concurrency_limit().is_some() {
            let unsupported = StoreError::Unsupported("event times take no concurrency slot");
            return Box::pin(std::future::ready(Err(unsupported)));
        }
        if policy.algorithm() != Algorithm::SlidingLog {
            let unsupported = StoreError::Unsupported("event times need the sliding log algorithm");
            return Box::pin(std::future::ready(Err(unsupported)));
        }
        let micros = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        self.run(
            key,
            policy,
            cost,
            i64::try_from(micros).unwrap_or(i64::MAX),
            Record::Yes,
        )
    }

    /// What a decision would answer now: from this instance's lease when it holds the units,
    /// as [`check_now`](Store::check_now) would, else from Redis, against the same GCRA
    /// headroom a leasing store's decisions keep.
    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        if let Some(decision) = lease::peek_now(&self.inner, key, policy, cost) {
            return Box::pin(std::future::ready(Ok(decision)));
        }
        let headroom = lease::headroom(&self.inner, policy);
        self.run(key, policy, cost, -1, Record::No { headroom })
    }

    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture {
        let inner = Arc::clone(&self.inner);
        let redis_key = self.redis_key(key, policy);
        Box::pin(async move {
            // The state, and the penalty box beside it (same hash slot).
            let del = |client: fred::clients::Client| {
                let keys = vec![redis_key.clone(), format!("{redis_key}:box")];
                async move { client.del::<(), _>(keys).await }
            };
            inner.batcher.on(&redis_key, del).await?;
            Ok(())
        })
    }

    /// One call of the policy's script in its settle mode (`record` 3), behind the breaker,
    /// in a call of its own that waits for Redis's reply up to 3 s rather than the time
    /// budget; a call Redis refused without running it (a cluster redirect, `TRYAGAIN`
    /// during a slot move) goes again through the batched path, which follows them. With
    /// leases as without, except that a reply showing the key full ends this instance's
    /// leases of it (`lease::settled`).
    fn settle(&self, key: &Key, policy: &Policy, settlement: Settlement) -> Self::ResetFuture {
        /// How long a settle waits for its reply. Redis records a settle when the script runs,
        /// however late the reply comes, and one whose reply is not read cannot be sent again
        /// safely: so a settle outlasts a Redis paused well past the time budget (a fork, a
        /// slow command), and a failure reported means that it did not run, or that no reply
        /// came within this long. Shorter than a lease's patience, so that a Redis that is
        /// gone is reported within a typical shutdown deadline.
        const PATIENCE: Duration = Duration::from_secs(3);
        if let Some(op) = slot_op(policy, &settlement) {
            // The path of the layer's own give-backs (`settle_then`), sent when first polled.
            let (store, key, policy) = (self.clone(), key.clone(), policy.clone());
            return Box::pin(async move {
                let (sent, outcome) = tokio::sync::oneshot::channel();
                let done = Box::new(move |kept| drop(sent.send(kept)));
                store.keep_slot(&key, &policy, op, done);
                let dropped =
                    fred::error::Error::new(fred::error::ErrorKind::Canceled, "batch dropped");
                outcome.await.unwrap_or_else(|_| Err(dropped.into()))
            });
        }
        let inner = Arc::clone(&self.inner);
        let place = inner.place(key, policy);
        let algorithm = policy.algorithm();
        let (key, policy) = (key.clone(), policy.clone());
        let (units, refund) = match settlement {
            Settlement::Charge(units) => (units, false),
            Settlement::Refund(units) => (units, true),
            // Sent through `keep_slot` above.
            Settlement::Release(_) | Settlement::Renew(_) => return Box::pin(async { Ok(()) }),
        };
        let record = Record::Settle {
            refund,
            admitted: units.admitted_at().unwrap_or(-1),
            recorded: units.recorded(),
        };
        let units = units.count();
        Box::pin(async move {
            if units == 0 {
                return Ok(());
            }
            super::in_range(&policy)?;
            let lane = place.lane;
            if inner.breaker(lane).is_open() {
                return Err(StoreError::Unavailable);
            }
            let started = inner.breaker(lane).now();
            let args = batch::encode_for(&policy, units, record, -1);
            let call = inner
                .batcher
                .decide_patiently(place.clone(), algorithm, args, PATIENCE);
            let answer = match call.await {
                Err(error) if lease::refused(&error) || ask::is_redirection(&error) => {
                    inner.decide(place, &policy, units, -1, record).await?
                }
                reply => inner.judge(lane, started, Some(reply))?,
            };
            lease::settled(&inner, &key, &policy, &answer);
            Ok(())
        })
    }

    /// A concurrency slot's give-back or renewal joins the next batched call of its key's lane,
    /// and `then` runs in the batching task that sent it (at once while the breaker is open):
    /// a give-back costs no task of its own. Charges and refunds run in a task, as by default.
    fn settle_then(&self, key: &Key, policy: &Policy, settlement: Settlement, then: OnSettled) {
        match slot_op(policy, &settlement) {
            Some(op) => self.keep_slot(key, policy, op, then),
            None => super::settle_in_task(self, key, policy, settlement, then),
        }
    }
}

impl RedisStore {
    /// Sends slot operation `op` with the next batched call of its key's lane, within the
    /// time budget: a give-back or a renewal may run twice or not at all without harm (the
    /// slot's expiry is the backstop), so it needs none of a charge's patience, and no timer
    /// of its own (the call has its timeout). Behind the breaker, as a decision is.
    fn keep_slot(&self, key: &Key, policy: &Policy, op: SlotOp, done: SlotDone) {
        let place = self.inner.place(key, policy);
        let lane = place.lane;
        if self.inner.breaker(lane).is_open() {
            return done(Err(StoreError::Unavailable));
        }
        let started = self.inner.breaker(lane).now();
        let inner = Arc::clone(&self.inner);
        let then = Box::new(move |reply| done(inner.slot_kept(lane, started, op, reply)));
        self.inner
            .batcher
            .keep_then(place, policy.algorithm(), op, then);
    }
}

/// What runs with the outcome of a slot's give-back or renewal.
type SlotDone = super::OnSettled;

/// The slot operation `settlement` asks for under `policy`: a give-back (lifetime 0) or a
/// renewal for the policy's slot lifetime; `None` for a charge or a refund.
fn slot_op(policy: &Policy, settlement: &Settlement) -> Option<SlotOp> {
    match settlement {
        Settlement::Release(id) => Some(SlotOp {
            id: id.get(),
            lifetime: 0,
        }),
        Settlement::Renew(id) => Some(SlotOp {
            id: id.get(),
            lifetime: policy.slot_micros().max(1),
        }),
        Settlement::Charge(_) | Settlement::Refund(_) => None,
    }
}

/// A start for a store's concurrency slot ids that another process, or another store of this
/// one, is unlikely to share: a hash of the process, the time and a fresh allocation's address.
fn random_start() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let here = Box::new(0u8);
    let mut hasher = blake3::Hasher::new();
    hasher.update(&std::process::id().to_le_bytes());
    hasher.update(&nanos.to_le_bytes());
    hasher.update(&(std::ptr::addr_of!(*here) as usize).to_le_bytes());
    let mut first = [0; 8];
    first.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    u64::from_le_bytes(first) & ((1 << 52) - 1)
}

/// A script's answer to one request, read.
struct Reply {
    outcome: Outcome,
    /// The units leased beyond the request's cost.
    extra: u64,
    /// The count of the reported limit when an override set it.
    count: Option<u64>,
    /// How long (µs) the key stays in the policy's penalty box, when it is in it.
    boxed: Option<u64>,
    /// When the key holds every concurrency slot: how long (µs) until the first expires.
    slots_full: Option<u64>,
}

impl Reply {
    /// The answer for a key in its policy's penalty box for `left` µs more.
    fn boxed(left: u64) -> Reply {
        Reply {
            outcome: Outcome {
                allowed: false,
                index: 0,
                remaining: 0,
                reset_after: left,
                retry_after: Some(left),
            },
            extra: 0,
            count: None,
            boxed: Some(left),
            slots_full: None,
        }
    }

    /// The decision it tells, under `policy` or the override's count.
    fn decision(&self, policy: &Policy) -> Decision {
        if let Some(left) = self.slots_full {
            return Decision::slots_full(policy, std::time::Duration::from_micros(left));
        }
        if let Some(left) = self.boxed {
            return Decision::boxed(policy, std::time::Duration::from_micros(left));
        }
        Decision::from_outcome(self.outcome, policy).with_limit(self.count)
    }
}

/// Reads `{allowed, index, remaining, reset_after, retry_after, count}`.
fn parse_reply(reply: &[i64; 6], policy: &Policy) -> Result<Reply, StoreError> {
    let bad = || StoreError::Reply(format!("{reply:?}"));
    let &[allowed, index, remaining, reset_after, retry_after, count] = reply;
    if index == -1 {
        // The key is in the policy's penalty box, for `retry_after` µs more.
        let left = u64::try_from(retry_after).map_err(|_| bad())?;
        return Ok(Reply::boxed(left));
    }
    if index == -2 {
        // The key holds every concurrency slot; the first expires in `retry_after` µs.
        let left = u64::try_from(retry_after).map_err(|_| bad())?;
        return Ok(Reply {
            slots_full: Some(left),
            ..Reply::boxed(left)
        });
    }
    let index = usize::try_from(index)
        .ok()
        .filter(|&i| i < policy.limits().len())
        .ok_or_else(bad)?;
    let non_negative = |v: i64| u64::try_from(v).map_err(|_| bad());
    let outcome = Outcome {
        allowed: allowed >= 1,
        index,
        remaining: non_negative(remaining)?,
        reset_after: non_negative(reset_after)?,
        retry_after: match retry_after {
            -1 | -2 => None,
            v => Some(non_negative(v)?),
        },
    };
    Ok(Reply {
        outcome,
        extra: non_negative(allowed.max(1) - 1)?,
        count: match count {
            -1 => None,
            v => Some(non_negative(v)?),
        },
        boxed: None,
        slots_full: None,
    })
}
