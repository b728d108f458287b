//! What an operator reads: logs and metrics. These tests read what the whole process logs or
//! records (one `metrics` recorder per process, a global `tracing` subscriber, and `tracing`'s
//! per-call-site cache of whether anyone listens), so each runs alone
//! ([`support::one_at_a_time`]), in a binary of its own.

#[path = "../support/mod.rs"]
mod support;

mod logging;
#[cfg(feature = "metrics")]
mod metrics;
mod noscript;
