//! How a load's requests spread over its keys (`--distribution` and `--keys` of `http_load`
//! and `store_load`): named by the rate each key sees, hot, cold or Zipf's law.

// Each example that includes this file uses part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tower_redis_ratelimit::store::Leases;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The lease period of the leasing configurations (the default): a key's rate times it says
/// whether a lease would serve several requests.
pub const LEASE_PERIOD: Duration = Leases::DEFAULT_PERIOD;
/// Requests per lease period from which a key counts as hot.
pub const HOT_PER_PERIOD: f64 = 10.0;
/// The most requests per second a key of a load sized by `--keys auto` sees.
pub const COLD_KEY_RATE: f64 = 0.1;
/// Keys of the warm-up that sizes `--keys auto`, named `w<n>` so that the measured keys stay
/// cold.
pub const AUTO_WARMUP_KEYS: usize = 10_000;
/// Zipf's exponent when `--distribution zipf` names none.
pub const ZIPF_S: f64 = 1.1;

/// How a load's requests spread over its keys, named by the rate each key sees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    /// Round-robin over `--keys` (default 1 000): the run without `--distribution`.
    Uniform,
    /// Round-robin over few keys (default 100), each busy enough for leases to pay.
    Hot,
    /// Round-robin over so many keys (default `auto`) that each sees at most 0.1 request a
    /// second: most production keys.
    Cold,
    /// Zipf's law with this exponent over `--keys` (default 100 000): key `n` (from 1) gets a
    /// share proportional to `n^-s`, a few hot keys and a long cold tail.
    Zipf(f64),
}

impl Distribution {
    pub fn parse_list(text: &str) -> Result<Vec<Distribution>, Error> {
        text.split(',').map(Distribution::parse).collect()
    }

    pub fn parse(text: &str) -> Result<Distribution, Error> {
        let exponent = |s: &str| s.parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0);
        match text.trim() {
            "hot" => Ok(Distribution::Hot),
            "cold" => Ok(Distribution::Cold),
            "zipf" => Ok(Distribution::Zipf(ZIPF_S)),
            other => other
                .strip_prefix("zipf:")
                .and_then(exponent)
                .map(Distribution::Zipf)
                .ok_or_else(|| {
                    format!("--distribution takes hot, cold or zipf[:S], not {other:?}").into()
                }),
        }
    }

    pub fn default_keys(self) -> KeyCount {
        match self {
            Distribution::Uniform => KeyCount::Fixed(1000),
            Distribution::Hot => KeyCount::Fixed(100),
            Distribution::Cold => KeyCount::Auto,
            Distribution::Zipf(_) => KeyCount::Fixed(100_000),
        }
    }

    /// What row names carry after the configuration's: nothing for the default load.
    pub fn suffix(self) -> String {
        match self {
            Distribution::Uniform => String::new(),
            Distribution::Hot => "/hot".to_owned(),
            Distribution::Cold => "/cold".to_owned(),
            Distribution::Zipf(s) if s == ZIPF_S => "/zipf".to_owned(),
            Distribution::Zipf(s) => format!("/zipf:{s}"),
        }
    }

    pub fn describe(self, keys: KeyCount) -> String {
        let keys = match keys {
            KeyCount::Fixed(n) => format!("{n} keys"),
            KeyCount::Auto => format!(
                "keys sized from each warm-up's throughput for at most {COLD_KEY_RATE} req/s each"
            ),
        };
        match self {
            Distribution::Uniform => keys,
            Distribution::Hot => format!("hot: {keys} round-robin"),
            Distribution::Cold => format!("cold: {keys} round-robin"),
            Distribution::Zipf(s) => format!("zipf (s = {s}): {keys}"),
        }
    }
}

/// `--keys`: a number, or `auto`.
#[derive(Debug, Clone, Copy)]
pub enum KeyCount {
    Fixed(usize),
    /// Ten times the configuration's warm-up throughput, rounded up to a power of ten.
    Auto,
}

impl KeyCount {
    pub fn parse(text: &str) -> Result<KeyCount, Error> {
        match text {
            "auto" => Ok(KeyCount::Auto),
            n => match n.parse() {
                Ok(n) if n > 0 => Ok(KeyCount::Fixed(n)),
                _ => Err(format!("--keys takes auto or a whole number above 0, not {n:?}").into()),
            },
        }
    }

    /// Keys enough that `rps` requests per second give each at most `COLD_KEY_RATE`.
    pub fn auto(rps: f64) -> usize {
        let needed = (rps / COLD_KEY_RATE).max(1.0);
        10usize.pow(needed.log10().ceil() as u32)
    }
}

/// The keys of one load (`V`: as the load sends them), and how its workers pick among them.
#[derive(Clone)]
pub struct KeySet<V> {
    pub values: Arc<[V]>,
    pub spread: Spread,
}

impl<V> KeySet<V> {
    /// `count` keys named `<prefix><n>`.
    pub fn named<E>(prefix: &str, count: usize, distribution: Distribution) -> Result<Self, E>
    where
        V: TryFrom<String, Error = E>,
    {
        let values = (0..count)
            .map(|n| V::try_from(format!("{prefix}{n}")))
            .collect::<Result<_, _>>()?;
        let spread = Spread::new(count, distribution);
        Ok(KeySet { values, spread })
    }

    pub fn one(value: V) -> Self {
        KeySet {
            values: [value].into(),
            spread: Spread::new(1, Distribution::Uniform),
        }
    }

    pub fn top_share(&self) -> f64 {
        self.spread.top_share()
    }

    pub fn hot_share(&self, rps: f64) -> f64 {
        self.spread.hot_share(rps)
    }

    pub fn picker(&self, worker: usize, workers: usize) -> Picker {
        self.spread.picker(worker, workers)
    }
}

/// How a load's requests spread over `count` keys, numbered from 0, without their names (a
/// load that names its keys as it sends them keeps no table of them: 10^7 cold keys would
/// take hundreds of MB).
#[derive(Clone)]
pub struct Spread {
    pub count: usize,
    /// Zipf's cumulative shares over the keys, hottest first; `None` for round-robin.
    cumulative: Option<Arc<[f64]>>,
}

impl Spread {
    pub fn new(count: usize, distribution: Distribution) -> Spread {
        let cumulative = match distribution {
            Distribution::Zipf(s) => Some(zipf_cumulative(count, s)),
            _ => None,
        };
        Spread { count, cumulative }
    }

    /// The share of the requests that the busiest key gets.
    pub fn top_share(&self) -> f64 {
        match &self.cumulative {
            Some(cumulative) => cumulative[0],
            None => 1.0 / self.count as f64,
        }
    }

    /// The share of the requests that go to keys seeing at least `HOT_PER_PERIOD` requests
    /// per lease period, at `rps` requests per second in all.
    pub fn hot_share(&self, rps: f64) -> f64 {
        let hot = |share: f64| share * rps * LEASE_PERIOD.as_secs_f64() >= HOT_PER_PERIOD;
        let Some(cumulative) = &self.cumulative else {
            return f64::from(u8::from(hot(self.top_share())));
        };
        // Shares fall with the rank: the hot keys come first.
        let mut before = 0.0;
        let shares = cumulative
            .iter()
            .map(|&c| c - std::mem::replace(&mut before, c));
        shares.take_while(|&share| hot(share)).sum()
    }

    /// Worker `worker` of `workers`: round-robin from its own first key, or its own seeded
    /// draws from Zipf's law.
    pub fn picker(&self, worker: usize, workers: usize) -> Picker {
        match &self.cumulative {
            None => Picker::RoundRobin {
                next: worker,
                step: workers,
            },
            Some(cumulative) => Picker::Zipf {
                cumulative: Arc::clone(cumulative),
                rng: SmallRng::seed_from_u64(worker as u64),
            },
        }
    }
}

/// How one worker picks its next key.
pub enum Picker {
    /// Keys `next`, `next + step`, ... modulo the number of keys: the workers together cycle
    /// over all of them.
    RoundRobin { next: usize, step: usize },
    /// A key by a uniform draw located in the cumulative shares (binary search).
    Zipf {
        cumulative: Arc<[f64]>,
        rng: SmallRng,
    },
}

impl Picker {
    pub fn next(&mut self, keys: usize) -> usize {
        match self {
            Picker::RoundRobin { next, step } => {
                let n = *next % keys;
                *next += *step;
                n
            }
            Picker::Zipf { cumulative, rng } => {
                let draw: f64 = rng.random();
                cumulative.partition_point(|&c| c <= draw).min(keys - 1)
            }
        }
    }
}

/// Zipf's law over `keys` ranks with exponent `s`: the share of ranks `1..=n` at `n - 1`,
/// built once per load (100 000 keys: 800 KB).
fn zipf_cumulative(keys: usize, s: f64) -> Arc<[f64]> {
    let mut total = 0.0;
    let mut cumulative: Vec<f64> = (1..=keys)
        .map(|rank| {
            total += (rank as f64).powf(-s);
            total
        })
        .collect();
    cumulative.iter_mut().for_each(|c| *c /= total);
    cumulative.into()
}
