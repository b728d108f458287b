//! [`Query`]: what one decision is about, from the gate to its verdict, and the verdict: the
//! layer's options applied to the store's answer (fallback store, shadow and soft limits,
//! concurrency refusals, the deny cache, the failure mode), one function per outcome.
//!
//! Under [`FailureMode::Fallback`], each answer of the layer's store is noted in [`Seen`]
//! first, so that while the store fails a key it last refused or spent stays refused until
//! the time it was given, before the fallback store is asked.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::Full;

use super::seen::Seen;
use super::verdict::{Admitted, Verdict};
use crate::decisions::Mark;
use crate::deny_cache::{DenyCache, Stamp};
use crate::ledger::post::{Ledger, StoreLedger};
use crate::ledger::slots::Holds;
use crate::ledger::tab::{Metering, Tab};
use crate::ledger::Receipt;
use crate::metered::{Flow, Meter, Opening, Steps};
use crate::metrics::{Report, Started};
use crate::response::{FailureMode, Responder, Tally};
use crate::usage::UsageMeter;
use crate::{Decision, Key, Store, StoreError, Undecided};

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
    /// Under [`FailureMode::Fallback`], the keys the layer's store last refused or spent.
    pub(crate) seen: Option<Arc<Seen>>,
    /// How the request's body is metered, when the layer meters request bodies.
    pub(crate) steps: Option<Arc<Steps>>,
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

/// The store that decided when it is not the layer's own: the fallback's ledger, where usage
/// or a slot must be settled with it.
type Fallback = Option<Arc<dyn Ledger>>;

impl Query {
    /// Applies the layer's options to the store's answer; logs what an operator should see.
    pub(crate) fn verdict(&self, outcome: Result<Decision, StoreError>) -> Verdict {
        let options = &self.responder.options;
        self.started.finish(&self.responder.policy);
        match &outcome {
            Err(_) => Report::store_error(&self.responder.policy),
            Ok(d) => self.note(d),
        }
        let (outcome, fallback) = self.fall_back(outcome);
        match outcome {
            Ok(d) if d.is_allowed() && self.over_cap_here(&d, fallback.is_some()) => {
                Verdict::Answer(self.slots_full(self.give_back_unused(d)))
            }
            Ok(d) if d.is_allowed() => Verdict::Call(self.admitted(d, fallback)),
            // Passed on over the limit: shadow mode (logged for the roll-out) or a soft limit
            // (the handler sees it in the decisions).
            Ok(d) if options.shadow || options.soft => Verdict::Call(self.passed_over(d, fallback)),
            Ok(d) if d.is_concurrency_limit() => Verdict::Answer(self.slots_full(d)),
            Ok(d) => Verdict::Answer(self.refused(d)),
            Err(error) => self.store_failed(&error),
        }
    }

    /// Under [`FailureMode::Fallback`], notes the layer's store's decision `d`, for the
    /// fallback to keep while the store fails.
    fn note(&self, d: &Decision) {
        if let Some(seen) = &self.seen {
            // Usage is settled after the response, and a metered body refunds what it did not
            // use: the units of an admission may come back.
            let settled = self.usage.is_some() || self.steps.is_some();
            seen.note(&self.key, &self.responder.policy, self.cost, d, settled);
        }
    }

    /// Under [`FailureMode::Fallback`], when the layer's store failed: the refusal still in
    /// force for a key the store last refused or spent, else the local store's decision; with
    /// the ledger that settles with the local store.
    fn fall_back(
        &self,
        outcome: Result<Decision, StoreError>,
    ) -> (Result<Decision, StoreError>, Fallback) {
        let (Err(error), FailureMode::Fallback(local)) =
            (&outcome, &self.responder.options.failure_mode)
        else {
            return (outcome, None);
        };
        let policy = &self.responder.policy;
        Report::fallback(policy);
        tracing::warn!(
            target: "tower_redis_ratelimit",
            policy = policy.name(),
            key = %self.key.loggable(),
            error = %crate::chain::Chain(error),
            "rate-limit store failed; deciding locally"
        );
        let owes = self.usage.is_some() || self.holds.is_some() || self.steps.is_some();
        let ledger = owes.then(|| Arc::new(StoreLedger(local.clone())) as Arc<dyn Ledger>);
        let seen = self.seen.as_ref();
        if let Some(refusal) = seen.and_then(|seen| seen.refusal(&self.key, policy, self.cost)) {
            return (Ok(refusal), ledger);
        }
        let decided = local.check(&self.key, policy, self.cost).into_inner();
        (decided, ledger)
    }

    /// An admitted request: its fields, its decision, its tab and its slot.
    fn admitted(&self, d: Decision, fallback: Fallback) -> Admitted {
        let options = &self.responder.options;
        options.tally(&self.responder.policy, &self.key, Tally::Allowed);
        let slot = self.holds.as_ref().and_then(|(holds, ledger)| {
            let ledger = fallback.clone().unwrap_or_else(|| Arc::clone(ledger));
            holds.hold(&self.key, &self.responder, ledger, d)
        });
        let (meter, flow) = self.meter(d, fallback.clone()).unzip();
        Admitted {
            fields: (!options.hide_allowed_headers).then(|| (d, self.responder.clone())),
            receipt: Receipt {
                tab: self.tab(d, fallback),
                slot,
            },
            entry: self.entry(d),
            meter,
            flow,
        }
    }

    /// A request over the limit passed on: in shadow mode, or under a soft limit.
    fn passed_over(&self, d: Decision, fallback: Fallback) -> Admitted {
        let options = &self.responder.options;
        let tally = match d.is_concurrency_limit() {
            true => Tally::DeniedConcurrency,
            false => Tally::Denied,
        };
        options.tally(&self.responder.policy, &self.key, tally);
        let retry_after_ms = d.retry_after().map(|r| r.as_millis() as u64);
        let (policy, key) = (self.responder.policy.name(), self.key.loggable());
        if options.shadow {
            tracing::info!(
                target: "tower_redis_ratelimit",
                policy,
                key = %key,
                retry_after_ms,
                "rate limit exceeded; passed on (shadow mode)"
            );
        } else {
            tracing::debug!(
                target: "tower_redis_ratelimit",
                policy,
                key = %key,
                retry_after_ms,
                "rate limit exceeded; passed on marked over (soft limit)"
            );
        }
        // Counted by outcome, a request over a soft limit, which reserved nothing, is still
        // charged when it matches: failures past the captcha add up.
        let counted = !options.shadow && self.counts_outcomes();
        // Its body is metered still: its steps are decided and recorded, and passed over too.
        let (meter, flow) = self.meter(d, fallback.clone()).unzip();
        Admitted {
            fields: Some((d, self.responder.clone())),
            receipt: Receipt {
                tab: counted.then(|| self.tab(d, fallback)).flatten(),
                slot: None,
            },
            entry: self.entry(d),
            meter,
            flow,
        }
    }

    /// A refusal for a concurrency slot: a slot may free any moment, so it says when one
    /// usually does, and the deny cache keeps nothing.
    fn slots_full(&self, mut d: Decision) -> Response<Full<Bytes>> {
        let policy = &self.responder.policy;
        self.responder
            .options
            .tally(policy, &self.key, Tally::DeniedConcurrency);
        if let Some(holds) = self.holds() {
            let known = Duration::from_millis(d.hold_ms.into());
            let retry = holds.retry_after(policy, known);
            (d.retry_after, d.reset_after) = (Some(retry), retry);
        }
        tracing::debug!(
            target: "tower_redis_ratelimit",
            policy = policy.name(),
            key = %self.key.loggable(),
            in_flight = d.limit(),
            "concurrency limit reached; refused"
        );
        self.responder.rejection(&d, self.grpc.as_ref())
    }

    /// A refusal by the policy's limits, remembered by the deny cache.
    fn refused(&self, d: Decision) -> Response<Full<Bytes>> {
        let policy = &self.responder.policy;
        self.responder
            .options
            .tally(policy, &self.key, Tally::Denied);
        tracing::debug!(
            target: "tower_redis_ratelimit",
            policy = policy.name(),
            key = %self.key.loggable(),
            retry_after_ms = d.retry_after().map(|r| r.as_millis() as u64),
            "rate limit exceeded; refused"
        );
        // A busy refusal ends with the attempts in flight, sooner than its retry may say.
        if let Some((cache, stamp)) = self.deny_cache.as_ref().filter(|_| !d.is_busy()) {
            cache.remember(&self.key, policy, self.cost, d, *stamp);
        }
        self.responder.rejection(&d, self.grpc.as_ref())
    }

    /// No decision: the layer's failure mode answers.
    fn store_failed(&self, error: &StoreError) -> Verdict {
        let options = &self.responder.options;
        tracing::warn!(
            target: "tower_redis_ratelimit",
            policy = self.responder.policy.name(),
            key = %self.key.loggable(),
            error = %crate::chain::Chain(error),
            mode = ?options.failure_mode,
            "rate-limit store failed"
        );
        let undecided =
            || Admitted::undecided(Arc::clone(&self.responder), Undecided::StoreUnavailable);
        match (&options.failure_mode, &self.holds) {
            (FailureMode::Closed, _) => Verdict::Answer(Responder::unavailable(self.grpc.as_ref())),
            // A concurrency limit holds on each instance alone while the store is out of reach
            // (shadow and soft layers pass the request on at the cap, as over a limit).
            (FailureMode::Open, Some((holds, ledger))) => {
                match holds.hold_alone(&self.key, &self.responder, Arc::clone(ledger)) {
                    Some(slot) => {
                        let mut admitted = undecided();
                        admitted.receipt.slot = Some(slot);
                        Verdict::Call(admitted)
                    }
                    None if options.shadow || options.soft => Verdict::Call(undecided()),
                    None => {
                        let full = Decision::slots_full(&self.responder.policy, Duration::ZERO);
                        Verdict::Answer(self.slots_full(full))
                    }
                }
            }
            _ => Verdict::Call(undecided()),
        }
    }

    /// Whether the store admitted `d` with a slot while this layer already holds the key's
    /// cap, counting the slots it took alone during an outage, which the store does not know
    /// (never with a fallback store's decision).
    fn over_cap_here(&self, d: &Decision, fell_back: bool) -> bool {
        let options = &self.responder.options;
        let passes = options.shadow || options.soft;
        let holds = self
            .holds()
            .filter(|_| d.holds_slot() && !fell_back && !passes);
        holds.is_some_and(|holds| holds.over_cap_with_alone(&self.key, &self.responder))
    }

    /// Gives back what the store gave `d`, unused: its slot and the units it recorded (the
    /// request is refused, and a refused request counts for nothing); returns the refusal for
    /// a slot to answer instead.
    fn give_back_unused(&self, d: Decision) -> Decision {
        if let Some((holds, ledger)) = &self.holds {
            holds.release_unused(&self.key, &self.responder, ledger, &d);
        }
        Decision::slots_full(&self.responder.policy, Duration::ZERO)
    }

    /// Under [`FailureMode::Open`], a store's failure for a request of a policy with a
    /// concurrency limit, while this layer already holds the cap of the key's slots: a refusal
    /// for a slot, which a request allowed to wait for one waits out (see
    /// [`store_failed`](Self::store_failed)); any other outcome as it is.
    pub(crate) fn at_cap_alone(
        &self,
        outcome: Result<Decision, StoreError>,
    ) -> Result<Decision, StoreError> {
        let options = &self.responder.options;
        let (Err(_), FailureMode::Open, Some(holds), false) = (
            &outcome,
            &options.failure_mode,
            self.holds(),
            options.shadow || options.soft,
        ) else {
            return outcome;
        };
        match holds.at_cap(&self.key, &self.responder) {
            true => Ok(Decision::slots_full(&self.responder.policy, Duration::ZERO)),
            false => outcome,
        }
    }

    /// The usage tab of a request `d` admitted, when the layer limits by usage: settled with
    /// the fallback store when it decided.
    fn tab(&self, d: Decision, fallback: Fallback) -> Option<Box<Tab>> {
        let (metering, meter) = self.usage.as_ref()?;
        let about = (self.key.clone(), Arc::clone(&self.responder));
        let cache = self.deny_cache.as_ref().map(|(cache, _)| cache.clone());
        let charged = (d, self.cost);
        Some(Tab::open(
            Arc::clone(metering),
            fallback,
            about,
            charged,
            meter.clone(),
            cache,
        ))
    }

    /// The metering of the body of a request `d` admitted (or passed over), when the layer
    /// meters request bodies: stepped and refunded with the fallback store when it decided.
    fn meter(&self, d: Decision, fallback: Fallback) -> Option<(Meter, Arc<Flow>)> {
        let steps = self.steps.as_ref()?;
        Some(Meter::open(Opening {
            steps,
            key: self.key.clone(),
            responder: Arc::clone(&self.responder),
            fallback,
            deny_cache: self.deny_cache.as_ref().map(|(cache, _)| cache.clone()),
            grpc: self.grpc.clone(),
            first: d,
        }))
    }

    /// The layer's entry for the request's decisions: the decision `d`.
    fn entry(&self, d: Decision) -> Option<(Arc<Responder>, Mark)> {
        Some((Arc::clone(&self.responder), Mark::Decided(d)))
    }
}

#[cfg(test)]
mod tests {
    use http::{Request, StatusCode};

    use super::*;
    use crate::deny_cache::DenyCache;
    use crate::ledger::post::InFlight;
    use crate::ledger::slots::Holds;
    use crate::metrics::Started;
    use crate::response::Options;
    use crate::{Key, MemoryStore, Policy};

    fn query(options: Options) -> Query {
        let policy: Policy = "1/1m".parse().unwrap();
        Query {
            responder: Arc::new(Responder::new(policy, options)),
            key: Key::from("ann"),
            cost: 1,
            grpc: None,
            deny_cache: None,
            started: Started::now(),
            usage: None,
            holds: None,
            seen: None,
            steps: None,
        }
    }

    /// `query` with a deny cache of its own, its stamp taken as the gate takes it.
    fn cached(mut query: Query) -> (Query, DenyCache) {
        let cache = DenyCache::new(100, Arc::new(|| 0));
        let stamp = cache.stamp(&query.key, &query.responder.policy);
        query.deny_cache = Some((cache.clone(), stamp));
        (query, cache)
    }

    /// The store's decisions for `query`'s key: one admitted, then one refused.
    fn decisions(query: &Query) -> (Decision, Decision) {
        let store = MemoryStore::new();
        let decide = || {
            let policy = &query.responder.policy;
            store.check(&query.key, policy, 1).into_inner().unwrap()
        };
        (decide(), decide())
    }

    fn status(verdict: &Verdict) -> Option<StatusCode> {
        match verdict {
            Verdict::Answer(response) => Some(response.status()),
            Verdict::Call(_) => None,
        }
    }

    fn retry_after(verdict: &Verdict) -> Option<&str> {
        match verdict {
            Verdict::Answer(response) => response.headers().get("retry-after")?.to_str().ok(),
            Verdict::Call(_) => None,
        }
    }

    /// The decisions an admitted request carries to the handler.
    fn marked(admitted: &mut Admitted) -> Option<crate::Decisions> {
        let mut request = Request::new(());
        admitted.mark(&mut request);
        request.extensions_mut().remove()
    }

    #[test]
    fn an_admitted_request_gets_its_fields_and_its_decision_unless_turned_off() {
        let shown = query(Options::default());
        let (allowed, _) = decisions(&shown);
        let Verdict::Call(mut admitted) = shown.verdict(Ok(allowed)) else {
            panic!("admitted");
        };
        let decisions = marked(&mut admitted).unwrap();
        assert_eq!(admitted.fields.map(|(d, _)| d), Some(allowed));
        assert_eq!(decisions.get("default"), Some(&allowed));

        let hidden = query(Options {
            hide_allowed_headers: true,
            no_decisions: true,
            ..Options::default()
        });
        let Verdict::Call(mut admitted) = hidden.verdict(Ok(allowed)) else {
            panic!("admitted");
        };
        assert!(marked(&mut admitted).is_none() && admitted.fields.is_none());
    }

    #[test]
    fn a_refusal_answers_429_with_retry_after_and_is_cached() {
        let (refusing, cache) = cached(query(Options::default()));
        let (_, refused) = decisions(&refusing);
        let verdict = refusing.verdict(Ok(refused));
        assert_eq!(status(&verdict), Some(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(retry_after(&verdict), Some("60"));
        let policy = &refusing.responder.policy;
        assert!(cache.refusal(&refusing.key, policy, 1).is_some());
    }

    #[test]
    fn shadow_and_soft_limits_pass_a_refused_request_on_marked_over() {
        for options in [
            Options {
                shadow: true,
                ..Options::default()
            },
            Options {
                soft: true,
                ..Options::default()
            },
        ] {
            let over = query(options);
            let (_, refused) = decisions(&over);
            let Verdict::Call(mut admitted) = over.verdict(Ok(refused)) else {
                panic!("passed on");
            };
            assert!(marked(&mut admitted).unwrap().is_over());
            assert!(admitted.fields.is_some() && admitted.receipt.is_empty());
        }
    }

    #[test]
    fn a_slot_refusal_says_when_a_slot_usually_frees_and_is_never_cached() {
        let (mut full, cache) = cached(query(Options::default()));
        let holds = Arc::new(Holds::new(Arc::new(InFlight::default())));
        let ledger: Arc<dyn Ledger> = Arc::new(StoreLedger(MemoryStore::new()));
        full.holds = Some((holds, ledger));
        let policy = &full.responder.policy;
        let refusal = Decision::slots_full(policy, std::time::Duration::from_secs(30));
        let verdict = full.verdict(Ok(refusal));
        assert_eq!(status(&verdict), Some(StatusCode::TOO_MANY_REQUESTS));
        // No hold time is known yet: one second, not the 30 until the first slot expires.
        assert_eq!(retry_after(&verdict), Some("1"));
        assert!(cache.refusal(&full.key, policy, 1).is_none());
    }

    #[test]
    fn a_store_failure_follows_the_failure_mode() {
        let failed = || Err(StoreError::Unavailable);
        let closed = query(Options {
            failure_mode: FailureMode::Closed,
            ..Options::default()
        });
        let answer = closed.verdict(failed());
        assert_eq!(status(&answer), Some(StatusCode::SERVICE_UNAVAILABLE));

        let open = query(Options::default());
        let Verdict::Call(mut admitted) = open.verdict(failed()) else {
            panic!("failing open calls the service");
        };
        // No decision, and no fields; the handler learns why.
        let decisions = marked(&mut admitted).unwrap();
        assert!(decisions.is_empty() && admitted.fields.is_none());
        let why: Vec<_> = decisions.undecided().collect();
        assert_eq!(why, [("default", Undecided::StoreUnavailable)]);

        let local = MemoryStore::new();
        let fallback = query(Options {
            failure_mode: FailureMode::Fallback(local.clone()),
            ..Options::default()
        });
        let Verdict::Call(mut admitted) = fallback.verdict(failed()) else {
            panic!("the local store admits the first request");
        };
        let decisions = marked(&mut admitted).unwrap();
        assert!(decisions.get("default").is_some_and(|d| d.is_allowed()));
        let refused = fallback.verdict(failed());
        assert_eq!(status(&refused), Some(StatusCode::TOO_MANY_REQUESTS));
    }

    #[tokio::test(start_paused = true)]
    async fn under_fallback_a_key_the_store_refused_stays_refused_while_it_fails() {
        let failed = || Err(StoreError::Unavailable);
        let seen = Arc::new(Seen::new(100));
        let fallback = |key: &str| Query {
            key: Key::from(key),
            seen: Some(Arc::clone(&seen)),
            ..query(Options {
                failure_mode: FailureMode::Fallback(MemoryStore::new()),
                ..Options::default()
            })
        };
        // The store refused ann (1/1m: a minute to wait); bob it has not seen.
        let ann = fallback("ann");
        let (_, refused) = decisions(&ann);
        assert_eq!(
            status(&ann.verdict(Ok(refused))),
            Some(StatusCode::TOO_MANY_REQUESTS)
        );
        tokio::time::advance(Duration::from_millis(20_500)).await;
        // The store fails: ann is refused for what is left of her minute, rounded up.
        let verdict = ann.verdict(failed());
        assert_eq!(status(&verdict), Some(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(retry_after(&verdict), Some("40"));
        let bob = fallback("bob");
        assert!(matches!(bob.verdict(failed()), Verdict::Call(_)));
        // Once her minute is over, the fallback store decides: a budget of its own.
        tokio::time::advance(Duration::from_millis(39_500)).await;
        assert!(matches!(ann.verdict(failed()), Verdict::Call(_)));
        let again = ann.verdict(failed());
        assert_eq!(status(&again), Some(StatusCode::TOO_MANY_REQUESTS));
    }
}
