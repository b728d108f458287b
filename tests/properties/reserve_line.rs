//! The line of reservations as a property, on the memory store and a manual clock: callers
//! that reserve, leave at random moments, and learn where they stand only when they look (every
//! `recheck`, one of a few rates as on instances set up alike or not, and at the turn they know
//! of), with pauses in between. Whatever the schedule,
//! the units used, at the times their callers went, keep every limit (each window of the
//! sliding log; GCRA's bucket, checked by its virtual scheduling): callers that learn of a move
//! late would go late, which the check sees (the leave's notice covers the time a caller takes
//! to learn of a move). Callers whose tickets carry a `late` are taken out of the line by the
//! look that finds their turn at most that far ahead, sleep the rest, and go anywhere up to
//! `late` after their turns (the network's delay to the upstream): the limits hold at those
//! times too, also where callers' lates differ (instances whose margins differ).

use std::time::{Duration, UNIX_EPOCH};

use futures::executor::block_on;
use proptest::prelude::*;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::test_util::turn;
use tower_redis_ratelimit::test_util::{Reserve, Ticket};
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy};

const MS: u64 = 1_000;

#[derive(Debug, Clone)]
enum Step {
    /// Callers reserve.
    Reserve(usize),
    /// The caller at this index (of those waiting, modulo) leaves.
    Leave(usize),
    /// An upstream pushes back: the key pauses this many ms.
    Pause(u64),
    /// Time passes (ms): callers look and go as it does.
    Pass(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1usize..6).prop_map(Step::Reserve),
        3 => (0usize..100).prop_map(Step::Leave),
        1 => (50u64..1500).prop_map(Step::Pause),
        4 => (1u64..700).prop_map(Step::Pass),
    ]
}

/// A caller waiting for its turn, as it knows it.
struct Caller {
    ticket: Ticket,
    /// How often it looks (callers of other instances may look at other rates).
    recheck: u64,
    /// Its turn, as it last learned (µs on the store's clock).
    turn: u64,
    /// When it looks next.
    next_look: u64,
}

/// The run of one schedule: the store, its clock, the callers waiting, the times units were
/// used, and the time now (µs since the clock's start).
struct Run {
    store: MemoryStore,
    clock: ManualClock,
    key: Key,
    policy: Policy,
    /// How often callers look: each caller takes the next of these in turn.
    rechecks: Vec<u64>,
    /// How late after its turn a caller may go (µs): each caller takes the next of these in
    /// turn (instances with other margins).
    lates: Vec<u64>,
    now: u64,
    next_id: u64,
    waiting: Vec<Caller>,
    used: Vec<u64>,
}

impl Run {
    /// A caller's ticket, and how often it looks: it learns of a move at its next look, at
    /// most that much later.
    fn ticket(&mut self) -> (Ticket, u64) {
        self.next_id += 1;
        let id = 1_000_000_000_000_000 + self.next_id;
        let recheck = self.rechecks[self.next_id as usize % self.rechecks.len()];
        let late = self.lates[self.next_id as usize / 2 % self.lates.len()];
        // As the layer's: it learns of a move at its next look, and may go `late` after.
        let ticket = Ticket {
            late: Duration::from_micros(late),
            notice: Duration::from_micros(recheck + late),
            ..Ticket::new(id, Duration::from_secs(600))
        };
        (ticket, recheck)
    }

    fn reserve(&mut self) {
        let (ticket, recheck) = self.ticket();
        let d = block_on(self.store.reserve(&self.key, &self.policy, ticket)).unwrap();
        assert!(d.is_allowed(), "{d:?}");
        let turn = self.now + turn(&d).as_micros() as u64;
        let next_look = turn.min(self.now + recheck);
        self.waiting.push(Caller {
            ticket,
            recheck,
            turn,
            next_look,
        });
    }

    fn leave(&mut self, i: usize) {
        let caller = self.waiting.remove(i);
        block_on(self.store.leave(&self.key, &self.policy, caller.ticket)).unwrap();
    }

    /// Moves the clock to `to`, the callers looking (and going) at their times, in order.
    fn pass_to(&mut self, to: u64) {
        loop {
            let next = self
                .waiting
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| c.next_look)
                .map(|(i, c)| (i, c.next_look));
            let Some((i, at)) = next.filter(|&(_, at)| at <= to) else {
                break;
            };
            self.clock.advance(Duration::from_micros(at - self.now));
            self.now = at;
            self.look(i);
        }
        self.clock.advance(Duration::from_micros(to - self.now));
        self.now = to;
    }

    /// Caller `i` looks where it stands: it goes at its turn, follows a move, or reserves
    /// again after a pause that falls after its turn.
    fn look(&mut self, i: usize) {
        let caller = &self.waiting[i];
        let stood = block_on(self.store.look(&self.key, &self.policy, caller.ticket)).unwrap();
        let paused = stood.paused.as_micros() as u64;
        let turn = stood.turn.map(|t| t.as_micros() as u64);
        if paused > 0 && turn.is_none_or(|t| t < paused) {
            self.leave(i);
            self.reserve();
            return;
        }
        let turn = turn.expect("a caller waiting is in line");
        let caller = &mut self.waiting[i];
        let late = caller.ticket.late.as_micros() as u64;
        if turn <= late {
            // Its turn is at most `late` ahead (at the latest now: a move it learns of only
            // now is to a place the leave's notice kept at least as far as this look): the look
            // took it out of the line. It sleeps until its turn and goes, up to `late` after
            // it (a delay of its own, as a network's); a caller that went later would show in
            // the limits' check.
            let delay = caller.ticket.id.wrapping_mul(7919) % (late + 1);
            self.used.push(self.now + turn + delay);
            self.waiting.remove(i);
            return;
        }
        caller.turn = self.now + turn;
        caller.next_look = caller.turn.min(self.now + caller.recheck);
    }
}

/// Whether the units used at `used` keep limit `count` per `window` µs: every window of the
/// sliding log, GCRA's virtual scheduling for a bucket of `count` draining `count` per window.
fn keeps(algorithm: Algorithm, used: &[u64], count: u64, window: u64) -> Result<(), String> {
    let mut used = used.to_vec();
    used.sort_unstable();
    match algorithm {
        Algorithm::SlidingLog => {
            for &t in &used {
                let held = used.iter().filter(|&&s| s <= t && s + window > t).count() as u64;
                if held > count {
                    return Err(format!(
                        "{held} units in ({}, {t}]",
                        t.saturating_sub(window)
                    ));
                }
            }
        }
        _ => {
            let u = window as f64 / count as f64;
            let tau = (count - 1) as f64 * u;
            let mut tat = f64::MIN;
            for &t in &used {
                let t = t as f64;
                if t + 1.0 < tat - tau {
                    return Err(format!("a unit at {t} before {}", tat - tau));
                }
                tat = tat.max(t) + u;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn units_used_at_their_turns_keep_every_limit(
        log in any::<bool>(),
        count in 1u64..6,
        window_ms in 100u64..2000,
        spacing in proptest::option::of(10u64..200),
        rechecks_ms in proptest::collection::vec(20u64..300, 1..4),
        lates_ms in proptest::collection::vec(prop_oneof![Just(0u64), 1u64..60], 1..3),
        steps in proptest::collection::vec(step(), 1..50),
    ) {
        let algorithm = if log { Algorithm::SlidingLog } else { Algorithm::Gcra };
        let mut limits = vec![format!("{count}/{window_ms}ms").parse().unwrap()];
        // A second limit spaces the turns (a policy takes each window once).
        if let Some(ms) = spacing.filter(|&ms| ms != window_ms) {
            limits.push(format!("1/{ms}ms").parse().unwrap());
        }
        let policy = Policy::new("api", limits.clone()).unwrap().with_algorithm(algorithm);
        // GCRA keeps `late` of drain free in every bucket: a bucket of one has none to spare.
        let late_ms = lates_ms.iter().copied().max().unwrap_or(0);
        let spares = |count: u64, ms: u64| (ms - late_ms.min(ms)) * count >= ms;
        let gcra_spares = spares(count, window_ms)
            && spacing.filter(|&ms| ms != window_ms).is_none_or(|ms| spares(1, ms));
        let lates_ms = if log || gcra_spares { lates_ms } else { vec![0] };
        let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        let mut run = Run {
            store: MemoryStore::builder().clock(clock.clone()).build(),
            clock,
            key: Key::from("k"),
            policy,
            rechecks: rechecks_ms.iter().map(|ms| ms * MS).collect(),
            lates: lates_ms.iter().map(|ms| ms * MS).collect(),
            now: 0,
            next_id: 0,
            waiting: Vec::new(),
            used: Vec::new(),
        };
        for step in steps {
            match step {
                Step::Reserve(n) => (0..n).for_each(|_| run.reserve()),
                Step::Leave(i) if !run.waiting.is_empty() => {
                    let i = i % run.waiting.len();
                    run.leave(i);
                }
                Step::Leave(_) => {}
                Step::Pause(ms) => {
                    let pause = Duration::from_millis(ms);
                    block_on(run.store.pause(&run.key, &run.policy, pause)).unwrap();
                }
                Step::Pass(ms) => run.pass_to(run.now + ms * MS),
            }
        }
        // Everyone still waiting goes.
        while let Some(last) = run.waiting.iter().map(|c| c.next_look).max() {
            run.pass_to(last);
        }
        for limit in &limits {
            let (c, w) = (limit.count(), limit.window().as_micros() as u64);
            if let Err(broke) = keeps(algorithm, &run.used, c, w) {
                return Err(TestCaseError::fail(format!("{algorithm:?} {c}/{w}us: {broke}")));
            }
        }
    }
}
