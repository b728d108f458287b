//! A response metered as it streams ([`UsageReport::step`](crate::usage::UsageReport::step)):
//! each data frame passes on the body's [`Credit`], and a frame the credit does not cover
//! waits for a step, decided through the [`Ledger`] of the store that admitted the request.
//! A refused step cuts the response; what it ends with is the [`Cut`] of the layer's report
//! (for gRPC, `RESOURCE_EXHAUSTED` trailers).
//!
//! The store holds, at every instant, what the response sent and at most one step more: a
//! step is asked only when a frame needs more than is left, and a frame passes whole, so what
//! a response sends never outgrows what its decisions admitted (save units passed uncounted
//! by a soft or shadow policy, or while the store failed under `FailureMode::Open`, which are
//! charged when it ends).

use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;

use super::post::{Ledger, Stepping, StoreLedger};
use super::steps::{Credit, OnFailure};
use crate::metrics::Report;
use crate::response::{FailureMode, Responder};
use crate::usage::{Cut, QuotaExceeded};
use crate::{Decision, Key, Settlement, StoreError};

/// A boxed error, as servers take a body's errors.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which ledger decided a step: the request's own (the layer's store, or the fallback that
/// admitted it), or the local store of [`FailureMode::Fallback`] that decided a step while
/// the store failed.
type Decider = Option<Arc<dyn Ledger>>;

/// What the body does with a data frame.
pub(crate) enum Gate {
    /// The frame passes.
    Pass,
    /// The response is cut: the frame is dropped, and the body ends with this.
    Cut(Finale),
}

/// The last frame of a cut response, or its error.
pub(crate) type Finale = Result<Frame<Bytes>, BoxError>;

/// What the stream needs of its tab to decide a step.
pub(crate) struct About<'a> {
    pub(crate) key: &'a Key,
    pub(crate) responder: &'a Responder,
    pub(crate) ledger: &'a Arc<dyn Ledger>,
    pub(crate) cut: &'a Cut,
}

/// A step asked for a frame held until it is decided.
struct Waiting {
    /// The frame's units.
    units: u64,
    /// The units asked.
    asked: u32,
    /// In a mutex only to keep the response body `Sync` (a boxed store future is not): it is
    /// reached by `get_mut`, never locked.
    stepping: Mutex<Stepping>,
    /// The ledger asked: `Some` for the fallback's local store.
    decider: Decider,
}

/// The metering of one response as it streams.
pub(crate) struct Stream {
    credit: Credit,
    /// Whether the units are the frames' bytes, rather than the meter's growth.
    bytes: bool,
    /// The meter's value when the last frame came.
    seen: u64,
    /// Units the store recorded for the request: its admission's and its admitted steps'.
    recorded: u64,
    /// The last admitted decision (the admission's until a step is), and the ledgers of it and
    /// of the one before it, which the unused credit is refunded to.
    last: Decision,
    deciders: [Decider; 2],
    waiting: Option<Waiting>,
    /// Whether the response is gRPC, cut with trailers.
    pub(crate) grpc: bool,
    /// Whether the response ended (its last frame passed): the meter's final value counts.
    pub(crate) ended: bool,
}

impl Stream {
    /// The metering of a response its admission `first` reserved for, asking steps of `step`.
    pub(crate) fn new(step: u32, bytes: bool, first: Decision) -> Stream {
        Stream {
            credit: Credit::new(step, first),
            bytes,
            seen: 0,
            recorded: if first.is_allowed() {
                first.recorded
            } else {
                0
            },
            last: first,
            deciders: [None, None],
            waiting: None,
            grpc: false,
            ended: false,
        }
    }

    /// The units sent so far.
    pub(crate) fn sent(&self) -> u64 {
        self.credit.passed()
    }

    /// Whether a frame waits for a step: its units are not sent.
    pub(crate) fn waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// A data frame of `len` bytes came, the meter then at `meter`: it passes on the credit,
    /// or waits for a step (then [`poll`](Self::poll) it).
    pub(crate) fn frame(&mut self, len: usize, meter: Option<u64>, about: &About<'_>) {
        let units = match self.bytes {
            true => len as u64,
            false => {
                let now = meter.unwrap_or(0);
                let grown = now.saturating_sub(self.seen);
                self.seen = self.seen.max(now);
                grown
            }
        };
        if units <= self.credit.left() {
            self.credit.cover(units);
            return;
        }
        let asked = self.credit.ask(units - self.credit.left(), true);
        let stepping = about.ledger.step(about.key, &about.responder.policy, asked);
        self.waiting = Some(Waiting {
            units,
            asked,
            stepping: Mutex::new(stepping),
            decider: None,
        });
    }

    /// Whether the frame last given may pass, once its step (if it waits for one) is decided.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>, about: &About<'_>) -> Poll<Gate> {
        loop {
            let Some(waiting) = &mut self.waiting else {
                return Poll::Ready(Gate::Pass);
            };
            let stepping = waiting.stepping.get_mut();
            let outcome = match stepping.unwrap_or_else(PoisonError::into_inner) {
                // Taken once: the waiting step is dropped below.
                Stepping::Now(outcome) => std::mem::replace(outcome, Err(StoreError::Unavailable)),
                Stepping::Later(future) => match future.as_mut().poll(cx) {
                    Poll::Ready(outcome) => outcome,
                    Poll::Pending => return Poll::Pending,
                },
            };
            let Some(waiting) = self.waiting.take() else {
                return Poll::Ready(Gate::Pass);
            };
            match self.decided(waiting, outcome, about) {
                Some(gate) => return Poll::Ready(gate),
                // Asked again, of the fallback's local store.
                None => continue,
            }
        }
    }

    /// What a step's `outcome` means for the frame waiting for it; `None` when it is asked
    /// again (of the fallback's local store).
    fn decided(
        &mut self,
        waiting: Waiting,
        outcome: Result<Decision, StoreError>,
        about: &About<'_>,
    ) -> Option<Gate> {
        let policy = &about.responder.policy;
        let options = &about.responder.options;
        match outcome {
            Ok(d) if d.is_allowed() => {
                self.recorded = self.recorded.saturating_add(d.recorded);
                self.credit.granted(d);
                self.last = d;
                let before = std::mem::replace(&mut self.deciders[0], waiting.decider);
                self.deciders[1] = before;
            }
            Ok(_) if options.soft || options.shadow => {
                tracing::debug!(
                    target: "tower_redis_ratelimit",
                    policy = policy.name(),
                    key = %about.key.loggable(),
                    sent = self.sent(),
                    "a response's step exceeds the limit; passed on (soft limit or shadow mode)"
                );
                // Passed uncounted, and charged when the response ends.
                self.credit.uncounted(waiting.asked);
            }
            Ok(d) => {
                let cut = QuotaExceeded::new(
                    policy.name(),
                    self.sent(),
                    d.retry_after(),
                    d.limit(),
                    d.window(),
                );
                tracing::debug!(
                    target: "tower_redis_ratelimit",
                    policy = policy.name(),
                    key = %about.key.loggable(),
                    sent = self.sent(),
                    "a response's step exceeds the limit; cut"
                );
                return Some(Gate::Cut(self.quota_finale(cut, about.cut)));
            }
            Err(error) => return self.failed(waiting, error, about),
        }
        self.pass(waiting.units)
    }

    /// What a step the store could not decide means, by the layer's failure mode; `None` when
    /// it is asked again, of the fallback's local store.
    fn failed(&mut self, waiting: Waiting, error: StoreError, about: &About<'_>) -> Option<Gate> {
        let policy = &about.responder.policy;
        let options = &about.responder.options;
        Report::store_error(policy);
        tracing::warn!(
            target: "tower_redis_ratelimit",
            policy = policy.name(),
            key = %about.key.loggable(),
            error = %crate::chain::Chain(&error),
            mode = ?options.failure_mode,
            "rate-limit store failed to decide a response's step"
        );
        let local = match &options.failure_mode {
            FailureMode::Fallback(local) if waiting.decider.is_none() => local,
            // The local store failed too: passed, as a failure of the store under
            // `Open`.
            FailureMode::Fallback(_) => {
                self.credit.uncounted(waiting.asked);
                return self.pass(waiting.units);
            }
            mode => {
                return match self.credit.failed(waiting.asked, mode) {
                    OnFailure::Cut => Some(Gate::Cut(self.unavailable(error, about.cut))),
                    OnFailure::Pass | OnFailure::Fallback => self.pass(waiting.units),
                };
            }
        };
        let ledger: Arc<dyn Ledger> = Arc::new(StoreLedger(local.clone()));
        let stepping = ledger.step(about.key, policy, waiting.asked);
        self.waiting = Some(Waiting {
            stepping: Mutex::new(stepping),
            decider: Some(ledger),
            ..waiting
        });
        None
    }

    /// The frame of `units` passes on the credit, which now covers it.
    fn pass(&mut self, units: u64) -> Option<Gate> {
        self.credit.cover(units);
        Some(Gate::Pass)
    }

    /// How a response cut by `quota` ends.
    fn quota_finale(&self, quota: QuotaExceeded, cut: &Cut) -> Finale {
        match (self.grpc, cut) {
            (true, _) => {
                let pushback = quota.retry_after();
                Ok(grpc_trailers(8, &quota.to_string(), pushback))
            }
            (false, Cut::Final(last)) => Ok(Frame::data(last.clone())),
            (false, Cut::Abort) => Err(Box::new(quota)),
        }
    }

    /// How a response is cut when its step could not be decided under
    /// [`FailureMode::Closed`].
    fn unavailable(&self, error: StoreError, cut: &Cut) -> Finale {
        match (self.grpc, cut) {
            (true, _) => Ok(grpc_trailers(14, "rate-limit store unavailable", None)),
            (false, Cut::Final(last)) => Ok(Frame::data(last.clone())),
            (false, Cut::Abort) => Err(Box::new(error)),
        }
    }

    /// What the response owes when it is done, having used `used` units (at least what it
    /// sent): the refunds of its unused credit, each with the ledger of the decision it is
    /// taken from (`None`: the request's own), and the charge of what its decisions did not
    /// record.
    pub(crate) fn settle(&mut self, used: u64) -> Vec<(Settlement, Decider)> {
        let [last, before] = self.credit.unused();
        let mut owed = Vec::with_capacity(3);
        let mut refunded = 0;
        for (refund, decider) in [(last, &self.deciders[0]), (before, &self.deciders[1])] {
            if let Some(refund) = refund {
                refunded += refund.units();
                owed.push((refund, decider.clone()));
            }
        }
        let holds = self.recorded.saturating_sub(refunded);
        let used = used.max(self.sent());
        if let Some(charge) = Settlement::charge(&self.last, used.saturating_sub(holds)) {
            owed.push((charge, self.deciders[0].clone()));
        }
        owed
    }
}

/// The trailers that end a gRPC response with `code` and `message` (printable ASCII without
/// '%', carried as is), and the pushback when a retry may pass.
fn grpc_trailers(code: u8, message: &str, pushback: Option<std::time::Duration>) -> Frame<Bytes> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    if let Ok(message) = HeaderValue::from_str(message) {
        trailers.insert("grpc-message", message);
    }
    if let Some(wait) = pushback {
        let ms = wait.as_micros().div_ceil(1000).max(1) as u64;
        trailers.insert("grpc-retry-pushback-ms", HeaderValue::from(ms));
    }
    Frame::trailers(trailers)
}
