//! The wire format between the store and its Lua scripts: the scripts themselves, what a
//! call's keys and arguments hold, how one request's arguments are encoded, and how the reply
//! is read.
//!
//! This is the Rust side of the contract that the header of `scripts/prelude.lua` states for
//! the scripts; the two follow the same order (keys, arguments, reply), and name the modes of
//! a request ([`Mode`]) and the answers that no limit gives ([`BOXED`], [`SLOTS_FULL`]) alike.
//! A change to one is a change to the other. `scripts/return.lua`'s header states the
//! arguments of a give-back of leased units ([`encode_return`]).
//!
//! Arguments and reply are 64-bit little-endian integers rather than Redis's text, so that
//! Redis neither parses nor prints a number per field (`prelude.lua`, "Cost").
//!
//! `request.rs` encodes a call's keys and arguments, `plain.rs` what of a request's arguments
//! a plain call carries (`scripts/plain.lua`), `reply.rs` reads its reply; the scripts
//! themselves are in `scripts/`.

mod plain;
mod reply;
mod request;

pub(crate) use plain::*;
pub(crate) use reply::*;
pub(crate) use request::*;
