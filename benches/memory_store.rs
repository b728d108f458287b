//! One decision of the sliding-window log in `MemoryStore`: one hot key, many keys, and a
//! multi-limit policy. `cargo bench --bench memory_store`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use tower_redis_ratelimit::{Key, MemoryStore, Policy, Store};

fn decide(store: &MemoryStore, key: &Key, policy: &Policy) -> bool {
    // The memory store's future is ready at once.
    let future = store.check(key, policy, 1);
    futures::executor::block_on(future).unwrap().is_allowed()
}

fn sliding_log(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory_sliding_log");
    let store = MemoryStore::new();

    let policy: Policy = "100/1s".parse().unwrap();
    let hot = Key::from("hot");
    group.bench_function("one_key_limit_100", |b| {
        b.iter(|| decide(&store, black_box(&hot), &policy))
    });

    let keys: Vec<Key> = (0..10_000)
        .map(|i| Key::from(format!("10.0.{}.{}", i / 256, i % 256)))
        .collect();
    let mut next = 0;
    group.bench_function("10k_keys_limit_100", |b| {
        b.iter(|| {
            next = (next + 1) % keys.len();
            decide(&store, black_box(&keys[next]), &policy)
        })
    });

    let multi: Policy = "10/1s + 100/1m + 1000/1h".parse().unwrap();
    group.bench_function("one_key_three_limits", |b| {
        b.iter(|| decide(&store, black_box(&hot), &multi))
    });
    group.finish();
}

criterion_group!(benches, sliding_log);
criterion_main!(benches);
