//! [`RedisStoreBuilder`]: a store's settings, checked, and the connections, scripts and
//! batching tasks they start.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use fred::clients::Pool;
use fred::prelude::{ClientLike, Config, ReconnectPolicy};
use fred::types::config::ReconnectError;
use fred::types::Builder;

use super::placement::Placement;
use super::scripts::Scripts;
use super::transport::batch::Batcher;
use super::transport::call::{Redis, Settings};
use super::transport::health::Breaker;
use super::transport::nodes::Nodes;
use super::{layout, lease, overrides, Inner, Leases, RedisStore};
use crate::ids::random_start;
use crate::StoreError;

/// Scheduler passes a cluster lane waits for more requests before it sends a batch (see
/// `batch::gather`): with three primaries on two cores, four took `EVALSHA` per request from
/// 0.25 to 0.15 (one pass: 0.18), near a single Redis's 0.14; `docs/performance.md`.
const CLUSTER_GATHER_PASSES: usize = 4;

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
    /// Whether plain requests go to the plain tier ([`plain_scripts`](Self::plain_scripts)).
    plain_scripts: bool,
    #[cfg(feature = "tls")]
    tls: Option<fred::types::config::TlsConnector>,
}

impl RedisStoreBuilder {
    /// The default settings for the Redis at `url` ([`RedisStore::builder`]).
    pub(super) fn new(url: String) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url,
            pool_size: 4,
            max_batch: RedisStore::DEFAULT_MAX_BATCH,
            max_in_flight: None,
            prefix: RedisStore::DEFAULT_PREFIX.to_owned(),
            timeout: RedisStore::DEFAULT_TIMEOUT,
            retry_interval: Duration::from_millis(500),
            leases: None,
            cluster_tags: RedisStore::DEFAULT_CLUSTER_TAGS,
            plain_scripts: true,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// Whether looks, admissions and leases of a policy without penalty box, concurrency
    /// limit or attempts go to the plain scripts, which do only what such a decision needs
    /// (on by default); off, every request runs the full scripts. For tests and measurements
    /// that compare the two: both decide alike.
    #[cfg(feature = "test-util")]
    #[doc(hidden)]
    pub fn plain_scripts(mut self, on: bool) -> Self {
        self.plain_scripts = on;
        self
    }

    /// Takes shares of each busy key's budget from Redis ahead of need (leases) and decides
    /// requests from them in this process: Redis sees one call per lease instead of one per
    /// request, and the fleet still never admits more than the limit. Off by default.
    ///
    /// Applies to every algorithm; the sliding log stays exact in every window, reading each
    /// window a lease's headroom longer. [`RedisStore::drain`] gives the units back on
    /// shutdown. What it costs (under-admission while another instance holds units, GCRA's
    /// smaller burst, the log's longer window) is in [`Leases`] and `docs/leases.md`.
    pub fn leases(mut self, leases: Leases) -> Self {
        self.leases = Some(leases);
        self
    }

    /// In a Redis Cluster, how many hash tags the clients' keys are spread over (default
    /// [`RedisStore::DEFAULT_CLUSTER_TAGS`], 3; at most 16 384, the number of hash slots). No
    /// effect on a single Redis.
    ///
    /// One script call decides requests of one hash slot only, so the batching that saves Redis and
    /// this process a command per request needs many requests per tag: a batch holds at most the
    /// requests under way divided by the tags. The tags' hash slots are spread evenly, so a cluster
    /// whose primaries hold equal ranges of hash slots (as `redis-cli --cluster create` assigns
    /// them) gets an equal share of the tags when its number of primaries divides this one. Set it
    /// to the number of primaries, or a small multiple of it where each instance has many requests
    /// under way: the default suits the usual three primaries, and leaves a fourth primary without
    /// limiter keys. Every instance must use the same number: changing it moves every key, which
    /// starts every client's limits afresh. The first instance to connect records its number in the
    /// cluster (`<prefix>:{layout}:cluster_tags`), and [`connect`](Self::connect) refuses another
    /// number with [`StoreError::Config`] ([`connect_lazy`](Self::connect_lazy) logs it as an ERROR
    /// once connected); to change it on purpose, delete that key once every instance uses the new
    /// one.
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
    /// returns, which saves Redis and the client a command's fixed cost per request. Up to as
    /// many give-backs or renewals of concurrency slots ride with them. A lone request is sent
    /// at once. `1` sends every request in its own call, at once, with no
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
    /// primary, which fail only the calls for their own hash slots.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let (builder, pool, scripts) = self.pool(true)?;
        if !pool.next().is_clustered() {
            pool.init().await?;
            for script in scripts.deciding() {
                script.load(pool.next()).await?;
            }
            return Ok(self.store(pool, None, scripts));
        }
        let nodes = Nodes::new(builder, self.pool_size, self.patience());
        nodes.refresh().await?;
        // fred's own cluster client (`RedisStore::pool`) connects to every primary at once,
        // and one that is gone would hold it up: it connects in the background.
        drop(pool.connect_pool());
        match layout::verify(&nodes, &self.prefix, self.cluster_tags).await {
            Err(error @ StoreError::Config(_)) => return Err(error),
            Err(error) => {
                let error = crate::chain::Chain(&error);
                tracing::warn!(target: "tower_redis_ratelimit", %error, "cluster_tags not checked yet");
                layout::verify_later(Arc::downgrade(&nodes), &self.prefix, self.cluster_tags);
            }
            Ok(()) => {}
        }
        Ok(self.store(pool, Some(nodes), scripts))
    }

    /// How long to wait for a node's hash slot map: the time budget, at least a second.
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
            layout::verify_later(weak, &prefix, tags);
        });
        Ok(self.store(pool, Some(nodes), scripts))
    }

    /// Refuses settings that cannot work, with [`StoreError::Config`].
    fn validate(&self) -> Result<(), StoreError> {
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
        Ok(())
    }

    /// Validates the settings and builds the pool, not yet connected, with the fred builder
    /// that made it. `fail_fast`: whether the first connection's failure is returned rather
    /// than retried.
    fn pool(&self, fail_fast: bool) -> Result<(Builder, Pool, Scripts), StoreError> {
        self.validate()?;
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
                // client (`RedisStore::pool`) fails a command on a moving hash slot rather than
                // stopping. The scripts follow redirections themselves, on the store's own
                // connections to each primary (`transport/nodes.rs`).
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
        Ok((builder, pool, Scripts::new()))
    }

    /// The store over `pool`, or in a Redis Cluster over `nodes` for its scripts, its
    /// batching tasks started.
    fn store(self, pool: Pool, nodes: Option<Arc<Nodes>>, scripts: Scripts) -> RedisStore {
        let placement = match nodes {
            Some(_) => Placement::tagged(self.cluster_tags),
            None => Placement::PerClient,
        };
        let lanes = placement.lanes();
        let limits = Arc::new(overrides::Limits::new());
        let batcher = Batcher::spawn(
            lanes,
            Settings {
                overrides: (0..lanes)
                    .map(|lane| {
                        fred::types::Value::from(placement.overrides_key(&self.prefix, lane))
                    })
                    .collect(),
                redis: match nodes {
                    Some(nodes) => Redis::Cluster(nodes),
                    None => Redis::Single(pool.clone()),
                },
                scripts,
                known: overrides::Known::new(lanes),
                limits: Arc::clone(&limits),
                plain: self.plain_scripts,
                max_batch: self.max_batch,
                // Without batching, waiting for a call permit gains nothing: send everything at
                // once, as fred pipelines it.
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
            leases: self.leases.map(lease::Leasing::new),
            limits,
            waiting: Default::default(),
            next_slot: AtomicU64::new(random_start()),
            claims: Default::default(),
        });
        overrides::spawn_watch(Arc::downgrade(&inner));
        if let Some(leases) = &self.leases {
            lease::spawn_sweeper(Arc::downgrade(&inner), leases.period_length());
        }
        RedisStore { inner }
    }
}
