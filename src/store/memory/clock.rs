//! The memory store's clock: the time since the UNIX epoch, read from tokio's clock by default,
//! or from one that moves only when told to.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::model::micros;

/// The time for [`MemoryStore`](super::MemoryStore): elapsed since the UNIX epoch.
///
/// Wall-clock based, so that event times ([`Store::check_at`](crate::Store::check_at)) and fixed windows (aligned to
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
    pub(crate) fn starting_at(start: SystemTime) -> Self {
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

/// A clock that moves only when told to; clones share one time. Starts at the UNIX epoch
/// (`ManualClock::default()`), or at a given time (`ManualClock::from(start)`).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tower_redis_ratelimit::store::{Clock, ManualClock};
///
/// let clock = ManualClock::default();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now(), Duration::from_millis(1500));
///
/// let later = ManualClock::from(SystemTime::UNIX_EPOCH + Duration::from_secs(60));
/// assert_eq!(later.now(), Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

/// A clock that reads `start`.
impl From<SystemTime> for ManualClock {
    fn from(start: SystemTime) -> Self {
        let clock = ManualClock::default();
        clock.advance(since_epoch(start));
        clock
    }
}

impl ManualClock {
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

pub(crate) fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default()
}
