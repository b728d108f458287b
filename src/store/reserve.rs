//! Reservations: a request that waits for its turn instead of being refused, for calls a
//! service makes to an API that limits it (`docs/outbound.md`).

use std::time::Duration;

use super::Store;
use crate::{Algorithm, Key, Policy, StoreError};

/// A store that reserves: it answers when a request's units may be used rather than only
/// whether they may be used now.
///
/// A reservation is recorded at once, so the next caller queues behind it, in reservation
/// order, on every instance that shares the store. Give one back, when its caller stops
/// waiting, with [`Store::settle`] and [`Settlement::refund`](crate::Settlement::refund) of
/// its cost: it never frees more than was reserved.
pub trait Reserve: Store {
    /// Reserves `cost` units of `key` under `policy` for the earliest time they fit every
    /// limit after every reservation made before, if that is at most `max_wait` away: an
    /// admitted decision whose [`turn`](crate::Decision::turn) says how long to wait before
    /// using them. Past `max_wait` nothing is recorded, and the refusal's
    /// [`retry_after`](crate::Decision::retry_after) says when the turn would have come
    /// (`None`: never, a cost over a count).
    ///
    /// `late`: how long after its turn the caller may use the units, as the limit that counts
    /// them sees it (an upstream API counts requests as they arrive, a network's delay after
    /// they left). Turns keep every window `late` longer within its count (the sliding log
    /// reads it that much longer, GCRA keeps that much drain free on Redis), so that units
    /// used up to `late` after their turns stay within the limit (`docs/leases.md` has the
    /// argument, for leases).
    ///
    /// GCRA and the sliding log reserve; the counters keep no place for a later turn, and a
    /// penalty box or a concurrency limit has no meaning for a turn:
    /// [`StoreError::Unsupported`].
    fn reserve(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        max_wait: Duration,
        late: Duration,
    ) -> Self::Future;
}

/// Whether `policy` can be reserved ([`Reserve::reserve`]).
pub(crate) fn reservable(policy: &Policy) -> Result<(), StoreError> {
    match policy.algorithm() {
        Algorithm::Gcra | Algorithm::SlidingLog => {}
        Algorithm::FixedWindow | Algorithm::SlidingWindow => {
            return Err(StoreError::Unsupported(
                "reservations need GCRA or the sliding log: a counter keeps no place for a \
                 later turn",
            ))
        }
    }
    if policy.block().is_some() || policy.concurrency_limit().is_some() {
        return Err(StoreError::Unsupported(
            "reservations take no penalty box and no concurrency limit",
        ));
    }
    Ok(())
}
