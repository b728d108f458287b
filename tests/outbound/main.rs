//! The outbound surface: calls that wait their turn under an upstream's limit, reservations on
//! the memory store, and a fleet of workers sharing a limit through Redis.

#[path = "../support/mod.rs"]
mod support;

mod calls;
mod fleet;
mod reserve;
mod tonic;
