//! The outbound surface: calls that wait their turn under an upstream's limit, reservations on
//! the memory store, and a fleet of workers sharing a limit through Redis.

#[path = "../support/mod.rs"]
mod support;

mod calls;
mod field;
mod fleet;
mod pushback;
mod recovery;
#[cfg(all(feature = "reqwest", feature = "redis"))]
mod reqwest;
mod reserve;
mod tonic;
