//! [`Settlement`]: what an admitted request owes the store after the fact.

use std::time::Duration;

use crate::model::MAX_UNITS;
use crate::Decision;

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
pub struct Settlement {
    pub(crate) owed: Owed,
}

/// What a [`Settlement`] tells the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owed {
    /// Adds units to what the request recorded.
    Charge(Units),
    /// Takes back units of those the request recorded.
    Refund(Units),
    /// Gives the request's concurrency slot back (releases it), held for this long (zero: not
    /// known). The store keeps the key's typical hold time, from which it says when a slot is
    /// likely to be free to the requests it refuses one.
    Release(SlotId, Duration),
    /// Keeps the request's concurrency slot for another
    /// [`slot_lifetime`](crate::Policy::slot_lifetime) from now.
    Renew(SlotId),
}

/// The units of a charge or a refund, with the admission they belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Units {
    count: u64,
    admitted_at: Option<i64>,
    recorded: u64,
    state: u64,
    /// The attempt whose outcome this settles, under a policy that counts requests by their
    /// outcome (`Decision`'s `attempt`); 0 otherwise.
    attempt: u64,
    /// When an attempt's units start draining in a single-limit GCRA bucket (µs on the
    /// store's clock): after the units ahead of them, which its decision's `reset_after` less
    /// its own drain tells. A refund frees what has not drained since; from the admission, a
    /// burst of attempts held together would leave most of its units behind.
    drains_from: Option<i64>,
}

impl Units {
    /// The units added or taken back.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    /// When the store recorded the request, in µs since the epoch on the store's own clock;
    /// `None` when it is not known (a refund then changes nothing).
    pub(crate) fn admitted_at(&self) -> Option<i64> {
        self.admitted_at
    }

    /// The units the request recorded at admission: on the sliding log, a refund finds the
    /// request's own event by its time and this weight.
    pub(crate) fn recorded(&self) -> u64 {
        self.recorded
    }

    /// The memory store's state that recorded the request (`Decision`'s `state`).
    pub(crate) fn state(&self) -> u64 {
        self.state
    }

    /// The attempt whose outcome this settles; 0 for none.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn attempt(&self) -> u64 {
        self.attempt
    }

    /// When the units start draining, for a single-limit GCRA bucket (see `drains_from`).
    pub(crate) fn drains_from(&self) -> Option<i64> {
        self.drains_from
    }
}

/// A concurrency slot's id in the store that gave it
/// ([`Policy::concurrency`](crate::Policy::concurrency)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SlotId(pub(crate) u64);

impl SlotId {
    /// The id as the store keeps it.
    pub(crate) fn get(self) -> u64 {
        self.0
    }
}

/// When an attempt's units start draining in a single-limit GCRA bucket (`Units`'
/// `drains_from`): its admission, plus the time its bucket took to drain after it
/// (`reset_after`), less its own units' drain (`recorded * window / limit`). `None` for
/// anything but an admitted attempt (attempts take no leases, whose decisions describe
/// another bucket); the store uses it for single-limit GCRA policies alone.
fn drains_from(decision: &Decision) -> Option<i64> {
    let admitted = decision.admitted_at?;
    if decision.attempt == 0 || decision.limit == 0 {
        return None;
    }
    let window = decision.window.as_micros();
    let own = (u128::from(decision.recorded) * window).div_ceil(u128::from(decision.limit));
    let queue = decision.reset_after.as_micros().checked_sub(own)?;
    let start = i128::from(admitted) + i128::try_from(queue).ok()?;
    i64::try_from(start).ok().filter(|&start| start > admitted)
}

impl Settlement {
    fn of(owed: Owed) -> Settlement {
        Settlement { owed }
    }

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
        decision
            .allowed
            .then_some(Settlement::of(Owed::Charge(Units {
                count: units.min(MAX_UNITS),
                admitted_at: decision.admitted_at,
                recorded: decision.recorded,
                state: decision.state,
                attempt: decision.attempt,
                drains_from: None,
            })))
    }

    /// A charge of `units` for a request counted by its outcome, which recorded nothing
    /// before it was called, admitted or over a soft limit.
    pub(crate) fn count(units: u64) -> Settlement {
        Settlement::of(Owed::Charge(Units {
            count: units.min(MAX_UNITS),
            admitted_at: None,
            recorded: 0,
            state: 0,
            attempt: 0,
            drains_from: None,
        }))
    }

    /// The outcome of attempt `decision` counts: its units stay, and it is no longer in
    /// flight (`Policy::counting_attempts`); `None` when it is no attempt.
    pub(crate) fn counted(decision: &Decision) -> Option<Settlement> {
        (decision.allowed && decision.attempt != 0).then_some(Settlement::of(Owed::Refund(Units {
            count: 0,
            admitted_at: decision.admitted_at,
            recorded: decision.recorded,
            state: decision.state,
            attempt: decision.attempt,
            drains_from: None,
        })))
    }

    /// Takes back `units` of those the request that got `decision` recorded, at most all of
    /// them (its cost); `None` when it was refused.
    pub fn refund(decision: &Decision, units: u64) -> Option<Settlement> {
        decision
            .allowed
            .then_some(Settlement::of(Owed::Refund(Units {
                count: units.min(decision.recorded),
                admitted_at: decision.admitted_at,
                recorded: decision.recorded,
                state: decision.state,
                attempt: decision.attempt,
                drains_from: drains_from(decision),
            })))
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
    pub(crate) fn release_after(decision: &Decision, held: Duration) -> Option<Settlement> {
        decision
            .slot
            .map(|slot| Settlement::of(Owed::Release(SlotId(slot), held)))
    }

    /// Renews the concurrency slot the request that got `decision` took, for another
    /// [`slot_lifetime`](crate::Policy::slot_lifetime) from now; `None` when it took none. A
    /// slot that is no longer held (it expired, or was given back) is not taken again: the
    /// settle answers [`StoreError::SlotGone`](crate::StoreError::SlotGone). The layer renews
    /// the slots of its requests in flight by itself.
    pub(crate) fn renew(decision: &Decision) -> Option<Settlement> {
        decision
            .slot
            .map(|slot| Settlement::of(Owed::Renew(SlotId(slot))))
    }

    /// Whether this settlement takes units back.
    pub(crate) fn is_refund(&self) -> bool {
        match self.owed {
            Owed::Refund(_) => true,
            Owed::Charge(_) | Owed::Release(..) | Owed::Renew(_) => false,
        }
    }

    /// The attempt this settles the outcome of (`Decision`'s `attempt`); 0 for none.
    pub(crate) fn attempt(&self) -> u64 {
        match self.owed {
            Owed::Charge(units) | Owed::Refund(units) => units.attempt,
            Owed::Release(..) | Owed::Renew(_) => 0,
        }
    }

    /// The units added or taken back; 0 for a concurrency slot's give-back or renewal.
    pub(crate) fn units(&self) -> u64 {
        match self.owed {
            Owed::Charge(units) | Owed::Refund(units) => units.count,
            Owed::Release(..) | Owed::Renew(_) => 0,
        }
    }
}
