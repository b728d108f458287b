//! The oracles of refusals: a request the promises say must be admitted is admitted, a key
//! with no counted outcome is never boxed, and a refusal where a wait helps says when.

use super::*;

/// Never refused for nothing: a request the promises say must be admitted is admitted, and not
/// marked over by a soft or shadow layer: a lone request (none of its key in flight, nothing of
/// its key held in any window: no request, charge or booked event within the time its state
/// takes to age out, since its last reset), whose cost fits the counts in force, with no
/// override that cuts them, while the store is reachable.
pub(super) fn lone_admitted(config: &Config, run: &Run) -> Result<(), String> {
    for (i, r) in run.records.iter().enumerate() {
        if !lone(config, run, r) {
            continue;
        }
        let handled = r.handled.as_ref();
        let decisions = handled.and_then(|h| h.decisions.as_ref());
        let over = |name: &str| {
            decisions
                .and_then(|d| d.get(name))
                .is_some_and(|d| !d.is_allowed())
        };
        if handled.is_none() || over("inner") || over("outer") {
            return Err(format!(
                "request {i} of key {} at {:?} (cost {}) with nothing held: {:?}, Retry-After {:?}, decisions {:?}",
                r.key, r.sent, r.cost, r.status, r.retry_after, decisions
            ));
        }
    }
    Ok(())
}

/// Whether `r` is a lone request that fits: see [`lone_admitted`].
fn lone(config: &Config, run: &Run, r: &Record) -> bool {
    let key = r.key;
    if in_outage(run, r.seq) || !fits(config, run, key, r.seq, r.pro, r.cost) {
        return false;
    }
    // On Redis: not while a fault may still be felt (reconnections, resends).
    if near_a_fault(run, r.sent) {
        return false;
    }
    if last_override(run, key, r.seq).is_some_and(|o| o.2.is_some_and(|p| p < 100)) {
        return false;
    }
    // A drop's give-back is not waited for; a flood may have evicted the key: either frees.
    let reset = reset_before(run, key, r.seq);
    let reset_at = run.times.get(&reset).copied().unwrap_or_default();
    let quiet = run.quiet;
    // Others sent before it was decided, in whatever order they were (a group sent at once
    // races).
    let decided = r
        .handled
        .as_ref()
        .map(|h| h.at)
        .or(r.responded)
        .unwrap_or(r.sent);
    let others = run.records.iter();
    let others = others.filter(|o| o.key == key && o.seq != r.seq && o.sent <= decided);
    let busy = others.into_iter().any(|o| {
        let last = o.ended.unwrap_or(Duration::MAX).max(o.sent);
        let in_flight = o.handled.is_some() || o.responded.is_none_or(|t| t >= r.sent);
        let in_flight = in_flight && o.ended.is_none_or(|e| e >= r.sent);
        let after_reset = o.seq > reset || o.ended.is_none_or(|e| e >= reset_at);
        in_flight || (after_reset && last.saturating_add(quiet) > r.sent)
    });
    let now = run.epoch + r.sent;
    let booked = run.at_calls.iter().any(|c| {
        let admitted = c.decision.is_some_and(|d| d.is_allowed());
        c.key == key && c.seq < r.seq && c.seq > reset && admitted && c.at + quiet > now
    });
    !busy && !booked
}

/// Under outcome counting, a key with no counted outcome (no response that counts, no event
/// booked) is never refused by the penalty box, nor marked over by a soft policy: a refusal
/// caused by attempts in flight is not a failure.
pub(super) fn no_box_without_failure(config: &Config, run: &Run) -> Result<(), String> {
    if !config.count_when {
        return Ok(());
    }
    for (i, r) in run.records.iter().enumerate() {
        let marked_over = r
            .handled
            .as_ref()
            .filter(|_| config.soft)
            .and_then(|h| h.decisions.as_ref()?.get("inner").copied())
            // A request larger than a limit itself (no wait helps) is over whatever was counted.
            .is_some_and(|d| {
                let waits = d.retry_after().is_some();
                !d.is_allowed() && !d.is_concurrency_limit() && !d.is_busy() && waits
            });
        let seq = r.handled.as_ref().map_or(r.seq, |h| h.seq);
        if !(r.boxed || marked_over) || counted_before(config, run, r.key, seq) {
            continue;
        }
        // A block set by an override refuses with no failure counted.
        if last_override(run, r.key, seq).is_some_and(|o| o.2 == Some(0)) {
            continue;
        }
        let what = if r.boxed { "boxed" } else { "marked over" };
        let decision = r
            .handled
            .as_ref()
            .and_then(|h| h.decisions.as_ref()?.get("inner"));
        return Err(format!(
            "request {i} of key {} at {:?} {what} with no counted outcome: Retry-After {:?}, {:?}",
            r.key, r.sent, r.retry_after, decision
        ));
    }
    Ok(())
}

/// Whether `key` had an outcome that counts (a 401 answered, an event booked) since its last
/// reset, before event `seq`.
fn counted_before(config: &Config, run: &Run, key: usize, seq: usize) -> bool {
    // A reset is the layer's store's: the fallback store keeps what it counted.
    let reset = match config.fallback {
        true => 0,
        false => reset_before(run, key, seq),
    };
    let answered = run.records.iter().any(|o| {
        let when = o.answered_seq.unwrap_or(usize::MAX);
        o.key == key && o.answered == Some(401) && when < seq && (o.seq > reset || when > reset)
    });
    let booked = run.at_calls.iter().any(|c| {
        let admitted = c.decision.is_some_and(|d| d.is_allowed());
        c.key == key && admitted && c.seq > reset && c.seq < seq
    });
    // On Redis, a decision that timed out in a fault may run late, and keep an attempt's unit
    // as a failure (`docs/operations.md`): a request sent near a fault may count.
    let near_fault = |o: &Record| o.key == key && o.seq < seq && near_a_fault(run, o.sent);
    answered || booked || run.records.iter().any(near_fault)
}

/// Whether a request sent at `sent` may still feel a fault injected on Redis: sent from a
/// second before one began to two seconds after it ended.
fn near_a_fault(run: &Run, sent: Duration) -> bool {
    run.faults.iter().any(|&(from, to)| {
        sent + Duration::from_secs(1) >= from && sent <= to + Duration::from_secs(2)
    })
}

/// `Retry-After` where a wait helps: a refusal by the limits or the box, of a request whose
/// cost fits the counts in force, carries one; a refused event time (`Store::check_at`) whose
/// cost fits has a `retry_after`, the event moved by it is admitted, and a second earlier it
/// is not (nothing else changes in between).
pub(super) fn retry_after_where_a_wait_helps(config: &Config, run: &Run) -> Result<(), String> {
    for (i, r) in run.records.iter().enumerate() {
        let refused = r.inner_refusal == Some(false);
        // A request is decided a moment after it is sent (later still when it waits for a
        // slot): an override set before its answer (a block) may be the one in force.
        let overridden_later = run.overrides.iter().any(|&(at, k, _)| {
            let set = run.times.get(&at).copied();
            k == r.key && at > r.seq && r.responded.is_none_or(|end| set.is_none_or(|s| s <= end))
        });
        // Near a Redis fault (a restart loses overrides and state; which state decided is
        // a race), the counts in force are not known.
        let fit = !overridden_later
            && !near_a_fault(run, r.sent)
            && fits(config, run, r.key, r.seq, r.pro, r.cost);
        if refused && r.retry_after.is_none() && fit {
            return Err(format!(
                "request {i} of key {} at {:?} (cost {}) refused without Retry-After: {:?}",
                r.key, r.sent, r.cost, r.fields
            ));
        }
    }
    for (i, c) in run.at_calls.iter().enumerate() {
        let describe = || {
            let since = run.epoch + c.decided;
            let offset = c.at.as_secs_f64() - since.as_secs_f64();
            format!(
                "check_at {i} of key {} at now {offset:+.3} s (cost {})",
                c.key, c.cost
            )
        };
        let allowed = c.decision.map(|d| d.is_allowed());
        match (c.probe, allowed) {
            (Some(true), Some(true)) | (Some(false), Some(false)) => {}
            (Some(true), _) => {
                return Err(format!(
                    "{}: the event moved by its retry_after is refused: {:?}",
                    describe(),
                    c.decision
                ))
            }
            (Some(false), _) => {
                return Err(format!(
                    "{}: admitted a second before its retry_after",
                    describe()
                ))
            }
            (None, None) if c.at >= run.epoch + c.decided => {
                return Err(format!("{}: an error", describe()))
            }
            (None, Some(false)) => {
                let d = c.decision.unwrap();
                let fit = fits(config, run, c.key, c.seq, false, c.cost);
                if fit && !d.in_penalty_box() && d.retry_after().is_none() {
                    return Err(format!(
                        "{}: refused with no retry_after: {d:?}",
                        describe()
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}
