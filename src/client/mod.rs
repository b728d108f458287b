//! Outbound: calls a service makes to an API that limits it wait for their turn instead of
//! failing (`docs/outbound.md`).
//!
//! [`OutboundLayer`] wraps a client service (hyper-util's client, a tonic `Channel`, any
//! `Service<http::Request<B>>`). Each request reserves its turn in the store
//! (the store reserves turns): in reservation order across every instance that
//! shares it, then waits for it and goes out. A request whose turn would come later than
//! `max_wait` fails at once with [`OutboundError::TooLate`]; one dropped before it went out
//! gives its reservation back, so that the requests behind it move up. Work that is not an
//! HTTP call waits for its turns through [`Turns`] ([`OutboundLayer::turns`]).
//!
//! ```
//! use std::time::Duration;
//! use tower_redis_ratelimit::client::OutboundLayer;
//! use tower_redis_ratelimit::{Algorithm, Policy};
//!
//! // The provider allows 10 requests per second, counted over any second.
//! let policy: Policy = "10/1s".parse().unwrap();
//! let layer = OutboundLayer::builder()
//!     .policy(policy.with_algorithm(Algorithm::SlidingLog))
//!     .max_wait(Duration::from_secs(30))
//!     .build()
//!     .unwrap();
//! # drop(layer);
//! ```
//!
//! Beyond hyper: a tonic `Channel` goes behind the layer as it is
//! (`Outbound<Channel, K, St>`); a reqwest client takes the layer's turns as a
//! reqwest-middleware `Middleware` ([`OutboundMiddleware`], from
//! [`OutboundLayer::middleware`], feature `reqwest`); and work that is not an HTTP call waits
//! with [`Turns`] (from [`OutboundLayer::turns`]): `turns.wait(key, cost).await?` is a
//! [`Turn`], used by [`Turn::go`] (`docs/outbound.md`, "Beyond hyper").

mod clock;
mod error;
mod future;
mod layer;
mod looker;
mod pace;
mod pushback;
#[cfg(feature = "reqwest")]
mod reqwest;
mod service;
mod shared;
mod turns;
mod wait;

pub use error::OutboundError;
pub use future::ResponseFuture;
pub use layer::{OutboundLayer, OutboundLayerBuilder};
pub use service::Outbound;
pub use turns::Turns;
pub use wait::{Turn, WaitTurn};

#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use self::reqwest::OutboundMiddleware;
