//! The embedded store: state in this process, for one instance, development and tests.

use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moka::sync::Cache;

use super::{Store, StoreError};
use crate::algorithm::sliding_log::SlidingLog;
use crate::algorithm::{Algorithm, Window};
use crate::{Decision, Key, Policy};

/// A monotonic clock for [`MemoryStore`], in time elapsed since an arbitrary origin.
///
/// Inject one to test with virtual time; see [`ManualClock`] and [`TokioClock`].
pub trait Clock: Send + Sync + 'static {
    /// The time elapsed since this clock's origin. Must never decrease.
    fn now(&self) -> Duration;
}

/// The default clock: tokio's `Instant`, which follows tokio's paused test clock
/// (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) when there is one.
#[derive(Debug, Clone)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        tokio::time::Instant::now().saturating_duration_since(self.origin)
    }
}

/// A clock that moves only when told to; clones share one time.
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
    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = by.as_micros().min(u64::MAX as u128) as u64;
        self.micros.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::SeqCst))
    }
}

/// Rate-limit state kept in this process.
///
/// Bounded: it holds at most [`max_keys`](MemoryStoreBuilder::max_keys) keys, and a key is
/// dropped once its policy's longest window has passed without a request, since its log would
/// be empty by then. When the bound is reached the least useful keys are evicted (moka's
/// TinyLFU policy), which forgets their history: size the bound above the number of clients
/// you expect within the longest window.
///
/// Clones share state.
#[derive(Clone)]
pub struct MemoryStore {
    entries: Cache<(Arc<str>, Key), Arc<Entry>>,
    clock: Arc<dyn Clock>,
}

struct Entry {
    log: Mutex<SlidingLog>,
    /// The policy's longest window: how long the entry is worth keeping after a request.
    idle: Duration,
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
    pub const DEFAULT_MAX_KEYS: u64 = 1_000_000;

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

    /// The number of events (admitted units) held for `key` under `policy`.
    ///
    /// Meant for tests and diagnostics.
    pub fn events(&self, key: &Key, policy: &Policy) -> usize {
        self.entries
            .get(&(policy.shared_name(), key.clone()))
            .map_or(0, |e| e.log.lock().map_or(0, |l| l.len()))
    }

    /// The number of keys held, after pending evictions have run.
    pub fn key_count(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.entry_count()
    }

    fn now_micros(&self) -> u64 {
        self.clock.now().as_micros().min(u64::MAX as u128) as u64
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

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        let entry = self
            .entries
            .get_with((policy.shared_name(), key.clone()), || {
                Arc::new(Entry {
                    log: Mutex::new(SlidingLog::default()),
                    idle: policy.longest_window(),
                })
            });
        let windows: Vec<Window> = Window::of(policy).collect();
        let now = self.now_micros();
        // A poisoned lock only means another thread panicked mid-update; the log is still a
        // sorted list of times, so keep using it.
        let mut log = entry.log.lock().unwrap_or_else(|p| p.into_inner());
        let outcome = match policy.algorithm() {
            Algorithm::SlidingLog => log.check(now, &windows, u64::from(cost)),
        };
        ready(Ok(Decision::from_outcome(outcome, policy)))
    }
}
