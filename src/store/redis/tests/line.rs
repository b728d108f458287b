//! A differential property test of the line of reservations: the memory store (which runs
//! `src/model/line.rs` on a manual clock) and a real Redis (`scripts/line.lua` with
//! `join_line` in `prelude.lua`), fed the same random sequences of reservations, looks, looks
//! at many, leaves and pauses, answer alike: the same turns, the same reservations taken out,
//! moved up and given back.
//!
//! Redis runs on its own clock, which moves on while a case runs (well under a second), so
//! every time of a case is a multiple of 5 s from its start and answers are compared to the
//! nearest 5 s: GCRA `2/20s` gives turns 10 s apart, after a first pause of 5 s, and pauses
//! are multiples of 10 s long. The rules that read the time are set on either side of it: a
//! notice of 0 or an hour, a look's `late` of 0 or an hour.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    /// later (`true`).
    Reserve(u32, bool),
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
        4 => (1u32..3, proptest::bool::weighted(0.2)).prop_map(|(c, n)| Op::Reserve(c, n)),
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

/// Runs `ops` on `store`, answering each step's answers as text.
async fn run<S: Store + Reserve>(store: &S, key: &Key, ops: &[Op]) -> Vec<String> {
    let policy = Policy::new("line", ["2/20s".parse().unwrap()])
        .unwrap()
        .with_algorithm(Algorithm::Gcra);
    let hour = Duration::from_secs(3600);
    let mut tickets: Vec<Ticket> = Vec::new();
    let mut answers = Vec::new();
    let first = store.pause(key, &policy, Duration::from_secs(5)).await;
    answers.push(format!("{:?}", stood(first)));
    for (i, op) in ops.iter().enumerate() {
        let answer = match *op {
            Op::Reserve(cost, slow) => {
                let ticket = Ticket {
                    cost,
                    notice: if slow { hour } else { Duration::ZERO },
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
        answers.push(format!("{op:?} -> {answer}"));
    }
    answers
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
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let clock = ManualClock::from(UNIX_EPOCH + Duration::from_secs(now.as_secs()));
        let memory = MemoryStore::builder().clock(clock).build();
        let ours = runtime.block_on(run(&memory, &key, &ops));
        let theirs = runtime.block_on(run(&redis, &key, &ops));
        moved.set(moved.get() + ours.iter().filter(|a| a.contains("Leave")).count());
        for (a, b) in ours.iter().zip(&theirs) {
            if a != b {
                let steps = ours.join("\n");
                return Err(TestCaseError::fail(format!(
                    "memory {a}\nredis  {b}\nafter\n{steps}"
                )));
            }
        }
        Ok(())
    });
    if let Err(failure) = outcome {
        panic!("{failure}");
    }
    assert!(moved.get() > 500, "{} leaves", moved.get());
}
