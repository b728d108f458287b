//! Before the inner service is called: which policy applies to a request, its key, and the
//! store's decision, turned into what the service does with the request.
//!
//! ```text
//! request ─► gate.rs: rule ─► key ─► allow list ─► deny cache ─► store
//!                                                                  │ decided at once, or later
//!                                                                  ▼ (decide.rs, wait.rs)
//!                      verdict.rs: admitted │ passed over │ slots full │ refused │ store failed
//! ```
//!
//! Under `FailureMode::Fallback`, `seen.rs` notes which keys the store refused or spent, so
//! that the fallback store, which has seen nothing, does not free them during an outage.
//!
//! Nothing here knows tower: the gate takes a plain `http::Request` and a [`Limiter`], and
//! answers an [`Admission`], which `service.rs` turns into a call of the inner service or an
//! answer of the layer's own, and `future.rs` polls when the decision comes later.

use bytes::Bytes;
use http::Response;
use http_body_util::Full;

mod allow;
mod decide;
mod limiter;
mod query;
mod seen;
mod verdict;
mod wait;

pub(crate) use allow::AllowList;
pub(crate) use decide::{Deciding, Later};
pub(crate) use limiter::{CostFn, Limiter};
pub(crate) use seen::{Seen, CAPACITY as SEEN_CAPACITY};
pub(crate) use verdict::{Admitted, Verdict};

/// What admission answered for a request.
// Returned and matched at once, never kept: boxing the larger variant would cost an
// allocation for nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Admission<F> {
    /// Not limited here (no policy applies): call the inner service as it is.
    Pass,
    /// Answer without calling the inner service.
    Answer(Response<Full<Bytes>>),
    /// Call the inner service: admitted, passed on over a soft or shadow limit, or passed on
    /// without a decision (allow-listed, no key, the store failed and the layer fails open).
    Call(Admitted),
    /// The decision is not in yet: the store decides later, or the request waits for a slot.
    Later(Later<F>),
}

impl<F> From<Verdict> for Admission<F> {
    fn from(verdict: Verdict) -> Self {
        match verdict {
            Verdict::Call(admitted) => Admission::Call(admitted),
            Verdict::Answer(response) => Admission::Answer(response),
        }
    }
}
