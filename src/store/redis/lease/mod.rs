//! Leases: a share of a key's budget taken from Redis ahead of need, so that busy keys are
//! decided in this process and Redis sees one call per lease instead of one per request.
//!
//! A lease takes `k` units of a key's budget in one script call, the same call that decides
//! the request that asked for it: the counters add `k` to every limit's window, GCRA moves the
//! backlog by `k` units. The instance then admits requests from those units on its own
//! ([`Store::check_now`](crate::Store::check_now)), fetches the next lease in the background
//! when a quarter of a period's worth is left, and gives back what it did not spend
//! (`scripts/release.lua`) when the key goes idle, when the lease expires, and on
//! [`RedisStore::drain`](super::RedisStore::drain).
//!
//! **Never over the limit.** Units are taken before they are spent, so Redis always counts at
//! least what the fleet admitted. What keeps the count true for spending *later* than taking:
//! - fixed and sliding window counters: a lease expires when the current window of its
//!   shortest limit ends, so every unit is spent in the window it was counted in;
//! - GCRA and the sliding log: a lease expires `h` after it was taken (a hundredth sooner on
//!   this instance's clock, for drift), `h` at most the lease period and `max_share` of the
//!   shortest window, and every decision of a leasing store allows for units spent up to `h`
//!   late (the script's headroom). GCRA keeps `h` of drain free in each bucket, so spending up
//!   to `h` late never lets the bucket hold more than its capacity: the burst is
//!   `c * (1 - h / w)` instead of `c`, the rate unchanged. The log logs a lease as one event at
//!   the time it was taken and reads every window `h` longer, `(now − w − h, now]`: every span
//!   of `w + h` holds at most the count as logged, so every window of `w` holds at most the
//!   count as spent (`docs/leases.md` has the proof). The price is a window of `w + h`.
//!
//! **A charge that fills a key** (a usage settlement, [`Store::settle`](crate::Store::settle))
//! ends this instance's leases of it: once the settlement's reply shows the key full, the units
//! granted until then are spent no more and go back to Redis ([`settled`]); other instances stop
//! at their own next settlement's reply, at a fetch Redis refuses, or when their lease expires
//! (`docs/leases.md` has the bound).
//!
//! **Under-admission** is the price: units one instance holds are refused to the others until
//! they are spent or given back, at most `max_share` of the limit per instance and key, and for
//! at most one lease period (sooner when the key goes idle).
//!
//! A policy with a penalty box or a concurrency limit is never leased, whatever its algorithm:
//! every decision goes to Redis as without leases (a sliding-log one reading the longer
//! window all the same, since a leased policy of its name may share its log).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};

use super::placement;
use super::protocol::{self, Answer, Answered, Record};
use super::{Inner, RedisStore};
use crate::algorithm::{window_start, Algorithm, Outcome};
use crate::shards::{lock, Pinning, Shards};
use crate::{Decision, Key, Policy, StoreError};

mod book;
#[cfg(test)]
mod model;

use book::{Entry, Grant, Return};

/// Lease settings of a [`RedisStore`]: how long a lease lasts and how large it may grow.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::Leases;
///
/// let leases = Leases::new().period(Duration::from_millis(500)).max_share(0.05);
/// # drop(leases);
/// ```
///
/// Pass them to [`RedisStoreBuilder::leases`](super::RedisStoreBuilder::leases). Every
/// instance sharing a Redis should use the same settings: the headroom for units spent late
/// (GCRA's drain kept free, the sliding log's longer window) is only kept by leasing stores,
/// at their own settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Leases {
    period: Duration,
    max_share: f64,
    max_keys: u64,
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
    /// instances cannot starve each other. A policy whose share is under 2 units is not
    /// leased: each of its requests goes to Redis, exactly as without leases.
    pub fn max_share(mut self, share: f64) -> Self {
        self.max_share = share;
        self
    }

    /// The most keys holding leases at once (default 100 000); past it, the least recently
    /// used key's lease is dropped unspent (counted as used, never admitted twice).
    pub fn max_keys(mut self, keys: u64) -> Self {
        self.max_keys = keys;
        self
    }

    pub(super) fn period_length(&self) -> Duration {
        self.period
    }

    pub(super) fn validate(&self) -> Result<(), StoreError> {
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
    fn plan(&self, policy: &Policy) -> Option<Plan> {
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
    fn late(&self, policy: &Policy) -> u64 {
        let shortest = policy.windows()[0].micros;
        micros(self.period).min((shortest as f64 * self.max_share) as u64)
    }

    /// The headroom (µs) every decision of `policy` allows for ([`Plan`]): a leased GCRA
    /// policy's; for the sliding log, whether this policy is leased or not, since a policy of
    /// its name and windows shares its log and may be leased (other counts, no penalty box),
    /// and the units it spends late are in every window this one reads. 0 otherwise.
    fn headroom(&self, policy: &Policy) -> u64 {
        match policy.algorithm() {
            Algorithm::SlidingLog => self.late(policy),
            Algorithm::Gcra => self.plan(policy).map_or(0, |plan| plan.headroom),
            Algorithm::FixedWindow | Algorithm::SlidingWindow => 0,
        }
    }

    /// Why these settings cannot lease `policy`, if they cannot: GCRA's headroom would leave
    /// a bucket room for less than one unit, so that the key would never admit anything.
    fn refuses(&self, policy: &Policy) -> Option<StoreError> {
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
pub(super) struct Plan {
    /// The most units one lease takes.
    cap: u64,
    /// The longest a lease lasts (µs), and the span whose use sets its size.
    period: u64,
    /// How late a leased unit may be spent after Redis recorded it (µs), which every decision
    /// of the policy allows for: GCRA keeps that much drain free, the sliding log reads every
    /// window that much longer; 0 for the counters, whose leases end with their window.
    headroom: u64,
    life: Life,
}

/// How long a lease's units may be spent (see the module's docs, "Never over the limit").
#[derive(Debug, Clone, Copy)]
enum Life {
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
    fn record(&self, cost: u64, want: u64) -> Record {
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
    fn full(&self, policy: &Policy, remaining: u64) -> bool {
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
    fn expiry(&self, policy: &Policy, sent: u64, granted: i64) -> u64 {
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

/// A lease's units are spent up to `h` after they were sent for, as this instance's clock
/// measures it, and Redis's headroom allows `h` as Redis's clock measures it: a lease that
/// allows for the headroom ends a hundredth of `h` sooner, far more than two clocks' rates
/// differ (100 ppm is a poor quartz; NTP slews at most 500 ppm).
const DRIFT: u64 = 100;

/// How long a lease's reply is waited for, however long after its caller gave up: Redis
/// counted its units when the script ran, so they are booked (spent or given back) when the
/// reply comes. A reply later than this is not read, and its units count as used until Redis
/// forgets them (the window ends, the bucket drains).
const PATIENCE: Duration = Duration::from_secs(10);

/// What a leasing store keeps.
pub(super) struct State {
    settings: Leases,
    book: Shards<Held>,
    origin: tokio::time::Instant,
    /// Set by [`RedisStore::drain`]: no new leases, and nothing spent from leases.
    drained: AtomicBool,
    /// Set once `drain` stopped waiting for the lease calls under way: a lease that lands
    /// later is given back by the call that took it (earlier ones, by `drain`).
    drain_waited: AtomicBool,
    /// Lease calls whose reply has not been booked yet; `landed` is notified as each is.
    taking: AtomicUsize,
    landed: Notify,
    /// Give-backs that were not run (the breaker was open, Redis refused the script), sent
    /// again with the next ones.
    pending: Mutex<Vec<Due>>,
}

/// A give-back to send: where, its arguments for `scripts/release.lua`, its units, and the
/// local time after which it no longer matters (every window that counted it has ended).
struct Due {
    key: String,
    args: Vec<u8>,
    units: u64,
    until: u64,
}

/// One key's leases, with the policy they are for.
struct Held {
    policy: Policy,
    entry: Entry,
}

/// A lease is never pinned: one evicted gives its units back when it ends, as any.
impl Pinning for Held {}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl State {
    pub(super) fn new(settings: Leases) -> State {
        State {
            settings,
            book: Shards::new(settings.max_keys),
            origin: tokio::time::Instant::now(),
            drained: AtomicBool::new(false),
            drain_waited: AtomicBool::new(false),
            taking: AtomicUsize::new(0),
            landed: Notify::new(),
            pending: Mutex::new(Vec::new()),
        }
    }

    fn is_drained(&self) -> bool {
        self.drained.load(Ordering::Acquire)
    }

    /// Local µs since the store was made.
    fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    /// Runs `f` on the entry of `key` under `policy`, made if missing.
    fn with<T>(&self, key: &Key, policy: &Policy, f: impl FnOnce(&mut Entry) -> T) -> T {
        let now = self.now();
        let mut locked = self.book.lock(key, policy.terms_id());
        if let Some(found) = locked.get(key, policy.terms_id(), now) {
            return f(&mut found.value.entry);
        }
        let mut held = Held {
            policy: policy.clone(),
            entry: Entry::default(),
        };
        let out = f(&mut held.entry);
        locked.insert(key, policy.terms_id(), now, u64::MAX, held);
        out
    }
}

/// The decision of [`Store::check_now`](crate::Store::check_now): from this instance's lease,
/// when it holds the units; the next lease is fetched in the background when few are left.
/// After [`RedisStore::drain`], none: every decision goes to Redis.
pub(super) fn check_now(
    inner: &Arc<Inner>,
    key: &Key,
    policy: &Policy,
    cost: u32,
) -> Option<Result<Decision, StoreError>> {
    let state = inner.leases.as_ref()?;
    let plan = state.settings.plan(policy)?;
    if !spending(inner, state) {
        return None;
    }
    let now = state.now();
    let (outcome, granted, prefetch) = state.with(key, policy, |entry| {
        let (outcome, granted) = entry.take(now, cost.into())?;
        entry.used(now, plan.period, cost.into());
        let prefetch = entry.should_prefetch(now, plan.period, plan.cap);
        entry.fetching |= prefetch.is_some();
        Some((outcome, granted, prefetch))
    })?;
    if let Some(want) = prefetch {
        take(inner, plan, key, policy, 0, want, None);
    }
    Some(Ok(spent(outcome, granted, policy, cost)))
}

/// The decision of a request of `cost` admitted from a lease, counted in Redis at `granted`.
fn spent(outcome: Outcome, granted: Option<i64>, policy: &Policy, cost: u32) -> Decision {
    Decision::from_outcome(outcome, policy).recorded_at(granted, cost.into())
}

/// Reads Redis's reply to a settlement of `key` under `policy` (`answer`, the state the
/// settlement left): where it may leave the key full ([`Plan::full`]), this instance spends
/// no more of the units Redis granted it for the key until then, nor of a grant whose reply
/// lands later; the sweeper gives them back within a quarter period. Without this, a charge
/// that fills a key would leave its leases admitting requests, each charged its usage in turn,
/// until they ran out or expired. Touches only a key this instance keeps an entry for: one
/// without holds nothing and fetches nothing.
pub(super) fn settled(inner: &Inner, key: &Key, policy: &Policy, answer: &Answer) {
    let Some(state) = inner.leases.as_ref() else {
        return;
    };
    let Some(plan) = state.settings.plan(policy) else {
        return;
    };
    let Ok(verdict) = answer.verdict(policy) else {
        return;
    };
    if plan.full(policy, verdict.outcome.remaining) {
        let now = state.now();
        let mut locked = state.book.lock(key, policy.terms_id());
        if let Some(found) = locked.get(key, policy.terms_id(), now) {
            found.value.entry.fill(answer.time);
        }
    }
}

/// The store's limits version changed (an override was set or removed, here or elsewhere):
/// every lease held now was taken under limits that may no longer hold, so none is spent any
/// more; the sweeper gives their units back. A lease call under way may still land and be
/// spent: at most one grant per key.
pub(super) fn limits_changed(inner: &Inner) {
    if let Some(state) = inner.leases.as_ref() {
        state.book.retain(|_, held| {
            held.entry.expire_grants();
            true
        });
    }
}

/// Whether this instance spends from its leases now: not once drained, nor while its limits
/// version is older than the stated bound (`overrides/version.rs`, `STALE`): an instance cut
/// off from Redis cannot know whether a change (a block, a cut) was made meanwhile, so it
/// decides in Redis, and its failure mode applies there, until it reads the version again.
fn spending(inner: &Inner, state: &State) -> bool {
    !state.is_drained() && inner.limits.is_current()
}

/// What [`check`] does with a request once it has looked at the key's lease.
enum Step {
    /// Spent from the lease: the outcome, and the Redis time its last unit was counted.
    Spent(Outcome, Option<i64>),
    /// Goes to Redis taking a lease of up to this many units.
    Lease(u64),
    /// Goes to Redis for itself alone; `behind`: while this instance's own lease is on its
    /// way.
    Redis { behind: bool },
}

/// What [`Store::peek`](crate::Store::peek) answers from this instance's lease: allowed, as
/// [`check_now`] would answer, when it holds `cost` units; else `None` (ask Redis).
pub(super) fn peek_now(
    inner: &Arc<Inner>,
    key: &Key,
    policy: &Policy,
    cost: u32,
) -> Option<Decision> {
    let state = inner.leases.as_ref()?;
    state.settings.plan(policy)?;
    if !spending(inner, state) {
        return None;
    }
    let now = state.now();
    let outcome = state.with(key, policy, |entry| entry.peek(now, cost.into()))?;
    Some(Decision::from_outcome(outcome, policy))
}

/// The headroom (µs) the store's decisions of `policy` allow for ([`Leases::headroom`]); 0
/// without leases.
pub(super) fn headroom(inner: &Inner, policy: &Policy) -> u64 {
    match (&inner.leases, policy.out_of_range()) {
        (Some(state), None) => state.settings.headroom(policy),
        _ => 0,
    }
}

/// What a request of `cost` that takes no lease records for `policy` (a policy never leased,
/// or an event time's, which [`Store::check_at`](crate::Store::check_at) decides in Redis):
/// its cost, allowing for the headroom of the store's leases, so that the log's bound covers
/// events logged at other times than now and by policies not leased as well.
pub(super) fn record_alone(inner: &Inner, policy: &Policy, cost: u32) -> Record {
    recording(cost.into(), cost.into(), headroom(inner, policy))
}

/// What a request of `cost` that takes up to `want` units records, allowing for `headroom`:
/// an admission of its cost when it takes no more and there is no headroom, else a lease
/// (of its cost alone when `want` is no more), which carries the headroom to the script.
fn recording(cost: u64, want: u64, headroom: u64) -> Record {
    match headroom {
        0 if want <= cost => Record::Admit,
        headroom => Record::Lease {
            want: want.max(cost),
            headroom,
        },
    }
}

/// The headroom a settlement of `policy` reads: the sliding log's, so that the reply says
/// whether the key is full in the windows its decisions read ([`Plan::full`]); 0 for GCRA,
/// whose settlement replies count without it, and for the counters.
pub(super) fn settling_headroom(inner: &Inner, policy: &Policy) -> u64 {
    match policy.algorithm() {
        Algorithm::SlidingLog => headroom(inner, policy),
        Algorithm::Gcra | Algorithm::FixedWindow | Algorithm::SlidingWindow => 0,
    }
}

/// The lease state of a store that was given a plan, so has leases.
fn state(inner: &Inner) -> Result<&State, StoreError> {
    (inner.leases.as_ref()).ok_or_else(|| StoreError::Config("leases are off".into()))
}

/// How `policy` is leased by the store of `inner`, if it is.
pub(super) fn plan(inner: &Inner, policy: &Policy) -> Option<Plan> {
    // A policy out of range is refused by the store's own path.
    if policy.out_of_range().is_some() {
        return None;
    }
    inner.leases.as_ref()?.settings.plan(policy)
}

/// The decision of [`Store::check`](crate::Store::check) for a policy leased as `plan`: from
/// the lease if it holds the units, else from Redis, taking a lease when the key is busy.
pub(super) async fn check(
    inner: Arc<Inner>,
    plan: Plan,
    key: Key,
    policy: Policy,
    cost: u32,
) -> Result<Decision, StoreError> {
    let state = state(&inner)?;
    let now = state.now();
    let drained = !spending(&inner, state);
    let step = state.with(&key, &policy, |entry| {
        entry.used(now, plan.period, cost.into());
        if drained {
            return Step::Redis { behind: false };
        }
        if let Some((outcome, granted)) = entry.take(now, cost.into()) {
            return Step::Spent(outcome, granted);
        }
        let want = entry.want(now, plan.period, cost.into(), plan.cap);
        if want > u64::from(cost) && !entry.fetching {
            entry.fetching = true;
            return Step::Lease(want);
        }
        Step::Redis {
            behind: entry.fetching,
        }
    });
    match step {
        Step::Spent(outcome, granted) => Ok(spent(outcome, granted, &policy, cost)),
        Step::Lease(want) => lease(&inner, plan, &key, &policy, cost, want).await,
        Step::Redis { behind: false } => decide(&inner, plan, &key, &policy, cost).await,
        Step::Redis { behind: true } => {
            // This instance's own lease is on its way: Redis may refuse because of the units
            // it is taking. Then the request waits for it (within the budget) rather than be
            // refused while this instance holds room.
            let decision = decide(&inner, plan, &key, &policy, cost).await?;
            if decision.is_allowed() || !landed(state, &key, &policy, inner.timeout).await {
                return Ok(decision);
            }
            let now = state.now();
            match state.with(&key, &policy, |entry| entry.take(now, cost.into())) {
                Some((outcome, granted)) => Ok(spent(outcome, granted, &policy, cost)),
                None => Ok(decision),
            }
        }
    }
}

/// Waits up to `budget` for the lease being fetched for `key` to be booked; whether it was.
async fn landed(state: &State, key: &Key, policy: &Policy, budget: Duration) -> bool {
    let fetching = || state.with(key, policy, |entry| entry.fetching);
    until_landed(state, budget, || !fetching()).await
}

/// Waits up to `budget`, waking as each lease call is booked, until `done`; whether it came.
async fn until_landed(state: &State, budget: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + budget;
    loop {
        let landed = state.landed.notified();
        tokio::pin!(landed);
        landed.as_mut().enable();
        if done() {
            return true;
        }
        if tokio::time::timeout_at(deadline, landed).await.is_err() {
            return false;
        }
    }
}

/// Asks Redis to decide a request of `cost` that takes no lease, batched with the others.
async fn decide(
    inner: &Arc<Inner>,
    plan: Plan,
    key: &Key,
    policy: &Policy,
    cost: u32,
) -> Result<Decision, StoreError> {
    let state = state(inner)?;
    let place = inner.place(key, policy);
    let record = plan.record(cost.into(), cost.into());
    let answer = inner.decide(place, policy, cost.into(), -1, record).await?;
    let verdict = answer.verdict(policy)?;
    state.with(key, policy, |entry| {
        entry.answered(verdict.outcome, answer.time)
    });
    let decision = verdict.decision(policy);
    Ok(decision.recorded_at(Some(answer.time), cost.into()))
}

/// Asks Redis to decide a request of `cost` and take a lease of up to `want` units for the
/// key, which is marked as fetching. The call runs on a task of its own ([`take`]), which
/// books its units however late Redis answers; this request waits for it within the time
/// budget.
async fn lease(
    inner: &Arc<Inner>,
    plan: Plan,
    key: &Key,
    policy: &Policy,
    cost: u32,
    want: u64,
) -> Result<Decision, StoreError> {
    let (reply, answer) = oneshot::channel();
    if !take(inner, plan, key, policy, cost, want, Some(reply)) {
        return Err(StoreError::Unavailable);
    }
    let lane = inner.placement.lane(key, policy);
    let answer = inner.within_budget(lane, answer).await?;
    let verdict = answer.verdict(policy)?;
    let outcome = Outcome {
        remaining: verdict.outcome.remaining + verdict.extra,
        ..verdict.outcome
    };
    let decision = Decision::from_outcome(outcome, policy).with_limit(verdict.count);
    Ok(decision.recorded_at(Some(answer.time), cost.into()))
}

/// Starts the call that takes a lease of up to `want` units for a request of `cost` (0 for a
/// fetch ahead of need), on a task of its own that waits for Redis's reply up to
/// [`PATIENCE`] and books it ([`book`]), so that every unit Redis counted is spent or given
/// back. A lease that lands after [`RedisStore::drain`] is given back at once. While the
/// breaker is open nothing starts: the key's fetch ends, and the answer is `false`.
fn take(
    inner: &Arc<Inner>,
    plan: Plan,
    key: &Key,
    policy: &Policy,
    cost: u32,
    want: u64,
    caller: Option<oneshot::Sender<Answered>>,
) -> bool {
    let Some(state) = inner.leases.as_ref() else {
        return false;
    };
    if inner.breaker(inner.placement.lane(key, policy)).is_open() {
        state.with(key, policy, |entry| entry.fetching = false);
        return false;
    }
    state.taking.fetch_add(1, Ordering::AcqRel);
    let sent = state.now();
    let version = inner.limits.token();
    let (inner, key, policy) = (Arc::clone(inner), key.clone(), policy.clone());
    tokio::spawn(async move {
        let place = inner.place(&key, &policy);
        let record = plan.record(cost.into(), want);
        let known = inner.batcher.known();
        let args = protocol::encode_for(&policy, &place, cost.into(), record, -1, known);
        let answered = inner
            .batcher
            .decide_patiently(place, policy.algorithm(), args, PATIENCE)
            .await;
        let granted = answered.as_ref().ok().and_then(|answer| {
            let verdict = answer.verdict(&policy).ok()?;
            Some((verdict.outcome, verdict.extra, answer.time))
        });
        let taken_by_caller = caller.is_some_and(|caller| caller.send(answered).is_ok());
        let Some(state) = inner.leases.as_ref() else {
            return;
        };
        state.with(&key, &policy, |entry| {
            entry.fetching = false;
            if let Some(granted) = granted {
                let lease = Lease { plan, sent, cost };
                book(entry, lease, &policy, granted, taken_by_caller);
                // The limits changed while the call was out: Redis may have granted under
                // the old ones (`limits_changed` has already run).
                if inner.limits.token() != version {
                    entry.expire_grants();
                }
            }
        });
        let late = state.drain_waited.load(Ordering::Acquire);
        state.taking.fetch_sub(1, Ordering::AcqRel);
        state.landed.notify_waiters();
        if late {
            let store = RedisStore {
                inner: Arc::clone(&inner),
            };
            let _ = give_back(&store, true).await;
        }
    });
    true
}

/// A lease call: its plan, the local time it was sent, and the cost of the request it decided.
struct Lease {
    plan: Plan,
    sent: u64,
    cost: u32,
}

/// Books the reply to `lease` in the key's `entry`: the `outcome`, the units `extra` leased
/// beyond the cost, and the Redis `time` of the grant. The units go to the key's lease, and so
/// does the cost itself when the caller no longer waited for the reply (`taken_by_caller`
/// false: it gave up at its time budget).
fn book(
    entry: &mut Entry,
    lease: Lease,
    policy: &Policy,
    (outcome, extra, time): (Outcome, u64, i64),
    taken_by_caller: bool,
) {
    let Lease { plan, sent, cost } = lease;
    let units = match taken_by_caller || !outcome.allowed {
        true => extra,
        false => extra + u64::from(cost),
    };
    let grant = Grant {
        units,
        expires: plan.expiry(policy, sent, time),
        granted: time,
    };
    match outcome.allowed {
        true => entry.granted(grant, outcome),
        // A fetch ahead of need (no cost) that Redis refuses found the key over its
        // limit, which only a settlement's charge makes it: one that this instance did
        // not see (another instance's) filled the key.
        false if cost == 0 => entry.fill(time),
        false => entry.answered(outcome, time),
    }
}

/// Gives back, at `now`, the units of expired leases, and all of those of idle keys (or of
/// every key when `all`), with the give-backs that could not be sent before and still
/// matter. Returns the units handed back. A give-back is sent again only when it certainly
/// did not run (the breaker was open, or Redis refused the script); one whose reply was
/// lost may have run, and is not sent twice.
pub(super) async fn give_back(store: &RedisStore, all: bool) -> Result<u64, StoreError> {
    let Some(state) = store.inner.leases.as_ref() else {
        return Ok(0);
    };
    let now = state.now();
    let mut due: Vec<Due> = std::mem::take(&mut *lock(&state.pending));
    due.retain(|d| d.until > now);
    due.extend(returns(store, state, now, all));
    let (result, unsent) = send(store, &due).await;
    if unsent.contains(&true) {
        let mut pending = lock(&state.pending);
        let kept = due.into_iter().zip(unsent).filter(|(_, unsent)| *unsent);
        pending.extend(kept.map(|(due, _)| due));
        // Bounded like the book: past it, the oldest give-backs are dropped (their units
        // count as used until their windows end).
        let most = usize::try_from(state.settings.max_keys).unwrap_or(usize::MAX);
        let over = pending.len().saturating_sub(most);
        pending.drain(..over);
    }
    result
}

/// Takes out of the book, at `now`, the units of expired leases, and all of those of idle keys
/// (or of every key when `all`), as give-backs to send; forgets the keys left idle and empty.
fn returns(store: &RedisStore, state: &State, now: u64, all: bool) -> Vec<Due> {
    let mut due = Vec::new();
    state.book.retain(|key, held| {
        let plan = state.settings.plan(&held.policy);
        let idle = plan.map_or(0, |p| p.period / 4);
        for Return { units, granted } in held.entry.returns(now, idle, all) {
            let policy = &held.policy;
            let windows = policy.windows();
            let args = protocol::encode_release(policy.algorithm(), units, granted, windows);
            due.push(Due {
                key: store.inner.place(key, policy).key,
                args,
                units,
                until: now + micros(policy.longest_window()),
            });
        }
        !(held.entry.is_empty() && now.saturating_sub(held.entry.last_used) >= idle)
    });
    due
}

/// Sends the give-backs `due`, as few calls as their hash slots allow; returns the units given
/// back (or the last error) and which were not sent and may be sent again.
async fn send(store: &RedisStore, due: &[Due]) -> (Result<u64, StoreError>, Vec<bool>) {
    let keys: Vec<String> = due.iter().map(|d| d.key.clone()).collect();
    let mut result = Ok(0);
    let mut unsent = vec![false; due.len()];
    for group in placement::by_hash_slot(&keys, store.inner.batcher.is_clustered()) {
        for chunk in group.chunks(512) {
            // With the breaker open nothing is sent: these are kept for the next sweep.
            if store
                .inner
                .breaker(store.inner.lane_of(&keys[chunk[0]]))
                .is_open()
            {
                chunk.iter().for_each(|&i| unsent[i] = true);
                result = Err(StoreError::Unavailable);
                continue;
            }
            let keys = chunk.iter().map(|&i| keys[i].clone()).collect();
            let args = chunk.iter().flat_map(|&i| due[i].args.iter().copied());
            let call = store.inner.batcher.release(keys, args.collect(), PATIENCE);
            match call.await {
                Ok(_) => {
                    if let Ok(sum) = &mut result {
                        *sum += chunk.iter().map(|&i| due[i].units).sum::<u64>();
                    }
                }
                // Redis refused to run the script (busy, loading, a hash slot moving): sent again.
                Err(error) if refused(&error) => {
                    chunk.iter().for_each(|&i| unsent[i] = true);
                    result = Err(error.into());
                }
                // It may have run: sending it again could give the units back twice. They
                // count as used until their windows end.
                Err(error) => result = Err(error.into()),
            }
        }
    }
    (result, unsent)
}

/// Whether Redis answered `error` without running the script, so that sending it again
/// cannot apply it twice.
pub(super) fn refused(error: &fred::error::Error) -> bool {
    const REFUSALS: [&str; 6] = [
        "BUSY",
        "LOADING",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "MOVED",
    ];
    REFUSALS.iter().any(|r| error.details().starts_with(r))
}

/// Gives back what idle keys and expired leases hold, every quarter of the lease period,
/// until the store is dropped.
pub(super) fn spawn_sweeper(store: Weak<Inner>, period: Duration) {
    let every = (period / 4).max(Duration::from_millis(5));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(inner) = store.upgrade() else { return };
            let store = RedisStore { inner };
            if let Err(error) = give_back(&store, false).await {
                tracing::debug!(
                    target: "tower_redis_ratelimit",
                    %error,
                    "leased units could not be given back; they count as used until they expire"
                );
            }
        }
    });
}

/// Stops new leases and spending from leases, for [`RedisStore::drain`], then waits (within
/// the time budget) for the lease calls under way to be booked, so that the give-back that
/// follows returns their units too.
pub(super) async fn stop(inner: &Inner) {
    let Some(state) = &inner.leases else {
        return;
    };
    state.drained.store(true, Ordering::Release);
    let idle = || state.taking.load(Ordering::Acquire) == 0;
    until_landed(state, inner.timeout, idle).await;
    state.drain_waited.store(true, Ordering::Release);
}

/// Whether the store can decide `policy`: a leasing store cannot lease a GCRA policy whose
/// headroom would leave a bucket no room (see [`Leases::refuses`]); a policy it never leases
/// (a penalty box, a concurrency limit) it decides whatever its algorithm.
pub(super) fn supports(inner: &Inner, policy: &Policy) -> Result<(), StoreError> {
    let Some(state) = &inner.leases else {
        return Ok(());
    };
    match state.settings.refuses(policy) {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// Whether `policy` is never leased, whatever the settings: a penalty box or a concurrency
/// limit, which every decision must read in Redis.
fn never_leased(policy: &Policy) -> bool {
    policy.block().is_some() || policy.concurrency_limit().is_some()
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u64::MAX as u128) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(limit: &str, algorithm: Algorithm) -> Policy {
        let policy: Policy = limit.parse().unwrap();
        policy.with_algorithm(algorithm)
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
