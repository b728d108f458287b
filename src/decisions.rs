//! [`Decisions`]: what the layers decided about a request, for its handler.

use std::sync::Arc;

use crate::Decision;

/// What the rate-limit layers decided about a request, found in its extensions by the
/// handler (`Extension<Decisions>` in axum): one entry per layer the request passed, outermost
/// first, each with the policy that applied. A handler can show the quota left, or, under a
/// [soft](crate::Rule::soft) policy, see that the key is over its limit and ask for a captcha
/// instead of refusing.
///
/// Every request a layer passes on carries `Decisions`, so that `Extension<Decisions>` never
/// fails because of the limiter: a layer whose store decided adds its decision, the same that
/// its `RateLimit` fields describe; a layer that passed the request on without a decision
/// (the key is allow-listed, the request had no key and such requests are let through, or the
/// store failed and the layer fails open) adds an entry saying why, read with
/// [`undecided`](Decisions::undecided). [`get`](Decisions::get), [`iter`](Decisions::iter) and
/// [`is_over`](Decisions::is_over) see decisions only. A request that no rule of a layer
/// applies to gets no entry from it: where no layer may apply, take
/// `Option<Extension<Decisions>>`. (Layers built with
/// [`decisions(false)`](crate::RateLimitLayerBuilder::decisions) add nothing.)
///
/// **Name your policies apart** when several layers decide one request: `get` finds the
/// outermost layer whose policy has the name, so two layers whose policies are both
/// `"default"` hide the inner one from it. A layer that finds its policy's name already there
/// logs a warning (once per layer and policy); [`iter`](Decisions::iter) still shows both.
///
/// ```
/// use axum::{routing::get, Extension, Router};
/// use tower_redis_ratelimit::{Decisions, RateLimitLayer};
///
/// async fn handler(Extension(decisions): Extension<Decisions>) -> String {
///     match decisions.get("default") {
///         Some(d) => format!("{} of {} left", d.remaining(), d.limit()),
///         None => "not limited".into(),
///     }
/// }
///
/// let app: Router = Router::new()
///     .route("/", get(handler))
///     .layer(RateLimitLayer::builder().policy("100/1m").build()?);
/// # Ok::<(), tower_redis_ratelimit::BuildError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Decisions {
    // The first entry inline: one layer, the common case, allocates no list.
    first: Option<(Arc<str>, Mark)>,
    rest: Vec<(Arc<str>, Mark)>,
}

/// Why a layer passed a request on without a decision of its store: the entry it puts in the
/// request's [`Decisions`] instead of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Undecided {
    /// The key is on the layer's allow list
    /// ([`allow_key`](crate::RateLimitLayerBuilder::allow_key),
    /// [`allow_network`](crate::RateLimitLayerBuilder::allow_network)).
    AllowListed,
    /// The request had no key, and the layer lets such requests through
    /// ([`MissingKey::Allow`](crate::response::MissingKey::Allow)).
    MissingKey,
    /// The store could not decide, and the layer fails open
    /// ([`FailureMode::Open`](crate::FailureMode::Open)).
    StoreUnavailable,
}

/// One layer's mark on a request, in its [`Decisions`]: the decision of the layer's store, or
/// why there is none.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mark {
    Decided(Decision),
    Undecided(Undecided),
}

impl Decisions {
    /// Adds the entry of a layer inside the ones already there; whether an entry of the same
    /// policy name was there already.
    pub(crate) fn push(&mut self, policy: Arc<str>, entry: Mark) -> bool {
        let repeated = self.entries().any(|(name, _)| **name == *policy);
        match self.first {
            None => self.first = Some((policy, entry)),
            Some(_) => self.rest.push((policy, entry)),
        }
        repeated
    }

    fn entries(&self) -> impl Iterator<Item = &(Arc<str>, Mark)> {
        self.first.iter().chain(&self.rest)
    }

    /// Each deciding layer's policy name and decision, outermost layer first.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Decision)> {
        self.entries().filter_map(|(policy, entry)| match entry {
            Mark::Decided(decision) => Some((&**policy, decision)),
            Mark::Undecided(_) => None,
        })
    }

    /// The decision of the (outermost) layer whose policy is named `policy`.
    pub fn get(&self, policy: &str) -> Option<&Decision> {
        self.iter().find(|(p, _)| *p == policy).map(|(_, d)| d)
    }

    /// What the request may still use under the (outermost) layer whose policy is named
    /// `policy`: its own reservation ([`Decision::reserved`]) plus what remains after it
    /// ([`Decision::remaining`]), in the policy's units, across all its limits (the decision
    /// describes the one with the fewest units left). [`remaining`](Decision::remaining) alone
    /// leaves out what the request itself holds: a handler that stops an upload at it cuts the
    /// upload short by its reservation.
    ///
    /// A request passed on over a [soft](crate::Rule::soft) limit (or in shadow mode) holds
    /// nothing, and may use what remains (usually 0). A policy with no rate limit, only a
    /// [concurrency](crate::Policy::concurrency) limit, does not bound usage: `u64::MAX`.
    /// `None` when no layer of that name decided the request (none applied, or it passed the
    /// request on undecided: [`undecided`](Self::undecided)).
    ///
    /// Like every entry, it is a snapshot taken at admission: other requests of the key may
    /// use the remainder meanwhile, so it is what this request may use at most, not what it
    /// is sure to get.
    ///
    /// ```
    /// use axum::{routing::post, Extension, Router};
    /// use tower_redis_ratelimit::{usage::UsageReport, Decisions, RateLimitLayer};
    ///
    /// // Uploads of at most 1 MB an hour; each reserves 64 KiB and is charged what it stores.
    /// async fn upload(Extension(decisions): Extension<Decisions>) -> String {
    ///     let allowance = decisions.allowance("uploads").unwrap_or(0);
    ///     format!("you may store {allowance} more bytes")
    /// }
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .policy(tower_redis_ratelimit::Policy::new("uploads", ["1000000/1h".parse()?])?)
    ///     .usage(UsageReport::new().reserve(65_536))
    ///     .build()?;
    /// let app: Router = Router::new().route("/upload", post(upload)).layer(layer);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn allowance(&self, policy: &str) -> Option<u64> {
        let decision = self.get(policy)?;
        if decision.is_allowed() && decision.is_concurrency_limit() {
            return Some(u64::MAX);
        }
        Some(decision.reserved().saturating_add(decision.remaining()))
    }

    /// Whether any layer found the key over its limit: a request passed on by a soft policy
    /// (or in shadow mode) that would otherwise have been refused. A refusal only attempts in
    /// flight cause ([`Decision::is_busy`]) is not over: see [`is_busy`](Self::is_busy).
    pub fn is_over(&self) -> bool {
        self.iter().any(|(_, d)| !d.is_allowed() && !d.is_busy())
    }

    /// Whether a layer that counts requests by their outcome would have refused the request
    /// only because attempts of its key are still in flight ([`Decision::is_busy`]): the
    /// outcomes counted so far leave room for it. Under a soft login limit, such a request is
    /// a user's own concurrent attempts (a double-clicked form, an app's retries), no reason
    /// for a captcha.
    pub fn is_busy(&self) -> bool {
        self.iter().any(|(_, d)| !d.is_allowed() && d.is_busy())
    }

    /// The layers that passed the request on without a decision, outermost first: each
    /// one's policy name, and why.
    pub fn undecided(&self) -> impl Iterator<Item = (&str, Undecided)> {
        self.entries().filter_map(|(policy, entry)| match entry {
            Mark::Decided(_) => None,
            Mark::Undecided(why) => Some((&**policy, *why)),
        })
    }

    /// Whether no layer decided the request.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }
}
