//! Reservations on Redis: the algorithm's script in its `RESERVE` mode (`prelude.lua`), one
//! call that finds the request's turn after every reservation before and records it, so that
//! turns follow reservation order across every instance sharing the Redis; and the key's line
//! of reservations (`scripts/line.lua`), which those waiting look up, leave and pause.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::transport::call::LATE_PATIENCE;
use super::{lease, wire, BoxFuture, Inner, RedisStore};
use crate::model::line::gives_back;
use crate::store::redis::placement::Place;
use crate::store::redis::wire::{Answer, Record};
use crate::store::reserve::{self, named, reservable, InLine, Reserve, Ticket};
use crate::store::Store;
use crate::{Key, Policy, StoreError};

/// How long a call of `line.lua`, and a leave's give-back, wait for their reply: a leave's
/// give-back is worth sending however late Redis runs it, as a settlement's is.
const PATIENCE: Duration = Duration::from_secs(3);

/// How long a reservation waits for its reply: its `max_wait` (it would wait that long for its
/// turn anyway), at least the store's time budget and at most [`LATE_PATIENCE`], the longest
/// the store reads any reply (which bounds a time budget set longer, too).
fn budget(inner: &Inner, ticket: &Ticket) -> Duration {
    ticket.max_wait.max(inner.timeout).min(LATE_PATIENCE)
}

impl Reserve for RedisStore {
    type LineFuture = BoxFuture<InLine>;
    type LinesFuture = BoxFuture<Vec<InLine>>;

    /// Decided in Redis, never from a lease; on a leasing store against the same headroom as
    /// its decisions (the sliding log's longer window), so that leased units spent late and
    /// reservations never share a window past its count.
    ///
    /// In a call of its own, outside the batches of decisions, waiting for its reply up to its
    /// own budget (its `max_wait`, within the store's time budget and 10 s), not
    /// the decisions' time budget: a reservation under load queues in Redis rather than
    /// failing. It shares the key's breaker with decisions: while Redis is found unreachable
    /// it fails at once ([`StoreError::Unavailable`]); a reply it waited for long closes the
    /// breaker, and only an outage (no connection, or no reply within its whole budget) trips
    /// it.
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
        let budget = budget(&inner, &ticket);
        Box::pin(async move {
            let answer = patiently(&inner, place, &policy, (cost, record), budget).await?;
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
        if let Err(error) = named(&ticket) {
            return Box::pin(std::future::ready(Err(error)));
        }
        let args = vec![member(ticket), micros(ticket.late).to_string()];
        let op = line(&self.inner, self.redis_key(key, policy), "look", args);
        Box::pin(async move { Ok(op.await?.0) })
    }

    fn look_many(&self, key: &Key, policy: &Policy, tickets: Vec<Ticket>) -> Self::LinesFuture {
        if let Err(error) = tickets.iter().try_for_each(named) {
            return Box::pin(std::future::ready(Err(error)));
        }
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
        if let Err(error) = named(&ticket) {
            return Box::pin(std::future::ready(Err(error)));
        }
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
                patiently(&inner, place, &policy, (cost, refund), PATIENCE).await?;
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
    format!("{}:{}", ticket.id, ticket.cost)
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

/// One call of `line.lua` on the line of `redis_key`, behind the key's breaker, waiting for
/// its reply up to [`PATIENCE`]: its reply.
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
        within(&inner, lane, PATIENCE, call).await
    })
}

/// Runs the policy's script for one request at `place` (`cost` units, `record`) in a call of
/// its own, behind the key's breaker, waiting for its reply up to `budget`; a call Redis
/// refused without running it (busy, loading, a hash slot on the move) is sent again within
/// the budget.
async fn patiently(
    inner: &Inner,
    place: Place,
    policy: &Policy,
    (cost, record): (u64, Record),
    budget: Duration,
) -> Result<Answer, StoreError> {
    crate::store::in_range(policy)?;
    let known = inner.batcher.known();
    let args = wire::encode_for(policy, &place, (cost, 0), record, -1, known);
    let algorithm = policy.algorithm();
    let call = async {
        loop {
            let reply = inner
                .batcher
                .decide_patiently(place.clone(), algorithm, args.clone(), budget)
                .await;
            match reply {
                Err(error) if lease::refused(&error) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                reply => return reply,
            }
        }
    };
    within(inner, place.lane, budget, call).await
}

/// Runs `call` behind lane `lane`'s breaker, waiting up to `budget`: fails at once while the
/// breaker is open (Redis found unreachable); a reply, however late within the budget, closes
/// it; an outage, or no reply within the whole budget, trips it.
async fn within<T>(
    inner: &Inner,
    lane: usize,
    budget: Duration,
    call: impl Future<Output = Result<T, fred::error::Error>>,
) -> Result<T, StoreError> {
    let breaker = inner.breaker(lane);
    if breaker.is_open() {
        return Err(StoreError::Unavailable);
    }
    let started = breaker.now();
    match tokio::time::timeout(budget, call).await {
        Ok(reply) => inner.judge(lane, started, Some(reply)),
        Err(_) => {
            breaker.trip(started);
            Err(StoreError::Timeout(budget))
        }
    }
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
