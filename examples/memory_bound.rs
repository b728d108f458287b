//! Resident memory of the memory store under a flood of distinct keys.
//!
//! ```text
//! cargo run --release --example memory_bound
//! ```
//!
//! Sends 2 000 000 requests, each from a new client, through a `MemoryStore`, and reports the
//! process's resident memory (VmRSS, Linux) over its start and the keys held after the first
//! and the second million: for the sliding log and GCRA at the default bound
//! (`MemoryStore::DEFAULT_MAX_KEYS`), and for the sliding log with `max_keys(1_000_000)`. Each
//! configuration runs in a process of its own, so that memory freed by one does not flatter
//! the next.

use std::process::Command;
use std::time::Duration;

use futures::executor::block_on;
use tower_redis_ratelimit::store::ManualClock;
use tower_redis_ratelimit::test_util::key_count;
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, Store};

const RUNS: [(&str, u64); 3] = [
    ("sliding log", MemoryStore::DEFAULT_MAX_KEYS),
    ("GCRA", MemoryStore::DEFAULT_MAX_KEYS),
    ("sliding log", 1_000_000),
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let [_, run] = &args[..] {
        let (name, max_keys) = RUNS[run.parse::<usize>().unwrap()];
        return measure(name, max_keys);
    }
    println!("| algorithm | max_keys | keys sent | keys held | resident memory | per key held |");
    println!("|---|---|---|---|---|---|");
    let exe = std::env::current_exe().unwrap();
    for run in 0..RUNS.len() {
        let status = Command::new(&exe).arg(run.to_string()).status().unwrap();
        assert!(status.success());
    }
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn measure(name: &str, max_keys: u64) {
    let algorithm = match name {
        "GCRA" => Algorithm::Gcra,
        _ => Algorithm::SlidingLog,
    };
    let clock = ManualClock::default();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(max_keys)
        .build();
    let policy = "10/1m".parse::<Policy>().unwrap().with_algorithm(algorithm);
    let base = rss_mib();
    let mut sent = 0u64;
    for _ in 0..2 {
        for _ in 0..1_000_000 {
            let key = Key::from(format!("client-{sent}"));
            block_on(store.check(&key, &policy, 1)).unwrap();
            sent += 1;
            clock.advance(Duration::from_micros(10));
        }
        let held = key_count(&store);
        let grown = rss_mib() - base;
        println!(
            "| {name} | {max_keys} | {sent} | {held} | +{grown:.0} MiB | {:.0} bytes |",
            grown * 1024.0 * 1024.0 / held as f64
        );
    }
}
