//! Settlement: what a store records after admission. `Store::settle` on both stores, the
//! arithmetic of charges and refunds at its edges, usage reported by the response through the
//! layer, and settles at the edges (stacked layers, a paused Redis, shutdown).

mod arithmetic;
mod edges;
mod store;
mod usage;
