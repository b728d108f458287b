//! Reservations on Redis: the algorithm's script in its `RESERVE` mode (`prelude.lua`), one
//! call that finds the request's turn after every reservation before and records it, so that
//! turns follow reservation order across every instance sharing the Redis.

use std::sync::Arc;
use std::time::Duration;

use super::protocol::Record;
use super::{lease, RedisStore};
use crate::store::reserve::{reservable, Reserve};
use crate::{Key, Policy};

impl Reserve for RedisStore {
    /// Decided in Redis, never from a lease; on a leasing store against the same headroom as
    /// its decisions (the sliding log's longer window), so that leased units spent late and
    /// reservations never share a window past its count.
    fn reserve(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u32,
        max_wait: Duration,
        late: Duration,
    ) -> Self::Future {
        if let Err(error) = crate::store::in_range(policy).and_then(|()| reservable(policy)) {
            return Box::pin(std::future::ready(Err(error)));
        }
        let inner = Arc::clone(&self.inner);
        let place = inner.place(key, policy);
        let policy = policy.clone();
        let record = Record::Reserve {
            max_wait: micros(max_wait),
            headroom: lease::headroom(&inner, &policy).max(micros(late)),
        };
        Box::pin(async move {
            let answer = inner
                .decide(place, &policy, cost.into(), -1, record)
                .await?;
            let mut verdict = answer.verdict(&policy)?;
            if !verdict.outcome.allowed {
                // The retry is the turn it would have had.
                return Ok(verdict.decision(&policy));
            }
            // Admitted, the retry is its turn (µs from Redis's now), where it was recorded.
            let turn = verdict.outcome.retry_after.take().unwrap_or(0);
            let at = answer
                .time
                .saturating_add(i64::try_from(turn).unwrap_or(i64::MAX));
            let decision = verdict.decision(&policy).recorded_at(Some(at), cost.into());
            Ok(decision.with_turn(Duration::from_micros(turn)))
        })
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
