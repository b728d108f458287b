//! How the Redis store knows Redis is unreachable, and stops waiting for it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fred::error::{Error, ErrorKind};

/// A circuit breaker: after a failure that says Redis is unreachable or too slow, decisions
/// fail at once for `retry` instead of each waiting out the timeout; then the next decision
/// tries Redis again, and its success closes the breaker. A failure trips it only if no
/// decision succeeded while the failed one was under way: while connections come back one by
/// one, one slow connection must not cut off the others.
#[derive(Debug)]
pub(crate) struct Breaker {
    origin: Instant,
    /// Microseconds after `origin` until which Redis counts as down; 0 when up.
    down_until: AtomicU64,
    /// Microseconds after `origin` of the latest success.
    last_ok: AtomicU64,
    retry: Duration,
}

impl Breaker {
    pub(crate) fn new(retry: Duration) -> Self {
        Breaker {
            origin: Instant::now(),
            down_until: AtomicU64::new(0),
            last_ok: AtomicU64::new(0),
            retry,
        }
    }

    /// The time to pass to [`trip`](Self::trip) for a decision starting now.
    pub(crate) fn now(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    /// Whether decisions should skip Redis now.
    pub(crate) fn is_open(&self) -> bool {
        self.now() < self.down_until.load(Ordering::Relaxed)
    }

    /// Whether the last decision found Redis unreachable (and no later one reached it).
    pub(crate) fn is_down(&self) -> bool {
        self.down_until.load(Ordering::Relaxed) != 0
    }

    /// Records the failure of a decision that started at `started`.
    pub(crate) fn trip(&self, started: u64) {
        if self.last_ok.load(Ordering::Relaxed) > started {
            return;
        }
        let until = self.now() + self.retry.as_micros() as u64;
        self.down_until.store(until.max(1), Ordering::Relaxed);
    }

    /// Records a success.
    pub(crate) fn close(&self) {
        self.last_ok.fetch_max(self.now().max(1), Ordering::Relaxed);
        if self.down_until.load(Ordering::Relaxed) != 0 {
            self.down_until.store(0, Ordering::Relaxed);
        }
    }
}

/// Whether `error` means Redis could not be reached or did not answer in time, as opposed to
/// an answer that was an error (a wrong key type, a script error, refused credentials), or a
/// cluster that is moving a hash slot (`TRYAGAIN`, a redirection the store follows itself): a call
/// that still fails so within its budget times out, which does count.
pub(crate) fn is_outage(error: &Error) -> bool {
    if super::ask::is_redirection(error) || error.details().starts_with("TRYAGAIN") {
        return false;
    }
    matches!(
        error.kind(),
        ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Routing
            | ErrorKind::Cluster
    ) || error.details().starts_with("LOADING")
        || error.details().starts_with("MASTERDOWN")
        || error.details().starts_with("CLUSTERDOWN")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trips_for_a_while_then_lets_a_probe_through() {
        let breaker = Breaker::new(Duration::from_millis(30));
        assert!(!breaker.is_open() && !breaker.is_down());
        let started = breaker.now();
        breaker.trip(started);
        assert!(breaker.is_open() && breaker.is_down());
        std::thread::sleep(Duration::from_millis(60));
        assert!(!breaker.is_open(), "a probe may go");
        assert!(breaker.is_down(), "still down until a probe succeeds");
        breaker.close();
        assert!(!breaker.is_down());
        // A failure that overlapped a success does not trip it.
        breaker.trip(started);
        assert!(!breaker.is_down());
        assert!(is_outage(&Error::new(ErrorKind::IO, "refused")));
        assert!(!is_outage(&Error::new(ErrorKind::Unknown, "WRONGTYPE")));
        let moving = Error::new(ErrorKind::Cluster, "ASK 3999 127.0.0.1:7001");
        assert!(!is_outage(&moving), "a hash slot's move is not an outage");
        let moved = Error::new(ErrorKind::Cluster, "MOVED 3999 127.0.0.1:7001");
        assert!(!is_outage(&moved), "a hash slot's move is not an outage");
        assert!(is_outage(&Error::new(
            ErrorKind::Routing,
            "Max attempts reached."
        )));
    }
}
