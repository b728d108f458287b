//! Properties over generated cases: the crate's promises on both stores, and the line of
//! reservations.

#[path = "../support/mod.rs"]
mod support;

mod promises;
mod reserve_line;
