//! Store-level load for failover tests: worker tasks call `Store::check` over a spread of keys
//! and record every decision (or error) with when it was sent and how long it took, so that a
//! test can say how long decisions failed and how many requests failed, were admitted or were
//! refused while a Redis node was down or a slot moved.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_redis_ratelimit::{Key, Policy, RedisStore, Store};

/// The decision budget of the stores under test (the default).
pub const BUDGET: Duration = RedisStore::DEFAULT_TIMEOUT;
/// Scheduling slack on a shared two-core machine, on top of the budget.
pub const MARGIN: Duration = Duration::from_millis(400);
/// How long after a kill the store must decide again for the failed-over keys.
pub const RECOVERY: Duration = Duration::from_secs(15);

/// How long after the first success of a failover late failures are allowed: a call that
/// started on a connection still coming back may time out (the budget) and trip the breaker
/// (its interval) after another call has succeeded.
pub const SETTLE: Duration = Duration::from_secs(1);

/// Asserts that decisions hold once back: none sent from [`SETTLE`] after `first_ok` on
/// failed, and at least `at_least` were sent then. Prints how many failed in between.
pub fn assert_holds_after(samples: &[Sample], first_ok: Duration, at_least: usize) {
    let settled = first_ok + SETTLE;
    let between = samples
        .iter()
        .filter(|s| s.at >= first_ok && s.at < settled);
    eprintln!(
        "first {SETTLE:?} after the first success: {}",
        Counts::of(between)
    );
    let after: Vec<Sample> = samples
        .iter()
        .filter(|s| s.at >= settled)
        .cloned()
        .collect();
    assert!(
        after.len() >= at_least,
        "only {} decisions after the recovery settled",
        after.len()
    );
    assert_eq!(
        Counts::of(&after).failed,
        0,
        "decisions failed after the recovery: {:?}",
        errors(&after)
    );
}

/// A store with the default budget and a short breaker interval.
pub async fn store(url: String) -> RedisStore {
    super::store_within(url, BUDGET).await
}

/// One `check` of a load run.
#[derive(Debug, Clone)]
pub struct Sample {
    /// When it was sent, from the start of the run.
    pub at: Duration,
    pub latency: Duration,
    /// The group of its key (e.g. the primary that holds it).
    pub group: usize,
    /// Its client's index in the run's keys.
    pub client: usize,
    /// `Ok(admitted)`, or the store's error as text.
    pub result: Result<bool, String>,
}

/// What the workers share with the test while they run.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    done: AtomicUsize,
    /// Per group: µs from the start of the latest successful decision's sending (+1; 0: none).
    last_ok: Vec<AtomicU64>,
}

/// A load run under way.
pub struct Load {
    start: Instant,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<Vec<Sample>>>,
}

impl Load {
    /// Starts `workers` tasks that each check the `keys` (client key, group) in turn, from a
    /// different offset, `pause` apart, at cost 1 under `policy`, until [`stop`](Self::stop).
    pub fn start(
        store: &RedisStore,
        policy: &Policy,
        keys: &[(Key, usize)],
        workers: usize,
        pause: Duration,
    ) -> Load {
        let groups = keys.iter().map(|(_, g)| g + 1).max().unwrap_or(0);
        let shared = Arc::new(Shared {
            last_ok: (0..groups).map(|_| AtomicU64::new(0)).collect(),
            ..Shared::default()
        });
        let start = Instant::now();
        let keys: Arc<[(Key, usize)]> = keys.into();
        let workers = (0..workers)
            .map(|w| {
                let (store, policy) = (store.clone(), policy.clone());
                let (keys, shared) = (Arc::clone(&keys), Arc::clone(&shared));
                tokio::spawn(async move {
                    let mut samples = Vec::new();
                    let mut i = w;
                    while !shared.stop.load(Ordering::Relaxed) {
                        let client = i % keys.len();
                        let (key, group) = &keys[client];
                        i += 1;
                        let sent = Instant::now();
                        let result = store.check(key, &policy, 1).await;
                        let latency = sent.elapsed();
                        let at = sent - start;
                        if result.is_ok() {
                            let micros = at.as_micros() as u64 + 1;
                            shared.last_ok[*group].fetch_max(micros, Ordering::Relaxed);
                        }
                        samples.push(Sample {
                            at,
                            latency,
                            group: *group,
                            client,
                            result: result.map(|d| d.is_allowed()).map_err(|e| e.to_string()),
                        });
                        shared.done.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(pause).await;
                    }
                    samples
                })
            })
            .collect();
        Load {
            start,
            shared,
            workers,
        }
    }

    /// Time since the run started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Requests answered so far.
    pub fn done(&self) -> usize {
        self.shared.done.load(Ordering::Relaxed)
    }

    /// When the latest successful decision for a key of `group` was sent, from the start.
    pub fn last_ok(&self, group: usize) -> Option<Duration> {
        match self.shared.last_ok[group].load(Ordering::Relaxed) {
            0 => None,
            micros => Some(Duration::from_micros(micros - 1)),
        }
    }

    /// Waits until a decision for `group` sent after `after` succeeded; `None` if none did
    /// by `deadline`.
    pub async fn wait_ok_after(
        &self,
        group: usize,
        after: Duration,
        deadline: Instant,
    ) -> Option<Duration> {
        loop {
            if let Some(at) = self.last_ok(group).filter(|&at| at >= after) {
                return Some(at);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until `more` requests were answered (a short stretch of load, counted rather
    /// than timed).
    pub async fn wait_for_requests(&self, more: usize) {
        let target = self.done() + more;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.done() < target {
            assert!(Instant::now() < deadline, "the load stalled");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the workers after a failover: once it recovered (`recovered`), only after a
    /// stretch of load past [`SETTLE`] and 1 000 more requests, to see that it holds.
    pub async fn stop_after_failover(self, recovered: bool) -> Vec<Sample> {
        if recovered {
            tokio::time::sleep(SETTLE).await;
            self.wait_for_requests(1000).await;
        }
        self.stop().await
    }

    /// Stops the workers; every sample, by sending time.
    pub async fn stop(self) -> Vec<Sample> {
        self.shared.stop.store(true, Ordering::Relaxed);
        let mut all: Vec<Sample> = join_all(self.workers)
            .await
            .into_iter()
            .flat_map(|w| w.unwrap())
            .collect();
        all.sort_by_key(|s| s.at);
        all
    }
}

/// Counts of one stretch of samples.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub sent: usize,
    pub admitted: usize,
    pub refused: usize,
    pub failed: usize,
}

impl Counts {
    pub fn of<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> Counts {
        let mut counts = Counts::default();
        for sample in samples {
            counts.sent += 1;
            match sample.result {
                Ok(true) => counts.admitted += 1,
                Ok(false) => counts.refused += 1,
                Err(_) => counts.failed += 1,
            }
        }
        counts
    }
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} sent: {} admitted, {} refused, {} failed",
            self.sent, self.admitted, self.refused, self.failed
        )
    }
}

/// The distinct errors among `samples`, most frequent first, with their counts.
pub fn errors(samples: &[Sample]) -> Vec<(String, usize)> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for sample in samples {
        if let Err(error) = &sample.result {
            *seen.entry(error.as_str()).or_default() += 1;
        }
    }
    let mut errors: Vec<(String, usize)> = seen.into_iter().map(|(e, n)| (e.into(), n)).collect();
    errors.sort_by_key(|e| std::cmp::Reverse(e.1));
    errors
}

/// Asserts that no request waited past the budget plus the margin.
pub fn assert_within_budget(samples: &[Sample]) {
    let slowest = samples.iter().map(|s| s.latency).max().unwrap();
    eprintln!(
        "slowest of {} decisions: {slowest:?} (budget {BUDGET:?} + margin {MARGIN:?})",
        samples.len()
    );
    assert!(
        slowest <= BUDGET + MARGIN,
        "slowest of {} requests took {slowest:?}",
        samples.len()
    );
}

/// Sends `requests` concurrent checks at cost 1 for each of `keys` under `policy`; per key,
/// the number admitted, and the errors of all.
pub async fn burst(
    store: &RedisStore,
    policy: &Policy,
    keys: &[Key],
    requests: usize,
) -> (Vec<usize>, Vec<String>) {
    let per_key = join_all(
        keys.iter()
            .map(|key| join_all((0..requests).map(move |_| store.check(key, policy, 1)))),
    )
    .await;
    let mut errors = Vec::new();
    let admitted = per_key
        .into_iter()
        .map(|decisions| {
            decisions
                .into_iter()
                .filter(|d| match d {
                    Ok(decision) => decision.is_allowed(),
                    Err(error) => {
                        errors.push(error.to_string());
                        false
                    }
                })
                .count()
        })
        .collect();
    (admitted, errors)
}

/// The policy of the exactness check after a failover.
pub fn exact_policy() -> Policy {
    "50/10s".parse().unwrap()
}

/// After a failover: bursts of 200 concurrent requests at [`exact_policy`] (`50/10s`) for
/// each fresh pair of clients in turn, until one burst has no error; asserts that burst
/// admitted exactly 50 per client (and that no burst admitted more). Returns when that burst
/// ended, from `since`, and how many bursts had errors.
pub async fn exact_again(
    store: &RedisStore,
    pairs: &[[Key; 2]],
    since: Instant,
) -> (Duration, usize) {
    let policy = exact_policy();
    for (failed_bursts, pair) in pairs.iter().enumerate() {
        let (admitted, errors) = burst(store, &policy, pair, 200).await;
        assert!(
            admitted.iter().all(|&n| n <= 50),
            "more than 50 of 200 admitted: {admitted:?}"
        );
        if errors.is_empty() {
            assert_eq!(admitted, [50, 50], "exactly 50 of 200 admitted per client");
            return (since.elapsed(), failed_bursts);
        }
        eprintln!(
            "  burst {}: {} errors (first: {}), admitted {admitted:?}",
            failed_bursts + 1,
            errors.len(),
            errors[0]
        );
    }
    panic!("every one of {} bursts had errors", pairs.len());
}

/// What a load run saw around a primary's death at `kill_at` (from the run's start), for the
/// keys of group `victim` (held by the killed primary) and the others; printed for the
/// operator. `recovered_at`: when the first decision for `victim` after the kill that
/// succeeded was sent.
#[derive(Debug)]
pub struct Failover {
    /// Failed decisions for the victim's keys after the kill.
    pub victim_failed: usize,
    /// When the victim's last failed decision was sent, from the kill.
    pub victim_last_failure: Option<Duration>,
    /// Failed decisions for the other keys after the kill.
    pub others_failed: usize,
    /// When the other keys' last failed decision was sent, from the kill.
    pub others_last_failure: Option<Duration>,
}

pub fn report_failover(
    samples: &[Sample],
    kill_at: Duration,
    recovered_at: Duration,
    victim: usize,
) -> Failover {
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at >= kill_at).collect();
    let outage = |s: &&Sample| s.at < recovered_at;
    let (victim_samples, other_samples): (Vec<&Sample>, Vec<&Sample>) =
        after.iter().partition(|s| s.group == victim);
    let failures = |set: &[&Sample]| -> Vec<Duration> {
        set.iter()
            .filter(|s| s.result.is_err())
            .map(|s| s.at - kill_at)
            .collect()
    };
    let victim_failures = failures(&victim_samples);
    let other_failures = failures(&other_samples);
    let span = |f: &[Duration]| match (f.first(), f.last()) {
        (Some(a), Some(b)) => format!("from +{a:?} to +{b:?} after the kill"),
        _ => "never".into(),
    };
    let alone = other_samples.is_empty();
    let victim_name = if alone {
        "keys"
    } else {
        "killed primary's keys"
    };
    eprintln!(
        "{victim_name}, kill to first success: {}",
        Counts::of(victim_samples.iter().copied().filter(outage))
    );
    if !alone {
        eprintln!(
            "other keys, kill to first success on the killed primary's keys: {}",
            Counts::of(other_samples.iter().copied().filter(outage))
        );
    }
    eprintln!(
        "after the kill: {victim_name} failed {} times ({})",
        victim_failures.len(),
        span(&victim_failures)
    );
    if !alone {
        eprintln!(
            "after the kill: other keys failed {} times ({})",
            other_failures.len(),
            span(&other_failures)
        );
    }
    eprintln!(
        "after recovery: {victim_name} {}",
        Counts::of(victim_samples.iter().copied().filter(|s| !outage(s)))
    );
    if !alone {
        eprintln!(
            "after recovery: other keys {}",
            Counts::of(other_samples.iter().copied().filter(|s| !outage(s)))
        );
    }
    for (error, n) in errors(samples) {
        eprintln!("  error x{n}: {error}");
    }
    Failover {
        victim_failed: victim_failures.len(),
        victim_last_failure: victim_failures.last().copied(),
        others_failed: other_failures.len(),
        others_last_failure: other_failures.last().copied(),
    }
}
