//! What an outbound request fails with.

use std::time::Duration;

use crate::{KeyError, StoreError};

/// Why an outbound request did not go out, or what the service it went to answered.
///
/// Like every error of this crate, its message says what failed and its cause is its
/// [`source`](std::error::Error::source), never repeated in the message: print the chain to
/// see both. An upstream's refusal (a `429`, a gRPC `RESOURCE_EXHAUSTED`) is no error here: it
/// is the inner service's answer, returned as it came (after pausing the key).
///
/// ```
/// use std::error::Error;
/// use tower_redis_ratelimit::client::OutboundError;
/// use tower_redis_ratelimit::KeyError;
///
/// /// The error and its causes on one line.
/// fn chain(error: &dyn Error) -> String {
///     let mut text = error.to_string();
///     let mut cause = error.source();
///     while let Some(error) = cause {
///         text = format!("{text}: {error}");
///         cause = error.source();
///     }
///     text
/// }
///
/// let failed: OutboundError<std::io::Error> =
///     OutboundError::Inner(std::io::Error::other("connection reset"));
/// assert_eq!(failed.to_string(), "the inner service failed");
/// assert_eq!(chain(&failed), "the inner service failed: connection reset");
///
/// let no_key: OutboundError<std::io::Error> = OutboundError::Key(KeyError::NotFound);
/// assert_eq!(chain(&no_key), "the request has no key: the key extractor found no key");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboundError<E> {
    /// Its turn would come later than the layer's `max_wait`: when, if the store said (`None`:
    /// the request costs more than a limit allows, or it reserved again, after a turn it could
    /// not keep, until nothing was left of its wait).
    #[error("{}", too_late(turn))]
    TooLate {
        /// How long from now its turn would have come.
        turn: Option<Duration>,
    },
    /// The store is too far for the layer's `max_margin`: the round trip to it (the shortest
    /// measured within the last 30 s) is so long that a request cannot know it leaves within the
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
    #[error("the request has no key")]
    Key(#[source] KeyError),
    /// The store could not reserve.
    #[error("the store could not reserve")]
    Store(#[source] StoreError),
    /// The inner service failed.
    #[error("the inner service failed")]
    Inner(#[source] E),
}

impl OutboundError<std::convert::Infallible> {
    /// An error of a wait for a turn as an error of a call whose inner service fails with `E`.
    pub(super) fn widen<E>(self) -> OutboundError<E> {
        match self {
            OutboundError::TooLate { turn } => OutboundError::TooLate { turn },
            OutboundError::TooFar {
                round_trip,
                max_margin,
            } => OutboundError::TooFar {
                round_trip,
                max_margin,
            },
            OutboundError::Key(error) => OutboundError::Key(error),
            OutboundError::Store(error) => OutboundError::Store(error),
            OutboundError::Inner(never) => match never {},
        }
    }
}

/// `TooLate`'s message: when its turn would have come, or that none can.
fn too_late(turn: &Option<Duration>) -> String {
    match turn {
        Some(turn) => {
            format!("the request's turn would come too late, in {turn:?} (past max_wait)")
        }
        None => "the request has no turn within max_wait (or none at all: it costs more than a \
                 limit allows)"
            .to_owned(),
    }
}
