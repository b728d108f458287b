//! The promises on the memory store, and the regressions the property found, shrunk.

use super::*;

/// The cases run so far, and the first that failed (before shrinking), for the report.
static CASES_RUN: AtomicUsize = AtomicUsize::new(0);
static FIRST_FAILED: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

fn check(config: &Config, ops: &[Op]) -> Result<(), TestCaseError> {
    let case = CASES_RUN.fetch_add(1, Ordering::SeqCst) + 1;
    let outcome = check_case(config, ops);
    if outcome.is_err() {
        FIRST_FAILED.get_or_init(|| case);
    }
    outcome
}

fn check_case(config: &Config, ops: &[Op]) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let refusals = unsupported(config);
    let run = match (runtime.block_on(run(config, ops)), refusals.first()) {
        (Ok(run), None) => run,
        (Err(error), Some(_))
            if refusals
                .iter()
                .any(|&(_, refusal)| Refusal::of(&error) == Some(refusal)) =>
        {
            return Ok(())
        }
        (Err(error), _) => {
            return Err(TestCaseError::fail(format!(
                "{config:?} failed to build: {error}; expected one of {refusals:?}"
            )))
        }
        (Ok(_), Some((why, _))) => {
            return Err(TestCaseError::fail(format!(
                "built what is listed unsupported: {why}"
            )))
        }
    };
    // Event times: the sliding log takes them, without a concurrency limit; the rest say so.
    let event_times = config.algorithm == Algorithm::SlidingLog && config.concurrency.is_none();
    match (&run.event_time, event_times) {
        (Ok(()), true) | (Err(StoreError::Unsupported(_)), false) => {}
        (outcome, _) => {
            return Err(TestCaseError::fail(format!(
                "check_at under {:?}: {outcome:?}",
                config.algorithm
            )))
        }
    }
    let oracles: [(&str, Result<(), String>); 6] = [
        ("never over", never_over(config, &run)),
        (
            "Retry-After never early",
            match probes_apply(config) {
                true => retry_after_true(config, &run),
                false => Ok(()),
            },
        ),
        ("nothing leaked", nothing_left(config, &run)),
        ("never the outage", never_the_outage(config, &run)),
        ("Decisions and fields agree", fields_agree(&run)),
        ("at most the cap", at_most_cap(config, &run)),
    ];
    for (promise, outcome) in oracles {
        outcome.map_err(|why| TestCaseError::fail(format!("{promise}: {why}")))?;
    }
    Ok(())
}

#[test]
fn the_promises_hold_on_the_memory_store() {
    let cases = cases_from("PROMISE_CASES", 2_000);
    let (mut runner, seed) = runner(cases, 8_000);
    if let Err(failure) = runner.run(&case(), |(config, ops)| check(&config, &ops)) {
        let first = FIRST_FAILED.get().copied().unwrap_or_default();
        panic!("seed {seed}: case {first} of {cases} failed first; shrunk: {failure}");
    }
}

fn send(key: usize, hold: u64) -> Op {
    Op::Send {
        key,
        status: 200,
        head: 0,
        hold,
        drop: false,
    }
}

/// GCRA usage spent under a raise outweighs the policy's own counts once the raise is removed:
/// the state expired a window after the last request, and the key was let in before the
/// `Retry-After` it was given.
#[test]
fn gcra_usage_spent_under_a_removed_raise_is_kept() {
    let config = plain(Algorithm::Gcra, vec![(2, 3)]);
    let ops = [
        send(0, 0),
        Op::Override(0, Some(200)),
        send(0, 0),
        send(0, 0),
        send(0, 0),
        Op::Override(0, None),
        send(0, 0),
        Op::Retry(0),
    ];
    check_case(&config, &ops).unwrap();
}

/// After an outage, the store admits a request past this instance's cap, which the layer
/// refuses: its units were left recorded, counted against the key.
#[test]
fn a_request_refused_over_the_cap_after_an_outage_leaves_no_unit() {
    let config = Config {
        concurrency: Some(1),
        ..plain(Algorithm::SlidingLog, vec![(2, 1)])
    };
    let ops = [Op::Outage(true), send(0, 1), Op::Outage(false), send(0, 0)];
    check_case(&config, &ops).unwrap();
}

/// An attempt admitted in the microsecond a reset then came in (the paused clock stands
/// still): its refund, on a 200, was taken from the state the reset started, freeing the unit
/// a second attempt held in flight, and a third, waiting for a slot, was let in beside it: 2
/// failures counted at `1/3s`.
#[test]
fn a_refund_from_before_a_reset_in_the_same_microsecond_frees_nothing() {
    let config = Config {
        count_when: true,
        concurrency: Some(2),
        max_wait: 2_000,
        ..plain(Algorithm::SlidingWindow, vec![(1, 3)])
    };
    let attempt = |status, head, hold| Op::Send {
        key: 0,
        status,
        head,
        hold,
        drop: false,
    };
    let ops = [
        attempt(200, 600, 0),
        Op::Reset(0),
        attempt(401, 1_000, 0),
        attempt(401, 0, 0),
    ];
    check_case(&config, &ops).unwrap();
}
