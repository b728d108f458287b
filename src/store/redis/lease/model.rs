//! A property test of the lease bookkeeping on a virtual clock: several instances lease from
//! one model of the scripts (`gcra.lua`, `fixed_window.lua` and `release.lua`, one limit), and
//! the units they admit, at the times they admit them, never exceed the limit.

use proptest::prelude::*;

use super::book::{Entry, Grant};
use super::Leases;
use crate::algorithm::{window_start, Algorithm, Outcome};
use crate::Policy;

/// One key's state in the model of Redis, one limit of `c` per `w` µs.
#[derive(Debug)]
enum Model {
    /// Start of the window counted, its count.
    Fixed(u64, u64),
    /// Time of the last write, backlog then (µs scaled by c).
    Gcra(u64, u128),
}

impl Model {
    /// `gcra.lua` / `fixed_window.lua` for one request of `cost` that takes up to `want`
    /// units, keeping `h` of headroom: the units taken, if admitted.
    fn lease(&mut self, now: u64, c: u64, w: u64, cost: u64, want: u64, h: u64) -> Option<u64> {
        match self {
            Model::Fixed(start, count) => {
                if *start != window_start(now, w) {
                    (*start, *count) = (window_start(now, w), 0);
                }
                let room = c - *count;
                (cost <= room).then(|| {
                    let take = want.min(room);
                    *count += take;
                    take
                })
            }
            Model::Gcra(at, b) => {
                let backlog = b.saturating_sub(u128::from(now - *at) * u128::from(c));
                let capacity = u128::from(w - h) * u128::from(c);
                if backlog + u128::from(cost) * u128::from(w) > capacity {
                    return None;
                }
                let take = ((capacity - backlog) / u128::from(w)).min(want.into()) as u64;
                (*at, *b) = (now, backlog + u128::from(take) * u128::from(w));
                Some(take)
            }
        }
    }

    /// `release.lua` for `units` granted at `granted`.
    fn release(&mut self, now: u64, c: u64, w: u64, units: u64, granted: u64) {
        match self {
            Model::Fixed(start, count) => {
                if *start == window_start(granted, w) {
                    *count = count.saturating_sub(units);
                }
            }
            Model::Gcra(at, b) => {
                let backlog = b.saturating_sub(u128::from(now - *at) * u128::from(c));
                let weight = (u128::from(units) * u128::from(w))
                    .saturating_sub(u128::from(now - granted) * u128::from(c));
                (*at, *b) = (now, backlog.saturating_sub(weight));
            }
        }
    }
}

/// A prefetch under way: Redis runs it at `runs`, the reply lands at `lands`.
struct Fetch {
    instance: usize,
    sent: u64,
    runs: u64,
    lands: u64,
    want: u64,
    taken: Option<(u64, u64)>,
}

/// Runs `steps` (gap before the request, instance, cost, Redis delay, reply delay, sweep?)
/// and returns the (time, units) admitted.
fn simulate(
    algorithm: Algorithm,
    c: u64,
    w: u64,
    instances: usize,
    steps: &[(u64, usize, u64, u64, u64, bool)],
) -> Vec<(u64, u64)> {
    let policy = Policy::new(
        "p",
        [crate::Limit::new(c, std::time::Duration::from_micros(w)).unwrap()],
    )
    .unwrap()
    .with_algorithm(algorithm);
    let plan = Leases::new().max_share(0.25).plan(&policy).expect("leased");
    let mut redis = match algorithm {
        Algorithm::Gcra => Model::Gcra(0, 0),
        _ => Model::Fixed(0, 0),
    };
    let mut entries = vec![Entry::default(); instances];
    let mut fetches: Vec<Fetch> = Vec::new();
    let mut admitted = Vec::new();
    let mut now = 0;
    let answer = Outcome {
        allowed: true,
        index: 0,
        remaining: 0,
        reset_after: 0,
        retry_after: None,
    };
    for &(gap, instance, cost, run_delay, land_delay, sweep) in steps {
        now += gap;
        // Redis runs the prefetches due, then their replies land, in time order.
        fetches.sort_by_key(|f| f.runs);
        for f in fetches
            .iter_mut()
            .filter(|f| f.runs <= now && f.taken.is_none())
        {
            let taken = redis
                .lease(f.runs, c, w, 0, f.want, plan.headroom)
                .unwrap_or(0);
            f.taken = Some((taken, f.runs));
        }
        fetches.retain(|f| {
            if f.lands > now {
                return true;
            }
            let (units, granted) = f.taken.unwrap_or((0, 0));
            let entry = &mut entries[f.instance];
            entry.fetching = false;
            let grant = Grant {
                units,
                expires: plan.expiry(&policy, f.sent, granted as i64),
                granted: granted as i64,
            };
            entry.granted(grant, answer);
            false
        });
        if sweep {
            for entry in entries.iter_mut() {
                for r in entry.returns(now, plan.period / 4, false) {
                    redis.release(now, c, w, r.units, r.granted as u64);
                }
            }
        }
        let entry = &mut entries[instance % instances];
        if entry.take(now, cost).is_some() {
            admitted.push((now, cost));
            entry.used(now, plan.period, cost);
            if let Some(want) = entry.should_prefetch(now, plan.period, plan.cap) {
                entry.fetching = true;
                fetches.push(Fetch {
                    instance: instance % instances,
                    sent: now,
                    runs: now + run_delay,
                    lands: now + run_delay + land_delay,
                    want,
                    taken: None,
                });
            }
            continue;
        }
        entry.used(now, plan.period, cost);
        let want = entry.want(now, plan.period, cost, plan.cap);
        let lease = want > cost && !entry.fetching;
        let ask = if lease { want } else { cost };
        if let Some(taken) = redis.lease(now, c, w, cost, ask, plan.headroom) {
            admitted.push((now, cost));
            let grant = Grant {
                units: taken - cost,
                expires: plan.expiry(&policy, now, now as i64),
                granted: now as i64,
            };
            entry.granted(grant, answer);
        }
    }
    admitted
}

const W: u64 = 1_000_000;

fn steps() -> impl Strategy<Value = Vec<(u64, usize, u64, u64, u64, bool)>> {
    proptest::collection::vec(
        (
            // Bursts (no gap) and quiet spells, where leases are taken and spent apart.
            prop_oneof![3 => Just(0u64), 2 => 0u64..40_000, 1 => 0u64..400_000],
            0usize..4,
            1u64..3,
            0u64..60_000,
            0u64..60_000,
            proptest::bool::weighted(0.05),
        ),
        1..600,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn fixed_windows_never_admit_more_than_the_limit(c in 8u64..60, steps in steps()) {
        let admitted = simulate(Algorithm::FixedWindow, c, W, 4, &steps);
        let mut per_window = std::collections::BTreeMap::new();
        for (t, units) in admitted {
            *per_window.entry(window_start(t, W)).or_insert(0) += units;
        }
        for (start, units) in per_window {
            prop_assert!(units <= c, "{units} > {c} in the window at {start}");
        }
    }

    #[test]
    fn gcra_admissions_fit_the_bucket(c in 8u64..60, steps in steps()) {
        let admitted = simulate(Algorithm::Gcra, c, W, 4, &steps);
        // A leaky bucket of c per w: for every s <= t, units admitted in [s, t] times w is at
        // most c * (t - s + w).
        for (i, &(s, _)) in admitted.iter().enumerate() {
            let mut units = 0u128;
            for &(t, k) in &admitted[i..] {
                units += u128::from(k);
                prop_assert!(
                    units * u128::from(W) <= u128::from(c) * u128::from(t - s + W),
                    "{units} units in [{s}, {t}] exceed a bucket of {c} per {W} us"
                );
            }
        }
    }
}
