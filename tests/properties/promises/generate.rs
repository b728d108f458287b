//! What a case configures, and the strategies that draw configurations and schedules.

use super::*;

/// The store's clock starts here: a multiple of every window generated, so that fixed windows
/// line up with the schedule's time.
pub(super) const EPOCH: u64 = 1_800_000_000;
pub(super) const KEYS: [&str; 2] = ["a", "b"];
pub(super) const WINDOWS: [u64; 3] = [1, 3, 10];
/// The windows drawn with `long_windows`: up to a day, on the memory store's virtual clock.
pub(super) const LONG_WINDOWS: [u64; 6] = [1, 3, 10, 60, 3_600, 86_400];

/// The dimensions and oracles added to the generator for the field (`PROMISE_DIMENSIONS`): each
/// can be turned on alone, to see one defect at a time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Dims {
    /// Requests of cost 1 to 3 (at most the smallest count).
    pub(super) costs: bool,
    /// `FailureMode::Fallback` among the failure modes.
    pub(super) fallback: bool,
    /// `Store::check_at` in the past and the future, mixed with the layer's `check`.
    pub(super) event_times: bool,
    /// The `Retry-After` oracle of event times: a refused `check_at` whose cost fits has a
    /// `retry_after`, and the event moved by it is admitted, and not a second earlier; and a
    /// refusal of the layer whose cost fits carries `Retry-After`.
    pub(super) event_retry: bool,
    /// Up to three limits per policy.
    pub(super) three_limits: bool,
    /// Windows up to a day.
    pub(super) long_windows: bool,
    /// Usage layers (`UsageReport`, units reported by the handler).
    pub(super) usage: bool,
    /// Shadow layers.
    pub(super) shadow: bool,
    /// The over-refusal oracle: a lone request with nothing held is admitted.
    pub(super) over_refusal: bool,
    /// Under outcome counting, a key with no counted outcome is never boxed nor marked over.
    pub(super) no_box_without_failure: bool,
    /// On Redis: outcome counting, overrides, plans, a stacked layer and event times.
    pub(super) redis_field: bool,
}

impl Dims {
    const NAMES: [&'static str; 11] = [
        "costs",
        "fallback",
        "event_times",
        "event_retry",
        "three_limits",
        "long_windows",
        "usage",
        "shadow",
        "over_refusal",
        "no_box_without_failure",
        "redis_field",
    ];

    fn from_list(list: &str) -> Dims {
        let all = matches!(list.trim(), "" | "all");
        let names: Vec<&str> = list.split(',').map(str::trim).collect();
        for name in names
            .iter()
            .filter(|n| !n.is_empty() && !["all", "none"].contains(n))
        {
            assert!(
                Dims::NAMES.contains(name),
                "PROMISE_DIMENSIONS: unknown {name}; known: {:?}",
                Dims::NAMES
            );
        }
        let on = |name: &str| all || names.contains(&name);
        Dims {
            costs: on("costs"),
            fallback: on("fallback"),
            event_times: on("event_times") || on("event_retry"),
            event_retry: on("event_retry"),
            three_limits: on("three_limits"),
            long_windows: on("long_windows"),
            usage: on("usage"),
            shadow: on("shadow"),
            over_refusal: on("over_refusal"),
            no_box_without_failure: on("no_box_without_failure"),
            redis_field: on("redis_field"),
        }
    }
}

/// The dimensions `PROMISE_DIMENSIONS` turns on: unset or `all`, every one; `none`, none (the
/// generator of before); else a comma-separated list of names (`costs`, `fallback`,
/// `event_times`, `event_retry`, `three_limits`, `long_windows`, `usage`, `shadow`,
/// `over_refusal`, `no_box_without_failure`, `redis_field`).
pub(super) fn dims() -> Dims {
    static DIMS: std::sync::OnceLock<Dims> = std::sync::OnceLock::new();
    *DIMS.get_or_init(|| {
        let list = std::env::var("PROMISE_DIMENSIONS").unwrap_or_default();
        Dims::from_list(&list)
    })
}

/// What a case configures.
#[derive(Debug, Clone)]
pub(super) struct Config {
    pub(super) algorithm: Algorithm,
    /// (count, window in seconds), shortest window first.
    pub(super) limits: Vec<(u64, u64)>,
    /// The penalty box, in seconds.
    pub(super) block: Option<u64>,
    pub(super) soft: bool,
    /// Outcome counting: a response counts when its status is 401.
    pub(super) count_when: bool,
    pub(super) concurrency: Option<u32>,
    /// `max_wait` in ms (0: none).
    pub(super) max_wait: u64,
    /// A second layer, outermost, with its own policy (count, window) on the same key.
    pub(super) outer: Option<(u64, u64)>,
    pub(super) failure: FailureMode,
    pub(super) max_keys: Option<u64>,
    /// Whether the layers put their decisions in the requests.
    pub(super) decisions: bool,
    /// Leases on Redis, with this `max_share` in percent (the memory property has none).
    pub(super) leases: Option<u32>,
    /// A configuration the crate refuses to build, added to the rest (the memory property).
    pub(super) odd: Option<Odd>,
    /// A plan `pro` of the inner policy, its counts this percent of the policy's; clients
    /// move to it and back (`Op::Plan`).
    pub(super) plan: Option<u64>,
    /// The most a request costs (1: every request costs 1); a request asks for its own cost,
    /// cut to this.
    pub(super) cost: u64,
    /// `FailureMode::Fallback` with a memory store of its own (on the run's clock), in place
    /// of `failure`.
    pub(super) fallback: bool,
    /// A usage layer: each request reserves its cost and is charged what its handler reports.
    pub(super) usage: bool,
    /// The inner layer is a shadow layer.
    pub(super) shadow: bool,
}

impl Config {
    /// The failure mode the layers are built with; `fallback` is the fallback store's.
    pub(super) fn failure_mode(&self, fallback: Option<&MemoryStore>) -> FailureMode {
        match (self.fallback, fallback) {
            (true, Some(store)) => FailureMode::Fallback(store.clone()),
            _ => self.failure.clone(),
        }
    }

    /// Whether the inner layer refuses nothing (soft or shadow).
    pub(super) fn lenient(&self) -> bool {
        self.soft || self.shadow
    }
}

/// An event time's offset from now.
#[derive(Debug, Clone, Copy)]
pub(super) enum Offset {
    /// Thousandths of the policy's longest window, -1 000 to 1 000.
    Part(i64),
    /// Milliseconds.
    Ms(i64),
}

impl Offset {
    /// The offset in ms under `config`.
    pub(super) fn ms(self, config: &Config) -> i64 {
        match self {
            Offset::Part(p) => {
                let longest = config.limits.iter().map(|l| l.1).max().unwrap_or(1) as i64;
                longest * p
            }
            Offset::Ms(ms) => ms,
        }
    }
}

/// A configuration the crate does not support (`docs/promises.md`), besides a soft layer
/// without `Decisions`, which the generator draws as any other.
#[derive(Debug, Clone, Copy)]
pub(super) enum Odd {
    /// GCRA with a bucket past 2^50 units: `1000003/30d`.
    HugeBucket,
    /// A rule with a plan's limits on a layer without a plan function.
    PlanWithoutFunction,
    /// A rule whose policy has the layer's policy's name and other counts.
    TwoPoliciesOneName,
}

/// The error each unsupported configuration must fail to build with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Refusal {
    Unsupported,
    Plan,
    PolicyConflict,
}

impl Refusal {
    pub(super) fn of(error: &BuildError) -> Option<Refusal> {
        match error {
            BuildError::Unsupported { .. } => Some(Refusal::Unsupported),
            BuildError::Plan { .. } => Some(Refusal::Plan),
            BuildError::PolicyConflict(_) => Some(Refusal::PolicyConflict),
            _ => None,
        }
    }
}

/// One step of a schedule.
#[derive(Debug, Clone)]
pub(super) enum Op {
    /// A request of key `key`: the handler answers `status` (200, 401 or 500) after `head`
    /// ms, and the client reads its body to the end `hold` ms later, or drops it then
    /// (`drop`).
    Send {
        key: usize,
        status: u16,
        head: u64,
        hold: u64,
        drop: bool,
        /// Its cost (cut to the configuration's `cost`).
        cost: u64,
        /// The units its handler reports (read under a usage layer).
        usage: u64,
    },
    /// `Store::check_at` of key `key` on the inner policy at an event time `offset` ms from
    /// now: given in thousandths of the longest window (`Offset::Part`) or in ms.
    At {
        key: usize,
        offset: Offset,
        cost: u64,
    },
    /// Time passes.
    Pass(u64),
    Reset(usize),
    /// An override of the inner policy for a key: its counts (each limit's count times this,
    /// in percent, at least 0: a block), or none.
    Override(usize, Option<u64>),
    /// The store fails (or answers again).
    Outage(bool),
    /// Requests of this many other keys.
    Flood(u64),
    /// A lone client retries at its last refusal's `Retry-After`, and a second before.
    Retry(usize),
    /// A key's client moves to the plan `pro` (`true`) or back to none.
    Plan(usize, bool),
}

pub(super) fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        Just(Algorithm::SlidingLog),
        Just(Algorithm::SlidingWindow),
        Just(Algorithm::FixedWindow),
        Just(Algorithm::Gcra),
    ]
}

pub(super) fn limits() -> BoxedStrategy<Vec<(u64, u64)>> {
    let d = dims();
    if !d.three_limits && !d.long_windows {
        return (1..=4u64, 0..3usize, prop::option::of((1..=8u64, 1..3usize)))
            .prop_map(|(c, w, second)| {
                let mut limits = vec![(c, WINDOWS[w])];
                if let Some((c2, step)) = second {
                    let w2 = WINDOWS[(w + step).min(2)];
                    if w2 != WINDOWS[w] {
                        limits.push((c.max(c2), w2));
                    }
                }
                limits
            })
            .boxed();
    }
    let windows: &'static [u64] = match d.long_windows {
        true => &LONG_WINDOWS,
        false => &WINDOWS,
    };
    let most = if d.three_limits { 2 } else { 1 };
    let last = windows.len() - 1;
    // Each further limit: a longer window (a step of 1 to 3 along the list), a count at
    // least the one before (more for longer windows, as configurations are written).
    let further = prop::collection::vec((1..=3usize, 0..=12u64), 0..=most);
    (1..=4u64, 0..windows.len(), further)
        .prop_map(move |(c, w, further)| {
            let mut limits = vec![(c, windows[w])];
            let (mut at, mut count) = (w, c);
            for (step, more) in further {
                let next = (at + step).min(last);
                if next == at {
                    break;
                }
                (at, count) = (next, count + more);
                limits.push((count, windows[at]));
            }
            limits
        })
        .boxed()
}

pub(super) fn config() -> impl Strategy<Value = Config> {
    let features = (
        prop::option::weighted(0.3, 2..=20u64),
        prop::bool::weighted(0.15),
        prop::bool::weighted(0.3),
        prop::option::weighted(0.3, 1..=3u32),
        prop_oneof![3 => Just(0u64), 1 => 100..=3_000u64],
    );
    let around = (
        prop::option::weighted(0.25, (1..=6u64, prop::sample::select(WINDOWS.to_vec()))),
        prop_oneof![Just(FailureMode::Open), Just(FailureMode::Closed)],
        prop::option::weighted(0.2, 16..=64u64),
        prop::bool::weighted(0.9),
        prop::option::weighted(
            0.03,
            prop_oneof![
                Just(Odd::HugeBucket),
                Just(Odd::PlanWithoutFunction),
                Just(Odd::TwoPoliciesOneName),
            ],
        ),
    );
    let plan = prop::option::weighted(0.3, prop_oneof![30..=90u64, 150..=400u64]);
    let d = dims();
    let field = (
        (
            prop::bool::weighted(if d.costs { 0.3 } else { 0.0 }),
            2..=3u64,
        )
            .prop_map(|(on, c)| on.then_some(c)),
        prop::bool::weighted(if d.fallback { 0.25 } else { 0.0 }),
        prop::bool::weighted(if d.usage { 0.2 } else { 0.0 }),
        prop::bool::weighted(if d.shadow { 0.1 } else { 0.0 }),
    );
    (algorithm(), limits(), features, around, (plan, field)).prop_map(
        |(algorithm, limits, features, around, (plan, field))| {
            let (block, soft, count_when, concurrency, max_wait) = features;
            let (outer, failure, max_keys, decisions, odd) = around;
            let (cost, fallback, usage, shadow) = field;
            // With plans, the layer has a plan function: a plan's limits without one is the
            // unsupported case, drawn without plans.
            let plan = plan.filter(|_| !matches!(odd, Some(Odd::PlanWithoutFunction)));
            let (algorithm, limits) = match odd {
                Some(Odd::HugeBucket) => (Algorithm::Gcra, vec![(1_000_003, 30 * 86_400)]),
                _ => (algorithm, limits),
            };
            Config {
                cost: cost.map_or(1, |c| c.min(limits_min(&limits))),
                algorithm,
                limits,
                block,
                soft,
                count_when,
                concurrency,
                max_wait: if concurrency.is_some() { max_wait } else { 0 },
                outer,
                failure,
                max_keys,
                decisions,
                leases: None,
                odd,
                plan,
                fallback,
                // Outcome counting is a usage report of its own: one or the other.
                usage: usage && !count_when,
                shadow,
            }
        },
    )
}

/// Whether `Store::check_at` takes event times under `config`: the sliding log, without a
/// concurrency limit; the rest answer `StoreError::Unsupported`.
pub(super) fn event_times_taken(config: &Config) -> bool {
    config.algorithm == Algorithm::SlidingLog && config.concurrency.is_none()
}

/// The smallest count of `limits`.
pub(super) fn limits_min(limits: &[(u64, u64)]) -> u64 {
    limits.iter().map(|l| l.0).min().unwrap_or(1).max(1)
}

/// Now and then, limits no GCRA bucket holds (`docs/operations.md`, "Range"): a count that
/// shares few factors with a month.
pub(super) fn out_of_range(config: Config) -> impl Strategy<Value = Config> {
    prop::bool::weighted(0.02).prop_map(move |huge| match huge {
        true => Config {
            limits: vec![(1_000_003, 30 * 86_400)],
            ..config.clone()
        },
        false => config.clone(),
    })
}

pub(super) fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS.len();
    let at = (key.clone(), offset(), 1..=3u64).prop_map(|(key, offset, cost)| Op::At {
        key,
        offset,
        cost,
    });
    prop_oneof![
        12 => (
            key.clone(),
            prop::sample::select(vec![200u16, 401, 500]),
            prop_oneof![4 => Just(0u64), 1 => 1..=1_500u64],
            prop_oneof![0..=5u64, 0..=4_000u64],
            prop::bool::weighted(0.2),
            (1..=3u64, 0..=4u64),
        )
            .prop_map(|(key, status, head, hold, drop, (cost, usage))| Op::Send {
                key,
                status,
                head,
                hold,
                drop,
                cost,
                usage,
            }),
        if dims().event_times { 4 } else { 0 } => at,
        5 => prop_oneof![1..=400u64, 400..=12_000u64].prop_map(Op::Pass),
        1 => key.clone().prop_map(Op::Reset),
        1 => (key.clone(), prop::option::of(prop_oneof![Just(0u64), 50..=300u64]))
            .prop_map(|(key, pct)| Op::Override(key, pct)),
        1 => any::<bool>().prop_map(Op::Outage),
        1 => (1..=60u64).prop_map(Op::Flood),
        2 => key.clone().prop_map(Op::Retry),
        1 => (key, any::<bool>()).prop_map(|(key, pro)| Op::Plan(key, pro)),
    ]
}

/// An event time: anywhere within the longest window either side of now, or within 20 s.
pub(super) fn offset() -> impl Strategy<Value = Offset> {
    prop_oneof![
        (-1_000..=1_000i64).prop_map(Offset::Part),
        (-20_000..=20_000i64).prop_map(Offset::Ms),
    ]
}

pub(super) fn case() -> impl Strategy<Value = (Config, Vec<Op>)> {
    (
        config().prop_flat_map(out_of_range),
        prop::collection::vec(op(), 1..40),
    )
}

/// The parts of `config` the crate refuses to build, with why and the error; none for a
/// configuration it must build. Where there are several, the build may name any. The list in
/// `docs/promises.md`, "What is not supported".
pub(super) fn unsupported(config: &Config) -> Vec<(&'static str, Refusal)> {
    let mut all = Vec::new();
    match config.odd {
        Some(Odd::PlanWithoutFunction) => {
            all.push(("a plan's limits without a plan function", Refusal::Plan))
        }
        Some(Odd::TwoPoliciesOneName) => {
            all.push(("two policies of one name", Refusal::PolicyConflict))
        }
        Some(Odd::HugeBucket) | None => {}
    }
    if config.soft && !config.decisions {
        all.push(("a soft layer without Decisions", Refusal::Unsupported));
    }
    let gcra_bucket = |&(c, w): &(u64, u64)| {
        let micros = u128::from(w) * 1_000_000;
        let gcd = gcd(u128::from(c), micros);
        u128::from(c) * micros / gcd > 1 << 50
    };
    if config.algorithm == Algorithm::Gcra && config.limits.iter().any(gcra_bucket) {
        all.push(("a GCRA bucket past 2^50 units", Refusal::Unsupported));
    }
    all
}

pub(super) fn gcd(a: u128, b: u128) -> u128 {
    match b {
        0 => a,
        b => gcd(b, a % b),
    }
}

pub(super) fn plain(algorithm: Algorithm, limits: Vec<(u64, u64)>) -> Config {
    Config {
        algorithm,
        limits,
        block: None,
        soft: false,
        count_when: false,
        concurrency: None,
        max_wait: 0,
        outer: None,
        failure: FailureMode::Open,
        max_keys: None,
        decisions: true,
        leases: None,
        odd: None,
        plan: None,
        cost: 1,
        fallback: false,
        usage: false,
        shadow: false,
    }
}
