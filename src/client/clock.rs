//! The instance's clock as the layer reads it, and what the layer learns of the store's
//! distance from its calls: the round trip and the rate between the two clocks (never an
//! offset to the store's time: the scripts answer durations from the store's now, and a call
//! brackets each answer by its own send and receive instants).

use std::convert::Infallible;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use super::OutboundError;

/// The instance's clock: tokio's, or (for tests) one that runs at a rate of its own.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clock {
    /// Its seconds per real second (1: tokio's clock).
    rate: f64,
    origin: Instant,
}

impl Clock {
    /// Tokio's clock.
    pub(super) fn real() -> Clock {
        Clock {
            rate: 1.0,
            origin: Instant::now(),
        }
    }

    /// A clock whose `now` and sleeps run at `rate` of tokio's (0.5: half as fast).
    #[cfg(feature = "test-util")]
    pub(super) fn scaled(rate: f64) -> Clock {
        Clock {
            rate,
            origin: Instant::now(),
        }
    }

    pub(super) fn now(&self) -> Instant {
        let now = Instant::now();
        match self.rate == 1.0 {
            true => now,
            false => self.origin + (now - self.origin).mul_f64(self.rate),
        }
    }

    /// Sleeps until `at` on this clock.
    pub(super) fn sleep_until(&self, at: Instant) -> Sleep {
        match self.rate == 1.0 {
            true => tokio::time::sleep_until(at),
            false => {
                let after = at.saturating_duration_since(self.origin);
                tokio::time::sleep_until(self.origin + after.div_f64(self.rate))
            }
        }
    }
}

/// How far the store is, as the layer's calls measured it: the round trip, the rate of the
/// instance's clock to the store's, and the margin the layer uses (the configured one, widened
/// where the round trip needs more, up to `max_margin`).
#[derive(Debug)]
pub(super) struct Reach {
    /// The policy's name, for the metrics.
    policy: String,
    margin: Duration,
    max_margin: Duration,
    learned: Mutex<Learned>,
}

#[derive(Debug, Clone, Copy)]
struct Learned {
    /// The round trip of looks (a moving average: one look held up behind a burst of
    /// reservations moves it little).
    round_trip: Option<Duration>,
    /// The longest of the latest round trips, decaying by an eighth of the gap to each new
    /// one: the margin covers it.
    longest: Duration,
    /// The margin last said (through `tracing`).
    said: Duration,
    /// The shortest round trip of the last [`DISTANCE`] or so, and when it was measured: how
    /// far the store is when nothing queues in front of a call (a stall or a load makes the
    /// others longer, not this one).
    shortest: Option<(Duration, Instant)>,
    /// The instance's seconds per store second: the median of the latest samples (a sample
    /// from a turn the line moved up in between says the instance's clock ran slower than it
    /// did; the median leaves such samples out while they are fewer than half).
    rate: f64,
    /// The latest samples of the rate, and where the next one goes.
    samples: [f64; RATE_SAMPLES],
    next: usize,
    /// The margin in use.
    margin: Duration,
}

/// How long the shortest round trip stands for the store's distance before a longer one
/// replaces it.
const DISTANCE: Duration = Duration::from_secs(30);

/// How many samples of the rate the median is taken of.
const RATE_SAMPLES: usize = 9;

/// How closely the rate between the instance's clock and the store's is known over a call's
/// last steps (those after its look at the turn, at most a margin and a round trip long).
pub(super) const RATE_TOLERANCE: f64 = 0.02;

/// How much margin looks need whose round trips reach `longest` of late: a look at the turn
/// answers from some instant of its round trip, so a call goes only where its round trip
/// fits its margin; a tenth more covers the next look's variation.
pub(super) fn needed(longest: Duration) -> Duration {
    longest.mul_f64(1.1)
}

impl Reach {
    pub(super) fn new(policy: &str, margin: Duration, max_margin: Duration) -> Reach {
        Reach {
            policy: policy.to_owned(),
            margin,
            max_margin,
            learned: Mutex::new(Learned {
                round_trip: None,
                longest: Duration::ZERO,
                said: margin,
                shortest: None,
                rate: 1.0,
                samples: [0.0; RATE_SAMPLES],
                next: 0,
                margin,
            }),
        }
    }

    fn learned(&self) -> Learned {
        *self.learned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The margin in use: the configured one, or wider where the round trip needs it.
    pub(super) fn margin(&self) -> Duration {
        self.learned().margin
    }

    /// The round trip, as measured (zero before any).
    pub(super) fn round_trip(&self) -> Duration {
        self.learned().round_trip.unwrap_or_default()
    }

    /// Whether the rate was measured (until then it is taken as 1).
    pub(super) fn rate_known(&self) -> bool {
        self.learned().next > 0
    }

    /// The instance's seconds per store second.
    pub(super) fn rate(&self) -> f64 {
        self.learned().rate
    }

    /// How far the store is, where no margin up to `max_margin` covers it (with a quarter to
    /// spare for its variation): the shortest round trip of the last [`DISTANCE`], so that a
    /// stall, a restart or a load that makes the round trips long for a while fails no call
    /// (they reserve again, up to their `max_wait`), while a store really that far fails them
    /// at once rather than have them reserve turns they cannot keep.
    pub(super) fn too_far(&self) -> Option<OutboundError<Infallible>> {
        let (shortest, _) = self.learned().shortest?;
        (shortest.mul_f64(1.25) > self.max_margin).then_some(OutboundError::TooFar {
            round_trip: shortest,
            max_margin: self.max_margin,
        })
    }

    /// The round trip of a layer's first, quiet look: the margin covers twice as much (under
    /// load a look may wait behind another call's round trip on the connection), the store's
    /// distance is this one.
    pub(super) fn first_round_trip(&self, took: Duration, now: Instant) {
        self.round_trip_took(took * 2, now);
        let mut learned = self.learned.lock().unwrap_or_else(|e| e.into_inner());
        learned.shortest = Some((took, now));
    }

    /// A look's round trip to the store, measured at `now`: the margin follows it.
    pub(super) fn round_trip_took(&self, took: Duration, now: Instant) {
        let mut learned = self.learned.lock().unwrap_or_else(|e| e.into_inner());
        let round_trip = match learned.round_trip {
            None => took,
            Some(was) => was.mul_f64(0.875) + took.mul_f64(0.125),
        };
        let longest = match took > learned.longest {
            true => took,
            false => learned.longest - (learned.longest - took) / 8,
        };
        learned.round_trip = Some(round_trip);
        learned.longest = longest;
        learned.shortest = match learned.shortest {
            Some((shortest, at))
                if shortest < took && now.saturating_duration_since(at) < DISTANCE =>
            {
                Some((shortest, at))
            }
            _ => Some((took, now)),
        };
        learned.margin = needed(longest).clamp(self.margin, self.max_margin);
        // Said when it moved by a quarter or more since it was last said, or came back to the
        // configured one.
        let margin = learned.margin;
        let back = margin == self.margin && learned.said != margin;
        let say = back || margin.abs_diff(learned.said) > learned.said / 4;
        if say {
            learned.said = margin;
        }
        drop(learned);
        if say {
            note_margin(&self.policy, margin, self.margin, round_trip);
        }
    }

    /// What one call learned of the rate: the store's clock ran `store` between two of its
    /// answers, while the instance's ran between `local.0` and `local.1`.
    pub(super) fn rate_seen(&self, local: (Duration, Duration), store: Duration) {
        // Only spans long enough for the brackets to say it within a few percent.
        let spread = local.1.saturating_sub(local.0);
        if store < Duration::from_millis(100) || spread.as_secs_f64() > store.as_secs_f64() / 20.0 {
            return;
        }
        let seen = (local.0 + local.1).as_secs_f64() / 2.0 / store.as_secs_f64();
        let seen = seen.clamp(0.05, 20.0);
        let mut learned = self.learned.lock().unwrap_or_else(|e| e.into_inner());
        let at = learned.next % RATE_SAMPLES;
        learned.samples[at] = seen;
        learned.next += 1;
        let mut samples: Vec<f64> = learned.samples[..learned.next.min(RATE_SAMPLES)].to_vec();
        samples.sort_by(f64::total_cmp);
        learned.rate = samples[samples.len() / 2];
    }
}

/// Says that the layer's margin moved: through `tracing`, and a gauge under `metrics`.
fn note_margin(policy: &str, margin: Duration, configured: Duration, round_trip: Duration) {
    if margin > configured {
        tracing::info!(
            target: "tower_redis_ratelimit",
            policy,
            ?margin,
            ?configured,
            ?round_trip,
            "outbound margin widened for the store's round trip",
        );
    } else {
        tracing::info!(
            target: "tower_redis_ratelimit",
            ?margin,
            ?round_trip,
            policy,
            "outbound margin back to the configured one",
        );
    }
    #[cfg(feature = "metrics")]
    ::metrics::gauge!("ratelimit_outbound_margin_seconds", "policy" => policy.to_owned())
        .set(margin.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = policy;
}

/// What one store answer was heard between, on the instance's clock.
#[derive(Debug, Clone, Copy)]
pub(super) struct Heard {
    pub(super) sent: Instant,
    pub(super) received: Instant,
}

impl Heard {
    pub(super) fn round_trip(&self) -> Duration {
        self.received.saturating_duration_since(self.sent)
    }
}

/// How long the store's clock and the instance's ran between a reservation's answer (heard,
/// and its turn `d` ahead) and a look's (heard, and its turn `ahead` or `past`), the turn
/// unmoved: the store's exactly, the instance's between the two brackets' near and far ends.
pub(super) fn ran(
    (reserved, d): (Heard, Duration),
    (looked, ahead, past): (Heard, Duration, Duration),
) -> Option<((Duration, Duration), Duration)> {
    let store = (d + past).checked_sub(ahead)?;
    let local = (
        looked.sent.saturating_duration_since(reserved.received),
        looked.received.saturating_duration_since(reserved.sent),
    );
    Some((local, store))
}
