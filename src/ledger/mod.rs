//! After the response: what an admitted request owes the store, settled when its response
//! body ends, fails or is dropped, never holding the response up.
//!
//! A request carries one [`Receipt`] in its response body: its usage [`Tab`](tab::Tab), when
//! the layer limits by [usage](crate::usage), and its concurrency [`Slot`](slots::Slot), when
//! the policy has a concurrency limit. Both post to the store through [`post`], the machinery
//! below them: neither imports the other.
//!
//! A request counted by outcome settles its tab as soon as the response head is in. A
//! response metered as it streams decides a step through its tab whenever a data frame
//! outgrows its credit ([`stream`]), and is cut when one is refused.
//!
//! ```text
//! body ends ─► Receipt dropped ─┬─► Tab: charge or refund ─┐
//!                               └─► Slot: give-back ───────┴─► Ledger ─► Store::settle_then
//! ```

use std::task::{Context, Poll};

use http::{HeaderMap, Response};

pub(crate) mod post;
pub(crate) mod queue;
pub(crate) mod slots;
pub(crate) mod steps;
pub(crate) mod stream;
pub(crate) mod tab;

use slots::Slot;
use stream::Gate;
use tab::Tab;

/// What an admitted request owes the store once its response is done: dropping it settles
/// its usage and gives its concurrency slot back.
#[derive(Default)]
pub(crate) struct Receipt {
    // Dropped in this order: the slot first, so that a request waiting for it is woken as
    // soon as the response is done; then the usage.
    pub(crate) slot: Option<Slot>,
    pub(crate) tab: Option<Box<Tab>>,
}

impl Receipt {
    /// Whether the request owes nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.tab.is_none() && self.slot.is_none()
    }

    /// Reads the usage a response's head reports, and whether a layer inside refused it; a
    /// request counted by outcome is settled there and then.
    pub(crate) fn read_head<B>(&mut self, response: &Response<B>) {
        if let Some(tab) = &mut self.tab {
            tab.read_head(response);
            if tab.settles_at_head() {
                self.tab = None;
            }
        }
    }

    /// Reads the usage a response's trailers report.
    pub(crate) fn read_trailers(&mut self, trailers: &HeaderMap) {
        if let Some(tab) = &mut self.tab {
            tab.read_trailers(trailers);
        }
    }

    /// Whether the response's data frames go through [`frame`](Self::frame): it is metered as
    /// it streams ([`UsageReport::step`]), or its bytes are its usage.
    ///
    /// [`UsageReport::step`]: crate::usage::UsageReport::step
    pub(crate) fn metered(&self) -> bool {
        self.tab.as_ref().is_some_and(|tab| tab.metered())
    }

    /// Whether the response may be cut short: it is metered as it streams.
    pub(crate) fn may_cut(&self) -> bool {
        self.tab.as_ref().is_some_and(|tab| tab.may_cut())
    }

    /// A data frame of `len` bytes came: whether it passes; `Pending` while a step for it is
    /// decided (then [`gate`](Self::gate) says).
    pub(crate) fn frame(&mut self, len: usize, cx: &mut Context<'_>) -> Poll<Gate> {
        match &mut self.tab {
            Some(tab) => tab.frame(len, cx),
            None => Poll::Ready(Gate::Pass),
        }
    }

    /// Whether the frame held for a step passes, once the step is decided.
    pub(crate) fn gate(&mut self, cx: &mut Context<'_>) -> Poll<Gate> {
        match &mut self.tab {
            Some(tab) => tab.gate(cx),
            None => Poll::Ready(Gate::Pass),
        }
    }

    /// The response's last frame passed.
    pub(crate) fn ended(&mut self) {
        if let Some(tab) = &mut self.tab {
            tab.ended();
        }
    }
}
