//! The Redis store in the deployments users run and the failures they meet: a cluster and its
//! failovers, Sentinel, TLS, credentials; Redis gone, slow, flushed or restarted, and the
//! fallback store meanwhile; overrides at the edges of Redis and listed by the hundred
//! thousand.

#[path = "../support/mod.rs"]
mod support;

mod body_costs;
mod cluster;
mod failover;
mod fallback;
mod late_replies;
mod override_edges;
mod override_listing;
mod resilience;
mod secured;
mod sentinel;
mod streams;
mod tls;
mod uploads;
