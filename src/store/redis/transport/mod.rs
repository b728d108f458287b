//! How calls reach Redis: the batcher that sends the requests arriving together as one call
//! (`batch.rs`, one lane per hash tag in a cluster, and `call.rs`, which sends one call and hands
//! each request its answer), the store's own cluster routing (`nodes.rs`, and `ask.rs`, which follows `ASK`
//! during hash slot migrations), and the breaker that fails decisions at once while Redis is
//! out of reach (`health.rs`). What a call holds is `wire/`'s.

pub(crate) mod ask;
pub(crate) mod batch;
pub(crate) mod call;
pub(crate) mod health;
pub(crate) mod nodes;
