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
    let event_times = event_times_taken(config);
    match (&run.event_time, event_times) {
        (Ok(()), true) | (Err(StoreError::Unsupported(_)), false) => {}
        (outcome, _) => {
            return Err(TestCaseError::fail(format!(
                "check_at under {:?}: {outcome:?}",
                config.algorithm
            )))
        }
    }
    let d = dims();
    let oracles: [(&str, Result<(), String>); 9] = [
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
        (
            "never refused for nothing",
            match d.over_refusal {
                true => lone_admitted(config, &run),
                false => Ok(()),
            },
        ),
        (
            "no box without a failure",
            match d.no_box_without_failure {
                true => no_box_without_failure(config, &run),
                false => Ok(()),
            },
        ),
        (
            "Retry-After where a wait helps",
            match d.event_retry {
                true => retry_after_where_a_wait_helps(config, &run),
                false => Ok(()),
            },
        ),
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
        cost: 1,
        usage: 0,
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
        cost: 1,
        usage: 0,
    };
    let ops = [
        attempt(200, 600, 0),
        Op::Reset(0),
        attempt(401, 1_000, 0),
        attempt(401, 0, 0),
    ];
    check_case(&config, &ops).unwrap();
}

/// Two stacked layers over one store, each with the same unnamed policy `1/10s`: a lone
/// request, nothing held, is refused, the two layers taking their units from one budget (the
/// default store of each builder keeps two). Equal unnamed policies on two layers behave alike
/// on one store and on two: separate budgets (the request is admitted), or refused at build.
#[test]
fn equal_unnamed_policies_on_two_layers_of_one_store_admit_a_lone_request() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = MemoryStore::new();
        let layer = || {
            RateLimitLayer::builder()
                .key(Header::new(HeaderName::from_static("x-key")))
                .store(store.clone())
                .policy("1/10s")
                .build()
        };
        let (Ok(inner), Ok(outer)) = (layer(), layer()) else {
            return; // refused at build: one of the two choices
        };
        let ok = service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(http_body_util::Empty::<Bytes>::new()))
        });
        let service = outer.layer(inner.layer(ok));
        let request = Request::builder().header("x-key", "a").body(()).unwrap();
        let response = service.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "a lone request refused");
    });
}

/// Failing over to the fallback with a request in flight that holds a slot of the primary: the
/// fallback admits a second one at cap 1 (2 in flight on one instance). `FailureMode::Open`
/// holds the cap per instance; `Fallback` holds it per store, and the property allows that
/// (twice the cap) but here.
#[test]
#[ignore = "finding: the cap under Fallback does not count the primary's slots in flight"]
fn fallback_counts_the_slots_in_flight() {
    STRICT_FALLBACK_CAP.with(|s| s.set(true));
    let config = Config {
        concurrency: Some(1),
        fallback: true,
        decisions: false,
        ..plain(Algorithm::SlidingLog, vec![(1, 1)])
    };
    let ops = [send(0, 1), Op::Outage(true), send(0, 0)];
    check_case(&config, &ops).unwrap();
}

// Regressions of the field's dimensions, found on the default seed (`PROMISE_DIMENSIONS`
// names the dimension that finds each), each failing until the fix it names is in.

/// Two right passwords at once at `1/1s` with a 2 s box: the second is refused for the first
/// in flight, and the refusal boxes a user with no failure counted (`no_box_without_failure`).
#[test]
fn right_passwords_at_once_box_no_one() {
    let config = Config {
        block: Some(2),
        count_when: true,
        decisions: false,
        ..plain(Algorithm::SlidingLog, vec![(1, 1)])
    };
    let login = |head| Op::Send {
        key: 0,
        status: 200,
        head,
        hold: 0,
        drop: false,
        cost: 1,
        usage: 0,
    };
    check_case(&config, &[login(1), login(0)]).unwrap();
}

/// An event booked a millisecond ahead at `1/1s`, then a request now: refused without a
/// `Retry-After`, though a wait of a second helps (`event_retry`).
#[test]
fn a_request_after_a_booking_ahead_has_a_retry_after() {
    let config = Config {
        decisions: false,
        ..plain(Algorithm::SlidingLog, vec![(1, 1)])
    };
    let ops = [
        Op::At {
            key: 1,
            offset: Offset::Ms(1),
            cost: 1,
        },
        Op::Send {
            key: 1,
            status: 200,
            head: 0,
            hold: 0,
            drop: false,
            cost: 1,
            usage: 0,
        },
    ];
    check_case(&config, &ops).unwrap();
}

/// `3/3s + 3/10s` filled at 0 (two requests and an event), then, 10 s later, an event 10 ms in
/// the past: admitted, 4 in the window `(-10 ms, 9.99 s]`; the past time read a log trimmed
/// to now's window (`event_times`).
#[test]
fn a_past_event_is_decided_against_the_log_as_it_was() {
    let config = Config {
        decisions: false,
        ..plain(Algorithm::SlidingLog, vec![(3, 3), (3, 10)])
    };
    let at = |offset| Op::At {
        key: 0,
        offset: Offset::Ms(offset),
        cost: 1,
    };
    let ops = [send(0, 0), at(0), send(0, 0), Op::Pass(10_000), at(-10)];
    check_case(&config, &ops).unwrap();
}

/// `1/3s` spent and refused with `Retry-After: 3`; the store fails over to the fallback, and a
/// retry a second early is let in: the fallback forgot the key it saw spent (`fallback`).
#[test]
fn the_fallback_keeps_a_key_it_saw_spent() {
    let config = Config {
        fallback: true,
        decisions: false,
        ..plain(Algorithm::SlidingLog, vec![(1, 3)])
    };
    let ops = [send(0, 0), send(0, 0), Op::Outage(true), Op::Retry(0)];
    check_case(&config, &ops).unwrap();
}
