//! The layer as users wire it: in axum, hyper, tonic and `ServiceBuilder`; keys from clients,
//! headers and bodies; what a handler sees of the decisions; counting by outcome, the penalty
//! box, plans, rules and limits changed at run time; requests in flight.

#[path = "../support/mod.rs"]
mod support;

#[cfg(all(feature = "redis", feature = "axum"))]
mod admin_endpoint;
mod blocklist;
mod body_key;
mod clients;
mod concurrency;
mod decisions;
mod grpc;
mod honest_users;
mod identity;
mod login;
mod outcomes;
mod penalty_box;
mod plans;
mod rules;
mod runtime_limits;
mod servers;
mod streams;
mod uploads;
