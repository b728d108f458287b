//! The usage tab of one admitted request: what it reserved, and what its response reports
//! (see [`usage`](crate::usage)); dropped when the response body ends (when its head is in,
//! for a request counted by outcome), it posts the difference to the store as a charge or a
//! refund. A response metered as it streams ([`UsageReport::step`]) decides its steps through
//! its tab's [`Stream`] while it runs, and settles what it sent.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderMap, Response};

use super::post::{InFlight, Ledger, Posting};
use super::stream::{About, Gate, Stream};
use crate::deny_cache::DenyCache;
use crate::response::{Refused, Responder};
use crate::rules::ResponseHead;
use crate::usage::{Usage, UsageMeter, UsageReport};
use crate::{Decision, Key, Settlement};

/// What the layer needs to settle usage: how it is reported, the store to settle with, and
/// the settles under way.
pub(crate) struct Metering {
    pub(crate) report: UsageReport,
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) in_flight: Arc<InFlight>,
}

/// The account of one admitted request: what it reserved, and what it reported so far.
/// Dropping it settles (see the module's docs).
pub(crate) struct Tab {
    metering: Arc<Metering>,
    /// The store that admitted the request, where it is not the layer's own (the fallback).
    fallback: Option<Arc<dyn Ledger>>,
    key: Key,
    responder: Arc<Responder>,
    decision: Decision,
    /// The request's cost: what it is counted when its outcome matches.
    cost: u32,
    meter: UsageMeter,
    /// Usage reported by the head (extension or field), then by the trailers.
    from_head: Option<u64>,
    from_trailers: Option<u64>,
    /// Whether a layer inside this one answered the request itself ([`Refused`]): it used
    /// nothing here, whatever else reports.
    refused: bool,
    /// The layer's deny cache, whose refusal of the key a refund makes stale.
    deny_cache: Option<DenyCache>,
    /// The metering of the response as it streams, with [`UsageReport::step`]: `None` for a
    /// response settled at its end, or answered by a layer inside.
    stream: Option<Stream>,
    /// The data bytes the response sent, when its usage is its bytes
    /// ([`UsageReport::bytes`]) settled at its end.
    bytes: Option<u64>,
}

impl Tab {
    /// A tab for a request `decision` admitted, settled through `fallback` if given, else
    /// through the layer's store.
    pub(crate) fn open(
        metering: Arc<Metering>,
        fallback: Option<Arc<dyn Ledger>>,
        (key, responder): (Key, Arc<Responder>),
        (decision, cost): (Decision, u32),
        meter: UsageMeter,
        deny_cache: Option<DenyCache>,
    ) -> Box<Tab> {
        let report = &metering.report;
        let stream = match (report.step, &report.outcome) {
            (Some(step), None) if decision.is_allowed() => {
                Some(Stream::new(step, report.bytes, decision))
            }
            _ => None,
        };
        let bytes = (report.bytes && stream.is_none()).then_some(0);
        Box::new(Tab {
            metering,
            fallback,
            key,
            responder,
            decision,
            cost,
            meter,
            from_head: None,
            from_trailers: None,
            refused: false,
            deny_cache,
            stream,
            bytes,
        })
    }

    /// Whether the tab is settled as soon as the response head is in: counted by outcome,
    /// the head says all there is.
    pub(crate) fn settles_at_head(&self) -> bool {
        self.metering.report.outcome.is_some()
    }

    /// Reads the usage a response's head reports, and whether a layer inside refused it.
    pub(crate) fn read_head<B>(&mut self, response: &Response<B>) {
        let extensions = response.extensions();
        self.refused = extensions.get::<Refused>().is_some();
        if self.refused {
            // A layer inside answered: its body is not the service's, and is not metered.
            (self.stream, self.bytes) = (None, None);
        }
        if let Some(stream) = &mut self.stream {
            stream.grpc = crate::response::grpc_content_type(response.headers()).is_some();
        }
        if let Some(outcome) = &self.metering.report.outcome {
            let counts = outcome(&ResponseHead::of(response));
            self.from_head = Some(if counts { u64::from(self.cost) } else { 0 });
            return;
        }
        self.from_head = match extensions.get::<Usage>() {
            Some(Usage(units)) => Some(*units),
            None => self
                .metering
                .report
                .head
                .as_ref()
                .and_then(|read| read(response.headers())),
        };
    }

    /// Reads the usage a response's trailers report.
    pub(crate) fn read_trailers(&mut self, trailers: &HeaderMap) {
        if self.metering.report.outcome.is_some() {
            return;
        }
        if let Some(read) = &self.metering.report.trailers {
            self.from_trailers = read(trailers).or(self.from_trailers);
        }
    }
}

impl Tab {
    /// Whether the response's data frames go through [`frame`](Self::frame): it is metered
    /// as it streams, or its bytes are counted.
    pub(crate) fn metered(&self) -> bool {
        self.stream.is_some() || self.bytes.is_some()
    }

    /// Whether the response may be cut: it is metered as it streams.
    pub(crate) fn may_cut(&self) -> bool {
        self.stream.is_some()
    }

    /// A data frame of `len` bytes came: whether it passes, cutting the response when its
    /// step is refused; `Pending` while its step is decided (then [`gate`](Self::gate) says,
    /// the frame held meanwhile).
    pub(crate) fn frame(&mut self, len: usize, cx: &mut Context<'_>) -> Poll<Gate> {
        if let Some(bytes) = &mut self.bytes {
            *bytes = bytes.saturating_add(len as u64);
        }
        let meter = self.meter.get();
        let Some((stream, about)) = self.stream() else {
            return Poll::Ready(Gate::Pass);
        };
        stream.frame(len, meter, &about);
        stream.poll(cx, &about)
    }

    /// Whether the frame held for a step passes, once the step is decided.
    pub(crate) fn gate(&mut self, cx: &mut Context<'_>) -> Poll<Gate> {
        match self.stream() {
            Some((stream, about)) => stream.poll(cx, &about),
            None => Poll::Ready(Gate::Pass),
        }
    }

    /// The response's stream, when it is metered as it goes, and what deciding its steps
    /// needs: the key, the policy, and the ledger of the store that admitted the request.
    fn stream(&mut self) -> Option<(&mut Stream, About<'_>)> {
        let about = About {
            key: &self.key,
            responder: &self.responder,
            ledger: self.fallback.as_ref().unwrap_or(&self.metering.ledger),
            cut: &self.metering.report.cut,
        };
        Some((self.stream.as_mut()?, about))
    }

    /// The response's last frame passed: what the meter says by now counts.
    pub(crate) fn ended(&mut self) {
        if let Some(stream) = &mut self.stream {
            stream.ended = true;
        }
    }

    /// Settles a response metered as it streams: charged what it sent, or what its trailers
    /// or head report when that is more (the meter's final value too, when it ended rather
    /// than was cut or dropped); its unused credit refunded.
    fn settle_stream(&mut self, mut stream: Stream) {
        let reported = self.from_trailers.or(self.from_head);
        let metered = match stream.ended && !stream.waiting() && !self.metering.report.bytes {
            true => self.meter.get(),
            false => None,
        };
        let used = reported.max(metered).unwrap_or(0);
        for (settlement, decider) in stream.settle(used) {
            self.post_to(Some(settlement), decider);
        }
    }
}

impl Drop for Tab {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take() {
            return self.settle_stream(stream);
        }
        let used = match (self.refused, &self.metering.report.outcome) {
            (true, _) => Some(0),
            // Counted by outcome: the head's verdict alone; when the head never came (the
            // client went away, the service failed), the attempt keeps the unit it holds.
            (false, Some(_)) => self.from_head,
            (false, None) => self
                .from_trailers
                .or_else(|| self.bytes.or_else(|| self.meter.get()))
                .or(self.from_head),
        };
        let reserved = self.decision.recorded;
        // An attempt whose outcome counts (or never came) keeps its units: the store is told,
        // so that they count as an outcome, no longer as an attempt in flight.
        if self.decision.attempt != 0 && used.is_none_or(|used| used >= reserved) {
            return self.post(Settlement::counted(&self.decision));
        }
        let Some(used) = used else {
            return;
        };
        let settlement = match used.cmp(&reserved) {
            // Passed on over a soft limit, counted by outcome: it reserved nothing, and is
            // charged when it matches, so that failures past the captcha add up.
            _ if !self.decision.is_allowed() => (used > 0).then(|| Settlement::count(used)),
            std::cmp::Ordering::Greater => Settlement::charge(&self.decision, used - reserved),
            std::cmp::Ordering::Less => Settlement::refund(&self.decision, reserved - used),
            std::cmp::Ordering::Equal => None,
        };
        self.post(settlement);
    }
}

impl Tab {
    /// Posts `settlement` to the ledger of the store that decided the request, unless it
    /// changes nothing.
    fn post(&mut self, settlement: Option<Settlement>) {
        self.post_to(settlement, None);
    }

    /// Posts `settlement` to `ledger`, or, when `None`, to the ledger of the store that
    /// decided the request.
    fn post_to(&mut self, settlement: Option<Settlement>, ledger: Option<Arc<dyn Ledger>>) {
        let Some(settlement) = settlement.filter(|s| s.units() > 0 || s.attempt() != 0) else {
            return;
        };
        let deny_cache = match settlement.is_refund() && settlement.units() > 0 {
            true => self.deny_cache.clone(),
            false => None,
        };
        let (key, responder) = (self.key.clone(), Arc::clone(&self.responder));
        let entry = Posting::new(key, responder, settlement, deny_cache);
        let ledger = ledger.as_ref().or(self.fallback.as_ref());
        let ledger = ledger.unwrap_or(&self.metering.ledger);
        ledger.settle(entry, &self.metering.in_flight);
    }
}
