//! [`RateLimit`]: the service the layer wraps around yours.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tower_service::Service;

use crate::body::ResponseBody;
use crate::future::ResponseFuture;
use crate::future::{Check, Recheck, Verdict, Waiting};
use crate::layer::Config;
use crate::metrics::Started;
use crate::response::{grpc_content_type, MissingKey, Responder, Tally};
use crate::rules::RequestHead;
use crate::usage::UsageMeter;
use crate::{Decision, KeyExtractor, Store};

/// Rate-limits requests to the inner service `S`; made by
/// [`RateLimitLayer`](crate::RateLimitLayer).
///
/// For each request it extracts a key, asks the store, and then calls `S` or answers itself
/// (`429` with `Retry-After`). Readiness is `S`'s: `poll_ready` asks `S`, and `call` moves the
/// service that was made ready into the response future, leaving a clone in its place, so the
/// readiness is not lost while the store decides.
pub struct RateLimit<S, K, St> {
    inner: S,
    config: Arc<Config<K, St>>,
}

impl<S, K, St> RateLimit<S, K, St> {
    pub(crate) fn new(inner: S, config: Arc<Config<K, St>>) -> Self {
        RateLimit { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K, St> Clone for RateLimit<S, K, St> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: std::fmt::Debug, K, St> std::fmt::Debug for RateLimit<S, K, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("rules", &self.config.table)
            .finish_non_exhaustive()
    }
}

impl<S, K, St, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor<ReqB>,
    St: Store,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, St::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqB>) -> Self::Future {
        let config = &self.config;
        // Every request gets a meter, so that a handler can always take it from the extensions;
        // under several usage layers (per API key and per IP, say), all read the same one.
        let meter = config.usage.as_ref().map(|_| {
            let extensions = request.extensions_mut();
            match extensions.get::<UsageMeter>() {
                Some(meter) => meter.clone(),
                None => {
                    let meter = UsageMeter::new();
                    extensions.insert(meter.clone());
                    meter
                }
            }
        });
        let head = RequestHead::of(&request);
        let grpc = grpc_content_type(head.headers);
        let Some(responder) = config.responder(&head) else {
            return ResponseFuture::calling(self.inner.call(request));
        };
        let key = match config.key.extract(&request) {
            Ok(key) => key,
            Err(error) => match &config.missing_key {
                MissingKey::Use(key) => key.clone(),
                MissingKey::Allow => return ResponseFuture::calling(self.inner.call(request)),
                MissingKey::Reject => {
                    return ResponseFuture::answer(Responder::missing_key(&error, grpc.as_ref()))
                }
            },
        };
        if config.allow.contains(&key) {
            return ResponseFuture::calling(self.inner.call(request));
        }
        let cost = config
            .cost
            .as_ref()
            .map_or(config.default_cost, |cost| cost(&head));
        let deny_cache = config
            .deny_cache
            .as_ref()
            .filter(|_| !responder.options.shadow && !responder.options.soft);
        if let Some(refusal) = deny_cache.and_then(|c| c.refusal(&key, &responder.policy, cost)) {
            let options = &responder.options;
            options.tally(&responder.policy, &key, Tally::DeniedCached);
            return ResponseFuture::answer(responder.rejection(&refusal, grpc.as_ref()));
        }
        // Taken before the store is asked, so that a refund sent meanwhile keeps its refusal
        // out of the cache.
        let deny_cache = deny_cache.map(|c| (c.clone(), c.ticket(&key, &responder.policy)));
        let holds = responder.policy.concurrency_limit().map(|_| {
            let ledger = Arc::clone(&config.ledger);
            (Arc::clone(&config.holds), ledger)
        });
        // A request refused for a concurrency slot may wait for one (`max_wait`).
        let options = &responder.options;
        let waits = holds.is_some() && !options.max_wait.is_zero();
        let waiting = (waits && !options.soft && !options.shadow).then(|| {
            let store = config.store.clone();
            let recheck: Recheck<St::Future> =
                Arc::new(move |key, policy, cost| store.check(key, policy, cost));
            Waiting::new(recheck, options.max_wait)
        });
        let check = Check {
            responder,
            key,
            cost,
            grpc,
            deny_cache,
            started: Started::now(),
            usage: config.usage.clone().zip(meter),
            holds,
        };
        // Requests of the key already waiting for a slot here go first: this one takes its place
        // at the back of their line without asking the store, as if refused for a slot.
        let in_line = waiting.is_some()
            && check
                .holds
                .as_ref()
                .is_some_and(|(holds, _)| holds.has_line(&check.key, &check.responder.policy));
        // A store that decides without waiting lets the inner service be called right here,
        // with no clone of it for a later call.
        // Counted by outcome, the store only looks: whether one more would fit.
        let counts_outcomes = check.counts_outcomes();
        let now = match (in_line, counts_outcomes) {
            (true, _) => Some(Ok(Decision::slots_full(
                &check.responder.policy,
                Duration::from_secs(1),
            ))),
            (false, true) => None,
            (false, false) => config
                .store
                .check_now(&check.key, &check.responder.policy, cost),
        };
        if let Some(outcome) = now {
            if let Some(waiting) = waiting.filter(|_| {
                outcome
                    .as_ref()
                    .is_ok_and(|decision| decision.is_concurrency_limit())
            }) {
                let ready = self.take_ready();
                return ResponseFuture::waiting(outcome, check, ready, request, waiting);
            }
            return match check.settle(outcome) {
                Verdict::Call(mut admitted) => {
                    admitted.mark(&mut request);
                    ResponseFuture::reporting(self.inner.call(request), admitted)
                }
                Verdict::Answer(response) => ResponseFuture::answer(response),
            };
        }
        let decision = match counts_outcomes {
            true => config.store.peek(&check.key, &check.responder.policy, cost),
            false => config
                .store
                .check(&check.key, &check.responder.policy, cost),
        };
        let ready = self.take_ready();
        ResponseFuture::checking(decision, check, ready, request, waiting)
    }
}

impl<S: Clone, K, St> RateLimit<S, K, St> {
    /// The inner service that `poll_ready` made ready, for a response future to call later,
    /// leaving a clone in its place.
    fn take_ready(&mut self) -> S {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}
