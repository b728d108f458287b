//! [`ResponseFuture`]: waits for the store's decision, then for the inner service.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::concurrency::holds::{Holds, InLine, Slot, Wait};
use crate::deny_cache::{DenyCache, Ticket};
use crate::metrics::{Report, Started};
use crate::response::{FailureMode, Responder, Tally};
use crate::usage::{Ledger, Metering, StoreLedger, Tab, UsageMeter};
use crate::{Decision, Decisions, Key, Store, StoreError};

/// What a pending decision is about.
pub(crate) struct Check {
    pub(crate) responder: Arc<Responder>,
    pub(crate) key: Key,
    pub(crate) cost: u32,
    /// The request's gRPC content type, for a gRPC request.
    pub(crate) grpc: Option<http::HeaderValue>,
    /// The layer's deny cache, with the ticket taken before the store was asked.
    pub(crate) deny_cache: Option<(DenyCache, Ticket)>,
    /// When the store was asked.
    pub(crate) started: Started,
    /// How usage is settled, and the request's meter, when the layer limits by usage.
    pub(crate) usage: Option<(Arc<Metering>, UsageMeter)>,
    /// The layer's concurrency slots and the store they go back to, when the policy has a
    /// concurrency limit.
    pub(crate) holds: Option<(Arc<Holds>, Arc<dyn Ledger>)>,
}

/// What an admitted request's response gets: the rate-limit fields (unless hidden, or the store
/// failed), and the tab its usage is settled on (when the layer limits by usage); neither by
/// default.
#[derive(Default)]
pub(crate) struct Admitted {
    pub(crate) fields: Option<(Decision, Arc<Responder>)>,
    pub(crate) tab: Option<Box<Tab>>,
    /// The policy and decision for the request's [`Decisions`].
    pub(crate) decided: Option<(Arc<str>, Decision)>,
    /// The concurrency slot the request holds until its response ends.
    pub(crate) slot: Option<Slot>,
}

impl Admitted {
    /// Adds the decision to the request's [`Decisions`], inside those of outer layers.
    pub(crate) fn mark<B>(&mut self, request: &mut Request<B>) {
        if let Some((policy, decision)) = self.decided.take() {
            let decisions = request
                .extensions_mut()
                .get_or_insert_default::<Decisions>();
            decisions.push(policy, decision);
        }
    }
}

/// What to do with a request once its decision is in.
pub(crate) enum Verdict {
    /// Call the inner service, adding these rate-limit fields to its response.
    Call(Admitted),
    /// Answer with the layer's own response (a refusal, or the store failed in closed mode).
    Answer(Response<Full<Bytes>>),
}

impl Check {
    /// Whether requests count only by their outcome: the store only looks before the call.
    pub(crate) fn counts_outcomes(&self) -> bool {
        let usage = self.usage.as_ref();
        usage.is_some_and(|(metering, _)| metering.report.outcome.is_some())
    }

    /// Applies the layer's options to the store's answer: fallback, shadow mode, the deny
    /// cache, the failure mode; logs what an operator should see.
    pub(crate) fn settle(&self, outcome: Result<Decision, StoreError>) -> Verdict {
        let policy = self.responder.policy.name();
        let options = &self.responder.options;
        self.started.finish(&self.responder.policy);
        if outcome.is_err() {
            Report::store_error(&self.responder.policy);
        }
        // The store that decided, when it is not the layer's own: the fallback.
        let mut ledger: Option<Arc<dyn Ledger>> = None;
        let mut slot_ledger = self.holds.as_ref().map(|(_, ledger)| Arc::clone(ledger));
        let outcome = match (outcome, &options.failure_mode) {
            (Err(error), FailureMode::Fallback(local)) => {
                Report::fallback(&self.responder.policy);
                tracing::warn!(
                    target: "tower_redis_ratelimit",
                    policy,
                    key = %self.key.loggable(),
                    %error,
                    "rate-limit store failed; deciding locally"
                );
                let policy = &self.responder.policy;
                if self.usage.is_some() || self.holds.is_some() {
                    ledger = Some(Arc::new(StoreLedger(local.clone())));
                    slot_ledger = slot_ledger.and(ledger.clone());
                }
                match self.counts_outcomes() {
                    true => local.peek(&self.key, policy, self.cost).into_inner(),
                    false => local.check(&self.key, policy, self.cost).into_inner(),
                }
            }
            (outcome, _) => outcome,
        };
        let tab = |d: Decision| {
            let ledger = ledger.clone().filter(|_| self.usage.is_some());
            self.usage.as_ref().map(|(metering, meter)| {
                let about = (self.key.clone(), Arc::clone(&self.responder));
                let cache = self.deny_cache.as_ref().map(|(cache, _)| cache.clone());
                let charged = (d, self.cost);
                Tab::open(
                    Arc::clone(metering),
                    ledger,
                    about,
                    charged,
                    meter.clone(),
                    cache,
                )
            })
        };
        // What goes into the request's `Decisions`, unless the layer turned them off.
        let decided =
            |d: Decision| (!options.no_decisions).then(|| (self.responder.policy.shared_name(), d));
        match outcome {
            Ok(d) if d.is_allowed() => {
                options.tally(&self.responder.policy, &self.key, Tally::Allowed);
                let tab = tab(d);
                let fields = (!options.hide_allowed_headers).then(|| (d, self.responder.clone()));
                let decided = decided(d);
                let slot = self
                    .holds
                    .as_ref()
                    .zip(slot_ledger)
                    .and_then(|((holds, _), ledger)| {
                        holds.hold(&self.key, &self.responder, ledger, d)
                    });
                Verdict::Call(Admitted {
                    fields,
                    tab,
                    decided,
                    slot,
                })
            }
            // Passed on over the limit: shadow mode (logged for the roll-out) or a soft limit
            // (the handler sees it in the decisions).
            Ok(d) if options.shadow || options.soft => {
                let tally = match d.is_concurrency_limit() {
                    true => Tally::DeniedConcurrency,
                    false => Tally::Denied,
                };
                options.tally(&self.responder.policy, &self.key, tally);
                let retry_after_ms = d.retry_after().map(|r| r.as_millis() as u64);
                let key = self.key.loggable();
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
                // Counted by outcome, a request over a soft limit still counts when it matches.
                let counted = !options.shadow && self.counts_outcomes();
                Verdict::Call(Admitted {
                    fields: Some((d, self.responder.clone())),
                    tab: if counted { tab(d) } else { None },
                    decided: decided(d),
                    slot: None,
                })
            }
            Ok(mut d) if d.is_concurrency_limit() => {
                // A slot may free any moment: say when one usually does, and cache nothing.
                options.tally(&self.responder.policy, &self.key, Tally::DeniedConcurrency);
                if let Some((holds, _)) = &self.holds {
                    let retry = holds.retry_after(&self.responder.policy);
                    (d.retry_after, d.reset_after) = (Some(retry), retry);
                }
                tracing::debug!(
                    target: "tower_redis_ratelimit",
                    policy,
                    key = %self.key.loggable(),
                    in_flight = d.limit(),
                    "concurrency limit reached; refused"
                );
                Verdict::Answer(self.responder.rejection(&d, self.grpc.as_ref()))
            }
            Ok(d) => {
                options.tally(&self.responder.policy, &self.key, Tally::Denied);
                tracing::debug!(
                    target: "tower_redis_ratelimit",
                    policy,
                    key = %self.key.loggable(),
                    retry_after_ms = d.retry_after().map(|r| r.as_millis() as u64),
                    "rate limit exceeded; refused"
                );
                if let Some((cache, ticket)) = &self.deny_cache {
                    cache.remember(&self.key, &self.responder.policy, self.cost, d, *ticket);
                }
                Verdict::Answer(self.responder.rejection(&d, self.grpc.as_ref()))
            }
            Err(error) => {
                tracing::warn!(
                    target: "tower_redis_ratelimit",
                    policy,
                    key = %self.key.loggable(),
                    %error,
                    mode = ?options.failure_mode,
                    "rate-limit store failed"
                );
                match options.failure_mode {
                    FailureMode::Closed => {
                        Verdict::Answer(Responder::unavailable(self.grpc.as_ref()))
                    }
                    _ => Verdict::Call(Admitted::default()),
                }
            }
        }
    }
}

pin_project! {
    /// Response future of [`RateLimit`](crate::RateLimit): `Checking` (the store decides) →
    /// `Calling` (the inner service answers) or an answer of the layer's own.
    pub struct ResponseFuture<S, B, F>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B, F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B, F>
    where
        S: Service<Request<B>>,
    {
        Checking {
            #[pin]
            step: Step<F>,
            // Boxed: a request is large, and only a store that waits (or a request waiting for
            // a concurrency slot) gets here; every other state stays small to move.
            pending: Box<Pending<S, B, F>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            admitted: Admitted,
        },
        Answer {
            response: Option<Response<Full<Bytes>>>,
        },
    }
}

pin_project! {
    /// Where a decision stands: asked of the store, or (refused for a concurrency slot, with
    /// `max_wait`) waiting to ask again.
    #[project = StepProj]
    enum Step<F> {
        Deciding {
            #[pin]
            decision: F,
        },
        // Boxed, so that the wait does not make every request's future larger.
        Waiting {
            wait: Pin<Box<Wait>>,
        },
    }
}

/// What waits with a decision: what it is about, and the call to make if it admits.
struct Pending<S, B, F> {
    check: Check,
    call: Option<(S, Request<B>)>,
    /// How a request refused for a concurrency slot waits for one, if the layer lets it.
    waiting: Option<Waiting<F>>,
}

/// Asks the store again for a request waiting for a concurrency slot.
pub(crate) type Recheck<F> = Arc<dyn Fn(&Key, &crate::Policy, u32) -> F + Send + Sync>;

/// A request's wait for a concurrency slot (`RateLimitLayerBuilder::max_wait`): until its
/// deadline, in line behind the requests of its key that came before it on this instance.
pub(crate) struct Waiting<F> {
    recheck: Recheck<F>,
    max_wait: Duration,
    /// Set at the first refusal.
    deadline: Option<Instant>,
    ticket: Option<InLine>,
    /// The latest refusal: the answer once the deadline has passed.
    refusal: Option<Decision>,
}

impl<F> Waiting<F> {
    pub(crate) fn new(recheck: Recheck<F>, max_wait: Duration) -> Self {
        Waiting {
            recheck,
            max_wait,
            deadline: None,
            ticket: None,
            refusal: None,
        }
    }
}

/// How often the first request in line asks the store again while it waits: a slot may free
/// on another instance, or expire, with no give-back here to wake it.
const RECHECK_EVERY: Duration = Duration::from_millis(50);

/// What a waiting request does next.
enum Next<F> {
    /// Ask the store again.
    Recheck(F),
    /// Wait some more.
    Wait(Wait),
    /// The deadline passed: answer this refusal.
    GiveUp(Decision),
}

impl<S, B, F> Pending<S, B, F> {
    /// Starts or goes on waiting when `outcome` refused the request for a concurrency slot and
    /// the layer lets it wait, before its deadline; `None` otherwise (and the request leaves
    /// the line).
    fn wait_for_slot(&mut self, outcome: &Result<Decision, StoreError>) -> Option<Wait> {
        let waiting = self.waiting.as_mut()?;
        let refusal = match outcome {
            Ok(d) if d.is_concurrency_limit() => *d,
            _ => {
                waiting.ticket = None;
                return None;
            }
        };
        let now = Instant::now();
        let later = now.checked_add(waiting.max_wait).unwrap_or(now);
        let deadline = *waiting.deadline.get_or_insert(later);
        let holds = self.check.holds.as_ref().map(|(holds, _)| holds);
        // A wait needs tokio's timer: called outside a runtime, the request is not kept.
        let timer = tokio::runtime::Handle::try_current().is_ok();
        let (Some(holds), true) = (holds, now < deadline && timer) else {
            waiting.ticket = None;
            return None;
        };
        waiting.refusal = Some(refusal);
        let (key, policy) = (&self.check.key, &self.check.responder.policy);
        let ticket = waiting
            .ticket
            .get_or_insert_with(|| holds.queue(key, policy));
        let until = match ticket.is_first() {
            true => deadline.min(now + RECHECK_EVERY),
            false => deadline,
        };
        Some(ticket.wait(until))
    }

    /// What a waiting request does once woken; `None` when it may not wait at all.
    fn after_wait(&mut self) -> Option<Next<F>> {
        let check = &self.check;
        let waiting = self.waiting.as_mut()?;
        let now = Instant::now();
        let deadline = waiting.deadline.unwrap_or(now);
        if let (true, Some(refusal)) = (now >= deadline, waiting.refusal) {
            waiting.ticket = None;
            return Some(Next::GiveUp(refusal));
        }
        Some(match &waiting.ticket {
            Some(ticket) if !ticket.is_first() => Next::Wait(ticket.wait(deadline)),
            _ => Next::Recheck((waiting.recheck)(
                &check.key,
                &check.responder.policy,
                check.cost,
            )),
        })
    }
}

impl<S, B, F> ResponseFuture<S, B, F>
where
    S: Service<Request<B>>,
{
    pub(crate) fn checking(
        decision: F,
        check: Check,
        service: S,
        request: Request<B>,
        waiting: Option<Waiting<F>>,
    ) -> Self {
        let call = Some((service, request));
        ResponseFuture {
            state: State::Checking {
                step: Step::Deciding { decision },
                pending: Box::new(Pending {
                    check,
                    call,
                    waiting,
                }),
            },
        }
    }

    /// A request refused for a concurrency slot by a store that decided at once: it waits
    /// for one (`max_wait`) if it can, and is otherwise answered as any other.
    pub(crate) fn waiting(
        outcome: Result<Decision, StoreError>,
        check: Check,
        mut service: S,
        mut request: Request<B>,
        waiting: Waiting<F>,
    ) -> Self {
        let mut pending = Box::new(Pending {
            check,
            call: None,
            waiting: Some(waiting),
        });
        if let Some(wait) = pending.wait_for_slot(&outcome) {
            pending.call = Some((service, request));
            return ResponseFuture {
                state: State::Checking {
                    step: Step::Waiting {
                        wait: Box::pin(wait),
                    },
                    pending,
                },
            };
        }
        match pending.check.settle(outcome) {
            Verdict::Answer(response) => ResponseFuture::answer(response),
            Verdict::Call(mut admitted) => {
                admitted.mark(&mut request);
                ResponseFuture::reporting(service.call(request), admitted)
            }
        }
    }

    /// Calls the inner service with no decision to report (not limited, or allow-listed).
    pub(crate) fn calling(future: S::Future) -> Self {
        ResponseFuture::reporting(future, Admitted::default())
    }

    /// Calls the inner service, adding rate-limit fields (if any) to its response and
    /// settling its usage (if metered) once its body ends.
    pub(crate) fn reporting(future: S::Future, admitted: Admitted) -> Self {
        ResponseFuture {
            state: State::Calling { future, admitted },
        }
    }

    pub(crate) fn answer(response: Response<Full<Bytes>>) -> Self {
        ResponseFuture {
            state: State::Answer {
                response: Some(response),
            },
        }
    }
}

impl<S, B, F, ResB> Future for ResponseFuture<S, B, F>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    F: Future<Output = Result<Decision, StoreError>>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking { mut step, pending } => {
                    let (outcome, may_wait) = match step.as_mut().project() {
                        StepProj::Waiting { wait } => {
                            ready!(wait.as_mut().poll(cx));
                            match pending.after_wait() {
                                Some(Next::Wait(next)) => {
                                    wait.set(next);
                                    continue;
                                }
                                Some(Next::GiveUp(refusal)) => (Ok(refusal), false),
                                Some(Next::Recheck(decision)) => {
                                    step.set(Step::Deciding { decision });
                                    continue;
                                }
                                // Only a request that may wait gets here; were it not so,
                                // it is decided as a store that failed to answer.
                                None => (Err(StoreError::Unavailable), false),
                            }
                        }
                        StepProj::Deciding { decision } => (ready!(decision.poll(cx)), true),
                    };
                    if may_wait {
                        if let Some(wait) = pending.wait_for_slot(&outcome) {
                            step.set(Step::Waiting {
                                wait: Box::pin(wait),
                            });
                            continue;
                        }
                    }
                    let mut admitted = match pending.check.settle(outcome) {
                        Verdict::Call(admitted) => admitted,
                        Verdict::Answer(response) => {
                            return Poll::Ready(Ok(response.map(ResponseBody::own)))
                        }
                    };
                    let (mut service, mut request) = pending
                        .call
                        .take()
                        .expect("ResponseFuture polled after completion");
                    admitted.mark(&mut request);
                    let future = service.call(request);
                    this.state.set(State::Calling { future, admitted });
                }
                StateProj::Calling { future, admitted } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some((decision, responder)) = admitted.fields.take() {
                        responder.add_headers(response.headers_mut(), &decision);
                    }
                    let tab = admitted.tab.take().map(|mut tab| {
                        tab.read_head(&response);
                        tab
                    });
                    let slot = admitted.slot.take();
                    let body = |body| ResponseBody::metered(body, tab, slot);
                    return Poll::Ready(Ok(response.map(body)));
                }
                StateProj::Answer { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::own)));
                }
            }
        }
    }
}

impl<S, B, F> std::fmt::Debug for ResponseFuture<S, B, F>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
