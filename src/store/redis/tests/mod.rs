//! Tests of the Redis store's models, run without Redis: the scripts' arithmetic against the
//! memory store's (`differential.rs`), and the lease bookkeeping on a virtual clock
//! (`lease_model.rs`).

mod differential;
mod lease_model;
mod line;
mod steps;
