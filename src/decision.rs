//! What a store decided for one request.

use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::MAX_UNITS;

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
    /// Refused for a slot while waiting for one: the request's place in its key's line (its
    /// deadline there, µs on the store's clock); 0 when it is in none.
    pub(crate) place: u64,
    /// Refused for a slot: the key's typical hold time the store keeps (ms; 0: none known).
    pub(crate) hold_ms: u32,
    /// A reservation's wait for its turn ([`Reserve`](crate::store::Reserve)), in ms rounded
    /// up (a `u32`, like `hold_ms`, so that it fits in the padding of the flags: 49 days at
    /// most); 0 for a decision.
    pub(crate) turn_ms: u32,
}

impl Decision {
    /// Whether the request was admitted (and recorded).
    pub fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// The index, in [`Policy::limits`](crate::Policy::limits), of the limit described.
    pub fn limit_index(&self) -> usize {
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

    /// Time until the described limit's remaining count next grows (its oldest counted event
    /// leaves the window).
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// When denied: the time after which the same request would be admitted, if nothing else
    /// is admitted in between. `None` when admitted, and when the request's cost exceeds the
    /// limit itself, so that no wait would help.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    pub(crate) fn from_outcome(
        outcome: crate::algorithm::Outcome,
        policy: &crate::Policy,
    ) -> Decision {
        let limit = policy.limits()[outcome.index.min(policy.limits().len() - 1)];
        Decision {
            allowed: outcome.allowed,
            limit_index: u32::try_from(outcome.index).unwrap_or(u32::MAX),
            limit: limit.count(),
            window: limit.window(),
            remaining: outcome.remaining,
            reset_after: Duration::from_micros(outcome.reset_after),
            retry_after: outcome.retry_after.map(Duration::from_micros),
            admitted_at: None,
            recorded: 0,
            state: 0,
            penalty: false,
            slot: None,
            concurrency: false,
            place: 0,
            hold_ms: 0,
            turn_ms: 0,
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

    /// The refusal of a key in `policy`'s penalty box, admitted again after `left`: the
    /// later of the box's end and the limits' own retry. It describes the policy's first
    /// limit.
    pub(crate) fn boxed(policy: &crate::Policy, left: Duration) -> Decision {
        let limit = policy.limits()[0];
        Decision {
            allowed: false,
            limit_index: 0,
            limit: limit.count(),
            window: limit.window(),
            remaining: 0,
            reset_after: left,
            retry_after: Some(left),
            admitted_at: None,
            recorded: 0,
            state: 0,
            penalty: true,
            slot: None,
            concurrency: false,
            place: 0,
            hold_ms: 0,
            turn_ms: 0,
        }
    }

    /// Whether the decision describes the policy's concurrency limit
    /// ([`Policy::concurrency`](crate::Policy::concurrency)) rather than a rate limit: the
    /// request was refused because [`limit`](Self::limit) requests of its key are in flight.
    /// [`limit_index`](Self::limit_index) is then the number of rate limits (one past the
    /// last), [`window`](Self::window) zero, and [`retry_after`](Self::retry_after) when a slot
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
    pub fn holds_slot(&self) -> bool {
        self.slot.is_some()
    }

    /// The refusal of a request whose key holds all `policy`'s concurrency slots; the first
    /// expires unrenewed after `left`.
    pub(crate) fn slots_full(policy: &crate::Policy, left: Duration) -> Decision {
        let left = u64::try_from(left.as_micros()).unwrap_or(u64::MAX);
        let full = crate::concurrency::Full {
            left,
            place: 0,
            hold: 0,
        };
        Decision::refused_slot(policy, full)
    }

    /// The refusal of a request for a concurrency slot, as the store's line answers it: its
    /// retry is the key's typical hold time where the store knows one, else the time until
    /// the first slot expires.
    pub(crate) fn refused_slot(policy: &crate::Policy, full: crate::concurrency::Full) -> Decision {
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
            recorded: 0,
            state: 0,
            penalty: false,
            slot: None,
            concurrency: true,
            place: full.place,
            hold_ms: u32::try_from(full.hold.div_ceil(1_000)).unwrap_or(u32::MAX),
            turn_ms: 0,
        }
    }

    /// How long a reservation waits for its turn ([`Reserve::reserve`](crate::store::Reserve)),
    /// rounded up to a millisecond: its units may be used that long after the store answered,
    /// not before. Zero for a decision, and for a reservation whose turn is now.
    pub fn turn(&self) -> Duration {
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
        let limit = policy.limits()[0];
        Decision {
            allowed: false,
            limit_index: 0,
            limit: 0,
            window: limit.window(),
            remaining: 0,
            reset_after: Duration::ZERO,
            retry_after: None,
            admitted_at: None,
            recorded: 0,
            state: 0,
            penalty: false,
            slot: None,
            concurrency: false,
            place: 0,
            hold_ms: 0,
            turn_ms: 0,
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

/// What becomes of an admitted request once it is done, told to the store after the fact:
/// units to add to what its decision recorded (a charge) or to take back (a refund), or its
/// concurrency slot given back or renewed.
///
/// Made from the request's admitted [`Decision`], which carries the units it recorded, when
/// the store recorded them and the slot it took, and given to
/// [`Store::settle`](crate::Store::settle). A refund takes back at most the units the decision
/// recorded (its cost), and only from the state those units were counted in; see
/// [`Store::settle`](crate::Store::settle) for each algorithm.
///
/// ```
/// use tower_redis_ratelimit::{Key, MemoryStore, Policy, Settlement, Store};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_redis_ratelimit::StoreError> {
/// let store = MemoryStore::new();
/// let (key, policy) = (Key::from("client"), "1000/1m".parse::<Policy>().unwrap());
/// // Reserve 10 tokens, then settle on the 250 the request used.
/// let decision = store.check(&key, &policy, 10).await?;
/// if let Some(settlement) = Settlement::charge(&decision, 240) {
///     store.settle(&key, &policy, settlement).await?;
/// }
/// assert_eq!(store.peek(&key, &policy, 1).await?.remaining(), 750);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Adds units to what the request recorded.
    Charge(Units),
    /// Takes back units of those the request recorded.
    Refund(Units),
    /// Gives the request's concurrency slot back, held for this long (zero: not known). The
    /// store keeps the key's typical hold time, from which it says when a slot is likely to
    /// be free to the requests it refuses one.
    Release(SlotId, Duration),
    /// Keeps the request's concurrency slot for another
    /// [`slot_lifetime`](crate::Policy::slot_lifetime) from now.
    Renew(SlotId),
}

/// The units of a [`Settlement::Charge`] or [`Settlement::Refund`], with the admission they
/// belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Units {
    count: u64,
    admitted_at: Option<i64>,
    recorded: u64,
    state: u64,
}

impl Units {
    /// The units added or taken back.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// When the store recorded the request, in µs since the epoch on the store's own clock;
    /// `None` when it is not known (a refund then changes nothing).
    pub fn admitted_at(&self) -> Option<i64> {
        self.admitted_at
    }

    /// The units the request recorded at admission: on the sliding log, a refund finds the
    /// request's own event by its time and this weight.
    pub fn recorded(&self) -> u64 {
        self.recorded
    }

    /// The memory store's state that recorded the request (`Decision`'s `state`).
    pub(crate) fn state(&self) -> u64 {
        self.state
    }
}

/// A concurrency slot's id in the store that gave it
/// ([`Policy::concurrency`](crate::Policy::concurrency)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(pub(crate) u64);

impl SlotId {
    /// The id as the store keeps it.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl Settlement {
    /// Adds `units` for the request that got `decision`; `None` when it was refused.
    ///
    /// A charge over 2^52 units, more than any state holds, is recorded as 2^52 (and logged
    /// as a warning): the key is then refused as long as its algorithm allows for that much,
    /// at least three windows (see `docs/operations.md`, "Range").
    pub fn charge(decision: &Decision, units: u64) -> Option<Settlement> {
        if decision.allowed && units > MAX_UNITS {
            tracing::warn!(
                target: "tower_redis_ratelimit",
                units,
                recorded = MAX_UNITS,
                "a charge past the largest usage a store holds is recorded as that much"
            );
        }
        decision.allowed.then_some(Settlement::Charge(Units {
            count: units.min(MAX_UNITS),
            admitted_at: decision.admitted_at,
            recorded: decision.recorded,
            state: decision.state,
        }))
    }

    /// A charge of `units` for a request counted by its outcome, which recorded nothing
    /// before it was called, admitted or over a soft limit.
    pub(crate) fn count(units: u64) -> Settlement {
        Settlement::Charge(Units {
            count: units.min(MAX_UNITS),
            admitted_at: None,
            recorded: 0,
            state: 0,
        })
    }

    /// Takes back `units` of those the request that got `decision` recorded, at most all of
    /// them (its cost); `None` when it was refused.
    pub fn refund(decision: &Decision, units: u64) -> Option<Settlement> {
        decision.allowed.then_some(Settlement::Refund(Units {
            count: units.min(decision.recorded),
            admitted_at: decision.admitted_at,
            recorded: decision.recorded,
            state: decision.state,
        }))
    }

    /// Gives back the concurrency slot the request that got `decision` took
    /// ([`Policy::concurrency`](crate::Policy::concurrency)); `None` when it took none. The
    /// layer does this when a response ends; a caller of [`Store::check`](crate::Store::check)
    /// does it when its work is done.
    pub fn release(decision: &Decision) -> Option<Settlement> {
        Settlement::release_after(decision, Duration::ZERO)
    }

    /// Gives back the concurrency slot the request that got `decision` took, as
    /// [`release`](Self::release) does, after it held it for `held`: the store counts that
    /// towards the key's typical hold time.
    pub fn release_after(decision: &Decision, held: Duration) -> Option<Settlement> {
        decision
            .slot
            .map(|slot| Settlement::Release(SlotId(slot), held))
    }

    /// Renews the concurrency slot the request that got `decision` took, for another
    /// [`slot_lifetime`](crate::Policy::slot_lifetime) from now; `None` when it took none. A
    /// slot that is no longer held (it expired, or was given back) is not taken again: the
    /// settle answers [`StoreError::SlotGone`](crate::StoreError::SlotGone). The layer renews
    /// the slots of its requests in flight by itself.
    pub fn renew(decision: &Decision) -> Option<Settlement> {
        decision.slot.map(|slot| Settlement::Renew(SlotId(slot)))
    }

    /// Whether this settlement takes units back.
    pub fn is_refund(&self) -> bool {
        match self {
            Settlement::Refund(_) => true,
            Settlement::Charge(_) | Settlement::Release(..) | Settlement::Renew(_) => false,
        }
    }

    /// The units added or taken back; 0 for a concurrency slot's give-back or renewal.
    pub fn units(&self) -> u64 {
        match self {
            Settlement::Charge(units) | Settlement::Refund(units) => units.count,
            Settlement::Release(..) | Settlement::Renew(_) => 0,
        }
    }
}

/// What the rate-limit layers decided about a request, found in its extensions by the
/// handler (`Extension<Decisions>` in axum): one entry per layer the request passed, outermost
/// first, each with the policy that applied. A handler can show the quota left, or, under a
/// [soft](crate::Rule::soft) policy, see that the key is over its limit and ask for a captcha
/// instead of refusing.
///
/// Every request a layer passes on carries `Decisions`, so that `Extension<Decisions>` never
/// fails because of the limiter: a layer whose store decided adds its decision, the same that
/// its `RateLimit` fields describe; a layer that passed the request on without a decision
/// (the key is allow-listed, the request had no key and such requests are let through, or the
/// store failed and the layer fails open) adds an entry saying why, read with
/// [`undecided`](Decisions::undecided). [`get`](Decisions::get), [`iter`](Decisions::iter) and
/// [`is_over`](Decisions::is_over) see decisions only. A request that no rule of a layer
/// applies to gets no entry from it: where no layer may apply, take
/// `Option<Extension<Decisions>>`. (Layers built with
/// [`decisions(false)`](crate::RateLimitLayerBuilder::decisions) add nothing.)
///
/// **Name your policies apart** when several layers decide one request: `get` finds the
/// outermost layer whose policy has the name, so two layers whose policies are both
/// `"default"` hide the inner one from it. A layer that finds its policy's name already there
/// logs a warning (once per layer and policy); [`iter`](Decisions::iter) still shows both.
///
/// ```
/// use axum::{routing::get, Extension, Router};
/// use tower_redis_ratelimit::{Decisions, RateLimitLayer};
///
/// async fn handler(Extension(decisions): Extension<Decisions>) -> String {
///     match decisions.get("default") {
///         Some(d) => format!("{} of {} left", d.remaining(), d.limit()),
///         None => "not limited".into(),
///     }
/// }
///
/// let app: Router = Router::new()
///     .route("/", get(handler))
///     .layer(RateLimitLayer::builder().policy("100/1m").build()?);
/// # Ok::<(), tower_redis_ratelimit::BuildError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Decisions {
    // The first entry inline: one layer, the common case, allocates no list.
    first: Option<(Arc<str>, Entry)>,
    rest: Vec<(Arc<str>, Entry)>,
}

/// Why a layer passed a request on without a decision of its store: the entry it puts in the
/// request's [`Decisions`] instead of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Undecided {
    /// The key is on the layer's allow list
    /// ([`allow_key`](crate::RateLimitLayerBuilder::allow_key),
    /// [`allow_network`](crate::RateLimitLayerBuilder::allow_network)).
    AllowListed,
    /// The request had no key, and the layer lets such requests through
    /// ([`MissingKey::Allow`](crate::response::MissingKey::Allow)).
    MissingKey,
    /// The store could not decide, and the layer fails open
    /// ([`FailureMode::Open`](crate::FailureMode::Open)).
    StoreUnavailable,
}

/// One layer's entry in a request's [`Decisions`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Entry {
    Decided(Decision),
    Undecided(Undecided),
}

impl Decisions {
    /// Adds the entry of a layer inside the ones already there; whether an entry of the same
    /// policy name was there already.
    pub(crate) fn push(&mut self, policy: Arc<str>, entry: Entry) -> bool {
        let repeated = self.entries().any(|(name, _)| **name == *policy);
        match self.first {
            None => self.first = Some((policy, entry)),
            Some(_) => self.rest.push((policy, entry)),
        }
        repeated
    }

    fn entries(&self) -> impl Iterator<Item = &(Arc<str>, Entry)> {
        self.first.iter().chain(&self.rest)
    }

    /// Each deciding layer's policy name and decision, outermost layer first.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Decision)> {
        self.entries().filter_map(|(policy, entry)| match entry {
            Entry::Decided(decision) => Some((&**policy, decision)),
            Entry::Undecided(_) => None,
        })
    }

    /// The decision of the (outermost) layer whose policy is named `policy`.
    pub fn get(&self, policy: &str) -> Option<&Decision> {
        self.iter().find(|(p, _)| *p == policy).map(|(_, d)| d)
    }

    /// Whether any layer found the key over its limit: a request passed on by a soft policy
    /// (or in shadow mode) that would otherwise have been refused.
    pub fn is_over(&self) -> bool {
        self.iter().any(|(_, d)| !d.is_allowed())
    }

    /// The layers that passed the request on without a decision, outermost first: each
    /// one's policy name, and why.
    pub fn undecided(&self) -> impl Iterator<Item = (&str, Undecided)> {
        self.entries().filter_map(|(policy, entry)| match entry {
            Entry::Decided(_) => None,
            Entry::Undecided(why) => Some((&**policy, *why)),
        })
    }

    /// Whether no layer decided the request.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }
}
