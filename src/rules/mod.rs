//! Rules: which policy applies to which request.
//!
//! A [`RateLimitLayer`](crate::RateLimitLayer) can hold several policies, each behind a
//! [`Rule`]; the first rule that matches a request decides its policy, and the layer's default
//! policy (if any) takes the rest. Each policy keeps its own budget (store keys carry the
//! policy name), and the `RateLimit-Policy` field names the policy that applied.
//!
//! A rule's policy can have other limits for the customers of a [plan](Rule::plan): the layer
//! asks its [plan function](crate::RateLimitLayerBuilder::plan) which plan a request is on and
//! decides it against that plan's limits, under the policy's name and state, so a customer who
//! changes plans keeps the usage recorded so far.
//!
//! The parts, in the order data flows through them: [`Rule`] and [`Rules`] are what the builder
//! and [`RuleTable::replace`] take; `combine` checks them against the layer's other options;
//! the table compiled from them is what a request reads. With feature `config`, `config` reads
//! [`Rules`] from a TOML file, and `watch` follows one.

mod combine;
#[cfg(feature = "config")]
pub mod config;
mod orphans;
mod rule;
mod table;
#[cfg(feature = "config")]
mod watch;

pub(crate) use combine::Capabilities;
pub(crate) use rule::PlanFn;
pub use rule::{RequestHead, ResponseHead, Rule};
pub(crate) use table::Compiler;
pub use table::{RuleTable, Rules};
