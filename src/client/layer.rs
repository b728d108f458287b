//! The layer and its builder.

use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::clock::Clock;
use super::pushback::{MAX_PAUSE, MAX_PAUSE_LIMIT};
use super::service::Outbound;
use super::shared::Shared;
use crate::key::Global;
use crate::store::reserve::Ticket;
use crate::store::reserve::{self, reservable, MAX_LATE};
use crate::{BuildError, MemoryStore, Policy, Store};

/// Makes every request of the wrapped service wait for its turn under one policy
/// ([`client`](super) has an example).
#[derive(Debug)]
pub struct OutboundLayer<K = Global, St = MemoryStore> {
    key: Arc<K>,
    shared: Arc<Shared<St>>,
}

impl<K, St> Clone for OutboundLayer<K, St> {
    fn clone(&self) -> Self {
        OutboundLayer {
            key: Arc::clone(&self.key),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl OutboundLayer {
    /// A builder: one key for every request ([`Global`]), a [`MemoryStore`] of this process,
    /// a `max_wait` of 30 s, a `margin` of 50 ms; set a policy.
    pub fn builder() -> OutboundLayerBuilder {
        OutboundLayerBuilder {
            key: Global,
            store: MemoryStore::new(),
            policy: None,
            max_wait: Duration::from_secs(30),
            margin: Duration::from_millis(50),
            max_margin: None,
            recheck: Duration::from_millis(100),
            clock: Clock::real(),
            max_pause: MAX_PAUSE,
        }
    }
}

impl<K, St> OutboundLayer<K, St> {
    /// Turns of the layer's store, policy and settings, for work that is not an HTTP call
    /// ([`Turns`](super::Turns)): they share the layer's line and wake-ups.
    pub fn turns(&self) -> super::Turns<St> {
        super::Turns::new(Arc::clone(&self.shared))
    }
}

impl<K, St, S> Layer<S> for OutboundLayer<K, St> {
    type Service = Outbound<S, K, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Outbound::new(inner, Arc::clone(&self.key), Arc::clone(&self.shared))
    }
}

/// Configures an [`OutboundLayer`].
#[derive(Debug)]
pub struct OutboundLayerBuilder<K = Global, St = MemoryStore> {
    key: K,
    store: St,
    policy: Option<Policy>,
    max_wait: Duration,
    margin: Duration,
    max_margin: Option<Duration>,
    recheck: Duration,
    clock: Clock,
    max_pause: Duration,
}

impl<K, St> OutboundLayerBuilder<K, St> {
    /// The limit the upstream sets (GCRA or the sliding log: they keep turns in order).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(policy);
        self
    }

    /// What a request's turn is counted by: one key for every request by default (the
    /// upstream's limit of this account), or any [`KeyExtractor`](crate::KeyExtractor).
    pub fn key<K2>(self, key: K2) -> OutboundLayerBuilder<K2, St> {
        OutboundLayerBuilder {
            key,
            store: self.store,
            policy: self.policy,
            max_wait: self.max_wait,
            margin: self.margin,
            max_margin: self.max_margin,
            recheck: self.recheck,
            clock: self.clock,
            max_pause: self.max_pause,
        }
    }

    /// The store that keeps the turns: a [`RedisStore`](crate::RedisStore) shared by every
    /// worker of a fleet, or the default memory store for one process.
    pub fn store<St2>(self, store: St2) -> OutboundLayerBuilder<K, St2> {
        OutboundLayerBuilder {
            key: self.key,
            store,
            policy: self.policy,
            max_wait: self.max_wait,
            margin: self.margin,
            max_margin: self.max_margin,
            recheck: self.recheck,
            clock: self.clock,
            max_pause: self.max_pause,
        }
    }

    /// The longest a request waits for its turn; past it, it fails at once with
    /// [`OutboundError::TooLate`](super::OutboundError::TooLate).
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }

    /// How much later than its turn a request may leave (default 50 ms), the upstream counting
    /// requests as they arrive: turns keep every window that much longer within the count, so
    /// that a request sent late, or one that took longer on the way than the one before it,
    /// is not counted in the next window. The price is a window that much longer. A request
    /// goes only when it knows it leaves within the margin of its turn, its clock bracketed by
    /// its round trip to the store: the margin must exceed that round trip (by half again),
    /// and is widened where it does not, up to [`max_margin`](Self::max_margin).
    pub fn margin(mut self, margin: Duration) -> Self {
        self.margin = margin;
        self
    }

    /// How often a request further than this from its turn looks where it stands in line
    /// (default 100 ms), to learn that it moved up (requests ahead of it on other instances
    /// stopped waiting) or that its key was paused by another instance. Requests of this
    /// layer learn what this layer's requests do at once. Each look is one call to the store.
    pub fn recheck(mut self, recheck: Duration) -> Self {
        self.recheck = recheck;
        self
    }

    /// The widest the layer may make its margin where the measured round trip to the store
    /// needs more than [`margin`](Self::margin) (one and a half round trips): by default four
    /// times the margin, where the policy leaves room for it on GCRA, else the margin. Past it
    /// requests fail at once with [`OutboundError::TooFar`](super::OutboundError::TooFar)
    /// rather than reserving turns they cannot keep. Checked at build as the margin is.
    pub fn max_margin(mut self, max_margin: Duration) -> Self {
        self.max_margin = Some(max_margin);
        self
    }

    /// A clock that runs at `rate` of tokio's (its `now` and its sleeps), for tests of a
    /// runtime whose clock runs slow or fast.
    #[cfg(feature = "test-util")]
    #[doc(hidden)]
    pub fn clock_rate(mut self, rate: f64) -> Self {
        self.clock = Clock::scaled(rate);
        self
    }

    /// The layer; fails without a policy, or with one that cannot keep turns (a counter, a
    /// penalty box, a concurrency limit) or that the store cannot decide.
    pub fn build(self) -> Result<OutboundLayer<K, St>, BuildError>
    where
        St: Store,
    {
        let policy = self.policy.ok_or(BuildError::NoPolicy)?;
        let unsupported = |error: crate::StoreError| BuildError::Unsupported {
            policy: policy.name().to_owned(),
            why: error.to_string(),
        };
        reservable(&policy).map_err(unsupported)?;
        self.store.supports(&policy).map_err(unsupported)?;
        let fits = |late: Duration| {
            let ticket = Ticket {
                late,
                ..Ticket::new(0, self.max_wait)
            };
            reserve::in_range(&policy, &ticket)
        };
        // By default, four times the margin where the policy leaves room for it.
        let max_margin = match self.max_margin {
            Some(max_margin) => max_margin,
            None if fits(self.margin * 4).is_ok() => self.margin * 4,
            None => self.margin,
        };
        let why = match (self.recheck, self.margin) {
            (recheck, _) if recheck.is_zero() => Some("its recheck must be longer than zero"),
            (_, margin) if max_margin < margin => {
                Some("its max_margin must be at least its margin")
            }
            (recheck, _) if recheck.saturating_add(max_margin) > MAX_LATE => {
                Some("its recheck and max_margin together are at most an hour")
            }
            _ => None,
        };
        if let Some(why) = why {
            return Err(BuildError::Unsupported {
                policy: policy.name().to_owned(),
                why: format!("an outbound layer: {why}"),
            });
        }
        if let Some(why) = pause_out_of_range(self.max_pause) {
            return Err(BuildError::Unsupported {
                policy: policy.name().to_owned(),
                why: format!("an outbound layer: {why}"),
            });
        }
        fits(self.margin).map_err(unsupported)?;
        fits(max_margin).map_err(unsupported)?;
        Ok(OutboundLayer {
            key: Arc::new(self.key),
            shared: Arc::new(
                Shared::new(
                    self.store,
                    policy,
                    self.max_wait,
                    (self.margin, max_margin, self.recheck),
                    self.clock,
                )
                .with_max_pause(self.max_pause),
            ),
        })
    }

    /// The longest an upstream's pushback pauses a key (default an hour, at most a day):
    /// a `429` or `503` with `Retry-After`, or a gRPC `RESOURCE_EXHAUSTED` with
    /// `grpc-retry-pushback-ms`, pauses the key for every instance that shares the store,
    /// for as long as it asks up to this. So a `Retry-After: 999999` stops the whole fleet's
    /// calls of the key for at most `max_pause`; an upstream whose daily quota resets at
    /// midnight may ask for hours. Zero is a build error: a pause is how the fleet stops
    /// sending to an upstream that refuses it (`docs/outbound.md`, "Upstream pushback").
    pub fn max_pause(mut self, max_pause: Duration) -> Self {
        self.max_pause = max_pause;
        self
    }
}

/// Why a `max_pause` is refused: zero, or longer than a day.
fn pause_out_of_range(max_pause: Duration) -> Option<&'static str> {
    match max_pause {
        pause if pause.is_zero() => Some("its max_pause must be longer than zero"),
        pause if pause > MAX_PAUSE_LIMIT => Some("its max_pause is at most a day"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(max_pause: Option<Duration>) -> Result<OutboundLayer, BuildError> {
        let builder = OutboundLayer::builder().policy("10/1s".parse().unwrap());
        match max_pause {
            Some(max_pause) => builder.max_pause(max_pause).build(),
            None => builder.build(),
        }
    }

    #[test]
    fn max_pause_is_an_hour_by_default_and_between_zero_and_a_day() {
        assert_eq!(built(None).unwrap().shared.max_pause, MAX_PAUSE);
        let five = Duration::from_secs(5);
        assert_eq!(built(Some(five)).unwrap().shared.max_pause, five);
        assert!(built(Some(MAX_PAUSE_LIMIT)).is_ok());
        for refused in [Duration::ZERO, MAX_PAUSE_LIMIT + Duration::from_millis(1)] {
            match built(Some(refused)) {
                Err(BuildError::Unsupported { why, .. }) => assert!(why.contains("max_pause")),
                other => panic!("{refused:?}: {other:?}"),
            }
        }
    }
}
