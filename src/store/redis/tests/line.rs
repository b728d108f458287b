//! A differential property test of the line of reservations: the memory store (which runs
//! `src/model/line.rs` on a manual clock) and a real Redis (`scripts/line.lua` with
//! `join_line` in `prelude.lua`), fed the same random sequences of reservations, looks, looks
//! at many, leaves and pauses, answer alike: the same turns, the same reservations taken out,
//! moved up and given back.
//!
//! Redis runs on its own clock: before each step the memory store's clock is moved to Redis's
//! `TIME`, so that both see time go on alike (each step a little later than the one before),
//! and answers, durations from each store's now, are compared to the nearest 5 s. GCRA
//! `2/20s` gives turns 10 s apart, after a first pause of 5 s, and pauses are multiples of
//! 10 s long. The rules that read the time are set on either side of it: a notice of 0 or an
//! hour, a look's `late` of 0 or an hour, a reservation's `late` of 0 or 10 s (half the window).

use std::time::{Duration, UNIX_EPOCH};

use proptest::prelude::*;
use proptest::test_runner::{Config as Cases, TestCaseError, TestRunner};

use super::differential::Server;
use crate::store::reserve::{InLine, Reserve, Ticket};
use crate::store::{ManualClock, MemoryStore};
use crate::{Algorithm, Decision, Key, Policy, RedisStore, Store};

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Op {
    /// A reservation of this cost, whose caller learns of a move at once (`false`) or an hour
    /// later (`true`), and whose units may be used on time (`false`) or 10 s late (`true`):
    /// every reservation after it then reads the key's windows 10 s late too.
    Reserve(u32, bool, bool),
    /// The `n`-th reservation made (modulo their number) looks, with a `late` of an hour
    /// (`true`: taken out, used) or of nothing.
    Look(usize, bool),
    /// The `n`-th reservation made leaves.
    Leave(usize),
    /// All the reservations made look at once.
    LookMany,
    /// The key pauses this many times 10 s.
    Pause(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u32..3, proptest::bool::weighted(0.2), proptest::bool::weighted(0.2))
            .prop_map(|(c, n, l)| Op::Reserve(c, n, l)),
        2 => (0usize..50, any::<bool>()).prop_map(|(i, late)| Op::Look(i, late)),
        4 => (0usize..50).prop_map(Op::Leave),
        1 => Just(Op::LookMany),
        1 => (1u64..4).prop_map(Op::Pause),
    ]
}

/// A duration to the nearest 5 s.
fn near(d: Duration) -> u128 {
    (d.as_millis() + 2_500) / 5_000
}

/// A turn, to the nearest 5 s.
fn decision(d: Result<Decision, crate::StoreError>) -> Result<Option<u128>, String> {
    let d = d.map_err(|e| e.to_string())?;
    Ok(d.is_allowed().then(|| near(crate::test_util::turn(&d))))
}

/// Where a reservation stands, to the nearest 5 s.
fn stood(s: Result<InLine, crate::StoreError>) -> Result<(Option<u128>, u128, u128), String> {
    let s = s.map_err(|e| e.to_string())?;
    Ok((s.turn.map(near), near(s.past), near(s.paused)))
}

/// The policy of every case.
fn policy() -> Policy {
    Policy::new("line", ["2/20s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra)
}

/// Runs step `i`, `op`, on `store`, whose reservations so far are `tickets`: its answer as
/// text.
async fn step<S: Store + Reserve>(
    store: &S,
    key: &Key,
    tickets: &mut Vec<Ticket>,
    (i, op): (usize, &Op),
) -> String {
    let policy = policy();
    let hour = Duration::from_secs(3600);
    let answer = match *op {
        Op::Reserve(cost, slow, late) => {
            let ticket = Ticket {
                cost,
                notice: if slow { hour } else { Duration::ZERO },
                late: if late {
                    Duration::from_secs(10)
                } else {
                    Duration::ZERO
                },
                ..Ticket::new(1_000 + i as u64, hour)
            };
            tickets.push(ticket);
            format!("{:?}", decision(store.reserve(key, &policy, ticket).await))
        }
        Op::Look(n, _) | Op::Leave(n) if tickets.is_empty() => format!("{n}: none"),
        Op::Look(n, late) => {
            let ticket = Ticket {
                late: if late { hour } else { Duration::ZERO },
                ..tickets[n % tickets.len()]
            };
            format!("{:?}", stood(store.look(key, &policy, ticket).await))
        }
        Op::Leave(n) => {
            let ticket = tickets[n % tickets.len()];
            format!("{:?}", stood(store.leave(key, &policy, ticket).await))
        }
        Op::LookMany => {
            let many = store.look_many(key, &policy, tickets.clone()).await;
            let many = many.map(|m| m.into_iter().map(|s| stood(Ok(s))).collect::<Vec<_>>());
            format!("{many:?}")
        }
        Op::Pause(tens) => {
            let pause = Duration::from_secs(10 * tens);
            format!("{:?}", stood(store.pause(key, &policy, pause).await))
        }
    };
    format!("{op:?} -> {answer}")
}

/// Redis's `TIME`, since the epoch.
async fn redis_time(redis: &RedisStore) -> Duration {
    use fred::interfaces::ClientLike;
    let command = fred::types::CustomCommand::new_static("TIME", None, false);
    let time: Vec<String> = redis
        .pool()
        .next()
        .custom(command, Vec::<String>::new())
        .await
        .unwrap();
    Duration::from_secs(time[0].parse().unwrap()) + Duration::from_micros(time[1].parse().unwrap())
}

/// Runs `ops` on the memory store and on Redis, step by step, the memory store's clock moved to
/// Redis's time before each: the steps where their answers differ, with the answers so far.
async fn compare(redis: &RedisStore, key: &Key, ops: &[Op]) -> Result<usize, String> {
    let start = redis_time(redis).await;
    let clock = ManualClock::from(UNIX_EPOCH + start);
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let mut clock_at = start;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let pause = Duration::from_secs(5);
    let (a, b) = (
        stood(memory.pause(key, &policy(), pause).await),
        stood(redis.pause(key, &policy(), pause).await),
    );
    if a != b {
        return Err(format!("first pause: memory {a:?}, redis {b:?}"));
    }
    let mut leaves = 0;
    for (i, op) in ops.iter().enumerate() {
        let now = redis_time(redis).await;
        clock.advance(now.saturating_sub(clock_at));
        clock_at = clock_at.max(now);
        let a = step(&memory, key, &mut ours, (i, op)).await;
        let b = step(redis, key, &mut theirs, (i, op)).await;
        if a != b {
            return Err(format!("step {i}: memory {a}\n        redis  {b}"));
        }
        leaves += usize::from(matches!(op, Op::Leave(_)) && a.contains("Some"));
    }
    Ok(leaves)
}

#[test]
fn the_line_on_redis_answers_as_the_memory_store() {
    let server = Server::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = format!("redis://127.0.0.1:{}", server.port);
    let redis = runtime.block_on(async {
        for _ in 0..100 {
            if let Ok(store) = RedisStore::connect(&url).await {
                return store;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("redis-server did not come up");
    });
    let mut runner = TestRunner::new(Cases {
        cases: 200,
        failure_persistence: None,
        ..Cases::default()
    });
    let n = std::cell::Cell::new(0u64);
    let moved = std::cell::Cell::new(0usize);
    let outcome = runner.run(&proptest::collection::vec(op(), 1..40), |ops| {
        n.set(n.get() + 1);
        let key = Key::from(format!("case-{}", n.get()));
        match runtime.block_on(compare(&redis, &key, &ops)) {
            Ok(leaves) => {
                moved.set(moved.get() + leaves);
                Ok(())
            }
            Err(differ) => Err(TestCaseError::fail(differ)),
        }
    });
    if let Err(failure) = outcome {
        panic!("{failure}");
    }
    assert!(
        moved.get() > 300,
        "{} leaves of reservations in line",
        moved.get()
    );
}
