//! What the layer's responses share: its options, and per policy a [`Responder`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
use http::{Request, Response};

use super::FailureMode;
use crate::decisions::Mark;
use crate::{Decision, Decisions, Policy};

/// Builds the response for a refused request; see
/// [`RateLimitLayerBuilder::on_rejection`](crate::RateLimitLayerBuilder::on_rejection).
pub(crate) type RejectionFn = dyn Fn(&Decision) -> Response<Bytes> + Send + Sync;

/// The layer's choices, set through [`RateLimitLayerBuilder`](crate::RateLimitLayerBuilder).
#[derive(Clone, Default)]
pub(crate) struct Options {
    pub(crate) hide_allowed_headers: bool,
    pub(crate) shadow: bool,
    /// Requests over the limit are passed on, marked, instead of refused (`Rule::soft`).
    pub(crate) soft: bool,
    /// Decisions are not put in the requests' extensions (`RateLimitLayerBuilder::decisions`).
    pub(crate) no_decisions: bool,
    /// How long a request refused for a concurrency slot waits for one
    /// (`RateLimitLayerBuilder::max_wait`); zero: not at all.
    pub(crate) max_wait: Duration,
    pub(crate) on_rejection: Option<Arc<RejectionFn>>,
    pub(crate) failure_mode: FailureMode,
    /// Requests are counted by their outcome (`RateLimitLayerBuilder::count_when`): the
    /// layer's policies keep attempts in flight apart (`Policy::counting_attempts`).
    pub(crate) counts_outcomes: bool,
    /// What the layer's policies count: requests, or bytes of request body.
    pub(crate) unit: Unit,
    #[cfg(feature = "redis")]
    pub(crate) unique: Option<crate::unique::UniqueClients>,
}

/// What a layer's policies count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Unit {
    /// Requests, or the units of a cost or a usage (the draft's `request`, its default).
    #[default]
    Requests,
    /// Bytes of request body (`RateLimitLayerBuilder::request_bytes`): a body larger than a
    /// limit itself is `413 Content Too Large`.
    ContentBytes,
}

/// What became of a decided request, for the counts operators see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tally {
    Allowed,
    /// Refused by the store (or counted as refused in shadow mode).
    Denied,
    /// Refused again by the deny cache.
    DeniedCached,
    /// Refused by the store for a concurrency slot.
    DeniedConcurrency,
}

impl Options {
    /// Counts a decided request in the metrics and, with `unique_clients`, as a unique client
    /// of `policy`.
    pub(crate) fn tally(&self, policy: &crate::Policy, key: &crate::Key, tally: Tally) {
        use crate::metrics::Report;
        match tally {
            Tally::Allowed => Report::allowed(policy),
            Tally::Denied => Report::denied(policy, false),
            Tally::DeniedCached => Report::denied(policy, true),
            Tally::DeniedConcurrency => Report::denied_concurrency(policy),
        }
        #[cfg(feature = "redis")]
        if let Some(unique) = &self.unique {
            unique.record(policy.shared_name(), key, tally != Tally::Allowed);
        }
        #[cfg(not(feature = "redis"))]
        let _ = key;
    }
}

/// Everything a response needs, shared by the layer, its services and their futures.
///
/// Built, and given its header fields, in [`fields`](super::fields); its refusals are in
/// [`refusal`](super::refusal).
pub(crate) struct Responder {
    pub(crate) policy: Policy,
    pub(crate) policy_header: HeaderValue,
    /// The header name of each limit, computed once rather than per response.
    pub(super) limit_names: Vec<String>,
    pub(crate) options: Options,
    /// Whether a request already carried a decision of another policy of this name when this
    /// responder's was added: warned about once.
    pub(super) name_repeated: AtomicBool,
}

impl Responder {
    /// Adds this layer's `entry` to the request's [`Decisions`], inside those of outer
    /// layers (unless the layer turned them off); warns once when a layer outside used the
    /// same policy name, which [`Decisions::get`] then finds instead.
    pub(crate) fn mark<B>(&self, request: &mut Request<B>, entry: Mark) {
        if self.options.no_decisions {
            return;
        }
        let decisions = request
            .extensions_mut()
            .get_or_insert_default::<Decisions>();
        let repeated = decisions.push(self.policy.shared_name(), entry);
        if repeated && !self.name_repeated.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_redis_ratelimit",
                policy = self.policy.name(),
                "two rate-limit layers on one request have policies of the same name: \
                 Decisions::get finds the outer one only; name the policies apart"
            );
        }
    }
}
