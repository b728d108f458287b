//! What a store decided for one request.

use std::time::Duration;

/// The answer of a [`Store`](crate::Store) for one request.
///
/// It describes one limit of the policy: the limit that refused the request, or, when the
/// request was admitted, the limit with the fewest units left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub(crate) allowed: bool,
    pub(crate) limit_index: usize,
    pub(crate) limit: u64,
    pub(crate) window: Duration,
    pub(crate) remaining: u64,
    pub(crate) reset_after: Duration,
    pub(crate) retry_after: Option<Duration>,
}

impl Decision {
    /// Whether the request was admitted (and recorded).
    pub fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// The index, in [`Policy::limits`](crate::Policy::limits), of the limit described.
    pub fn limit_index(&self) -> usize {
        self.limit_index
    }

    /// The count of the limit described.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window of the limit described.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Units left in the described limit's current window, after this request.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Time until the described limit's remaining count next grows (its oldest counted event
    /// leaves the window).
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// When denied: the time after which the same request would be admitted, if nothing else
    /// is admitted in between. `None` when admitted, and when the request's cost exceeds the
    /// limit itself, so that no wait would help.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    pub(crate) fn from_outcome(
        outcome: crate::algorithm::Outcome,
        policy: &crate::Policy,
    ) -> Decision {
        let limit = policy.limits()[outcome.index.min(policy.limits().len() - 1)];
        Decision {
            allowed: outcome.allowed,
            limit_index: outcome.index,
            limit: limit.count(),
            window: limit.window(),
            remaining: outcome.remaining,
            reset_after: Duration::from_micros(outcome.reset_after),
            retry_after: outcome.retry_after.map(Duration::from_micros),
        }
    }
}
