//! What a store decided for one request.

use std::time::{Duration, SystemTime};

/// The answer of a [`Store`](crate::Store) for one request.
///
/// It describes one limit of the policy: the limit that refused the request, or, when the
/// request was admitted, the limit with the fewest units left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub(crate) allowed: bool,
    /// `u32`, so that it shares a word with the flags: a decision travels in every request's
    /// future.
    pub(crate) limit_index: u32,
    pub(crate) limit: u64,
    pub(crate) window: Duration,
    pub(crate) remaining: u64,
    pub(crate) reset_after: Duration,
    pub(crate) retry_after: Option<Duration>,
    /// When the request was recorded, in µs since the epoch on the store's clock (the memory
    /// store's [`Clock`](crate::store::Clock), Redis `TIME`); `None` when nothing was recorded
    /// or the time is not known.
    pub(crate) admitted_at: Option<i64>,
    /// The time decided at, in µs since the epoch on the store's clock: the event's time for
    /// [`Store::check_at`](crate::Store::check_at), the store's now otherwise; 0 when not known.
    /// [`retry_after`](Self::retry_after) counts from it.
    pub(crate) at: i64,
    /// The units the request recorded (its cost; 0 for a peek or a refusal).
    pub(crate) recorded: u64,
    /// Which of the memory store's states of the key recorded the request (numbered as the
    /// store makes them; 0 on other stores): a refund applies to that state alone, not to
    /// one a reset, an expiry or an eviction made since, even within the same microsecond.
    pub(crate) state: u64,
    /// Refused because the key is in its policy's penalty box.
    pub(crate) penalty: bool,
    /// The concurrency slot the request took, when its policy has a concurrency limit.
    pub(crate) slot: Option<u64>,
    /// Describes the policy's concurrency limit: refused because the key holds every slot,
    /// or every slot not kept for the waiters ahead of the request.
    pub(crate) concurrency: bool,
    /// Refused for a slot while waiting for one: the request's place in its key's queue (its
    /// deadline there, µs on the store's clock); 0 when it is in none.
    pub(crate) place: u64,
    /// Refused for a slot: the key's typical hold time the store keeps (ms; 0: none known).
    pub(crate) hold_ms: u32,
    /// A reservation's wait for its turn ([`Reserve`](crate::store::Reserve)), in ms rounded
    /// up (a `u32`, like `hold_ms`, so that it fits in the padding of the flags: 49 days at
    /// most); 0 for a decision.
    pub(crate) turn_ms: u32,
    /// The attempt the request is, when its policy counts requests by their outcome and it
    /// was admitted: its units stay apart in the store until its outcome is settled
    /// ([`Settlement::refund`](crate::Settlement::refund) or counted); 0 otherwise.
    pub(crate) attempt: u64,
    /// Refused only because attempts still in flight hold the units the request needs.
    pub(crate) busy: bool,
}

impl Decision {
    /// Whether the request was admitted (and recorded).
    pub fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// The index, in [`Policy::limits`](crate::Policy::limits), of the limit described.
    pub(crate) fn limit_index(&self) -> usize {
        self.limit_index as usize
    }

    /// The count of the limit described.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window of the limit described.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Units left in the described limit's current window, after this request.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// The units this request holds in the store: its cost when admitted (the reservation
    /// of a layer that settles usage later,
    /// [`UsageReport::reserve`](crate::usage::UsageReport::reserve)), 0 when refused. They are
    /// not part of [`remaining`](Self::remaining), which counts what is left after them:
    /// what the request may still use is both, as
    /// [`Decisions::allowance`](crate::Decisions::allowance) says.
    pub fn reserved(&self) -> u64 {
        self.recorded
    }

    /// Time until the described limit's remaining count next grows (its oldest counted event
    /// leaves the window).
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// When denied: how long after the time decided the same request would be admitted, if
    /// nothing else is admitted in between; a second earlier it would still be refused. The
    /// time decided is now for [`Store::check`](crate::Store::check), and the event's own time
    /// for [`Store::check_at`](crate::Store::check_at): the event moved by `retry_after` fits,
    /// whatever the log holds before or after it (other events booked later included).
    /// [`retry_at`](Self::retry_at) is the same instant, absolute. `None` when admitted, and
    /// when the request's cost exceeds a limit itself, so that no wait would help: every
    /// refusal whose cost fits the counts has a wait.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// When denied: the instant at which the same request would be admitted, on the store's
    /// clock (Redis `TIME` on a Redis store), if nothing else is admitted in between:
    /// [`retry_after`](Self::retry_after) after the time decided, which is the event's time for
    /// [`Store::check_at`](crate::Store::check_at), so a scheduler moves the event there
    /// without knowing which time the wait counts from. `None` where `retry_after` is, and for
    /// a decision whose time the store does not report (a reservation's).
    pub fn retry_at(&self) -> Option<SystemTime> {
        let at = u64::try_from(self.at).ok().filter(|&at| at > 0)?;
        let decided = SystemTime::UNIX_EPOCH.checked_add(Duration::from_micros(at))?;
        decided.checked_add(self.retry_after?)
    }

    /// This decision, made at `at` (µs since the epoch on the store's clock).
    pub(crate) fn decided_at(self, at: i64) -> Decision {
        Decision { at, ..self }
    }

    pub(crate) fn from_outcome(outcome: crate::model::Outcome, policy: &crate::Policy) -> Decision {
        let limits = policy.limits();
        let Some(&limit) = limits.get(outcome.index).or(limits.last()) else {
            // No rate limit: nothing but a block refuses here (full slots are read apart, as
            // `refused_slot`); an admission describes the concurrency limit.
            if !outcome.allowed {
                return Decision::blocked(policy);
            }
            return Decision {
                allowed: true,
                limit: policy.concurrency_limit().map_or(0, u64::from),
                window: Duration::ZERO,
                concurrency: true,
                ..Decision::blocked(policy)
            };
        };
        Decision {
            allowed: outcome.allowed,
            limit_index: u32::try_from(outcome.index).unwrap_or(u32::MAX),
            limit: limit.count(),
            window: limit.window(),
            remaining: outcome.remaining,
            reset_after: Duration::from_micros(outcome.reset_after),
            retry_after: outcome.retry_after.map(Duration::from_micros),
            admitted_at: None,
            at: 0,
            recorded: 0,
            state: 0,
            penalty: false,
            slot: None,
            concurrency: false,
            place: 0,
            hold_ms: 0,
            turn_ms: 0,
            attempt: 0,
            busy: false,
        }
    }

    /// Whether the request was refused because its key is in the policy's penalty box
    /// ([`Policy::block_for`](crate::Policy::block_for)): it hit the limit, and is refused
    /// for at least the box's length and until its limits admit it again.
    /// [`retry_after`](Self::retry_after) (and [`reset_after`](Self::reset_after)) is then
    /// the later of the two: the time until the same request would be admitted. The decision
    /// describes the policy's first limit, with nothing remaining.
    pub fn in_penalty_box(&self) -> bool {
        self.penalty
    }

    /// Whether the request was refused only because attempts still in flight hold the units
    /// it needs, under a layer that counts requests by their outcome
    /// ([`count_when`](crate::RateLimitLayerBuilder::count_when)): the outcomes counted so far
    /// leave room for it. Such a refusal is no failure: it starts no penalty box, and a soft
    /// layer does not mark the request over ([`Decisions::is_over`](crate::Decisions::is_over)).
    /// [`retry_after`](Self::retry_after) is then an estimate, at most a second: attempts in
    /// flight usually end within it, and give their units back when they succeed.
    pub fn is_busy(&self) -> bool {
        self.busy
    }

    /// This decision, when it admits, as attempt `attempt` (see `attempt`).
    pub(crate) fn as_attempt(self, attempt: u64) -> Decision {
        match self.allowed {
            true => Decision { attempt, ..self },
            false => self,
        }
    }

    /// This refusal, busy (see [`is_busy`](Self::is_busy)), to be retried after `retry`.
    pub(crate) fn made_busy(self, retry: Duration) -> Decision {
        Decision {
            busy: true,
            penalty: false,
            retry_after: Some(retry),
            ..self
        }
    }

    /// The refusal of a key in `policy`'s penalty box, admitted again after `left`: the
    /// later of the box's end and the limits' own retry. It describes the policy's first
    /// limit.
    pub(crate) fn boxed(policy: &crate::Policy, left: Duration) -> Decision {
        // A policy without rate limits takes no box (`Policy::out_of_range`).
        let (limit, window) = policy
            .limits()
            .first()
            .map_or((0, Duration::ZERO), |l| (l.count(), l.window()));
        Decision {
            allowed: false,
            limit_index: 0,
            limit,
            window,
            remaining: 0,
            reset_after: left,
            retry_after: Some(left),
            admitted_at: None,
            at: 0,
            recorded: 0,
            state: 0,
            penalty: true,
            slot: None,
            concurrency: false,
            place: 0,
            hold_ms: 0,
            turn_ms: 0,
            attempt: 0,
            busy: false,
        }
    }

    /// Whether the decision describes the policy's concurrency limit
    /// ([`Policy::concurrency`](crate::Policy::concurrency)) rather than a rate limit: the
    /// request was refused because [`limit`](Self::limit) requests of its key are in flight, or
    /// its policy has no rate limit and the decision admits it (with nothing counted in
    /// [`remaining`](Self::remaining)). [`window`](Self::window) is then zero, and [`retry_after`](Self::retry_after) when a slot
    /// is likely to be free: from the store, the key's typical hold time across every
    /// instance that shares it, or, while the store knows none, when the first slot held would
    /// expire unrenewed; from the layer, the same hold time capped at the slot lifetime and
    /// never under 1 s (the layer's own when the store keeps none).
    pub fn is_concurrency_limit(&self) -> bool {
        self.concurrency
    }

    /// Whether the request took a concurrency slot, which the layer gives back when its
    /// response ends. A caller of [`Store::check`](crate::Store::check) gives it back with
    /// [`Settlement::release`].
    pub(crate) fn holds_slot(&self) -> bool {
        self.slot.is_some()
    }

    /// The refusal of a request whose key holds all `policy`'s concurrency slots; the first
    /// expires unrenewed after `left`.
    pub(crate) fn slots_full(policy: &crate::Policy, left: Duration) -> Decision {
        let left = u64::try_from(left.as_micros()).unwrap_or(u64::MAX);
        let full = crate::model::slots::Full {
            left,
            place: 0,
            hold: 0,
        };
        Decision::refused_slot(policy, full)
    }

    /// The refusal of a request for a concurrency slot, as the store's queue answers it: its
    /// retry is the key's typical hold time where the store knows one, else the time until
    /// the first slot expires.
    pub(crate) fn refused_slot(
        policy: &crate::Policy,
        full: crate::model::slots::Full,
    ) -> Decision {
        let retry = Duration::from_micros(match full.hold {
            0 => full.left,
            hold => hold,
        });
        Decision {
            allowed: false,
            limit_index: u32::try_from(policy.limits().len()).unwrap_or(u32::MAX),
            limit: policy.concurrency_limit().map_or(0, u64::from),
            window: Duration::ZERO,
            remaining: 0,
            reset_after: retry,
            retry_after: Some(retry),
            admitted_at: None,
            at: 0,
            recorded: 0,
            state: 0,
            penalty: false,
            slot: None,
            concurrency: true,
            place: full.place,
            hold_ms: u32::try_from(full.hold.div_ceil(1_000)).unwrap_or(u32::MAX),
            turn_ms: 0,
            attempt: 0,
            busy: false,
        }
    }

    /// How long a reservation waits for its turn ([`Reserve::reserve`](crate::store::Reserve)),
    /// rounded up to a millisecond: its units may be used that long after the store answered,
    /// not before. Zero for a decision, and for a reservation whose turn is now.
    pub(crate) fn turn(&self) -> Duration {
        Duration::from_millis(self.turn_ms.into())
    }

    /// This decision, a reservation whose turn comes after `turn` (rounded up to a ms).
    pub(crate) fn with_turn(self, turn: Duration) -> Decision {
        let ms = turn.as_micros().div_ceil(1_000);
        let turn_ms = u32::try_from(ms).unwrap_or(u32::MAX);
        Decision { turn_ms, ..self }
    }

    /// This decision, holding concurrency slot `slot` when it admits.
    pub(crate) fn with_slot(self, slot: u64) -> Decision {
        Decision {
            slot: self.allowed.then_some(slot),
            ..self
        }
    }

    /// The refusal of a key blocked by an override: a limit of 0, nothing left, and no
    /// wait that helps.
    pub(crate) fn blocked(policy: &crate::Policy) -> Decision {
        let window = policy
            .limits()
            .first()
            .map_or(Duration::ZERO, |l| l.window());
        Decision {
            allowed: false,
            limit_index: 0,
            limit: 0,
            window,
            remaining: 0,
            reset_after: Duration::ZERO,
            retry_after: None,
            admitted_at: None,
            at: 0,
            recorded: 0,
            state: 0,
            penalty: false,
            slot: None,
            concurrency: false,
            place: 0,
            hold_ms: 0,
            turn_ms: 0,
            attempt: 0,
            busy: false,
        }
    }

    /// This decision at a limit of `count` when an override set it (`None`: as it is).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn with_limit(self, count: Option<u64>) -> Decision {
        match count {
            Some(limit) => Decision { limit, ..self },
            None => self,
        }
    }

    /// This decision, recording `units` at `at` (µs on the store's clock) when it admits.
    pub(crate) fn recorded_at(self, at: Option<i64>, units: u64) -> Decision {
        match self.allowed {
            true => Decision {
                admitted_at: at,
                recorded: units,
                ..self
            },
            false => self,
        }
    }
    /// Marks a recorded decision as the memory store's state `state`'s (see `state`).
    pub(crate) fn in_state(self, state: u64) -> Decision {
        Decision { state, ..self }
    }
}
