//! The embedded store: state in this process, for one instance, development and tests.

use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use moka::sync::Cache;

use super::{Store, StoreError};
use crate::algorithm::{
    decide, fixed_window::FixedWindow, gcra::Gcra, sliding_log::SlidingLog,
    sliding_window::SlidingWindow, Algorithm, Outcome, Window,
};
use crate::{Decision, Key, Policy};

/// The time for [`MemoryStore`]: elapsed since the UNIX epoch.
///
/// Wall-clock based, so that event times ([`Store::check_at`]) and fixed windows (aligned to
/// the epoch) mean the same as in Redis. Must not go backwards. Inject one to test with virtual
/// time; see [`ManualClock`] and [`TokioClock`].
pub trait Clock: Send + Sync + 'static {
    /// The time elapsed since the UNIX epoch.
    fn now(&self) -> Duration;
}

/// The default clock: the system time when the clock is made, advanced by tokio's monotonic
/// `Instant`. It follows tokio's paused test clock (`#[tokio::test(start_paused = true)]`,
/// `tokio::time::advance`) when there is one, and never goes backwards.
#[derive(Debug, Clone)]
pub struct TokioClock {
    start: Duration,
    origin: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::starting_at(SystemTime::now())
    }
}

impl TokioClock {
    /// A clock that reads `start` now and advances with tokio's clock.
    pub fn starting_at(start: SystemTime) -> Self {
        TokioClock {
            start: since_epoch(start),
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.start + tokio::time::Instant::now().saturating_duration_since(self.origin)
    }
}

/// A clock that moves only when told to; clones share one time. Starts at the UNIX epoch.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::{Clock, ManualClock};
///
/// let clock = ManualClock::default();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now(), Duration::from_millis(1500));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start`.
    pub fn starting_at(start: SystemTime) -> Self {
        let clock = ManualClock::default();
        clock.advance(since_epoch(start));
        clock
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.micros.fetch_add(micros(by), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::SeqCst))
    }
}

fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default()
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u64::MAX as u128) as u64
}

/// Rate-limit state kept in this process.
///
/// Bounded: it holds at most [`max_keys`](MemoryStoreBuilder::max_keys) keys, and a key is
/// dropped once its policy's longest window has passed without a request, since its state
/// would be empty by then. When the bound is reached the least useful keys are evicted (moka's
/// TinyLFU policy), which forgets their history: size the bound above the number of clients
/// you expect within the longest window.
///
/// Runs the same algorithms as [`RedisStore`](crate::RedisStore), decided under one lock per
/// key. Clones share state.
#[derive(Clone)]
pub struct MemoryStore {
    entries: Cache<(Arc<str>, Key), Arc<Entry>>,
    clock: Arc<dyn Clock>,
}

struct Entry {
    state: Mutex<State>,
    /// How long the entry is worth keeping after a request (see `Algorithm::retention`).
    idle: Duration,
}

/// One key's state under the algorithm of its policy.
enum State {
    Log(SlidingLog),
    Sliding(SlidingWindow),
    Fixed(FixedWindow),
    Gcra(Gcra),
}

impl State {
    fn new(algorithm: Algorithm) -> State {
        match algorithm {
            Algorithm::SlidingLog => State::Log(SlidingLog::default()),
            Algorithm::SlidingWindow => State::Sliding(SlidingWindow::default()),
            Algorithm::FixedWindow => State::Fixed(FixedWindow::default()),
            Algorithm::Gcra => State::Gcra(Gcra::default()),
        }
    }

    fn algorithm(&self) -> Algorithm {
        match self {
            State::Log(_) => Algorithm::SlidingLog,
            State::Sliding(_) => Algorithm::SlidingWindow,
            State::Fixed(_) => Algorithm::FixedWindow,
            State::Gcra(_) => Algorithm::Gcra,
        }
    }

    fn decide(&mut self, t: u64, windows: &[Window], cost: u64, record: bool) -> Outcome {
        match self {
            State::Log(s) => decide(s, t, windows, cost, record),
            State::Sliding(s) => decide(s, t, windows, cost, record),
            State::Fixed(s) => decide(s, t, windows, cost, record),
            State::Gcra(s) => decide(s, t, windows, cost, record),
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.entries.entry_count())
            .finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// The number of keys a store holds at most unless told otherwise.
    pub const DEFAULT_MAX_KEYS: u64 = 100_000;

    /// A store with the default bound and clock.
    pub fn new() -> Self {
        MemoryStore::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_keys: Self::DEFAULT_MAX_KEYS,
            clock: None,
        }
    }

    /// The number of events (admitted units) a sliding log holds for `key` under `policy`.
    ///
    /// Meant for tests and diagnostics; 0 for other algorithms.
    pub fn events(&self, key: &Key, policy: &Policy) -> usize {
        let Some(entry) = self.entries.get(&(policy.shared_name(), key.clone())) else {
            return 0;
        };
        let state = entry.state.lock().unwrap_or_else(|p| p.into_inner());
        match &*state {
            State::Log(log) => log.len(),
            _ => 0,
        }
    }

    /// The number of keys held, after pending evictions have run.
    pub fn key_count(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.entry_count()
    }

    /// Decides at event time `at` (µs since the epoch; `None`: now).
    fn decide(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        at: Option<SystemTime>,
        record: bool,
    ) -> Ready<Result<Decision, StoreError>> {
        let algorithm = policy.algorithm();
        if at.is_some() && algorithm != Algorithm::SlidingLog {
            return ready(Err(StoreError::Unsupported(
                "event times need the sliding log algorithm",
            )));
        }
        let cache_key = (policy.shared_name(), key.clone());
        let fresh = || {
            Arc::new(Entry {
                state: Mutex::new(State::new(algorithm)),
                idle: algorithm.retention(policy.longest_window()),
            })
        };
        let entry = if record {
            self.entries.get_with(cache_key, fresh)
        } else {
            self.entries.get(&cache_key).unwrap_or_else(fresh)
        };
        let windows: Vec<Window> = Window::of(policy).collect();
        let now = micros(self.clock.now());
        let t = at.map_or(now, |at| micros(since_epoch(at)));
        // A poisoned lock only means another thread panicked mid-update; every state is
        // valid between two field writes, so keep using it.
        let mut state = entry.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.algorithm() != algorithm {
            *state = State::new(algorithm);
        }
        if let State::Log(log) = &mut *state {
            if let Some(cutoff) = now.min(t).checked_sub(micros(policy.longest_window())) {
                log.trim(cutoff);
            }
        }
        let outcome = state.decide(t, &windows, u64::from(cost), record);
        ready(Ok(Decision::from_outcome(outcome, policy)))
    }
}

/// Configures a [`MemoryStore`].
pub struct MemoryStoreBuilder {
    max_keys: u64,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    /// The most keys (client × policy) held at once; default
    /// [`MemoryStore::DEFAULT_MAX_KEYS`].
    pub fn max_keys(mut self, max_keys: u64) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The clock decisions are made with; default [`TokioClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let entries = Cache::builder()
            .max_capacity(self.max_keys)
            .expire_after(IdleFor)
            .build();
        MemoryStore {
            entries,
            clock: self
                .clock
                .unwrap_or_else(|| Arc::new(TokioClock::default())),
        }
    }
}

/// Expires an entry once its policy's longest window has passed since it was last used.
struct IdleFor;

impl moka::Expiry<(Arc<str>, Key), Arc<Entry>> for IdleFor {
    fn expire_after_create(
        &self,
        _: &(Arc<str>, Key),
        e: &Arc<Entry>,
        _: Instant,
    ) -> Option<Duration> {
        Some(e.idle)
    }

    fn expire_after_read(
        &self,
        _: &(Arc<str>, Key),
        e: &Arc<Entry>,
        _: Instant,
        _: Option<Duration>,
        _: Instant,
    ) -> Option<Duration> {
        Some(e.idle)
    }
}

impl Store for MemoryStore {
    type Future = Ready<Result<Decision, StoreError>>;
    type ResetFuture = Ready<Result<(), StoreError>>;

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, true)
    }

    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future {
        self.decide(key, policy, cost, Some(at), true)
    }

    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, false)
    }

    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture {
        self.entries
            .invalidate(&(policy.shared_name(), key.clone()));
        ready(Ok(()))
    }
}
