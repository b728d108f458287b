//! [`Deciding`]: a decision the store makes later, and a request's wait for a concurrency
//! slot, polled to the request's [`Verdict`].

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use pin_project_lite::pin_project;

use super::query::Query;
use super::verdict::Verdict;
use super::wait::{Next, Waiting};
use crate::ledger::queue::Wait;
use crate::{Decision, StoreError};

pin_project! {
    /// Where a decision stands: asked of the store, or (refused for a concurrency slot, with
    /// `max_wait`) waiting to ask again.
    #[project = StateProj]
    pub(crate) enum State<F> {
        Asking {
            #[pin]
            decision: F,
        },
        // Boxed, so that the wait does not make every request's future larger.
        Waiting {
            wait: Pin<Box<Wait>>,
        },
    }
}

/// What admission hands on when the decision is not in yet: the step it is at, what it is
/// about, and how the request may wait for a slot.
pub(crate) struct Later<F> {
    pub(crate) step: State<F>,
    pub(crate) query: Query,
    pub(crate) waiting: Option<Waiting<F>>,
}

impl<F> Later<F> {
    /// The store is asked: `decision` answers.
    pub(crate) fn asking(decision: F, query: Query, waiting: Option<Waiting<F>>) -> Self {
        Later {
            step: State::Asking { decision },
            query,
            waiting,
        }
    }
}

pin_project! {
    /// A decision under way, carrying `call` (what to do once admitted) until its verdict.
    pub(crate) struct Deciding<F, T> {
        #[pin]
        step: State<F>,
        // Boxed: a request is large, and only a store that waits (or a request waiting for a
        // slot) gets here; the futures of requests decided at once stay small to move.
        carried: Box<Carried<F, T>>,
    }
}

struct Carried<F, T> {
    query: Query,
    waiting: Option<Waiting<F>>,
    call: Option<T>,
}

impl<F, T> Deciding<F, T> {
    pub(crate) fn new(later: Later<F>, call: T) -> Self {
        Deciding {
            step: later.step,
            carried: Box::new(Carried {
                query: later.query,
                waiting: later.waiting,
                call: Some(call),
            }),
        }
    }
}

impl<F, T> Deciding<F, T>
where
    F: Future<Output = Result<Decision, StoreError>>,
{
    /// The verdict, with the call it carried; `None` once they were handed out.
    pub(crate) fn poll_verdict(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<(Verdict, T)>> {
        let mut this = self.project();
        let carried = &mut **this.carried;
        let outcome = loop {
            // `unanswered`: the store's answer never came, though the request may stand in its
            // queue (an outage's refusal at this layer's cap replaces the error).
            let (outcome, may_wait, unanswered) = match this.step.as_mut().project() {
                StateProj::Waiting { wait } => {
                    ready!(wait.as_mut().poll(cx));
                    // Only a request that may wait waits; were it not so, it is decided as a
                    // store that failed to answer.
                    let Some(waiting) = carried.waiting.as_mut() else {
                        break Err(StoreError::Unavailable);
                    };
                    match waiting.after_wait(&carried.query) {
                        Next::Wait(next) => {
                            wait.set(next);
                            continue;
                        }
                        Next::Recheck(decision) => {
                            this.step.set(State::Asking { decision });
                            continue;
                        }
                        Next::GiveUp(refusal) => (Ok(refusal), false, false),
                    }
                }
                StateProj::Asking { decision } => {
                    let outcome = ready!(decision.poll(cx));
                    let unanswered = outcome.is_err();
                    (carried.query.at_cap_alone(outcome), true, unanswered)
                }
            };
            let waiting = carried.waiting.as_mut().filter(|_| may_wait);
            match waiting.and_then(|w| w.wait_for_slot(&carried.query, &outcome, unanswered)) {
                Some(wait) => this.step.set(State::Waiting {
                    wait: Box::pin(wait),
                }),
                None => break outcome,
            }
        };
        let verdict = carried.query.verdict(outcome);
        Poll::Ready(carried.call.take().map(|call| (verdict, call)))
    }
}
