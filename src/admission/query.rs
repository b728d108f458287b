//! [`Query`]: what one decision is about, from the gate to its verdict.

use std::sync::Arc;

use crate::deny_cache::{DenyCache, Stamp};
use crate::ledger::post::Ledger;
use crate::ledger::slots::Holds;
use crate::ledger::tab::Metering;
use crate::metrics::Started;
use crate::response::Responder;
use crate::usage::UsageMeter;
use crate::Key;

/// What a decision is about: the policy that applies, the key, the cost, and what the layer
/// does with the answer.
pub(crate) struct Query {
    pub(crate) responder: Arc<Responder>,
    pub(crate) key: Key,
    pub(crate) cost: u32,
    /// The request's gRPC content type, for a gRPC request.
    pub(crate) grpc: Option<http::HeaderValue>,
    /// The layer's deny cache, with the stamp taken before the store was asked.
    pub(crate) deny_cache: Option<(DenyCache, Stamp)>,
    /// When the store was asked.
    pub(crate) started: Started,
    /// How usage is settled, and the request's meter, when the layer limits by usage.
    pub(crate) usage: Option<(Arc<Metering>, UsageMeter)>,
    /// The layer's concurrency slots and the store they go back to, when the policy has a
    /// concurrency limit.
    pub(crate) holds: Option<(Arc<Holds>, Arc<dyn Ledger>)>,
}

impl Query {
    /// Whether requests count only by their outcome ([`UsageReport::count_when`]).
    ///
    /// [`UsageReport::count_when`]: crate::usage::UsageReport::count_when
    pub(crate) fn counts_outcomes(&self) -> bool {
        let usage = self.usage.as_ref();
        usage.is_some_and(|(metering, _)| metering.report.outcome.is_some())
    }

    /// The layer's concurrency slots, when the policy has a concurrency limit.
    pub(crate) fn holds(&self) -> Option<&Arc<Holds>> {
        self.holds.as_ref().map(|(holds, _)| holds)
    }
}
