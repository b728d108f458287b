//! How often each O(1) algorithm decides differently from the exact sliding log, on a
//! generated trace of about 3 200 000 requests from 3 000 clients.
//!
//! ```text
//! cargo run --release --example accuracy
//! ```
//!
//! Each client sends Poisson traffic at its own rate, between a tenth of the limit and four
//! times it (log-uniform), for 10 minutes. Every algorithm sees the same trace through its own
//! `MemoryStore` on a `ManualClock`, so the figures do not depend on the machine; the seed is
//! fixed. Decisions are compared request by request, overall and by the client's load (its
//! rate over the limit), and as the total number admitted.

use std::time::Duration;

use futures::executor::block_on;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower_redis_ratelimit::store::{Clock, ManualClock};
use tower_redis_ratelimit::{Algorithm, Key, MemoryStore, Policy, Store};

const CLIENTS: usize = 3_000;
const TRACE: Duration = Duration::from_secs(600);
const POLICY: &str = "100/1m";

/// Whether a client's load (rate over the limit) falls in a class.
type LoadClass = fn(f64) -> bool;

fn main() {
    let (trace, load) = generate(1);
    let limit = POLICY.parse::<Policy>().unwrap().limits()[0];
    let exact = run(&trace, Algorithm::SlidingLog);
    println!(
        "{} requests from {CLIENTS} clients over {} s, limit {limit}; the exact log admits {:.2} %\n",
        trace.len(),
        TRACE.as_secs(),
        100.0 * share(&exact, |&a| a)
    );
    let classes: [(&str, LoadClass); 3] = [
        ("load < 0.5", |l| l < 0.5),
        ("0.5 to 1", |l| (0.5..1.0).contains(&l)),
        ("over 1", |l| l >= 1.0),
    ];
    let mut header = String::from("| algorithm | differing, all |");
    for (name, _) in classes {
        header.push_str(&format!(" differing, {name} |"));
    }
    println!("{header} admitted where the log refused | refused where the log admitted | admitted in total vs the log |");
    println!("|---|---|---|---|---|---|---|---|");
    for (algorithm, name) in [
        (Algorithm::SlidingWindow, "sliding window counter"),
        (Algorithm::FixedWindow, "fixed window"),
        (Algorithm::Gcra, "GCRA"),
    ] {
        let got = run(&trace, algorithm);
        let rows: Vec<(bool, bool, f64)> = exact
            .iter()
            .zip(&got)
            .zip(&trace)
            .map(|((&e, &g), &(_, client))| (e, g, load[client as usize]))
            .collect();
        let mut line = format!(
            "| {name} | {:.2} % |",
            100.0 * share(&rows, |(e, g, _)| e != g)
        );
        for (_, class) in classes {
            let members: Vec<_> = rows.iter().filter(|r| class(r.2)).copied().collect();
            line.push_str(&format!(
                " {:.2} % |",
                100.0 * share(&members, |(e, g, _)| e != g)
            ));
        }
        let admitted = |v: &[bool]| v.iter().filter(|&&a| a).count() as f64;
        println!(
            "{line} {:.2} % | {:.2} % | {:+.2} % |",
            100.0 * share(&rows, |&(e, g, _)| g && !e),
            100.0 * share(&rows, |&(e, g, _)| e && !g),
            100.0 * (admitted(&got) / admitted(&exact) - 1.0),
        );
    }
}

fn share<T>(items: &[T], pred: impl Fn(&T) -> bool) -> f64 {
    items.iter().filter(|i| pred(i)).count() as f64 / items.len() as f64
}

/// `(time in µs, client)` sorted by time, and each client's rate over the limit.
fn generate(seed: u64) -> (Vec<(u64, u32)>, Vec<f64>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let limit_per_us = 100.0 / 60e6;
    let mut trace = Vec::new();
    let mut load = Vec::new();
    for client in 0..CLIENTS as u32 {
        load.push(10f64.powf(rng.random_range(-1.0..0.6)));
        let rate = limit_per_us * load[client as usize];
        let mut t = 0.0;
        loop {
            t += -(1.0 - rng.random::<f64>()).ln() / rate;
            if t >= TRACE.as_micros() as f64 {
                break;
            }
            trace.push((t as u64, client));
        }
    }
    trace.sort_unstable();
    (trace, load)
}

fn run(trace: &[(u64, u32)], algorithm: Algorithm) -> Vec<bool> {
    let clock = ManualClock::default();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let policy = POLICY.parse::<Policy>().unwrap().with_algorithm(algorithm);
    let keys: Vec<Key> = (0..CLIENTS)
        .map(|c| Key::from(format!("client-{c}")))
        .collect();
    trace
        .iter()
        .map(|&(t, client)| {
            let now = clock.now().as_micros() as u64;
            clock.advance(Duration::from_micros(t - now.min(t)));
            let decision = block_on(store.check(&keys[client as usize], &policy, 1));
            decision.unwrap().is_allowed()
        })
        .collect()
}
