//! A property test of the lease bookkeeping on a virtual clock: several instances lease from
//! one model of the scripts (`gcra.lua`, `fixed_window.lua`, `sliding_log.lua` and
//! `return.lua`, one limit), and the units they admit, at the times they admit them, never
//! exceed the limit.

use proptest::prelude::*;

use super::super::lease::book::{Grant, KeyBook};
use super::super::lease::heat::{Heat, Spot};
use super::super::lease::{Leases, Plan};
use crate::model::{window_start, Algorithm, Outcome};
use crate::Policy;

/// One key's state in the model of Redis, one limit of `c` per `w` µs.
#[derive(Debug)]
enum Model {
    /// Start of the window counted, its count.
    Fixed(u64, u64),
    /// Time of the last write, backlog then (µs scaled by c).
    Gcra(u64, u128),
    /// The log's events: time logged, weight.
    Log(Vec<(u64, u64)>),
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
            Model::Log(events) => {
                // Every window read `h` longer: (now - w - h, now].
                events.retain(|&(t, _)| t + w + h > now);
                let logged: u64 = events.iter().map(|&(_, k)| k).sum();
                (logged + cost <= c).then(|| {
                    let take = want.min(c - logged);
                    events.push((now, take));
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

    /// `return.lua` for `units` granted at `granted`.
    fn return_units(&mut self, now: u64, c: u64, w: u64, units: u64, granted: u64) {
        match self {
            Model::Log(events) => {
                let mut left = units;
                for (_, k) in events.iter_mut().rev().filter(|(t, _)| *t == granted) {
                    let give = left.min(*k);
                    (*k, left) = (*k - give, left - give);
                }
                events.retain(|&(_, k)| k > 0);
            }
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

/// One request: the gap before it (µs), its instance, its cost, the delay before Redis runs
/// the prefetch it may start, the delay before that reply lands, and whether the instances
/// give back what is due first.
type Step = (u64, usize, u64, u64, u64, bool);

/// The policy of one limit of `c` per `w` µs under `algorithm`, and how it is leased: a share
/// of 0.25, so a lease holds up to a quarter of `c` and GCRA's headroom is a quarter of `w`.
fn leased(algorithm: Algorithm, c: u64, w: u64) -> (Policy, Plan) {
    let policy = Policy::new(
        "p",
        [crate::Limit::new(c, std::time::Duration::from_micros(w)).unwrap()],
    )
    .unwrap()
    .with_algorithm(algorithm);
    let plan = Leases::new().max_share(0.25).plan(&policy).expect("leased");
    (policy, plan)
}

/// What a run of the model admitted, `(time, units, instance)`, and how often an instance's
/// key switched: `heated`, from cold (no book entry) to leasing; `cooled`, back.
#[derive(Debug, Default)]
struct Run {
    admitted: Vec<(u64, u64, usize)>,
    heated: u64,
    cooled: u64,
    /// Script calls: decisions in Redis and lease calls (fetches ahead of need included).
    calls: u64,
    /// Of those, the calls that asked for more units than their request's cost.
    leases: u64,
}

/// One instance: its heat table (the key's cell there) and its book entry, kept only while the
/// key leases (its leasing bit is set), as `lease/mod.rs` does.
struct Instance {
    heat: Heat,
    spot: Spot,
    entry: KeyBook,
}

/// The instances of a run, the model of Redis, and what they did, on a virtual clock.
struct Fleet {
    policy: Policy,
    plan: Plan,
    c: u64,
    w: u64,
    redis: Model,
    instances: Vec<Instance>,
    fetches: Vec<Fetch>,
    run: Run,
    now: u64,
}

impl Fleet {
    fn new(algorithm: Algorithm, c: u64, w: u64, instances: usize) -> Fleet {
        let (policy, plan) = leased(algorithm, c, w);
        let redis = match algorithm {
            Algorithm::Gcra => Model::Gcra(0, 0),
            Algorithm::SlidingLog => Model::Log(Vec::new()),
            // The counters (the cases run the fixed window).
            Algorithm::FixedWindow | Algorithm::SlidingWindow => Model::Fixed(0, 0),
        };
        let key = crate::Key::from("k");
        let instances = (0..instances)
            .map(|_| {
                let heat = Heat::new(1);
                let spot = heat.spot(&key, policy.terms_id());
                let entry = KeyBook::default();
                Instance { heat, spot, entry }
            })
            .collect();
        Fleet {
            policy,
            plan,
            c,
            w,
            redis,
            instances,
            fetches: Vec::new(),
            run: Run::default(),
            now: 0,
        }
    }

    /// Redis runs the prefetches due at `now`, then their replies land, in time order.
    fn land(&mut self, now: u64) {
        let (c, w, h) = (self.c, self.w, self.plan.headroom);
        self.fetches.sort_by_key(|f| f.runs);
        for f in self
            .fetches
            .iter_mut()
            .filter(|f| f.runs <= now && f.taken.is_none())
        {
            let taken = self.redis.lease(f.runs, c, w, 0, f.want, h).unwrap_or(0);
            f.taken = Some((taken, f.runs));
        }
        let (policy, plan, instances) = (&self.policy, &self.plan, &mut self.instances);
        self.fetches.retain(|f| {
            if f.lands > now {
                return true;
            }
            let (units, granted) = f.taken.unwrap_or((0, 0));
            let entry = &mut instances[f.instance].entry;
            entry.fetching = false;
            let grant = Grant {
                units,
                expires: plan.expiry(policy, f.sent, granted as i64),
                granted: granted as i64,
            };
            entry.granted(grant, ANSWER);
            false
        });
    }

    /// The sweeper of every instance at `now`: gives back expired and idle units, and forgets
    /// a key left empty that is idle or cooling, clearing its leasing bit.
    fn sweep(&mut self, now: u64) {
        let (c, w, period) = (self.c, self.w, self.plan.period);
        for i in self.instances.iter_mut() {
            for r in i.entry.returns(now, period / 4, false) {
                self.redis
                    .return_units(now, c, w, r.units, r.granted as u64);
            }
            let reading = i.heat.read(i.spot, now, period);
            if reading.leasing && i.entry.can_go(now, period / 4, reading.estimate) {
                i.heat.unpin(i.spot);
                i.entry = KeyBook::default();
                self.run.cooled += 1;
            }
        }
    }

    /// `check_now`: spends from the lease of a key that leases, maybe fetching ahead; whether
    /// it answered.
    fn check_now(&mut self, now: u64, instance: usize, cost: u64, delays: (u64, u64)) -> bool {
        let plan = self.plan;
        let i = &mut self.instances[instance];
        if !i.heat.read(i.spot, now, plan.period).leasing || i.entry.take(now, cost).is_none() {
            return false;
        }
        self.run.admitted.push((now, cost, instance));
        i.entry.used(now);
        let estimate = i.heat.touch(i.spot, now, plan.period, cost).estimate;
        if let Some(want) = i.entry.should_prefetch(now, estimate, plan.cap) {
            i.entry.fetching = true;
            self.run.calls += 1;
            self.run.leases += 1;
            self.fetches.push(Fetch {
                instance,
                sent: now,
                runs: now + delays.0,
                lands: now + delays.0 + delays.1,
                want,
                taken: None,
            });
        }
        true
    }

    /// `check`: a cold key is decided alone and gets no entry; a hot one takes a lease unless
    /// one is on its way.
    fn check(&mut self, now: u64, instance: usize, cost: u64) {
        let (plan, c, w) = (self.plan, self.c, self.w);
        let i = &mut self.instances[instance];
        let heat = i.heat.touch(i.spot, now, plan.period, cost);
        let lease = plan.lease_size(heat.estimate, cost, heat.leasing);
        self.run.calls += 1;
        if !heat.leasing && lease.is_none() {
            if self
                .redis
                .lease(now, c, w, cost, cost, plan.headroom)
                .is_some()
            {
                self.run.admitted.push((now, cost, instance));
            }
            return;
        }
        if !heat.leasing {
            assert!(i.heat.pin(i.spot, now, plan.period), "one key per table");
            self.run.heated += 1;
        }
        i.entry.used(now);
        let ask = lease.filter(|_| !i.entry.fetching).unwrap_or(cost);
        self.run.leases += u64::from(ask > cost);
        if let Some(taken) = self.redis.lease(now, c, w, cost, ask, plan.headroom) {
            self.run.admitted.push((now, cost, instance));
            let grant = Grant {
                units: taken - cost,
                expires: plan.expiry(&self.policy, now, now as i64),
                granted: now as i64,
            };
            i.entry.granted(grant, ANSWER);
        }
    }
}

/// What the model answers: only the units matter here.
const ANSWER: Outcome = Outcome {
    allowed: true,
    index: 0,
    remaining: 0,
    reset_after: 0,
    retry_after: None,
};

/// Runs `steps` on `instances` instances deciding with the store's heat rule.
fn simulate(algorithm: Algorithm, c: u64, w: u64, instances: usize, steps: &[Step]) -> Run {
    let mut fleet = Fleet::new(algorithm, c, w, instances);
    for &step in steps {
        fleet.step(step);
    }
    fleet.run
}

impl Fleet {
    /// One step: the gap passes, the replies due land, the sweeper runs if asked, and the
    /// request is decided as the layer does (`check_now`, else `check`).
    fn step(&mut self, (gap, instance, cost, run_delay, land_delay, sweep): Step) {
        self.now += gap;
        let now = self.now;
        self.land(now);
        if sweep {
            self.sweep(now);
        }
        let instance = instance % self.instances.len();
        if !self.check_now(now, instance, cost, (run_delay, land_delay)) {
            self.check(now, instance, cost);
        }
    }
}

const W: u64 = 1_000_000;

/// The limits the cases draw: with a share of 0.25, a cap of 8 to 29 units, so that a key
/// busy enough leases (`HOT` is 4).
const COUNTS: std::ops::Range<u64> = 32..120;

fn steps() -> impl Strategy<Value = Vec<Step>> {
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

/// `held_lease`'s structure with its sizes, times and order drawn at random, a few times over:
/// instance 0 warms up with one request of `warm`, leases with a request of 1 `after` later
/// (about one `period`, when its use over the last period is highest), and spends `late`
/// units of 1 among the others' `burst`, `early` before the lease expires. `steps` rarely
/// builds it, so without this only `held_lease` would notice a bucket missing its headroom.
fn held_leases() -> impl Strategy<Value = (u64, Vec<Step>)> {
    COUNTS.prop_flat_map(|c| {
        let (policy, plan) = leased(Algorithm::Gcra, c, W);
        let (cap, period) = (plan.cap, plan.period);
        // How long a lease taken at 0 lasts.
        let life = plan.expiry(&policy, 0, 0);
        let episode = (
            prop_oneof![Just(0u64), 0..2 * W],
            1..=cap + 1,
            prop_oneof![Just(period), period - period / 16..period + period / 16],
            prop_oneof![Just(1u64), 1..life / 8],
            proptest::collection::vec((1usize..4, 1u64..3), c as usize..3 * c as usize),
            0..=cap + 1,
            0usize..1_000,
            (0u64..2_000, 0u64..2_000),
        );
        let steps = proptest::collection::vec(episode, 1..4).prop_map(move |episodes| {
            let mut steps = Vec::new();
            for (quiet, warm, after, early, burst, late, at, (runs, lands)) in episodes {
                steps.push((quiet, 0, warm, runs, lands, false));
                steps.push((after, 0, 1, runs, lands, false));
                let mut burst: Vec<Step> = burst
                    .into_iter()
                    .map(|(instance, cost)| (0, instance, cost, runs, lands, false))
                    .collect();
                let at = at % (burst.len() + 1);
                burst.splice(at..at, (0..late).map(|_| (0, 0, 1, runs, lands, false)));
                burst[0].0 = life - early;
                steps.extend(burst);
            }
            steps
        });
        (Just(c), steps)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn fixed_windows_never_admit_more_than_the_limit(c in COUNTS, steps in steps()) {
        fits_each_fixed_window(c, &simulate(Algorithm::FixedWindow, c, W, 4, &steps).admitted)?;
    }

    #[test]
    fn sliding_log_windows_never_hold_more_than_the_limit(c in COUNTS, steps in steps()) {
        fits_every_window(c, &simulate(Algorithm::SlidingLog, c, W, 4, &steps).admitted)?;
    }

    #[test]
    fn gcra_admissions_fit_the_bucket(c in COUNTS, steps in steps()) {
        fits_the_bucket(c, &simulate(Algorithm::Gcra, c, W, 4, &steps).admitted)?;
    }

    #[test]
    fn gcra_leases_held_through_a_drain_fit_the_bucket((c, steps) in held_leases()) {
        fits_the_bucket(c, &simulate(Algorithm::Gcra, c, W, 4, &steps).admitted)?;
    }
}

/// Traffic in phases: hot ones (a request every 0 to 8 ms among the phase's instances, far
/// above `HOT` per period of 250 ms) and cold ones (every
/// 60 to 400 ms, under `COLD` per period), each phase on a random subset of the instances,
/// so that each instance's key heats and cools at its own points, with heavy requests now and
/// then. The sweeper runs after every
/// gap of a quarter period or more, as the store's does, and at random besides.
fn phases() -> impl Strategy<Value = Vec<Step>> {
    let phase = (any::<bool>(), 5usize..80, 1usize..16).prop_flat_map(|(hot, n, mask)| {
        let gap = if hot { 0u64..8_000 } else { 60_000u64..400_000 };
        let members: Vec<usize> = (0..4).filter(|i| mask & (1 << i) != 0).collect();
        // Now and then a heavy request, decided alone when no lease would be larger than it.
        let cost = prop_oneof![4 => 1u64..3, 1 => 8u64..40];
        let step = (
            gap,
            proptest::sample::select(members),
            cost,
            (0u64..60_000, 0u64..60_000),
            proptest::bool::weighted(0.05),
        );
        proptest::collection::vec(step, n).prop_map(|steps| {
            let step = |(gap, i, cost, (runs, lands), sweep)| {
                (gap, i, cost, runs, lands, sweep || gap >= 62_500)
            };
            steps.into_iter().map(step).collect::<Vec<Step>>()
        })
    });
    proptest::collection::vec(phase, 2..10).prop_map(|phases| phases.concat())
}

/// Whether `admitted` holds what `algorithm` promises for a limit of `c` per [`W`].
fn holds(
    algorithm: Algorithm,
    c: u64,
    admitted: &[(u64, u64, usize)],
) -> Result<(), TestCaseError> {
    match algorithm {
        Algorithm::Gcra => fits_the_bucket(c, admitted),
        Algorithm::SlidingLog => fits_every_window(c, admitted),
        Algorithm::FixedWindow | Algorithm::SlidingWindow => fits_each_fixed_window(c, admitted),
    }
}

/// The never-over property with keys that switch: each instance's key goes from plain
/// decisions to leases and back many times per case (tallied: both ways, at least once per case
/// on average), and the admissions still fit the limit. The headroom is a property of the
/// policy, so that what a lease spends late is allowed for by every decision, leased or not.
#[test]
fn keys_that_switch_between_leases_and_plain_decisions_never_go_over() {
    use proptest::test_runner::{Config, TestRunner};
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::Gcra,
    ] {
        let mut runner = TestRunner::new(Config::with_cases(200));
        let tally = std::cell::Cell::new((0u64, 0u64, 0u64));
        let case = |(c, steps): (u64, Vec<Step>)| {
            let run = simulate(algorithm, c, W, 4, &steps);
            let (heated, cooled, cases) = tally.get();
            tally.set((heated + run.heated, cooled + run.cooled, cases + 1));
            holds(algorithm, c, &run.admitted)
        };
        if let Err(e) = runner.run(&(COUNTS, phases()), case) {
            panic!("{algorithm:?}: {e}");
        }
        let (heated, cooled, cases) = tally.get();
        eprintln!("{algorithm:?}: {cases} cases, {heated} switches to leases, {cooled} back");
        assert!(
            heated >= cases && cooled >= cases,
            "{algorithm:?}: {heated} switches to leases and {cooled} back in {cases} cases"
        );
    }
}

/// `n` requests of 1 from instance 0, `gap` µs apart, the sweeper running every `sweep`-th.
fn paced(n: usize, gap: u64, sweep: usize) -> Vec<Step> {
    (0..n).map(|i| (gap, 0, 1, 0, 0, i % sweep == 0)).collect()
}

/// The warm key never leases: a key at 2 units per period (GCRA 400/1s, leases of up
/// to 100 units for 250 ms) is decided in Redis, one call a request; at 20 per period it
/// leases, and Redis sees fewer than one call per five requests.
#[test]
fn a_key_leases_at_twenty_units_a_period_and_never_at_two() {
    let warm = simulate(Algorithm::Gcra, 400, W, 1, &paced(200, 125_000, 1));
    eprintln!(
        "2 a period: {warm:?}",
        warm = (warm.calls, warm.leases, warm.heated)
    );
    assert_eq!((warm.heated, warm.leases, warm.calls), (0, 0, 200));
    let hot = simulate(Algorithm::Gcra, 400, W, 1, &paced(200, 12_500, 5));
    eprintln!(
        "20 a period: {hot:?}",
        hot = (hot.calls, hot.leases, hot.heated)
    );
    assert_eq!(hot.heated, 1);
    assert!(hot.calls * 5 < 200, "{} calls for 200 requests", hot.calls);
}

/// A key that cools from 20 units a period to 1 stops fetching leases, spends or gives back
/// what it holds, and once the sweeper runs, right at a request (so the key is not idle: it
/// is cooling), its entry and leasing bit are gone; Redis then counts exactly the units
/// admitted (a fixed window of a minute, leases of up to 10 000 units for 1 s).
#[test]
fn a_cooling_key_stops_leasing_and_gives_its_units_back() {
    let mut fleet = Fleet::new(Algorithm::FixedWindow, 40_000, 60 * W, 1);
    paced(100, 50_000, 5)
        .into_iter()
        .for_each(|s| fleet.step(s));
    assert_eq!(fleet.run.heated, 1, "the hot key leases");
    // No sweep meanwhile: the sweeper would find the key idle between two requests.
    let trickle = [(W, 0, 1, 0, 0, false); 20];
    trickle[..3].iter().for_each(|&s| fleet.step(s));
    let leases = fleet.run.leases;
    trickle[3..].iter().for_each(|&s| fleet.step(s));
    let late = fleet.run.leases - leases;
    eprintln!("{late} leases taken at one unit a period");
    assert_eq!(late, 0, "a cooling key fetched {late} leases");
    fleet.sweep(fleet.now);
    let i = &fleet.instances[0];
    let leasing = i.heat.read(i.spot, fleet.now, W).leasing;
    eprintln!("swept: {} cooled, leasing bit {leasing}", fleet.run.cooled);
    assert_eq!(fleet.run.cooled, 1, "the cooled key keeps its entry");
    assert!(i.entry.is_empty() && !leasing);
    let admitted: u64 = fleet.run.admitted.iter().map(|&(_, k, _)| k).sum();
    assert!(matches!(fleet.redis, Model::Fixed(_, count) if count == admitted));
}

/// Whether no fixed window of [`W`] holds more than `c` units admitted.
fn fits_each_fixed_window(c: u64, admitted: &[(u64, u64, usize)]) -> Result<(), TestCaseError> {
    let mut per_window = std::collections::BTreeMap::new();
    for &(t, units, _) in admitted {
        *per_window.entry(window_start(t, W)).or_insert(0) += units;
    }
    for (start, units) in per_window {
        prop_assert!(units <= c, "{units} > {c} in the window at {start}");
    }
    Ok(())
}

/// Whether `admitted` fits a leaky bucket of `c` per `W`: for every s <= t, units admitted in
/// [s, t] times `W` is at most c * (t - s + W).
fn fits_the_bucket(c: u64, admitted: &[(u64, u64, usize)]) -> Result<(), TestCaseError> {
    for (i, &(s, _, _)) in admitted.iter().enumerate() {
        let mut units = 0u128;
        for &(t, k, _) in &admitted[i..] {
            units += u128::from(k);
            prop_assert!(
                units * u128::from(W) <= u128::from(c) * u128::from(t - s + W),
                "{units} units in [{s}, {t}] exceed a bucket of {c} per {W} us"
            );
        }
    }
    Ok(())
}

/// Whether no window `(t − W, t]` ending at an admission holds more than `c` units admitted:
/// the fullest window of any placement ends at an admission.
fn fits_every_window(c: u64, admitted: &[(u64, u64, usize)]) -> Result<(), TestCaseError> {
    for (i, &(t, _, _)) in admitted.iter().enumerate() {
        let units: u64 = admitted[..=i]
            .iter()
            .filter(|&&(s, _, _)| s + W > t)
            .map(|&(_, k, _)| k)
            .sum();
        prop_assert!(
            units <= c,
            "{units} units in ({}, {t}] exceed {c}",
            t as i64 - W as i64
        );
    }
    Ok(())
}

/// The interleaving the log's longer window is for: instance 0 leases at `t0` and spends what
/// it holds just before the lease expires, while the others fill the key just after `t0`'s
/// event has left a window of `W`.
///
/// - At 0, instance 0 asks for `cap` units in one request, decided alone (a lease of no more
///   than the cost is no lease), so that its use over the last `period` is `cap` at
///   `t0 = period`.
/// - At `t0`, a request of 1 from instance 0 leases `cap` units (it spends 1, holds `cap - 1`).
/// - At `t1`, 1 µs before the lease expires, instance 0 spends its `cap - 1` units.
/// - At `t0 + W + 1`, when neither the warm-up nor the lease is in `(now − W, now]`, the
///   other instances ask for all `c` units at once, then for what is left after the lease,
///   `c − cap`. (A fetch ahead of need that the spending at `t1` starts runs only after all
///   that: one logged at `t1` would refuse the first request with or without the longer
///   window.)
///
/// Without the longer window the first takes all `c` units (the log reads nothing in its last
/// `W`), and the window `(t1 − 1, t1 − 1 + W]` holds them and instance 0's `cap - 1`. With it,
/// the lease logged at `t0` still counts at `t0 + W + 1` (`h = period`): the first is refused
/// and the second admitted.
fn late_spender(c: u64, instances: usize) -> Vec<Step> {
    let (policy, plan) = leased(Algorithm::SlidingLog, c, W);
    let t0 = plan.period;
    let t1 = plan.expiry(&policy, t0, t0 as i64) - 1;
    let mut steps = vec![(0, 0, plan.cap, 0, 0, false), (t0, 0, 1, 0, 0, false)];
    let never = 10 * W;
    steps.push((t1 - t0, 0, 1, never, 0, false));
    steps.extend((1..plan.cap - 1).map(|_| (0, 0, 1, never, 0, false)));
    steps.push((t0 + W + 1 - t1, 1, c, 0, 0, false));
    steps.push((0, instances - 1, c - plan.cap, 0, 0, false));
    steps
}

/// The units of the admissions `(time, units, instance)` that `which` picks.
fn units_of(admitted: &[(u64, u64, usize)], which: impl Fn(u64, usize) -> bool) -> u64 {
    let picked = admitted.iter().filter(|&&(t, _, i)| which(t, i));
    picked.map(|&(_, units, _)| units).sum()
}

/// The cases of the late-spending tests: 2 to 4 instances, `c` in [`COUNTS`], the plan of `c`
/// per `W` under `algorithm`, and `t1`, the last µs of a lease taken at `plan.period`.
fn late_spending_cases(algorithm: Algorithm) -> impl Iterator<Item = (usize, u64, Plan, u64)> {
    (2..=4).flat_map(move |instances| {
        COUNTS.map(move |c| {
            let (policy, plan) = leased(algorithm, c, W);
            let t1 = plan.expiry(&policy, plan.period, plan.period as i64) - 1;
            (instances, c, plan, t1)
        })
    })
}

#[test]
fn the_log_counts_a_lease_spent_late_in_every_window_it_is_spent_in() {
    for (instances, c, plan, t1) in late_spending_cases(Algorithm::SlidingLog) {
        let steps = late_spender(c, instances);
        let admitted = simulate(Algorithm::SlidingLog, c, W, instances, &steps).admitted;
        if let Err(e) = fits_every_window(c, &admitted) {
            panic!("{instances} instances, c = {c}: {e}");
        }
        // The case still builds what it is for: instance 0 spends its lease at `t1`.
        let late = units_of(&admitted, |t, i| t == t1 && i == 0);
        assert_eq!(late + 1, plan.cap, "{instances} instances, c = {c}");
        // And the others only what the longer window leaves them.
        let others = units_of(&admitted, |_, i| i != 0);
        assert_eq!(others, c - plan.cap, "{instances} instances, c = {c}");
    }
}

/// The interleaving GCRA's headroom is for, which random traffic rarely builds: instance 0
/// holds a full lease through a drain while the others fill the bucket, then spends it late.
///
/// - At 0, instance 0 asks for `cap` units in one request, decided alone (a lease of no more
///   than the cost is no lease), so that its use over the last `period` is `cap` at
///   `t0 = period`.
/// - At `t0`, a request of 1 from instance 0 leases `cap` units (it spends 1, holds `cap - 1`).
///   The warm-up has drained by then (`cap` is at most `c / 4`, `h = period = w / 4`), so the
///   bucket holds the lease alone.
/// - At `t1`, 1 µs before the lease expires (`plan.expiry`, `h` after `t0`), the lease has
///   drained too: the bucket is all but empty, and the other instances fill it with requests
///   of 1, `2 * c` of them so that each spends whatever it leased on the way.
/// - Still at `t1`, instance 0 spends its `cap - 1` units, counted at `t0`.
///
/// Without the headroom the others take the whole burst at `t1` but what the lease's last µs
/// of drain leaves (`c - 1` units when `c / 4` is whole, `c` otherwise), and the instant admits
/// `c + cap - 2` or `c + cap - 1`: more than `c` for every `c` here. With it they take at most
/// `(w - h) * c / w`, and the `h * c / w >= cap` units kept free are what instance 0 spends.
fn held_lease(c: u64, instances: usize) -> Vec<Step> {
    let (policy, plan) = leased(Algorithm::Gcra, c, W);
    let t0 = plan.period;
    let t1 = plan.expiry(&policy, t0, t0 as i64) - 1;
    let mut steps = vec![(0, 0, plan.cap, 0, 0, false), (t0, 0, 1, 0, 0, false)];
    let mut gap = t1 - t0;
    for i in 0..2 * c as usize {
        let instance = 1 + i % (instances - 1);
        steps.push((std::mem::take(&mut gap), instance, 1, 0, 0, false));
    }
    steps.extend((0..plan.cap).map(|_| (0, 0, 1, 0, 0, false)));
    steps
}

#[test]
fn gcra_keeps_room_for_a_lease_spent_late_after_a_burst() {
    for (instances, c, plan, t1) in late_spending_cases(Algorithm::Gcra) {
        let steps = held_lease(c, instances);
        let admitted = simulate(Algorithm::Gcra, c, W, instances, &steps).admitted;
        if let Err(e) = fits_the_bucket(c, &admitted) {
            panic!("{instances} instances, c = {c}: {e}");
        }
        // The case still builds what it is for: instance 0 spends its lease at `t1`.
        let late = units_of(&admitted, |t, i| t == t1 && i == 0);
        assert!(
            late + 1 >= plan.cap,
            "{instances} instances, c = {c}: instance 0 spent {late} units at {t1}, \
             not the {} it leased at {}",
            plan.cap - 1,
            plan.period
        );
    }
}
