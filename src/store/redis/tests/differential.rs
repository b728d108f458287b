//! A differential property test: the algorithms the memory store runs (`src/model/`) and
//! the scripts a real Redis runs, fed the same random sequences of decisions, charges and
//! refunds at the same instants, decide alike to the microsecond; and neither admits more
//! than a brute-force model of the algorithm's definition allows.
//!
//! The scripts take an explicit event time (prelude.lua), which the stores use only for the
//! sliding log: here every request carries one, so that both sides see the same clock. The
//! algorithms run in the future: their state's creation time, Redis' own, then precedes every
//! admission, as it does in production, and the sliding log, which Redis trims twice its
//! longest window before its own time, keeps every event on both sides. Windows are a minute
//! or longer, so that no key expires in the real time a case takes.
//!
//! Every case runs three ways: every request on the full scripts, every request on the plain
//! tier (`scripts/plain.lua`; what it does not decide it answers `FULL_PATH`, and the request
//! goes to the full script, as the store sends it on), and the two tiers in turn, step by step,
//! so that each reads the state the other wrote. All three decide as the model.
//!
//! The range covers what the parser accepts: counts up to 2^50, windows from a minute to ten
//! years, costs up to `u32::MAX`, usage up to `u64::MAX` (2^53 ± 1, 2^63 included); the
//! monthly budget that once wrapped (`5000000/30d`, a million at a time) is a fixed case.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use fred::prelude::{Builder, ClientLike, Config};
use fred::types::{ClusterHash, CustomCommand, Value};
use proptest::prelude::*;
use proptest::test_runner::{Config as Cases, TestCaseError, TestRunner};

use crate::model::{
    decide, fixed_window::FixedWindow, gcra::Gcra, settle, sliding_log::SlidingLog,
    sliding_window::SlidingWindow, window_start, Algorithm, AlgorithmState, Outcome, Refund,
    Settle, Window,
};
use crate::store::redis::scripts::{self, Tier};
use crate::store::redis::wire::{self, Record, FULL_PATH, INT};
use crate::{Limit, Policy};

/// A `redis-server` of this test's own on a free port, killed when dropped.
pub(super) struct Server {
    child: Child,
    pub(super) port: u16,
}

impl Server {
    pub(super) fn start() -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let binary = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs");
        Server { child, port }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Op {
    /// A decision of this cost.
    Check(u32),
    /// A charge of this usage.
    Charge(u64),
    /// A refund of up to this many units of the `n`-th admitted request (modulo their number),
    /// once per request.
    Refund(usize, u64),
    /// Other counts for the same windows from now on, the first of these for the first limit
    /// and so on: the policy's own (`Policy::with_limits`), an override's that the arguments
    /// carry (kind COUNTS, `prelude.lua`), or the override gone (its counts unused).
    Recount(Vec<u64>, Counts),
}

/// Whose counts an [`Op::Recount`] changes.
#[derive(Debug, Clone, Copy)]
enum Counts {
    Own,
    Override,
    NoOverride,
}

/// Which scripts a case's requests go to (see the module's docs).
#[derive(Debug, Clone, Copy)]
enum Ways {
    Full,
    Plain,
    /// The plain tier for even steps, the full scripts for odd ones, and the look after each
    /// step on the other.
    Alternate,
}

impl Ways {
    fn tier(self, step: usize) -> Tier {
        match self {
            Ways::Full => Tier::Full,
            Ways::Plain => Tier::Plain,
            Ways::Alternate if step.is_multiple_of(2) => Tier::Plain,
            Ways::Alternate => Tier::Full,
        }
    }
}

/// The counts of an override that the arguments carry: count and scale of each limit.
type Overriding = Option<Vec<[i64; 2]>>;

/// The state of one key on the Rust side, as the memory store keeps it.
enum Model {
    Log(SlidingLog),
    Sliding(SlidingWindow),
    Fixed(FixedWindow),
    Gcra(Gcra),
}

impl Model {
    fn new(algorithm: Algorithm) -> Model {
        match algorithm {
            Algorithm::SlidingLog => Model::Log(SlidingLog::default()),
            Algorithm::SlidingWindow => Model::Sliding(SlidingWindow::default()),
            Algorithm::FixedWindow => Model::Fixed(FixedWindow::default()),
            Algorithm::Gcra => Model::Gcra(Gcra::default()),
        }
    }

    /// `f` over the algorithm's state. The log is not trimmed: every event of a case is in the
    /// future, after the cut-off of the script's trim (twice the longest window before now).
    fn with<R>(&mut self, f: impl FnOnce(&mut dyn Lim) -> R) -> R {
        match self {
            Model::Log(log) => f(log),
            Model::Sliding(s) => f(s),
            Model::Fixed(s) => f(s),
            Model::Gcra(s) => f(s),
        }
    }
}

/// [`decide`] and [`settle`] behind one object-safe trait.
trait Lim {
    fn decide(&mut self, t: u64, windows: &[Window], cost: u64, record: bool) -> Outcome;
    fn settle(&mut self, t: u64, windows: &[Window], change: Settle);
}

impl<L: AlgorithmState> Lim for L {
    fn decide(&mut self, t: u64, windows: &[Window], cost: u64, record: bool) -> Outcome {
        decide(self, t, windows, cost, record)
    }

    fn settle(&mut self, t: u64, windows: &[Window], change: Settle) {
        settle(self, t, windows, change)
    }
}

/// The scripts' side: one connection, one key per case, and what the plain tier did.
struct Scripts {
    client: fred::clients::Client,
    /// Requests the plain tier decided, settlements it sent on to the full scripts, and
    /// decisions it sent on.
    plain: std::cell::Cell<u64>,
    sent_on: std::cell::Cell<u64>,
    decisions_sent_on: std::cell::Cell<u64>,
}

/// A request's arguments (`wire::encode`) carrying `overriding` counts as an override the store
/// knows at generation 0 (the hash of overrides does not exist: `prelude.lua` trusts it).
fn encode(
    cost: u64,
    record: Record,
    t: i64,
    windows: &[Window],
    overriding: &Overriding,
) -> Vec<u8> {
    let mut args = wire::encode(cost, record, t, [0; 4], windows);
    if let Some(counts) = overriding {
        // known (the 9th integer) and kind (the 10th): COUNTS, then the counts last.
        args[8 * INT..9 * INT].copy_from_slice(&0i64.to_le_bytes());
        args[9 * INT..10 * INT].copy_from_slice(&(-2i64).to_le_bytes());
        for value in counts.iter().flatten() {
            args.extend_from_slice(&value.to_le_bytes());
        }
    }
    args
}

impl Scripts {
    /// The reply of `tier`'s script to one request at `t` (-1: now), or its error.
    #[allow(clippy::too_many_arguments)]
    async fn eval(
        &self,
        (algorithm, tier): (Algorithm, Tier),
        key: &str,
        cost: u64,
        record: Record,
        t: i64,
        windows: &[Window],
        overriding: &Overriding,
    ) -> Result<Bytes, fred::error::Error> {
        let script = scripts::source(algorithm, tier);
        let mut args = encode(cost, record, t, windows, overriding);
        let eval = CustomCommand::new_static("EVAL", ClusterHash::FirstKey, false);
        // No override is ever set: the hash of overrides does not exist. The plain tier (of an
        // algorithm that has one) is confirmed at the request's own generation, for ever, and
        // sent what the store sends it of the request (`wire::plain_args`).
        let plain = tier == Tier::Plain && scripts::Scripts::has_plain(algorithm);
        let overrides = match plain {
            false => Value::from("overrides"),
            true => {
                let known = &args[8 * INT..9 * INT];
                let generation = i64::from_le_bytes(known.try_into().unwrap());
                let confirmation = [known, &i64::MAX.to_le_bytes()].concat();
                args = wire::plain_args(&args, 1, generation);
                Value::Bytes(Bytes::from(confirmation))
            }
        };
        let values = vec![
            Value::from(script),
            Value::from(1),
            Value::from(key),
            Value::Bytes(Bytes::from(args)),
            overrides,
            Value::Bytes(Bytes::new()),
        ];
        self.client.custom(eval, values).await
    }

    /// The outcome of one request at `t` on `tier`, sent on to the full script where the plain
    /// tier answers `FULL_PATH` (as the store does).
    #[allow(clippy::too_many_arguments)]
    async fn call(
        &self,
        (algorithm, tier): (Algorithm, Tier),
        key: &str,
        cost: u64,
        record: Record,
        t: u64,
        windows: &[Window],
        overriding: &Overriding,
    ) -> Outcome {
        let t = t as i64;
        let eval = |tier| self.eval((algorithm, tier), key, cost, record, t, windows, overriding);
        let mut reply = eval(tier).await.expect("EVAL");
        let int = |reply: &Bytes, i: usize| {
            i64::from_le_bytes(reply[8 * i..8 * i + 8].try_into().unwrap())
        };
        if tier == Tier::Plain && scripts::Scripts::has_plain(algorithm) {
            if int(&reply, 1) == FULL_PATH {
                let sent_on = match record {
                    Record::Settle { .. } => &self.sent_on,
                    _ => &self.decisions_sent_on,
                };
                sent_on.set(sent_on.get() + 1);
                reply = eval(Tier::Full).await.expect("EVAL");
            } else {
                self.plain.set(self.plain.get() + 1);
            }
        }
        let int = |i: usize| int(&reply, i);
        let retry = int(4);
        Outcome {
            allowed: int(0) >= 1,
            index: int(1) as usize,
            remaining: int(2) as u64,
            reset_after: int(3) as u64,
            retry_after: (retry >= 0).then_some(retry as u64),
        }
    }
}

/// What was recorded, raw (uncapped, in u128), for the brute-force models: events of
/// `(time, units)`, admissions first with their cost, a refund lowering its own.
#[derive(Default)]
struct History {
    events: Vec<(u64, u128)>,
    /// Whether a charge went past what the algorithm holds exactly (GCRA past a bucket, the
    /// log near its 2^52 units), so that both sides may saturate where the model does not.
    saturated: bool,
    /// The units charged, each at most the largest count and one.
    charged: u128,
    /// Whether GCRA's counts changed, after which the model (one rate throughout) no longer
    /// holds; the two sides must still agree.
    recounted: bool,
}

impl History {
    fn units_in(&self, from: u64, to: u64) -> u128 {
        let inside = |&&(e, _): &&(u64, u128)| from <= e && e <= to;
        self.events.iter().filter(inside).map(|&(_, u)| u).sum()
    }

    /// Whether the definition admits `cost` at `t` under every limit.
    fn admits(&self, algorithm: Algorithm, t: u64, windows: &[Window], cost: u64) -> bool {
        let cost = u128::from(cost);
        windows.iter().all(|w| {
            let (c, wu) = (u128::from(w.count), u128::from(w.micros));
            match algorithm {
                // Units in (t - w, t].
                Algorithm::SlidingLog => {
                    self.units_in((t + 1).saturating_sub(w.micros), t) + cost <= c
                }
                // The counters never hold more than c in a fixed window.
                Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                    let start = window_start(t, w.micros);
                    self.units_in(start, t) + cost <= c
                }
                // A bucket of c draining c per w: the units since any earlier event, with
                // this one, drain within the time since plus one window.
                Algorithm::Gcra if self.recounted => true,
                Algorithm::Gcra => {
                    let starts = self.events.iter().map(|&(s, _)| s).chain([t]);
                    starts.filter(|&s| s <= t).all(|s| {
                        let units = self.units_in(s, t) + cost;
                        units * wu <= c * (u128::from(t - s) + wu)
                    })
                }
            }
        })
    }
}

/// A case: an algorithm, its limits, and the steps with the time before each.
#[derive(Debug, Clone)]
struct Case {
    algorithm: Algorithm,
    limits: Vec<(u64, u64)>,
    steps: Vec<(u64, Op)>,
    /// The time of the first step (µs since the epoch); `None`: as the module's docs say.
    start: Option<u64>,
}

/// What the cases exercised, printed at the end so that a run shows it tested something.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    cases: u64,
    out_of_range: u64,
    admitted: u64,
    refused: u64,
    charges: u64,
    refunds: u64,
    recounts: u64,
    /// Changes of an override's counts (set or gone).
    overrides: u64,
}

/// Runs one case on both sides three ways ([`Ways`]); `key` names its Redis keys.
async fn run(
    scripts: &Scripts,
    key: &str,
    case: &Case,
    tally: &std::cell::Cell<Tally>,
) -> Result<(), TestCaseError> {
    for ways in [Ways::Full, Ways::Plain, Ways::Alternate] {
        let mut counts = tally.get();
        let key = format!("{key} {ways:?}");
        let result = run_counted(scripts, &key, case, &mut counts, ways).await;
        tally.set(counts);
        result?;
    }
    Ok(())
}

async fn run_counted(
    scripts: &Scripts,
    key: &str,
    case: &Case,
    tally: &mut Tally,
    ways: Ways,
) -> Result<(), TestCaseError> {
    tally.cases += 1;
    let limits = case
        .limits
        .iter()
        .map(|&(c, ms)| Limit::new(c, Duration::from_millis(ms)).expect("limits in range"));
    let Ok(policy) = Policy::new("d", limits) else {
        return Ok(()); // two limits of one window
    };
    let policy = policy.with_algorithm(case.algorithm);
    if policy.out_of_range().is_some() {
        tally.out_of_range += 1;
        return Ok(()); // refused by both stores, tested apart
    }
    let mut policy = policy;
    // The policy's own windows, which the arguments carry; the override that decides instead
    // where one is set; and the windows the model decides by (the override's, or the own).
    let mut own = policy.windows().to_vec();
    let mut over: Option<Policy> = None;
    let mut overriding: Overriding = None;
    let mut windows = own.clone();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    // In the future (see the module's docs).
    let mut t = case.start.unwrap_or(now + 3_600_000_000);
    let (mut state, mut history) = (Model::new(case.algorithm), History::default());
    // Admissions that may still be refunded: (time, cost, index in history).
    let mut admitted: Vec<Option<(u64, u64, usize)>> = vec![];
    for (step, (gap, op)) in case.steps.iter().enumerate() {
        t += gap;
        let at = format!("step {step} at +{} us: {op:?} ({ways:?})", t);
        let script = (case.algorithm, ways.tier(step));
        let (sent, carried) = (&own[..], &overriding);
        match *op {
            Op::Check(cost) => {
                let cost = u64::from(cost);
                let windows = &windows[..];
                let allowed_by_model = history.admits(case.algorithm, t, windows, cost);
                let ours = state.with(|s| s.decide(t, windows, cost, true));
                let theirs = scripts
                    .call(script, key, cost, Record::Admit, t, sent, carried)
                    .await;
                prop_assert_eq!(ours, theirs, "{}", at);
                tally.admitted += u64::from(ours.allowed);
                tally.refused += u64::from(!ours.allowed);
                if ours.allowed {
                    prop_assert!(
                        allowed_by_model || history.saturated,
                        "{}: admitted past the definition",
                        at
                    );
                    if cost > 0 {
                        history.events.push((t, u128::from(cost)));
                    }
                    admitted.push(Some((t, cost, history.events.len().wrapping_sub(1))));
                }
            }
            // A settle of nothing is never sent (`Store::settle`).
            Op::Charge(0) => {}
            Op::Charge(units) => {
                let windows = &windows[..];
                tally.charges += 1;
                state.with(|s| s.settle(t, windows, Settle::Charge(units)));
                let record = Record::Settle {
                    refund: false,
                    admitted: -1,
                    recorded: 0,
                    headroom: 0,
                    drains: -1,
                };
                scripts
                    .call(script, key, units, record, t, sent, carried)
                    .await;
                // The log records an event of at most the largest count and one (no decision
                // under these counts tells more), and counts it so after a change of counts.
                let largest = windows.iter().map(|w| w.count).max().unwrap_or(0);
                let weight = match case.algorithm {
                    Algorithm::SlidingLog => units.min(largest + 1),
                    _ => units,
                };
                history.events.push((t, u128::from(weight)));
                // GCRA saturates its backlog at 2^52 (at least three buckets), and the log
                // its units at 2^52: past those the model, which does not, is stricter than
                // both sides.
                history.charged += u128::from(units.min(largest + 1));
                history.saturated |= match case.algorithm {
                    Algorithm::Gcra => units > largest,
                    Algorithm::SlidingLog => history.charged > 1 << 51,
                    _ => false,
                };
            }
            Op::Recount(_, Counts::NoOverride) => {
                let gone = over.take().is_some();
                tally.overrides += u64::from(gone);
                history.recounted |= gone && case.algorithm == Algorithm::Gcra;
                windows = own.clone();
            }
            Op::Recount(ref counts, whose) => {
                let limits = policy.limits().iter().zip(counts).map(|(limit, &count)| {
                    Limit::new(count, limit.window()).expect("counts in range")
                });
                let other = policy.with_limits(limits).expect("the same windows");
                if other.out_of_range().is_some() {
                    continue;
                }
                match whose {
                    Counts::Override => tally.overrides += 1,
                    _ => tally.recounts += 1,
                }
                // Only GCRA's state depends on the counts (its units are count-scaled).
                history.recounted |= match case.algorithm {
                    Algorithm::Gcra => true,
                    Algorithm::SlidingLog | Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                        false
                    }
                };
                if matches!(whose, Counts::Override) {
                    over = Some(other);
                } else {
                    policy = other;
                    own = policy.windows().to_vec();
                }
                windows = over.as_ref().unwrap_or(&policy).windows().to_vec();
            }
            Op::Refund(n, units) => {
                let windows = &windows[..];
                let Some(slot) = (!admitted.is_empty()).then(|| n % admitted.len()) else {
                    continue;
                };
                let Some((at, recorded, event)) = admitted[slot].take() else {
                    continue;
                };
                let units = units.min(recorded);
                if units == 0 {
                    continue;
                }
                tally.refunds += 1;
                let back = Refund {
                    units,
                    at: Some(at),
                    recorded,
                };
                state.with(|s| s.settle(t, windows, Settle::Refund(back)));
                let record = Record::Settle {
                    refund: true,
                    admitted: at as i64,
                    recorded,
                    headroom: 0,
                    drains: -1,
                };
                scripts
                    .call(script, key, units, record, t, sent, carried)
                    .await;
                // As if the request had cost less from the start: what a refund may free.
                if recorded > 0 {
                    history.events[event].1 -= u128::from(units);
                }
            }
        }
        overriding = over.as_ref().map(|over| {
            let counts = over
                .windows()
                .iter()
                .map(|w| [w.count as i64, w.scale as i64]);
            counts.collect()
        });
        // Both sides hold the same state: a look at it agrees (alternating, on the other tier).
        let windows = &windows[..];
        let ours = state.with(|s| s.decide(t, windows, 1, false));
        let look = Record::Look { headroom: 0 };
        let script = (case.algorithm, ways.tier(step + 1));
        let theirs = scripts
            .call(script, key, 1, look, t, &own, &overriding)
            .await;
        prop_assert_eq!(ours, theirs, "look after {}", at);
    }
    Ok(())
}

fn count() -> impl Strategy<Value = u64> {
    prop_oneof![
        1u64..10,
        1u64..1_000,
        1u64..1_000_000,
        1u64..1_000_000_000_000,
        Just(Limit::MAX_COUNT),
        Just(1_000_000),
        Just(5_000_000),
    ]
}

fn window_ms() -> impl Strategy<Value = u64> {
    const YEAR: u64 = 365 * 86_400_000;
    prop_oneof![
        60_000u64..3_600_000,
        60_000u64..YEAR,
        Just(60_000),
        Just(3_600_000),
        Just(86_400_000),
        Just(30 * 86_400_000),
        Just(YEAR),
        Just(3650 * 86_400_000),
    ]
}

fn usage() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        1u64..100,
        1u64..1_000_000_000_000,
        Just((1 << 53) - 1),
        Just(1 << 53),
        Just((1 << 53) + 1),
        Just(1 << 63),
        Just(u64::MAX),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop_oneof![
            1 => Just(0u32),
            4 => 1u32..4,
            2 => 1u32..1_000_000,
            1 => any::<u32>(),
        ].prop_map(Op::Check),
        1 => usage().prop_map(Op::Charge),
        2 => (any::<usize>(), 0u64..u64::from(u32::MAX)).prop_map(|(n, u)| Op::Refund(n, u)),
        1 => (proptest::collection::vec(count(), 3), prop_oneof![
            2 => Just(Counts::Own),
            2 => Just(Counts::Override),
            1 => Just(Counts::NoOverride),
        ]).prop_map(|(counts, whose)| Op::Recount(counts, whose)),
    ]
}

fn gap() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        1u64..1_000,
        1u64..60_000_000,
        1u64..3_600_000_000,
        1u64..31_536_000_000_000 / 64,
    ]
}

fn case() -> impl Strategy<Value = Case> {
    let algorithm = prop_oneof![
        Just(Algorithm::SlidingLog),
        Just(Algorithm::SlidingWindow),
        Just(Algorithm::FixedWindow),
        Just(Algorithm::Gcra),
    ];
    (
        algorithm,
        proptest::collection::vec((count(), window_ms()), 1..=3),
        proptest::collection::vec((gap(), op()), 1..40),
    )
        .prop_map(|(algorithm, limits, steps)| Case {
            algorithm,
            limits,
            steps,
            start: None,
        })
}

/// A sliding window case where the weighed previous window passes the room by less than the
/// doubles' rounding: `prev * (w - e)` is a few units more than `(c - 1) * w`, both near 2^76,
/// and the two round to one double, so that a comparison in doubles would admit.
fn near_tie() -> Case {
    let (c, w): (u64, u64) = (1_000_000_000_000, 86_400_000_000);
    let room = u128::from(c - 1) * u128::from(w);
    let (prev, m) = (1..w)
        .map(|k| w - k)
        .find_map(|m| {
            let prev = room / u128::from(m) + 1;
            let over = prev * u128::from(m) - room;
            let rounds_equal = prev as f64 * m as f64 <= room as f64;
            (over > 0 && rounds_equal).then_some((prev as u64, m))
        })
        .expect("a near tie");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    // A window boundary an hour or more ahead: `prev` in that window, the check `w - m` into
    // the next.
    let start = window_start(now + 3_600_000_000, w) + w;
    Case {
        algorithm: Algorithm::SlidingWindow,
        limits: vec![(c, w / 1000)],
        steps: vec![(0, Op::Charge(prev)), (w + (w - m), Op::Check(1))],
        start: Some(start),
    }
}

#[test]
fn the_scripts_decide_as_the_algorithms_over_the_whole_range() {
    let server = Server::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let scripts = runtime.block_on(async {
        let url = format!("redis://127.0.0.1:{}", server.port);
        let client = Builder::from_config(Config::from_url(&url).unwrap())
            .build()
            .unwrap();
        for _ in 0..100 {
            if client.init().await.is_ok() {
                return Scripts {
                    client,
                    plain: Default::default(),
                    sent_on: Default::default(),
                    decisions_sent_on: Default::default(),
                };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("redis-server did not come up");
    });

    let tally = std::cell::Cell::new(Tally::default());
    // The monthly budget, a million at a time: five of seven, then the largest usages.
    let mut steps: Vec<(u64, Op)> = (0..7).map(|_| (0, Op::Check(1_000_000))).collect();
    steps.extend([
        (1, Op::Charge(u64::MAX)),
        (1, Op::Check(1)),
        (1, Op::Refund(0, 1)),
    ]);
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
    ] {
        let monthly = Case {
            algorithm,
            limits: vec![(5_000_000, 30 * 86_400_000)],
            steps: steps.clone(),
            start: None,
        };
        runtime
            .block_on(run(
                &scripts,
                &format!("monthly {algorithm:?}"),
                &monthly,
                &tally,
            ))
            .unwrap();
    }

    runtime
        .block_on(run(&scripts, "near tie", &near_tie(), &tally))
        .unwrap();

    // Limits out of range are an error in the scripts too, never decided inexactly.
    let out_of_range = [
        (
            Algorithm::FixedWindow,
            Window::new(Limit::MAX_COUNT + 1, 60_000_000),
        ),
        (
            Algorithm::SlidingLog,
            Window::new(10, 3651 * 86_400_000_000),
        ),
        (Algorithm::Gcra, Window::new(1_000_003, 30 * 86_400_000_000)),
    ];
    for (algorithm, window) in out_of_range {
        for tier in [Tier::Full, Tier::Plain] {
            let script = (algorithm, tier);
            let windows = [window];
            let reply = scripts.eval(script, "range", 1, Record::Admit, -1, &windows, &None);
            let error = runtime.block_on(reply).expect_err("refused");
            assert!(error.details().contains("out of range"), "{error:?}");
        }
    }
    runtime.block_on(the_plain_log_sends_on(&scripts));
    runtime.block_on(both_logs_trim_an_old_set_alike(&scripts));

    let mut runner = TestRunner::new(Cases {
        cases: 320,
        failure_persistence: None,
        ..Cases::default()
    });
    let n = std::cell::Cell::new(0u64);
    let outcome = runner.run(&case(), |case| {
        n.set(n.get() + 1);
        runtime.block_on(run(&scripts, &format!("case {}", n.get()), &case, &tally))
    });
    if let Err(failure) = outcome {
        panic!("{failure}");
    }
    let tally = tally.get();
    let (plain, sent_on) = (scripts.plain.get(), scripts.sent_on.get());
    let decisions_sent_on = scripts.decisions_sent_on.get();
    eprintln!(
        "{tally:?}; the plain tier decided {plain} requests, and sent on {sent_on} \
         settlements and {decisions_sent_on} decisions"
    );
    // The checks and looks of the plain and alternating runs of GCRA and the log go plain,
    // and their charges and refunds are sent on.
    assert!(
        plain > 2000 && sent_on > 200,
        "{plain}, {sent_on}: {tally:?}"
    );
    assert!(tally.overrides > 100, "{tally:?}");
    assert!(tally.admitted > 500 && tally.refused > 500, "{tally:?}");
    assert!(tally.charges > 200 && tally.refunds > 150, "{tally:?}");
    assert!(tally.recounts > 100, "{tally:?}");
}

/// The plain log sends on what it does not decide, recording nothing: a request before the
/// newest event (a scheduled one), and a set of an earlier version's members ("<time>:<n>").
async fn the_plain_log_sends_on(scripts: &Scripts) {
    let windows = [Window::new(10, 60_000_000)];
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let later = now + 3_600_000_000;
    let (full, plain) = (
        (Algorithm::SlidingLog, Tier::Full),
        (Algorithm::SlidingLog, Tier::Plain),
    );
    let zcard = |key: &'static str| {
        let command = CustomCommand::new_static("ZCARD", ClusterHash::FirstKey, false);
        scripts.client.custom::<i64, _>(command, vec![key])
    };
    let admit = Record::Admit;
    let logged = scripts.eval(full, "scheduled", 1, admit, later as i64, &windows, &None);
    logged.await.expect("EVAL");
    let before = (later - 1_000) as i64;
    let reply = scripts.eval(plain, "scheduled", 1, admit, before, &windows, &None);
    let reply = reply.await.expect("EVAL");
    assert_eq!(
        i64::from_le_bytes(reply[8..16].try_into().unwrap()),
        FULL_PATH
    );
    assert_eq!(zcard("scheduled").await.unwrap(), 1, "nothing recorded");

    let zadd = CustomCommand::new_static("ZADD", ClusterHash::FirstKey, false);
    let old: Vec<Value> = vec!["old".into(), (now as i64).into(), format!("{now}:1").into()];
    scripts.client.custom::<i64, _>(zadd, old).await.unwrap();
    let reply = scripts.eval(plain, "old", 1, admit, -1, &windows, &None);
    let reply = reply.await.expect("EVAL");
    assert_eq!(
        i64::from_le_bytes(reply[8..16].try_into().unwrap()),
        FULL_PATH
    );
    assert_eq!(zcard("old").await.unwrap(), 1, "nothing recorded");
}

/// A set whose newest event is further back than twice the longest window is trimmed whole by
/// either tier, so that an admission writes the same member (total 1) on both.
async fn both_logs_trim_an_old_set_alike(scripts: &Scripts) {
    let windows = [Window::new(10, 60_000_000)];
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let old = now - 3 * 60_000_000;
    for (key, tier) in [("trim full", Tier::Full), ("trim plain", Tier::Plain)] {
        let zadd = CustomCommand::new_static("ZADD", ClusterHash::FirstKey, false);
        let member = format!("{old}:{:016}:5", 5);
        let args: Vec<Value> = vec![key.into(), (old as i64).into(), member.into()];
        scripts.client.custom::<i64, _>(zadd, args).await.unwrap();
        let script = (Algorithm::SlidingLog, tier);
        let reply = scripts.eval(script, key, 1, Record::Admit, -1, &windows, &None);
        let reply = reply.await.expect("EVAL");
        let int = |i: usize| i64::from_le_bytes(reply[8 * i..8 * i + 8].try_into().unwrap());
        assert_eq!((int(0), int(2)), (1, 9), "admitted, 9 left ({tier:?})");
        let zrange = CustomCommand::new_static("ZRANGE", ClusterHash::FirstKey, false);
        let all: Vec<Value> = vec![key.into(), 0.into(), (-1).into()];
        let members: Vec<String> = scripts.client.custom(zrange, all).await.unwrap();
        assert_eq!(members.len(), 1, "{members:?} ({tier:?})");
        assert!(
            members[0].ends_with(&format!(":{:016}:1", 1)),
            "{members:?} ({tier:?})"
        );
    }
}
