//! One request's metering: its [`Meter`] (the credit its body draws on, and the store it
//! decides and refunds with), and the [`Flow`] the meter shares with the response future,
//! which learns there whether the body was cut and answers for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body_util::Full;

use crate::deny_cache::DenyCache;
use crate::ledger::post::{InFlight, Ledger, Posting, Stepping, StoreLedger};
use crate::ledger::steps::{Credit, OnFailure};
use crate::metrics::Report;
use crate::response::{FailureMode, Refused, Responder, Tally};
use crate::usage::QuotaExceeded;
use crate::{Decision, Key, StoreError};

/// What a layer that meters request bodies gives each one: its step, and where its refunds
/// are counted while under way.
pub(crate) struct Steps {
    pub(crate) step: u32,
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) in_flight: Arc<InFlight>,
}

/// Why a body was cut, for its error and the layer's answer.
// Set once per cut body, in the flow it already allocated: boxing would cost a second
// allocation for nothing.
#[allow(clippy::large_enum_variant)]
enum Cut {
    /// A step was refused: the decision to answer with (what a retry of the body would get,
    /// or the step's refusal), and the error the handler sees.
    Quota(Decision, QuotaExceeded),
    /// The store failed and the layer fails closed.
    Unavailable,
}

/// What a metered body shares with its response future: whether it was cut, and what the
/// layer answers then.
pub(crate) struct Flow {
    responder: Arc<Responder>,
    grpc: Option<HeaderValue>,
    cut: OnceLock<Cut>,
}

impl Flow {
    /// The layer's answer for a cut body, replacing the handler's response: `413` when the
    /// body can never fit, `429` with `Retry-After` when a wait helps (gRPC:
    /// `RESOURCE_EXHAUSTED`), `503` when the store failed; `None` when it was not cut. Not
    /// marked [`Refused`]: the service was called, and an outer usage layer settles as usual.
    pub(crate) fn answer(&self) -> Option<Response<Full<Bytes>>> {
        let grpc = self.grpc.as_ref();
        let mut response = match self.cut.get()? {
            Cut::Quota(decision, _) => self.responder.rejection(decision, grpc),
            Cut::Unavailable => Responder::unavailable(grpc),
        };
        response.extensions_mut().remove::<Refused>();
        Some(response)
    }

    /// The error of a cut body, made again for each poll after the cut.
    pub(crate) fn error(&self) -> Option<super::BoxError> {
        Some(match self.cut.get()? {
            Cut::Quota(_, exceeded) => Box::new(exceeded.clone()),
            Cut::Unavailable => Box::new(StoreError::Unavailable),
        })
    }
}

/// A decision under way: a step of `units` while `held` bytes wait, or, after the step's
/// refusal `refused`, the look at what the body would need.
pub(crate) struct Asking {
    units: u32,
    held: u64,
    refused: Option<Decision>,
    future: Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send>>,
}

impl Asking {
    /// Polls the decision under way.
    pub(crate) fn poll(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<Decision, StoreError>> {
        self.future.as_mut().poll(cx)
    }
}

/// The metering of one request body: its credit, and what it decides and refunds with.
/// Dropping it refunds the credit left (a body dropped unread gives back all of it).
// Public in a private module: named by `Bodies::wrap`, which users cannot call.
pub struct Meter {
    flow: Arc<Flow>,
    key: Key,
    /// The store that decided the request (the fallback's, where it did).
    ledger: Arc<dyn Ledger>,
    in_flight: Arc<InFlight>,
    deny_cache: Option<DenyCache>,
    credit: Credit,
    /// Set once a step is refused: the body is read on, unpassed, to learn its size.
    reading: Option<Reading>,
}

/// A refused body read to its end (or past the count that refused it) before the cut, so
/// that the answer is about the whole body: `413` when it can never fit, else a
/// `Retry-After` after which all of it is admitted.
struct Reading {
    refused: Decision,
    /// The body's bytes so far: passed, held, and read since the refusal.
    seen: u64,
}

impl std::fmt::Debug for Meter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meter")
            .field("policy", &self.flow.responder.policy.name())
            .finish_non_exhaustive()
    }
}

/// What a request's metering starts from: what was decided, about whom, and how.
pub(crate) struct Opening<'a> {
    pub(crate) steps: &'a Steps,
    pub(crate) key: Key,
    pub(crate) responder: Arc<Responder>,
    /// The fallback store's ledger, where it decided.
    pub(crate) fallback: Option<Arc<dyn Ledger>>,
    pub(crate) deny_cache: Option<DenyCache>,
    pub(crate) grpc: Option<HeaderValue>,
    /// The admission's decision: the first credit (none when it refused, passed over).
    pub(crate) first: Decision,
}

impl Meter {
    /// The meter of a request body, and the flow its response future watches.
    pub(crate) fn open(opening: Opening<'_>) -> (Meter, Arc<Flow>) {
        let flow = Arc::new(Flow {
            responder: opening.responder,
            grpc: opening.grpc,
            cut: OnceLock::new(),
        });
        let steps = opening.steps;
        let meter = Meter {
            flow: Arc::clone(&flow),
            key: opening.key,
            ledger: opening
                .fallback
                .unwrap_or_else(|| Arc::clone(&steps.ledger)),
            in_flight: Arc::clone(&steps.in_flight),
            deny_cache: opening.deny_cache,
            credit: Credit::new(steps.step, opening.first),
            reading: None,
        };
        (meter, flow)
    }

    /// The error of a cut body.
    pub(crate) fn cut(&self) -> Option<super::BoxError> {
        self.flow.error()
    }

    /// How many of `units` may pass now, counted as used.
    pub(crate) fn cover(&mut self, units: u64) -> u64 {
        self.credit.cover(units)
    }

    /// Asks a step for a frame of which `held` bytes are not covered: decided in place
    /// where the store needs no waiting, else the decision to poll.
    pub(crate) fn step(&mut self, held: u64) -> Option<Asking> {
        self.ask(self.credit.ask(held, false), held)
    }

    /// Asks a step of `units` for a frame of which `held` bytes are not covered.
    fn ask(&mut self, units: u32, held: u64) -> Option<Asking> {
        let policy = &self.flow.responder.policy;
        match self.ledger.step(&self.key, policy, units) {
            Stepping::Now(outcome) => self.stepped(units, held, outcome),
            Stepping::Later(future) => Some(Asking {
                units,
                held,
                refused: None,
                future,
            }),
        }
    }

    /// Takes in the outcome of a decision that was polled; the next one to poll, if any.
    pub(crate) fn decided(
        &mut self,
        asking: Asking,
        outcome: Result<Decision, StoreError>,
    ) -> Option<Asking> {
        match asking.refused {
            None => self.stepped(asking.units, asking.held, outcome),
            Some(refused) => {
                self.cut_by(refused, outcome);
                None
            }
        }
    }

    /// Takes in a step's outcome: admitted, it adds to the credit; refused, the body is cut
    /// (passed on over a soft or shadow limit), once the store said what a retry of the body
    /// would get; failed, the layer's failure mode says.
    fn stepped(
        &mut self,
        units: u32,
        held: u64,
        outcome: Result<Decision, StoreError>,
    ) -> Option<Asking> {
        let responder = Arc::clone(&self.flow.responder);
        let options = &responder.options;
        match outcome {
            Ok(d) if d.is_allowed() => {
                self.credit.granted(d);
                None
            }
            Ok(_) if options.soft || options.shadow => {
                tracing::debug!(
                    target: "tower_redis_ratelimit",
                    policy = responder.policy.name(),
                    key = %self.key.loggable(),
                    passed = self.credit.passed(),
                    "rate limit exceeded by a request body; passed on (soft limit or shadow mode)"
                );
                options.tally(&responder.policy, &self.key, Tally::Denied);
                // Recorded nothing: the step's units pass uncounted.
                self.credit.uncounted(units);
                None
            }
            // A step larger than what is left was refused: a step of what is left (at most
            // the bytes waiting) fits, so a body near the quota gets all of it. Each such step
            // asks fewer units than the last, so the asking ends.
            Ok(d) if d.remaining() > 0 && d.remaining() < u64::from(units) && held > 0 => {
                let units = d.remaining().min(held);
                self.ask(u32::try_from(units).unwrap_or(u32::MAX), held)
            }
            Ok(d) => {
                let seen = self.credit.passed().saturating_add(held);
                self.reading = Some(Reading { refused: d, seen });
                None
            }
            Err(error) => self.failed(units, held, &error),
        }
    }

    /// Whether the body is being read on after a refused step, before it is cut.
    pub(crate) fn is_reading(&self) -> bool {
        self.reading.is_some()
    }

    /// Counts `bytes` read on after the refusal; whether the body is now known to be more
    /// than the refusing limit counts (no need to read further).
    pub(crate) fn read(&mut self, bytes: u64) -> bool {
        let Some(reading) = self.reading.as_mut() else {
            return true;
        };
        reading.seen = reading.seen.saturating_add(bytes);
        reading.seen > reading.refused.limit()
    }

    /// Ends the reading (the body ended, failed, or outgrew the count): asks what a retry of
    /// the whole body would get, against a state that still holds what passed of it.
    pub(crate) fn read_all(&mut self) -> Option<Asking> {
        let Reading { refused, seen } = self.reading.take()?;
        let whole = u32::try_from(seen).unwrap_or(u32::MAX);
        match self
            .ledger
            .peek(&self.key, &self.flow.responder.policy, whole)
        {
            Stepping::Now(peek) => {
                self.cut_by(refused, peek);
                None
            }
            Stepping::Later(future) => Some(Asking {
                units: whole,
                held: 0,
                refused: Some(refused),
                future,
            }),
        }
    }

    /// A step the store could not decide, under the layer's failure mode.
    fn failed(&mut self, units: u32, held: u64, error: &StoreError) -> Option<Asking> {
        let responder = Arc::clone(&self.flow.responder);
        Report::store_error(&responder.policy);
        tracing::warn!(
            target: "tower_redis_ratelimit",
            policy = responder.policy.name(),
            key = %self.key.loggable(),
            error = %crate::chain::Chain(error),
            "rate-limit store failed deciding a step of a request body"
        );
        let mode = &responder.options.failure_mode;
        match self.credit.failed(units, mode) {
            OnFailure::Pass => None,
            OnFailure::Cut => {
                let _ = self.flow.cut.set(Cut::Unavailable);
                None
            }
            OnFailure::Fallback => {
                let FailureMode::Fallback(local) = mode else {
                    return None;
                };
                // Decided by the local store from now on, which never fails; it settles the
                // refund of what it admitted.
                self.ledger = Arc::new(StoreLedger(local.clone()));
                self.step(held)
            }
        }
    }

    /// Cuts the body after the step refusal `refused`: the layer answers with what a retry
    /// of the body would get (`peek`), or with the refusal itself where that look failed or
    /// would admit.
    fn cut_by(&mut self, refused: Decision, peek: Result<Decision, StoreError>) {
        let answer = match peek {
            Ok(peek) if !peek.is_allowed() => peek,
            _ => refused,
        };
        let responder = &self.flow.responder;
        responder
            .options
            .tally(&responder.policy, &self.key, Tally::Denied);
        let exceeded = QuotaExceeded::new(
            responder.policy.name(),
            self.credit.passed(),
            answer.retry_after(),
            answer.limit(),
            answer.window(),
        );
        let _ = self.flow.cut.set(Cut::Quota(answer, exceeded));
    }

    /// Settles the credit, once: at the body's end, or when it is dropped. The unused part is
    /// refunded; what passed uncounted (a soft or shadow limit's refused steps, a store
    /// failure under `FailureMode::Open`) is charged, as a response's is.
    pub(crate) fn refund(&mut self) {
        let unrecorded = self.credit.unrecorded();
        for settlement in self
            .credit
            .unused()
            .into_iter()
            .chain([unrecorded])
            .flatten()
        {
            let (key, responder) = (self.key.clone(), Arc::clone(&self.flow.responder));
            let posting = Posting::new(key, responder, settlement, self.deny_cache.clone());
            self.ledger.settle(posting, &self.in_flight);
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.refund();
    }
}
