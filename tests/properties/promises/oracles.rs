//! The oracles: one per promise, each over a run.

use super::*;

/// The counts in force for `key` at event `seq`: the inner policy's, or an override's.
pub(super) fn counts_at(config: &Config, run: &Run, key: usize, seq: usize, pro: bool) -> Vec<u64> {
    let last = last_override(run, key, seq);
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

/// The last override of `key` before event `seq`: (event, key, percent or none).
pub(super) fn last_override(
    run: &Run,
    key: usize,
    seq: usize,
) -> Option<&(usize, usize, Option<u64>)> {
    run.overrides
        .iter()
        .rfind(|&&(at, k, _)| k == key && at < seq)
}

/// Whether the units a request of `cost` needs fit the counts in force (none is 0, and none
/// is under the cost), so that a wait can admit it.
pub(super) fn fits(
    config: &Config,
    run: &Run,
    key: usize,
    seq: usize,
    pro: bool,
    cost: u64,
) -> bool {
    counts_at(config, run, key, seq, pro)
        .iter()
        .all(|&c| c >= cost.max(1))
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
#[derive(Debug, Clone)]
pub(super) struct Unit {
    /// When the request was decided ([`Log::next`]).
    pub(super) seq: usize,
    /// When the store recorded it (since the UNIX epoch, on the store's clock).
    pub(super) at: Duration,
    /// When it was taken back, on the same clock.
    pub(super) refunded: Option<Duration>,
    /// Decided on the plan `pro`.
    pub(super) pro: bool,
    /// The units it holds from its admission.
    pub(super) cost: u64,
    /// When it was decided, on the store's clock: `at`, but for an event time.
    pub(super) decided: Duration,
    /// An event time (`Store::check_at`): `at` is the event's.
    pub(super) event: bool,
    /// Decided by an instance's fallback store (`FailureMode::Fallback`, the store out of
    /// reach): the `n`th instance's is `n + 1`; 0 for the store.
    pub(super) fallback: usize,
    /// Under a usage layer: when its body ended, the units it reported, and whether the body
    /// was dropped (then it holds at most its cost, and at least the usage, after).
    pub(super) settled: Option<(Duration, u64, bool)>,
}

impl Unit {
    /// The units it holds at `t` (the store's clock): its cost, none once refunded, its usage
    /// once charged; where the order is not known, the lesser.
    pub(super) fn weight(&self, t: Duration) -> u64 {
        if self.refunded.is_some_and(|r| r <= t) {
            return 0;
        }
        match self.settled {
            Some((end, used, dropped)) if end <= t => match dropped || end == t {
                true => used.min(self.cost),
                false => used,
            },
            _ => self.cost,
        }
    }

    /// The events it may leave in a sliding log at `now` that are live (within `longest`): its
    /// own, and the one a usage charge adds when its body ends.
    fn events_live(&self, now: Duration, longest: Duration) -> usize {
        let live = |at: Duration| at + longest > now;
        let charge = self.settled.is_some_and(|(end, _, _)| live(end));
        usize::from(live(self.at)) + usize::from(charge)
    }
}

/// Whether `u` was recorded no later than `v`: by the store's time, then (for one time, as on
/// the paused clock) in the order they were decided.
pub(super) fn no_later(u: &Unit, v: &Unit) -> bool {
    match u.event || v.event {
        // An event time is recorded in the order of the calls, whatever its time.
        true => u.seq <= v.seq,
        false => (u.at, u.seq) <= (v.at, v.seq),
    }
}

/// Which store recorded a unit at `at` (0: the store; `n`: the fallback of the instance whose
/// clock runs `n` times [`FALLBACK_AHEAD`] ahead), and its time on the store's clock.
pub(super) fn fallback_of(run: &Run, at: Duration) -> (usize, Duration) {
    let ahead = at.saturating_sub(run.epoch) + FALLBACK_AHEAD / 2;
    let n = (ahead.as_secs() / FALLBACK_AHEAD.as_secs()) as usize;
    (n, at - FALLBACK_AHEAD * n as u32)
}

/// Whether event `seq` fell in an outage.
pub(super) fn in_outage(run: &Run, seq: usize) -> bool {
    run.outages.iter().any(|&(from, to)| from < seq && seq < to)
}

/// When the store recorded `decision`, on its clock (since the UNIX epoch), if it recorded it.
pub(super) fn recorded_at(decision: &Decision) -> Option<Duration> {
    let at = tower_redis_ratelimit::test_util::recorded_at(decision)?;
    at.duration_since(UNIX_EPOCH).ok()
}

pub(super) fn inner_units(config: &Config, run: &Run, key: usize) -> Vec<Unit> {
    let recorded = run.records.iter().filter(|r| r.key == key);
    // Without decisions, a request the handler saw in an outage was the fallback's.
    let unit = |seq, at: Duration, refunded: Option<Duration>, r: &Record| {
        let fallback = usize::from(config.fallback && in_outage(run, seq));
        let settled = r.ended.filter(|_| config.usage);
        Unit {
            seq,
            at,
            refunded: refunded.map(|t| run.epoch + t),
            pro: r.pro,
            cost: r.cost.max(1),
            decided: at,
            event: false,
            fallback,
            settled: settled.map(|end| (run.epoch + end, r.usage, r.dropped)),
        }
    };
    let mut units: Vec<Unit> = recorded
        .filter_map(|r| {
            let handled = r.handled.as_ref()?;
            let counted = !config.count_when || r.answered == Some(401);
            if !config.decisions {
                // No decisions to read (and no soft layer, which needs them): every request
                // the handler sees was admitted, unless the store was out of reach (and no
                // fallback decided it).
                (config.fallback || !in_outage(run, handled.seq)).then_some(())?;
                let refunded = (!counted).then_some(r.responded).flatten();
                return Some(unit(handled.seq, run.epoch + handled.at, refunded, r));
            }
            let decision = handled.decisions.as_ref()?.get("inner")?;
            if !decision.is_allowed() {
                // Passed on over a soft limit: charged when its outcome counts.
                let charged = config.soft && config.count_when && counted;
                let seq = r.answered_seq?;
                return charged.then(|| unit(seq, run.epoch + r.responded.unwrap(), None, r));
            }
            let refunded = (!counted).then_some(r.responded).flatten();
            let at = recorded_at(decision).unwrap_or(run.epoch + handled.at);
            // The fallback stores' clocks run ahead: their decisions tell by their time.
            let (fallback, at) = fallback_of(run, at);
            Some(Unit {
                fallback,
                ..unit(handled.seq, at, refunded, r)
            })
        })
        .collect();
    // Events booked by `Store::check_at`, in the primary store.
    let booked = run.at_calls.iter().filter(|c| c.key == key);
    let booked = booked.filter(|c| c.decision.is_some_and(|d| d.is_allowed()));
    units.extend(booked.map(|c| Unit {
        seq: c.seq,
        at: c.at,
        refunded: None,
        pro: false,
        cost: c.cost,
        decided: run.epoch + c.decided,
        event: true,
        fallback: 0,
        settled: None,
    }));
    units.sort_by_key(|u| u.seq);
    units
}

/// Never over: at each admission, the units the inner policy holds in each of its windows (as
/// its algorithm counts them) are within the counts in force. The sliding log holds every
/// sliding window to its count; the fixed window and the sliding window counter every fixed
/// window; GCRA every interval `d` to `count + d · count / window`.
pub(super) fn never_over(config: &Config, run: &Run) -> Result<(), String> {
    // A soft or shadow limit refuses nothing: its promise is that it passes every request on.
    if config.lenient() {
        return Ok(());
    }
    for key in 0..KEYS.len() {
        let units = inner_units(config, run, key);
        let mut stores: Vec<usize> = units.iter().map(|u| u.fallback).collect();
        stores.sort();
        stores.dedup();
        for fallback in stores {
            let units = inner_units(config, run, key);
            let units: Vec<Unit> = units
                .into_iter()
                .filter(|u| u.fallback == fallback)
                .collect();
            never_over_in(config, run, key, &units, fallback)?;
        }
    }
    Ok(())
}

/// Never over for the units one store recorded: the primary, or the fallback, which knows no
/// reset nor override.
fn never_over_in(
    config: &Config,
    run: &Run,
    key: usize,
    units: &[Unit],
    fallback: usize,
) -> Result<(), String> {
    {
        for (j, unit) in units.iter().enumerate() {
            if may_be_evicted(config, run, unit.seq) {
                break;
            }
            // Units of a dropped usage body may be charged or not: the oracle counts the
            // lesser, and GCRA's drain of charges is not modelled.
            if config.usage && config.algorithm == Algorithm::Gcra {
                break;
            }
            let (t, decided) = (unit.at, unit.decided);
            let since = match fallback {
                0 => reset_before(run, key, unit.seq),
                _ => 0,
            };
            let done = reset_done(run, since);
            // Held when it was decided: recorded after the last reset, not taken back by then.
            let held = |u: &&Unit| {
                u.seq > since && u.decided >= done && no_later(u, unit) && u.weight(decided) > 0
            };
            let counts = match fallback > 0 {
                true => match unit.pro {
                    true => plan_counts(config).iter().map(|l| l.0).collect(),
                    false => config.limits.iter().map(|l| l.0).collect(),
                },
                false => counts_at(config, run, key, unit.seq, unit.pro),
            };
            let weigh = |u: &Unit| u.weight(decided) as f64;
            for (i, &(_, w)) in config.limits.iter().enumerate() {
                let (c, w) = (counts[i], Duration::from_secs(w));
                let n = match config.algorithm {
                    Algorithm::SlidingLog => {
                        // Every window that holds the unit: those that end at it or at a
                        // unit held after it within a window (booked ahead).
                        let ends = units.iter().filter(held).map(|u| u.at);
                        let ends = ends.filter(|&s| s >= t && s < t + w).chain([t]);
                        let in_window = |s: Duration| {
                            let within = |u: &&Unit| u.at + w > s && u.at <= s;
                            units
                                .iter()
                                .filter(held)
                                .filter(within)
                                .map(weigh)
                                .sum::<f64>()
                        };
                        ends.map(in_window).fold(0.0, f64::max)
                    }
                    Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                        let window = |d: Duration| d.as_micros() / w.as_micros();
                        let same = |u: &&Unit| window(u.at) == window(t);
                        units
                            .iter()
                            .filter(held)
                            .filter(same)
                            .map(weigh)
                            .sum::<f64>()
                    }
                    _ => gcra_excess(run, key, units, j, c, w),
                };
                if n > c as f64 + 1e-6 {
                    let store = match fallback {
                        0 => String::new(),
                        n => format!(" (fallback {n})"),
                    };
                    return Err(format!(
                        "key {key}{store}: admission {j} at {t:?} holds {n} in a window of {w:?}, count {c}"
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
        let admitted: f64 = held
            .clone()
            .filter(|u| no_later(first, u))
            .map(|u| u.cost as f64)
            .sum();
        let refunds: f64 = units
            .iter()
            .filter_map(|u| {
                let r = u.refunded.filter(|&r| r >= start && r <= t)?;
                let left = u.cost as f64 * period - r.saturating_sub(u.at).as_secs_f64();
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
        // Under a usage layer, a request in flight at the refusal is charged or refunded when
        // its body ends, after the refusal said when: the key changed since.
        let charged_since = |refusal: &Record| {
            run.records.iter().any(|o| {
                let handled = o.handled.as_ref().map(|h| h.at);
                o.key == refusal.key
                    && handled.is_some_and(|at| at <= refusal.sent)
                    && o.ended.is_none_or(|at| at >= refusal.sent)
            })
        };
        if config.usage && before.is_some_and(charged_since) {
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
    config.outer.is_none() && !config.lenient() && config.concurrency.is_none()
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
            let now = run.epoch + t;
            let live = units
                .iter()
                .filter(|u| u.fallback == 0 && u.seq > since && u.seq < seq)
                .map(|u| u.events_live(now, kept))
                .sum::<usize>();
            // A usage charge lands in the state at hand when the body ends, past a reset too.
            let reset_at = run.epoch + run.times.get(&since).copied().unwrap_or_default();
            let charged_across = units
                .iter()
                .filter(|u| u.fallback == 0 && u.seq <= since)
                .filter(|u| {
                    u.settled
                        .is_some_and(|(end, _, _)| end >= reset_at && end + kept > now)
                })
                .count();
            let live = live + charged_across;
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
    let Some(cap) = config.concurrency.filter(|_| !config.lenient()) else {
        return Ok(());
    };
    // Failing over, the fallback's slots do not count the primary's still in flight: the cap
    // holds per store (a finding: `fallback_counts_the_slots_in_flight`).
    let cap = match config.fallback && !strict_fallback_cap() {
        true => 2 * cap,
        false => cap,
    };
    for (key, &most) in run.most.iter().enumerate() {
        if most > cap as usize {
            return Err(format!("key {key}: {most} in flight at cap {cap}"));
        }
    }
    Ok(())
}

thread_local! {
    /// Whether the cap under `FailureMode::Fallback` is held to one cap per instance, the
    /// primary's slots in flight and the fallback's together (the finding's regression case).
    pub(super) static STRICT_FALLBACK_CAP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn strict_fallback_cap() -> bool {
    STRICT_FALLBACK_CAP.with(|s| s.get())
}
