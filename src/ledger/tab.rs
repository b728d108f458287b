//! The usage tab of one admitted request: what it reserved, and what its response reports
//! (see [`usage`](crate::usage)); dropped when the response body ends (when its head is in,
//! for a request counted by outcome), it posts the difference to the store as a charge or a
//! refund.

use std::sync::Arc;

use http::{HeaderMap, Response};

use super::post::{InFlight, Ledger, Posting};
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

impl Drop for Tab {
    fn drop(&mut self) {
        let used = match (self.refused, &self.metering.report.outcome) {
            (true, _) => Some(0),
            // Counted by outcome: the head's verdict alone; when the head never came (the
            // client went away, the service failed), the attempt keeps the unit it holds.
            (false, Some(_)) => self.from_head,
            (false, None) => self
                .from_trailers
                .or_else(|| self.meter.get())
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
        let Some(settlement) = settlement.filter(|s| s.units() > 0 || s.attempt() != 0) else {
            return;
        };
        let deny_cache = match settlement.is_refund() && settlement.units() > 0 {
            true => self.deny_cache.clone(),
            false => None,
        };
        let (key, responder) = (self.key.clone(), Arc::clone(&self.responder));
        let entry = Posting::new(key, responder, settlement, deny_cache);
        let ledger = self.fallback.as_ref().unwrap_or(&self.metering.ledger);
        ledger.settle(entry, &self.metering.in_flight);
    }
}
