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
//! - GCRA: a lease expires `h` after it was taken, and every decision of a leasing store keeps
//!   `h` of drain free in each bucket (the script's headroom), so spending up to `h` late never
//!   lets the bucket hold more than its capacity. The burst is `c * (1 - h / w)` instead of `c`;
//!   the rate is unchanged. `h` is at most the lease period and `max_share` of the shortest
//!   window.
//!
//! **Under-admission** is the price: units one instance holds are refused to the others until
//! they are spent or given back, at most `max_share` of the limit per instance and key, and for
//! at most one lease period (sooner when the key goes idle).
//!
//! The sliding log cannot be leased: its exactness is per event, and units spent after they
//! were logged would sit at the wrong times in it. A leasing store refuses it at build time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::batch::{self, Answer, Record};
use super::{Inner, RedisStore};
use crate::algorithm::{window_start, Algorithm, Outcome};
use crate::shards::Shards;
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
/// instance sharing a Redis should use the same settings: GCRA's headroom is only kept by
/// leasing stores.
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
    /// may be spent for that long at most (less for GCRA and at the end of a counter's window;
    /// see the module docs). Longer periods mean fewer Redis calls and larger shares held by
    /// one instance.
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

    /// How `policy` is leased; `None` when it is not (the sliding log, or a share under two
    /// units).
    fn plan(&self, policy: &Policy) -> Option<Plan> {
        let smallest = policy.windows().iter().map(|w| w.count).min()?;
        let cap = (smallest as f64 * self.max_share) as u64;
        let shortest = policy.windows()[0].micros;
        let period = micros(self.period);
        let (period, headroom) = match policy.algorithm() {
            Algorithm::SlidingLog => return None,
            Algorithm::Gcra => {
                let h = period.min((shortest as f64 * self.max_share) as u64);
                (h, h)
            }
            _ => (period, 0),
        };
        (cap >= 2 && period > 0).then_some(Plan {
            cap,
            period,
            headroom,
        })
    }
}

/// How one policy is leased.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// The most units one lease takes.
    cap: u64,
    /// The longest a lease lasts (µs), and the span whose use sets its size.
    period: u64,
    /// GCRA's headroom (µs), kept by every decision of the policy; 0 for the counters.
    headroom: u64,
}

impl Plan {
    /// What a request that goes to Redis records: a lease of `want` units, or its cost alone.
    fn record(&self, want: Option<u64>, cost: u32) -> Record {
        match (want, self.headroom) {
            (None, 0) => Record::Yes,
            (want, headroom) => Record::Lease {
                want: want.unwrap_or(cost.into()),
                headroom,
            },
        }
    }

    /// Local time until which units granted at Redis time `granted`, for a request sent at
    /// local time `sent`, may be spent. Measured from the sending, which is before Redis ran
    /// the script.
    fn expiry(&self, policy: &Policy, sent: u64, granted: i64) -> u64 {
        let t = u64::try_from(granted).unwrap_or(0);
        let life = match policy.algorithm() {
            Algorithm::Gcra => self.period,
            _ => policy
                .windows()
                .iter()
                .map(|w| window_start(t, w.micros) + w.micros - t)
                .fold(self.period, u64::min),
        };
        sent + life
    }
}

/// What a leasing store keeps.
pub(super) struct State {
    settings: Leases,
    book: Shards<Held>,
    origin: tokio::time::Instant,
    /// Set by [`RedisStore::drain`]: no new leases.
    drained: AtomicBool,
}

/// One key's leases, with the policy they are for.
struct Held {
    policy: Policy,
    entry: Entry,
}

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
        }
    }

    /// Local µs since the store was made.
    fn now(&self) -> u64 {
        micros(self.origin.elapsed())
    }

    /// Runs `f` on the entry of `key` under `policy`, made if missing.
    fn with<T>(&self, key: &Key, policy: &Policy, f: impl FnOnce(&mut Entry) -> T) -> T {
        let now = self.now();
        let mut locked = self.book.lock(key, policy);
        if let Some(slot) = locked.get(key, policy, now) {
            return f(&mut slot.value.entry);
        }
        let mut held = Held {
            policy: policy.clone(),
            entry: Entry::default(),
        };
        let out = f(&mut held.entry);
        locked.insert(key, policy, now, u64::MAX, held);
        out
    }
}

/// The decision of [`Store::check_now`](crate::Store::check_now): from this instance's lease,
/// when it holds the units; the next lease is fetched in the background when few are left.
pub(super) fn check_now(
    inner: &Arc<Inner>,
    key: &Key,
    policy: &Policy,
    cost: u32,
) -> Option<Result<Decision, StoreError>> {
    let state = inner.leases.as_ref()?;
    let plan = state.settings.plan(policy)?;
    let now = state.now();
    let drained = state.drained.load(Ordering::Relaxed);
    let (outcome, granted, prefetch) = state.with(key, policy, |entry| {
        let (outcome, granted) = entry.take(now, cost.into())?;
        entry.used(now, plan.period, cost.into());
        let prefetch = entry
            .should_prefetch(now, plan.period, plan.cap)
            .filter(|_| !drained);
        entry.fetching |= prefetch.is_some();
        Some((outcome, granted, prefetch))
    })?;
    if let Some(want) = prefetch {
        let (inner, key, policy) = (Arc::clone(inner), key.clone(), policy.clone());
        tokio::spawn(async move {
            let record = plan.record(Some(want), 0);
            let _ = fetch(&inner, plan, &key, &policy, 0, record, true).await;
        });
    }
    let decision = Decision::from_outcome(outcome, policy);
    Some(Ok(decision.recorded_at(granted, cost.into())))
}

/// The lease state of a store that was given a plan, so has leases.
fn state(inner: &Inner) -> Result<&State, StoreError> {
    (inner.leases.as_ref()).ok_or_else(|| StoreError::Config("leases are off".into()))
}

/// How `policy` is leased by the store of `inner`, if it is.
pub(super) fn plan(inner: &Inner, policy: &Policy) -> Option<Plan> {
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
    let drained = state.drained.load(Ordering::Relaxed);
    let step = state.with(&key, &policy, |entry| {
        entry.used(now, plan.period, cost.into());
        if let Some(taken) = entry.take(now, cost.into()) {
            return Err(taken);
        }
        let want = entry.want(now, plan.period, cost.into(), plan.cap);
        let lease = want > u64::from(cost) && !entry.fetching && !drained;
        entry.fetching |= lease;
        Ok(lease.then_some(want))
    });
    let want = match step {
        Err((outcome, granted)) => {
            let decision = Decision::from_outcome(outcome, &policy);
            return Ok(decision.recorded_at(granted, cost.into()));
        }
        Ok(want) => want,
    };
    let record = plan.record(want, cost);
    fetch(&inner, plan, &key, &policy, cost, record, want.is_some()).await
}

/// Asks Redis to decide a request of `cost` with `record`; `lease`: whether this call was
/// counted as the key's fetch, which its answer ends.
async fn fetch(
    inner: &Arc<Inner>,
    plan: Plan,
    key: &Key,
    policy: &Policy,
    cost: u32,
    record: Record,
    lease: bool,
) -> Result<Decision, StoreError> {
    let state = state(inner)?;
    let sent = state.now();
    let place = inner.place(key, policy);
    let answer = inner.decide(place, policy, cost.into(), -1, record).await;
    let parsed = answer.and_then(|a| Ok((super::parse_reply(&a.five, policy)?, a)));
    state.with(key, policy, |entry| {
        entry.fetching &= !lease;
        if let Ok((outcome, Answer { time, .. })) = &parsed {
            match record {
                Record::Lease { .. } if outcome.0.allowed => {
                    let grant = Grant {
                        units: outcome.1,
                        expires: plan.expiry(policy, sent, *time),
                        granted: *time,
                    };
                    entry.granted(grant, outcome.0);
                }
                _ => entry.answered(outcome.0),
            }
        }
    });
    let ((outcome, extra), answer) = parsed?;
    let outcome = Outcome {
        remaining: outcome.remaining + extra,
        ..outcome
    };
    let decision = Decision::from_outcome(outcome, policy);
    Ok(decision.recorded_at(Some(answer.time), cost.into()))
}

/// Gives back, at `now`, the units of expired leases, and all of those of idle keys (or of
/// every key when `all`). Returns the units handed back.
pub(super) async fn give_back(store: &RedisStore, all: bool) -> Result<u64, StoreError> {
    let Some(state) = store.inner.leases.as_ref() else {
        return Ok(0);
    };
    let now = state.now();
    let mut keys = Vec::new();
    let mut args = Vec::new();
    let mut units = 0;
    state.book.retain(|key, held| {
        let plan = state.settings.plan(&held.policy);
        let idle = plan.map_or(0, |p| p.period / 4);
        for Return { units: u, granted } in held.entry.returns(now, idle, all) {
            let policy = &held.policy;
            keys.push(store.inner.place(key, policy).key);
            let windows = policy.windows();
            args.push(batch::encode_release(
                policy.algorithm(),
                u,
                granted,
                windows,
            ));
            units += u;
        }
        !(held.entry.is_empty() && now.saturating_sub(held.entry.last_used) >= idle)
    });
    let mut result = Ok(units);
    for group in batch::by_slot(&keys, store.inner.batcher.is_clustered()) {
        for chunk in group.chunks(512) {
            let keys = chunk.iter().map(|&i| keys[i].clone()).collect();
            let args = chunk
                .iter()
                .flat_map(|&i| args[i].iter().copied())
                .collect();
            let call = store.inner.batcher.release(keys, args);
            if let Err(error) = store.inner.guarded(call).await {
                result = Err(error);
            }
        }
    }
    result
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

/// Stops new leases, for [`RedisStore::drain`].
pub(super) fn stop(inner: &Inner) {
    if let Some(state) = &inner.leases {
        state.drained.store(true, Ordering::Relaxed);
    }
}

/// Why a leasing store cannot take `policy`, if it cannot.
pub(super) fn refuses(inner: &Inner, policy: &Policy) -> Option<&'static str> {
    (inner.leases.is_some() && policy.algorithm() == Algorithm::SlidingLog).then_some(
        "the sliding log cannot be leased: its events must be logged at the times they are \
         admitted; use GCRA or a window counter with leases, or a store without leases",
    )
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u64::MAX as u128) as u64
}
