//! What an outbound request fails with.

use std::time::Duration;

use crate::{KeyError, StoreError};

/// Why an outbound request did not go out, or what the service it went to answered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError<E> {
    /// Its turn would come later than the layer's `max_wait`: when, if a turn is possible
    /// (`None`: the request costs more than a limit allows).
    #[error("the request's turn would come too late ({turn:?} from now)")]
    TooLate {
        /// How long from now its turn would have come.
        turn: Option<Duration>,
    },
    /// The store is too far for the layer's `max_margin`: the round trip to it (as measured
    /// within the last second) is so long that a request cannot know it leaves within the
    /// margin of its turn. Widen `max_margin` (and with it every window) or bring the store
    /// closer.
    #[error("the store's round trip ({round_trip:?}) needs more margin than the layer's max_margin ({max_margin:?})")]
    TooFar {
        /// The round trip measured.
        round_trip: Duration,
        /// The widest margin the layer may use.
        max_margin: Duration,
    },
    /// The request has no key.
    #[error("the request has no key: {0}")]
    Key(KeyError),
    /// The store could not reserve.
    #[error("the store could not reserve: {0}")]
    Store(StoreError),
    /// The inner service failed.
    #[error("the inner service failed")]
    Inner(#[source] E),
}
