//! The outbound layer in the conditions of a deployment: each instance with a store of its
//! own, Redis behind a proxy that delays what it forwards (`support::delay`), a runtime clock
//! that runs slow, and a stand-in for the upstream that counts arrivals over a true sliding
//! second (`fleet::stand_in_of`).

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_redis_ratelimit::client::{Outbound, OutboundError, OutboundLayer, OutboundLayerBuilder};
use tower_redis_ratelimit::key::Global;
use tower_redis_ratelimit::{Algorithm, Policy, RedisStore};

use crate::fleet::{fullest, stand_in_of, Http};
use crate::support::delay::Delay;
use crate::support::RedisServer;

/// `count` per second, on the sliding log.
fn per_second(count: u32) -> Policy {
    Policy::new("api", [format!("{count}/1s").parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
}

/// A worker's client: a hyper client behind an outbound layer of `policy` with a store of its
/// own at `url`, configured further by `tune`.
async fn worker(
    url: &str,
    policy: Policy,
    tune: impl FnOnce(
        OutboundLayerBuilder<Global, RedisStore>,
    ) -> OutboundLayerBuilder<Global, RedisStore>,
) -> Outbound<Http, Global, RedisStore> {
    let store = RedisStore::connect(url).await.unwrap();
    let builder = OutboundLayer::builder()
        .policy(policy)
        .store(store)
        .max_wait(Duration::from_secs(30));
    let layer = tune(builder).build().unwrap();
    let http = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    ServiceBuilder::new().layer(layer).service(http)
}

use bytes::Bytes;

/// How a call ended.
#[derive(Debug, Default)]
struct Tally {
    served: usize,
    refused: usize,
    too_late: usize,
    failed: usize,
}

/// Sends `calls` calls at once through each client, and tallies them; how long the last took.
async fn send_all(
    clients: &[Outbound<Http, Global, RedisStore>],
    calls: usize,
    addr: SocketAddr,
) -> (Tally, Duration) {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for client in clients {
        for _ in 0..calls {
            let mut client = client.clone();
            tasks.push(tokio::spawn(async move {
                let request = http::Request::get(format!("http://{addr}/"))
                    .body(Empty::new())
                    .unwrap();
                let answer = client.ready().await.unwrap().call(request).await;
                (answer.map(|r| r.status()), Instant::now())
            }));
        }
    }
    let mut tally = Tally::default();
    let mut last = start;
    for task in tasks {
        let (answer, at) = task.await.unwrap();
        last = last.max(at);
        match answer {
            Ok(StatusCode::OK) => tally.served += 1,
            Ok(_) => tally.refused += 1,
            Err(OutboundError::TooLate { .. }) => tally.too_late += 1,
            Err(error) => {
                eprintln!("a call failed: {error}");
                tally.failed += 1;
            }
        }
    }
    (tally, last - start)
}

/// One of two instances hears Redis's replies 25 ms late (half the default margin): its calls
/// still leave within the margin of their turns, so the upstream refuses none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_25ms_late_for_one_of_two_instances_keep_the_window() {
    let server = RedisServer::start();
    let delay = Delay::start(server.port(), Duration::ZERO, Duration::from_millis(25)).await;
    let (addr, arrivals) = stand_in_of(20, None).await;
    let near = worker(&server.url(), per_second(20), |b| b).await;
    let far = worker(&delay.url(), per_second(20), |b| b).await;
    let (tally, took) = send_all(&[near, far], 30, addr).await;
    let arrivals = arrivals.lock().unwrap().clone();
    let fullest = fullest(&arrivals);
    eprintln!("{tally:?} in {took:?}; the fullest second held {fullest}");
    assert_eq!(tally.refused, 0, "the stand-in refused calls: {tally:?}");
    assert_eq!(tally.served, 60, "{tally:?}");
    assert!(fullest <= 20, "{fullest} in one second");
}

/// Redis `round_trip` away (half each way), one instance, 40 calls at `10/1s`: all served,
/// none refused, none `TooLate`, and the arrivals spread over at most `within` times the
/// ideal 3 s (four windows' worth; the layer widens its margin for the round trip, and every
/// window is that much longer).
async fn far_redis_serves_every_call_at_the_full_rate(round_trip: Duration, within: f64) {
    let server = RedisServer::start();
    let delay = Delay::start(server.port(), round_trip / 2, round_trip / 2).await;
    let (addr, arrivals) = stand_in_of(10, None).await;
    let client = worker(&delay.url(), per_second(10), |b| b).await;
    let (tally, took) = send_all(&[client], 40, addr).await;
    let arrivals = arrivals.lock().unwrap().clone();
    let fullest = fullest(&arrivals);
    let first = arrivals.iter().map(|a| a.0).min().unwrap();
    let last = arrivals.iter().map(|a| a.0).max().unwrap();
    eprintln!(
        "round trip {round_trip:?}: {tally:?}, the last answered {took:?} after the start, \
         arrivals over {:?} (ideal 3 s); the fullest second held {fullest}",
        last - first
    );
    assert_eq!(tally.served, 40, "{tally:?}");
    assert!(fullest <= 10, "{fullest} in one second");
    assert!(
        last - first <= Duration::from_secs(3).mul_f64(within),
        "{:?}",
        last - first
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_40ms_away_serves_every_call_at_the_full_rate() {
    // Measured alone 3.15 to 3.47 s (within 15 %); the bound leaves room for a loaded CI
    // machine (4.39 s once with the whole binary running at once), and still fails the
    // client that looked after its turn (4.24 s).
    far_redis_serves_every_call_at_the_full_rate(Duration::from_millis(40), 1.3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_60ms_away_serves_every_call_at_the_full_rate() {
    // Measured alone 3.41 to 3.48 s (14 to 16 % over): the margin covers about two round
    // trips, and every window is that much longer.
    far_redis_serves_every_call_at_the_full_rate(Duration::from_millis(60), 1.3).await;
}

/// A round trip longer than the widest margin allows fails at once, naming it, rather than
/// reserving turns in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_trip_past_max_margin_fails_naming_it() {
    let server = RedisServer::start();
    let delay = Delay::start(
        server.port(),
        Duration::from_millis(50),
        Duration::from_millis(50),
    )
    .await;
    let (addr, _) = stand_in_of(10, None).await;
    let tune =
        |b: OutboundLayerBuilder<Global, RedisStore>| b.max_margin(Duration::from_millis(60));
    let client = worker(&delay.url(), per_second(10), tune).await;
    let start = Instant::now();
    let (tally, _) = send_all(&[client], 3, addr).await;
    eprintln!("{tally:?} after {:?}", start.elapsed());
    assert_eq!(tally.failed, 3, "{tally:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// One of two instances runs on a clock at half speed. The normal one fills the first second
/// (20 calls), the slow one takes half of the next (10), the normal one the rest and the third
/// second (30): a slow call that went at its turn as its own clock says would reach the
/// stand-in a second late, into the full third second. The rate between its clock and
/// Redis's is learned from its calls' answers (and any call that cannot know it is in time
/// reserves again): none is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_at_half_speed_keeps_the_window() {
    let server = RedisServer::start();
    let (addr, arrivals) = stand_in_of(20, None).await;
    let normal = worker(&server.url(), per_second(20), |b| b).await;
    let slow = worker(&server.url(), per_second(20), |b| b.clock_rate(0.5)).await;
    let first = tokio::spawn({
        let normal = normal.clone();
        async move { send_all(&[normal], 20, addr).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let slow_calls = tokio::spawn(async move { send_all(&[slow], 10, addr).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (third, took) = send_all(&[normal], 30, addr).await;
    let (first, _) = first.await.unwrap();
    let (slow, _) = slow_calls.await.unwrap();
    let arrivals = arrivals.lock().unwrap().clone();
    let fullest = fullest(&arrivals);
    eprintln!(
        "normal {first:?} then {third:?}, slow {slow:?}; {took:?}; the fullest second held \
         {fullest}"
    );
    for tally in [&first, &slow, &third] {
        assert_eq!(tally.refused, 0, "the stand-in refused calls: {tally:?}");
        assert_eq!(tally.failed + tally.too_late, 0, "{tally:?}");
    }
    assert!(fullest <= 20, "{fullest} in one second");
}

/// 200 calls waiting at once on one key (100 per second, 20 at once: 1.8 s) cost at most 4 `EVALSHA` each: their reservation,
/// their look at the turn, and their share of one looker's looks (not a look each per
/// `recheck`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_waiters_cost_at_most_four_evalsha_per_call() {
    let server = RedisServer::start();
    let client = server.client().await;
    let policy = Policy::new("api", ["20/200ms".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let layer = OutboundLayer::builder()
        .policy(policy)
        .store(server.store().await)
        .max_wait(Duration::from_secs(30))
        .build()
        .unwrap();
    let turns = layer.turns();
    let before = crate::support::evalsha_calls(&client).await;
    let start = Instant::now();
    let waiters: Vec<_> = (0..200)
        .map(|_| {
            let wait = turns.wait(tower_redis_ratelimit::Key::from("api"), 1);
            tokio::spawn(async move { wait.await.map(|turn| turn.go()).is_ok() })
        })
        .collect();
    let mut served = 0;
    for waiter in waiters {
        served += usize::from(waiter.await.unwrap());
    }
    let took = start.elapsed();
    let calls = crate::support::evalsha_calls(&client).await - before - 1;
    let per_call = calls as f64 / 200.0;
    eprintln!("{served} of 200 served in {took:?}: {calls} EVALSHA, {per_call:.2} per call");
    assert_eq!(served, 200);
    assert!(per_call <= 4.0, "{per_call} EVALSHA per call");
}

/// When each worker finished (it answers the time it took), the run's length (the last), and
/// the spread between the first and the last.
async fn finish_times(
    workers: Vec<tokio::task::JoinHandle<Duration>>,
) -> (Vec<Duration>, Duration, Duration) {
    let mut finished = Vec::new();
    for worker in workers {
        finished.push(worker.await.unwrap());
    }
    let run = *finished.iter().max().unwrap();
    let spread = run - *finished.iter().min().unwrap();
    (finished, run, spread)
}

/// Four workers, each with a store of its own, start together with `calls` calls each, one
/// after the other, at `count/1s` on `algorithm`: they finish within 10 % of the run's length
/// of each other. On GCRA a fifth client first spends the burst (`count` turns at once, its
/// stand-in allowing twice the count in a second), so that the workers start in its paced
/// turns, `1/count` s apart in reservation order, and their last calls are at least three of
/// those apart. (A race for the burst itself goes to whoever is back first, and on a loaded
/// machine one way: 13, 12, 7 and 6 of it, last calls 0.75 s apart in 7.06 s; docs/outbound.md,
/// "Turns at one instant".) Prints when each worker's calls arrived, per second, and the run's
/// length.
async fn four_workers_finish_together(algorithm: Algorithm, count: usize, calls: usize) {
    let server = RedisServer::start();
    let most = match algorithm {
        Algorithm::Gcra => 2 * count,
        _ => count,
    };
    let (addr, arrivals) = stand_in_of(most, None).await;
    let policy = Policy::new("api", [format!("{count}/1s").parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm);
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(worker(&server.url(), policy.clone(), |b| b).await);
    }
    if algorithm == Algorithm::Gcra {
        let primer = worker(&server.url(), policy.clone(), |b| b).await;
        for _ in 0..count + 2 {
            crate::fleet::numbered(primer.clone(), addr, 4).await;
        }
    }
    let start = Instant::now();
    let workers: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(n, mut client)| {
            tokio::spawn(async move {
                for _ in 0..calls {
                    let request = http::Request::get(format!("http://{addr}/?n={n}"))
                        .body(Empty::new())
                        .unwrap();
                    let answer = client.ready().await.unwrap().call(request).await;
                    assert_eq!(answer.unwrap().status(), StatusCode::OK);
                }
                start.elapsed()
            })
        })
        .collect();
    let (finished, run, spread) = finish_times(workers).await;
    let arrivals = arrivals.lock().unwrap().clone();
    for n in 0..4 {
        let mut per_second = vec![0; run.as_secs() as usize + 1];
        for &(t, _, _) in arrivals.iter().filter(|a| a.2 == n) {
            per_second[(t - start).as_secs() as usize] += 1;
        }
        eprintln!("worker {n}: {per_second:?} per second");
    }
    let fullest = fullest(&arrivals);
    eprintln!(
        "{algorithm:?} {count}/1s, 4 × {calls}: finished at {finished:?}; spread {spread:?} of \
         {run:?}; fullest second {fullest}"
    );
    assert!(fullest <= most, "{fullest} in one second");
    assert!(spread <= run / 10, "finished at {finished:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_finish_together_on_the_log() {
    four_workers_finish_together(Algorithm::SlidingLog, 20, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_finish_together_on_gcra() {
    four_workers_finish_together(Algorithm::Gcra, 20, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_finish_together_at_ten_per_second_on_gcra() {
    four_workers_finish_together(Algorithm::Gcra, 10, 20).await;
}

/// 4 × 13 calls at `10/1s` on the log: the last round of four turns falls on both sides of a
/// window's start (turns 49 and 50 in the fifth window's burst, 51 and 52 in the sixth), so
/// two workers finish a whole window after the other two: 4.2 s against 5.25 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the log's bursts: two workers finish a window after the others (docs/outbound.md, \
            \"Turns at one instant\")"]
async fn four_workers_whose_last_turns_straddle_a_window_finish_together_on_the_log() {
    four_workers_finish_together(Algorithm::SlidingLog, 10, 13).await;
}

/// Four layers (four instances) sharing one memory store, on tokio's paused clock, start
/// together with `calls` turns each at `count/1s` on `algorithm`, one after the other (each
/// turn's work takes 5 ms): they finish within 10 % of the run's length of each other.
async fn four_layers_finish_together(algorithm: Algorithm, count: usize, calls: usize) {
    let store = tower_redis_ratelimit::MemoryStore::new();
    let policy = Policy::new("api", [format!("{count}/1s").parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm);
    let start = Instant::now();
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let layer = OutboundLayer::builder()
                .policy(policy.clone())
                .store(store.clone())
                .max_wait(Duration::from_secs(60))
                .build()
                .unwrap();
            let turns = layer.turns();
            tokio::spawn(async move {
                for _ in 0..calls {
                    let key = tower_redis_ratelimit::Key::from("api");
                    turns.wait(key, 1).await.unwrap().go();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                start.elapsed()
            })
        })
        .collect();
    let (finished, run, spread) = finish_times(workers).await;
    eprintln!(
        "memory store, {algorithm:?} {count}/1s, 4 × {calls}: finished at {finished:?}; \
         spread {spread:?} of {run:?}"
    );
    assert!(spread <= run / 10, "finished at {finished:?}");
}

#[tokio::test(start_paused = true)]
async fn four_layers_on_one_memory_store_finish_together_on_the_log() {
    four_layers_finish_together(Algorithm::SlidingLog, 10, 15).await;
}

#[tokio::test(start_paused = true)]
async fn four_layers_on_one_memory_store_finish_together_on_gcra() {
    four_layers_finish_together(Algorithm::Gcra, 10, 13).await;
}

/// As on Redis: 4 × 13 turns at `10/1s` on the log finish a window apart (4.215 s against
/// 5.255 s).
#[tokio::test(start_paused = true)]
#[ignore = "the log's bursts: two workers finish a window after the others (docs/outbound.md, \
            \"Turns at one instant\")"]
async fn four_layers_whose_last_turns_straddle_a_window_finish_together_on_the_log() {
    four_layers_finish_together(Algorithm::SlidingLog, 10, 13).await;
}

/// Load, scaled to a debug build (a tenth of 20 000 calls over 10 000 keys within 3 s):
/// 2 000 calls over 1 000 keys at `1/1s` each, handed to one layer within 3 s. Every call is
/// served, or fails with `TooLate` for a turn truly past `max_wait`; none fails with the
/// store's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_calls_over_a_thousand_keys_wait_rather_than_fail() {
    const KEYS: usize = 1_000;
    const CALLS: usize = 2_000;
    let server = RedisServer::start();
    let max_wait = Duration::from_secs(10);
    let layer = OutboundLayer::builder()
        .policy(per_second(1))
        .store(server.store().await)
        .max_wait(max_wait)
        .build()
        .unwrap();
    let turns = layer.turns();
    let start = Instant::now();
    let mut calls = Vec::with_capacity(CALLS);
    for i in 0..CALLS {
        // Both calls of a key come together: the second waits a second for its turn.
        let key = tower_redis_ratelimit::Key::from(format!("load-{}", i / (CALLS / KEYS)));
        let wait = turns.wait(key, 1);
        calls.push(tokio::spawn(async move {
            match wait.await {
                Ok(turn) => {
                    turn.go();
                    Ok(())
                }
                Err(error) => Err(error),
            }
        }));
        if i % 200 == 199 {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let sent = start.elapsed();
    let (mut served, mut late, mut failed) = (0, 0, Vec::new());
    for call in calls {
        match call.await.unwrap() {
            Ok(()) => served += 1,
            Err(OutboundError::TooLate { turn }) => {
                assert!(turn.is_none_or(|t| t > max_wait), "TooLate at {turn:?}");
                late += 1;
            }
            Err(error) => failed.push(error.to_string()),
        }
    }
    eprintln!(
        "{CALLS} calls over {KEYS} keys handed over within {sent:?}: {served} served, {late} \
         too late, {} failed ({:?}), all done after {:?}",
        failed.len(),
        failed.first(),
        start.elapsed()
    );
    assert!(sent <= Duration::from_secs(3));
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(served + late, CALLS);
}

/// Departures: when each turn was used (`Turn::go`), by which instance.
type Departures = std::sync::Arc<std::sync::Mutex<Vec<(Instant, &'static str)>>>;

/// `calls` turns of `turns` at once, each recording its departure under `who`.
fn depart(
    turns: &tower_redis_ratelimit::client::Turns<RedisStore>,
    calls: usize,
    who: &'static str,
    gone: &Departures,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..calls)
        .map(|_| {
            let (wait, gone) = (turns.wait("k".into(), 1), gone.clone());
            tokio::spawn(async move {
                wait.await.unwrap().go();
                gone.lock().unwrap().push((Instant::now(), who));
            })
        })
        .collect()
}

/// How many of `departures` an upstream running GCRA at `count` per `window` (virtual
/// scheduling, 200 µs of slack) refuses.
fn refused_by_gcra(departures: &[(Instant, &'static str)], count: u32, window: Duration) -> usize {
    let mut sorted: Vec<Instant> = departures.iter().map(|d| d.0).collect();
    sorted.sort();
    let emission = window / count;
    let (mut tat, mut refused) = (None::<Instant>, 0);
    for at in sorted {
        let next = tat.map_or(at, |tat| tat.max(at)) + emission;
        if next - at > window + Duration::from_micros(200) {
            refused += 1;
        } else {
            tat = Some(next);
        }
    }
    refused
}

/// Two instances whose margins differ share `10/1s` on `algorithm`: a far one, whose
/// Redis replies come 100 ms late (its margin widened to cover the round trip: its calls go
/// up to that late after their turns), takes 10 turns, and half a second later a near one (the
/// default 50 ms margin) takes 10 more. Every reservation reads the key's windows as late as
/// the far one's units may be used, so the near one's turns wait for them. The departures,
/// and how many units the fullest true second held.
async fn instances_with_different_margins(
    algorithm: Algorithm,
) -> (Vec<(Instant, &'static str)>, usize) {
    let server = RedisServer::start();
    let delay = Delay::start(server.port(), Duration::ZERO, Duration::from_millis(100)).await;
    let policy = Policy::new("api", ["10/1s".parse().unwrap()])
        .unwrap()
        .with_algorithm(algorithm);
    let turns = |url: String| {
        let policy = policy.clone();
        async move {
            let store = RedisStore::connect(&url).await.unwrap();
            let layer: OutboundLayer<Global, RedisStore> = OutboundLayer::builder()
                .policy(policy)
                .store(store)
                .max_wait(Duration::from_secs(30))
                .build()
                .unwrap();
            layer.turns()
        }
    };
    let far = turns(delay.url()).await;
    let near = turns(server.url()).await;
    let gone: Departures = Default::default();
    let start = Instant::now();
    let mut all = depart(&far, 10, "far", &gone);
    tokio::time::sleep_until(start + Duration::from_millis(500)).await;
    all.extend(depart(&near, 10, "near", &gone));
    for task in all {
        task.await.unwrap();
    }
    let gone = gone.lock().unwrap().clone();
    let fullest = gone
        .iter()
        .map(|&(t, _)| {
            gone.iter()
                .filter(|&&(s, _)| s <= t && s + Duration::from_secs(1) > t)
                .count()
        })
        .max()
        .unwrap_or(0);
    let when = |who: &str| -> Vec<Duration> {
        let mut at: Vec<_> = gone
            .iter()
            .filter(|g| g.1 == who)
            .map(|g| g.0 - start)
            .collect();
        at.sort();
        vec![at[0], at[at.len() - 1]]
    };
    eprintln!(
        "{algorithm:?}: far went {:?}, near {:?}; the fullest second held {fullest}",
        when("far"),
        when("near")
    );
    (gone, fullest)
}

/// On the log: no true second holds more than 10 of the 20 departures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_with_different_margins_keep_the_window_on_the_log() {
    let (_, fullest) = instances_with_different_margins(Algorithm::SlidingLog).await;
    assert!(fullest <= 10, "{fullest} in one second");
}

/// On GCRA: an upstream that runs GCRA at `10/1s` refuses none of the 20 departures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_with_different_margins_keep_an_upstream_gcra_on_gcra() {
    let (gone, _) = instances_with_different_margins(Algorithm::Gcra).await;
    let refused = refused_by_gcra(&gone, 10, Duration::from_secs(1));
    eprintln!("an upstream GCRA at 10/1s refuses {refused}");
    assert_eq!(refused, 0);
}
