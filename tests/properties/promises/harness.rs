//! The run: a case's configuration built into layers over the memory store (behind a switch
//! that fails it, for the failure modes), its schedule played on tokio's paused clock, and what
//! the handler and the client saw, for the oracles.

use super::*;
use tower_redis_ratelimit::test_util::{events, key_count, slots_in_use, tokio_clock_at};
use tower_redis_ratelimit::usage::{UsageMeter, UsageReport};

/// How far ahead of the store's clock the fallback store's clock runs (on Redis, the second
/// instance's twice as far): a decision recorded this far ahead is the fallback's.
pub(super) const FALLBACK_AHEAD: Duration = Duration::from_secs(1_000 * 86_400);

/// What the handler saw of one request.
#[derive(Debug, Clone)]
pub(super) struct Handled {
    /// When the handler was called ([`Log::next`]): just after the decision.
    pub(super) seq: usize,
    pub(super) at: Duration,
    pub(super) decisions: Option<Decisions>,
}

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub(super) struct Record {
    /// When it was sent, in the run's order of events ([`Log::next`]).
    pub(super) seq: usize,
    pub(super) key: usize,
    pub(super) sent: Duration,
    pub(super) status: Option<StatusCode>,
    pub(super) retry_after: Option<u64>,
    /// The `RateLimit` field's members: policy, remaining.
    pub(super) fields: Vec<(String, i64)>,
    /// What the outer layer passed on (its decisions), when there is one.
    pub(super) passed_outer: Option<Decisions>,
    pub(super) handled: Option<Handled>,
    /// The handler's status, when it answered.
    pub(super) answered: Option<u16>,
    /// When the handler gave its response ([`Log::next`]): the layer settles what the status
    /// says before anything else runs.
    pub(super) answered_seq: Option<usize>,
    /// When its response's head came back.
    pub(super) responded: Option<Duration>,
    /// When its body ended or was dropped.
    pub(super) ended: Option<Duration>,
    /// When the handler's body stopped streaming (before the layer gave its slot back).
    pub(super) streamed_until: Option<Duration>,
    /// A probe of a retry: refused expected (`false`) or admitted expected (`true`).
    pub(super) probe: Option<bool>,
    /// Sent on the plan `pro`.
    pub(super) pro: bool,
    /// Its cost, and the units its handler reports (under a usage layer).
    pub(super) cost: u64,
    pub(super) usage: u64,
    /// Its body dropped, not read to the end.
    pub(super) dropped: bool,
    /// Refused by the inner layer (its rejection): for a slot (`Some(true)`) or by its limits
    /// or penalty box (`Some(false)`); and whether the refusal was the penalty box's.
    pub(super) inner_refusal: Option<bool>,
    pub(super) boxed: bool,
}

/// The log of a run, shared by the client side and the handler.
#[derive(Default)]
pub(super) struct Log {
    pub(super) records: Mutex<Vec<Record>>,
    /// The run's events in order: requests sent, resets, overrides, looks at the store.
    pub(super) seq: AtomicUsize,
    /// Responses streaming now per key, and the most at once.
    pub(super) streaming: [AtomicUsize; 2],
    pub(super) most: [AtomicUsize; 2],
}

impl Log {
    pub(super) fn next(&self) -> usize {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Records a request of `key` sent at `sent`; its index.
    pub(super) fn open(&self, key: usize, sent: Duration, probe: Option<bool>) -> usize {
        let mut records = self.records.lock().unwrap();
        records.push(Record {
            seq: self.next(),
            key,
            sent,
            probe,
            ..Record::default()
        });
        records.len() - 1
    }

    pub(super) fn with<T>(&self, i: usize, f: impl FnOnce(&mut Record) -> T) -> T {
        f(&mut self.records.lock().unwrap()[i])
    }
}

/// Counts a response of a key streaming until dropped.
pub(super) struct Streaming(
    pub(super) Arc<Log>,
    pub(super) usize,
    pub(super) usize,
    pub(super) Instant,
);

impl Drop for Streaming {
    fn drop(&mut self) {
        let Streaming(log, key, i, start) = self;
        log.streaming[*key].fetch_sub(1, Ordering::SeqCst);
        log.with(*i, |r| r.streamed_until = Some(since(*start)));
    }
}

pub(super) fn since(start: Instant) -> Duration {
    Instant::now() - start
}

/// The handler: answers the status the request asks for, with a body that streams until the
/// client ends it (`x-end` fires) or drops it.
pub(super) fn handler(
    log: Arc<Log>,
    start: Instant,
    ends: Arc<Mutex<BTreeMap<usize, tokio::sync::oneshot::Receiver<()>>>>,
) -> impl Service<Request<()>, Response = Response<Body>, Error = Infallible, Future: Send> + Clone
{
    service_fn(move |request: Request<()>| {
        let i: usize = request.headers()["x-i"].to_str().unwrap().parse().unwrap();
        let number = |name: &str| request.headers()[name].to_str().unwrap().parse::<u64>();
        let status = number("x-status").unwrap() as u16;
        let head = number("x-head").unwrap();
        let key = log.with(i, |r| r.key);
        let decisions = request.extensions().get::<Decisions>().cloned();
        // Under a usage layer, the units the request asks to report.
        if let Some(meter) = request.extensions().get::<UsageMeter>() {
            meter.set(number("x-usage").unwrap_or(0));
        }
        let handled = Handled {
            seq: log.next(),
            at: since(start),
            decisions,
        };
        log.with(i, |r| {
            r.handled = Some(handled);
            r.answered = Some(status);
        });
        let now = log.streaming[key].fetch_add(1, Ordering::SeqCst) + 1;
        log.most[key].fetch_max(now, Ordering::SeqCst);
        let guard = Streaming(Arc::clone(&log), key, i, start);
        let end = ends.lock().unwrap().remove(&i).unwrap();
        let log = Arc::clone(&log);
        async move {
            tokio::time::sleep(Duration::from_millis(head)).await;
            log.with(i, |r| r.answered_seq = Some(log.next()));
            let frames = futures::stream::once(async move {
                let _ = end.await;
                drop(guard);
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(b"done")))
            });
            let body: Body = BodyExt::boxed(StreamBody::new(frames.map(|f: Frame| f)));
            let mut response = Response::new(body);
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            Ok(response)
        }
    })
}

pub(super) fn policy(name: &str, algorithm: Algorithm, limits: &[(u64, u64)]) -> Policy {
    let limits = limits
        .iter()
        .map(|&(c, w)| Limit::new(c, Duration::from_secs(w)).unwrap());
    Policy::new(name, limits).unwrap().with_algorithm(algorithm)
}

/// The counts of the plan `pro`: the inner policy's, times the plan's percent, at least 1.
pub(super) fn plan_counts(config: &Config) -> Vec<(u64, u64)> {
    let pct = config.plan.unwrap_or(100);
    let scaled = config
        .limits
        .iter()
        .map(|&(c, w)| ((c * pct / 100).max(1), w));
    scaled.collect()
}

pub(super) fn plan_policy(config: &Config) -> Policy {
    policy("inner", config.algorithm, &plan_counts(config))
}

pub(super) fn inner_policy(config: &Config) -> Policy {
    let mut p = policy("inner", config.algorithm, &config.limits);
    if let Some(block) = config.block {
        p = p.block_for(Duration::from_secs(block)).unwrap();
    }
    if let Some(cap) = config.concurrency {
        p = p
            .concurrency(cap)
            .unwrap()
            .slot_expiry(Duration::from_secs(5))
            .unwrap();
    }
    p
}

pub(super) fn outer_policy(config: &Config) -> Option<Policy> {
    let (c, w) = config.outer?;
    Some(policy("outer", config.algorithm, &[(c, w)]))
}

/// The `RateLimit` field's members: (policy, remaining).
pub(super) fn fields(response: &Response<impl Sized>) -> Vec<(String, i64)> {
    let Some(value) = response.headers().get("ratelimit") else {
        return Vec::new();
    };
    let list: sfv::List = sfv::Parser::new(value.as_bytes()).parse().unwrap();
    list.iter()
        .filter_map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item.bare_item.as_string()?.as_str().to_owned();
                let r = item.params.iter().find(|(k, _)| k.as_str() == "r")?;
                Some((name, i64::from(r.1.as_integer()?)))
            }
            sfv::ListEntry::InnerList(_) => None,
        })
        .collect()
}

/// A `Store::check_at` call of the schedule, and what it answered.
#[derive(Debug, Clone)]
pub(super) struct AtCall {
    /// When it was decided ([`Log::next`]), and when on the run's clock.
    pub(super) seq: usize,
    pub(super) decided: Duration,
    pub(super) key: usize,
    /// The event time, since the UNIX epoch on the store's clock.
    pub(super) at: Duration,
    pub(super) cost: u64,
    /// What it answered: `None` for an error.
    pub(super) decision: Option<Decision>,
    /// A probe of a refusal's `retry_after`: a second earlier (`Some(false)`, refused
    /// expected) or at it (`Some(true)`, admitted expected).
    pub(super) probe: Option<bool>,
}

/// What a run left for the oracles.
pub(super) struct Run {
    /// The store's time (since the UNIX epoch) when the run's clock read zero: the times of
    /// the records are on the run's clock, the admissions' on the store's.
    pub(super) epoch: Duration,
    pub(super) records: Vec<Record>,
    /// (event, key) of each reset ([`Log::next`]).
    pub(super) resets: Vec<(usize, usize)>,
    /// (event, time) of each reset on Redis: the time it had been done by, on the store's
    /// clock. A unit recorded before it was counted in the state the reset dropped, though
    /// spent after (a lease's, or a decision under way): the documented bound of a reset is
    /// the limit plus those.
    pub(super) reset_done: Vec<(usize, Duration)>,
    /// (event, key, percent or none) of each override.
    pub(super) overrides: Vec<(usize, usize, Option<u64>)>,
    /// (event, key) of each move to a plan or back.
    pub(super) plans: Vec<(usize, usize)>,
    /// (from, to) of each outage.
    /// (from, to) of each outage, as events ([`Log::next`]).
    pub(super) outages: Vec<(usize, usize)>,
    /// (event) of each flood of other keys, which may evict the keys not pinned.
    pub(super) floods: Vec<usize>,
    pub(super) most: [usize; 2],
    /// After every request ended and the state aged out: slots in use and keys held.
    pub(super) slots_left: usize,
    pub(super) keys_left: u64,
    /// The sliding log's events held, at each look: (time, event, key, events).
    pub(super) log_sizes: Vec<(Duration, usize, usize, usize)>,
    /// What `Store::check_at` answered for a key of the inner policy (the memory property).
    pub(super) event_time: Result<(), StoreError>,
    /// The schedule's `check_at` calls on the keys the layers limit.
    pub(super) at_calls: Vec<AtCall>,
    /// The run's clock at events ([`Log::next`]) of resets, overrides and outages.
    pub(super) times: BTreeMap<usize, Duration>,
    /// How long a key's state takes to age out in this run (its windows, box, slots, usage
    /// charged and events booked ahead): nothing is held of a request or an event older.
    pub(super) quiet: Duration,
    /// The faults injected on Redis, on the run's clock: (from, to).
    pub(super) faults: Vec<(Duration, Duration)>,
}

pub(super) async fn run(config: &Config, ops: &[Op]) -> Result<Run, BuildError> {
    let start = Instant::now();
    let epoch = UNIX_EPOCH + Duration::from_secs(EPOCH);
    let mut builder = MemoryStore::builder().clock(tokio_clock_at(epoch));
    if let Some(max) = config.max_keys {
        builder = builder.max_keys(max);
    }
    let memory = builder.build();
    // The fallback store, on the same clock moved ahead, so that its decisions tell.
    let fallback = MemoryStore::builder()
        .clock(tokio_clock_at(epoch + FALLBACK_AHEAD))
        .build();
    // The memory store behind a switch that fails its decisions, for the failure modes; it
    // stays local (the layer decides in place, its deny cache off), and its settlements land.
    let store = FaultyStore::new(memory.clone());
    let inner = inner_policy(config);
    let flood = Policy::new("flood", ["100/1s".parse().unwrap()]).unwrap();
    let header = Header::new(HeaderName::from_static("x-key"));
    let mut layer = RateLimitLayer::builder()
        .key(header.clone())
        .store(store.clone())
        .decisions(config.decisions)
        .failure_mode(config.failure_mode(Some(&fallback)))
        .on_rejection(rejection);
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
    // A soft layer is one whose every rule is soft: the policy for every request a rule with
    // no method or path, after the others.
    let soft = |rule: Rule| match config.soft {
        true => rule.soft(),
        false => rule,
    };
    layer = match config.plan {
        Some(_) => layer
            .rule(soft(
                Rule::new(inner.clone()).plan("pro", plan_policy(config)),
            ))
            .plan(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok())),
        None if config.soft => layer,
        None => layer.policy(inner.clone()),
    };
    if config.count_when {
        layer = layer.count_when(|head| head.status == StatusCode::UNAUTHORIZED);
    }
    if config.max_wait > 0 {
        layer = layer.max_wait(Duration::from_millis(config.max_wait));
    }
    layer = match config.odd {
        Some(Odd::PlanWithoutFunction) => layer.rule(soft(
            Rule::new(inner.clone()).path("/plans").plan("pro", "10/1s"),
        )),
        Some(Odd::TwoPoliciesOneName) => {
            let other = config
                .limits
                .iter()
                .map(|&(c, w)| (c + 1, w))
                .collect::<Vec<_>>();
            let other = policy("inner", config.algorithm, &other);
            layer.rule(soft(Rule::new(other).path("/other")))
        }
        _ => layer,
    };
    if config.soft && config.plan.is_none() {
        layer = layer.rule(Rule::new(inner.clone()).soft());
    }
    let inner_layer = layer.build()?;
    // An event time, on a key of its own (aged out with the rest).
    let at = UNIX_EPOCH + Duration::from_secs(EPOCH);
    let event_time = memory
        .check_at(&Key::from("event-time"), &inner, 1, at)
        .await;
    let mut event_time = event_time.map(drop);
    let outer = outer_policy(config);
    let outer_layer = match &outer {
        Some(p) => Some(
            RateLimitLayer::builder()
                .key(header)
                .store(store.clone())
                .policy(p.clone())
                .decisions(config.decisions)
                .failure_mode(config.failure_mode(Some(&fallback)))
                .build()?,
        ),
        None => None,
    };
    let log = Arc::new(Log::default());
    let ends = Arc::new(Mutex::new(BTreeMap::new()));
    let handled = inner_layer.layer(handler(Arc::clone(&log), start, Arc::clone(&ends)));
    let probe_log = Arc::clone(&log);
    let passed = service_fn(move |request: Request<()>| {
        let i: usize = request.headers()["x-i"].to_str().unwrap().parse().unwrap();
        let decisions = request.extensions().get::<Decisions>().cloned();
        probe_log.with(i, |r| r.passed_outer = decisions);
        handled.clone().oneshot(request)
    });
    let passed = passed.map_response(|r| r.map(BodyExt::boxed));
    let service = match outer_layer {
        Some(outer) => {
            let outer = outer.layer(passed).map_response(|r| r.map(BodyExt::boxed));
            tower::util::BoxCloneService::new(outer)
        }
        None => tower::util::BoxCloneService::new(passed),
    };
    let mut tasks = Vec::new();
    let mut resets = Vec::new();
    let mut overrides = Vec::new();
    let mut outages = Vec::new();
    let mut floods = Vec::new();
    let mut log_sizes = Vec::new();
    let mut down_since = None;
    // The last event that may free a key or change its count: a probe of a refusal before it
    // tests nothing the promise says.
    let mut changed = 0;
    let on_plan = [AtomicBool::new(false), AtomicBool::new(false)];
    let mut plans = Vec::new();
    let mut at_calls = Vec::new();
    let mut times = BTreeMap::new();
    let send = |key: usize,
                status: u16,
                (head, hold): (u64, u64),
                drop_it: bool,
                probe,
                (cost, usage): (u64, u64)| {
        let i = log.open(key, since(start), probe);
        let pro = on_plan[key].load(Ordering::SeqCst);
        let cost = cost.clamp(1, config.cost);
        log.with(i, |r| {
            r.pro = pro;
            r.cost = cost;
            r.usage = usage;
            r.dropped = drop_it;
        });
        let (end, ended) = tokio::sync::oneshot::channel();
        ends.lock().unwrap().insert(i, ended);
        let request = Request::builder()
            .header("x-key", KEYS[key])
            .header("x-plan", if pro { "pro" } else { "none" })
            .header("x-i", i.to_string())
            .header("x-status", status.to_string())
            .header("x-head", head.to_string())
            .header("x-cost", cost.to_string())
            .header("x-usage", usage.to_string())
            .body(())
            .unwrap();
        let (service, log) = (service.clone(), Arc::clone(&log));
        tokio::spawn(async move {
            let response = service.oneshot(request).await.unwrap();
            let retry = response.headers().get("retry-after");
            let retry = retry.map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
            let members = fields(&response);
            let refusal = response
                .headers()
                .get("x-refusal")
                .map(|v| v.as_bytes().to_vec());
            log.with(i, |r| {
                r.status = Some(response.status());
                r.responded = Some(since(start));
                r.retry_after = retry;
                r.fields = members;
                r.inner_refusal = refusal.as_ref().map(|v| v.as_slice() == b"slot");
                r.boxed = refusal.as_deref() == Some(b"box");
            });
            tokio::time::sleep(Duration::from_millis(hold)).await;
            match drop_it {
                true => drop(response),
                false => {
                    let _ = end.send(());
                    let _ = response.into_body().collect().await;
                }
            }
            log.with(i, |r| r.ended = Some(since(start)));
        })
    };
    for op in ops {
        match *op {
            Op::Send {
                key,
                status,
                head,
                hold,
                drop,
                cost,
                usage,
            } => tasks.push(send(key, status, (head, hold), drop, None, (cost, usage))),
            Op::At { key, offset, cost } => {
                let now = epoch + since(start);
                let ms = offset.ms(config);
                let at = match ms >= 0 {
                    true => now + Duration::from_millis(ms as u64),
                    false => now - Duration::from_millis(ms.unsigned_abs()),
                };
                let booking = Booking {
                    key,
                    at,
                    cost: cost.clamp(1, config.cost),
                    now,
                };
                let stamp = || (log.next(), since(start));
                match book(&store, &inner, config, booking, stamp, &mut at_calls).await {
                    Booked::Changed => changed = log.next(),
                    Booked::Same => {}
                    Booked::Unexpected(outcome) => event_time = outcome,
                }
            }
            Op::Pass(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            Op::Reset(key) => {
                let k = Key::from(KEYS[key]);
                memory.reset(&k, &inner).await.unwrap();
                if let Some(outer) = &outer {
                    memory.reset(&k, outer).await.unwrap();
                }
                let seq = log.next();
                resets.push((seq, key));
                times.insert(seq, since(start));
                changed = log.next();
            }
            Op::Plan(key, pro) => {
                on_plan[key].store(pro, Ordering::SeqCst);
                plans.push((log.next(), key));
                changed = log.next();
            }
            Op::Override(key, pct) => {
                let scope = Scope::Key(Key::from(KEYS[key]));
                let overrides_of = memory.overrides();
                match pct {
                    Some(0) => overrides_of
                        .set(&inner, &scope, &Override::Block)
                        .await
                        .unwrap(),
                    Some(pct) => {
                        let counts = config.limits.iter().map(|&(c, w)| {
                            let c = (c * pct / 100).max(1);
                            Limit::new(c, Duration::from_secs(w)).unwrap()
                        });
                        let to = Override::Limits(counts.collect());
                        overrides_of.set(&inner, &scope, &to).await.unwrap();
                    }
                    None => drop(overrides_of.remove(&inner, &scope).await.unwrap()),
                }
                let seq = log.next();
                overrides.push((seq, key, pct));
                times.insert(seq, since(start));
                changed = log.next();
            }
            Op::Outage(on) => {
                store.fail(on);
                // Failing over to the fallback, a key this instance saw refused stays refused
                // until its `Retry-After`: a probe of it still tests a promise.
                let kept = config.fallback && on;
                let seq = log.next();
                times.insert(seq, since(start));
                if !kept {
                    changed = seq;
                }
                match (on, down_since) {
                    (true, None) => down_since = Some(seq),
                    (false, Some(from)) => {
                        outages.push((from, seq));
                        down_since = None;
                    }
                    _ => {}
                }
            }
            Op::Flood(n) => {
                for other in 0..n {
                    let k = Key::from(format!("flood-{other}").as_str());
                    let _ = memory.check(&k, &flood, 1).await;
                }
                floods.push(log.next());
                // A key in its penalty box is kept whatever the flood (it is refused until
                // its `Retry-After`); another key may be evicted, and start afresh.
                if config.block.is_none() && config.max_keys.is_some() {
                    changed = log.next();
                }
            }
            Op::Retry(key) => {
                // The last answer of this key, if it is a refusal nothing has touched since.
                let last = {
                    let records = log.records.lock().unwrap();
                    records.iter().rev().find(|r| r.key == key).cloned()
                };
                // Once a flood has filled a bounded store, any new key may evict this one (not
                // pinned without a box), which then starts afresh, a documented bound.
                let evictable = config.max_keys.is_some() && !floods.is_empty();
                let evictable = evictable && config.block.is_none();
                let reachable = !store.is_failing() || config.fallback;
                let fresh = |l: &Record| l.seq > changed && reachable && !evictable;
                let Some(last) = last.filter(fresh) else {
                    continue;
                };
                let (Some(StatusCode::TOO_MANY_REQUESTS), Some(retry)) =
                    (last.status, last.retry_after)
                else {
                    continue;
                };
                let at = last.sent + Duration::from_secs(retry);
                let early = at.saturating_sub(Duration::from_secs(1));
                if early > since(start) && retry >= 2 {
                    tokio::time::sleep(early - since(start)).await;
                    let units = (last.cost, last.usage);
                    tasks.push(send(key, 200, (0, 0), false, Some(false), units));
                    settle().await;
                }
                if at > since(start) {
                    tokio::time::sleep(at - since(start)).await;
                }
                let units = (last.cost, last.usage);
                tasks.push(send(key, 200, (0, 0), false, Some(true), units));
            }
        }
        settle().await;
        if config.algorithm == Algorithm::SlidingLog {
            for (k, name) in KEYS.iter().enumerate() {
                let held = events(&memory, &Key::from(*name), &inner);
                log_sizes.push((since(start), log.next(), k, held));
            }
        }
    }
    if let Some(from) = down_since {
        outages.push((from, log.next()));
    }
    store.fail(false);
    // Every body ends (the longest hold is 4 s, a wait 3 s), then everything ages out.
    tokio::time::sleep(Duration::from_secs(10)).await;
    for task in tasks {
        task.await.unwrap();
    }
    let slots_left = KEYS
        .iter()
        .map(|k| slots_in_use(&memory, &Key::from(*k), &inner))
        .sum();
    // Then the state ages out: the longest window (twice that for the sliding window
    // counter and the sliding log), GCRA's stretched by the largest raise, or the box; a second's margin.
    let windows = config.limits.iter().chain(&config.outer).map(|l| l.1);
    let longest = windows.max().unwrap();
    let raise = overrides
        .iter()
        .filter_map(|o| o.2)
        .max()
        .unwrap_or(100)
        .max(100);
    // A cut to `p` % makes a GCRA backlog weigh `count / max(1, count · p / 100)` times more,
    // and a refusal under it keeps the key until it drains at that weight.
    let cut = overrides
        .iter()
        .filter_map(|o| o.2.filter(|&p| p > 0 && p < 100))
        .flat_map(|p| {
            config
                .limits
                .iter()
                .map(move |&(c, _)| c.div_ceil((c * p / 100).max(1)))
        })
        .max()
        .unwrap_or(1);
    // A plan's counts and the policy's weigh a GCRA backlog differently, as a cut does.
    let plan = config.plan.map_or(1, |pct| {
        let counts = config.limits.iter().zip(plan_counts(config));
        let ratio = |(&(c, _), (p, _)): (&(u64, u64), (u64, u64))| c.max(p).div_ceil(c.min(p));
        counts.map(ratio).max().unwrap_or(1).max(pct.div_ceil(100))
    });
    let cut = cut * plan;
    let kept = match config.algorithm {
        Algorithm::SlidingWindow | Algorithm::SlidingLog => 2 * longest,
        Algorithm::Gcra => (longest * raise).div_ceil(100) * cut,
        _ => longest,
    };
    let block = config.block.unwrap_or(0);
    let slots = config.concurrency.map_or(0, |_| 5);
    // Charges recorded past the count (outcomes counted over a soft limit) overfill a GCRA
    // bucket, which then lives until it drains: a window per count of them.
    let records = log.records.lock().unwrap().clone();
    let over = |r: &&Record| {
        let decisions = r.handled.as_ref().and_then(|h| h.decisions.as_ref());
        let passed_over = decisions
            .and_then(|d| d.get("inner"))
            .is_some_and(|d| !d.is_allowed());
        passed_over && config.count_when && r.answered == Some(401)
    };
    let charged: u64 = records.iter().filter(over).map(|r| r.cost.max(1)).sum();
    let smallest = config.limits.iter().map(|l| l.0).min().unwrap_or(1).max(1);
    let drained = match config.algorithm {
        Algorithm::Gcra => (charged * longest).div_ceil(smallest) * cut,
        _ => 0,
    };
    // Usage charged past the count: a window per count of it (GCRA drains it so).
    let used: u64 = match config.usage {
        true => records.iter().map(|r| r.usage.max(r.cost)).sum(),
        false => 0,
    };
    let used = (used * longest).div_ceil(smallest) * cut;
    // Events booked ahead live a window past their time.
    let ahead = at_calls
        .iter()
        .filter(|c| c.decision.is_some_and(|d| d.is_allowed()))
        .map(|c| {
            c.at.saturating_sub(Duration::from_secs(EPOCH) + since(start))
        })
        .max()
        .unwrap_or_default();
    let kept = kept + drained + used + ahead.as_secs() + 1;
    let quiet = Duration::from_secs(kept.max(block).max(slots) + 1);
    tokio::time::sleep(quiet).await;
    let most = [0, 1].map(|k| log.most[k].load(Ordering::SeqCst));
    Ok(Run {
        epoch: Duration::from_secs(EPOCH),
        records,
        resets,
        reset_done: Vec::new(),
        overrides,
        plans,
        outages,
        floods,
        most,
        slots_left,
        keys_left: key_count(&memory),
        log_sizes,
        event_time,
        at_calls,
        times,
        quiet,
        faults: Vec::new(),
    })
}

/// A `Store::check_at` of the schedule: the key, the event time, the cost.
pub(super) struct Booking {
    pub(super) key: usize,
    pub(super) at: SystemTime,
    pub(super) cost: u64,
    /// Now, on the store's clock: a past time may be refused with a typed error.
    pub(super) now: SystemTime,
}

/// What a booking did to its key.
pub(super) enum Booked {
    /// An event was admitted: what the key holds changed.
    Changed,
    Same,
    /// `check_at` answered other than the configuration says (an algorithm that does not take
    /// event times took one, or the sliding log refused them as unsupported): what it answered.
    Unexpected(Result<(), StoreError>),
}

/// Books `booking` on the inner policy (through the switch of outages), recording each call
/// in `calls` at the event and time `stamp` gives; a refusal's `retry_after` is then probed:
/// the event moved by it is admitted, and not a second earlier (nothing else changes in
/// between: the clock stands still).
pub(super) async fn book(
    store: &FaultyStore<MemoryStore>,
    inner: &Policy,
    config: &Config,
    booking: Booking,
    stamp: impl Fn() -> (usize, Duration),
    calls: &mut Vec<AtCall>,
) -> Booked {
    let Booking { key, at, cost, now } = booking;
    let k = Key::from(KEYS[key]);
    let mut call = |at: SystemTime, decision: Option<Decision>, probe| {
        let (seq, decided) = stamp();
        let at = at.duration_since(UNIX_EPOCH).unwrap();
        calls.push(AtCall {
            seq,
            decided,
            key,
            at,
            cost,
            decision,
            probe,
        });
    };
    let taken = event_times_taken(config);
    let outcome = match store.check_at(&k, inner, cost as u32, at).await {
        Err(StoreError::Unsupported(_)) if !taken => return Booked::Same,
        Err(_) if store.is_failing() => return Booked::Same,
        // A past time older than a bound the store documents may be refused so.
        Err(StoreError::Unsupported(_) | StoreError::EventTooOld) if at < now => None,
        Err(StoreError::Unsupported(why)) => {
            return Booked::Unexpected(Err(StoreError::Unsupported(why)))
        }
        Ok(_) if !taken => return Booked::Unexpected(Ok(())),
        outcome => outcome.ok(),
    };
    call(at, outcome, None);
    let admitted = |d: &Decision| d.is_allowed();
    let mut booked = match outcome.as_ref().is_some_and(admitted) {
        true => Booked::Changed,
        false => Booked::Same,
    };
    let Some(retry) = outcome
        .filter(|d| dims().event_retry && !d.is_allowed() && !d.in_penalty_box())
        .and_then(|d| d.retry_after())
    else {
        return booked;
    };
    if retry > Duration::from_secs(1) {
        let early = at + retry - Duration::from_secs(1);
        let early_outcome = store.check_at(&k, inner, cost as u32, early).await.ok();
        call(early, early_outcome, Some(false));
        if early_outcome.as_ref().is_some_and(admitted) {
            return Booked::Changed;
        }
    }
    let moved = store
        .check_at(&k, inner, cost as u32, at + retry)
        .await
        .ok();
    if moved.as_ref().is_some_and(admitted) {
        booked = Booked::Changed;
    }
    call(at + retry, moved, Some(true));
    booked
}

/// The inner layer's rejection: a 429 that says what refused (`x-refusal`: `slot`, `box` or
/// `limit`), for the oracles; the layer adds its fields.
pub(super) fn rejection(decision: &Decision) -> Response<Bytes> {
    let what = match (decision.is_concurrency_limit(), decision.in_penalty_box()) {
        (true, _) => "slot",
        (_, true) => "box",
        _ => "limit",
    };
    let mut response = Response::new(Bytes::from_static(b"refused"));
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let what = http::HeaderValue::from_static(what);
    response.headers_mut().insert("x-refusal", what);
    response
}

/// Lets every task spawned run until it waits on time: a sleep of zero on the paused clock
/// returns once every task ready to run has run.
pub(super) async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}
