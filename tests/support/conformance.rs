//! One table of scenarios for every algorithm, run unchanged against every store.
//!
//! Times are milliseconds from a start that lies on a boundary of every window of the
//! scenario (fixed and sliding windows are aligned to the UNIX epoch). The memory store runs
//! on a virtual clock that starts at the epoch; the Redis store waits for the next boundary of
//! real time, and its figures are compared with a margin.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::{sleep_until, Instant};
use tower_redis_ratelimit::test_util::limit_index;
use tower_redis_ratelimit::{Algorithm, Key, Policy, Store};

/// One request of a scenario and what it must get.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub at_ms: u64,
    pub cost: u32,
    pub allowed: bool,
    /// When denied: which limit denies and the retry (`None`: no wait helps).
    pub denied_by: usize,
    pub retry_ms: Option<u64>,
    /// Units left after the request, where the scenario states it.
    pub remaining: Option<u64>,
}

const fn ok(at_ms: u64, cost: u32, remaining: Option<u64>) -> Step {
    Step {
        at_ms,
        cost,
        allowed: true,
        denied_by: 0,
        retry_ms: None,
        remaining,
    }
}

const fn no(at_ms: u64, cost: u32, denied_by: usize, retry_ms: Option<u64>) -> Step {
    Step {
        at_ms,
        cost,
        allowed: false,
        denied_by,
        retry_ms,
        remaining: None,
    }
}

pub struct Scenario {
    pub name: &'static str,
    pub algorithm: Algorithm,
    pub policy: &'static str,
    pub steps: &'static [Step],
}

pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "log",
        algorithm: Algorithm::SlidingLog,
        policy: "2/1s + 3/2s",
        steps: &[
            ok(100, 1, Some(1)),
            ok(200, 1, Some(0)),
            no(300, 1, 0, Some(800)),
            ok(1150, 1, Some(0)),
            no(1250, 1, 1, Some(850)),
            no(1250, 4, 0, None),
            ok(2150, 1, Some(0)),
        ],
    },
    Scenario {
        name: "fixed",
        algorithm: Algorithm::FixedWindow,
        policy: "2/500ms + 3/2s",
        steps: &[
            ok(100, 1, Some(1)),
            ok(200, 1, Some(0)),
            no(300, 1, 0, Some(200)),
            ok(600, 1, Some(0)),
            no(700, 1, 1, Some(1300)),
            no(2100, 4, 0, None),
            ok(2100, 2, Some(0)),
            no(2200, 1, 0, Some(300)),
        ],
    },
    Scenario {
        name: "sliding",
        algorithm: Algorithm::SlidingWindow,
        policy: "4/1s",
        steps: &[
            ok(100, 4, Some(0)),
            no(100, 1, 0, Some(1150)),
            ok(1250, 1, Some(0)),
            no(1300, 1, 0, Some(200)),
            ok(1500, 1, Some(0)),
            no(1600, 1, 0, Some(150)),
            no(1600, 5, 0, None),
        ],
    },
    Scenario {
        name: "gcra",
        algorithm: Algorithm::Gcra,
        policy: "4/1s",
        steps: &[
            ok(100, 4, Some(0)),
            no(100, 1, 0, Some(250)),
            ok(400, 1, Some(0)),
            no(400, 1, 0, Some(200)),
            no(400, 5, 0, None),
            ok(1500, 2, Some(2)),
        ],
    },
];

/// Runs `scenario` against `store`. `margin` is how far Redis-timed retries may drift; with a
/// margin, the start is first aligned to the next boundary of the longest window in real time.
pub async fn run<St: Store>(store: &St, scenario: &Scenario, margin: Duration) {
    let policy = scenario
        .policy
        .parse::<Policy>()
        .unwrap()
        .named(scenario.name)
        .unwrap()
        .with_algorithm(scenario.algorithm);
    if !margin.is_zero() {
        let longest = policy
            .limits()
            .last()
            .map(|l| l.window())
            .unwrap_or_default();
        align_to(longest).await;
    }
    let start = Instant::now();
    let key = Key::from("conformance");
    for (n, step) in scenario.steps.iter().enumerate() {
        sleep_until(start + Duration::from_millis(step.at_ms)).await;
        let d = store.check(&key, &policy, step.cost).await.unwrap();
        let at = format!("{} step {n} ({step:?}): got {d:?}", scenario.name);
        assert_eq!(d.is_allowed(), step.allowed, "{at}");
        if let Some(remaining) = step.remaining {
            assert_eq!(d.remaining(), remaining, "{at}");
        }
        if !step.allowed {
            assert_eq!(limit_index(&d), step.denied_by, "{at}");
            match (d.retry_after(), step.retry_ms) {
                (Some(got), Some(want)) => {
                    let want = Duration::from_millis(want);
                    assert!(got.abs_diff(want) <= margin, "{at}");
                    assert!(got > Duration::ZERO, "{at}");
                }
                (got, want) => assert_eq!(got, want.map(Duration::from_millis), "{at}"),
            }
        }
    }
}

/// Sleeps until just after the next multiple of `period` since the epoch, in real time.
async fn align_to(period: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let period = period.as_micros();
    let wait = period - now.as_micros() % period;
    tokio::time::sleep(Duration::from_micros(wait as u64)).await;
}

/// "Send this user a push at 11:11:11, at most 1 per minute, 5 per hour and 10 per day",
/// submitted out of order: (seconds from 11:11:11, admitted, retry in seconds when denied,
/// from the send's own time, past the sends booked after it too: -59 s waits for +60 s, clear
/// of the minute of the send at 0).
pub const SCHEDULED: &[(i64, bool, Option<u64>)] = &[
    (0, true, None),
    (30, false, Some(30)),
    (-59, false, Some(119)),
    (-60, true, None),
    (60, true, None),
    (3000, true, None),
    (-1800, true, None),
    (1200, true, None),
    (2000, false, Some(1540)),
    (-3000, true, None),
    (7200, true, None),
    (10800, true, None),
    (14400, true, None),
    (18000, false, Some(65400)),
];

/// Runs [`SCHEDULED`] on `store`, with 11:11:11 on the day after tomorrow (UTC).
pub async fn scheduled_sends<St: Store>(store: &St) {
    let policy = "1/1m + 5/1h + 10/1d"
        .parse::<Policy>()
        .unwrap()
        .named("push")
        .unwrap();
    let day = 86_400;
    let today = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / day
        * day;
    let base = (today + 2 * day + 11 * 3600 + 11 * 60 + 11) as i64;
    let key = Key::from("user-42");
    for &(offset, admitted, retry) in SCHEDULED {
        let at = UNIX_EPOCH + Duration::from_secs((base + offset) as u64);
        let d = store.check_at(&key, &policy, 1, at).await.unwrap();
        let context = format!("send at 11:11:11 {offset:+} s: {d:?}");
        assert_eq!(d.is_allowed(), admitted, "{context}");
        assert_eq!(d.retry_after(), retry.map(Duration::from_secs), "{context}");
    }
}

/// `peek` decides without recording and `reset` forgets, for `algorithm`.
pub async fn peek_and_reset<St: Store>(store: &St, algorithm: Algorithm) {
    let policy = "2/1m".parse::<Policy>().unwrap().with_algorithm(algorithm);
    let key = Key::from("inspect");
    for _ in 0..3 {
        let d = store.peek(&key, &policy, 1).await.unwrap();
        assert!(d.is_allowed(), "{algorithm:?}");
        assert_eq!(d.remaining(), 2, "{algorithm:?}: peek consumes nothing");
    }
    assert!(store.check(&key, &policy, 2).await.unwrap().is_allowed());
    let d = store.peek(&key, &policy, 1).await.unwrap();
    assert!(!d.is_allowed(), "{algorithm:?}");
    assert_eq!(d.remaining(), 0);
    store.reset(&key, &policy).await.unwrap();
    let d = store.check(&key, &policy, 2).await.unwrap();
    assert!(d.is_allowed(), "{algorithm:?}: reset forgets");
    // Event times belong to the sliding log.
    let at = store.check_at(&key, &policy, 1, SystemTime::now()).await;
    assert_eq!(
        at.is_ok(),
        algorithm == Algorithm::SlidingLog,
        "{algorithm:?}"
    );
}
