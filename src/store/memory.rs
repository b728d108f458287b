//! The embedded store: state in this process, for one instance, development and tests.

use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::line::Line;
use super::override_table::Table;
use super::overrides::{Applied, Overrides};
use super::reserve::{self, reservable, InLine, Reserve, Ticket};
use super::{Store, StoreError};
use crate::algorithm::{
    decide,
    fixed_window::FixedWindow,
    gcra::Gcra,
    reserve::{reserve, Reserved},
    settle,
    sliding_log::SlidingLog,
    sliding_window::SlidingWindow,
    Algorithm, Outcome, Refund, Settle, Window,
};
use crate::concurrency::{Slots, Waiter};
use crate::shards::{Entry, Pinning, Shards};
use crate::{Decision, Key, Policy, Settlement};

/// The time for [`MemoryStore`]: elapsed since the UNIX epoch.
///
/// Wall-clock based, so that event times ([`Store::check_at`]) and fixed windows (aligned to
/// the epoch) mean the same as in Redis. Must not go backwards. Inject one to test with virtual
/// time; see [`ManualClock`] and [`TokioClock`].
pub trait Clock: Send + Sync + 'static {
    /// The time elapsed since the UNIX epoch.
    fn now(&self) -> Duration;
}

/// The default clock: the system time when the clock is made, advanced by tokio's monotonic
/// `Instant`. It follows tokio's paused test clock (`#[tokio::test(start_paused = true)]`,
/// `tokio::time::advance`) when there is one, and never goes backwards.
#[derive(Debug, Clone)]
pub struct TokioClock {
    start: Duration,
    origin: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::starting_at(SystemTime::now())
    }
}

impl TokioClock {
    /// A clock that reads `start` now and advances with tokio's clock.
    pub fn starting_at(start: SystemTime) -> Self {
        TokioClock {
            start: since_epoch(start),
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.start + tokio::time::Instant::now().saturating_duration_since(self.origin)
    }
}

/// A clock that moves only when told to; clones share one time. Starts at the UNIX epoch.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::{Clock, ManualClock};
///
/// let clock = ManualClock::default();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now(), Duration::from_millis(1500));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start`.
    pub fn starting_at(start: SystemTime) -> Self {
        let clock = ManualClock::default();
        clock.advance(since_epoch(start));
        clock
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.micros.fetch_add(micros(by), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::SeqCst))
    }
}

fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default()
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u64::MAX as u128) as u64
}

/// Rate-limit state kept in this process.
///
/// Bounded: it holds at most [`max_keys`](MemoryStoreBuilder::max_keys) keys (client ×
/// policy), and forgets a key once its policy's longest window has passed without a request,
/// since its state would be empty by then. When the bound is reached, expired keys are dropped
/// first, then the least recently used of the keys that are not pinned (a refused request
/// counts as use); an evicted key starts again with a full budget, so size the bound above the
/// number of clients you expect within the longest window.
///
/// **Pinned keys.** A key in its penalty box ([`Policy::block_for`]) is pinned until the
/// lockout its box's first refusal announced has passed (the later of the box's end and its
/// limits' own `Retry-After` then), and a key that holds concurrency slots ([`Policy::concurrency`])
/// until its last slot expires: every other key is evicted first, so that a flood of new
/// clients cannot free a boxed one. The bound is per shard: the keys are split over
/// `max_keys / 256` shards, rounded up to a power of two, from 1 to 64 (4 shards of 250 keys
/// for `max_keys(1_000)`, 64 of 1 562 for the default 100 000), and each holds at most
/// `max_keys / shards` keys, pinned or not. A store therefore keeps every boxed key while no
/// shard holds `max_keys / shards` pinned keys; keys fall into shards at random, so keep the
/// keys boxed or with requests in flight at once well under `max_keys` (under half keeps every
/// shard far from full). A shard whose keys are all pinned evicts the one whose pin ends
/// soonest (it starts afresh, out of its box), counted in `ratelimit_evicted_pinned_total`
/// (feature `metrics`): the bound holds whatever clients do.
///
/// Keys are spread over independently locked shards, and a decision holds one shard's lock for
/// the few arithmetic steps it takes, so concurrent requests rarely wait on each other. Runs
/// the same algorithms as [`RedisStore`](crate::RedisStore). Clones share state.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    entries: Shards<State>,
    /// The id of the next concurrency slot taken.
    next_slot: AtomicU64,
    /// The number of the next key state made (`State::number`).
    next_state: AtomicU64,
    clock: Arc<dyn Clock>,
    overrides: Arc<Table>,
}

impl Shared {
    /// A new, empty state for `algorithm`, numbered.
    fn fresh(&self, algorithm: Algorithm) -> State {
        State::new(algorithm, self.next_state.fetch_add(1, Ordering::Relaxed))
    }
}

/// One key's state: which one it is, and its algorithm's state.
struct State {
    /// This state's number, from the store's count of the states it has made (from 1). A
    /// refund applies only to the state that recorded its request (`Decision`'s `state`):
    /// one made afresh since (a reset, an expiry, an eviction) never held its units, even
    /// when made in the same microsecond, as on a clock that stands still.
    number: u64,
    of: Of,
    /// Until when (µs) the key is in its policy's penalty box (the box's own length); 0 when
    /// it never was. Requests are then refused whatever the limits say.
    boxed_until: u64,
    /// Until when (µs) the box holds once its length has passed, unless the key is admitted
    /// first (0: no box): the limits decide again, but a refusal of theirs is the box's, and
    /// sets no new one. Set with the box to the later of its end and the state's expiry.
    held_until: u64,
    /// Until when (µs) the key is refused, as the refusal that set its box said (the later of
    /// the box's end and the limits' own retry): the map keeps the key that long, so that a
    /// flood of other keys cannot evict a locked-out one and give it a fresh budget.
    locked_until: u64,
    /// The key's concurrency slots, when its policy has a concurrency limit.
    slots: Slots,
    /// The key's reservations waiting for their turns, and its pause ([`Reserve`]).
    line: Line,
}

/// The state of one key under the algorithm of its policy.
enum Of {
    Log(SlidingLog),
    Sliding(SlidingWindow),
    Fixed(FixedWindow),
    Gcra(Gcra),
}

/// What one decision asks, in the store's units.
struct Ask {
    /// The store's time (µs).
    now: u64,
    /// The time (µs) decided at: `now`, or the request's event time.
    t: u64,
    cost: u64,
    /// Whether an admitted request is recorded (a check) or only looked at (a peek).
    record: bool,
    /// The concurrency slot an admitted request takes: only a recorded decision under a
    /// concurrency limit takes one.
    take: Option<Take>,
    /// The request's place in its key's line for a slot, when it waits for one.
    waiter: Option<Waiter>,
    /// How much longer than its longest window the state must be kept ([`Stretch`]).
    stretch: Stretch,
    /// A reservation ([`Reserve`]).
    reserve: Option<Booking>,
}

/// A reservation's [`Ticket`] in the store's units (µs).
#[derive(Clone, Copy)]
struct Booking {
    id: u64,
    max_wait: u64,
    late: u64,
    notice: u64,
}

/// How much longer a GCRA state decided under an override's counts must be kept than their
/// longest window: its backlog holds units of cost, which weigh `count / count'` times more
/// under the policy's own counts than under the override's (`src/algorithm/gcra.rs`), so once
/// the override is removed it drains that much slower. The largest such ratio of the limits, as
/// a fraction; 1 for the other algorithms, whose state is kept by time alone.
#[derive(Clone, Copy)]
struct Stretch(u64, u64);

impl Stretch {
    const NONE: Stretch = Stretch(1, 1);

    /// The stretch of state decided under `used`, the counts in force for a key of `own`.
    fn of(own: &Policy, used: &Policy) -> Stretch {
        if used.algorithm() != Algorithm::Gcra {
            return Stretch::NONE;
        }
        let pairs = own.limits().iter().zip(used.limits());
        pairs.fold(Stretch::NONE, |most, (own, used)| {
            let (over, under) = (used.count(), own.count().max(1));
            match u128::from(over) * u128::from(most.1) > u128::from(most.0) * u128::from(under) {
                true => Stretch(over, under),
                false => most,
            }
        })
    }

    /// `micros` stretched, rounded up.
    fn apply(self, micros: u64) -> u64 {
        let stretched = (u128::from(micros) * u128::from(self.0)).div_ceil(u128::from(self.1));
        u64::try_from(stretched).unwrap_or(u64::MAX)
    }
}

/// What a settle or a waiter leaving does to a key's concurrency slots.
enum SlotOp {
    GiveBack { id: u64, held: Duration },
    Renew(u64),
    Leave(u64),
}

/// The concurrency slot a request takes when admitted.
#[derive(Clone, Copy)]
struct Take {
    /// The policy's concurrency limit.
    cap: u32,
    id: u64,
    /// Until when (µs) the slot is held unless renewed.
    until: u64,
}

/// What a key's state answered, under its shard's lock.
struct Answer {
    outcome: Outcome,
    /// Until when (µs) the key's state must be kept, when the decision recorded something:
    /// the request it admitted, or the penalty box its refusal earned.
    keep_until: Option<u64>,
    /// When the penalty box answers the refusal (it set the box, or the box holds): its
    /// retry (µs), the later of the box's end and the limits' own retry.
    boxed: Option<u64>,
    /// A reservation's turn (µs, the store's time), when it was reserved.
    turn: Option<u64>,
}

/// The map keeps a key while it is locked out by its penalty box, holds concurrency slots, or
/// has reservations waiting for their turns or a pause.
impl Pinning for State {
    fn pinned_until(&self) -> u64 {
        let line = self.line.last().unwrap_or(0).max(self.line.paused_until());
        self.locked_until.max(self.slots.last_expiry()).max(line)
    }
}

impl State {
    fn new(algorithm: Algorithm, number: u64) -> State {
        let of = match algorithm {
            Algorithm::SlidingLog => Of::Log(SlidingLog::default()),
            Algorithm::SlidingWindow => Of::Sliding(SlidingWindow::default()),
            Algorithm::FixedWindow => Of::Fixed(FixedWindow::default()),
            Algorithm::Gcra => Of::Gcra(Gcra::default()),
        };
        State {
            number,
            of,
            boxed_until: 0,
            held_until: 0,
            locked_until: 0,
            slots: Slots::default(),
            line: Line::default(),
        }
    }

    /// Puts the key in `policy`'s penalty box from `now`, if it has one and is not in one
    /// already (nothing extends a box), holding it at least until `kept` (the state's
    /// expiry); `retry` is the limits' own (µs). Until when the box lasts.
    fn penalize(&mut self, now: u64, policy: &Policy, kept: u64, retry: u64) -> Option<u64> {
        let block = policy.block_micros();
        if block == 0 || self.held_until > now {
            return None;
        }
        self.boxed_until = now.saturating_add(block);
        self.held_until = self.boxed_until.max(kept);
        self.locked_until = self.boxed_until.max(now.saturating_add(retry));
        Some(self.boxed_until)
    }

    /// Puts the key in `policy`'s penalty box, if it has one and is not in one already, when
    /// a charge has left it no unit (a look for one more would be refused); until when.
    fn penalize_if_full(&mut self, now: u64, policy: &Policy, kept: u64) -> Option<u64> {
        if policy.block_micros() == 0 || self.held_until > now {
            return None;
        }
        let looked = self.decide(now, now, policy, 1, false);
        if looked.allowed {
            return None;
        }
        self.penalize(now, policy, kept, looked.retry_after.unwrap_or(0))
    }

    fn algorithm(&self) -> Algorithm {
        match self.of {
            Of::Log(_) => Algorithm::SlidingLog,
            Of::Sliding(_) => Algorithm::SlidingWindow,
            Of::Fixed(_) => Algorithm::FixedWindow,
            Of::Gcra(_) => Algorithm::Gcra,
        }
    }

    /// Decides at `t` (µs); `now` is the store's time, which may differ for event times.
    fn decide(&mut self, now: u64, t: u64, policy: &Policy, cost: u64, record: bool) -> Outcome {
        let windows = policy.windows();
        match &mut self.of {
            Of::Log(log) => {
                trim(log, now.min(t), policy);
                decide(log, t, windows, cost, record)
            }
            Of::Sliding(s) => decide(s, t, windows, cost, record),
            Of::Fixed(s) => decide(s, t, windows, cost, record),
            Of::Gcra(s) => decide(s, t, windows, cost, record),
        }
    }

    /// The refusal a request meets before the limits decide it: the key is in its penalty
    /// box, or the request would take a concurrency slot and the key holds every one.
    ///
    /// In the box, the limits are looked at without recording, and the refusal's retry is the
    /// later of the box's end and theirs: the time until the same request is admitted. A
    /// request that no wait helps (larger than a limit itself) gets the limits' refusal.
    fn refusal(&mut self, policy: &Policy, ask: &Ask) -> Option<Decision> {
        // The state is the policy's name's (`Policy::state_id`): a box another policy of the
        // name set answers only for policies with a box, as on Redis.
        let boxes = policy.block_micros() > 0;
        if boxes && self.boxed_until > ask.now {
            let looked = self.decide(ask.now, ask.t, policy, ask.cost, false);
            if !looked.allowed && looked.retry_after.is_none() {
                return Some(Decision::from_outcome(looked, policy));
            }
            let left = (self.boxed_until - ask.now).max(looked.retry_after.unwrap_or(0));
            return Some(Decision::boxed(policy, Duration::from_micros(left)));
        }
        let full = self
            .slots
            .full(ask.now, ask.take?.cap, ask.waiter.as_ref())?;
        Some(Decision::refused_slot(policy, full))
    }

    /// Decides `ask` against the limits, and keeps what a recorded decision leaves: the
    /// request it admits and the concurrency slot that takes, or the penalty box of a refusal.
    /// `kept` is until when the key's state is kept so far (0: new).
    fn answer(&mut self, policy: &Policy, ask: &Ask, kept: u64) -> Answer {
        if let Some(booking) = ask.reserve {
            return self.reserve(policy, ask, booking);
        }
        let (now, t) = (ask.now, ask.t);
        let outcome = self.decide(now, t, policy, ask.cost, ask.record);
        if ask.record && outcome.allowed {
            // The key is admitted again: a box that held past its length ends.
            (self.held_until, self.locked_until) = (0, 0);
            let mut until = expiry(policy, now, t, ask.stretch);
            if let Some(take) = ask.take {
                self.slots.take(take.id, take.until, ask.waiter.as_ref());
                until = until.max(take.until);
            }
            return Answer {
                outcome,
                keep_until: Some(until),
                boxed: None,
                turn: None,
            };
        }
        // Refused by a limit that a wait satisfies (not a request larger than the limit
        // itself, which no wait helps and the key did not earn): the box answers, the one
        // that still holds, or a new one a recorded refusal sets.
        let Some(retry) = outcome.retry_after else {
            return Answer {
                outcome,
                keep_until: None,
                boxed: None,
                turn: None,
            };
        };
        if self.held_until > now && policy.block_micros() > 0 {
            return Answer {
                outcome,
                keep_until: None,
                boxed: Some(retry),
                turn: None,
            };
        }
        let until = match ask.record {
            true => self.penalize(now, policy, kept, retry),
            false => None,
        };
        Answer {
            outcome,
            keep_until: until,
            boxed: until.map(|until| (until - now).max(retry)),
            turn: None,
        }
    }

    /// Reserves `ask`'s cost for its turn, after the key's pause and within its most wait
    /// (`algorithm::reserve`), and puts it in the key's line: the answer of a request admitted
    /// at its turn, and the key kept a window past it. Its units may be used `late` after
    /// their turn: the log reads its windows that much longer, GCRA keeps that much drain free
    /// in every bucket (as Redis does, `gcra.lua`).
    fn reserve(&mut self, policy: &Policy, ask: &Ask, booking: Booking) -> Answer {
        let Booking {
            id,
            max_wait,
            late,
            notice,
        } = booking;
        let (now, windows) = (ask.now, policy.windows());
        // Reserved as if asked at the pause's end, so that GCRA's bucket drains from there.
        let from = self.line.floor(now);
        let shift = from - now;
        let reserved = match (&mut self.of, max_wait.checked_sub(shift)) {
            (_, None) => Reserved::TooLate(Some(0)),
            (Of::Log(log), Some(wait)) => {
                trim(log, now.saturating_sub(late), policy);
                let longer: Vec<Window> = windows
                    .iter()
                    .map(|w| Window::new(w.count, w.micros.saturating_add(late)))
                    .collect();
                reserve(log, from, &longer, ask.cost, wait)
            }
            (Of::Gcra(bucket), Some(wait)) => {
                let tighter: Vec<Window> = windows
                    .iter()
                    .map(|w| Window {
                        micros: w.micros.saturating_sub(late),
                        ..*w
                    })
                    .collect();
                reserve(bucket, from, &tighter, ask.cost, wait)
            }
            // `reservable` refuses them first.
            (Of::Sliding(_) | Of::Fixed(_), _) => Reserved::TooLate(None),
        };
        let reserved = match reserved {
            Reserved::TooLate(wait) => Reserved::TooLate(wait.map(|w| w + shift)),
            Reserved::At(turn) => {
                self.line.join(now, turn, id, (ask.cost, notice));
                Reserved::At(turn)
            }
        };
        let (turn, outcome) = match reserved {
            Reserved::At(turn) => (Some(turn), self.decide(now, turn, policy, 0, false)),
            Reserved::TooLate(wait) => {
                let looked = self.decide(now, now, policy, ask.cost, false);
                let refused = Outcome {
                    allowed: false,
                    retry_after: wait,
                    ..looked
                };
                (None, refused)
            }
        };
        Answer {
            outcome,
            keep_until: turn.map(|turn| expiry(policy, now, turn, ask.stretch) + late),
            boxed: None,
            turn,
        }
    }

    /// How long from `now` the state matters under `policy`'s counts, when that can be longer
    /// than the policy's retention from its last write (a GCRA backlog, read under other
    /// counts than it was written under, or overfilled by a charge); 0 otherwise.
    fn drained_in(&self, now: u64, policy: &Policy) -> u64 {
        match &self.of {
            Of::Gcra(s) => s.drained_in(now, policy.windows()),
            _ => 0,
        }
    }

    /// Records a settlement at `now`; returns how long the state matters from now on, when
    /// that can be longer than the policy's retention (a GCRA bucket charged past its size).
    fn settle(&mut self, now: u64, policy: &Policy, change: Settle) -> u64 {
        let windows = policy.windows();
        match &mut self.of {
            Of::Log(log) => {
                trim(log, now, policy);
                settle(log, now, windows, change);
                0
            }
            Of::Sliding(s) => {
                settle(s, now, windows, change);
                0
            }
            Of::Fixed(s) => {
                settle(s, now, windows, change);
                0
            }
            Of::Gcra(s) => {
                settle(s, now, windows, change);
                s.drained_in(now, windows)
            }
        }
    }
}

/// Drops the events no window around `t` or later can hold.
fn trim(log: &mut SlidingLog, t: u64, policy: &Policy) {
    if let Some(cutoff) = t.checked_sub(micros(policy.longest_window())) {
        log.trim(cutoff);
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// The number of keys a store holds at most unless told otherwise.
    pub const DEFAULT_MAX_KEYS: u64 = 100_000;

    /// A store with the default bound and clock.
    pub fn new() -> Self {
        MemoryStore::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_keys: Self::DEFAULT_MAX_KEYS,
            clock: None,
        }
    }

    /// The number of events (admitted requests, one each whatever its cost) a sliding log
    /// holds for `key` under `policy` that are younger than its longest window.
    ///
    /// Meant for tests and diagnostics; 0 for other algorithms and expired keys.
    pub fn events(&self, key: &Key, policy: &Policy) -> usize {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(entry) if entry.is_live(now) => match &mut entry.value.of {
                Of::Log(log) => {
                    trim(log, now, policy);
                    log.events()
                }
                Of::Sliding(_) | Of::Fixed(_) | Of::Gcra(_) => 0,
            },
            _ => 0,
        }
    }

    /// The concurrency slots ([`Policy::concurrency`]) that `key` holds under `policy` now:
    /// its requests in flight, counted on every instance that shares this store.
    ///
    /// Meant for tests and diagnostics.
    pub fn slots_in_use(&self, key: &Key, policy: &Policy) -> usize {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(entry) if entry.is_live(now) => entry.value.slots.live(now),
            _ => 0,
        }
    }

    /// The store's overrides: limits changed at run time for a key or a whole policy,
    /// applied to every decision of this store and its clones from the next one on.
    pub fn overrides(&self) -> Overrides {
        super::override_table::overrides(&self.shared.overrides)
    }

    /// The number of keys held, once expired ones are dropped.
    pub fn key_count(&self) -> u64 {
        self.shared.entries.len(self.now())
    }

    fn now(&self) -> u64 {
        micros(self.shared.clock.now())
    }

    /// Decides at event time `at` (`None`: now), recording an admitted request if `record`.
    fn decide(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        at: Option<SystemTime>,
        record: bool,
        waiter: Option<&Waiter>,
    ) -> Ready<Result<Decision, StoreError>> {
        if let Err(error) = decidable(policy, at) {
            return ready(Err(error));
        }
        // The concurrency limit is the request's policy's, whatever counts an override sets.
        let ask = Ask {
            waiter: waiter.copied(),
            ..self.ask(policy, cost, at, record)
        };
        ready(Ok(self.decide_overridden(key, policy, ask)))
    }

    /// Decides `ask` under the limits in force for `key` (an override's, or `policy`'s own).
    fn decide_overridden(&self, key: &Key, policy: &Policy, ask: Ask) -> Decision {
        match self.shared.overrides.apply(key, policy) {
            Applied::Own(policy) => self.decide_under(key, policy, &ask),
            Applied::Other(used) => {
                let stretch = Stretch::of(policy, &used);
                self.decide_under(key, &used, &Ask { stretch, ..ask })
            }
            Applied::Blocked => Decision::blocked(policy),
        }
    }

    /// What a decision of `cost` at event time `at` (`None`: now) asks; a recorded one under a
    /// concurrency limit draws the id of the slot it takes if admitted.
    fn ask(&self, policy: &Policy, cost: u32, at: Option<SystemTime>, record: bool) -> Ask {
        let now = self.now();
        let take = policy
            .concurrency_limit()
            .filter(|_| record)
            .map(|cap| Take {
                cap,
                id: self.shared.next_slot.fetch_add(1, Ordering::Relaxed),
                until: now.saturating_add(policy.slot_micros()),
            });
        Ask {
            now,
            t: at.map_or(now, |at| micros(since_epoch(at))),
            cost: u64::from(cost),
            record,
            take,
            waiter: None,
            stretch: Stretch::NONE,
            reserve: None,
        }
    }

    /// Decides `ask` for `key` under `policy`, the limits in force for it, holding the key's
    /// shard locked only while its state answers.
    fn decide_under(&self, key: &Key, policy: &Policy, ask: &Ask) -> Decision {
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let answer = match shard.get(key, policy.state_id(), ask.now) {
            Some(entry) => match answer_held(entry, policy, ask, &self.shared) {
                Ok(answer) => (answer, entry.value.number),
                Err(refusal) => return *refusal,
            },
            None => {
                let mut state = self.shared.fresh(policy.algorithm());
                let answer = state.answer(policy, ask, 0);
                let number = state.number;
                // The map holds a key once a decision has recorded something for it.
                if let Some(until) = answer.keep_until {
                    shard.insert(key, policy.state_id(), ask.now, until, state);
                }
                (answer, number)
            }
        };
        drop(shard);
        decision(answer, policy, ask)
    }

    /// Does `op` to the concurrency slots of `key` under `policy`; whether the slot (or the
    /// waiter) was there.
    fn keep_slot(&self, key: &Key, policy: &Policy, op: SlotOp) -> bool {
        let now = self.now();
        let until = now.saturating_add(policy.slot_micros());
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let Some(entry) = shard.get(key, policy.state_id(), now) else {
            return false;
        };
        if !entry.is_live(now) {
            return false;
        }
        let slots = &mut entry.value.slots;
        match op {
            SlotOp::GiveBack { id, held } => slots.give_back(id, micros(held)),
            SlotOp::Leave(id) => slots.leave(id),
            SlotOp::Renew(id) => {
                let kept = slots.renew(now, id, until);
                entry.expires = entry.expires.max(slots.last_expiry());
                kept
            }
        }
    }

    /// The policy whose counts `key` is decided by under `policy` (an override's, or its
    /// own, a blocked key's too), and how much longer its state is kept for it ([`Stretch`]).
    fn in_force(&self, key: &Key, policy: &Policy) -> (Policy, Stretch) {
        match self.shared.overrides.apply(key, policy) {
            Applied::Other(used) => {
                let stretch = Stretch::of(policy, &used);
                (used, stretch)
            }
            _ => (policy.clone(), Stretch::NONE),
        }
    }

    /// Records `settlement` for `key` under `policy`, now.
    fn settle_now(&self, key: &Key, policy: &Policy, settlement: Settlement) {
        let now = self.now();
        // Settled under the counts the key is decided by; a blocked key's under its own.
        let (in_force, stretch) = self.in_force(key, policy);
        let policy = &in_force;
        let algorithm = policy.algorithm();
        // The state a refund's units were recorded in, the only one it applies to.
        let recorded_in = match &settlement {
            Settlement::Refund(units) => Some(units.state()),
            _ => None,
        };
        let change = match settlement {
            Settlement::Charge(units) => Settle::Charge(units.count()),
            Settlement::Refund(units) => Settle::Refund(Refund {
                units: units.count(),
                at: units.admitted_at().and_then(|at| u64::try_from(at).ok()),
                recorded: units.recorded(),
            }),
            // Slots are kept by `keep_slot`; they record no units.
            Settlement::Release(..) | Settlement::Renew(_) => Settle::Charge(0),
        };
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            Some(entry) => {
                let stale = !entry.is_live(now) || entry.value.algorithm() != algorithm;
                if recorded_in.is_some_and(|n| stale || n != entry.value.number) {
                    return;
                }
                if stale {
                    entry.value = self.shared.fresh(algorithm);
                }
                let drained = stretch.apply(entry.value.settle(now, policy, change));
                entry.expires = entry.expires.max(now.saturating_add(drained));
                if let Settle::Charge(_) = change {
                    entry.expires = entry.expires.max(expiry(policy, now, now, stretch));
                    // A charge that fills the key puts it in the penalty box, unless it is in
                    // one already.
                    let kept = entry.expires;
                    let boxed = entry.value.penalize_if_full(now, policy, kept);
                    entry.expires = entry.expires.max(boxed.unwrap_or(0));
                }
            }
            // Nothing recorded is left to refund.
            None if matches!(change, Settle::Refund { .. }) => {}
            None => {
                let mut state = self.shared.fresh(algorithm);
                let drained = stretch.apply(state.settle(now, policy, change));
                let kept = expiry(policy, now, now, stretch).max(now.saturating_add(drained));
                let boxed = state.penalize_if_full(now, policy, kept).unwrap_or(0);
                shard.insert(key, policy.state_id(), now, kept.max(boxed), state);
            }
        }
    }
}

/// Whether this store decides `policy` at event time `at` (`None`: now): its limits must be in
/// the algorithms' range, and an event time needs an algorithm that takes one and a policy
/// without a concurrency limit.
fn decidable(policy: &Policy, at: Option<SystemTime>) -> Result<(), StoreError> {
    super::in_range(policy)?;
    if at.is_none() {
        return Ok(());
    }
    if !policy.algorithm().takes_event_times() {
        return Err(StoreError::Unsupported(
            "event times need the sliding log algorithm",
        ));
    }
    if policy.concurrency_limit().is_some() {
        return Err(StoreError::Unsupported(
            "event times take no concurrency slot",
        ));
    }
    Ok(())
}

/// Answers `ask` for a key the map holds in `entry`, afresh when its state has expired or was
/// kept under another algorithm; `Err` with the refusal it meets before the limits are asked
/// (boxed: a penalty box or a full key is the rare answer, and a decision is large).
fn answer_held(
    entry: &mut Entry<State>,
    policy: &Policy,
    ask: &Ask,
    shared: &Shared,
) -> Result<Answer, Box<Decision>> {
    let algorithm = policy.algorithm();
    if !entry.is_live(ask.now) || entry.value.algorithm() != algorithm {
        entry.value = shared.fresh(algorithm);
    }
    if let Some(refusal) = entry.value.refusal(policy, ask) {
        // A waiter refused a slot may have joined the key's line: the key is kept as long.
        entry.expires = entry.expires.max(entry.value.slots.last_expiry());
        return Err(Box::new(refusal));
    }
    // Under counts lower than those it was written under (an override's cut, a plan's), a
    // GCRA backlog drains later than the expiry its write set: the key is kept until it has,
    // so that a refusal's retry holds, and a penalty box set now holds as long.
    let drained = entry.value.drained_in(ask.now, policy);
    entry.expires = entry.expires.max(ask.now.saturating_add(drained));
    let answer = entry.value.answer(policy, ask, entry.expires);
    if let Some(until) = answer.keep_until {
        entry.expires = entry.expires.max(until);
    }
    Ok(answer)
}

/// The decision `answer` makes: the penalty box's refusal, or the limits' outcome, with the
/// concurrency slot an admitted request took and what a recorded one recorded.
fn decision((answer, state): (Answer, u64), policy: &Policy, ask: &Ask) -> Decision {
    if let Some(left) = answer.boxed {
        return Decision::boxed(policy, Duration::from_micros(left));
    }
    let mut decision = Decision::from_outcome(answer.outcome, policy);
    if let Some(take) = ask.take {
        decision = decision.with_slot(take.id);
    }
    if let Some(turn) = answer.turn {
        let wait = Duration::from_micros(turn - ask.now);
        let recorded = decision.recorded_at(i64::try_from(turn).ok(), ask.cost);
        return recorded.in_state(state).with_turn(wait);
    }
    match ask.record {
        true => decision
            .recorded_at(i64::try_from(ask.t).ok(), ask.cost)
            .in_state(state),
        false => decision,
    }
}

/// Reserves in the map, as decisions are made: under the override or plan in force for the
/// key, blocked by a block; the key is kept until a window past its last turn, and its line
/// with it.
impl Reserve for MemoryStore {
    type LineFuture = Ready<Result<InLine, StoreError>>;

    fn reserve(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::Future {
        let supported = super::in_range(policy).and_then(|()| reservable(policy));
        if let Err(error) = supported.and_then(|()| reserve::in_range(policy, &ticket)) {
            return ready(Err(error));
        }
        let booking = Booking {
            id: ticket.id,
            max_wait: micros(ticket.max_wait),
            late: micros(ticket.late),
            notice: micros(ticket.notice),
        };
        let ask = Ask {
            reserve: Some(booking),
            ..self.ask(policy, ticket.cost, None, true)
        };
        ready(Ok(self.decide_overridden(key, policy, ask)))
    }

    fn look(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        ready(Ok(self.in_line(key, policy, |state, now| {
            state.line.look(now, ticket.id)
        })))
    }

    /// The place left at the end is refunded under the counts in force for the key, only
    /// where the key's state is the one the line was kept with (it is the same entry).
    fn leave(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        let (in_force, _) = self.in_force(key, policy);
        ready(Ok(self.in_line(key, policy, |state, now| {
            let (at, left) = state.line.leave(now, ticket.id)?;
            if left.given_back(in_force.algorithm()) {
                let refund = Refund {
                    units: left.cost,
                    at: Some(left.at),
                    recorded: left.cost,
                };
                state.settle(now, &in_force, Settle::Refund(refund));
            }
            Some(at)
        })))
    }

    fn pause(&self, key: &Key, policy: &Policy, pause: Duration) -> Self::LineFuture {
        let now = self.now();
        let until = now.saturating_add(micros(pause));
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let paused = match shard.get(key, policy.state_id(), now) {
            Some(entry) if entry.is_live(now) => {
                entry.value.line.pause(until);
                entry.expires = entry.expires.max(until);
                entry.value.line.paused_until()
            }
            _ => {
                let mut state = self.shared.fresh(policy.algorithm());
                state.line.pause(until);
                shard.insert(key, policy.state_id(), now, until, state);
                until
            }
        };
        ready(Ok(InLine {
            turn: None,
            paused: Duration::from_micros(paused.saturating_sub(now)),
        }))
    }
}

impl MemoryStore {
    /// Runs `f` on the line of `key` under `policy`, with the time and the key's state, and
    /// answers where the reservation it names stands (the turn `f` returns) and the pause.
    fn in_line(
        &self,
        key: &Key,
        policy: &Policy,
        f: impl FnOnce(&mut State, u64) -> Option<u64>,
    ) -> InLine {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        let Some(entry) = shard
            .get(key, policy.state_id(), now)
            .filter(|e| e.is_live(now))
        else {
            return InLine {
                turn: None,
                paused: Duration::ZERO,
            };
        };
        let state = &mut entry.value;
        let turn = f(state, now);
        InLine {
            turn: turn.map(|at| Duration::from_micros(at.saturating_sub(now))),
            paused: Duration::from_micros(state.line.paused_until().saturating_sub(now)),
        }
    }
}

/// When the state left by an event at `t`, decided at `now`, stops mattering: a window after
/// the later of the two (a future event counts until its window has passed), `stretch`ed.
fn expiry(policy: &Policy, now: u64, t: u64, stretch: Stretch) -> u64 {
    let retention = micros(policy.algorithm().retention(policy.longest_window()));
    now.max(t).saturating_add(stretch.apply(retention))
}

/// Configures a [`MemoryStore`].
pub struct MemoryStoreBuilder {
    max_keys: u64,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    /// The most keys (client × policy) held at once; default
    /// [`MemoryStore::DEFAULT_MAX_KEYS`]. At least one key per shard is always held.
    pub fn max_keys(mut self, max_keys: u64) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The clock decisions are made with; default [`TokioClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            shared: Arc::new(Shared {
                entries: Shards::new(self.max_keys),
                next_slot: AtomicU64::new(1),
                next_state: AtomicU64::new(1),
                clock: self
                    .clock
                    .unwrap_or_else(|| Arc::new(TokioClock::default())),
                overrides: Arc::default(),
            }),
        }
    }
}

impl Store for MemoryStore {
    type Future = Ready<Result<Decision, StoreError>>;
    type ResetFuture = Ready<Result<(), StoreError>>;

    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, true, None)
    }

    fn check_at(&self, key: &Key, policy: &Policy, cost: u32, at: SystemTime) -> Self::Future {
        self.decide(key, policy, cost, Some(at), true, None)
    }

    fn peek(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future {
        self.decide(key, policy, cost, None, false, None)
    }

    fn reset(&self, key: &Key, policy: &Policy) -> Self::ResetFuture {
        let now = self.now();
        let mut shard = self.shared.entries.lock(key, policy.state_id());
        match shard.get(key, policy.state_id(), now) {
            // The requests in flight still are: their slots stay.
            Some(entry) if entry.value.slots.last_expiry() > now => {
                let slots = std::mem::take(&mut entry.value.slots);
                entry.value = State {
                    slots,
                    ..self.shared.fresh(policy.algorithm())
                };
            }
            _ => shard.remove(key, policy.state_id()),
        }
        ready(Ok(()))
    }

    fn settle(&self, key: &Key, policy: &Policy, settlement: Settlement) -> Self::ResetFuture {
        if let Err(error) = super::in_range(policy) {
            return ready(Err(error));
        }
        match settlement {
            Settlement::Release(id, held) => {
                let give_back = SlotOp::GiveBack { id: id.get(), held };
                self.keep_slot(key, policy, give_back);
            }
            Settlement::Renew(id) if !self.keep_slot(key, policy, SlotOp::Renew(id.get())) => {
                return ready(Err(StoreError::SlotGone))
            }
            Settlement::Renew(_) => {}
            Settlement::Charge(_) | Settlement::Refund(_) => {
                self.settle_now(key, policy, settlement)
            }
        }
        ready(Ok(()))
    }

    fn settle_now(
        &self,
        key: &Key,
        policy: &Policy,
        settlement: Settlement,
    ) -> Option<Result<(), StoreError>> {
        Some(self.settle(key, policy, settlement).into_inner())
    }

    fn check_now(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
    ) -> Option<Result<Decision, StoreError>> {
        Some(self.check(key, policy, cost).into_inner())
    }

    fn check_in_line(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        waiter: &Waiter,
    ) -> Self::Future {
        self.decide(key, policy, cost, None, true, Some(waiter))
    }

    fn leave_line(&self, key: &Key, policy: &Policy, waiter: &Waiter) {
        self.keep_slot(key, policy, SlotOp::Leave(waiter.id()));
    }

    fn is_local(&self) -> bool {
        true
    }

    fn limits_version(&self) -> u64 {
        self.shared.overrides.version()
    }

    fn run_time_overrides(&self) -> Option<Overrides> {
        Some(self.overrides())
    }
}
