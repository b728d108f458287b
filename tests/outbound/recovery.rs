//! Outbound calls where the store misbehaves for a while or the clock runs slow: departures
//! recorded at `Turn::go` and counted over a true sliding window (a stand-in with no network
//! delay). A stall, a restart or a fresh instance on a slow clock must neither send calls
//! late nor keep failing calls once the store answers again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_redis_ratelimit::client::{OutboundError, OutboundLayer, Turns};
use tower_redis_ratelimit::key::Global;
use tower_redis_ratelimit::{Algorithm, Key, Policy, RedisStore};

use crate::support::delay::Delay;
use crate::support::RedisServer;

type Gone = Arc<Mutex<Vec<(Instant, u32, &'static str)>>>;

fn policy(limits: &[&str], algorithm: Algorithm) -> Policy {
    Policy::new("api", limits.iter().map(|l| l.parse().unwrap()))
        .unwrap()
        .with_algorithm(algorithm)
}

async fn turns_at(url: &str, policy: Policy, rate: Option<f64>) -> Turns<RedisStore> {
    let store = RedisStore::connect(url).await.unwrap();
    let mut builder = OutboundLayer::<Global, _>::builder()
        .policy(policy)
        .store(store)
        .max_wait(Duration::from_secs(30));
    if let Some(rate) = rate {
        builder = builder.clock_rate(rate);
    }
    builder.build().unwrap().turns()
}

/// `n` waits of `cost`, each recording its departure (tokio's clock) under `who`.
fn send(
    turns: &Turns<RedisStore>,
    n: usize,
    cost: u32,
    who: &'static str,
    gone: &Gone,
) -> Vec<tokio::task::JoinHandle<Result<(), String>>> {
    (0..n)
        .map(|_| {
            let (wait, gone) = (turns.wait(Key::from("k"), cost), gone.clone());
            tokio::spawn(async move {
                match wait.await {
                    Ok(turn) => {
                        turn.go();
                        gone.lock().unwrap().push((Instant::now(), cost, who));
                        Ok(())
                    }
                    Err(e) => Err(e.to_string()),
                }
            })
        })
        .collect()
}

/// The most units departed within any `window` (true sliding window, at each departure).
fn fullest(gone: &[(Instant, u32, &'static str)], window: Duration) -> (u32, Vec<String>) {
    let mut best = (0, Vec::new());
    for &(t, _, _) in gone {
        let inside: Vec<_> = gone
            .iter()
            .filter(|g| g.0 <= t && g.0 + window > t)
            .collect();
        let units: u32 = inside.iter().map(|g| g.1).sum();
        if units > best.0 {
            let start = inside.iter().map(|g| g.0).min().unwrap();
            let what = inside
                .iter()
                .map(|g| format!("{}@{:?}", g.2, g.0 - start))
                .collect();
            best = (units, what);
        }
    }
    best
}

async fn join(tasks: Vec<tokio::task::JoinHandle<Result<(), String>>>) -> Vec<String> {
    let mut errors = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            errors.push(e);
        }
    }
    errors
}

/// A fresh instance on a clock at 0.25x whose first reservation is already within its margin
/// of its turn: it has no rate sample yet.
async fn fresh_clock_at(rate: f64, near_reply_delay: Duration) {
    clock_at(rate, near_reply_delay, false).await
}

async fn clock_at(rate: f64, near_reply_delay: Duration, warm: bool) {
    let server = RedisServer::start();
    let delay = Delay::start(server.port(), Duration::ZERO, near_reply_delay).await;
    let p = policy(&["10/1s"], Algorithm::SlidingLog);
    let near = turns_at(&delay.url(), p.clone(), None).await;
    let odd = turns_at(&server.url(), p.clone(), Some(rate)).await;
    if warm {
        // The odd instance learns its rate first: calls on another key that wait ~1 s.
        for _ in 0..10 {
            near.wait(Key::from("warm"), 1).await.unwrap().go();
        }
        let waits: Vec<_> = (0..5).map(|_| odd.wait(Key::from("warm"), 1)).collect();
        for w in waits {
            w.await.unwrap().go();
        }
    }
    let gone: Gone = Arc::default();
    let t0 = Instant::now();
    let mut all = send(&near, 10, 1, "near", &gone);
    tokio::time::sleep_until(t0 + Duration::from_millis(1010)).await;
    all.extend(send(&odd, 1, 1, "odd", &gone));
    tokio::time::sleep_until(t0 + Duration::from_millis(1025)).await;
    all.extend(send(&near, 9, 1, "near", &gone));
    tokio::time::sleep_until(t0 + Duration::from_millis(1150)).await;
    all.extend(send(&near, 10, 1, "near", &gone));
    let errors = join(all).await;
    let gone = gone.lock().unwrap().clone();
    let (most, what) = fullest(&gone, Duration::from_secs(1));
    let odd_at: Vec<_> = gone
        .iter()
        .filter(|g| g.2 == "odd")
        .map(|g| g.0 - t0)
        .collect();
    eprintln!("clock {rate}x: {} went, errors {errors:?}; odd went at {odd_at:?}; fullest second {most}: {what:?}", gone.len());
    assert!(most <= 10, "{most} in one second");
}

/// A fresh instance (no rate learned yet) on a clock at a quarter of the store's: its first
/// turn is confirmed by a look before it goes, and the window holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_instance_on_a_clock_at_a_quarter_keeps_the_window() {
    fresh_clock_at(0.25, Duration::ZERO).await;
}

/// A cost of 0 is refused by the store, naming the rule; a cost over the count has no turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_out_of_range_fail_with_what_is_wrong() {
    let server = RedisServer::start();
    let turns = turns_at(&server.url(), policy(&["10/1s"], Algorithm::Gcra), None).await;
    let zero = turns.wait(Key::from("k"), 0).await.map(|t| t.go());
    let above = turns.wait(Key::from("k"), 11).await.map(|t| t.go());
    let show = |r: &Result<(), OutboundError<std::convert::Infallible>>| match r {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("{e} / {e:?}"),
    };
    eprintln!("cost 0: {}; cost 11 of 10: {}", show(&zero), show(&above));
    assert!(
        matches!(zero, Err(OutboundError::Store(_))),
        "{}",
        show(&zero)
    );
    assert!(show(&zero).contains("at least one unit"));
    assert!(matches!(above, Err(OutboundError::TooLate { turn: None })));
}

/// After Redis was killed while calls waited and came back (restarted, empty): how long new
/// calls (one every 100 ms, one at a time) keep failing, and with what.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_a_restart_are_served_again_within_two_seconds() {
    let mut server = RedisServer::start();
    let p = policy(&["10/1s"], Algorithm::SlidingLog);
    let turns = turns_at(&server.url(), p.clone(), None).await;
    let gone: Gone = Arc::default();
    let all = send(&turns, 30, 1, "w", &gone);
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.kill();
    let _ = join(all).await;
    server.restart();
    let start = Instant::now();
    let mut log: Vec<(Duration, String)> = Vec::new();
    while start.elapsed() < Duration::from_secs(40) {
        let r = tokio::time::timeout(Duration::from_secs(5), turns.wait(Key::from("k"), 1)).await;
        let what = match r {
            Err(_) => "hang".to_owned(),
            Ok(Ok(turn)) => {
                turn.go();
                "ok".to_owned()
            }
            Ok(Err(e)) => e.to_string().chars().take(40).collect(),
        };
        log.push((start.elapsed(), what));
        if log.iter().rev().take(10).filter(|l| l.1 == "ok").count() == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first_ok = log.iter().find(|l| l.1 == "ok").map(|l| l.0);
    let failed = log.iter().filter(|l| l.1 != "ok").count();
    let last_failed = log.iter().filter(|l| l.1 != "ok").map(|l| l.0).next_back();
    let mut kinds: Vec<String> = log
        .iter()
        .filter(|l| l.1 != "ok")
        .map(|l| l.1.clone())
        .collect();
    kinds.sort();
    kinds.dedup();
    eprintln!("after the restart: first served at {first_ok:?}; {failed} of {} failed, the last at {last_failed:?}: {kinds:?}", log.len());
    assert!(last_failed.is_none_or(|t| t < Duration::from_secs(2)));
}

/// Calls waiting on an instance whose Redis stalls for `stall` (a proxy that stops), while
/// another instance goes on: the window holds, and none fails.
async fn stalled(stall: Duration) {
    let server = RedisServer::start();
    let proxy = crate::support::proxy::Proxy::start(server.port()).await;
    let p = policy(&["10/1s"], Algorithm::SlidingLog);
    let a = turns_at(&proxy.url(), p.clone(), None).await;
    let b = turns_at(&server.url(), p.clone(), None).await;
    let gone: Gone = Arc::default();
    let start = Instant::now();
    let mut all = send(&a, 20, 1, "a", &gone);
    all.extend(send(&b, 10, 1, "b", &gone));
    tokio::time::sleep(Duration::from_millis(900)).await;
    proxy.pause();
    tokio::time::sleep(stall).await;
    proxy.resume();
    let errors = join(all).await;
    let took = start.elapsed();
    let gone = gone.lock().unwrap().clone();
    let (one, w) = fullest(&gone, Duration::from_secs(1));
    let mut kinds: Vec<String> = errors
        .iter()
        .map(|e| e.chars().take(60).collect())
        .collect();
    kinds.sort();
    kinds.dedup();
    eprintln!("stall {stall:?}: {} went, {} failed {kinds:?}, done in {took:?}; fullest second {one} {w:?}", gone.len(), errors.len());
    assert!(one <= 10);
    assert!(errors.is_empty(), "{kinds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_waiting_through_a_stall_keep_the_window_and_none_fails() {
    stalled(Duration::from_millis(1500)).await;
}

/// After a 1.5 s stall while calls waited: how long new calls (one every 100 ms) fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_a_stall_are_served_again_within_two_seconds() {
    let server = RedisServer::start();
    let proxy = crate::support::proxy::Proxy::start(server.port()).await;
    let p = policy(&["10/1s"], Algorithm::SlidingLog);
    let a = turns_at(&proxy.url(), p.clone(), None).await;
    let gone: Gone = Arc::default();
    let all = send(&a, 20, 1, "a", &gone);
    tokio::time::sleep(Duration::from_millis(900)).await;
    proxy.pause();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.resume();
    let errors = join(all).await;
    let start = Instant::now();
    let mut log: Vec<(Duration, bool)> = Vec::new();
    while start.elapsed() < Duration::from_secs(30) {
        let ok = matches!(a.wait(Key::from("k2"), 1).await.map(|t| t.go()), Ok(()));
        log.push((start.elapsed(), ok));
        if log.iter().rev().take(10).filter(|l| l.1).count() == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let failed = log.iter().filter(|l| !l.1).count();
    let last_failed = log.iter().filter(|l| !l.1).map(|l| l.0).next_back();
    eprintln!("stall 1.5 s: {} of 20 waiting failed; then on another key {failed} of {} calls failed, the last at {last_failed:?} after Redis answered again", errors.len(), log.len());
    assert!(last_failed.is_none_or(|t| t < Duration::from_secs(2)));
}
