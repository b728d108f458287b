//! The Redis store, over the `fred` client.
//!
//! Data flows one way through its files: [`RedisStore`] (here) places a request
//! (`placement.rs`), encodes it (`wire/`, the contract with `scripts/prelude.lua`) and
//! hands it to a lane of the batcher (`transport/batch.rs`), which sends it in a call through
//! fred's pool or, in a Redis Cluster, the store's own routing (`transport/nodes.rs`,
//! `transport/ask.rs`); the reply comes back the same way and is read by `wire/`. The scripts
//! are in `scripts/`. Beside that path: the breakers (`transport/health.rs`),
//! concurrency slots' give-backs and renewals that wait for Redis (`slots.rs`),
//! leases (`lease/`), overrides (`overrides/`), the cluster's key layout check (`layout.rs`),
//! and the settings that start it all (`builder.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use fred::prelude::KeysInterface;

mod builder;
mod layout;
mod lease;
mod overrides;
mod placement;
mod reserve;
mod scripts;
mod slots;
#[cfg(test)]
mod tests;
mod transport;
mod wire;

pub use builder::RedisStoreBuilder;
pub use lease::Leases;

use placement::{Place, Placement};
use scripts::{Scripts, Tier};
use transport::batch::Batcher;
use transport::call::{Late, ScriptId};
use transport::health::{is_outage, Breaker};
use wire::{Answer, Answered, Record, SlotOp};

use super::claims::Claims;
use super::engine::{Engine, OnSettled, Sealed};
use super::{Store, StoreError};
use crate::model::slots::Waiter;
use crate::model::Algorithm;
use crate::settlement::Owed;
use crate::{Decision, Key, Policy, Settlement};

/// What a plain call carries of one request's full arguments ([`wire::plain_args`]), for the
/// scripts' own tests (`test_util::plain_args`).
#[cfg(feature = "test-util")]
pub(crate) fn plain_args(full: &[u8], confirmed: i64) -> Vec<u8> {
    wire::plain_args(full, 1, confirmed)
}

/// Rate-limit state in Redis, shared by every instance of a service.
///
/// Decisions run the algorithm's Lua script (`EVALSHA`; under load one call decides a batch,
/// see [`RedisStoreBuilder::max_batch`]): the script reads the time
/// from Redis `TIME` (so that app servers whose clocks disagree still share one timeline),
/// trims, counts and records in one atomic step. If Redis has lost the script (`SCRIPT FLUSH`,
/// a restart, a failover) it is loaded again and the call retried once.
///
/// Keys are `<prefix>:{<policy>:<key>}:<algorithm>:<limits>` (algorithm `log`, `sw`, `fw`, `gcra`;
/// limits as in [identity](crate::Policy#identity)) on a single Redis. On a Redis Cluster (a `redis-cluster://`
/// URL) they are `<prefix>:{<tag>}:<policy>:<key>:<algorithm>:<limits>`, where the hash tag is one
/// of a fixed set ([`RedisStoreBuilder::cluster_tags`]) spread evenly over the hash slots: requests
/// for many clients then share a hash slot, and so a script call. Either way, all the state of one
/// decision is in one hash slot. Each key expires once its state no longer matters: the longest
/// window after the last admitted request (twice that for the sliding window counter).
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
    /// has connections of its own, see `transport/nodes.rs`).
    breakers: Vec<Breaker>,
    /// Set when the store leases ([`RedisStoreBuilder::leases`]).
    leases: Option<lease::Leasing>,
    /// What this store knows of the limits version in Redis (`overrides/version.rs`).
    limits: Arc<overrides::Limits>,
    /// The id of the next concurrency slot taken: from a random start per store, so that
    /// instances sharing Redis take different ids, below 2^52 (exact in Lua's doubles).
    next_slot: AtomicU64,
    /// Slot give-backs and renewals waiting for Redis (`slots.rs`).
    waiting: slots::Unsent,
    /// The unnamed policies the live layers on this store use (`store/claims.rs`): another
    /// `RedisStore` on the same Redis, as another instance has, keeps its own.
    claims: Claims,
}

impl Inner {
    /// Records the limits version read from Redis by a call sent at `sent`; when it is
    /// another, the leases held now are spent no more (`lease::limits_changed`), and when the
    /// overrides were lost with Redis's data, says so.
    fn limits_seen(&self, reading: overrides::Reading, sent: tokio::time::Instant) {
        match self.limits.seen(reading, sent) {
            overrides::Change::Same => return,
            overrides::Change::Changed => {}
            overrides::Change::Lost => {
                tracing::error!(
                    target: "tower_redis_ratelimit",
                    prefix = %self.prefix,
                    "the overrides in Redis were lost (a restart without persistence, or a \
                     flush): every override set before is gone, and each key and policy \
                     decides by its own limits until they are set again"
                );
                crate::metrics::Report::overrides_lost();
            }
        }
        lease::limits_changed(self);
    }

    /// Where the state of `key` under `policy` lives.
    fn place(&self, key: &Key, policy: &Policy) -> Place {
        self.placement.place(&self.prefix, key, policy)
    }

    /// Runs the policy's script for one request at `place`, behind the breaker and within
    /// the time budget; `at` is an event time in µs since the epoch (`-1`: now). `units` is
    /// the request's cost and the attempt it is or settles (0: none; `model::attempts`).
    async fn decide(
        &self,
        place: Place,
        policy: &Policy,
        units: (u64, u64),
        at: i64,
        record: Record,
    ) -> Result<Answer, StoreError> {
        self.decide_or_late(place, policy, units, at, record, None)
            .await
    }

    /// [`decide`](Self::decide), with `late` reading the reply if it comes after the budget
    /// (or after the caller went away): see `transport/call.rs`, "Replies after the budget".
    ///
    /// A request goes to the plain tier where [`tier`](Self::tier) says so; one that the plain
    /// tier answers [`FULL_PATH`](wire::FULL_PATH) (it recorded nothing) goes again to the
    /// full tier, within the same budget.
    async fn decide_or_late(
        &self,
        place: Place,
        policy: &Policy,
        units: (u64, u64),
        at: i64,
        record: Record,
        late: Option<Arc<GiveBack>>,
    ) -> Result<Answer, StoreError> {
        super::in_range(policy)?;
        let resolution = wire::resolve(policy, &place, self.batcher.known());
        let tier = self.tier(&place, policy, (units.1, at), &record, &resolution);
        let args = wire::encode_with(policy, &place, units, record, at, &resolution);
        let args = bytes::Bytes::from(args);
        let (lane, algorithm) = (place.lane, policy.algorithm());
        // Shared bytes: a second call costs no copy of the key.
        let key = fred::types::Key::from(place.key);
        // The budget covers the whole decision: the queue, the calls and a script reload.
        let decision = async {
            if tier == Tier::Plain {
                let plain = ScriptId { algorithm, tier };
                let first = late.clone().map(GiveBack::late);
                let answer = (self.batcher)
                    .decide(lane, key.clone(), plain, args.clone(), first)
                    .await?;
                if answer.ints[1] != wire::FULL_PATH {
                    return Ok(answer);
                }
            }
            let full = ScriptId::full(algorithm);
            let late = late.map(GiveBack::late);
            self.batcher.decide(lane, key, full, args, late).await
        };
        self.guarded(lane, decision).await
    }

    /// The tier that decides a request of `record` under `policy` at `place`, as `attempt`
    /// (0: none) at event time `at` (-1: now), whose override is `resolution`: the plain
    /// tier where it decides such a request (`wire::plain_eligible`) and the lane's
    /// overrides are confirmed (`overrides/known.rs`, "The plain tier"), else the full one.
    fn tier(
        &self,
        place: &Place,
        policy: &Policy,
        (attempt, at): (u64, i64),
        record: &Record,
        resolution: &overrides::Resolution,
    ) -> Tier {
        let plain = self.batcher.plain()
            && Scripts::has_plain(policy.algorithm())
            && wire::plain_eligible(record, policy, attempt, at)
            && (self.batcher.known()).plain_ok(place.lane, resolution, self.limits.token());
        match plain {
            true => Tier::Plain,
            false => Tier::Full,
        }
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
    /// range of hash slots holds its hash slot (the tags divide the hash slots in equal ranges).
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
        reply: Answered,
    ) -> Result<(), StoreError> {
        let answer = self.judge(lane, started, Some(reply))?;
        match (op.is_renewal(), answer.ints[0]) {
            (true, 0) => Err(StoreError::SlotGone),
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
        RedisStoreBuilder::new(url.into())
    }

    /// How many keys hold an entry in the lease book (0 without leases).
    #[cfg(feature = "test-util")]
    pub(crate) fn leasing_keys(&self) -> u64 {
        lease::leasing_keys(&self.inner)
    }

    /// The Redis key holding the state of `key` under `policy`.
    ///
    /// Useful to inspect or clear state by hand.
    pub(crate) fn redis_key(&self, key: &Key, policy: &Policy) -> String {
        self.inner.place(key, policy).key
    }

    /// Decides a request under a concurrency limit, taking a slot if admitted (for `waiter`,
    /// if it waits).
    fn take(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        waiter: Option<Waiter>,
    ) -> <Self as Store>::Future {
        let cap = policy.concurrency_limit().unwrap_or(u32::MAX);
        let id = self.inner.next_slot();
        let ttl = slots::stored_micros(policy, self.inner.timeout);
        let take = Record::Take {
            cap,
            id,
            ttl,
            waiter,
            headroom: lease::headroom(&self.inner, policy),
        };
        self.run(key, policy, cost, -1, take)
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
        // A slot taken by a decision whose answer is never read is given back (`slots.rs`).
        let mut unheld = match record {
            Record::Take { id, .. } => Some(slots::Unheld::new(&inner, key, &policy, id)),
            _ => None,
        };
        // An admission counted by its outcome is an attempt (`model::attempts`); an event time
        // is not: a scheduler's booking has no outcome to wait for.
        let admits = matches!(
            record,
            Record::Admit | Record::Lease { .. } | Record::Take { .. }
        );
        let attempt = match admits && policy.attempts() && at < 0 {
            true => inner.next_slot(),
            false => 0,
        };
        // Units recorded by a decision whose answer is never read are given back.
        let late = match record {
            Record::Admit | Record::Step { .. } | Record::Take { .. } => {
                Some(self.give_back_late(key, &policy, (cost, attempt), at))
            }
            _ => None,
        };
        Box::pin(async move {
            let units = (cost.into(), attempt);
            let answer = inner
                .decide_or_late(place, &policy, units, at, record, late)
                .await;
            if let (Some(unheld), Err(StoreError::Unavailable)) = (&mut unheld, &answer) {
                unheld.disarm();
            }
            let answer = answer?;
            let decided = decided_at(&answer, at);
            let decision = answer.verdict(&policy)?.decision(&policy);
            let decision = decision.decided_at(decided);
            if let Some(unheld) = &mut unheld {
                unheld.disarm();
            }
            let recorded = |d: Decision| d.recorded_at(Some(decided), cost.into());
            Ok(match record {
                // A lease of its cost alone: an event time's decision on a leasing store.
                Record::Admit | Record::Lease { .. } | Record::Step { .. } => {
                    recorded(decision).as_attempt(attempt)
                }
                Record::Take { id, .. } => recorded(decision).with_slot(id).as_attempt(attempt),
                _ => decision,
            })
        })
    }

    /// What reads the answer to a decision of `cost` under `policy` (at event time `at`, or
    /// now) that its caller never read ([`GiveBack::late`]). `units` is the decision's cost
    /// and the attempt it is (0: none), whose settle the refund is.
    fn give_back_late(
        &self,
        key: &Key,
        policy: &Policy,
        units: (u32, u64),
        at: i64,
    ) -> Arc<GiveBack> {
        // Weak: a store dropped meanwhile gives nothing back (its tasks end with it).
        Arc::new(GiveBack {
            inner: Arc::downgrade(&self.inner),
            key: key.clone(),
            policy: policy.clone(),
            units,
            at,
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
        lease::return_unused(self, true).await
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
    pub(crate) fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The fred connection pool, e.g. to inspect keys in tests. On a Redis Cluster this is
    /// fred's cluster client, which the scripts do not use (they run on the store's own
    /// connections to each primary): it holds every command while any primary is gone.
    pub(crate) fn pool(&self) -> &fred::clients::Pool {
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

type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;

impl Store for RedisStore {
    type Future = BoxFuture<Decision>;

    type ResetFuture = BoxFuture<()>;

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        if policy.concurrency_limit().is_some() {
            return self.take(key, policy, cost, None);
        }
        // Attempts counted by their outcome are decided in Redis one by one, so that it knows
        // those in flight (`model::attempts`): a login limit's keys are seldom hot enough
        // for a lease to pay.
        let plan = lease::plan(&self.inner, policy).filter(|_| !policy.attempts());
        if let Some(plan) = plan {
            let (inner, key, policy) = (Arc::clone(&self.inner), key.clone(), policy.clone());
            return Box::pin(lease::check(inner, plan, key, policy, cost));
        }
        let record = lease::record_alone(&self.inner, policy, cost);
        self.run(key, policy, cost, -1, record)
    }

    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future {
        if policy.concurrency_limit().is_some() {
            let unsupported = StoreError::Unsupported("event times take no concurrency slot");
            return Box::pin(std::future::ready(Err(unsupported)));
        }
        match policy.algorithm() {
            Algorithm::SlidingLog => {}
            Algorithm::SlidingWindow | Algorithm::FixedWindow | Algorithm::Gcra => {
                let unsupported =
                    StoreError::Unsupported("event times need the sliding log algorithm");
                return Box::pin(std::future::ready(Err(unsupported)));
            }
        }
        if let Err(error) = super::event_in_range(at) {
            return Box::pin(std::future::ready(Err(error)));
        }
        let micros = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros();
        let at = i64::try_from(micros).unwrap_or(i64::MAX);
        let record = lease::record_alone(&self.inner, policy, cost);
        self.run(key, policy, cost, at, record)
    }

    /// What a decision would answer now: from this instance's lease when it holds the units,
    /// as `Engine::check_now` would, else from Redis, against the same GCRA
    /// headroom a leasing store's decisions keep.
    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        if let Some(decision) = lease::peek_now(&self.inner, key, policy, cost) {
            return Box::pin(std::future::ready(Ok(decision)));
        }
        let headroom = lease::headroom(&self.inner, policy);
        self.run(key, policy, cost, -1, Record::Look { headroom })
    }

    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture {
        let inner = Arc::clone(&self.inner);
        let redis_key = self.redis_key(key, policy);
        Box::pin(async move {
            // The state, and the penalty box, line of reservations, pause and longest late
            // beside it (same hash slot).
            let del = |client: fred::clients::Client| {
                let keys = vec![
                    redis_key.clone(),
                    format!("{redis_key}:box"),
                    format!("{redis_key}:line"),
                    format!("{redis_key}:places"),
                    format!("{redis_key}:notices"),
                    format!("{redis_key}:costs"),
                    format!("{redis_key}:pause"),
                    format!("{redis_key}:late"),
                    format!("{redis_key}:tries"),
                ];
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
        if let Some(op) = slot_op(policy, &settlement, self.inner.timeout) {
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
        self.settle_units(key, policy, settlement, true)
    }
}

/// What gives back the units recorded by a decision whose answer its caller never read
/// ([`late`](Self::late)); shared (`Arc`) so that a plain request, whose second call (on the
/// full tier) needs one of its own, copies nothing, and a decision's future holds a pointer.
struct GiveBack {
    inner: Weak<Inner>,
    key: Key,
    policy: Policy,
    units: (u32, u64),
    at: i64,
}

impl GiveBack {
    /// What reads the answer to the decision that its caller never read (it took longer than
    /// the time budget, or the caller went away): the units an admission recorded then are
    /// ones no request accounts for (the caller saw a failure, and the layer followed its
    /// failure mode), so they are refunded, as a refused request's would be, under the same
    /// checks as any refund (the state that recorded them, by the admission's time). A slot it
    /// took goes back through `Unheld`. An answer that decided nothing (the plain tier's
    /// [`FULL_PATH`](wire::FULL_PATH)) gives nothing back.
    fn late(self: Arc<Self>) -> Late {
        Box::new(move |answered| {
            let GiveBack {
                inner,
                key,
                policy,
                units: (cost, attempt),
                at,
            } = &*self;
            let (cost, attempt, at) = (*cost, *attempt, *at);
            let (Ok(answer), Some(inner)) = (answered, inner.upgrade()) else {
                return;
            };
            let (key, policy) = (key.clone(), policy.clone());
            let store = RedisStore { inner };
            let Ok(verdict) = answer.verdict(&policy) else {
                return;
            };
            let decision = verdict
                .decision(&policy)
                .recorded_at(Some(decided_at(&answer, at)), cost.into())
                .as_attempt(attempt);
            let Some(refund) = Settlement::refund(&decision, cost.into()) else {
                return;
            };
            tracing::debug!(
                target: "tower_redis_ratelimit",
                policy = policy.name(),
                key = %key.loggable(),
                units = cost,
                "a decision answered after its time budget: the units it recorded are given back"
            );
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return;
            };
            runtime.spawn(async move {
                if let Err(error) = store.settle_units(&key, &policy, refund, false).await {
                    tracing::warn!(
                        target: "tower_redis_ratelimit",
                        policy = policy.name(),
                        key = %key.loggable(),
                        error = %crate::chain::Chain(&error),
                        "the refund of a decision answered after its time budget failed"
                    );
                }
            });
        })
    }
}

/// When a script decided a request sent with event time `at` (µs; `-1`: now): that time, or
/// the call's `TIME`. The script records an admission then.
fn decided_at(answer: &Answer, at: i64) -> i64 {
    if at < 0 {
        answer.time
    } else {
        at
    }
}

impl RedisStore {
    /// [`settle`](Store::settle) of a charge or a refund; `guarded`: behind the breaker (a
    /// refund of a reply read late is not: that reply showed Redis back).
    fn settle_units(
        &self,
        key: &Key,
        policy: &Policy,
        settlement: Settlement,
        guarded: bool,
    ) -> BoxFuture<()> {
        /// How long a settle waits for its reply. Redis records a settle when the script runs,
        /// however late the reply comes, and one whose reply is not read cannot be sent again
        /// safely: so a settle outlasts a Redis paused well past the time budget (a fork, a
        /// slow command), and a failure reported means that it did not run, or that no reply
        /// came within this long. Shorter than a lease's patience, so that a Redis that is
        /// gone is reported within a typical shutdown deadline.
        const PATIENCE: Duration = Duration::from_secs(3);
        let inner = Arc::clone(&self.inner);
        let place = inner.place(key, policy);
        let algorithm = policy.algorithm();
        let (key, policy) = (key.clone(), policy.clone());
        let (units, refund) = match settlement.owed {
            Owed::Charge(units) => (units, false),
            Owed::Refund(units) => (units, true),
            // Sent through `keep_slot` above.
            Owed::Release(..) | Owed::Renew(_) => return Box::pin(async { Ok(()) }),
        };
        let record = Record::Settle {
            refund,
            admitted: units.admitted_at().unwrap_or(-1),
            recorded: units.recorded(),
            headroom: lease::settling_headroom(&self.inner, &policy),
            drains: units.drains_from().unwrap_or(-1),
        };
        let (units, attempt) = (units.count(), units.attempt());
        Box::pin(async move {
            if units == 0 && attempt == 0 {
                return Ok(());
            }
            super::in_range(&policy)?;
            let lane = place.lane;
            if guarded && inner.breaker(lane).is_open() {
                return Err(StoreError::Unavailable);
            }
            let started = inner.breaker(lane).now();
            let known = inner.batcher.known();
            let args = wire::encode_for(&policy, &place, (units, attempt), record, -1, known);
            let call = inner
                .batcher
                .decide_patiently(place.clone(), algorithm, args, PATIENCE);
            let answer = match call.await {
                Err(error) if lease::refused(&error) || transport::ask::is_redirection(&error) => {
                    inner
                        .decide(place, &policy, (units, attempt), -1, record)
                        .await?
                }
                reply => inner.judge(lane, started, Some(reply))?,
            };
            lease::settled(&inner, &key, &policy, &answer);
            Ok(())
        })
    }
}

impl Sealed for RedisStore {}

impl Engine for RedisStore {
    /// A leased policy (never one with a penalty box or a concurrency limit) steps through
    /// its lease as `check` does; any other is decided in Redis with no box and no slot.
    fn step(&self, key: &Key, policy: &Policy, units: u32) -> <Self as Store>::Future {
        let plan = lease::plan(&self.inner, policy).filter(|_| !policy.attempts());
        if let Some(plan) = plan {
            let (inner, key, policy) = (Arc::clone(&self.inner), key.clone(), policy.clone());
            return Box::pin(lease::check(inner, plan, key, policy, units));
        }
        let headroom = lease::headroom(&self.inner, policy);
        self.run(key, policy, units, -1, Record::Step { headroom })
    }

    fn step_now(
        &self,
        key: &Key,
        policy: &Policy,
        units: u32,
    ) -> Option<Result<Decision, StoreError>> {
        if policy.attempts() {
            return None;
        }
        lease::check_now(&self.inner, key, policy, units)
    }

    fn check_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        if policy.attempts() {
            return None;
        }
        lease::check_now(&self.inner, key, policy, cost)
    }

    fn check_queued(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        waiter: &Waiter,
    ) -> <Self as Store>::Future {
        match policy.concurrency_limit() {
            Some(_) => self.take(key, policy, cost, Some(*waiter)),
            None => self.check(key, policy, cost),
        }
    }

    /// Sent as a decision's own give-back is (`slots.rs`): it waits while Redis is out of
    /// reach, and while it finds the waiter gone it is sent again, until what was left of the
    /// waiter's wait has passed, so that an ask that was still on its way when the waiter left
    /// (its answer lost) is undone once it lands.
    fn leave_queue(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        let op = SlotOp::Leave { id: waiter.id() };
        let until = u64::try_from(waiter.wait().as_micros()).unwrap_or(u64::MAX);
        let work = slots::SlotWork::new(key.clone(), policy.clone(), op, until, Box::new(drop));
        self.inner.send_slot_op(work.until_found(), false);
    }

    fn supports(&self, policy: &Policy) -> Result<(), StoreError> {
        super::in_range(policy)?;
        lease::supports(&self.inner, policy)
    }

    fn limits_version(&self) -> u64 {
        self.inner.limits.token()
    }

    fn run_time_overrides(&self) -> Option<crate::store::Overrides> {
        Some(self.overrides())
    }

    fn claims(&self) -> Option<Claims> {
        Some(self.inner.claims.clone())
    }

    /// A concurrency slot's give-back or renewal joins the next batched call of its key's lane,
    /// and `then` runs in the batching task that sent it (at once while the breaker is open):
    /// a give-back costs no task of its own. Charges and refunds run in a task, as by default.
    fn settle_then(&self, key: &Key, policy: &Policy, settlement: Settlement, then: OnSettled) {
        match slot_op(policy, &settlement, self.inner.timeout) {
            Some(op) => self.keep_slot(key, policy, op, then),
            None => super::engine::settle_in_task(self, key, policy, settlement, then),
        }
    }
}

impl RedisStore {
    /// Sends slot operation `op` with the next batched call of its key's lane, behind the
    /// breaker as a decision is; where the breaker is open or Redis does not answer, it waits
    /// and is sent again until Redis answers or the slot has expired there (`slots.rs`).
    fn keep_slot(&self, key: &Key, policy: &Policy, op: SlotOp, done: OnSettled) {
        let lifetime = slots::stored_micros(policy, self.inner.timeout);
        let work = slots::SlotWork::new(key.clone(), policy.clone(), op, lifetime, done);
        self.inner.send_slot_op(work, false);
    }
}

/// The slot operation `settlement` asks for under `policy`: a give-back (lifetime 0) or a
/// renewal for the slot's stored lifetime (`slots.rs`, within a time budget of `budget`);
/// `None` for a charge or a refund.
fn slot_op(policy: &Policy, settlement: &Settlement, budget: Duration) -> Option<SlotOp> {
    match settlement.owed {
        Owed::Release(id, held) => Some(SlotOp::Release {
            id: id.get(),
            held: u64::try_from(held.as_micros()).unwrap_or(u64::MAX),
        }),
        Owed::Renew(id) => Some(SlotOp::Renew {
            id: id.get(),
            lifetime: slots::stored_micros(policy, budget),
        }),
        Owed::Charge(_) | Owed::Refund(_) => None,
    }
}
