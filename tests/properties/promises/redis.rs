//! The promises on Redis: short real-time cases on two instances over the test's own
//! `redis-server`, with stalls (`DEBUG SLEEP`, `SIGSTOP`) and restarts.

use super::*;

use crate::support::RedisServer;
use tower_redis_ratelimit::store::Leases;
use tower_redis_ratelimit::test_util::{redis_key, tokio_clock_at};
use tower_redis_ratelimit::usage::UsageReport;
use tower_redis_ratelimit::RedisStore;

/// A fault the harness injects into Redis.
#[derive(Debug, Clone)]
enum Fault {
    /// `DEBUG SLEEP` for this many ms.
    Sleep(u64),
    /// `SIGSTOP`, then `SIGCONT` this many ms later.
    Stop(u64),
    /// A restart, empty.
    Restart,
}

/// One step of a schedule on Redis.
#[derive(Debug, Clone)]
enum Step {
    /// A request of key `key` to instance `instance`, its body ended `hold` ms after its head
    /// (long enough, at times, to stream through a stall).
    Send {
        instance: usize,
        key: usize,
        hold: u64,
        /// The handler's status, cost and usage reported.
        how: How,
    },
    /// `n` requests of key `key` to instance `instance` at once, each streaming `hold` ms.
    Streams {
        instance: usize,
        key: usize,
        n: usize,
        hold: u64,
        how: How,
    },
    /// An override of the inner policy for a key (as on the memory store), given the
    /// stores' 250 ms to read it.
    Override(usize, Option<u64>),
    /// A key's client moves to the plan `pro` or back.
    Plan(usize, bool),
    /// `Store::check_at` on instance 0 at an event time this many ms from now.
    At {
        key: usize,
        offset: i64,
        cost: u64,
    },
    Pass(u64),
    Reset(usize),
    Fault(Fault),
}

/// What a request of the Redis property asks of its handler: its status (200 or 401), its
/// cost, and the usage it reports.
#[derive(Debug, Clone, Copy)]
struct How {
    status: u16,
    /// ms before the handler answers: an attempt in flight that long.
    head: u64,
    cost: u64,
    usage: u64,
}

fn how() -> impl Strategy<Value = How> {
    let head = prop_oneof![3 => Just(0u64), 1 => 1..=1_000u64];
    (
        prop::sample::select(vec![200u16, 401]),
        head,
        1..=3u64,
        0..=4u64,
    )
        .prop_map(|(status, head, cost, usage)| How {
            status,
            head,
            cost,
            usage,
        })
}

/// The configurations the Redis property draws: the algorithms, limits of one to three
/// seconds, the penalty box, concurrency with a two-second slot lifetime (stalls are shorter),
/// and both failure modes. Outcome counting, soft and stacked layers, overrides and the
/// memory store's bound are the memory property's: they add no Redis behaviour of their own
/// that the short real-time cases here could tell apart.
fn redis_config() -> impl Strategy<Value = Config> {
    let limits = (1..=8u64, 1..=3u64).prop_map(|(c, w)| vec![(c, w)]);
    (
        algorithm(),
        limits,
        prop::option::weighted(0.3, 1..=3u64),
        prop::option::weighted(0.5, 1..=2u32),
        prop_oneof![Just(FailureMode::Open), Just(FailureMode::Closed)],
        prop::option::weighted(0.35, prop::sample::select(vec![50u32, 90])),
        redis_field(),
    )
        .prop_map(
            |(algorithm, mut limits, block, concurrency, failure, leases, field)| {
                // Under a concurrency limit, counts that leave room for more than the cap at once:
                // the cap, not the count, is what holds requests back.
                if let Some(cap) = concurrency {
                    limits[0].0 = limits[0].0.max(2 * u64::from(cap) + 1);
                }
                let (count_when, plan, outer, (cost, fallback, usage, shadow)) = field;
                let smallest = limits_min(&limits);
                Config {
                    block,
                    concurrency,
                    failure,
                    leases,
                    count_when,
                    plan,
                    outer,
                    cost: cost.map_or(1, |c| c.min(smallest)),
                    fallback,
                    usage: usage && !count_when,
                    shadow,
                    ..plain(algorithm, limits)
                }
            },
        )
}

/// What the Redis property draws of the field, as the memory property does (each with its
/// dimension): outcome counting, a plan, a stacked layer; costs, the fallback, usage and
/// shadow layers.
#[allow(clippy::type_complexity)]
fn redis_field() -> impl Strategy<
    Value = (
        bool,
        Option<u64>,
        Option<(u64, u64)>,
        (Option<u64>, bool, bool, bool),
    ),
> {
    let d = dims();
    let p = |on: bool, p: f64| if on { p } else { 0.0 };
    let field = p(d.redis_field, 1.0);
    (
        prop::bool::weighted(0.3 * field),
        (
            prop::bool::weighted(0.2 * field),
            prop_oneof![30..=90u64, 150..=400u64],
        )
            .prop_map(|(on, pct)| on.then_some(pct)),
        (prop::bool::weighted(0.2 * field), 1..=6u64, 1..=3u64)
            .prop_map(|(on, c, w)| on.then_some((c, w))),
        (
            (prop::bool::weighted(p(d.costs, 0.3)), 2..=3u64).prop_map(|(on, c)| on.then_some(c)),
            prop::bool::weighted(p(d.fallback, 0.25)),
            prop::bool::weighted(p(d.usage, 0.15)),
            prop::bool::weighted(p(d.shadow, 0.1)),
        ),
    )
}

/// A fault: a stall that is a blip (under a third of the slot lifetime) or comes close to
/// the lifetime, by `DEBUG SLEEP` or `SIGSTOP`, or a restart.
fn redis_fault() -> impl Strategy<Value = Fault> {
    let stall = || prop_oneof![100..=600u64, 1_500..=1_950u64];
    prop_oneof![
        2 => stall().prop_map(Fault::Sleep),
        2 => stall().prop_map(Fault::Stop),
        1 => Just(Fault::Restart),
    ]
}

/// Requests that end at once or stream for up to 3 s, streams of a key opened together that
/// outlast any stall, time passing, resets and faults.
fn redis_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (0..2usize, 0..KEYS.len(), prop_oneof![0..=5u64, 0..=3_000u64], how())
            .prop_map(|(instance, key, hold, how)| Step::Send { instance, key, hold, how }),
        3 => (0..2usize, 0..KEYS.len(), 1..=3usize, 2_500..=4_000u64, how())
            .prop_map(|(instance, key, n, hold, how)| Step::Streams { instance, key, n, hold, how }),
        3 => (20..=800u64).prop_map(Step::Pass),
        1 => (0..KEYS.len()).prop_map(Step::Reset),
        1 => redis_fault().prop_map(Step::Fault),
        if dims().redis_field { 1 } else { 0 } => (
            0..KEYS.len(),
            prop::option::of(prop_oneof![Just(0u64), 50..=300u64])
        )
            .prop_map(|(key, pct)| Step::Override(key, pct)),
        if dims().redis_field { 1 } else { 0 } => (0..KEYS.len(), any::<bool>())
            .prop_map(|(key, pro)| Step::Plan(key, pro)),
        if dims().redis_field && dims().event_times { 2 } else { 0 } => (
            0..KEYS.len(),
            -3_000..=3_000i64,
            1..=3u64
        )
            .prop_map(|(key, offset, cost)| Step::At { key, offset, cost }),
    ]
}

/// A schedule on Redis: what runs before a fault, the fault (at any point of the slots'
/// renewal period: up to 600 ms later), and what runs after it, so that every case meets a
/// fault under load.
fn redis_steps() -> impl Strategy<Value = Vec<Step>> {
    let around = || prop::collection::vec(redis_step(), 1..6);
    (around(), 0..=600u64, redis_fault(), around()).prop_map(|(mut steps, lag, fault, after)| {
        steps.push(Step::Pass(lag));
        steps.push(Step::Fault(fault));
        steps.extend(after);
        steps
    })
}

/// Runs `steps` on two instances of `config` over `server`; the keys are the case's own.
async fn run_redis(
    server: &mut RedisServer,
    case: usize,
    config: &Config,
    steps: &[Step],
) -> Result<Run, BuildError> {
    let start = Instant::now();
    let epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let inner = inner_policy(config);
    let inner = match config.concurrency {
        Some(_) => inner.slot_expiry(Duration::from_secs(2)).unwrap(),
        None => inner,
    };
    let log = Arc::new(Log::default());
    let ends = Arc::new(Mutex::new(BTreeMap::new()));
    let mut instances = Vec::new();
    let mut stores = Vec::new();
    let header = Header::new(HeaderName::from_static("x-key"));
    let outer = outer_policy(config);
    for instance in 0..2u32 {
        let mut store = RedisStore::builder(server.url());
        if let Some(share) = config.leases {
            store = store.leases(Leases::new().max_share(f64::from(share) / 100.0));
        }
        let store = store.connect().await.unwrap();
        // Each instance's fallback, its clock ahead (by one more period for each instance) so
        // that its decisions tell, and whose.
        let fallback = MemoryStore::builder()
            .clock(tokio_clock_at(
                SystemTime::now() + FALLBACK_AHEAD * (instance + 1),
            ))
            .build();
        let mut layer = RateLimitLayer::builder()
            .key(header.clone())
            .store(store.clone())
            .failure_mode(config.failure_mode(Some(&fallback)))
            .on_rejection(rejection);
        layer = match config.plan {
            Some(_) => layer
                .rule(Rule::new(inner.clone()).plan("pro", plan_policy(config)))
                .plan(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok())),
            None => layer.policy(inner.clone()),
        };
        if config.count_when {
            layer = layer.count_when(|head| head.status == StatusCode::UNAUTHORIZED);
        }
        if config.cost > 1 {
            layer = layer.cost(|head| {
                let cost = head.headers.get("x-cost").and_then(|v| v.to_str().ok());
                cost.and_then(|c| c.parse().ok()).unwrap_or(1)
            });
        }
        if config.usage {
            layer = layer.usage(UsageReport::new());
        }
        if config.shadow {
            layer = layer.shadow(true);
        }
        let layer = layer.build()?;
        let service = layer.layer(handler(Arc::clone(&log), start, Arc::clone(&ends)));
        let service = service.map_response(|r| r.map(BodyExt::boxed));
        let service = match &outer {
            Some(policy) => {
                let outer = RateLimitLayer::builder()
                    .key(header.clone())
                    .store(store.clone())
                    .policy(policy.clone())
                    .failure_mode(config.failure_mode(Some(&fallback)))
                    .build()?;
                let service = outer.layer(service).map_response(|r| r.map(BodyExt::boxed));
                tower::util::BoxCloneService::new(service)
            }
            None => tower::util::BoxCloneService::new(service),
        };
        instances.push(service);
        stores.push(store);
    }
    let on_plan = [AtomicBool::new(false), AtomicBool::new(false)];
    let mut plans = Vec::new();
    let mut overrides = Vec::new();
    let mut at_calls = Vec::new();
    let mut times = BTreeMap::new();
    let mut faults = Vec::new();
    let name = |key: usize| format!("{case}-{}", KEYS[key]);
    let send = |instance: usize, key: usize, hold: u64, how: How| {
        let i = log.open(key, since(start), None);
        let pro = on_plan[key].load(Ordering::SeqCst);
        let (cost, status, head) = match dims().redis_field || dims().costs || dims().usage {
            true => (how.cost.clamp(1, config.cost), how.status, how.head),
            false => (1, 200, 0),
        };
        log.with(i, |r| {
            r.pro = pro;
            r.cost = cost;
            r.usage = how.usage;
        });
        let (end, ended) = tokio::sync::oneshot::channel();
        ends.lock().unwrap().insert(i, ended);
        let request = Request::builder()
            .header("x-key", name(key))
            .header("x-i", i.to_string())
            .header("x-status", status.to_string())
            .header("x-head", head.to_string())
            .header("x-plan", if pro { "pro" } else { "none" })
            .header("x-cost", cost.to_string())
            .header("x-usage", how.usage.to_string())
            .body(())
            .unwrap();
        let (service, log) = (instances[instance].clone(), Arc::clone(&log));
        tokio::spawn(async move {
            let response = service.oneshot(request).await.unwrap();
            let members = fields(&response);
            let retry = response.headers().get("retry-after");
            let retry = retry.map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
            let refusal = response
                .headers()
                .get("x-refusal")
                .map(|v| v.as_bytes().to_vec());
            log.with(i, |r| {
                r.status = Some(response.status());
                r.responded = Some(since(start));
                r.fields = members;
                r.retry_after = retry;
                r.inner_refusal = refusal.as_ref().map(|v| v.as_slice() == b"slot");
                r.boxed = refusal.as_deref() == Some(b"box");
            });
            tokio::time::sleep(Duration::from_millis(hold)).await;
            let _ = end.send(());
            let _ = response.into_body().collect().await;
            log.with(i, |r| r.ended = Some(since(start)));
        })
    };
    let mut tasks = Vec::new();
    let mut resets = Vec::new();
    let mut reset_done = Vec::new();
    let wall = || SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    for step in steps {
        match step {
            &Step::Send {
                instance,
                key,
                hold,
                how,
            } => tasks.push(send(instance, key, hold, how)),
            &Step::Streams {
                instance,
                key,
                n,
                hold,
                how,
            } => tasks.extend((0..n).map(|_| send(instance, key, hold, how))),
            &Step::Override(key, pct) => {
                let scope = Scope::Key(Key::from(name(key).as_str()));
                let table = stores[0].overrides();
                let set = match pct {
                    Some(0) => table.set(&inner, &scope, &Override::Block).await,
                    Some(pct) => {
                        let counts = config.limits.iter().map(|&(c, w)| {
                            let c = (c * pct / 100).max(1);
                            Limit::new(c, Duration::from_secs(w)).unwrap()
                        });
                        let to = Override::Limits(counts.collect());
                        table.set(&inner, &scope, &to).await
                    }
                    None => table.remove(&inner, &scope).await.map(drop),
                };
                // Both stores read the table every 250 ms; nothing is decided meanwhile.
                tokio::time::sleep(Duration::from_millis(400)).await;
                if set.is_ok() {
                    let seq = log.next();
                    overrides.push((seq, key, pct));
                    times.insert(seq, since(start));
                }
            }
            &Step::Plan(key, pro) => {
                on_plan[key].store(pro, Ordering::SeqCst);
                plans.push((log.next(), key));
            }
            &Step::At { key, offset, cost } => {
                let k = Key::from(name(key).as_str());
                let now = SystemTime::now();
                let at = match offset >= 0 {
                    true => now + Duration::from_millis(offset as u64),
                    false => now - Duration::from_millis(offset.unsigned_abs()),
                };
                let cost = cost.clamp(1, config.cost);
                let decision = stores[0].check_at(&k, &inner, cost as u32, at).await;
                let Ok(decision) = decision else { continue };
                let mut call = |at: SystemTime, decision: Decision, probe| {
                    let (seq, decided) = (log.next(), since(start));
                    let at = at.duration_since(UNIX_EPOCH).unwrap();
                    let decision = Some(decision);
                    at_calls.push(AtCall {
                        seq,
                        decided,
                        key,
                        at,
                        cost,
                        decision,
                        probe,
                    });
                };
                call(at, decision, None);
                // The probes of its retry_after, without leases (a lease held elsewhere may
                // refuse the moved event).
                let retry = Some(decision)
                    .filter(|_| dims().event_retry && config.leases.is_none())
                    .filter(|d| !d.is_allowed() && !d.in_penalty_box())
                    .and_then(|d| d.retry_after());
                if let Some(retry) = retry {
                    let mut early_admitted = false;
                    if retry > Duration::from_secs(1) {
                        let early = at + retry - Duration::from_secs(1);
                        if let Ok(d) = stores[0].check_at(&k, &inner, cost as u32, early).await {
                            early_admitted = d.is_allowed();
                            call(early, d, Some(false));
                        }
                    }
                    if !early_admitted {
                        let moved = at + retry;
                        if let Ok(d) = stores[0].check_at(&k, &inner, cost as u32, moved).await {
                            call(moved, d, Some(true));
                        }
                    }
                }
            }
            &Step::Pass(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            &Step::Reset(key) => {
                stores[0]
                    .reset(&Key::from(name(key).as_str()), &inner)
                    .await
                    .unwrap();
                let at = log.next();
                resets.push((at, key));
                reset_done.push((at, wall()));
            }
            Step::Fault(fault) => {
                let from = since(start);
                match *fault {
                    Fault::Sleep(ms) => {
                        let (port, seconds) = (server.port(), (ms as f64 / 1000.0).to_string());
                        tokio::task::spawn_blocking(move || {
                            crate::support::cluster::cli(port, &["DEBUG", "SLEEP", &seconds])
                        })
                        .await
                        .unwrap();
                    }
                    Fault::Stop(ms) => {
                        server.signal("-STOP");
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        server.signal("-CONT");
                    }
                    Fault::Restart => {
                        tokio::task::block_in_place(|| server.restart());
                        // Redis lost every key: each starts afresh.
                        let at = log.next();
                        resets.extend((0..KEYS.len()).map(|key| (at, key)));
                        reset_done.push((at, wall()));
                        // And the overrides, which the stores forget within 250 ms.
                        let set = |key: &usize| {
                            let last = overrides.iter().rfind(|o: &&(usize, usize, _)| o.1 == *key);
                            last.is_some_and(|o| o.2.is_some())
                        };
                        let lost: Vec<usize> = (0..KEYS.len()).filter(set).collect();
                        if !lost.is_empty() {
                            tokio::time::sleep(Duration::from_millis(400)).await;
                            let seq = log.next();
                            overrides.extend(lost.into_iter().map(|key| (seq, key, None)));
                            times.insert(seq, since(start));
                        }
                    }
                }
                faults.push((from, since(start)));
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    // Every give-back has landed once Redis has answered for a few rounds of resends.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let client = server.client().await;
    let mut slots_left = 0;
    for key in 0..KEYS.len() {
        let slots = redis_key(&stores[0], &Key::from(name(key).as_str()), &inner) + ":slots";
        let held: u64 = fred::interfaces::SortedSetsInterface::zcard(&client, slots)
            .await
            .unwrap();
        slots_left += held as usize;
    }
    let records = log.records.lock().unwrap().clone();
    let most = [0, 1].map(|k| log.most[k].load(Ordering::SeqCst));
    // A key's state ages out within twice its longest window, its box, its slots' lifetime,
    // its usage charged (a window per count of it) and the events booked ahead.
    let outer_limits = outer_policy_limits(config);
    let windows = config.limits.iter().chain(&outer_limits).map(|l| l.1);
    let longest = windows.max().unwrap_or(1);
    let used: u64 = records.iter().map(|r| r.usage.max(r.cost)).sum();
    let used = match config.usage {
        true => (used * longest).div_ceil(limits_min(&config.limits)),
        false => 0,
    };
    let quiet = 2 * longest + config.block.unwrap_or(0) + 2 + used + 3 + 1;
    Ok(Run {
        epoch,
        records,
        resets,
        reset_done,
        overrides,
        plans,
        outages: Vec::new(),
        floods: Vec::new(),
        most,
        slots_left,
        keys_left: 0,
        log_sizes: Vec::new(),
        event_time: Ok(()),
        at_calls,
        times,
        quiet: Duration::from_secs(quiet),
        faults,
    })
}

/// What the Redis property's configuration `config` asks that a leasing store does not
/// support (`docs/promises.md`): GCRA where the lease's headroom leaves a bucket less than
/// one unit; a policy with a penalty box or a concurrency limit is never leased, nor one
/// whose share of its smallest count is under two units.
fn unsupported_on_redis(config: &Config) -> Option<&'static str> {
    let share = f64::from(config.leases?) / 100.0;
    if config.block.is_some() || config.concurrency.is_some() {
        return None;
    }
    let smallest = config.limits.iter().map(|l| l.0).min()?;
    let shortest = config.limits[0].1 * 1_000_000;
    let leased = (smallest as f64 * share) as u64 >= 2;
    match config.algorithm {
        Algorithm::Gcra if leased => {
            let headroom = 1_000_000u64.min((shortest as f64 * share) as u64);
            let starved = config.limits.iter().any(|&(c, w)| {
                let w = w * 1_000_000;
                (w - headroom) * c < w
            });
            starved.then_some("leases that leave a GCRA bucket less than one unit")
        }
        _ => None,
    }
}

/// Whether the store's slots are promised to hold through `steps`: not past a restart, which
/// loses them (`docs/operations.md`).
fn slots_kept(steps: &[Step]) -> bool {
    !steps
        .iter()
        .any(|s| matches!(s, Step::Fault(Fault::Restart)))
}

/// The most requests of `key` streaming at once among those the store decided, which each
/// hold a slot of the fleet's; a request let in without a decision (failing open, on an
/// instance's own cap) holds none. A body that stops streaming is done before the slot it
/// held is given back, so at one time an end comes before a start.
fn most_with_slots(run: &Run, key: usize) -> usize {
    let mut edges: Vec<(Duration, bool)> = Vec::new();
    for r in run.records.iter().filter(|r| r.key == key) {
        let Some(handled) = &r.handled else { continue };
        let decided = handled.decisions.as_ref().and_then(|d| d.get("inner"));
        // A decision of an instance's fallback holds a slot of its own, not the fleet's.
        let fallback = decided
            .and_then(recorded_at)
            .is_some_and(|at| fallback_of(run, at).0 > 0);
        if decided.is_none() || fallback {
            continue;
        }
        edges.push((handled.at, true));
        edges.push((r.streamed_until.unwrap_or(Duration::MAX), false));
    }
    edges.sort();
    let (mut now, mut most) = (0usize, 0usize);
    for (_, starts) in edges {
        match starts {
            true => now += 1,
            false => now -= 1,
        }
        most = most.max(now);
    }
    most
}

fn check_redis(
    server: &mut RedisServer,
    case: usize,
    config: &Config,
    steps: &[Step],
) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let fail = |promise: &str, why: String| TestCaseError::fail(format!("{promise}: {why}"));
    let run = match (
        runtime.block_on(run_redis(server, case, config, steps)),
        unsupported_on_redis(config),
    ) {
        (Ok(run), None) => run,
        (Err(BuildError::Unsupported { .. }), Some(_)) => return Ok(()),
        (Err(error), _) => {
            return Err(fail(
                "supported",
                format!("{config:?} failed to build: {error}"),
            ))
        }
        (Ok(_), Some(why)) => return Err(fail("unsupported", format!("built {why}"))),
    };
    never_over(config, &run).map_err(|why| fail("never over", why))?;
    let d = dims();
    if d.over_refusal {
        lone_admitted(config, &run).map_err(|why| fail("never refused for nothing", why))?;
    }
    if d.no_box_without_failure {
        no_box_without_failure(config, &run)
            .map_err(|why| fail("no box without a failure", why))?;
    }
    if d.event_retry {
        retry_after_where_a_wait_helps(config, &run)
            .map_err(|why| fail("Retry-After where a wait helps", why))?;
    }
    never_the_outage(config, &run).map_err(|why| fail("never the outage", why))?;
    fields_agree(&run).map_err(|why| fail("Decisions and fields agree", why))?;
    if run.slots_left != 0 {
        return Err(fail(
            "nothing leaked",
            format!("{} slots held after every request ended", run.slots_left),
        ));
    }
    // A soft or shadow layer passes on what it would refuse for a slot.
    let cap = config.concurrency.filter(|_| !config.lenient());
    if let Some(cap) = cap.filter(|_| slots_kept(steps)) {
        for key in 0..KEYS.len() {
            let most = most_with_slots(&run, key);
            if most > cap as usize {
                return Err(fail(
                    "at most the cap",
                    format!("key {key}: {most} with slots in flight at cap {cap}"),
                ));
            }
        }
    }
    Ok(())
}

/// The Redis property runs in this many slices, tests of their own that the test threads
/// share beside the others.
const SLICES: usize = 10;

/// Slice `slice` of the Redis property: of the one sequence of cases the seed draws (as one
/// run of all of them would draw it), the cases `[slice·n/SLICES, (slice + 1)·n/SLICES)`,
/// `n` being `PROMISE_REDIS_CASES`, on a server of its own; the cases before the slice are
/// drawn, not run.
fn the_promises_hold_on_redis(slice: usize) {
    let cases = cases_from("PROMISE_REDIS_CASES", 50);
    let (from, to) = (
        slice * cases as usize / SLICES,
        (slice + 1) * cases as usize / SLICES,
    );
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let server = std::cell::RefCell::new(server);
    let (mut runner, seed) = runner(to as u32, 20);
    let case = AtomicUsize::new(0);
    let strategy = (redis_config(), redis_steps());
    let first = std::sync::OnceLock::new();
    let outcome = runner.run(&strategy, |(config, steps)| {
        let n = case.fetch_add(1, Ordering::SeqCst);
        if n < from {
            return Ok(());
        }
        let outcome = check_redis(&mut server.borrow_mut(), n, &config, &steps);
        if outcome.is_err() {
            first.get_or_init(|| n + 1);
        }
        outcome
    });
    if let Err(failure) = outcome {
        let first = first.get().copied().unwrap_or_default();
        panic!("seed {seed}: case {first} of {cases} failed first; shrunk: {failure}");
    }
}

/// One test per slice, `the_promises_hold_on_redis_<slice>_of_10`.
macro_rules! slices {
    ($($name:ident = $slice:expr),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                the_promises_hold_on_redis($slice);
            }
        )*
        const _: () = assert!([$($slice),*].len() == SLICES);
    };
}

slices! {
    the_promises_hold_on_redis_1_of_10 = 0,
    the_promises_hold_on_redis_2_of_10 = 1,
    the_promises_hold_on_redis_3_of_10 = 2,
    the_promises_hold_on_redis_4_of_10 = 3,
    the_promises_hold_on_redis_5_of_10 = 4,
    the_promises_hold_on_redis_6_of_10 = 5,
    the_promises_hold_on_redis_7_of_10 = 6,
    the_promises_hold_on_redis_8_of_10 = 7,
    the_promises_hold_on_redis_9_of_10 = 8,
    the_promises_hold_on_redis_10_of_10 = 9,
}

/// Two streams that outlive a stall shorter than their slot lifetime keep their slots: no third
/// request gets in (the concurrency issue's stall, as a case of the Redis property).
#[test]
fn slots_ride_out_a_stall_on_redis() {
    let config = Config {
        concurrency: Some(2),
        failure: FailureMode::Closed,
        ..plain(Algorithm::Gcra, vec![(4, 1)])
    };
    let long = |instance| Step::Send {
        instance,
        key: 0,
        hold: 3_500,
        how: How {
            status: 200,
            head: 0,
            cost: 1,
            usage: 0,
        },
    };
    let steps = [
        long(0),
        long(1),
        Step::Pass(400),
        Step::Fault(Fault::Stop(1_900)),
        Step::Pass(100),
        long(0),
        long(1),
    ];
    let mut server = RedisServer::start();
    check_redis(&mut server, 0, &config, &steps).unwrap();
}

/// The outer layer's limit, as a list.
fn outer_policy_limits(config: &Config) -> Vec<(u64, u64)> {
    config.outer.into_iter().collect()
}

/// Three right passwords at once on one instance at `1/2s` with a 2 s box, each answered after
/// 500 ms: one is let in, the others are refused for it in flight, and a refusal boxes a user
/// with no failure counted (`no_box_without_failure` on Redis).
#[test]
fn right_passwords_at_once_box_no_one_on_redis() {
    let config = Config {
        block: Some(2),
        count_when: true,
        ..plain(Algorithm::SlidingWindow, vec![(1, 2)])
    };
    let steps = [
        Step::Streams {
            instance: 0,
            key: 0,
            n: 3,
            hold: 0,
            how: How {
                status: 200,
                head: 500,
                cost: 1,
                usage: 0,
            },
        },
        Step::Pass(1_000),
    ];
    let mut server = RedisServer::start();
    check_redis(&mut server, 0, &config, &steps).unwrap();
}
