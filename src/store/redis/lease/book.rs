//! The bookkeeping of leases for one key under one policy, free of I/O: which units this
//! instance holds, until when, how fast it uses them, and how many to ask for next.
//!
//! Times are whole microseconds on this process's monotonic clock (`now`), except
//! [`Grant::granted`], which is Redis's time of the grant, as the give-back script needs it.

use std::collections::VecDeque;

use super::plan::COLD;
use crate::model::Outcome;

/// Units taken from Redis in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// Units not spent yet.
    pub(crate) units: u64,
    /// Local time from which they may no longer be spent.
    pub(crate) expires: u64,
    /// Redis time of the grant, µs since the epoch.
    pub(crate) granted: i64,
}

/// Units to give back to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Return {
    pub(crate) units: u64,
    pub(crate) granted: i64,
}

/// What one instance holds for one key under one policy.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyBook {
    /// Oldest first; a second one arrives when the next lease is fetched ahead of need.
    grants: VecDeque<Grant>,
    /// Whether a lease is being fetched for this key.
    pub(crate) fetching: bool,
    /// Local time of the last request.
    pub(crate) last_used: u64,
    /// What Redis last answered for this key, and its Redis time, for the rate-limit fields
    /// of requests admitted from a lease: its remaining count already excludes every unit
    /// leased. Replies may land out of order (leases and plain decisions travel apart); the
    /// latest by Redis time is kept, since an older one does not count the newer grants.
    last: Option<(i64, Outcome)>,
    /// The Redis time of the latest answer that showed the key full (a settlement's charge
    /// filled it, or a fetch found it over its limit): no grant Redis made until then is
    /// spent, including one whose reply lands later (it ran before the answer, and Redis may
    /// now hold more than the limit without the units this instance still holds).
    filled: Option<i64>,
}

impl KeyBook {
    /// Notes a request at `now` (the rate leases follow is counted in the heat table).
    pub(crate) fn used(&mut self, now: u64) {
        self.last_used = now;
    }

    /// Spends `cost` units of unexpired leases, oldest first, if they hold that many; returns
    /// the outcome to answer with, and the Redis time of the grant the last unit came from
    /// (where Redis counted it).
    pub(crate) fn take(&mut self, now: u64, cost: u64) -> Option<(Outcome, Option<i64>)> {
        self.peek(now, cost)?;
        let mut left = cost;
        let mut granted = None;
        for grant in self.grants.iter_mut().filter(|g| g.expires > now) {
            if left == 0 {
                break;
            }
            let spent = grant.units.min(left);
            grant.units -= spent;
            left -= spent;
            if spent > 0 || granted.is_none() {
                granted = Some(grant.granted);
            }
        }
        Some((self.outcome(now)?, granted))
    }

    /// What [`take`](Self::take) would answer at `now` for `cost`, without spending: `None`
    /// when the unexpired leases hold fewer units.
    pub(crate) fn peek(&self, now: u64, cost: u64) -> Option<Outcome> {
        (self.units(now) >= cost).then(|| self.outcome(now))?
    }

    /// An admission from the lease at `now`: what Redis last answered, with the units still
    /// held added to its remaining count (Redis counted them as used).
    fn outcome(&self, now: u64) -> Option<Outcome> {
        let (_, last) = self.last?;
        Some(Outcome {
            allowed: true,
            retry_after: None,
            remaining: last.remaining + self.units(now),
            ..last
        })
    }

    /// Unexpired units held at `now`.
    pub(crate) fn units(&self, now: u64) -> u64 {
        self.grants
            .iter()
            .filter(|g| g.expires > now)
            .map(|g| g.units)
            .sum()
    }

    /// Whether to fetch the next lease now, ahead of need, and how many units: none is being
    /// fetched, the key is still busy enough to lease (its use over the last period,
    /// `estimate`, at most `cap`, is [`COLD`] or more: below, it is cooling and its leases run
    /// out), and the units left would last less than a quarter of the period at that rate.
    pub(crate) fn should_prefetch(&self, now: u64, estimate: u64, cap: u64) -> Option<u64> {
        let want = estimate.min(cap);
        if self.fetching || want < COLD {
            return None;
        }
        (self.units(now) * 4 < want).then_some(want)
    }

    /// Adds a grant of `units` (beyond the request that fetched it), and remembers what Redis
    /// answered. A grant made no later than an answer that showed the key full is never spent:
    /// it is kept as expired, for the sweeper to give back.
    pub(crate) fn granted(&mut self, mut grant: Grant, outcome: Outcome) {
        self.remember(grant.granted, outcome);
        if self.filled.is_some_and(|filled| grant.granted <= filled) {
            grant.expires = 0;
        }
        if grant.units > 0 {
            self.grants.push_back(grant);
        }
    }

    /// Redis answered at Redis time `at` that the key is full: the grants it made until then
    /// are spent no more (and so are those that land later, see [`granted`](Self::granted)).
    /// They are kept as expired, so that the sweeper gives them back: Redis counted them and
    /// nobody was admitted with them, and once they are back Redis decides every request as
    /// it would without leases.
    pub(crate) fn fill(&mut self, at: i64) {
        self.filled = Some(self.filled.map_or(at, |filled| filled.max(at)));
        for grant in self.grants.iter_mut().filter(|g| g.granted <= at) {
            grant.expires = 0;
        }
    }

    /// The limits may have changed (an override): the grants held now were taken under the
    /// old ones, and are spent no more; the sweeper gives them back.
    pub(crate) fn expire_grants(&mut self) {
        for grant in self.grants.iter_mut() {
            grant.expires = 0;
        }
    }

    /// Remembers what Redis answered at Redis time `at` to a request of this key that took
    /// no lease.
    pub(crate) fn answered(&mut self, outcome: Outcome, at: i64) {
        if outcome.allowed {
            self.remember(at, outcome);
        }
    }

    /// Keeps `outcome` unless Redis answered later already.
    fn remember(&mut self, at: i64, outcome: Outcome) {
        if self.last.is_none_or(|(last, _)| last <= at) {
            self.last = Some((at, outcome));
        }
    }

    /// Takes out the units to give back at `now`: those of expired grants, and every unit
    /// once the key has been idle for `idle` (or when `all`).
    pub(crate) fn returns(&mut self, now: u64, idle: u64, all: bool) -> Vec<Return> {
        let everything = all || now.saturating_sub(self.last_used) >= idle;
        let mut out = Vec::new();
        self.grants.retain(|g| {
            let done = everything || g.expires <= now;
            if done && g.units > 0 {
                out.push(Return {
                    units: g.units,
                    granted: g.granted,
                });
            }
            !done
        });
        out
    }

    /// Whether nothing is held or being fetched.
    pub(crate) fn is_empty(&self) -> bool {
        self.grants.is_empty() && !self.fetching
    }

    /// Whether the entry can go at `now`: nothing held or being fetched, and the key either
    /// idle for `idle` or cooling (its use over the last period, `estimate`, under [`COLD`]:
    /// a lease would no longer pay). A key that goes reads as cold until it is hot again.
    pub(crate) fn can_go(&self, now: u64, idle: u64, estimate: u64) -> bool {
        let idle = now.saturating_sub(self.last_used) >= idle;
        self.is_empty() && (idle || estimate < COLD)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000;
    const PERIOD: u64 = 1_000 * MS;

    /// What Redis answers when it refuses, with 100 ms to wait.
    fn refused() -> Outcome {
        Outcome {
            allowed: false,
            index: 0,
            remaining: 0,
            reset_after: 900 * MS,
            retry_after: Some(100 * MS),
        }
    }

    fn outcome(remaining: u64) -> Outcome {
        Outcome {
            allowed: true,
            index: 0,
            remaining,
            reset_after: 0,
            retry_after: None,
        }
    }

    #[test]
    fn an_empty_entry_goes_when_idle_or_cooling() {
        let mut e = KeyBook::default();
        e.used(100 * MS);
        assert!(!e.can_go(100 * MS, 25 * MS, 3), "busy, and at COLD");
        assert!(e.can_go(100 * MS, 25 * MS, 2), "under COLD");
        assert!(e.can_go(125 * MS, 25 * MS, 40), "idle");
        e.granted(grant(1, PERIOD, 0), outcome(0));
        assert!(!e.can_go(PERIOD - 1, 25 * MS, 0), "holds a unit");
    }

    #[test]
    fn a_cooling_key_stops_prefetching() {
        let e = KeyBook::default();
        assert_eq!(e.should_prefetch(0, 40, 1_000), Some(40));
        assert_eq!(e.should_prefetch(0, 3, 1_000), Some(3), "at COLD");
        assert_eq!(e.should_prefetch(0, 2, 1_000), None, "under COLD: cooling");
        assert_eq!(e.should_prefetch(0, 40, 2), None, "a cap under COLD");
    }

    #[test]
    fn spends_oldest_grants_first_and_never_expired_ones() {
        let mut e = KeyBook::default();
        let first = Grant {
            units: 3,
            expires: 100 * MS,
            granted: 7,
        };
        let second = Grant {
            units: 5,
            expires: 200 * MS,
            granted: 8,
        };
        e.granted(first, outcome(10));
        e.granted(second, outcome(10));
        assert_eq!(e.units(0), 8);
        // `spent > 0` in `take` as `>=` is equivalent: `peek` ensures the unexpired grants
        // hold `cost`, so the last grant the loop visits always spends a unit.
        let (d, granted) = e.take(0, 4).expect("held");
        assert_eq!(granted, Some(8), "the last unit came from the second grant");
        assert_eq!(
            d.remaining,
            10 + 4,
            "fleet-wide remaining plus what is still held"
        );
        assert_eq!(e.units(0), 4);
        // The first grant (3 units, 0 left) expired; the second has 4.
        assert_eq!(e.units(150 * MS), 4);
        assert!(e.take(150 * MS, 5).is_none());
        assert!(e.take(150 * MS, 4).is_some());
        assert!(e.take(250 * MS, 1).is_none(), "everything expired");
    }

    #[test]
    fn gives_back_expired_grants_and_everything_when_idle() {
        let mut e = KeyBook::default();
        e.used(0);
        for (units, expires, granted) in [(3, 100 * MS, 1), (5, 900 * MS, 2)] {
            let grant = Grant {
                units,
                expires,
                granted,
            };
            e.granted(grant, outcome(0));
        }
        assert_eq!(e.returns(50 * MS, PERIOD, false), []);
        assert_eq!(
            e.returns(100 * MS, PERIOD, false),
            [Return {
                units: 3,
                granted: 1
            }]
        );
        e.used(200 * MS);
        // Idle for `idle` after its last request at 200 ms.
        assert_eq!(e.returns(400 * MS, 250 * MS, false), []);
        assert_eq!(
            e.returns(450 * MS, 250 * MS, false),
            [Return {
                units: 5,
                granted: 2
            }]
        );
        assert!(e.is_empty());
    }

    #[test]
    fn prefetches_when_a_quarter_period_of_units_is_left() {
        let mut e = KeyBook::default();
        let grant = Grant {
            units: 11,
            expires: 2 * PERIOD,
            granted: 0,
        };
        e.granted(grant, outcome(0));
        let now = PERIOD - MS;
        assert_eq!(e.should_prefetch(now, 40, 1_000), None, "11 of 40 left");
        e.take(now, 2);
        assert_eq!(e.should_prefetch(now, 40, 1_000), Some(40));
        e.fetching = true;
        assert_eq!(e.should_prefetch(now, 40, 1_000), None, "one at a time");
    }

    fn grant(units: u64, expires: u64, granted: i64) -> Grant {
        Grant {
            units,
            expires,
            granted,
        }
    }

    #[test]
    fn a_grant_is_not_spendable_at_its_expiry() {
        let mut e = KeyBook::default();
        e.granted(grant(2, 100 * MS, 1), outcome(0));
        e.granted(grant(5, 200 * MS, 2), outcome(0));
        assert_eq!(e.units(100 * MS - 1), 7);
        assert_eq!(e.units(100 * MS), 5, "the first grant expires at 100 ms");
        // At 100 ms the two units come from the second grant, not the expired first.
        let (_, granted) = e.take(100 * MS, 2).expect("held");
        assert_eq!(granted, Some(2));
        assert_eq!(e.units(100 * MS), 3);
        assert_eq!(e.units(200 * MS), 0);
        assert!(
            e.take(200 * MS, 1).is_none(),
            "the second expires at 200 ms"
        );
    }

    #[test]
    fn spent_and_empty_grants_give_nothing_back() {
        let mut e = KeyBook::default();
        e.granted(grant(0, 100 * MS, 1), outcome(0));
        assert!(e.is_empty(), "a grant of no units is not kept");
        e.granted(grant(3, 100 * MS, 2), outcome(0));
        e.take(0, 3).expect("held");
        assert_eq!(e.returns(100 * MS, PERIOD, false), [], "all three spent");
        assert!(e.is_empty());
    }

    #[test]
    fn empty_only_without_grants_or_a_fetch() {
        let mut e = KeyBook::default();
        assert!(e.is_empty());
        e.granted(grant(1, 100 * MS, 1), outcome(0));
        assert!(!e.is_empty(), "holds a grant");
        e.fetching = true;
        assert!(!e.is_empty());
        e.returns(0, PERIOD, true);
        assert!(!e.is_empty(), "fetching");
        e.fetching = false;
        assert!(e.is_empty());
    }

    #[test]
    fn the_latest_answer_by_redis_time_is_reported() {
        let mut e = KeyBook::default();
        e.granted(grant(4, PERIOD, 10), outcome(20));
        assert_eq!(e.take(0, 1).expect("held").0.remaining, 20 + 3);
        // An older answer, landing late, counts fewer grants: it is ignored.
        e.answered(outcome(30), 9);
        e.granted(grant(1, PERIOD, 8), outcome(40));
        assert_eq!(e.peek(0, 1).expect("held").remaining, 20 + 4);
        // One from the same Redis time, or later, replaces it.
        e.answered(outcome(7), 10);
        assert_eq!(e.peek(0, 1).expect("held").remaining, 7 + 4);
        e.granted(grant(2, PERIOD, 11), outcome(5));
        assert_eq!(e.peek(0, 1).expect("held").remaining, 5 + 6);
    }

    #[test]
    fn only_an_allowed_answer_sets_what_a_lease_admission_reports() {
        let mut e = KeyBook::default();
        e.granted(grant(2, PERIOD, 1), outcome(9));
        let allowed = Outcome {
            index: 1,
            reset_after: 500 * MS,
            ..outcome(4)
        };
        e.answered(allowed, 2);
        let (d, _) = e.take(0, 1).expect("held");
        assert_eq!(
            d,
            Outcome {
                remaining: 4 + 1,
                ..allowed
            }
        );
        let refused = refused();
        e.answered(refused, 3);
        assert_eq!(e.peek(0, 1), Some(d), "a refusal is not remembered");
    }

    #[test]
    fn a_lease_admission_is_allowed_with_no_wait() {
        // The units are held: whatever Redis said with them, spending one admits.
        let mut e = KeyBook::default();
        let refused = refused();
        e.granted(grant(2, PERIOD, 1), refused);
        let (d, _) = e.take(0, 1).expect("held");
        assert!(d.allowed);
        assert_eq!(d.retry_after, None);
        assert_eq!(d.remaining, 1);
    }

    #[test]
    fn prefetches_only_below_a_quarter() {
        let mut e = KeyBook::default();
        e.granted(grant(10, 2 * PERIOD, 0), outcome(0));
        let now = PERIOD - MS;
        assert_eq!(e.should_prefetch(now, 40, 1_000), None, "10 of 40 left");
        e.take(now, 1);
        assert_eq!(e.should_prefetch(now, 40, 1_000), Some(40), "9 of 40");
    }

    #[test]
    fn a_fill_ends_the_grants_made_until_then_and_gives_them_back() {
        let mut e = KeyBook::default();
        e.used(0);
        e.granted(grant(4, PERIOD, 10), outcome(0));
        e.granted(grant(6, PERIOD, 20), outcome(0));
        e.fill(10);
        assert_eq!(e.units(0), 6, "only the grant made after the fill is spent");
        assert!(e.take(0, 7).is_none());
        e.fill(20);
        assert_eq!(
            e.units(0),
            0,
            "a grant made at the fill's time is ended too"
        );
        assert!(e.take(0, 1).is_none());
        // Both are given back by the next sweep, as expired grants are, busy key or not.
        assert_eq!(
            e.returns(0, PERIOD, false),
            [
                Return {
                    units: 4,
                    granted: 10
                },
                Return {
                    units: 6,
                    granted: 20
                }
            ]
        );
        assert!(e.is_empty());
    }

    #[test]
    fn a_grant_landing_after_a_fill_it_ran_before_is_never_spent() {
        let mut e = KeyBook::default();
        e.used(0);
        e.fetching = true;
        // The settlement's reply (Redis time 50) is read before the fetch's (Redis time 40).
        e.fill(50);
        e.fetching = false;
        e.granted(grant(5, PERIOD, 40), outcome(0));
        assert_eq!(e.units(0), 0, "counted before the fill, landed after it");
        // An older fill does not move the mark back.
        e.fill(30);
        e.granted(grant(3, PERIOD, 50), outcome(0));
        assert_eq!(e.units(0), 0, "a grant at the fill's own time is ended");
        // A grant Redis made after the fill took only units that fit then.
        e.granted(grant(2, PERIOD, 51), outcome(0));
        assert_eq!(e.units(0), 2);
        assert_eq!(
            e.returns(0, PERIOD, false),
            [
                Return {
                    units: 5,
                    granted: 40
                },
                Return {
                    units: 3,
                    granted: 50
                }
            ]
        );
        assert_eq!(e.units(0), 2);
    }
}
