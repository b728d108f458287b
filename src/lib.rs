#![doc = include_str!("../README.md")]
#![warn(missing_docs, missing_debug_implementations)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admission;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod blocklist;
pub mod body;
mod chain;
pub mod client;
mod decision;
mod decisions;
mod deny_cache;
mod future;
mod ids;
pub mod key;
mod layer;
mod ledger;
pub mod metered;
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub mod metrics;
mod model;
mod policy;
pub mod response;
mod rules;
mod service;
mod settlement;
mod shards;
pub mod store;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod test_util;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod unique;
pub mod usage;

pub use decision::Decision;
pub use decisions::{Decisions, Undecided};
pub use future::ResponseFuture;
pub use key::{
    BodyField, BodyFieldLayer, BodyKey, ClientIp, Global, Header, Key, KeyError, KeyExtractor,
    PeerIp,
};
pub use layer::{BuildError, RateLimitLayer, RateLimitLayerBuilder, DEFAULT_DENY_CACHE};
pub use model::Algorithm;
pub use policy::{Limit, LimitError, Policy, PolicyError};
pub use response::{FailureMode, MissingKey};
#[cfg(feature = "config")]
#[cfg_attr(docsrs, doc(cfg(feature = "config")))]
pub use rules::config;
pub use rules::{RequestHead, ResponseHead, Rule, RuleTable, Rules};
pub use service::RateLimit;
pub use settlement::Settlement;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::RedisStore;
pub use store::{MemoryStore, Store, StoreError};

/// The code blocks of the operations guide, compiled as doctests so that they keep up with the
/// API.
#[cfg(doctest)]
#[doc = include_str!("../docs/operations.md")]
mod operations_guide {}

/// The code blocks of the usage guide, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/usage.md")]
mod usage_guide {}

/// The code blocks of the leases guide, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/leases.md")]
mod leases_guide {}

/// The code blocks of the outbound guide, compiled as doctests.
#[cfg(all(doctest, feature = "redis"))]
#[doc = include_str!("../docs/outbound.md")]
mod outbound_guide {}

/// The code blocks of the integration guide, compiled as doctests.
#[cfg(all(doctest, feature = "redis", feature = "axum"))]
#[doc = include_str!("../docs/integration.md")]
mod integration_guide {}

/// The code blocks of the promises, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/promises.md")]
mod promises_guide {}
