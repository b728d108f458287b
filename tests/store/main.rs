//! What the stores decide and record: the algorithms on both stores, decisions batched to
//! Redis, unique clients, leases, and settlement (charges and refunds after the response).

#[path = "../support/mod.rs"]
mod support;

mod batching;
mod conformance;
mod event_time;
mod expiry_kept;
mod field_fixes;
mod field_pressure;
mod leases;
mod log_seeded;
mod log_trims;
mod mixed_stores;
mod plain_arguments;
mod plain_tier;
mod plain_tier_fast;
mod plain_tier_field;
mod settlement;
mod sliding_log;
mod steps;
mod unique_clients;
