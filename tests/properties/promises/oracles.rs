//! The oracles: one per promise, each over a run.

use super::*;

/// The counts in force for `key` at event `seq`: the inner policy's, or an override's.
pub(super) fn counts_at(config: &Config, run: &Run, key: usize, seq: usize, pro: bool) -> Vec<u64> {
    let last = run
        .overrides
        .iter()
        .rfind(|&&(at, k, _)| k == key && at < seq);
    // A key's override wins over its plan's counts.
    let own = match pro {
        true => plan_counts(config),
        false => config.limits.clone(),
    };
    config
        .limits
        .iter()
        .zip(own)
        .map(|(&(c, _), (own, _))| match last {
            Some(&(_, _, Some(pct))) => (c * pct / 100).max(if pct == 0 { 0 } else { 1 }),
            _ => own,
        })
        .collect()
}

/// The last reset of `key` before event `seq` (0: none; events after it count).
pub(super) fn reset_before(run: &Run, key: usize, seq: usize) -> usize {
    reset_only(run, key, seq)
}

/// Whether the memory store may have evicted a key before event `seq`: it holds at most
/// `max_keys`, and once a flood of other keys has filled it, any new key may evict one of
/// ours that is not pinned (by its penalty box or its slots), which then starts afresh.
pub(super) fn may_be_evicted(config: &Config, run: &Run, seq: usize) -> bool {
    config.max_keys.is_some() && run.floods.iter().any(|&at| at < seq)
}

/// When the reset of event `since` had been done by, where known (on Redis); else zero.
pub(super) fn reset_done(run: &Run, since: usize) -> Duration {
    let done = run.reset_done.iter().find(|&&(at, _)| at == since);
    done.map_or(Duration::ZERO, |&(_, t)| t)
}

/// The last reset of `key` before event `seq` (0: none).
pub(super) fn reset_only(run: &Run, key: usize, seq: usize) -> usize {
    let resets = run.resets.iter().filter(|&&(at, k)| k == key && at < seq);
    resets.map(|&(at, _)| at).max().unwrap_or_default()
}

/// A unit the inner policy recorded: when, and when it was taken back (outcome counting, an
/// attempt whose outcome does not count: when its response's head is in).
pub(super) struct Unit {
    /// When the request was decided ([`Log::next`]).
    pub(super) seq: usize,
    /// When the store recorded it (since the UNIX epoch, on the store's clock).
    pub(super) at: Duration,
    /// When it was taken back, on the same clock.
    pub(super) refunded: Option<Duration>,
    /// Decided on the plan `pro`.
    pub(super) pro: bool,
}

/// Whether `u` was recorded no later than `v`: by the store's time, then (for one time, as on
/// the paused clock) in the order they were decided.
pub(super) fn no_later(u: &Unit, v: &Unit) -> bool {
    (u.at, u.seq) <= (v.at, v.seq)
}

/// When the store recorded `decision`, on its clock (since the UNIX epoch), if it recorded it.
pub(super) fn recorded_at(decision: &Decision) -> Option<Duration> {
    let at = tower_redis_ratelimit::test_util::recorded_at(decision)?;
    at.duration_since(UNIX_EPOCH).ok()
}

pub(super) fn inner_units(config: &Config, run: &Run, key: usize) -> Vec<Unit> {
    let recorded = run.records.iter().filter(|r| r.key == key);
    recorded
        .filter_map(|r| {
            let handled = r.handled.as_ref()?;
            let counted = !config.count_when || r.answered == Some(401);
            if !config.decisions {
                // No decisions to read (and no soft layer, which needs them): every request
                // the handler sees was admitted, unless the store was out of reach.
                let down = |&&(from, to): &&(usize, usize)| from < handled.seq && handled.seq < to;
                run.outages.iter().find(down).is_none().then_some(())?;
                let refunded = (!counted).then_some(r.responded).flatten();
                return Some(Unit {
                    seq: handled.seq,
                    at: run.epoch + handled.at,
                    refunded: refunded.map(|t| run.epoch + t),
                    pro: r.pro,
                });
            }
            let decision = handled.decisions.as_ref()?.get("inner")?;
            if !decision.is_allowed() {
                // Passed on over a soft limit: charged when its outcome counts.
                let charged = config.soft && config.count_when && counted;
                return charged.then_some(Unit {
                    seq: r.answered_seq?,
                    at: run.epoch + r.responded?,
                    refunded: None,
                    pro: r.pro,
                });
            }
            let refunded = (!counted).then_some(r.responded).flatten();
            Some(Unit {
                seq: handled.seq,
                at: recorded_at(decision).unwrap_or(run.epoch + handled.at),
                refunded: refunded.map(|t| run.epoch + t),
                pro: r.pro,
            })
        })
        .collect()
}

/// Never over: at each admission, the units the inner policy holds in each of its windows (as
/// its algorithm counts them) are within the counts in force. The sliding log holds every
/// sliding window to its count; the fixed window and the sliding window counter every fixed
/// window; GCRA every interval `d` to `count + d · count / window`.
pub(super) fn never_over(config: &Config, run: &Run) -> Result<(), String> {
    // A soft limit refuses nothing: its promise is that it passes every request on.
    if config.soft {
        return Ok(());
    }
    for key in 0..KEYS.len() {
        let units = inner_units(config, run, key);
        for (j, unit) in units.iter().enumerate() {
            if may_be_evicted(config, run, unit.seq) {
                break;
            }
            let t = unit.at;
            let since = reset_before(run, key, unit.seq);
            let done = reset_done(run, since);
            // Held at t: recorded after the last reset, not taken back before t.
            let held = |u: &&Unit| {
                u.seq > since
                    && u.at >= done
                    && no_later(u, unit)
                    && u.refunded.is_none_or(|r| r > t)
            };
            let counts = counts_at(config, run, key, unit.seq, unit.pro);
            for (i, &(_, w)) in config.limits.iter().enumerate() {
                let (c, w) = (counts[i], Duration::from_secs(w));
                let n = match config.algorithm {
                    Algorithm::SlidingLog => {
                        let within = |u: &&Unit| u.at + w > t;
                        units.iter().filter(held).filter(within).count() as f64
                    }
                    Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                        let window = |d: Duration| d.as_micros() / w.as_micros();
                        let same = |u: &&Unit| window(u.at) == window(t);
                        units.iter().filter(held).filter(same).count() as f64
                    }
                    _ => gcra_excess(run, key, &units, j, c, w),
                };
                if n > c as f64 + 1e-6 {
                    return Err(format!(
                        "key {key}: admission {j} at {t:?} holds {n} in a window of {w:?}, count {c}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// GCRA: the most, over the intervals that end at admission `j`, of the units admitted in the
/// interval less the room the interval's drain and any refund in it made: at most the count.
/// Intervals start after the last reset and the last override of the key (a change of counts
/// changes the drain).
pub(super) fn gcra_excess(
    run: &Run,
    key: usize,
    units: &[Unit],
    j: usize,
    c: u64,
    w: Duration,
) -> f64 {
    if c == 0 {
        return units.get(j).map_or(0.0, |_| 1.0);
    }
    let (t, seq) = (units[j].at, units[j].seq);
    // A change of counts in force (an override, a move to a plan or back) changes the drain.
    let overridden = run.overrides.iter().map(|&(at, k, _)| (at, k));
    let changed = overridden
        .chain(run.plans.iter().copied())
        .filter(|&(at, k)| k == key && at < seq)
        .map(|(at, _)| at)
        .max()
        .unwrap_or_default();
    let done = reset_done(run, reset_before(run, key, seq));
    let since = reset_before(run, key, seq).max(changed);
    let period = w.as_secs_f64() / c as f64;
    let mut most: f64 = 0.0;
    let last = &units[j];
    let held = units
        .iter()
        .filter(|u| u.seq > since && u.at >= done && no_later(u, last));
    for first in held.clone() {
        let start = first.at;
        let admitted = held.clone().filter(|u| no_later(first, u)).count() as f64;
        let refunds: f64 = units
            .iter()
            .filter_map(|u| {
                let r = u.refunded.filter(|&r| r >= start && r <= t)?;
                let left = period - r.saturating_sub(u.at).as_secs_f64();
                Some((left / period).max(0.0))
            })
            .sum();
        let drained = t.saturating_sub(start).as_secs_f64() / period;
        most = most.max(admitted - refunds - drained);
    }
    most
}

/// `Retry-After` never early: a lone client that retries at a refusal's `Retry-After` is
/// admitted, and one that retries a second before is not.
pub(super) fn retry_after_true(config: &Config, run: &Run) -> Result<(), String> {
    for (i, r) in run.records.iter().enumerate() {
        let Some(admitted) = r.probe else { continue };
        let got = r.status == Some(StatusCode::OK) || r.handled.is_some();
        let inner = r
            .handled
            .as_ref()
            .and_then(|h| h.decisions.as_ref()?.get("inner").copied());
        let passed = match inner {
            Some(d) => d.is_allowed(),
            None => got,
        };
        // The refusal it follows, for the message.
        let before = run.records[..i]
            .iter()
            .rev()
            .find(|b| b.key == r.key && b.probe.is_none());
        // Counted by outcome, a refusal while attempts were in flight may be busy: its
        // `Retry-After` is an estimate of when they end (promise 3's exception); those that
        // succeed give their units back, and the key may be let in earlier.
        let in_flight_then = |refusal: &Record| {
            run.records.iter().any(|o| {
                let handled = o.handled.as_ref().map(|h| h.at);
                o.key == refusal.key
                    && handled.is_some_and(|at| at <= refusal.sent)
                    && o.responded.is_none_or(|at| at > refusal.sent)
            })
        };
        if config.count_when && before.is_some_and(in_flight_then) {
            continue;
        }
        if passed != admitted {
            return Err(format!(
                "retry probe {i} of key {} at {:?} expected admitted={admitted}, got {:?} (the refusal: {:?})",
                r.key, r.sent, r.status, before.map(|b| (b.sent, b.retry_after, &b.fields))
            ));
        }
    }
    Ok(())
}

/// Whether the schedule makes a retry probe meaningless: between the refusal and the probe,
/// another request of the key, a reset, an override, an outage, a flood or eviction may have
/// changed what the key holds; a refusal for a slot says when one usually frees, no promise;
/// and the outer layer may refuse at the inner's `Retry-After`.
pub(super) fn probes_apply(config: &Config) -> bool {
    config.outer.is_none() && !config.soft && config.concurrency.is_none()
}

/// Nothing leaked and memory follows what is held: once every request has ended, no slot is
/// held; once the state has aged out, the store holds no key; and the sliding log never holds
/// more events than the units the oracle accounts for in twice its longest window.
pub(super) fn nothing_left(config: &Config, run: &Run) -> Result<(), String> {
    if run.slots_left != 0 {
        return Err(format!(
            "{} slots held after every request ended",
            run.slots_left
        ));
    }
    if run.keys_left != 0 {
        return Err(format!(
            "{} keys held after the state aged out",
            run.keys_left
        ));
    }
    if config.algorithm == Algorithm::SlidingLog {
        let kept = 2 * Duration::from_secs(config.limits.iter().map(|l| l.1).max().unwrap());
        for &(t, seq, key, held) in &run.log_sizes {
            let since = reset_only(run, key, seq);
            let units = inner_units(config, run, key);
            let live = units
                .iter()
                .filter(|u| u.seq > since && u.seq < seq && u.at + kept > run.epoch + t)
                .count();
            // Refunded units weigh nothing but may stay until they age out.
            if held > live {
                return Err(format!(
                    "key {key} at {t:?}: the log holds {held} events, {live} live"
                ));
            }
        }
    }
    Ok(())
}

/// The limiter is never the outage: failing open, no request gets a 5xx the handler did not
/// answer, and every request the handler sees carries a `Decisions` entry per layer.
pub(super) fn never_the_outage(config: &Config, run: &Run) -> Result<(), String> {
    for (i, r) in run.records.iter().enumerate() {
        let status = r.status.ok_or(format!("request {i} never answered"))?;
        let own = r.answered.map(|s| s == status.as_u16()).unwrap_or(false);
        if matches!(config.failure, FailureMode::Open) && status.is_server_error() && !own {
            return Err(format!(
                "request {i}: {status} from the limiter, failing open"
            ));
        }
        if let Some(handled) = r.handled.as_ref().filter(|_| config.decisions) {
            let decisions = handled
                .decisions
                .as_ref()
                .ok_or(format!("request {i}: no Decisions"))?;
            let has = |name: &str| {
                decisions.get(name).is_some() || decisions.undecided().any(|(p, _)| p == name)
            };
            if !has("inner") || (config.outer.is_some() && !has("outer")) {
                return Err(format!(
                    "request {i}: Decisions lacks a layer: {decisions:?}"
                ));
            }
        }
    }
    Ok(())
}

/// The handler's `Decisions` and the response's `RateLimit` field describe the same decision.
pub(super) fn fields_agree(run: &Run) -> Result<(), String> {
    for (i, r) in run.records.iter().enumerate() {
        let Some(decisions) = r.handled.as_ref().and_then(|h| h.decisions.as_ref()) else {
            continue;
        };
        for (name, decision) in decisions.iter() {
            let field = r
                .fields
                .iter()
                .find(|(n, _)| n == name || n.starts_with(&format!("{name}-")));
            let Some((_, remaining)) = field else {
                return Err(format!(
                    "request {i}: no RateLimit member for {name}: {:?}",
                    r.fields
                ));
            };
            if decision.is_concurrency_limit() {
                continue;
            }
            if *remaining != decision.remaining() as i64 {
                return Err(format!(
                    "request {i}: {name} remaining {} in Decisions, {remaining} in the field",
                    decision.remaining()
                ));
            }
        }
    }
    Ok(())
}

/// At most the concurrency limit in flight per key (on this one instance, failing open too).
pub(super) fn at_most_cap(config: &Config, run: &Run) -> Result<(), String> {
    let Some(cap) = config.concurrency.filter(|_| !config.soft) else {
        return Ok(());
    };
    for (key, &most) in run.most.iter().enumerate() {
        if most > cap as usize {
            return Err(format!("key {key}: {most} in flight at cap {cap}"));
        }
    }
    Ok(())
}
