//! What leasing a policy means: the store's [`Leases`] settings, and the [`Plan`] they make for
//! each policy (how many units a lease takes, how long they may be spent, and the headroom
//! every decision of the policy keeps for units spent late).

use std::time::Duration;

use crate::model::{micros, window_start, Algorithm};
use crate::store::redis::wire::Record;
use crate::{Policy, StoreError};

/// Lease settings of a [`RedisStore`](crate::RedisStore): how long a lease lasts and how large it may grow.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::Leases;
///
/// let leases = Leases::new().period(Duration::from_millis(500)).max_share(0.05);
/// # drop(leases);
/// ```
///
/// Pass them to [`RedisStoreBuilder::leases`](crate::store::RedisStoreBuilder::leases). Every
/// instance sharing a Redis should use the same settings: the headroom for units spent late
/// (GCRA's drain kept free, the sliding log's longer window) is only kept by leasing stores,
/// at their own settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Leases {
    period: Duration,
    max_share: f64,
    pub(crate) max_keys: u64,
}

impl Default for Leases {
    fn default() -> Self {
        Leases::new()
    }
}

impl Leases {
    /// The default lease period.
    pub const DEFAULT_PERIOD: Duration = Duration::from_secs(1);
    /// The default largest share of a limit one lease takes.
    pub const DEFAULT_MAX_SHARE: f64 = 0.1;

    /// Leases of the default [`period`](Self::period) (1 s) and
    /// [`max_share`](Self::max_share) (0.1), for at most 100 000 keys at once.
    pub fn new() -> Self {
        Leases {
            period: Self::DEFAULT_PERIOD,
            max_share: Self::DEFAULT_MAX_SHARE,
            max_keys: 100_000,
        }
    }

    /// How long a lease lasts: it holds what the key used in the last period, and its units
    /// may be spent for that long at most (less at the end of a counter's window, and for GCRA
    /// and the sliding log at most `max_share` of the shortest window; see the module docs).
    /// For GCRA and the sliding log it is also the headroom every decision keeps: a smaller
    /// burst, or a window read that much longer. Longer periods mean fewer Redis calls and
    /// larger shares held by one instance.
    pub fn period(mut self, period: Duration) -> Self {
        self.period = period;
        self
    }

    /// The largest lease, as a share of the policy's smallest count (default 0.1), so that
    /// instances cannot starve each other. A key takes leases only while a lease would serve
    /// at least 4 units of requests (its use over the last period, up to this share), so a
    /// policy whose share is under 4 units takes none: each of its requests goes to Redis, as
    /// a cold key's do (`docs/leases.md`, "The path of a request").
    pub fn max_share(mut self, share: f64) -> Self {
        self.max_share = share;
        self
    }

    /// The most keys holding leases at once (default 100 000); past it, the least recently
    /// used key's lease is dropped unspent (counted as used, never admitted twice). It also
    /// sizes the table that counts each key's recent use to decide which keys lease: one
    /// 8-byte cell per key, rounded up to a power of two, 2^10 to 2^20 cells (1 MiB by
    /// default).
    pub fn max_keys(mut self, keys: u64) -> Self {
        self.max_keys = keys;
        self
    }

    pub(crate) fn period_length(&self) -> Duration {
        self.period
    }

    pub(crate) fn validate(&self) -> Result<(), StoreError> {
        if self.period < Duration::from_millis(10) {
            return Err(StoreError::Config(
                "the lease period must be at least 10 ms".into(),
            ));
        }
        if !(self.max_share > 0.0 && self.max_share <= 1.0) {
            return Err(StoreError::Config(format!(
                "the lease share {} must be above 0 and at most 1",
                self.max_share
            )));
        }
        if self.max_keys == 0 {
            return Err(StoreError::Config("leases need room for one key".into()));
        }
        Ok(())
    }

    /// How `policy` is leased; `None` when it is not (a share under two units, or a policy
    /// with a penalty box or a concurrency limit, which every decision must read in Redis).
    pub(crate) fn plan(&self, policy: &Policy) -> Option<Plan> {
        if never_leased(policy) {
            return None;
        }
        let smallest = policy.windows().iter().map(|w| w.count).min()?;
        let cap = (smallest as f64 * self.max_share) as u64;
        let (period, headroom, life) = match policy.algorithm() {
            Algorithm::Gcra | Algorithm::SlidingLog => {
                let h = self.late(policy);
                (h, h, Life::Period)
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                (micros(self.period), 0, Life::Window)
            }
        };
        (cap >= 2 && period > 0).then_some(Plan {
            cap,
            period,
            headroom,
            life,
        })
    }

    /// How late (µs) a unit of a lease of `policy` may be spent after Redis recorded it, where
    /// its lease lasts a time rather than a window: the period, at most `max_share` of the
    /// shortest window.
    pub(crate) fn late(&self, policy: &Policy) -> u64 {
        let Some(shortest) = policy.windows().first().map(|w| w.micros) else {
            return 0;
        };
        micros(self.period).min((shortest as f64 * self.max_share) as u64)
    }

    /// The headroom (µs) every decision of `policy` allows for ([`Plan`]): a leased GCRA
    /// policy's; for the sliding log, whether this policy is leased or not, since a policy of
    /// its name and windows shares its log and may be leased (other counts, no penalty box),
    /// and the units it spends late are in every window this one reads. 0 otherwise.
    pub(crate) fn headroom(&self, policy: &Policy) -> u64 {
        match policy.algorithm() {
            Algorithm::SlidingLog => self.late(policy),
            Algorithm::Gcra => self.plan(policy).map_or(0, |plan| plan.headroom),
            Algorithm::FixedWindow | Algorithm::SlidingWindow => 0,
        }
    }

    /// Why these settings cannot lease `policy`, if they cannot: GCRA's headroom would leave
    /// a bucket room for less than one unit, so that the key would never admit anything.
    pub(crate) fn refuses(&self, policy: &Policy) -> Option<StoreError> {
        if policy.algorithm() != Algorithm::Gcra {
            return None;
        }
        let plan = self.plan(policy)?;
        let starved = policy.windows().iter().position(|w| {
            let room = u128::from(w.micros.saturating_sub(plan.headroom)) * u128::from(w.count);
            room < u128::from(w.micros)
        })?;
        let limit = policy.limits()[starved];
        Some(StoreError::Config(format!(
            "leases with max_share {} and period {:?} keep {} ms of GCRA headroom, which leaves \
             the {limit} limit of policy {:?} a burst under one unit: lower max_share or the \
             lease period, or use a store without leases for this policy",
            self.max_share,
            self.period,
            plan.headroom / 1_000,
            policy.name(),
        )))
    }
}

/// How one policy is leased.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// The most units one lease takes.
    pub(crate) cap: u64,
    /// The longest a lease lasts (µs), and the span whose use sets its size.
    pub(crate) period: u64,
    /// How late a leased unit may be spent after Redis recorded it (µs), which every decision
    /// of the policy allows for: GCRA keeps that much drain free, the sliding log reads every
    /// window that much longer; 0 for the counters, whose leases end with their window.
    pub(crate) headroom: u64,
    pub(crate) life: Life,
}

/// How long a lease's units may be spent (see the module's docs, "Never over the limit").
#[derive(Debug, Clone, Copy)]
pub(crate) enum Life {
    /// For the plan's period after the sending, less [`DRIFT`] (GCRA and the sliding log: the
    /// headroom covers that much delay).
    Period,
    /// Until the current window of the shortest limit ends, or for the period if sooner (the
    /// counters: every unit is spent in the window that counted it).
    Window,
}

impl Plan {
    /// What a request of `cost` records that takes up to `want` units, keeping the policy's
    /// headroom ([`recording`]).
    pub(crate) fn record(&self, cost: u64, want: u64) -> Record {
        recording(cost, want, self.headroom)
    }

    /// Whether a settlement's reply that `remaining` units are left (in the limit with the
    /// fewest) may mean that the key is full: Redis counts the units this instance holds as
    /// used, and with none left it may count more than the limit without them, which spending
    /// them would admit past. For the counters and the sliding log (whose settlements read
    /// the same longer windows as its decisions, [`settling_headroom`]), when none is left.
    /// A settlement's reply counts GCRA's `remaining` without the headroom
    /// (`scripts/gcra.lua`), against `w·c` rather than `(w − h)·c`: the key may be full when
    /// fewer than `1 + h·c/w` units are left, in any limit, since the limit with the fewest
    /// units left without the headroom need not be the one with the fewest with it.
    pub(crate) fn full(&self, policy: &Policy, remaining: u64) -> bool {
        if policy.algorithm() != Algorithm::Gcra {
            return remaining == 0;
        }
        let room = |count: u64, micros: u64| {
            u128::from(remaining) * u128::from(micros)
                < u128::from(micros) + u128::from(self.headroom) * u128::from(count)
        };
        policy.windows().iter().any(|w| room(w.count, w.micros))
    }

    /// Local time until which units granted at Redis time `granted`, for a request sent at
    /// local time `sent`, may be spent. Measured from the sending, which is before Redis ran
    /// the script.
    pub(crate) fn expiry(&self, policy: &Policy, sent: u64, granted: i64) -> u64 {
        let t = u64::try_from(granted).unwrap_or(0);
        let life = match self.life {
            Life::Period => self.period - self.period / DRIFT,
            Life::Window => policy
                .windows()
                .iter()
                .map(|w| window_start(t, w.micros) + w.micros - t)
                .fold(self.period, u64::min),
        };
        sent + life
    }
}

/// A key takes its first lease when a lease would serve at least this many requests of one
/// unit: its use over the last period (the lease's size), at most the plan's cap, reaches it.
/// A lease is a script call decided alone plus, often, a give-back, where a decision in Redis
/// costs a share of one batched call: measured with `http_load` (GCRA, leases of 1 s), leases
/// cost Redis more than they saved at about 2 units a period per key, and saved a little at
/// 4 and about half at 6 to 7 (`docs/leases.md`, "Which keys lease"). A policy whose cap is
/// under it is never leased.
pub(crate) const HOT: u64 = 4;

/// A key that holds leases keeps fetching them while a lease would serve at least this many
/// requests; below, it stops (the leases it holds are spent until they expire, and the rest
/// is given back), and it must reach [`HOT`] again to lease. Under `HOT`, so that a key whose
/// rate hovers at the threshold does not switch every period; not under 3, where a lease no
/// longer pays.
pub(crate) const COLD: u64 = 3;

impl Plan {
    /// The units a request of `cost` that needs Redis asks for, when a lease pays: the key's
    /// use over the last period (`estimate`), at most the cap, when that reaches [`HOT`] (or
    /// [`COLD`] for a key `leasing` already) and is more than the cost. `None`: a decision of
    /// its cost alone.
    pub(crate) fn lease_size(&self, estimate: u64, cost: u64, leasing: bool) -> Option<u64> {
        let want = estimate.min(self.cap);
        let least = if leasing { COLD } else { HOT };
        (want >= least && want > cost).then_some(want)
    }
}

/// A lease's units are spent up to `h` after they were sent for, as this instance's clock
/// measures it, and Redis's headroom allows `h` as Redis's clock measures it: a lease that
/// allows for the headroom ends a hundredth of `h` sooner, far more than two clocks' rates
/// differ (100 ppm is a poor quartz; NTP slews at most 500 ppm).
pub(crate) const DRIFT: u64 = 100;

/// What a request of `cost` that takes up to `want` units records, allowing for `headroom`:
/// an admission of its cost when it takes no more and there is no headroom, else a lease
/// (of its cost alone when `want` is no more), which carries the headroom to the script.
pub(crate) fn recording(cost: u64, want: u64, headroom: u64) -> Record {
    match headroom {
        0 if want <= cost => Record::Admit,
        headroom => Record::Lease {
            want: want.max(cost),
            headroom,
        },
    }
}

/// Whether `policy` is never leased, whatever the settings: a penalty box or a concurrency
/// limit, which every decision must read in Redis.
pub(crate) fn never_leased(policy: &Policy) -> bool {
    policy.block().is_some() || policy.concurrency_limit().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(limit: &str, algorithm: Algorithm) -> Policy {
        let policy: Policy = limit.parse().unwrap();
        policy.with_algorithm(algorithm)
    }

    #[test]
    fn a_key_leases_from_four_units_a_period_and_stops_under_three() {
        let plan = Leases::new()
            .plan(&policy("1000/1s", Algorithm::Gcra))
            .unwrap();
        assert_eq!(plan.cap, 100);
        // A warm key, 2 or 3 units per period, never leases.
        assert_eq!(plan.lease_size(2, 1, false), None);
        assert_eq!(plan.lease_size(3, 1, false), None);
        assert_eq!(plan.lease_size(4, 1, false), Some(4));
        assert_eq!(plan.lease_size(20, 1, false), Some(20));
        assert_eq!(plan.lease_size(500, 1, false), Some(100), "capped");
        // Once leasing, it goes on down to three.
        assert_eq!(plan.lease_size(3, 1, true), Some(3));
        assert_eq!(plan.lease_size(2, 1, true), None);
        assert_eq!(plan.lease_size(9, 9, false), None, "no more than the cost");
        // A cap under four never leases.
        let small = Leases::new()
            .plan(&policy("30/1s", Algorithm::Gcra))
            .unwrap();
        assert_eq!(small.cap, 3);
        assert_eq!(small.lease_size(1_000, 1, false), None);
    }

    #[test]
    fn a_counter_is_full_when_nothing_is_left() {
        let fixed = policy("1000/1m", Algorithm::FixedWindow);
        let plan = Leases::new().plan(&fixed).unwrap();
        assert!(plan.full(&fixed, 0));
        assert!(!plan.full(&fixed, 1));
    }

    #[test]
    fn gcra_is_full_when_what_is_left_may_all_be_headroom() {
        // h = 1 s of a 1 min bucket of 1000: 16.7 units of headroom, which a settlement's
        // reply counts as remaining. With 17 left, the bucket may hold less than one unit of
        // room under the headroom; with 18, it holds at least 1.3.
        let bucket = policy("1000/1m", Algorithm::Gcra);
        let plan = Leases::new().plan(&bucket).unwrap();
        assert_eq!(plan.headroom, 1_000_000);
        assert!(plan.full(&bucket, 0));
        assert!(plan.full(&bucket, 17));
        assert!(!plan.full(&bucket, 18));
    }
}
