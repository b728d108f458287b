//! [`Limiter`]: what a layer decides its requests with, shared by the layer, its clones, the
//! services they made and their futures; and its gate, for one request: rule → key → allow
//! list → deny cache → store.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;

use super::allow::AllowList;
use super::decide::Later;
use super::query::Query;
use super::seen::Seen;
use super::wait::{SlotQueue, Waiting};
use super::{Admission, Admitted};
use crate::deny_cache::{DenyCache, Stamp};
use crate::ledger::post::Ledger;
use crate::ledger::slots::Holds;
use crate::ledger::tab::Metering;
use crate::metered::Steps;
use crate::metrics::Started;
use crate::response::{grpc_content_type, MissingKey, Responder, Tally};
use crate::rules::{PlanFn, RequestHead, RuleTable};
use crate::usage::UsageMeter;
use crate::{Decision, Key, KeyExtractor, Store, StoreError, Undecided};

/// A request's cost, computed from its head.
pub(crate) type CostFn = dyn Fn(&RequestHead<'_>) -> u32 + Send + Sync;

/// A layer's settings and shared state, as its builder made them.
pub(crate) struct Limiter<K, St> {
    pub(crate) key: K,
    pub(crate) store: St,
    /// Which policy applies to a request: first matching rule, then the default; no policy at
    /// all means the request is not limited.
    pub(crate) table: RuleTable,
    /// Which plan a request is on, for policies with plans.
    pub(crate) plan: Option<Arc<PlanFn>>,
    pub(crate) allow: AllowList,
    pub(crate) cost: Option<Arc<CostFn>>,
    /// A request's cost when there is no cost function: 1, or the usage reservation.
    pub(crate) default_cost: u32,
    pub(crate) missing_key: MissingKey,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) usage: Option<Arc<Metering>>,
    /// The concurrency slots of the requests in flight, and the store they go back to.
    pub(crate) holds: Arc<Holds>,
    pub(crate) ledger: Arc<dyn Ledger>,
    /// Under [`FailureMode::Fallback`](crate::FailureMode::Fallback), the keys the store last
    /// refused or spent, which the fallback store refuses too.
    pub(crate) seen: Option<Arc<Seen>>,
    /// How request bodies are metered, when the layer meters them.
    pub(crate) steps: Option<Arc<Steps>>,
}

impl<K, St> Limiter<K, St> {
    /// The responder of the policy (and plan) that applies to `head`, if any.
    pub(crate) fn responder(&self, head: &RequestHead<'_>) -> Option<Arc<Responder>> {
        let table = self.table.load();
        table.responder(head, self.plan.as_deref()).cloned()
    }

    /// The cost of the request with head `head`; on a layer that meters request bodies, its
    /// `declared` length (capped at `u32::MAX`, reserved whole), or one step when it declares
    /// none.
    pub(crate) fn cost(&self, head: &RequestHead<'_>, declared: Option<u64>) -> u32 {
        if let Some(steps) = &self.steps {
            return declared.map_or(steps.step, |length| {
                u32::try_from(length).unwrap_or(u32::MAX)
            });
        }
        self.cost
            .as_ref()
            .map_or(self.default_cost, |cost| cost(head))
    }
}

impl<K, St: Store> Limiter<K, St> {
    /// Admits `request` (its body of `declared` length, when the layer meters bodies), or
    /// answers it, or says what it waits for.
    pub(crate) fn admit<B>(
        &self,
        request: &mut Request<B>,
        declared: Option<u64>,
    ) -> Admission<St::Future>
    where
        K: KeyExtractor<B>,
    {
        let meter = self.meter(request);
        let head = RequestHead::of(request);
        let grpc = grpc_content_type(head.headers);
        let Some(responder) = self.responder(&head) else {
            return Admission::Pass;
        };
        let key = match self.key.extract(request) {
            Ok(key) => key,
            Err(error) => match &self.missing_key {
                MissingKey::Use(key) => key.clone(),
                MissingKey::Allow => return undecided(responder, Undecided::MissingKey),
                MissingKey::Reject => {
                    return Admission::Answer(Responder::missing_key(&error, grpc.as_ref()))
                }
            },
        };
        if self.allow.contains(&key) {
            return undecided(responder, Undecided::AllowListed);
        }
        let cost = self.cost(&head, declared);
        let deny_cache = match self.cached(&responder, &key, cost, grpc.as_ref()) {
            Cached::Miss(deny_cache) => deny_cache,
            Cached::Hit(refusal) => return Admission::Answer(refusal),
        };
        let query = Query {
            usage: self.usage.clone().zip(meter),
            holds: responder
                .policy
                .concurrency_limit()
                .map(|_| (Arc::clone(&self.holds), Arc::clone(&self.ledger))),
            started: Started::now(),
            responder,
            key,
            cost,
            grpc,
            deny_cache,
            seen: self.seen.clone(),
            steps: self.steps.clone(),
        };
        self.ask(query)
    }

    /// The deny cache's refusal of `key`, if it holds one; otherwise the cache with the
    /// stamp taken before the store is asked, so that a refund sent meanwhile keeps its
    /// refusal out of the cache (none in shadow mode or under a soft limit, which refuse
    /// nothing).
    fn cached(
        &self,
        responder: &Responder,
        key: &Key,
        cost: u32,
        grpc: Option<&http::HeaderValue>,
    ) -> Cached {
        let options = &responder.options;
        let Some(cache) = self
            .deny_cache
            .as_ref()
            .filter(|_| !options.shadow && !options.soft)
        else {
            return Cached::Miss(None);
        };
        let policy = &responder.policy;
        if let Some(refusal) = cache.refusal(key, policy, cost) {
            options.tally(policy, key, Tally::DeniedCached);
            return Cached::Hit(responder.rejection(&refusal, grpc));
        }
        Cached::Miss(Some((cache.clone(), cache.stamp(key, policy))))
    }

    /// The request's usage meter, when the layer limits by usage: every request gets one, so
    /// that a handler can always take it from the extensions; under several usage layers (per
    /// API key and per IP, say), all read the same one.
    fn meter<B>(&self, request: &mut Request<B>) -> Option<UsageMeter> {
        self.usage.as_ref()?;
        let extensions = request.extensions_mut();
        Some(match extensions.get::<UsageMeter>() {
            Some(meter) => meter.clone(),
            None => {
                let meter = UsageMeter::new();
                extensions.insert(meter.clone());
                meter
            }
        })
    }

    /// The store's decision: at once when the store decides without waiting, later
    /// otherwise. A request that may wait for a concurrency slot asks as a waiter, so that
    /// the store serves the key's waiters, here and on other instances, before it.
    fn ask(&self, query: Query) -> Admission<St::Future> {
        let (key, policy, cost) = (&query.key, &query.responder.policy, query.cost);
        if let Some(mut waiting) = self.waiting(&query) {
            let decision = waiting.ask(&query);
            return Admission::Later(Later::asking(decision, query, Some(waiting)));
        }
        match self.store.check_now(key, policy, cost) {
            Some(outcome) => decided(query, outcome),
            None => {
                let decision = self.store.check(key, policy, cost);
                Admission::Later(Later::asking(decision, query, None))
            }
        }
    }

    /// How the request may wait for a concurrency slot when refused for one
    /// ([`max_wait`](crate::RateLimitLayerBuilder::max_wait)); `None` when it may not.
    fn waiting(&self, query: &Query) -> Option<Waiting<St::Future>> {
        let options = &query.responder.options;
        let waits = !options.max_wait.is_zero() && !options.soft && !options.shadow;
        let (holds, _) = query.holds.as_ref().filter(|_| waits)?;
        let waiter = holds.queues().waiter(options.max_wait);
        let store: Arc<dyn SlotQueue<St::Future>> = Arc::new(self.store.clone());
        Some(Waiting::new(store, waiter))
    }
}

/// What the deny cache answered.
enum Cached {
    /// A refusal it repeats.
    Hit(Response<Full<Bytes>>),
    /// Nothing: the store decides, with the cache and its stamp, if the layer has one.
    Miss(Option<(DenyCache, Stamp)>),
}

/// A request passed on without a decision of the store, for the reason `why`.
fn undecided<F>(responder: Arc<Responder>, why: Undecided) -> Admission<F> {
    Admission::Call(Admitted::undecided(responder, why))
}

/// The verdict on a request the store decided at once.
fn decided<F>(query: Query, outcome: Result<Decision, StoreError>) -> Admission<F> {
    let outcome = query.at_cap_alone(outcome);
    query.verdict(outcome).into()
}

#[cfg(test)]
mod tests {
    use std::task::Context;
    use std::time::Duration;

    use http::{HeaderName, StatusCode};

    use super::*;
    use crate::admission::{Deciding, Verdict};
    use crate::key::Header;
    use crate::{Decisions, MemoryStore, RateLimitLayer, RateLimitLayerBuilder, Rule};

    fn user(name: &str) -> Request<()> {
        let request = Request::builder().uri("/login");
        let request = match name {
            "" => request,
            name => request.header("x-user", name),
        };
        request.body(()).unwrap()
    }

    fn builder() -> RateLimitLayerBuilder<Header, MemoryStore> {
        let header = Header::new(HeaderName::from_static("x-user"));
        RateLimitLayer::builder().key(header)
    }

    /// The status of an answer, or `None` for a call of the inner service.
    fn answered(admission: Admission<impl Sized>) -> Option<StatusCode> {
        match admission {
            Admission::Answer(response) => Some(response.status()),
            Admission::Pass | Admission::Call(_) | Admission::Later(_) => None,
        }
    }

    /// What an admission passed on without a decision tells the handler: each layer's
    /// policy and why it did not decide.
    fn undecided_because(admission: Admission<impl Sized>) -> Vec<(String, Undecided)> {
        let Admission::Call(mut admitted) = admission else {
            panic!("passed on");
        };
        assert!(admitted.receipt.is_empty() && admitted.fields.is_none());
        let mut request = user("");
        admitted.mark(&mut request);
        let decisions = request.extensions().get::<Decisions>().unwrap();
        assert!(decisions.is_empty() && !decisions.is_over());
        let why = decisions.undecided();
        why.map(|(policy, why)| (policy.to_owned(), why)).collect()
    }

    #[test]
    fn a_request_no_rule_matches_passes_without_a_decision() {
        let layer = builder()
            .rule(Rule::new("1/1m").path("/api/*"))
            .build()
            .unwrap();
        let mut request = user("ann");
        let admission = layer.limiter().admit(&mut request, None);
        assert!(matches!(admission, Admission::Pass));
        assert!(request.extensions().get::<Decisions>().is_none());
    }

    #[test]
    fn the_store_admits_then_refuses_with_fields_and_a_decision() {
        let layer = builder().policy("1/1m").build().unwrap();
        let Admission::Call(mut admitted) = layer.limiter().admit(&mut user("ann"), None) else {
            panic!("the first request is admitted at once by the memory store");
        };
        let mut request = user("ann");
        admitted.mark(&mut request);
        let decisions = request.extensions().get::<Decisions>().unwrap();
        assert_eq!(decisions.get("default").unwrap().remaining(), 0);
        assert!(admitted.fields.is_some());
        let refused = layer.limiter().admit(&mut user("ann"), None);
        assert_eq!(answered(refused), Some(StatusCode::TOO_MANY_REQUESTS));
        // Another key has its own count.
        assert!(matches!(
            layer.limiter().admit(&mut user("bob"), None),
            Admission::Call(_)
        ));
    }

    #[test]
    fn a_missing_key_is_refused_let_through_or_counted_as_told() {
        let reject = builder().policy("1/1m").build().unwrap();
        let answer = reject.limiter().admit(&mut user(""), None);
        assert_eq!(answered(answer), Some(StatusCode::BAD_REQUEST));

        let allow = builder()
            .policy("1/1m")
            .on_missing_key(MissingKey::Allow)
            .build()
            .unwrap();
        for _ in 0..3 {
            let why = undecided_because(allow.limiter().admit(&mut user(""), None));
            assert_eq!(why, [("default".to_owned(), Undecided::MissingKey)]);
        }

        let shared = builder()
            .policy("1/1m")
            .on_missing_key(MissingKey::Use(Key::from("anonymous")))
            .build()
            .unwrap();
        assert!(matches!(
            shared.limiter().admit(&mut user(""), None),
            Admission::Call(_)
        ));
        let second = shared.limiter().admit(&mut user(""), None);
        assert_eq!(answered(second), Some(StatusCode::TOO_MANY_REQUESTS));
    }

    #[test]
    fn an_allow_listed_key_is_never_counted() {
        let layer = builder().policy("1/1m").allow_key("ops").build().unwrap();
        for _ in 0..3 {
            let why = undecided_because(layer.limiter().admit(&mut user("ops"), None));
            assert_eq!(why, [("default".to_owned(), Undecided::AllowListed)]);
        }
        assert!(matches!(
            layer.limiter().admit(&mut user("ann"), None),
            Admission::Call(_)
        ));
    }

    #[test]
    fn the_deny_cache_answers_a_refused_key_without_the_store() {
        let store = MemoryStore::new();
        let layer = builder()
            .store(store.clone())
            .policy("1/1m")
            .deny_cache(100)
            .build()
            .unwrap();
        let limiter = layer.limiter();
        assert!(matches!(
            limiter.admit(&mut user("ann"), None),
            Admission::Call(_)
        ));
        let refused = limiter.admit(&mut user("ann"), None);
        assert_eq!(answered(refused), Some(StatusCode::TOO_MANY_REQUESTS));
        // The store forgets the key; the cache, asked first, still refuses it.
        let policy = layer.policy().unwrap();
        store
            .reset(&Key::from("ann"), &policy)
            .into_inner()
            .unwrap();
        let cached = limiter.admit(&mut user("ann"), None);
        assert_eq!(answered(cached), Some(StatusCode::TOO_MANY_REQUESTS));
    }

    #[test]
    fn counted_by_outcome_an_attempt_holds_a_unit_from_its_admission() {
        let layer = builder()
            .policy("1/1m")
            .count_when(|head| head.status == StatusCode::UNAUTHORIZED)
            .build()
            .unwrap();
        let Admission::Call(attempt) = layer.limiter().admit(&mut user("ann"), None) else {
            panic!("the first attempt is admitted");
        };
        assert!(attempt.receipt.tab.is_some());
        // Its outcome is not in: a second attempt finds no unit left.
        let second = layer.limiter().admit(&mut user("ann"), None);
        assert_eq!(answered(second), Some(StatusCode::TOO_MANY_REQUESTS));
    }

    #[test]
    fn a_policy_without_rate_limits_is_decided_by_its_slots_alone() {
        let policy = crate::Policy::new("streams", [])
            .unwrap()
            .concurrency(2)
            .unwrap();
        let layer = builder().policy(policy).build().unwrap();
        let limiter = layer.limiter();
        let mut held = Vec::new();
        for _ in 0..2 {
            let Admission::Call(mut admitted) = limiter.admit(&mut user("ann"), None) else {
                panic!("a slot is free");
            };
            assert!(admitted.receipt.slot.is_some());
            let mut request = user("ann");
            admitted.mark(&mut request);
            let decisions = request.extensions().get::<Decisions>().unwrap();
            let decision = decisions.get("streams").unwrap();
            assert!(decision.is_allowed() && decision.is_concurrency_limit());
            assert_eq!((decision.limit(), decision.window()), (2, Duration::ZERO));
            // The fields name the concurrency quota, and count no rate.
            let (d, responder) = admitted.fields.take().unwrap();
            let mut headers = http::HeaderMap::new();
            responder.add_headers(&mut headers, &d);
            assert!(headers["ratelimit-policy"]
                .to_str()
                .unwrap()
                .contains("concurrent-requests"));
            assert!(headers.get("ratelimit").is_none());
            held.push(admitted);
        }
        // Both slots held: refused for a slot, whatever the rate.
        let refused = limiter.admit(&mut user("ann"), None);
        assert_eq!(answered(refused), Some(StatusCode::TOO_MANY_REQUESTS));
        // Another key has its own slots; a slot released admits again.
        assert!(matches!(
            limiter.admit(&mut user("bob"), None),
            Admission::Call(_)
        ));
        drop(held.pop());
        assert!(matches!(
            limiter.admit(&mut user("ann"), None),
            Admission::Call(_)
        ));
    }

    #[test]
    fn a_policy_without_rate_limits_needs_a_concurrency_limit_and_takes_no_box() {
        let bare = crate::Policy::new("nothing", []).unwrap();
        let built = builder().policy(bare.clone()).build();
        assert!(matches!(built, Err(crate::BuildError::Unsupported { .. })));
        let boxed = bare
            .concurrency(1)
            .unwrap()
            .block_for(Duration::from_secs(60))
            .unwrap();
        let built = builder().policy(boxed).build();
        assert!(matches!(built, Err(crate::BuildError::Unsupported { .. })));
    }

    #[tokio::test]
    async fn a_request_refused_for_a_slot_waits_in_the_queue_for_one() {
        // With a rate limit, and with none: an admission is never taken for a refusal.
        let limits: [Vec<crate::Limit>; 2] = [vec!["100/1m".parse().unwrap()], vec![]];
        for limits in limits {
            let policy = crate::Policy::new("streams", limits)
                .unwrap()
                .concurrency(1)
                .unwrap();
            let layer = builder()
                .policy(policy)
                .max_wait(Duration::from_secs(1))
                .build()
                .unwrap();
            let limiter = layer.limiter();
            // A request that may wait asks the store as a waiter, so its decision comes later.
            let Admission::Later(first) = limiter.admit(&mut user("ann"), None) else {
                panic!("a request that may wait is decided later");
            };
            let mut first = std::pin::pin!(Deciding::new(first, ()));
            let verdict = std::future::poll_fn(|cx| first.as_mut().poll_verdict(cx)).await;
            let Some((Verdict::Call(first), ())) = verdict else {
                panic!("the first request takes the slot");
            };
            assert!(first.receipt.slot.is_some());
            let Admission::Later(second) = limiter.admit(&mut user("ann"), None) else {
                panic!("the second waits for the slot");
            };
            let mut second = Box::pin(Deciding::new(second, ()));
            let waker = std::task::Waker::noop();
            assert!(second
                .as_mut()
                .poll_verdict(&mut Context::from_waker(waker))
                .is_pending());
            // The first response ends: its slot goes back, and the second takes it.
            drop(first);
            let verdict = std::future::poll_fn(|cx| second.as_mut().poll_verdict(cx)).await;
            let Some((Verdict::Call(admitted), ())) = verdict else {
                panic!("the second request gets the slot given back");
            };
            assert!(admitted.receipt.slot.is_some());
        }
    }
}
