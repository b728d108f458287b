//! The crate's promises (`docs/promises.md`) as properties over generated configurations.
//!
//! proptest generates a configuration (algorithm, limits, penalty box, soft, outcome counting,
//! concurrency and `max_wait`, a second layer stacked on the first, the failure mode, the memory
//! store's bound) and a schedule (requests that end, fail or are dropped, time passing, resets,
//! overrides, outages, floods of other keys, retries at a refusal's `Retry-After`), runs it on
//! the memory store under tokio's paused clock, and checks every promise against what the
//! handler and the client saw: one oracle per promise, and the oracles of refusals
//! (`refusals`). A configuration the crate does not support must fail to build with a typed
//! error, and only those do (`generate::unsupported`).
//!
//! `PROMISE_DIMENSIONS` turns on the dimensions of the field (costs, `Fallback`, event times,
//! three limits, windows up to a day, usage and shadow layers, on Redis outcome counting,
//! overrides, plans and a stacked layer) and the oracles of refusals: by default all of them;
//! `none`, none; or a list of names (`generate::dims`), to see one defect at a time.
//!
//! `PROMISE_CASES` sets the number of cases on the memory store (default 2 000),
//! `PROMISE_REDIS_CASES` on Redis (default 50), `PROMISE_SEED` the seed they are drawn from
//! (default a fixed one; `random` for a new one, printed on failure).

mod generate;
mod harness;
mod memory;
mod oracles;
mod redis;
mod refusals;

use generate::*;
use harness::*;
use oracles::*;
use refusals::*;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, StreamBody};
use proptest::prelude::*;
use proptest::test_runner::{Config as Cases, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_redis_ratelimit::key::Header;

use tower_redis_ratelimit::store::{Override, Scope};
use tower_redis_ratelimit::test_util::FaultyStore;
use tower_redis_ratelimit::{
    Algorithm, BuildError, Decision, Decisions, FailureMode, Key, Limit, MemoryStore, Policy,
    RateLimitLayer, Rule, Store, StoreError,
};

type Body = BoxBody<Bytes, Infallible>;
type Frame = Result<http_body::Frame<Bytes>, Infallible>;

/// The number of cases the environment variable `var` asks for, else `default`.
fn cases_from(var: &str, default: u32) -> u32 {
    let asked = std::env::var(var).ok().and_then(|n| n.parse().ok());
    asked.unwrap_or(default)
}

/// A runner of `cases` cases, shrinking a failure for up to `shrink` steps, drawn from the
/// seed `PROMISE_SEED` names: a number, `random` (a new one, printed on failure), or by
/// default a fixed one, so that a run fails or passes the same way everywhere. Explore with
/// `PROMISE_SEED=random`; a failure it finds becomes a regression case below.
fn runner(cases: u32, shrink: u32) -> (TestRunner, u64) {
    let seed: u64 = match std::env::var("PROMISE_SEED").as_deref() {
        Ok("random") => rand::random(),
        Ok(n) => n.parse().expect("PROMISE_SEED: a number or `random`"),
        Err(_) => 0x7072_6f6d_6973_6573,
    };
    let mut bytes = [0; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Cases {
        cases,
        failure_persistence: None,
        max_shrink_iters: shrink,
        ..Cases::default()
    };
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
    (TestRunner::new_with_rng(config, rng), seed)
}
