//! The sliding-window log, on the embedded store and on Redis.

mod memory;
mod redis;
