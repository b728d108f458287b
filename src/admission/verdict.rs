//! [`Verdict`]: what the layer does with a request once its decision is in (made by
//! [`Query::verdict`](super::query::Query::verdict)), and [`Admitted`], what an admitted
//! request's response gets.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;

use crate::decisions::Mark;
use crate::ledger::Receipt;
use crate::metered::{Flow, Meter};
use crate::response::Responder;
use crate::{Decision, Undecided};

/// What to do with a request once its decision is in.
// Matched as soon as it is made, and never kept: boxing the larger variant would cost every
// admitted request an allocation to save a copy of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Verdict {
    /// Call the inner service, with what its response gets.
    Call(Admitted),
    /// Answer with the layer's own response (a refusal, or the store failed in closed mode).
    Answer(Response<Full<Bytes>>),
}

/// What an admitted request's response gets: the rate-limit fields (unless hidden, or the store
/// failed), and what the request owes the store once its response is done; the layer's entry
/// goes into the request's [`Decisions`](crate::Decisions). Nothing of these by default.
#[derive(Default)]
pub(crate) struct Admitted {
    pub(crate) fields: Option<(Decision, Arc<Responder>)>,
    pub(crate) receipt: Receipt,
    /// The layer's entry for the request's decisions: its decision, or why there was none.
    pub(crate) entry: Option<(Arc<Responder>, Mark)>,
    /// The metering of the request's body, when the layer meters them: handed to the body.
    pub(crate) meter: Option<Meter>,
    /// What the meter shares with the response future: whether the body was cut.
    pub(crate) flow: Option<Arc<Flow>>,
}

impl Admitted {
    /// A request passed on without a decision of the store, for the reason `why`.
    pub(crate) fn undecided(responder: Arc<Responder>, why: Undecided) -> Self {
        Admitted {
            entry: Some((responder, Mark::Undecided(why))),
            ..Admitted::default()
        }
    }

    /// Adds the layer's entry to the request's decisions, inside those of outer layers.
    pub(crate) fn mark<B>(&mut self, request: &mut Request<B>) {
        if let Some((responder, entry)) = self.entry.take() {
            responder.mark(request, entry);
        }
    }
}
