//! The limits version: what every instance reads to follow changes of overrides made through
//! other instances, and how old a reading may be before an instance stops deciding by what it
//! keeps locally.
//!
//! The version lives in Redis as a hash (`scripts/limits_version.lua`): an *epoch*, made when
//! the hash is, and a *version* that every change raises (Redis time in µs, never back). An
//! instance reads both every [`WATCH`]. When either differs from what it saw last, the layer's
//! deny cache drops the refusals decided before (`Store::limits_version`) and the leases held
//! are spent no more (`lease::limits_changed`). An epoch that is gone or replaced means the
//! overrides went with it (a restart without persistence, a flush): logged at ERROR and
//! counted (`ratelimit_overrides_lost_total`). Comparing the epoch too means a counter that
//! starts again after a restart is never taken for one already seen.
//!
//! An instance that cannot read the version for [`STALE`] (counted from the send of its last
//! read that was answered) cannot know whether a change was made meanwhile, so it stops
//! spending leases and repeating cached refusals until it reads again: every instance decides
//! by overrides at most [`STALE`] old, reachable or not.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};
use std::time::Duration;

use fred::clients::Client;
use fred::interfaces::HashesInterface;
use tokio::time::{Instant, MissedTickBehavior};

use super::super::Inner;
use crate::store::UNCONFIRMED_LIMITS as UNCONFIRMED;

/// The bound on following an override (`docs/promises.md`): a decision, a lease's spend or a
/// cached refusal that starts this long or more after an override call returned goes by it,
/// on every instance, reachable or not. Each path meets it on its own: Redis's plain tier by
/// a confirmation of the overrides no older than this (`known.rs`, `plain_ok`), leases and
/// the deny cache by a reading of the limits version no older than this ([`STALE`]).
pub(in crate::store::redis) const FOLLOW: Duration = Duration::from_millis(250);

/// How often a store reads the limits version: twice per [`FOLLOW`], so that a healthy
/// instance whose one read fails or is slow still has an answered read within [`STALE`].
pub(in crate::store::redis) const WATCH: Duration =
    Duration::from_millis(FOLLOW.as_millis() as u64 / 2);

/// How old an instance's last answered read of the version may be (from its send) before it
/// stops deciding by what it keeps locally: [`FOLLOW`], the bound itself.
pub(in crate::store::redis) const STALE: Duration = FOLLOW;

/// The key of the limits version of the stores using `prefix`.
pub(super) fn limits_key(prefix: &str) -> String {
    format!("{prefix}:{{overrides}}:limits")
}

/// A reading of the limits version: its epoch (`None` where the hash does not exist) and
/// version.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(in crate::store::redis) struct Reading {
    pub(super) epoch: Option<String>,
    pub(super) version: u64,
}

/// What one instance knows of the limits version.
pub(in crate::store::redis) struct Limits {
    /// The last reading, which changes are compared with, and when (µs since `origin`) it
    /// was answered.
    last: Mutex<(Reading, u64)>,
    /// A hash of the last reading, never [`UNCONFIRMED`].
    token: AtomicU64,
    /// Times are ms since this instant, on tokio's clock (paused time in tests).
    origin: Instant,
    /// When the last answered read (or write) was sent.
    confirmed: AtomicU64,
}

/// How a reading differs from the one before.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::store::redis) enum Change {
    Same,
    Changed,
    /// Changed, and the epoch seen before is gone: the overrides were lost.
    Lost,
}

impl Limits {
    /// Knows nothing yet, and counts as confirmed now: a store starts with no lease and no
    /// cached refusal, and reads at once.
    pub(in crate::store::redis) fn new() -> Limits {
        Limits {
            last: Mutex::new((
                Reading {
                    epoch: None,
                    version: 0,
                },
                0,
            )),
            token: AtomicU64::new(0),
            origin: Instant::now(),
            confirmed: AtomicU64::new(0),
        }
    }

    /// Records `reading`, read by a call sent at `sent` and answered now; how it differs from
    /// the last one. A call sent before the last reading was answered may have run before it
    /// in Redis (on another connection of the pool: a watch read beside this instance's own
    /// write): what it shows other than that reading may be older, so it changes nothing and
    /// confirms nothing; the next read, sent after, tells.
    pub(in crate::store::redis) fn seen(&self, reading: Reading, sent: Instant) -> Change {
        let since = sent.saturating_duration_since(self.origin);
        let sent_us = since.as_micros() as u64;
        let mut guard = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let (last, answered) = &mut *guard;
        if *last != reading && sent_us < *answered {
            return Change::Same;
        }
        self.confirmed
            .fetch_max(since.as_millis() as u64, Ordering::AcqRel);
        if *last == reading {
            return Change::Same;
        }
        *answered = self.origin.elapsed().as_micros() as u64;
        let lost = last.epoch.is_some() && last.epoch != reading.epoch;
        let mut hasher = DefaultHasher::new();
        reading.hash(&mut hasher);
        // Never UNCONFIRMED, and never 0 (nothing seen) for a reading of something.
        let token = (hasher.finish() >> 1).max(1);
        *last = reading;
        self.token.store(token, Ordering::Release);
        match lost {
            true => Change::Lost,
            false => Change::Changed,
        }
    }

    /// Whether the last answered read was sent within [`STALE`].
    pub(in crate::store::redis) fn is_current(&self) -> bool {
        let confirmed = Duration::from_millis(self.confirmed.load(Ordering::Acquire));
        self.origin.elapsed() <= confirmed + STALE
    }

    /// The version as the deny cache compares it: a hash of the last reading, or
    /// [`UNCONFIRMED`] while it is older than [`STALE`].
    pub(in crate::store::redis) fn token(&self) -> u64 {
        match self.is_current() {
            true => self.token.load(Ordering::Acquire),
            false => UNCONFIRMED,
        }
    }
}

/// Reads the limits version at once and then every [`WATCH`] (from each read's start) until
/// the store is dropped.
pub(in crate::store::redis) fn spawn_watch(inner: Weak<Inner>) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(WATCH);
        every.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let sent = Instant::now();
            if let Ok(Ok(reading)) = tokio::time::timeout(inner.timeout, read(&inner)).await {
                inner.limits_seen(reading, sent);
            }
        }
    });
}

/// Reads the limits version.
async fn read(inner: &Inner) -> Result<Reading, fred::error::Error> {
    let key = limits_key(&inner.prefix);
    let get = |client: Client| {
        let key = key.clone();
        async move {
            let (epoch, version): (Option<String>, Option<u64>) =
                client.hmget(key, vec!["epoch", "version"]).await?;
            Ok(Reading {
                epoch,
                version: version.unwrap_or(0),
            })
        }
    };
    inner.batcher.on(&key, get).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(epoch: Option<&str>, version: u64) -> Reading {
        Reading {
            epoch: epoch.map(str::to_owned),
            version,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_counter_that_starts_again_under_a_new_epoch_is_a_change() {
        let limits = Limits::new();
        let now = Instant::now();
        assert_eq!(limits.seen(reading(Some("1.5"), 7), now), Change::Changed);
        let before = limits.token();
        assert_eq!(limits.seen(reading(Some("1.5"), 7), now), Change::Same);
        // A restart without persistence: the hash is gone, then a change makes a new epoch
        // and the counter happens to come back to the value seen before.
        assert_eq!(limits.seen(reading(None, 0), now), Change::Lost);
        assert_eq!(limits.seen(reading(Some("9.1"), 7), now), Change::Changed);
        assert_ne!(limits.token(), before);
        assert_eq!(limits.seen(reading(Some("4.4"), 8), now), Change::Lost);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reading_sent_before_the_last_one_was_answered_changes_nothing() {
        let limits = Limits::new();
        let at = |us: u64| limits.origin + Duration::from_micros(us);
        // This instance's own first write, sent at 20 µs, made the epoch; answered at 40 µs.
        tokio::time::advance(Duration::from_micros(40)).await;
        assert_eq!(
            limits.seen(reading(Some("1.5"), 7), at(20)),
            Change::Changed
        );
        let token = limits.token();
        // Watch reads sent before that answer (at 10 µs, and at 30 µs on another connection)
        // that ran before the write: not a loss, and not a change back.
        assert_eq!(limits.seen(reading(None, 0), at(10)), Change::Same);
        assert_eq!(limits.seen(reading(None, 0), at(30)), Change::Same);
        assert_eq!(limits.token(), token);
        // One sent after it: the hash is gone.
        tokio::time::advance(Duration::from_micros(20)).await;
        assert_eq!(limits.seen(reading(None, 0), at(50)), Change::Lost);
    }

    #[test]
    fn leases_cached_refusals_and_plain_decisions_follow_within_one_bound() {
        // The promise (`docs/promises.md`), one figure for every path.
        assert_eq!(FOLLOW, Duration::from_millis(250));
        assert_eq!(STALE, FOLLOW);
        // Two reads per bound: one read that fails does not stop a healthy instance.
        assert_eq!(WATCH * 2, FOLLOW);
    }

    #[tokio::test(start_paused = true)]
    async fn a_version_unread_for_longer_than_stale_is_unconfirmed() {
        let limits = Limits::new();
        limits.seen(reading(Some("1.5"), 7), Instant::now());
        let token = limits.token();
        assert_ne!(token, UNCONFIRMED);
        tokio::time::advance(STALE).await;
        assert!(limits.is_current());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!limits.is_current());
        assert_eq!(limits.token(), UNCONFIRMED);
        // A read sent before the last one answered confirms nothing newer.
        limits.seen(reading(Some("1.5"), 7), limits.origin);
        assert_eq!(limits.token(), UNCONFIRMED);
        limits.seen(reading(Some("1.5"), 7), Instant::now());
        assert_eq!(limits.token(), token);
    }
}
