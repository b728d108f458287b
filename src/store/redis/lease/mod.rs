//! Leases: a share of a key's budget taken from Redis ahead of need, so that busy keys are
//! decided in this process and Redis sees one call per lease instead of one per request.
//!
//! A lease takes `k` units of a key's budget in one script call, the same call that decides
//! the request that asked for it: the counters add `k` to every limit's window, GCRA moves the
//! backlog by `k` units. The instance then admits requests from those units on its own
//! ([`Store::check_now`](crate::Store::check_now)), fetches the next lease in the background
//! when a quarter of a period's worth is left, and gives back what it did not spend
//! (`scripts/return.lua`) when the key goes idle, when the lease expires, and on
//! [`RedisStore::drain`](super::RedisStore::drain).
//!
//! **Only keys a lease pays for lease.** A lease is a call decided alone, and often a
//! give-back: it pays only when it serves several requests. Each key's use over the last
//! period is counted in a fixed table (`heat.rs`); a key takes its first lease when a lease
//! would serve at least [`HOT`](plan::HOT) units, keeps leasing down to [`COLD`](plan::COLD),
//! and below spends or gives back what it holds and leaves the book. A key that does not lease
//! (most keys of a large key space) has no entry in the book: its requests are decided in
//! Redis, batched, as without leases, and `check_now` answers for it without a lock. Heat
//! changes only who fetches: every decision of a leased policy keeps its headroom.
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

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::oneshot;

use super::placement;
use super::{Inner, RedisStore};
use crate::model::{micros, Algorithm, Outcome};
use crate::shards::lock;
use crate::store::redis::wire::{self, Answer, Answered, Record};
use crate::{Decision, Key, Policy, StoreError};

pub(crate) mod book;
pub(crate) mod heat;
mod plan;
mod state;

use book::{Grant, KeyBook, Return};
use plan::recording;
pub use plan::Leases;
pub(crate) use plan::Plan;
use state::Due;
pub(crate) use state::Leasing;

/// How long a lease's reply is waited for, however long after its caller gave up: Redis
/// counted its units when the script ran, so they are booked (spent or given back) when the
/// reply comes. A reply later than this is not read, and its units count as used until Redis
/// forgets them (the window ends, the bucket drains).
const PATIENCE: Duration = Duration::from_secs(10);

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
    let spot = state.spot(key, policy);
    // A key without leases (the cold ones, most keys) has no book entry: not even a lock.
    if !state.heat.read(spot, now, plan.period).leasing {
        return None;
    }
    let (outcome, granted, prefetch) = state.leased(key, policy, spot, |entry| {
        let (outcome, granted) = entry.take(now, cost.into())?;
        entry.used(now);
        let estimate = state.heat.touch(spot, now, plan.period, cost.into());
        let prefetch = entry.should_prefetch(now, estimate.estimate, plan.cap);
        entry.fetching |= prefetch.is_some();
        Some((outcome, granted, prefetch))
    })??;
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
fn spending(inner: &Inner, state: &Leasing) -> bool {
    !state.is_drained() && inner.limits.is_current()
}

/// What [`check`] does with a request once it has looked at the key's lease.
enum Source {
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
    let plan = state.settings.plan(policy)?;
    if !spending(inner, state) {
        return None;
    }
    let now = state.now();
    let spot = state.spot(key, policy);
    if !state.heat.read(spot, now, plan.period).leasing {
        return None;
    }
    let outcome = state.existing(key, policy, |entry| entry.peek(now, cost.into()))??;
    let decided = i64::try_from(now).unwrap_or(0);
    Some(Decision::from_outcome(outcome, policy).decided_at(decided))
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
fn state(inner: &Inner) -> Result<&Leasing, StoreError> {
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
    let step = source(state, plan, (&key, &policy, cost), now, drained);
    let decided = i64::try_from(now).unwrap_or(0);
    match step {
        Source::Spent(outcome, granted) => {
            Ok(spent(outcome, granted, &policy, cost).decided_at(decided))
        }
        Source::Lease(want) => lease(&inner, plan, &key, &policy, cost, want).await,
        Source::Redis { behind: false } => decide(&inner, plan, &key, &policy, cost).await,
        Source::Redis { behind: true } => {
            // This instance's own lease is on its way: Redis may refuse because of the units
            // it is taking. Then the request waits for it (within the budget) rather than be
            // refused while this instance holds room.
            let decision = decide(&inner, plan, &key, &policy, cost).await?;
            if decision.is_allowed() || !landed(state, &key, &policy, inner.timeout).await {
                return Ok(decision);
            }
            let now = state.now();
            match state
                .existing(&key, &policy, |entry| entry.take(now, cost.into()))
                .flatten()
            {
                Some((outcome, granted)) => {
                    let decided = i64::try_from(now).unwrap_or(0);
                    Ok(spent(outcome, granted, &policy, cost).decided_at(decided))
                }
                None => Ok(decision),
            }
        }
    }
}

/// Where the request of `cost` that [`check`] decides at `now` goes: a key whose recent use
/// says that a lease would not pay (cold, and not leasing) goes to Redis without a book entry;
/// a hot one spends from its lease, or takes one. Either way its use is counted in the heat
/// table first.
fn source(
    state: &Leasing,
    plan: Plan,
    (key, policy, cost): (&Key, &Policy, u32),
    now: u64,
    drained: bool,
) -> Source {
    let spot = state.spot(key, policy);
    let heat = state.heat.touch(spot, now, plan.period, cost.into());
    let lease = plan.lease_size(heat.estimate, cost.into(), heat.leasing);
    if !heat.leasing && (drained || lease.is_none()) {
        return Source::Redis { behind: false };
    }
    state.with(key, policy, plan.period, |entry| {
        entry.used(now);
        if drained {
            return Source::Redis { behind: false };
        }
        if let Some((outcome, granted)) = entry.take(now, cost.into()) {
            return Source::Spent(outcome, granted);
        }
        match lease {
            Some(want) if !entry.fetching => {
                entry.fetching = true;
                Source::Lease(want)
            }
            _ => Source::Redis {
                behind: entry.fetching,
            },
        }
    })
}

/// Waits up to `budget` for the lease being fetched for `key` to be booked; whether it was.
async fn landed(state: &Leasing, key: &Key, policy: &Policy, budget: Duration) -> bool {
    let fetching = || state.existing(key, policy, |entry| entry.fetching) == Some(true);
    until_landed(state, budget, || !fetching()).await
}

/// Waits up to `budget`, waking as each lease call is booked, until `done`; whether it came.
async fn until_landed(state: &Leasing, budget: Duration, done: impl Fn() -> bool) -> bool {
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
    let answer = inner
        .decide(place, policy, (cost.into(), 0), -1, record)
        .await?;
    let verdict = answer.verdict(policy)?;
    state.existing(key, policy, |entry| {
        entry.answered(verdict.outcome, answer.time)
    });
    let decision = verdict.decision(policy).decided_at(answer.time);
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
    let decision = decision.decided_at(answer.time);
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
        state.existing(key, policy, |entry| entry.fetching = false);
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
        let args = wire::encode_for(&policy, &place, (cost.into(), 0), record, -1, known);
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
        state.with(&key, &policy, plan.period, |entry| {
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
            let _ = return_unused(&store, true).await;
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
    entry: &mut KeyBook,
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
pub(super) async fn return_unused(store: &RedisStore, all: bool) -> Result<u64, StoreError> {
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
/// (or of every key when `all`), as give-backs to send; forgets the keys left empty that are
/// idle or cooling ([`KeyBook::can_go`]), clearing their leasing bit.
fn returns(store: &RedisStore, state: &Leasing, now: u64, all: bool) -> Vec<Due> {
    let mut due = Vec::new();
    state.book.retain(|key, held| {
        let plan = state.settings.plan(&held.policy);
        let (idle, length) = plan.map_or((0, 1), |p| (p.period / 4, p.period));
        for Return { units, granted } in held.entry.returns(now, idle, all) {
            let policy = &held.policy;
            let windows = policy.windows();
            let args = wire::encode_return(policy.algorithm(), units, granted, windows);
            due.push(Due {
                key: store.inner.place(key, policy).key,
                args,
                units,
                until: now + micros(policy.longest_window()),
            });
        }
        let estimate = state.heat.read(held.spot, now, length).estimate;
        let gone = held.entry.can_go(now, idle, estimate);
        if gone {
            state.heat.unpin(held.spot);
        }
        !gone
    });
    due
}

/// The keys with an entry in the lease book (the keys that lease), for tests.
#[cfg(feature = "test-util")]
pub(super) fn leasing_keys(inner: &Inner) -> u64 {
    inner.leases.as_ref().map_or(0, Leasing::keys)
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
            let call = store
                .inner
                .batcher
                .return_units(keys, args.collect(), PATIENCE);
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
            if let Err(error) = return_unused(&store, false).await {
                tracing::debug!(
                    target: "tower_redis_ratelimit",
                    error = %crate::chain::Chain(&error),
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
