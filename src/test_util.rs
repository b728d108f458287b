//! Support for testing code that uses this crate, and for the crate's own tests, benchmarks
//! and load tools (feature `test-util`). Not part of the stable API: what is here follows the
//! engine, and may change in any release.
//!
//! - [`FaultyStore`] wraps a store so that its decisions fail on demand, or so that it answers
//!   as a store in another process would (the layer then keeps its deny cache on and decides
//!   from its response future, as with Redis).
//! - Functions that read what the API does not show: a decision's limit index, slot and turn,
//!   when it was recorded; a memory store's events, slots and keys; a Redis key.
//! - [`Engine`] and [`Reserve`] name the hooks that the layer, its ledger and the outbound
//!   client use ([`Store`] is sealed: they are its supertraits), so that a test can look at
//!   them: whether a decision needs no waiting ([`Engine::check_now`], a leased one on
//!   Redis), the version of the limits in force, a reservation's turn.
//!
//! ```
//! use tower_redis_ratelimit::test_util::FaultyStore;
//! use tower_redis_ratelimit::{Key, MemoryStore, Policy, Store, StoreError};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = FaultyStore::new(MemoryStore::new());
//! let (key, policy) = (Key::from("ann"), "5/1m".parse::<Policy>().unwrap());
//! assert!(store.check(&key, &policy, 1).await.unwrap().is_allowed());
//! store.fail(true);
//! let failed = store.check(&key, &policy, 1).await;
//! assert!(matches!(failed, Err(StoreError::Unavailable)));
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, oneshot};

use crate::model::slots::Waiter;
use crate::store::engine::Sealed;
pub use crate::store::engine::{Engine, OnSettled};
pub use crate::store::reserve::{InLine, Reserve, Ticket, MAX_ID, MAX_LATE};
use crate::store::Overrides;
use crate::{Decision, Key, MemoryStore, Policy, Settlement, Store, StoreError};

/// A store that fails while told to, or that answers as a store in another process would.
///
/// While [`fail`](Self::fail)ed, every decision (a check, a check at an event time, a peek,
/// a waiter's ask, a reservation) fails with [`StoreError::Unavailable`]; settlements, resets
/// and a line's looks, leaves and pauses still reach the store, as they would once a real
/// store is back (the layer sends them again until it is). Clones share the switch.
#[derive(Clone)]
pub struct FaultyStore<St> {
    store: St,
    down: Arc<AtomicBool>,
    /// The task that decides for a [`remote`](Self::remote) store, started at its first
    /// decision; `None` for a store that answers in place.
    remote: Option<Arc<OnceLock<Option<Worker<St>>>>>,
}

/// A question for a remote store's task, which asks the store and sends the answer back.
type Job<St> = Box<dyn FnOnce(&St) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Where a remote store's questions go.
type Worker<St> = mpsc::UnboundedSender<Job<St>>;

impl<St> std::fmt::Debug for FaultyStore<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyStore")
            .field("down", &self.down.load(Ordering::SeqCst))
            .field("remote", &self.remote.is_some())
            .finish_non_exhaustive()
    }
}

/// The future of a [`FaultyStore`]'s decision or settlement.
pub type FaultyFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

impl<St: Store> FaultyStore<St> {
    /// `store`, answering as it does until told to fail.
    pub fn new(store: St) -> Self {
        FaultyStore {
            store,
            down: Arc::default(),
            remote: None,
        }
    }

    /// The same store, answering as a store in another process would: its decisions are made
    /// in a task of its own (a message goes each way, and the request waits for the answer),
    /// never in place, and it is not local, so that a layer keeps its deny cache on by
    /// default. The task starts with the first decision made in a tokio runtime; outside one,
    /// decisions are made in place.
    pub fn remote(self) -> Self {
        FaultyStore {
            remote: Some(Arc::default()),
            ..self
        }
    }

    /// Makes every decision fail (`true`) or reach the store again (`false`).
    pub fn fail(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Whether its decisions fail now ([`fail`](Self::fail)).
    pub fn is_failing(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// The store it wraps.
    pub fn inner(&self) -> &St {
        &self.store
    }

    /// A decision made in place by `ask`, as the wrapped store would make it: none where it
    /// answers from a worker (`remote`), a failure in place where a local store is down.
    fn decide_now<F>(&self, ask: F) -> Option<Result<Decision, StoreError>>
    where
        F: FnOnce(&St) -> Option<Result<Decision, StoreError>>,
    {
        if self.remote.is_some() {
            return None;
        }
        match self.down.load(Ordering::SeqCst) {
            true => self
                .store
                .is_local()
                .then_some(Err(StoreError::Unavailable)),
            false => ask(&self.store),
        }
    }

    /// The decision `ask` makes of the store: a failure while told to fail, else asked in
    /// place or of the remote store's task.
    fn decide<F>(&self, ask: F) -> FaultyFuture<Decision>
    where
        F: FnOnce(&St) -> St::Future + Send + 'static,
    {
        if self.down.load(Ordering::SeqCst) {
            return Box::pin(std::future::ready(Err(StoreError::Unavailable)));
        }
        let Some(worker) = self.worker() else {
            return Box::pin(ask(&self.store));
        };
        let (answer, answered) = oneshot::channel();
        let job: Job<St> = Box::new(move |store| {
            let decision = ask(store);
            Box::pin(async move {
                let _ = answer.send(decision.await);
            })
        });
        let asked = worker.send(job).is_ok();
        Box::pin(async move {
            match asked {
                true => answered.await.unwrap_or(Err(StoreError::Unavailable)),
                false => Err(StoreError::Unavailable),
            }
        })
    }

    /// A remote store's task, started now if it is not yet; `None` for a store that answers
    /// in place, or outside a tokio runtime.
    fn worker(&self) -> Option<&Worker<St>> {
        let cell = self.remote.as_ref()?;
        let store = self.store.clone();
        let started = cell.get_or_init(move || {
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            let (queue, mut jobs) = mpsc::unbounded_channel::<Job<St>>();
            runtime.spawn(async move {
                while let Some(job) = jobs.recv().await {
                    job(&store).await;
                }
            });
            Some(queue)
        });
        started.as_ref()
    }
}

impl<St: Store> Store for FaultyStore<St> {
    type Future = FaultyFuture<Decision>;
    type ResetFuture = FaultyFuture<()>;

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        let (key, policy) = (key.clone(), policy.clone());
        self.decide(move |store| store.check(&key, &policy, cost))
    }

    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future {
        let (key, policy) = (key.clone(), policy.clone());
        self.decide(move |store| store.check_at(&key, &policy, cost, at))
    }

    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        let (key, policy) = (key.clone(), policy.clone());
        self.decide(move |store| store.peek(&key, &policy, cost))
    }

    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture {
        Box::pin(self.store.reset(key, policy))
    }

    fn settle(&self, key: &Key, policy: &Policy, settlement: Settlement) -> Self::ResetFuture {
        Box::pin(self.store.settle(key, policy, settlement))
    }
}

impl<St: Store> Sealed for FaultyStore<St> {}

impl<St: Store> Engine for FaultyStore<St> {
    fn step(&self, key: &Key, policy: &Policy, units: u32) -> <Self as Store>::Future {
        let (key, policy) = (key.clone(), policy.clone());
        self.decide(move |store| store.step(&key, &policy, units))
    }

    fn step_now(
        &self,
        key: &Key,
        policy: &Policy,
        units: u32,
    ) -> Option<Result<Decision, StoreError>> {
        self.decide_now(|store| store.step_now(key, policy, units))
    }

    fn check_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        self.decide_now(|store| store.check_now(key, policy, cost))
    }

    fn settle_now(
        &self,
        key: &Key,
        policy: &Policy,
        settlement: Settlement,
    ) -> Option<Result<(), StoreError>> {
        match self.remote {
            Some(_) => None,
            None => self.store.settle_now(key, policy, settlement),
        }
    }

    fn check_queued(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        waiter: &Waiter,
    ) -> <Self as Store>::Future {
        let (key, policy, waiter) = (key.clone(), policy.clone(), *waiter);
        self.decide(move |store| store.check_queued(&key, &policy, cost, &waiter))
    }

    fn leave_queue(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        self.store.leave_queue(key, policy, waiter);
    }

    fn supports(&self, policy: &Policy) -> Result<(), StoreError> {
        self.store.supports(policy)
    }

    fn limits_version(&self) -> u64 {
        self.store.limits_version()
    }

    fn run_time_overrides(&self) -> Option<Overrides> {
        self.store.run_time_overrides()
    }

    fn is_local(&self) -> bool {
        self.remote.is_none() && self.store.is_local()
    }

    fn claims(&self) -> Option<crate::store::claims::Claims> {
        self.store.claims()
    }
}

impl<St: Store> Reserve for FaultyStore<St> {
    type LineFuture = FaultyFuture<InLine>;
    type LinesFuture = FaultyFuture<Vec<InLine>>;

    fn reserve(&self, key: &Key, policy: &Policy, ticket: Ticket) -> <Self as Store>::Future {
        let (key, policy) = (key.clone(), policy.clone());
        self.decide(move |store| store.reserve(&key, &policy, ticket))
    }

    fn look(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        Box::pin(self.store.look(key, policy, ticket))
    }

    fn look_many(&self, key: &Key, policy: &Policy, tickets: Vec<Ticket>) -> Self::LinesFuture {
        Box::pin(self.store.look_many(key, policy, tickets))
    }

    fn leave(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        Box::pin(self.store.leave(key, policy, ticket))
    }

    fn pause(&self, key: &Key, policy: &Policy, pause: Duration) -> Self::LineFuture {
        Box::pin(self.store.pause(key, policy, pause))
    }
}

/// When the store recorded the request that got `decision`, on its own clock (the memory
/// store's [`Clock`](crate::store::Clock), Redis `TIME`); `None` when it recorded nothing, or
/// the time is not known. A reservation is recorded at its turn.
pub fn recorded_at(decision: &Decision) -> Option<SystemTime> {
    let micros = u64::try_from(decision.admitted_at?).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_micros(micros))
}

/// The index, in [`Policy::limits`], of the limit `decision` describes (one past the last for
/// a concurrency refusal).
pub fn limit_index(decision: &Decision) -> usize {
    decision.limit_index()
}

/// Whether the request that got `decision` took a concurrency slot.
pub fn holds_slot(decision: &Decision) -> bool {
    decision.holds_slot()
}

/// How long a reservation ([`Reserve::reserve`]) waits for its turn, rounded up to a
/// millisecond; zero for a decision.
pub fn turn(decision: &Decision) -> Duration {
    decision.turn()
}

/// The memory store's default clock ([`TokioClock`](crate::store::TokioClock)), reading
/// `start` now: with tokio's clock paused, a test decides event times and windows from a
/// chosen wall-clock time.
pub fn tokio_clock_at(start: SystemTime) -> crate::store::TokioClock {
    crate::store::TokioClock::starting_at(start)
}

/// A body field as a [`BodyFieldLayer`](crate::BodyFieldLayer) would have put it in a
/// request's extensions, to test a handler that reads one.
pub fn body_field(name: &str, value: impl Into<String>) -> crate::BodyField {
    crate::BodyField::new(name, value)
}

/// What `policy`'s state is kept under: its identity (`Policy`, "Identity"), e.g.
/// `api:gcra:1m+1d`.
pub fn identity(policy: &Policy) -> &str {
    policy.identity()
}

/// `policy` decided against other counts for its windows, its state (and identity) kept: what
/// an override does in the store.
pub fn with_limits(
    policy: &Policy,
    limits: impl IntoIterator<Item = crate::Limit>,
) -> Result<Policy, crate::PolicyError> {
    policy.with_limits(limits)
}

/// `policy` for the requests of plan `plan`, as a layer makes it for a rule's plan: its
/// decisions also go by the store's overrides for that plan.
pub fn on_plan(policy: Policy, plan: &str) -> Policy {
    policy.on_plan(plan)
}

/// A policy's penalty box, concurrency limit and slot lifetime, as its builder methods set
/// them.
pub fn box_and_slots(policy: &Policy) -> (Option<Duration>, Option<u32>, Duration) {
    (
        policy.block(),
        policy.concurrency_limit(),
        policy.slot_lifetime(),
    )
}

/// The key as logs show it (its `Debug`, without the `Key(..)` around it).
pub fn loggable(key: &Key) -> String {
    key.loggable().into_owned()
}

/// The units `settlement` adds or takes back (0 for a slot's release or renewal), and whether
/// it takes them back.
pub fn units(settlement: &Settlement) -> (u64, bool) {
    (settlement.units(), settlement.is_refund())
}

/// Renews the concurrency slot the request that got `decision` took, for another slot
/// lifetime from now, as a layer does while the request runs; `None` when it took none.
pub fn renew(decision: &Decision) -> Option<Settlement> {
    Settlement::renew(decision)
}

/// Releases the concurrency slot the request that got `decision` took, after it held it for
/// `held`, which the store counts towards the key's typical hold time.
pub fn release_after(decision: &Decision, held: Duration) -> Option<Settlement> {
    Settlement::release_after(decision, held)
}

/// The events (admitted requests, one each whatever its cost) a memory store's sliding log
/// holds for `key` under `policy` that are younger than twice its longest window (what event
/// times up to a window back read); 0 for other
/// algorithms and expired keys.
pub fn events(store: &MemoryStore, key: &Key, policy: &Policy) -> usize {
    store.events(key, policy)
}

/// The concurrency slots that `key` holds under `policy` in a memory store now.
pub fn slots_in_use(store: &MemoryStore, key: &Key, policy: &Policy) -> usize {
    store.slots_in_use(key, policy)
}

/// The keys a memory store holds, once expired ones are dropped.
pub fn key_count(store: &MemoryStore) -> u64 {
    store.key_count()
}

/// How many requests a [`UniqueClients`](crate::unique::UniqueClients) recorder left
/// uncounted because its queue was full (Redis unreachable or too slow).
#[cfg(feature = "redis")]
pub fn dropped(unique: &crate::unique::UniqueClients) -> u64 {
    unique.dropped()
}

/// What this instance's `blocklist` has answered so far: the keys screened, those its local
/// filter could not clear (each one a `SISMEMBER`), and those found blocked.
#[cfg(feature = "redis")]
pub fn blocklist_stats(
    blocklist: &crate::blocklist::Blocklist,
) -> crate::blocklist::BlocklistStats {
    blocklist.stats()
}

/// Waits until every request `unique` queued before the call has been sent to Redis; `true` if
/// every write since the previous flush succeeded.
#[cfg(feature = "redis")]
pub async fn flush(unique: &crate::unique::UniqueClients) -> bool {
    unique.flush().await
}

/// The store's fred connection pool (on a Redis Cluster, fred's cluster client, which the
/// scripts do not use: they run on the store's own connections to each primary).
#[cfg(feature = "redis")]
pub fn pool(store: &crate::RedisStore) -> &fred::clients::Pool {
    store.pool()
}

/// The Redis key holding the state of `key` under `policy`.
#[cfg(feature = "redis")]
pub fn redis_key(store: &crate::RedisStore, key: &Key, policy: &Policy) -> String {
    store.redis_key(key, policy)
}

/// What a plain call carries (`scripts/plain.lua`, `ARGV[1]`) of one request's arguments as the
/// full scripts read them (`scripts/prelude.lua`, `ARGV[1]`), in a call confirmed at generation
/// `confirmed`: a request the plain tier must not decide is sent to be answered `FULL_PATH`.
#[cfg(feature = "redis")]
pub fn plain_args(full: &[u8], confirmed: i64) -> Vec<u8> {
    crate::store::redis::plain_args(full, confirmed)
}

/// How many keys hold an entry in the store's lease book: the keys that lease (a cold key has
/// none).
#[cfg(feature = "redis")]
pub fn leasing_keys(store: &crate::RedisStore) -> u64 {
    store.leasing_keys()
}
