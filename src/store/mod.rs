//! Where decisions are made and state is kept.
//!
//! A [`Store`] makes one atomic decision per request. [`MemoryStore`] keeps state in this
//! process; [`RedisStore`] (feature `redis`) keeps it in Redis so that every instance of a
//! service shares one limit.

use std::future::Future;

use crate::{Decision, Key, Policy};

pub(crate) mod memory;
#[cfg(feature = "redis")]
pub(crate) mod redis;

pub use memory::{Clock, ManualClock, MemoryStore, MemoryStoreBuilder, TokioClock};
#[cfg(feature = "redis")]
pub use redis::{RedisStore, RedisStoreBuilder};

/// Decides whether a request fits a policy, and records it if it does, in one atomic step.
///
/// Implementations take the time from their own clock, never from the caller, so that all
/// instances sharing a store agree on it.
pub trait Store: Clone + Send + Sync + 'static {
    /// The future of one decision.
    type Future: Future<Output = Result<Decision, StoreError>> + Send + 'static;

    /// Decides a request of `cost` units (usually 1) for `key` under `policy`.
    ///
    /// Admitted requests are recorded against every limit of the policy; denied ones are not
    /// recorded at all.
    fn check(&self, key: &Key, policy: &Policy, cost: u32) -> Self::Future;
}

/// A store could not decide.
///
/// The layer then follows its [`FailureMode`](crate::FailureMode).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Redis answered with an error, timed out, or could not be reached.
    #[cfg(feature = "redis")]
    #[error("redis: {0}")]
    Redis(#[from] fred::error::Error),
    /// The store answered something this crate does not understand.
    #[error("unexpected store reply: {0}")]
    Reply(String),
    /// The store was configured wrongly (e.g. a bad URL or key prefix).
    #[error("store configuration: {0}")]
    Config(String),
}
