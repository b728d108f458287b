//! Reservations on Redis: the algorithm's script in its `RESERVE` mode (`prelude.lua`), one
//! call that finds the request's turn after every reservation before and records it, so that
//! turns follow reservation order across every instance sharing the Redis; and the key's line
//! of reservations (`scripts/line.lua`), which those waiting look up, leave and pause.

use std::sync::Arc;
use std::time::Duration;

use super::{lease, BoxFuture, Inner, RedisStore};
use crate::model::line::gives_back;
use crate::store::redis::wire::Record;
use crate::store::reserve::{self, reservable, InLine, Reserve, Ticket};
use crate::store::Store;
use crate::{Key, Policy, StoreError};

/// How long a call of `line.lua` waits for its reply: a leave's give-back is worth sending
/// however late Redis runs it, as a settlement's is.
const PATIENCE: Duration = Duration::from_secs(3);

impl Reserve for RedisStore {
    type LineFuture = BoxFuture<InLine>;
    type LinesFuture = BoxFuture<Vec<InLine>>;

    /// Decided in Redis, never from a lease; on a leasing store against the same headroom as
    /// its decisions (the sliding log's longer window), so that leased units spent late and
    /// reservations never share a window past its count.
    fn reserve(&self, key: &Key, policy: &Policy, ticket: Ticket) -> <Self as Store>::Future {
        let supported = crate::store::in_range(policy).and_then(|()| reservable(policy));
        if let Err(error) = supported.and_then(|()| reserve::in_range(policy, &ticket)) {
            return Box::pin(std::future::ready(Err(error)));
        }
        let inner = Arc::clone(&self.inner);
        let place = inner.place(key, policy);
        let policy = policy.clone();
        let record = Record::Reserve {
            max_wait: micros(ticket.max_wait),
            headroom: lease::headroom(&inner, &policy).max(micros(ticket.late)),
            id: ticket.id,
            notice: micros(ticket.notice),
        };
        let cost = u64::from(ticket.cost);
        Box::pin(async move {
            let answer = inner.decide(place, &policy, (cost, 0), -1, record).await?;
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
            let decision = verdict.decision(&policy).recorded_at(Some(at), cost);
            Ok(decision.with_turn(Duration::from_micros(turn)))
        })
    }

    fn look(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        let args = vec![member(ticket), micros(ticket.late).to_string()];
        let op = line(&self.inner, self.redis_key(key, policy), "look", args);
        Box::pin(async move { Ok(op.await?.0) })
    }

    fn look_many(&self, key: &Key, policy: &Policy, tickets: Vec<Ticket>) -> Self::LinesFuture {
        let args = tickets.iter().map(|&t| member(t)).collect();
        let call = lines(&self.inner, self.redis_key(key, policy), "many", args);
        let count = tickets.len();
        Box::pin(async move {
            let reply = call.await?;
            let Some((&paused, stood)) = reply.split_first() else {
                return Err(StoreError::Unavailable);
            };
            if stood.len() != 2 * count {
                return Err(StoreError::Unavailable);
            }
            Ok(stood
                .chunks(2)
                .map(|pair| in_line(pair[0], pair[1], paused))
                .collect())
        })
    }

    /// The place left at the end is given back by the policy's script (a refund at its
    /// time, of its cost), right after: a reservation made in between queues behind units
    /// that are about to be freed, and is none the worse.
    fn leave(&self, key: &Key, policy: &Policy, ticket: Ticket) -> Self::LineFuture {
        let args = vec![member(ticket)];
        let op = line(&self.inner, self.redis_key(key, policy), "leave", args);
        let inner = Arc::clone(&self.inner);
        let place = inner.place(key, policy);
        let policy = policy.clone();
        Box::pin(async move {
            let (stood, left) = op.await?;
            let free = left.filter(|&(_, last)| gives_back(policy.algorithm(), last));
            if let Some((free, _)) = free {
                let cost = u64::from(ticket.cost);
                let refund = Record::Settle {
                    refund: true,
                    admitted: free,
                    recorded: cost,
                    headroom: 0,
                    drains: -1,
                };
                inner.decide(place, &policy, (cost, 0), -1, refund).await?;
            }
            Ok(stood)
        })
    }

    fn pause(&self, key: &Key, policy: &Policy, pause: Duration) -> Self::LineFuture {
        let args = vec![micros(pause).to_string()];
        let op = line(&self.inner, self.redis_key(key, policy), "pause", args);
        Box::pin(async move { Ok(op.await?.0) })
    }
}

/// A reservation's member in its key's line (`prelude.lua`, `join_line`).
fn member(ticket: Ticket) -> String {
    format!("{}:{}:{}", ticket.id, ticket.cost, micros(ticket.notice))
}

/// One call of `line.lua` on the line of `redis_key`, behind the key's breaker: where the
/// reservation stands, and the place a leave left at the end (Redis time, µs) with whether it
/// is the last in line.
fn line(
    inner: &Arc<Inner>,
    redis_key: String,
    op: &'static str,
    args: Vec<String>,
) -> BoxFuture<(InLine, Option<(i64, bool)>)> {
    let call = lines(inner, redis_key, op, args);
    Box::pin(async move {
        let reply = call.await?;
        let [turn, past, paused, free, last] = reply[..] else {
            return Err(StoreError::Unavailable);
        };
        Ok((
            in_line(turn, past, paused),
            (free >= 0).then_some((free, last == 1)),
        ))
    })
}

/// One call of `line.lua` on the line of `redis_key`, behind the key's breaker: its reply.
fn lines(
    inner: &Arc<Inner>,
    redis_key: String,
    op: &'static str,
    args: Vec<String>,
) -> BoxFuture<Vec<i64>> {
    let inner = Arc::clone(inner);
    Box::pin(async move {
        let lane = inner.lane_of(&redis_key);
        let argv = std::iter::once(op.to_owned()).chain(args).collect();
        let call = inner.batcher.line(redis_key, argv, PATIENCE);
        inner.guarded(lane, call).await
    })
}

/// Where a reservation stands, from a reply's turn (µs; -1: not in line), past and pause.
fn in_line(turn: i64, past: i64, paused: i64) -> InLine {
    let us = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    InLine {
        turn: u64::try_from(turn).ok().map(Duration::from_micros),
        past: us(past),
        paused: us(paused),
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
