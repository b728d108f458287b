//! One decision in `MemoryStore`, for each algorithm, side by side with the `governor` crate's
//! keyed limiter (GCRA over a concurrent map) on the same keys: single-threaded, and contended
//! by two threads on shared keys. `cargo bench --bench vs_governor`.
//!
//! Every limiter is set to 1000 per second per key over 10 000 keys visited in turn, so both
//! admitting and refusing paths are taken as in a busy service.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use futures::executor::block_on;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, Store};

const KEYS: usize = 10_000;
const ALGORITHMS: [(Algorithm, &str); 4] = [
    (Algorithm::SlidingLog, "sliding_log"),
    (Algorithm::SlidingWindow, "sliding_window"),
    (Algorithm::FixedWindow, "fixed_window"),
    (Algorithm::Gcra, "gcra"),
];

fn ours(algorithm: Algorithm) -> (MemoryStore, Policy) {
    let policy = "1000/1s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(algorithm);
    (MemoryStore::new(), policy)
}

fn theirs() -> DefaultKeyedRateLimiter<String> {
    RateLimiter::keyed(Quota::per_second(NonZeroU32::new(1000).unwrap()))
}

fn keys() -> (Vec<Key>, Vec<String>) {
    let names: Vec<String> = (0..KEYS)
        .map(|i| format!("10.{}.{}.1", i / 256, i % 256))
        .collect();
    (names.iter().map(|n| Key::from(n.as_str())).collect(), names)
}

fn single_thread(c: &mut Criterion) {
    let (keys, names) = keys();
    let mut group = c.benchmark_group("one_thread");
    for (algorithm, name) in ALGORITHMS {
        let (store, policy) = ours(algorithm);
        let mut i = 0;
        group.bench_function(format!("memory_store/{name}"), |b| {
            b.iter(|| {
                i = (i + 1) % KEYS;
                block_on(store.check(black_box(&keys[i]), &policy, 1))
                    .unwrap()
                    .is_allowed()
            })
        });
    }
    let limiter = theirs();
    let mut i = 0;
    group.bench_function("governor/gcra", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            limiter.check_key(black_box(&names[i])).is_ok()
        })
    });
    group.finish();
}

/// Runs `per_thread` decisions on each of two threads at once; the time is the wall time.
fn contended(per_thread: u64, decide: impl Fn(usize) + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..2 {
            let decide = &decide;
            s.spawn(move || {
                for n in 0..per_thread as usize {
                    decide((n * 7 + t * 13) % KEYS);
                }
            });
        }
    });
    start.elapsed()
}

fn two_threads(c: &mut Criterion) {
    let (keys, names) = keys();
    let mut group = c.benchmark_group("two_threads");
    for (algorithm, name) in ALGORITHMS {
        let (store, policy) = ours(algorithm);
        group.bench_function(format!("memory_store/{name}"), |b| {
            b.iter_custom(|n| {
                contended(n, |i| {
                    black_box(block_on(store.check(&keys[i], &policy, 1)).unwrap());
                })
            })
        });
    }
    let limiter = theirs();
    group.bench_function("governor/gcra", |b| {
        b.iter_custom(|n| {
            contended(n, |i| {
                let _ = black_box(limiter.check_key(&names[i]));
            })
        })
    });
    group.finish();
}

criterion_group!(benches, single_thread, two_threads);
criterion_main!(benches);
